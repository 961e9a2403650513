/*
 * rdma-write.c - the classic verbs walk-through: one-sided RDMA WRITE over an
 * RC queue pair, with a two-sided SEND telling the target that the data is there.
 *
 * Two processes take part, like ibv_rc_pingpong: a server (no SERVERNAME) and
 * a client (SERVERNAME given).  Each side opens an RDMA device, allocates a
 * protection domain, registers a buffer, creates a completion queue and an RC
 * queue pair, and moves the QP through INIT -> RTR -> RTS.  The two sides swap
 * their endpoints (LID, QP number, PSN, GID, buffer address and rkey) as one
 * text line each over a plain TCP connection.  Then, for every iteration:
 *
 *   client: fill its buffer with a pattern that depends on the iteration and
 *           on the byte offset; RDMA WRITE all SIZE bytes into the server's
 *           buffer (remote address + rkey from the exchange); wait for the
 *           write's completion; SEND 4 bytes holding the iteration number.
 *   server: on the receive completion, check every byte of its buffer against
 *           the pattern, repost the receive, and SEND 4 bytes back: the
 *           iteration number when the data was right, 0xffffffff when not.
 *   client: wait for that answer before the next iteration, so that it never
 *           overwrites the server's buffer while the server is still checking.
 *
 * The server never touches a verb to receive the data itself: the RDMA WRITE
 * lands in its memory without involving its CPU; only the SEND makes it see a
 * completion.  Both buffers are deliberately NOT page aligned (malloc()ed,
 * then offset by one byte): verbs do not require alignment.
 *
 * Build (Debian: apt-get install libibverbs-dev):
 *   cc -Wall -Wextra -Werror -O1 -o rdma-write verbs/examples/rdma-write.c -libverbs
 *
 * Run, e.g. on one Soft-RoCE (rxe) device through loopback:
 *   rdma-write -d rxe0 -g 1 -s 65536 -n 5 &            # server
 *   rdma-write -d rxe0 -g 1 -s 65536 -n 5 127.0.0.1    # client
 * Through rdmad, unmodified (rdmad's libibverbs.so.1 is used instead of the
 * system's):
 *   rdmactl exec -- rdma-write -s 65536 -n 5 &
 *   rdmactl exec -- rdma-write -s 65536 -n 5 127.0.0.1
 *
 * Usage: rdma-write [-d DEVICE] [-i IB_PORT] [-g GID_INDEX] [-p TCP_PORT]
 *                   [-s SIZE] [-n ITERS] [-e] [SERVERNAME]
 *   -d DEVICE     RDMA device name (default: the first one found)
 *   -i IB_PORT    port of that device (default 1)
 *   -g GID_INDEX  local GID index (default 1, the IPv4-mapped RoCE v2 GID on
 *                 rxe); -1 for no GID (InfiniBand, addressing by LID only)
 *   -p TCP_PORT   TCP port of the endpoint exchange (default 18515)
 *   -s SIZE       bytes written per iteration (default 4096)
 *   -n ITERS      number of iterations (default 1)
 *   -e            sleep on a completion channel instead of busy-polling the CQ
 * Both sides must be given the same -s and -n (a server told to expect more
 * iterations than the client sends waits forever, as ibv_rc_pingpong does).
 * The client retries the TCP connection for up to 30 s, so it may be started
 * before the server.  If the peer vanishes, a send fails after a few
 * retransmissions with "transport retry counter exceeded".
 *
 * Output: the server prints one line
 *   rdma-write: server: N bytes written by the peer checked (ITERS iterations)
 * and the client
 *   rdma-write: client: N bytes written ITERS times
 * both exiting 0.  On any failure either side says what failed and exits 1.
 */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE	/* getaddrinfo, lrand48, nanosleep under -std=c99 */
#endif

#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include <infiniband/verbs.h>

/* Work request ids, so that a completion tells which operation it ends. */
enum {
	WRID_WRITE = 1,	/* client: the RDMA WRITE of the data */
	WRID_SEND,	/* either side: the 4-byte message */
	WRID_RECV,	/* either side: the receive for the peer's message */
};

/* What the server answers when the data it found was wrong. */
#define REPLY_BAD UINT32_MAX

/* One side of the connection, as sent to the peer. */
struct endpoint {
	uint16_t lid;		/* port LID (0 on RoCE) */
	uint32_t qpn;		/* QP number */
	uint32_t psn;		/* first packet sequence number this side sends */
	union ibv_gid gid;	/* GID (all zero: none) */
	uint64_t addr;		/* virtual address of the data buffer */
	uint32_t rkey;		/* remote key of the data buffer */
};

/* Everything one side owns. */
struct ctx {
	struct ibv_device **dev_list;
	struct ibv_context *verbs;
	struct ibv_pd *pd;
	struct ibv_comp_channel *channel;	/* only with -e */
	struct ibv_cq *cq;
	struct ibv_qp *qp;

	void *buf_alloc;	/* what malloc() returned for the data buffer */
	uint8_t *buf;		/* the data buffer itself: buf_alloc + 1 */
	struct ibv_mr *buf_mr;

	/* The 4-byte messages: msg[0] is received into, msg[1] is sent from. */
	uint32_t *msg;
	struct ibv_mr *msg_mr;

	int cq_armed;		/* -e: ibv_req_notify_cq() is pending */
};

/* Options. */
static const char *role = "server";
static const char *dev_name;
static int ib_port = 1;
static int gid_index = 1;
static int tcp_port = 18515;
static size_t size = 4096;
static unsigned iters = 1;
static int use_events;

/* Print "rdma-write: ROLE: MESSAGE" to stderr and exit 1. */
static void __attribute__((noreturn, format(printf, 1, 2)))
fail(const char *fmt, ...)
{
	char msg[512];
	va_list ap;

	/* One fprintf, so that the server's and the client's messages do not
	 * interleave when they share a terminal. */
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	fprintf(stderr, "rdma-write: %s: %s\n", role, msg);
	exit(1);
}

/* The byte the client writes at OFFSET in iteration ITER.  Every byte changes
 * from one iteration to the next (37 is odd), and neighbouring bytes and
 * 256-byte blocks differ, so misplaced or stale data is caught. */
static uint8_t pattern(unsigned iter, size_t offset)
{
	return (uint8_t)(offset + (offset >> 8) * 3 + (offset >> 16) * 5 +
			 iter * 37u + 1);
}

static void usage(void)
{
	fprintf(stderr,
		"usage: rdma-write [-d DEVICE] [-i IB_PORT] [-g GID_INDEX] [-p TCP_PORT]\n"
		"                  [-s SIZE] [-n ITERS] [-e] [SERVERNAME]\n"
		"Without SERVERNAME it is the server; see the source for details.\n");
	exit(1);
}

/* Parse a decimal number in [MIN, MAX] or exit with usage. */
static long long number(const char *opt, const char *s, long long min,
			long long max)
{
	char *end;
	long long v;

	errno = 0;
	v = strtoll(s, &end, 10);
	if (errno || end == s || *end || v < min || v > max) {
		fprintf(stderr, "rdma-write: %s: expected a number from %lld to %lld, got '%s'\n",
			opt, min, max, s);
		usage();
	}
	return v;
}

/* ------------------------------------------------------------------ TCP */

/* Write all LEN bytes of BUF to FD. */
static void write_all(int fd, const char *buf, size_t len)
{
	while (len) {
		ssize_t n = write(fd, buf, len);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			fail("endpoint exchange: write: %s", strerror(errno));
		buf += n;
		len -= (size_t)n;
	}
}

/* Read one '\n'-terminated line (at most LEN - 1 bytes) from FD into LINE.
 * Byte by byte, so nothing after the newline is consumed. */
static void read_line(int fd, char *line, size_t len)
{
	size_t used = 0;

	for (;;) {
		char c;
		ssize_t n = read(fd, &c, 1);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			fail("endpoint exchange: read: %s", strerror(errno));
		if (n == 0)
			fail("endpoint exchange: the peer closed the connection");
		if (c == '\n')
			break;
		if (used + 1 >= len)
			fail("endpoint exchange: line from the peer too long");
		line[used++] = c;
	}
	line[used] = '\0';
}

/* Server: a socket listening on INADDR_ANY:tcp_port. */
static int tcp_listen(void)
{
	struct sockaddr_in sin;
	int one = 1;
	int fd = socket(AF_INET, SOCK_STREAM, 0);

	if (fd < 0)
		fail("socket: %s", strerror(errno));
	if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)))
		fail("setsockopt(SO_REUSEADDR): %s", strerror(errno));
	memset(&sin, 0, sizeof(sin));
	sin.sin_family = AF_INET;
	sin.sin_addr.s_addr = htonl(INADDR_ANY);
	sin.sin_port = htons((uint16_t)tcp_port);
	if (bind(fd, (struct sockaddr *)&sin, sizeof(sin)))
		fail("bind to TCP port %d: %s", tcp_port, strerror(errno));
	if (listen(fd, 1))
		fail("listen: %s", strerror(errno));
	return fd;
}

/* Client: a socket connected to SERVERNAME:tcp_port (IPv4), retrying for up
 * to 30 s while nothing listens there yet. */
static int tcp_connect(const char *servername)
{
	struct addrinfo hints, *res, *ai;
	char service[8];
	int attempt, err, fd = -1;

	memset(&hints, 0, sizeof(hints));
	hints.ai_family = AF_INET;
	hints.ai_socktype = SOCK_STREAM;
	snprintf(service, sizeof(service), "%d", tcp_port);
	err = getaddrinfo(servername, service, &hints, &res);
	if (err)
		fail("getaddrinfo(%s): %s", servername, gai_strerror(err));

	for (attempt = 0; attempt < 300; attempt++) {
		struct timespec pause = { 0, 100 * 1000 * 1000 };

		for (ai = res; ai; ai = ai->ai_next) {
			fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
			if (fd < 0)
				fail("socket: %s", strerror(errno));
			if (!connect(fd, ai->ai_addr, ai->ai_addrlen))
				goto connected;
			err = errno;
			close(fd);
			fd = -1;
			if (err != ECONNREFUSED)
				fail("connect to %s:%d: %s", servername, tcp_port,
				     strerror(err));
		}
		nanosleep(&pause, NULL);
	}
	fail("connect to %s:%d: %s (for 30 s)", servername, tcp_port,
	     strerror(ECONNREFUSED));
connected:
	freeaddrinfo(res);
	return fd;
}

/* Send our endpoint as one text line. */
static void send_endpoint(int fd, const struct endpoint *ep)
{
	char gid[INET6_ADDRSTRLEN], line[256];
	int len;

	/* A GID has the layout of an IPv6 address: print it as one. */
	if (!inet_ntop(AF_INET6, ep->gid.raw, gid, sizeof(gid)))
		fail("inet_ntop: %s", strerror(errno));
	len = snprintf(line, sizeof(line),
		       "lid 0x%04x qpn 0x%06x psn 0x%06x gid %s addr 0x%016" PRIx64
		       " rkey 0x%08x\n",
		       ep->lid, ep->qpn, ep->psn, gid, ep->addr, ep->rkey);
	write_all(fd, line, (size_t)len);
}

/* Receive the peer's endpoint line. */
static void recv_endpoint(int fd, struct endpoint *ep)
{
	char gid[INET6_ADDRSTRLEN + 1], line[256];
	unsigned lid, qpn, psn, rkey;
	uint64_t addr;

	read_line(fd, line, sizeof(line));
	if (sscanf(line, "lid %x qpn %x psn %x gid %46s addr %" SCNx64 " rkey %x",
		   &lid, &qpn, &psn, gid, &addr, &rkey) != 6 ||
	    lid > 0xffff || qpn > 0xffffff || psn > 0xffffff ||
	    inet_pton(AF_INET6, gid, ep->gid.raw) != 1)
		fail("endpoint exchange: bad line from the peer: '%s'", line);
	ep->lid = (uint16_t)lid;
	ep->qpn = qpn;
	ep->psn = psn;
	ep->addr = addr;
	ep->rkey = rkey;
}

/* ---------------------------------------------------------------- verbs */

/* Open the device and create PD, buffers + MRs, channel, CQ and QP (left in
 * RESET state).  Fill in our own endpoint. */
static void setup(struct ctx *c, struct endpoint *me)
{
	struct ibv_device *dev = NULL;
	struct ibv_port_attr port;
	struct ibv_qp_init_attr qp_init;
	int i, num, ret;

	c->dev_list = ibv_get_device_list(&num);
	if (!c->dev_list)
		fail("ibv_get_device_list: %s", strerror(errno));
	for (i = 0; i < num; i++) {
		if (!dev_name || !strcmp(ibv_get_device_name(c->dev_list[i]), dev_name)) {
			dev = c->dev_list[i];
			break;
		}
	}
	if (!dev) {
		if (dev_name)
			fail("no RDMA device named %s", dev_name);
		fail("no RDMA device found");
	}

	c->verbs = ibv_open_device(dev);
	if (!c->verbs)
		fail("ibv_open_device(%s): %s", ibv_get_device_name(dev),
		     strerror(errno));

	/* The port gives our LID (InfiniBand) and the MTU to use on the path. */
	ret = ibv_query_port(c->verbs, (uint8_t)ib_port, &port);
	if (ret)
		fail("ibv_query_port(%d): %s", ib_port, strerror(ret));
	if (port.state != IBV_PORT_ACTIVE)
		fail("port %d of %s is not active (state %s)", ib_port,
		     ibv_get_device_name(dev), ibv_port_state_str(port.state));
	if (size > port.max_msg_sz)
		fail("-s %zu is larger than the port's largest message (%u bytes)",
		     size, port.max_msg_sz);
	me->lid = port.lid;

	/* Our GID: needed on RoCE, where packets are routed by it. */
	memset(&me->gid, 0, sizeof(me->gid));
	if (gid_index >= 0) {
		if (ibv_query_gid(c->verbs, (uint8_t)ib_port, gid_index, &me->gid))
			fail("ibv_query_gid(port %d, index %d): %s", ib_port,
			     gid_index, strerror(errno));
		/* An unused table entry reads back as all zeros. */
		if (!me->gid.global.subnet_prefix && !me->gid.global.interface_id)
			fail("GID index %d of port %d is empty", gid_index, ib_port);
	}

	c->pd = ibv_alloc_pd(c->verbs);
	if (!c->pd)
		fail("ibv_alloc_pd: %s", strerror(errno));

	/* The data buffer, one byte into a malloc()ed block: not page aligned
	 * on purpose.  The peer may write and read it. */
	c->buf_alloc = malloc(size + 1);
	if (!c->buf_alloc)
		fail("malloc(%zu): %s", size + 1, strerror(errno));
	c->buf = (uint8_t *)c->buf_alloc + 1;
	c->buf_mr = ibv_reg_mr(c->pd, c->buf, size,
			       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
			       IBV_ACCESS_REMOTE_READ);
	if (!c->buf_mr)
		fail("ibv_reg_mr(%zu bytes): %s", size, strerror(errno));

	/* The small messages live in a separate MR; receiving into it is a
	 * local write by the device. */
	c->msg = calloc(2, sizeof(*c->msg));
	if (!c->msg)
		fail("calloc: %s", strerror(errno));
	c->msg_mr = ibv_reg_mr(c->pd, c->msg, 2 * sizeof(*c->msg),
			       IBV_ACCESS_LOCAL_WRITE);
	if (!c->msg_mr)
		fail("ibv_reg_mr(messages): %s", strerror(errno));

	if (use_events) {
		c->channel = ibv_create_comp_channel(c->verbs);
		if (!c->channel)
			fail("ibv_create_comp_channel: %s", strerror(errno));
	}

	/* One CQ for sends and receives: at most one send and one receive
	 * are outstanding at any time; leave some room anyway. */
	c->cq = ibv_create_cq(c->verbs, 4, NULL, c->channel, 0);
	if (!c->cq)
		fail("ibv_create_cq: %s", strerror(errno));

	memset(&qp_init, 0, sizeof(qp_init));
	qp_init.send_cq = c->cq;
	qp_init.recv_cq = c->cq;
	qp_init.qp_type = IBV_QPT_RC;
	qp_init.cap.max_send_wr = 2;
	qp_init.cap.max_recv_wr = 1;
	qp_init.cap.max_send_sge = 1;
	qp_init.cap.max_recv_sge = 1;
	qp_init.cap.max_inline_data = 0;
	qp_init.sq_sig_all = 0;		/* we ask for each completion */
	c->qp = ibv_create_qp(c->pd, &qp_init);
	if (!c->qp)
		fail("ibv_create_qp: %s", strerror(errno));

	me->qpn = c->qp->qp_num;
	me->psn = (uint32_t)lrand48() & 0xffffff;	/* PSNs are 24 bits */
	me->addr = (uintptr_t)c->buf;
	me->rkey = c->buf_mr->rkey;
}

/* RESET -> INIT: bind the QP to the port and allow the peer to write and
 * read our memory.  Receives may be posted from INIT on. */
static void qp_to_init(struct ctx *c)
{
	struct ibv_qp_attr attr;
	int ret;

	memset(&attr, 0, sizeof(attr));
	attr.qp_state = IBV_QPS_INIT;
	attr.pkey_index = 0;
	attr.port_num = (uint8_t)ib_port;
	attr.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
	ret = ibv_modify_qp(c->qp, &attr,
			    IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
			    IBV_QP_ACCESS_FLAGS);
	if (ret)
		fail("ibv_modify_qp(INIT): %s", strerror(ret));
}

/* INIT -> RTR (ready to receive from the peer's QP) -> RTS (ready to send). */
static void qp_to_rts(struct ctx *c, const struct endpoint *me,
		      const struct endpoint *peer)
{
	struct ibv_port_attr port;
	struct ibv_qp_attr attr;
	int ret;

	ret = ibv_query_port(c->verbs, (uint8_t)ib_port, &port);
	if (ret)
		fail("ibv_query_port(%d): %s", ib_port, strerror(ret));

	memset(&attr, 0, sizeof(attr));
	attr.qp_state = IBV_QPS_RTR;
	attr.path_mtu = port.active_mtu;	/* assumes both ports agree */
	attr.dest_qp_num = peer->qpn;
	attr.rq_psn = peer->psn;
	attr.max_dest_rd_atomic = 1;
	attr.min_rnr_timer = 12;		/* 0.64 ms */
	attr.ah_attr.dlid = peer->lid;
	attr.ah_attr.sl = 0;
	attr.ah_attr.src_path_bits = 0;
	attr.ah_attr.port_num = (uint8_t)ib_port;
	if (peer->gid.global.subnet_prefix || peer->gid.global.interface_id) {
		/* A global route header, addressed by GID: mandatory on RoCE. */
		if (gid_index < 0)
			fail("the peer has a GID; give a local one with -g");
		attr.ah_attr.is_global = 1;
		attr.ah_attr.grh.dgid = peer->gid;
		attr.ah_attr.grh.sgid_index = (uint8_t)gid_index;
		attr.ah_attr.grh.hop_limit = 1;
	}
	ret = ibv_modify_qp(c->qp, &attr,
			    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
			    IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
			    IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
	if (ret)
		fail("ibv_modify_qp(RTR): %s", strerror(ret));

	memset(&attr, 0, sizeof(attr));
	attr.qp_state = IBV_QPS_RTS;
	attr.sq_psn = me->psn;
	attr.timeout = 14;			/* 4.096 us * 2^14 = 67 ms */
	/* Retransmissions before giving up with "transport retry counter
	 * exceeded" when the peer stops answering.  Not 7: rxe takes 7 to
	 * mean "retry forever", so a vanished peer would hang us. */
	attr.retry_cnt = 6;
	attr.rnr_retry = 7;			/* 7 = retry forever */
	attr.max_rd_atomic = 1;
	ret = ibv_modify_qp(c->qp, &attr,
			    IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT |
			    IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
			    IBV_QP_MAX_QP_RD_ATOMIC);
	if (ret)
		fail("ibv_modify_qp(RTS): %s", strerror(ret));
}

static const char *wr_name(uint64_t wr_id)
{
	switch (wr_id) {
	case WRID_WRITE: return "RDMA WRITE";
	case WRID_SEND: return "SEND";
	case WRID_RECV: return "RECV";
	default: return "unknown work request";
	}
}

/* Post a receive of 4 bytes into msg[0]. */
static void post_recv(struct ctx *c)
{
	struct ibv_sge sge = {
		.addr = (uintptr_t)&c->msg[0],
		.length = sizeof(c->msg[0]),
		.lkey = c->msg_mr->lkey,
	};
	struct ibv_recv_wr wr = {
		.wr_id = WRID_RECV,
		.sg_list = &sge,
		.num_sge = 1,
	}, *bad;
	int ret = ibv_post_recv(c->qp, &wr, &bad);

	if (ret)
		fail("ibv_post_recv: %s", strerror(ret));
}

/* Post a signalled SEND of the 4-byte VALUE (network byte order) from msg[1]. */
static void post_send(struct ctx *c, uint32_t value)
{
	struct ibv_sge sge = {
		.addr = (uintptr_t)&c->msg[1],
		.length = sizeof(c->msg[1]),
		.lkey = c->msg_mr->lkey,
	};
	struct ibv_send_wr wr = {
		.wr_id = WRID_SEND,
		.sg_list = &sge,
		.num_sge = 1,
		.opcode = IBV_WR_SEND,
		.send_flags = IBV_SEND_SIGNALED,
	}, *bad;
	int ret;

	c->msg[1] = htonl(value);
	ret = ibv_post_send(c->qp, &wr, &bad);
	if (ret)
		fail("ibv_post_send(SEND): %s", strerror(ret));
}

/* Post a signalled RDMA WRITE of the whole buffer to the peer's buffer. */
static void post_write(struct ctx *c, const struct endpoint *peer)
{
	struct ibv_sge sge = {
		.addr = (uintptr_t)c->buf,
		.length = (uint32_t)size,
		.lkey = c->buf_mr->lkey,
	};
	struct ibv_send_wr wr = {
		.wr_id = WRID_WRITE,
		.sg_list = &sge,
		.num_sge = 1,
		.opcode = IBV_WR_RDMA_WRITE,
		.send_flags = IBV_SEND_SIGNALED,
		.wr.rdma = { .remote_addr = peer->addr, .rkey = peer->rkey },
	}, *bad;
	int ret = ibv_post_send(c->qp, &wr, &bad);

	if (ret)
		fail("ibv_post_send(RDMA WRITE): %s", strerror(ret));
}

/* Wait for the next completion and return it in WC; exit if it failed.
 * Busy-polls, or with -e sleeps on the completion channel. */
static void next_completion(struct ctx *c, struct ibv_wc *wc)
{
	for (;;) {
		struct ibv_cq *ev_cq;
		void *ev_ctx;
		int n, ret;

		n = ibv_poll_cq(c->cq, 1, wc);
		if (n < 0)
			fail("ibv_poll_cq failed (%d)", n);
		if (n == 1)
			break;
		if (!use_events)
			continue;
		if (!c->cq_armed) {
			/* Ask for an event on the next completion, then poll
			 * once more: one may have arrived before the request. */
			ret = ibv_req_notify_cq(c->cq, 0);
			if (ret)
				fail("ibv_req_notify_cq: %s", strerror(ret));
			c->cq_armed = 1;
			continue;
		}
		if (ibv_get_cq_event(c->channel, &ev_cq, &ev_ctx))
			fail("ibv_get_cq_event: %s", strerror(errno));
		if (ev_cq != c->cq)
			fail("ibv_get_cq_event: event for an unknown CQ");
		/* Every event must be acknowledged before the CQ is destroyed. */
		ibv_ack_cq_events(ev_cq, 1);
		c->cq_armed = 0;
	}

	if (wc->status != IBV_WC_SUCCESS)
		fail("%s completion failed: %s (status %d, vendor error 0x%x)",
		     wr_name(wc->wr_id), ibv_wc_status_str(wc->status),
		     wc->status, wc->vendor_err);
	if (wc->wr_id == WRID_RECV && wc->byte_len != sizeof(c->msg[0]))
		fail("received %u bytes, expected %zu", wc->byte_len,
		     sizeof(c->msg[0]));
}

/* Wait for the completion of the work request WR_ID (only one is pending). */
static void wait_for(struct ctx *c, uint64_t wr_id)
{
	struct ibv_wc wc;

	next_completion(c, &wc);
	if (wc.wr_id != wr_id)
		fail("expected a %s completion, got %s", wr_name(wr_id),
		     wr_name(wc.wr_id));
}

/* Destroy everything, in the reverse order of creation. */
static void teardown(struct ctx *c)
{
	int ret;

	ret = ibv_destroy_qp(c->qp);
	if (ret)
		fail("ibv_destroy_qp: %s", strerror(ret));
	ret = ibv_destroy_cq(c->cq);
	if (ret)
		fail("ibv_destroy_cq: %s", strerror(ret));
	if (c->channel) {
		ret = ibv_destroy_comp_channel(c->channel);
		if (ret)
			fail("ibv_destroy_comp_channel: %s", strerror(ret));
	}
	ret = ibv_dereg_mr(c->msg_mr);
	if (ret)
		fail("ibv_dereg_mr(messages): %s", strerror(ret));
	ret = ibv_dereg_mr(c->buf_mr);
	if (ret)
		fail("ibv_dereg_mr(buffer): %s", strerror(ret));
	free(c->msg);
	free(c->buf_alloc);
	ret = ibv_dealloc_pd(c->pd);
	if (ret)
		fail("ibv_dealloc_pd: %s", strerror(ret));
	if (ibv_close_device(c->verbs))
		fail("ibv_close_device: %s", strerror(errno));
	ibv_free_device_list(c->dev_list);
}

/* ------------------------------------------------------------ the sides */

static int run_server(struct ctx *c)
{
	struct endpoint me, peer;
	size_t off;
	unsigned it;
	int lfd, fd;

	lfd = tcp_listen();
	setup(c, &me);

	/* Start with bytes that match no iteration's pattern, so that a write
	 * that never arrived is noticed. */
	for (off = 0; off < size; off++)
		c->buf[off] = (uint8_t)~pattern(0, off);

	qp_to_init(c);
	post_recv(c);	/* before the peer learns where to send */

	fd = accept(lfd, NULL, NULL);
	if (fd < 0)
		fail("accept: %s", strerror(errno));
	close(lfd);
	recv_endpoint(fd, &peer);
	qp_to_rts(c, &me, &peer);
	send_endpoint(fd, &me);	/* our QP is ready: the client may start */
	close(fd);

	for (it = 0; it < iters; it++) {
		uint32_t got;

		wait_for(c, WRID_RECV);
		got = ntohl(c->msg[0]);
		if (got != it)
			fail("message says iteration %" PRIu32 ", expected %u", got, it);

		/* The write is complete: check what it put into our memory. */
		for (off = 0; off < size; off++)
			if (c->buf[off] != pattern(it, off))
				break;
		if (off < size) {
			fprintf(stderr,
				"rdma-write: server: iteration %u: wrong byte at offset %zu"
				" of %zu: 0x%02x, expected 0x%02x\n",
				it, off, size, c->buf[off], pattern(it, off));
			post_send(c, REPLY_BAD);
			wait_for(c, WRID_SEND);
			return 1;
		}

		/* Repost the receive before answering: the answer lets the
		 * client send the next message. */
		if (it + 1 < iters)
			post_recv(c);
		post_send(c, it);
		wait_for(c, WRID_SEND);
	}

	return 0;
}

static int run_client(struct ctx *c, const char *servername)
{
	struct endpoint me, peer;
	unsigned it;
	int fd;

	setup(c, &me);
	qp_to_init(c);

	fd = tcp_connect(servername);
	send_endpoint(fd, &me);
	recv_endpoint(fd, &peer);
	close(fd);
	qp_to_rts(c, &me, &peer);

	for (it = 0; it < iters; it++) {
		int sent = 0, answered = 0;
		uint32_t answer;
		size_t off;

		for (off = 0; off < size; off++)
			c->buf[off] = pattern(it, off);

		/* The data: straight into the server's memory. */
		post_write(c, &peer);
		wait_for(c, WRID_WRITE);

		/* Then the notification.  Post the receive for the answer
		 * first; its completion and the send's may come in any order. */
		post_recv(c);
		post_send(c, it);
		while (!sent || !answered) {
			struct ibv_wc wc;

			next_completion(c, &wc);
			if (wc.wr_id == WRID_SEND && !sent)
				sent = 1;
			else if (wc.wr_id == WRID_RECV && !answered)
				answered = 1;
			else
				fail("unexpected %s completion", wr_name(wc.wr_id));
		}
		answer = ntohl(c->msg[0]);
		if (answer == REPLY_BAD)
			fail("the server found wrong data after iteration %u", it);
		if (answer != it)
			fail("the server answered %" PRIu32 " to iteration %u", answer, it);
	}

	return 0;
}

int main(int argc, char *argv[])
{
	struct ctx c;
	int opt, ret;

	while ((opt = getopt(argc, argv, "d:i:g:p:s:n:eh")) != -1) {
		switch (opt) {
		case 'd': dev_name = optarg; break;
		case 'i': ib_port = (int)number("-i", optarg, 1, 255); break;
		case 'g': gid_index = (int)number("-g", optarg, -1, 255); break;
		case 'p': tcp_port = (int)number("-p", optarg, 1, 65535); break;
		case 's': size = (size_t)number("-s", optarg, 1, UINT32_MAX); break;
		case 'n': iters = (unsigned)number("-n", optarg, 1, UINT32_MAX - 1); break;
		case 'e': use_events = 1; break;
		default: usage();
		}
	}
	if (argc - optind > 1)
		usage();
	if (optind < argc)
		role = "client";

	srand48(getpid() ^ time(NULL));
	memset(&c, 0, sizeof(c));

	ret = optind < argc ? run_client(&c, argv[optind]) : run_server(&c);
	if (ret)
		return ret;
	teardown(&c);

	/* Only now, with everything released cleanly, report success. */
	if (optind < argc)
		printf("rdma-write: client: %zu bytes written %u times\n", size, iters);
	else
		printf("rdma-write: server: %zu bytes written by the peer checked (%u iterations)\n",
		       size, iters);
	return 0;
}
