/* A verbs program that misbehaves in every way a broken or hostile program can, through
 * whatever libibverbs it is run with: it hands the verbs pointers that are not theirs,
 * posts requests with keys it does not own, and finally scribbles over the library's own
 * memory (its queue pairs' rings) while requests are in flight and exits without cleaning
 * up. Each step prints "ok ..." when the library answered as libibverbs documents (an
 * error value, never a crash), or "FAIL ...". The last line is "scribbled N bytes".
 *
 * Given another program's rkey and address, it also RDMA-WRITEs there through its own
 * queue pairs: the device must refuse (the rkey belongs to another protection domain).
 *
 *   hostile DEVICE GID_INDEX [RKEY ADDR]
 *   hostile DEVICE GID_INDEX victim   registers 4 KiB with remote write and read, prints
 *       "victim RKEY ADDR", waits for a line on stdin, then checks its memory is as it was
 */
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

/* Writes random bytes over every mapping of the library's rings: returns how many. */
static size_t scribble_over_rings(void)
{
	FILE *maps = fopen("/proc/self/maps", "r");
	char line[512];
	size_t total = 0;
	if (!maps)
		return 0;
	while (fgets(line, sizeof line, maps)) {
		unsigned long start, end;
		char perms[5];
		if (!strstr(line, "rdmad-qp-ring"))
			continue;
		if (sscanf(line, "%lx-%lx %4s", &start, &end, perms) != 3 || perms[1] != 'w')
			continue;
		for (unsigned char *p = (unsigned char *)start; p < (unsigned char *)end; p++)
			*p = (unsigned char)rand();
		total += end - start;
	}
	fclose(maps);
	return total;
}

int main(int argc, char **argv)
{
	if (argc != 3 && argc != 4 && argc != 5) {
		fprintf(stderr, "usage: %s DEVICE GID_INDEX [RKEY ADDR | victim]\n", argv[0]);
		return 2;
	}
	int gid_index = atoi(argv[2]);
	srand(getpid());
	int n;
	struct ibv_device **list = ibv_get_device_list(&n);
	if (!list)
		die("ibv_get_device_list");
	struct ibv_device *dev = NULL;
	for (int i = 0; i < n; i++)
		if (!strcmp(ibv_get_device_name(list[i]), argv[1]))
			dev = list[i];
	if (!dev)
		die("no such device");
	struct ibv_context *ctx = ibv_open_device(dev);
	if (!ctx)
		die("ibv_open_device");
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	if (!pd)
		die("ibv_alloc_pd");
	if (argc == 4 && !strcmp(argv[3], "victim")) {
		char *mine = malloc(4096);
		memset(mine, 'v', 4096);
		struct ibv_mr *victim = ibv_reg_mr(pd, mine, 4096,
						   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
		if (!victim)
			die("ibv_reg_mr");
		printf("victim %u %lu\n", victim->rkey, (unsigned long)(uintptr_t)mine);
		fflush(stdout);
		char line[16];
		if (!fgets(line, sizeof line, stdin))
			die("stdin");
		int untouched = 1;
		for (int i = 0; i < 4096; i++)
			untouched &= mine[i] == 'v';
		check(untouched, "the victim's memory is as it was");
		return failures ? 1 : 0;
	}

	/* Pointers that are not the library's: errors, never a crash. Each fake is zeroed
	 * memory of the right size, as a program that confused its objects would pass. */
	static char junk[4096];
	check(ibv_open_device((struct ibv_device *)junk) == NULL, "ibv_open_device of a foreign device");
	check(ibv_alloc_pd((struct ibv_context *)junk) == NULL, "ibv_alloc_pd of a foreign context");
	check(ibv_dealloc_pd((struct ibv_pd *)junk) != 0, "ibv_dealloc_pd of a foreign PD");
	check(ibv_reg_mr((struct ibv_pd *)junk, junk, 64, IBV_ACCESS_LOCAL_WRITE) == NULL,
	      "ibv_reg_mr in a foreign PD");
	check(ibv_reg_mr(pd, (void *)4096, 4096, IBV_ACCESS_LOCAL_WRITE) == NULL,
	      "ibv_reg_mr of unmapped memory");
	check(ibv_dereg_mr((struct ibv_mr *)junk) != 0, "ibv_dereg_mr of a foreign MR");
	check(ibv_create_cq((struct ibv_context *)junk, 8, NULL, NULL, 0) == NULL,
	      "ibv_create_cq of a foreign context");
	check(ibv_destroy_cq((struct ibv_cq *)junk) != 0, "ibv_destroy_cq of a foreign CQ");
	struct ibv_qp_init_attr bad_init = { .qp_type = IBV_QPT_RC };
	bad_init.send_cq = bad_init.recv_cq = (struct ibv_cq *)junk;
	check(ibv_create_qp(pd, &bad_init) == NULL, "ibv_create_qp with a foreign CQ");
	check(ibv_create_qp((struct ibv_pd *)junk, &bad_init) == NULL, "ibv_create_qp in a foreign PD");
	check(ibv_destroy_qp((struct ibv_qp *)junk) != 0, "ibv_destroy_qp of a foreign QP");
	struct ibv_cq *cq_out;
	void *cq_ctx;
	check(ibv_get_cq_event((struct ibv_comp_channel *)junk, &cq_out, &cq_ctx) != 0,
	      "ibv_get_cq_event of a foreign channel");
	check(ibv_destroy_comp_channel((struct ibv_comp_channel *)junk) != 0,
	      "ibv_destroy_comp_channel of a foreign channel");

	/* Keys it does not own. */
	union ibv_gid gid;
	if (ibv_query_gid(ctx, 1, gid_index, &gid))
		die("ibv_query_gid");
	struct end a = make_end(ctx, pd), b = make_end(ctx, pd);
	connect_to(a.qp, b.qp, &gid, gid_index);
	connect_to(b.qp, a.qp, &gid, gid_index);
	char *buf = malloc(8192);
	memset(buf, 0, 8192);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, 8192,
				       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
	if (!mr)
		die("ibv_reg_mr");
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 64, .lkey = mr->lkey ^ 0x5a5a };
	struct ibv_send_wr wr = {
		.wr_id = 1, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED,
	}, *bad_wr = NULL;
	check(ibv_post_send(a.qp, &wr, &bad_wr) == EINVAL && bad_wr == &wr, "a send with a foreign lkey");
	sge.lkey = mr->lkey;
	sge.addr = (uintptr_t)buf + 8190;
	check(ibv_post_send(a.qp, &wr, &bad_wr) == EINVAL, "a send reaching past its MR");
	sge.addr = (uintptr_t)buf;
	wr.opcode = IBV_WR_RDMA_WRITE;
	wr.wr.rdma.remote_addr = (uintptr_t)buf + 4096;
	wr.wr.rdma.rkey = mr->rkey ^ 0x0f00;
	memset(buf, 'x', 64);
	struct ibv_wc wc;
	check(ibv_post_send(a.qp, &wr, &bad_wr) == 0 && wait_wc(a.cq, &wc) == 0 &&
		      wc.status != IBV_WC_SUCCESS,
	      "an RDMA WRITE with a foreign rkey completes in error");
	check(buf[4096] == 0, "and writes nothing");

	/* Another program's rkey, through a connection of its own. */
	if (argc == 5) {
		struct end e = make_end(ctx, pd), f = make_end(ctx, pd);
		connect_to(e.qp, f.qp, &gid, gid_index);
		connect_to(f.qp, e.qp, &gid, gid_index);
		wr.wr.rdma.rkey = (uint32_t)strtoul(argv[3], NULL, 0);
		wr.wr.rdma.remote_addr = strtoull(argv[4], NULL, 0);
		check(ibv_post_send(e.qp, &wr, &bad_wr) == 0 && wait_wc(e.cq, &wc) == 0 &&
			      wc.status == IBV_WC_REM_ACCESS_ERR,
		      "an RDMA WRITE with another program's rkey is a remote access error");
	}

	/* Scribble over the library's rings with requests in flight, then leave. */
	struct end c = make_end(ctx, pd), d = make_end(ctx, pd);
	connect_to(c.qp, d.qp, &gid, gid_index);
	connect_to(d.qp, c.qp, &gid, gid_index);
	struct ibv_recv_wr rwr = { .wr_id = 2, .sg_list = &sge, .num_sge = 1 }, *bad_rwr;
	for (int i = 0; i < 16; i++)
		ibv_post_recv(d.qp, &rwr, &bad_rwr);
	wr.opcode = IBV_WR_SEND;
	for (int i = 0; i < 16; i++)
		ibv_post_send(c.qp, &wr, &bad_wr);
	size_t scribbled = scribble_over_rings();
	printf("scribbled %zu bytes\n", scribbled);
	fflush(stdout);
	/* Whatever the library now makes of its rings is its own business: poll a little. */
	for (int i = 0; i < 1000; i++) {
		ibv_poll_cq(c.cq, 1, &wc);
		ibv_poll_cq(d.cq, 1, &wc);
	}
	_exit(failures ? 1 : 0);
}
