/* Moving a queue pair to the error state flushes what it holds, through whatever
 * libibverbs it is run with: receives posted to a connected QP, and receives posted in
 * INIT before it was ever connected, complete with IBV_WC_WR_FLUSH_ERR, and so does a send
 * posted to a QP in the error state. One line per check ("ok ..." or "FAIL ..."); exit 0 if all held.
 *
 *   qp_error DEVICE GID_INDEX
 */
#include <stdint.h>

#include "common.h"

/* Posts `n` receives of 64 bytes of `mr` to `qp`, wr_id 100, 101, ... */
static void post_receives(struct ibv_qp *qp, struct ibv_mr *mr, int n)
{
	for (int i = 0; i < n; i++) {
		struct ibv_sge sge = { .addr = (uintptr_t)mr->addr + 64 * i, .length = 64, .lkey = mr->lkey };
		struct ibv_recv_wr wr = { .wr_id = 100 + i, .sg_list = &sge, .num_sge = 1 }, *bad;
		if (ibv_post_recv(qp, &wr, &bad))
			die("ibv_post_recv");
	}
}

/* Whether the next `n` completions of `cq` are flushed receives 100 ... 100 + n - 1. */
static int flushed(struct ibv_cq *cq, int n)
{
	for (int i = 0; i < n; i++) {
		struct ibv_wc wc;
		if (wait_wc(cq, &wc) || wc.status != IBV_WC_WR_FLUSH_ERR || wc.wr_id != (uint64_t)(100 + i))
			return 0;
	}
	return 1;
}

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: %s DEVICE GID_INDEX\n", argv[0]);
		return 2;
	}
	int gid_index = atoi(argv[2]), n;
	struct ibv_device **list = ibv_get_device_list(&n);
	struct ibv_context *ctx = NULL;
	for (int i = 0; list && i < n; i++)
		if (!strcmp(ibv_get_device_name(list[i]), argv[1]))
			ctx = ibv_open_device(list[i]);
	if (!ctx)
		die("ibv_open_device");
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	char *buf = calloc(1, 8192);
	struct ibv_mr *mr = pd ? ibv_reg_mr(pd, buf, 8192, IBV_ACCESS_LOCAL_WRITE) : NULL;
	if (!mr)
		die("ibv_reg_mr");
	union ibv_gid gid;
	if (ibv_query_gid(ctx, 1, gid_index, &gid))
		die("ibv_query_gid");

	/* Connected: one message arrives, the seven receives left are flushed. */
	struct end a = make_end(ctx, pd), b = make_end(ctx, pd);
	connect_to(a.qp, b.qp, &gid, gid_index);
	connect_to(b.qp, a.qp, &gid, gid_index);
	post_receives(b.qp, mr, 8);
	struct ibv_sge sge = { .addr = (uintptr_t)buf + 4096, .length = 16, .lkey = mr->lkey };
	struct ibv_send_wr swr = {
		.wr_id = 1, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED,
	}, *bad_swr;
	struct ibv_wc wc;
	check(ibv_post_send(a.qp, &swr, &bad_swr) == 0 && wait_wc(a.cq, &wc) == 0 && wc.status == IBV_WC_SUCCESS,
	      "a send before the error");
	check(wait_wc(b.cq, &wc) == 0 && wc.status == IBV_WC_SUCCESS && wc.wr_id == 100,
	      "arrives in the first receive");
	struct ibv_qp_attr attr = { .qp_state = IBV_QPS_ERR };
	check(ibv_modify_qp(b.qp, &attr, IBV_QP_STATE) == 0, "ibv_modify_qp to ERR");
	int ok = 1;
	for (int i = 1; i < 8; i++)
		ok &= wait_wc(b.cq, &wc) == 0 && wc.status == IBV_WC_WR_FLUSH_ERR && wc.wr_id == (uint64_t)(100 + i);
	check(ok, "the seven receives left complete flushed, in order");
	struct ibv_qp_init_attr init;
	check(ibv_query_qp(b.qp, &attr, IBV_QP_STATE, &init) == 0 && attr.qp_state == IBV_QPS_ERR,
	      "ibv_query_qp says ERR");
	swr.wr_id = 2;
	check(ibv_post_send(b.qp, &swr, &bad_swr) == 0 && wait_wc(b.cq, &wc) == 0 &&
		      wc.status == IBV_WC_WR_FLUSH_ERR && wc.wr_id == 2,
	      "a send posted to a QP in ERR completes flushed");

	/* Never connected: receives posted in INIT are flushed too. */
	struct end c = make_end(ctx, pd);
	attr = (struct ibv_qp_attr){ .qp_state = IBV_QPS_INIT, .port_num = 1 };
	if (ibv_modify_qp(c.qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		die("ibv_modify_qp INIT");
	post_receives(c.qp, mr, 3);
	attr.qp_state = IBV_QPS_ERR;
	check(ibv_modify_qp(c.qp, &attr, IBV_QP_STATE) == 0 && flushed(c.cq, 3),
	      "receives posted in INIT complete flushed");

	if (ibv_destroy_qp(a.qp) || ibv_destroy_qp(b.qp) || ibv_destroy_qp(c.qp) || ibv_destroy_cq(a.cq) ||
	    ibv_destroy_cq(b.cq) || ibv_destroy_cq(c.cq) || ibv_dereg_mr(mr) || ibv_dealloc_pd(pd) ||
	    ibv_close_device(ctx))
		die("teardown");
	ibv_free_device_list(list);
	return failures ? 1 : 0;
}
