/* Completion events as programs use them, through whatever libibverbs it is run with:
 *  - a CQ armed before its QP exists (rping's order) still raises its event;
 *  - with channel->fd non-blocking, ibv_get_cq_event fails with EAGAIN while nothing is
 *    there, and poll(2) on the descriptor wakes for the next completion;
 *  - a QP whose send and receive CQs are on two channels raises each channel's event.
 * One line per check ("ok ..." or "FAIL ..."); exit 0 if all held. A check that would
 * hang is cut off by alarm(2) (the program dies of SIGALRM).
 *
 *   events DEVICE GID_INDEX
 */
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <unistd.h>

#include "common.h"

static struct ibv_qp *qp_on(struct ibv_pd *pd, struct ibv_cq *send_cq, struct ibv_cq *recv_cq)
{
	struct ibv_qp_init_attr init = {
		.send_cq = send_cq,
		.recv_cq = recv_cq,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 },
		.qp_type = IBV_QPT_RC,
	};
	struct ibv_qp *qp = ibv_create_qp(pd, &init);
	if (!qp)
		die("ibv_create_qp");
	return qp;
}

static void post_recv(struct ibv_qp *qp, struct ibv_mr *mr, uint64_t id)
{
	struct ibv_sge sge = { .addr = (uintptr_t)mr->addr, .length = 64, .lkey = mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = id, .sg_list = &sge, .num_sge = 1 }, *bad;
	if (ibv_post_recv(qp, &wr, &bad))
		die("ibv_post_recv");
}

static void post_send(struct ibv_qp *qp, struct ibv_mr *mr, uint64_t id)
{
	struct ibv_sge sge = { .addr = (uintptr_t)mr->addr + 4096, .length = 8, .lkey = mr->lkey };
	struct ibv_send_wr wr = {
		.wr_id = id, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED,
	}, *bad;
	if (ibv_post_send(qp, &wr, &bad))
		die("ibv_post_send");
}

/* The next event of `channel` is for `cq`; acknowledged, CQ polled empty. */
static int event_for(struct ibv_comp_channel *channel, struct ibv_cq *cq)
{
	struct ibv_cq *got;
	void *ctx;
	alarm(20);
	int rc = ibv_get_cq_event(channel, &got, &ctx);
	alarm(0);
	if (rc || got != cq)
		return 0;
	ibv_ack_cq_events(got, 1);
	struct ibv_wc wc;
	int n = 0;
	while (ibv_poll_cq(cq, 1, &wc) == 1)
		n += wc.status == IBV_WC_SUCCESS;
	return n > 0;
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

	/* Armed before the QP exists. */
	struct ibv_comp_channel *channel = ibv_create_comp_channel(ctx);
	struct ibv_cq *events_cq = channel ? ibv_create_cq(ctx, 64, NULL, channel, 0) : NULL;
	if (!events_cq)
		die("ibv_create_cq with a channel");
	check(ibv_req_notify_cq(events_cq, 0) == 0, "ibv_req_notify_cq before any QP");
	struct ibv_cq *plain_cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	struct ibv_qp *a = qp_on(pd, plain_cq, plain_cq), *b = qp_on(pd, events_cq, events_cq);
	connect_to(a, b, &gid, gid_index);
	connect_to(b, a, &gid, gid_index);
	post_recv(b, mr, 1);
	post_send(a, mr, 2);
	check(event_for(channel, events_cq), "the event of a CQ armed before its QP existed");

	/* Non-blocking. */
	int flags = fcntl(channel->fd, F_GETFL);
	check(fcntl(channel->fd, F_SETFL, flags | O_NONBLOCK) == 0, "O_NONBLOCK on channel->fd");
	check(ibv_req_notify_cq(events_cq, 0) == 0, "re-armed");
	struct ibv_cq *got;
	void *cq_ctx;
	errno = 0;
	check(ibv_get_cq_event(channel, &got, &cq_ctx) == -1 && errno == EAGAIN,
	      "nothing there: EAGAIN at once");
	post_recv(b, mr, 3);
	post_send(a, mr, 4);
	struct pollfd pfd = { .fd = channel->fd, .events = POLLIN };
	check(poll(&pfd, 1, 20000) == 1 && (pfd.revents & POLLIN), "poll(2) wakes for the next completion");
	check(ibv_get_cq_event(channel, &got, &cq_ctx) == 0 && got == events_cq, "and the event is there");
	ibv_ack_cq_events(got, 1);
	struct ibv_wc wc;
	while (ibv_poll_cq(events_cq, 1, &wc) == 1)
		;
	while (ibv_poll_cq(plain_cq, 1, &wc) == 1)
		;

	/* Send and receive CQs on two channels. */
	struct ibv_comp_channel *send_channel = ibv_create_comp_channel(ctx);
	struct ibv_comp_channel *recv_channel = ibv_create_comp_channel(ctx);
	struct ibv_cq *send_cq = send_channel ? ibv_create_cq(ctx, 64, NULL, send_channel, 0) : NULL;
	struct ibv_cq *recv_cq = recv_channel ? ibv_create_cq(ctx, 64, NULL, recv_channel, 0) : NULL;
	if (!send_cq || !recv_cq)
		die("ibv_create_cq on two channels");
	struct ibv_qp *c = qp_on(pd, send_cq, recv_cq), *d = qp_on(pd, plain_cq, plain_cq);
	connect_to(c, d, &gid, gid_index);
	connect_to(d, c, &gid, gid_index);
	check(ibv_req_notify_cq(send_cq, 0) == 0 && ibv_req_notify_cq(recv_cq, 0) == 0, "both armed");
	post_recv(c, mr, 5);
	post_recv(d, mr, 6);
	post_send(d, mr, 7);
	/* The receive's event, its completion left in the CQ for now. */
	alarm(20);
	check(ibv_get_cq_event(recv_channel, &got, &cq_ctx) == 0 && got == recv_cq,
	      "a receive raises the receive CQ's channel's event");
	alarm(0);
	ibv_ack_cq_events(got, 1);
	int send_flags = fcntl(send_channel->fd, F_GETFL);
	fcntl(send_channel->fd, F_SETFL, send_flags | O_NONBLOCK);
	errno = 0;
	check(ibv_get_cq_event(send_channel, &got, &cq_ctx) == -1 && errno == EAGAIN,
	      "and not the send CQ's");
	fcntl(send_channel->fd, F_SETFL, send_flags);
	check(ibv_poll_cq(recv_cq, 1, &wc) == 1 && wc.status == IBV_WC_SUCCESS && wc.wr_id == 5,
	      "the receive is the receive CQ's");
	post_send(c, mr, 8);
	check(event_for(send_channel, send_cq), "a send raises the send CQ's channel's event");

	if (ibv_destroy_qp(a) || ibv_destroy_qp(b) || ibv_destroy_qp(c) || ibv_destroy_qp(d) ||
	    ibv_destroy_cq(events_cq) || ibv_destroy_cq(plain_cq) || ibv_destroy_cq(send_cq) ||
	    ibv_destroy_cq(recv_cq) || ibv_destroy_comp_channel(channel) ||
	    ibv_destroy_comp_channel(send_channel) || ibv_destroy_comp_channel(recv_channel) ||
	    ibv_dereg_mr(mr) || ibv_dealloc_pd(pd) || ibv_close_device(ctx))
		die("teardown");
	ibv_free_device_list(list);
	return failures ? 1 : 0;
}
