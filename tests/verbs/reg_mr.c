/* Registers the program's own memory through whatever libibverbs it is run with, and
 * checks what a verbs program relies on: the buffer keeps its contents, stays the
 * program's memory (writes before and after land), and dereg leaves it intact.
 * Prints one line per check ("ok ..." or "FAIL ..."), then "quota ..." for a registration
 * past the user's limit, if asked: reg_mr [BYTES_PAST_QUOTA]. Exit 0 if every check held.
 * Also: another thread writing next to a buffer (same page) while it is registered and
 * deregistered over and over loses none of its writes. */
#include <errno.h>
#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static int failures;

static void check(int ok, const char *what)
{
	printf("%s %s\n", ok ? "ok" : "FAIL", what);
	if (!ok)
		failures++;
}

static void fill(unsigned char *p, size_t n, unsigned seed)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (unsigned char)(i * 31 + seed);
}

static int same(const unsigned char *p, size_t n, unsigned seed)
{
	for (size_t i = 0; i < n; i++)
		if (p[i] != (unsigned char)(i * 31 + seed))
			return 0;
	return 1;
}

/* Registers buf[0..n), checks the MR and the contents, writes through it, deregisters. */
static void round_trip(struct ibv_pd *pd, unsigned char *buf, size_t n, const char *what)
{
	char line[160];
	fill(buf, n, 7);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, n, IBV_ACCESS_LOCAL_WRITE);
	snprintf(line, sizeof line, "%s: ibv_reg_mr (%s)", what, mr ? "registered" : strerror(errno));
	check(mr != NULL, line);
	if (!mr)
		return;
	snprintf(line, sizeof line, "%s: the MR covers the buffer", what);
	check(mr->addr == buf && mr->length == n && mr->pd == pd && mr->lkey != 0, line);
	snprintf(line, sizeof line, "%s: contents kept by the registration", what);
	check(same(buf, n, 7), line);
	fill(buf, n, 11);
	snprintf(line, sizeof line, "%s: writes after the registration land", what);
	check(same(buf, n, 11), line);
	snprintf(line, sizeof line, "%s: ibv_dereg_mr", what);
	check(ibv_dereg_mr(mr) == 0, line);
	snprintf(line, sizeof line, "%s: contents kept by the deregistration", what);
	check(same(buf, n, 11), line);
	fill(buf, n, 13);
	snprintf(line, sizeof line, "%s: the buffer is writable after it", what);
	check(same(buf, n, 13), line);
}

/* A thread that counts in memory next to a buffer being registered: every increment
 * reads what the previous one wrote, so a write lost in a registration shows as a count
 * in memory behind the thread's own. */
struct neighbour_writer {
	volatile uint64_t *counter;
	atomic_int stop;
	uint64_t written;
};

static void *write_next_door(void *arg)
{
	struct neighbour_writer *w = arg;
	while (!atomic_load(&w->stop)) {
		*w->counter = *w->counter + 1;
		w->written++;
	}
	return NULL;
}

static void busy_neighbour(struct ibv_pd *pd)
{
	unsigned char *page;
	if (posix_memalign((void **)&page, 4096, 4096)) {
		printf("FAIL posix_memalign\n");
		exit(1);
	}
	memset(page, 0, 4096);
	struct neighbour_writer w = { .counter = (volatile uint64_t *)page };
	pthread_t thread;
	if (pthread_create(&thread, NULL, write_next_door, &w)) {
		printf("FAIL pthread_create\n");
		exit(1);
	}
	int registered = 0;
	for (int i = 0; i < 200; i++) {
		struct ibv_mr *mr = ibv_reg_mr(pd, page + 64, 4096 - 64, IBV_ACCESS_LOCAL_WRITE);
		if (!mr)
			break;
		registered += ibv_dereg_mr(mr) == 0;
	}
	atomic_store(&w.stop, 1);
	pthread_join(thread, NULL);
	check(registered == 200, "threads: 200 registrations next to a busy thread");
	char line[160];
	snprintf(line, sizeof line,
		 "threads: a thread writing on the same page loses nothing (%llu of %llu)",
		 (unsigned long long)*w.counter, (unsigned long long)w.written);
	check(*w.counter == w.written, line);
	free(page);
}

int main(int argc, char **argv)
{
	struct ibv_device **list = ibv_get_device_list(NULL);
	if (!list || !list[0]) {
		printf("FAIL no device (%s)\n", strerror(errno));
		return 1;
	}
	struct ibv_context *ctx = ibv_open_device(list[0]);
	check(ctx != NULL, "ibv_open_device");
	if (!ctx)
		return 1;
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	check(pd != NULL, "ibv_alloc_pd");
	if (!pd)
		return 1;

	/* Heap, not page-aligned, with a neighbour on the same page that must survive. */
	unsigned char *heap = malloc(10000);
	unsigned char *neighbour = heap + 9000;
	fill(neighbour, 1000, 3);
	round_trip(pd, heap + 100, 5000, "heap");
	check(same(neighbour, 1000, 3), "heap: a neighbour on the same pages is untouched");

	unsigned char stack[3000];
	round_trip(pd, stack + 1, sizeof stack - 1, "stack");

	unsigned char *pages = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE,
				    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	round_trip(pd, pages, 1 << 20, "page-aligned 1 MiB");

	/* Two MRs within the same pages share them; the second outlives the first. */
	fill(heap, 10000, 5);
	struct ibv_mr *a = ibv_reg_mr(pd, heap, 4000, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *b = ibv_reg_mr(pd, heap + 1000, 2000, IBV_ACCESS_LOCAL_WRITE);
	check(a && b && a->lkey != b->lkey, "two MRs within the same pages");
	check(a && ibv_dereg_mr(a) == 0, "the first is deregistered");
	check(same(heap, 10000, 5), "the second still holds the contents");
	check(b && ibv_dereg_mr(b) == 0, "the second is deregistered");

	busy_neighbour(pd);

	check(ibv_reg_mr(pd, NULL, 10, IBV_ACCESS_LOCAL_WRITE) == NULL && errno == EINVAL,
	      "a NULL buffer is refused with EINVAL");
	check(ibv_reg_mr(pd, (void *)0x10000, 4096, IBV_ACCESS_LOCAL_WRITE) == NULL &&
		      errno == EFAULT,
	      "an unmapped buffer is refused with EFAULT");
	check(ibv_reg_mr(pd, heap, 100, IBV_ACCESS_ON_DEMAND) == NULL && errno == EOPNOTSUPP,
	      "on-demand paging is refused with EOPNOTSUPP");
	check(ibv_dereg_mr((struct ibv_mr *)heap) == EINVAL, "a stranger's pointer is refused");

	if (argc > 1) {
		size_t n = strtoull(argv[1], NULL, 0);
		unsigned char *big = mmap(NULL, n, PROT_READ | PROT_WRITE,
					  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		struct ibv_mr *mr = ibv_reg_mr(pd, big, n, IBV_ACCESS_LOCAL_WRITE);
		printf("quota %s\n", mr ? "registered" : strerror(errno));
		check(mr == NULL && errno == ENOMEM, "past the quota: NULL with ENOMEM");
	}

	/* A PD with a live MR cannot go; closing the context releases both, as the kernel
	 * does, and the buffer stays the program's, contents kept. */
	fill(heap, 10000, 17);
	struct ibv_mr *held = ibv_reg_mr(pd, heap, 100, IBV_ACCESS_LOCAL_WRITE);
	check(held && ibv_dealloc_pd(pd) == EBUSY, "ibv_dealloc_pd with a live MR: EBUSY");
	check(ibv_close_device(ctx) == 0, "ibv_close_device with a live PD and MR");
	check(same(heap, 10000, 17), "the MR's buffer is intact after the close");
	fill(heap, 10000, 19);
	check(same(heap, 10000, 19), "and writable");
	ibv_free_device_list(list);
	printf("%d failed\n", failures);
	return failures ? 1 : 0;
}
