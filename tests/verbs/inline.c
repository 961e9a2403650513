/* Inline sends as programs use them, through whatever libibverbs it is run with: a QP
 * created with max_inline_data sends IBV_SEND_INLINE messages straight from the program's
 * unregistered stack, which it overwrites as soon as ibv_post_send returns; a send queue
 * of 8 with one send in 4 signaled carries 40 of them (each of its slots reused five
 * times), and the receiver checks every message. One line per check ("ok ..." or
 * "FAIL ..."); exit 0 if all held.
 *
 *   inline DEVICE GID_INDEX
 */
#include <stdint.h>
#include <unistd.h>

#include "common.h"

#define DEPTH 8
#define MESSAGES 40
#define SIZE 48

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
	char *buf = calloc(1, 4096);
	struct ibv_mr *mr = pd ? ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE) : NULL;
	if (!mr)
		die("ibv_reg_mr");
	union ibv_gid gid;
	if (ibv_query_gid(ctx, 1, gid_index, &gid))
		die("ibv_query_gid");

	struct ibv_cq *send_cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	struct ibv_qp_init_attr init = {
		.send_cq = send_cq,
		.recv_cq = send_cq,
		.cap = { .max_send_wr = DEPTH, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1,
			 .max_inline_data = 64 },
		.qp_type = IBV_QPT_RC,
	};
	struct ibv_qp *sender = send_cq ? ibv_create_qp(pd, &init) : NULL;
	if (!sender)
		die("ibv_create_qp with max_inline_data 64");
	check(init.cap.max_inline_data >= 64, "max_inline_data granted");
	struct end receiver = make_end(ctx, pd);
	connect_to(sender, receiver.qp, &gid, gid_index);
	connect_to(receiver.qp, sender, &gid, gid_index);

	for (int i = 0; i < 16; i++) {
		struct ibv_sge sge = { .addr = (uintptr_t)buf + 64 * i, .length = 64, .lkey = mr->lkey };
		struct ibv_recv_wr wr = { .wr_id = i, .sg_list = &sge, .num_sge = 1 }, *bad;
		if (ibv_post_recv(receiver.qp, &wr, &bad))
			die("ibv_post_recv");
	}
	int wrong = 0, refused = 0;
	for (int m = 0; m < MESSAGES; m++) {
		char message[SIZE] = { 0 };
		snprintf(message, sizeof message, "inline message %02d from the stack ......", m);
		struct ibv_sge sge = { .addr = (uintptr_t)message, .length = SIZE, .lkey = 0 };
		struct ibv_send_wr wr = {
			.wr_id = m, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
			.send_flags = IBV_SEND_INLINE | (m % 4 == 3 ? IBV_SEND_SIGNALED : 0),
		}, *bad;
		int rc;
		while ((rc = ibv_post_send(sender, &wr, &bad)) == ENOMEM) {
			/* The send queue is full: a signaled completion frees it. */
			struct ibv_wc wc;
			if (wait_wc(send_cq, &wc) || wc.status != IBV_WC_SUCCESS)
				die("a signaled inline send's completion");
			refused++;
		}
		if (rc)
			die("ibv_post_send inline");
		memset(message, 'x', sizeof message);
		struct ibv_wc wc;
		if (wait_wc(receiver.cq, &wc) || wc.status != IBV_WC_SUCCESS || wc.byte_len != SIZE)
			die("the inline message's receive");
		char expected[SIZE] = { 0 };
		snprintf(expected, sizeof expected, "inline message %02d from the stack ......", m);
		if (memcmp(buf + 64 * wc.wr_id, expected, SIZE))
			wrong++;
		struct ibv_sge rsge = { .addr = (uintptr_t)buf + 64 * wc.wr_id, .length = 64, .lkey = mr->lkey };
		struct ibv_recv_wr rwr = { .wr_id = wc.wr_id, .sg_list = &rsge, .num_sge = 1 }, *rbad;
		if (ibv_post_recv(receiver.qp, &rwr, &rbad))
			die("ibv_post_recv again");
	}
	check(wrong == 0, "every message arrived as it was when posted");
	/* Whether the send queue ever filled (`refused`) is the device's business: rxe frees
	 * an unsignaled send's slot once it is sent, mlx5 and rdmad once a later signaled
	 * send's completion is polled. */
	(void)refused;

	if (ibv_destroy_qp(sender) || ibv_destroy_qp(receiver.qp) || ibv_destroy_cq(send_cq) ||
	    ibv_destroy_cq(receiver.cq) || ibv_dereg_mr(mr) || ibv_dealloc_pd(pd) || ibv_close_device(ctx))
		die("teardown");
	ibv_free_device_list(list);
	return failures ? 1 : 0;
}
