/* What the C test programs share: a QP with a CQ of its own, connecting two QPs of one
 * process to each other, waiting for a completion. Fails the program ("FAIL ...", exit 1)
 * on a verb that should not fail. */
#ifndef RDMAD_TESTS_VERBS_COMMON_H
#define RDMAD_TESTS_VERBS_COMMON_H

#include <errno.h>
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int failures;

/* One line per check: "ok WHAT" or "FAIL WHAT". */
static inline void check(int ok, const char *what)
{
	printf("%s %s\n", ok ? "ok" : "FAIL", what);
	fflush(stdout);
	if (!ok)
		failures++;
}

static inline void die(const char *what)
{
	printf("FAIL %s: %s\n", what, strerror(errno));
	exit(1);
}

struct end {
	struct ibv_cq *cq;
	struct ibv_qp *qp;
};

/* A QP in `pd` with a CQ of its own, RESET. */
static inline struct end make_end(struct ibv_context *ctx, struct ibv_pd *pd)
{
	struct end e;
	e.cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	if (!e.cq)
		die("ibv_create_cq");
	struct ibv_qp_init_attr init = {
		.send_cq = e.cq,
		.recv_cq = e.cq,
		.cap = { .max_send_wr = 32, .max_recv_wr = 32, .max_send_sge = 1, .max_recv_sge = 1 },
		.qp_type = IBV_QPT_RC,
	};
	e.qp = ibv_create_qp(pd, &init);
	if (!e.qp)
		die("ibv_create_qp");
	return e;
}

/* Moves `a` to RTS towards `b` (both on this process's device and port 1). */
static inline void connect_to(struct ibv_qp *a, struct ibv_qp *b, union ibv_gid *gid, int gid_index)
{
	struct ibv_qp_attr attr = {
		.qp_state = IBV_QPS_INIT,
		.port_num = 1,
		.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ,
	};
	if (ibv_modify_qp(a, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		die("ibv_modify_qp INIT");
	memset(&attr, 0, sizeof attr);
	attr.qp_state = IBV_QPS_RTR;
	attr.path_mtu = IBV_MTU_1024;
	attr.dest_qp_num = b->qp_num;
	attr.rq_psn = 7;
	attr.max_dest_rd_atomic = 1;
	attr.min_rnr_timer = 12;
	attr.ah_attr.is_global = 1;
	attr.ah_attr.grh.dgid = *gid;
	attr.ah_attr.grh.sgid_index = gid_index;
	attr.ah_attr.grh.hop_limit = 1;
	attr.ah_attr.port_num = 1;
	if (ibv_modify_qp(a, &attr, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
				    IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		die("ibv_modify_qp RTR");
	memset(&attr, 0, sizeof attr);
	attr.qp_state = IBV_QPS_RTS;
	attr.timeout = 14;
	attr.retry_cnt = 7;
	attr.rnr_retry = 7;
	attr.sq_psn = 7;
	attr.max_rd_atomic = 1;
	if (ibv_modify_qp(a, &attr, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
				    IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
		die("ibv_modify_qp RTS");
}

/* The next completion of `cq` (10 s at most). */
static inline int wait_wc(struct ibv_cq *cq, struct ibv_wc *wc)
{
	time_t end = time(NULL) + 10;
	while (time(NULL) < end) {
		int n = ibv_poll_cq(cq, 1, wc);
		if (n < 0)
			return -1;
		if (n == 1)
			return 0;
	}
	return -1;
}

#endif
