/* Where a libfabric hop's time goes: two processes (one CPU each: 0 and 1) ping-pong 8 bytes
 * with fi_tinject, fi_cq_read and fi_trecv, and time each call with the TSC (one clock for
 * both). Prints medians: the one-way time, each side's send call, the read that finds the
 * message, the gap from the end of a send to the end of the peer's read, the receive's post,
 * and a raw cache-line ping-pong between the same two processes first, as the baseline.
 *
 *   cc -O2 -o /tmp/fabric-hop scripts/fabric-hop.c -lfabric
 *   eval "$(target/release/clan fabric env)"; /tmp/fabric-hop clan     (or: /tmp/fabric-hop shm)
 *
 * A measuring tool, not a test: run it on a quiet machine, several times, alternating builds.
 */
#define _GNU_SOURCE
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <x86intrin.h>

#define N 200000 /* round trips measured */
#define W 20000  /* and before them, not measured */

static struct fid_ep *ep;
static struct fid_cq *cq;
static struct fid_av *av;

static void setup(const char *prov)
{
	struct fi_info *h = fi_allocinfo(), *i = NULL;
	h->fabric_attr->prov_name = strdup(prov);
	h->ep_attr->type = FI_EP_RDM;
	h->caps = FI_TAGGED;
	if (fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &i)) {
		fprintf(stderr, "fi_getinfo: no provider %s\n", prov);
		exit(1);
	}
	struct fid_fabric *f;
	struct fid_domain *d;
	struct fi_cq_attr ca = { .format = FI_CQ_FORMAT_TAGGED, .size = 64 };
	struct fi_av_attr aa = { .type = FI_AV_TABLE };
	if (fi_fabric(i->fabric_attr, &f, NULL) || fi_domain(f, i, &d, NULL) || fi_cq_open(d, &ca, &cq, NULL) ||
	    fi_av_open(d, &aa, &av, NULL) || fi_endpoint(d, i, &ep, NULL) ||
	    fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV) || fi_ep_bind(ep, &av->fid, 0) || fi_enable(ep)) {
		fprintf(stderr, "setting up the endpoint failed\n");
		exit(1);
	}
}

/* One side's times of round trip i: its send call's start and end, the start of the read
 * that found the peer's message and its end. */
struct ts {
	uint64_t ss, se, fc, fe;
};

static double tsc_ns;

static int cmpu(const void *a, const void *b)
{
	int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
	return x < y ? -1 : x > y;
}

static double median(int64_t *v, int n)
{
	qsort(v, n, sizeof *v, cmpu);
	return v[n / 2] * tsc_ns;
}

static void pin(int cpu)
{
	cpu_set_t s;
	CPU_ZERO(&s);
	CPU_SET(cpu, &s);
	sched_setaffinity(0, sizeof s, &s);
}

/* Read until the peer's message completes; the start of the read that found it. */
static uint64_t take(void)
{
	struct fi_cq_tagged_entry e;
	for (;;) {
		uint64_t at = __rdtsc();
		if (fi_cq_read(cq, &e, 1) == 1 && (e.flags & FI_RECV))
			return at;
	}
}

int main(int argc, char **argv)
{
	const char *prov = argc > 1 ? argv[1] : "clan";
	struct ts *t[2];
	for (int k = 0; k < 2; k++)
		t[k] = mmap(NULL, sizeof(struct ts) * (N + W), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	volatile uint64_t *raw = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	struct timespec q0, q1;
	clock_gettime(CLOCK_MONOTONIC, &q0);
	uint64_t r0 = __rdtsc();
	usleep(100000);
	clock_gettime(CLOCK_MONOTONIC, &q1);
	uint64_t r1 = __rdtsc();
	tsc_ns = ((q1.tv_sec - q0.tv_sec) * 1e9 + (q1.tv_nsec - q0.tv_nsec)) / (double)(r1 - r0);
	int a[2], b[2];
	if (pipe(a) || pipe(b))
		return 1;
	pid_t child = fork();
	int me = child ? 0 : 1;
	pin(me);
	/* The baseline: a flag each way, on lines of their own. */
	for (int i = 1; i <= 1000000; i++) {
		if (me == 0) {
			if (i == 200000)
				r0 = __rdtsc();
			raw[0] = i;
			while (raw[8] != (uint64_t)i)
				;
		} else {
			while (raw[0] != (uint64_t)i)
				;
			raw[8] = i;
		}
	}
	if (me == 0)
		printf("raw cache-line ping-pong, one way: %.1f ns\n", (__rdtsc() - r0) * tsc_ns / 800000 / 2);
	setup(prov);
	char name[256];
	size_t len = sizeof name, plen;
	char pname[256];
	fi_getname(&ep->fid, name, &len);
	int wr = child ? a[1] : b[1], rd = child ? b[0] : a[0];
	if (write(wr, &len, sizeof len) < 0 || write(wr, name, len) < 0 || read(rd, &plen, sizeof plen) < 0 ||
	    read(rd, pname, plen) < 0)
		return 1;
	fi_addr_t peer;
	fi_av_insert(av, pname, 1, &peer, 0, NULL);
	uint64_t v = 0, r;
	struct fi_cq_tagged_entry e;
	struct ts *mine = t[me];
	fi_trecv(ep, &r, 8, NULL, FI_ADDR_UNSPEC, 1, 0, &r);
	for (int i = 0; i < N + W; i++) {
		if (me == 1) {
			mine[i].fc = take();
			mine[i].fe = __rdtsc();
			fi_trecv(ep, &r, 8, NULL, FI_ADDR_UNSPEC, 1, 0, &r);
		}
		mine[i].ss = __rdtsc();
		while (fi_tinject(ep, &v, 8, peer, 1) == -FI_EAGAIN)
			fi_cq_read(cq, &e, 1);
		mine[i].se = __rdtsc();
		if (me == 0) {
			mine[i].fc = take();
			mine[i].fe = __rdtsc();
			fi_trecv(ep, &r, 8, NULL, FI_ADDR_UNSPEC, 1, 0, &r);
		}
	}
	if (!child)
		return 0;
	waitpid(child, NULL, 0);
	int64_t *x = malloc(sizeof *x * N);
	struct ts *A = t[0] + W, *B = t[1] + W;
	for (int i = 0; i < N - 1; i++)
		x[i] = A[i + 1].ss - A[i].ss;
	printf("one way (round trip / 2): %.1f ns\n", median(x, N - 1) / 2);
	for (int i = 0; i < N; i++)
		x[i] = A[i].se - A[i].ss;
	printf("the pinger's send call: %.1f ns\n", median(x, N));
	for (int i = 0; i < N; i++)
		x[i] = B[i].fe - B[i].fc;
	printf("the ponger's read that finds the message: %.1f ns\n", median(x, N));
	for (int i = 0; i < N; i++)
		x[i] = B[i].fe - A[i].se;
	printf("from the end of the send to the end of that read: %.1f ns\n", median(x, N));
	for (int i = 0; i < N; i++)
		x[i] = B[i].ss - B[i].fe;
	printf("the ponger's receive posted, until its send: %.1f ns\n", median(x, N));
	return 0;
}
