/* clan bench fabric: the message rate of a libfabric provider between two processes (built
 * with the system's cc at run time, against libfabric). Usage: fi_rate PROVIDER COUNT.
 * A receiver process on CPU 1 keeps 64 tagged receives of 8 bytes posted; a sender on CPU 0
 * injects COUNT 8-byte tagged messages (fi_tinject; when the provider says FI_EAGAIN, it
 * reads its completion queue, which makes progress, and tries again), each carrying its
 * number. Both domains are FI_THREAD_DOMAIN with manual progress where the provider offers
 * it, as Open MPI asks. The sender prints
 *   rate msgs_per_s R count COUNT
 * timed from its first inject to the receiver's word that every message came; the receiver
 * checks that the numbers it got sum to what COUNT messages carry (none lost, none twice).
 * Exits non-zero on any failure, with the reason on stderr. */
#define _GNU_SOURCE
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define WINDOW 64
#define FAIL(...) do { fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } while (0)

static struct fid_fabric *fabric;
static struct fid_domain *domain;
static struct fid_ep *ep;
static struct fid_cq *cq;
static struct fid_av *av;

/* Close what setup() opened, at exit (also after a failure): a provider may keep state
 * beyond the process otherwise (the shm provider's regions in /dev/shm, whose names a
 * later process with the same pid could not take). */
static void teardown(void)
{
	if (ep)
		fi_close(&ep->fid);
	if (av)
		fi_close(&av->fid);
	if (cq)
		fi_close(&cq->fid);
	if (domain)
		fi_close(&domain->fid);
	if (fabric)
		fi_close(&fabric->fid);
	ep = NULL, av = NULL, cq = NULL, domain = NULL, fabric = NULL;
}

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec * 1e-9;
}

static void pin(int cpu)
{
	cpu_set_t s;
	CPU_ZERO(&s);
	CPU_SET(cpu, &s);
	if (sched_setaffinity(0, sizeof s, &s) != 0)
		FAIL("cannot run on CPU %d", cpu);
}

static void setup(const char *prov)
{
	struct fi_info *hints = fi_allocinfo(), *info = NULL;
	hints->fabric_attr->prov_name = strdup(prov);
	hints->ep_attr->type = FI_EP_RDM;
	hints->caps = FI_TAGGED;
	hints->domain_attr->threading = FI_THREAD_DOMAIN;
	int r = fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &info);
	if (r != 0)
		FAIL("fi_getinfo(%s): %s", prov, fi_strerror(-r));
	atexit(teardown);
	struct fi_cq_attr ca = { .format = FI_CQ_FORMAT_TAGGED, .size = 1024 };
	struct fi_av_attr aa = { .type = FI_AV_TABLE };
	if (fi_fabric(info->fabric_attr, &fabric, NULL) || fi_domain(fabric, info, &domain, NULL) ||
	    fi_cq_open(domain, &ca, &cq, NULL) || fi_av_open(domain, &aa, &av, NULL) ||
	    fi_endpoint(domain, info, &ep, NULL) || fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV) ||
	    fi_ep_bind(ep, &av->fid, 0) || fi_enable(ep))
		FAIL("%s: setting up an endpoint failed", prov);
	fi_freeinfo(hints);
	fi_freeinfo(info);
}

/* Read exactly `n` bytes from `fd`. */
static void take(int fd, void *p, size_t n)
{
	for (size_t got = 0; got < n;) {
		ssize_t r = read(fd, (char *)p + got, n - got);
		if (r <= 0)
			FAIL("the other process went away");
		got += (size_t)r;
	}
}

static int receiver(const char *prov, long count, int to_sender)
{
	pin(1);
	setup(prov);
	char name[256];
	size_t len = sizeof name;
	if (fi_getname(&ep->fid, name, &len))
		FAIL("fi_getname");
	if (write(to_sender, &len, sizeof len) != sizeof len || write(to_sender, name, len) != (ssize_t)len)
		FAIL("cannot hand the address over");
	static uint64_t slot[WINDOW];
	long posted = 0, got = 0;
	unsigned long long sum = 0;
	for (int k = 0; k < WINDOW && posted < count; k++, posted++)
		if (fi_trecv(ep, &slot[k], 8, NULL, FI_ADDR_UNSPEC, 1, 0, &slot[k]))
			FAIL("fi_trecv");
	struct fi_cq_tagged_entry e[WINDOW];
	double end = now() + 120;
	while (got < count) {
		ssize_t n = fi_cq_read(cq, e, WINDOW);
		if (n == -FI_EAGAIN) {
			if (now() > end)
				FAIL("%ld of %ld messages after 120 s", got, count);
			continue;
		}
		if (n < 0)
			FAIL("fi_cq_read: %s", fi_strerror((int)-n));
		for (ssize_t k = 0; k < n; k++) {
			uint64_t *s = e[k].op_context;
			sum += *s;
			got++;
			if (posted < count) {
				if (fi_trecv(ep, s, 8, NULL, FI_ADDR_UNSPEC, 1, 0, s))
					FAIL("fi_trecv");
				posted++;
			}
		}
	}
	unsigned long long want = (unsigned long long)count * (count - 1) / 2;
	if (sum != want)
		FAIL("the messages' numbers sum to %llu, not %llu", sum, want);
	char done = 1;
	if (write(to_sender, &done, 1) != 1)
		FAIL("cannot say done");
	return 0;
}

int main(int argc, char **argv)
{
	if (argc < 3)
		FAIL("usage: fi_rate PROVIDER COUNT");
	const char *prov = argv[1];
	long count = atol(argv[2]);
	if (count < 1)
		FAIL("COUNT must be at least 1");
	int up[2];
	if (pipe(up))
		FAIL("pipe");
	pid_t child = fork();
	if (child < 0)
		FAIL("fork");
	if (child == 0)
		exit(receiver(prov, count, up[1]));
	pin(0);
	setup(prov);
	size_t len;
	char name[256];
	take(up[0], &len, sizeof len);
	if (len > sizeof name)
		FAIL("an address of %zu bytes", len);
	take(up[0], name, len);
	fi_addr_t to;
	if (fi_av_insert(av, name, 1, &to, 0, NULL) != 1)
		FAIL("fi_av_insert");
	struct fi_cq_tagged_entry e[16];
	double t0 = now(), end = t0 + 120;
	for (long i = 0; i < count; i++) {
		uint64_t v = (uint64_t)i;
		ssize_t r;
		while ((r = fi_tinject(ep, &v, 8, to, 1)) == -FI_EAGAIN) {
			fi_cq_read(cq, e, 16);
			if (now() > end)
				FAIL("message %ld of %ld still not sent after 120 s", i, count);
		}
		if (r != 0)
			FAIL("fi_tinject: %s", fi_strerror((int)-r));
	}
	/* (making progress meanwhile: a provider may need its sender's to finish) */
	struct pollfd pf = { .fd = up[0], .events = POLLIN };
	while (poll(&pf, 1, 0) == 0) {
		fi_cq_read(cq, e, 16);
		if (now() > end)
			FAIL("the receiver did not finish within 120 s");
	}
	char done;
	take(up[0], &done, 1);
	double t1 = now();
	int status;
	if (waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
		FAIL("the receiver failed");
	printf("rate msgs_per_s %.0f count %ld\n", count / (t1 - t0), count);
	return 0;
}
