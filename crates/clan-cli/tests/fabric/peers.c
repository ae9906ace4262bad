/* Two processes over the clan provider, for tests/fabric.rs:
 *
 *   peers server          prints "addr <name>", sleeps on its completion queue's wait
 *                         descriptor (fi_trywait + poll) until the client's first message
 *                         comes, prints the CPU time it used while it slept, answers with
 *                         the key of a registered buffer, serves the client's remote writes
 *                         and reads of it until the client's "done" (and checks what was
 *                         written), posts a receive directed to the client, prints "ready";
 *                         then, told on stdin that the client was killed, expects that
 *                         receive to complete in error (and a send to the client, and a read
 *                         of the client's registered memory, too) and prints how long it took.
 *   peers client ADDR     waits a while (so that the server sleeps), sends its own name,
 *                         takes the answer, writes 256 KiB into the server's buffer and reads
 *                         it back (checked), sends "done" with a key of its own, prints
 *                         "answered", then waits to be killed.
 *
 * Every wait is bounded; any failure exits non-zero with a message. */
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_tagged.h>
#include <rdma/fi_rma.h>
#include <stdint.h>
#include <rdma/fi_errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAILED %s:%d: ", __FILE__, __LINE__); \
	fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } } while (0)
#define ADDR_LEN 64
#define RMA_LEN (256 * 1024)

/* What the server answers, and the client's "done": a registered buffer's key and address. */
struct reg_msg {
	char text[8];
	uint64_t key, addr;
};

static unsigned char pattern(size_t i) { return (unsigned char)(i * 7 + (i >> 10)); }

static struct fid_fabric *fabric;
static struct fid_domain *domain;
static struct fid_av *av;
static struct fid_cq *cq;
static struct fid_ep *ep;

static double now_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static double cpu_ms(void)
{
	struct rusage u;
	getrusage(RUSAGE_SELF, &u);
	return (u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e3 + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e3;
}

static void open_all(void)
{
	struct fi_info *hints = fi_allocinfo(), *info = NULL;
	hints->fabric_attr->prov_name = strdup("clan");
	hints->ep_attr->type = FI_EP_RDM;
	hints->caps = FI_MSG | FI_TAGGED | FI_DIRECTED_RECV | FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
	int r = fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &info);
	CHECK(r == 0, "fi_getinfo: %s", fi_strerror(-r));
	CHECK(!strcmp(info->fabric_attr->prov_name, "clan"), "provider %s", info->fabric_attr->prov_name);
	CHECK(fi_fabric(info->fabric_attr, &fabric, NULL) == 0, "fabric");
	CHECK(fi_domain(fabric, info, &domain, NULL) == 0, "domain");
	struct fi_av_attr av_attr = { .type = FI_AV_TABLE };
	CHECK(fi_av_open(domain, &av_attr, &av, NULL) == 0, "av");
	struct fi_cq_attr cq_attr = { .format = FI_CQ_FORMAT_TAGGED, .wait_obj = FI_WAIT_FD, .size = 64 };
	CHECK(fi_cq_open(domain, &cq_attr, &cq, NULL) == 0, "cq");
	CHECK(fi_endpoint(domain, info, &ep, NULL) == 0, "endpoint");
	CHECK(fi_ep_bind(ep, &av->fid, 0) == 0 && fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV) == 0, "bind");
	CHECK(fi_enable(ep) == 0, "enable");
	fi_freeinfo(info);
	fi_freeinfo(hints);
}

/* The next completion, sleeping on the queue's descriptor between looks (never spinning);
 * -FI_EAVAIL when an error completion is first. */
static ssize_t next(struct fi_cq_tagged_entry *e, int timeout_ms)
{
	int fd;
	CHECK(fi_control(&cq->fid, FI_GETWAIT, &fd) == 0, "FI_GETWAIT");
	double end = now_ms() + timeout_ms;
	for (;;) {
		ssize_t n = fi_cq_read(cq, e, 1);
		if (n != -FI_EAGAIN)
			return n;
		CHECK(now_ms() < end, "nothing came in %d ms", timeout_ms);
		struct fid *fids[1] = { &cq->fid };
		if (fi_trywait(fabric, fids, 1) == 0) {
			struct pollfd p = { .fd = fd, .events = POLLIN };
			poll(&p, 1, (int)(end - now_ms()) + 1);
		}
	}
}

static int server(void)
{
	open_all();
	char name[ADDR_LEN] = { 0 };
	size_t len = sizeof name;
	CHECK(fi_getname(&ep->fid, name, &len) == 0, "getname");
	printf("addr %s\n", name);
	fflush(stdout);

	/* Asleep until the client's first message. */
	char hello[ADDR_LEN + 1] = { 0 };
	CHECK(fi_recv(ep, hello, ADDR_LEN, NULL, FI_ADDR_UNSPEC, (void *)1) == 0, "recv");
	struct fi_cq_tagged_entry e;
	double c0 = cpu_ms(), w0 = now_ms();
	ssize_t n = next(&e, 30000);
	double c1 = cpu_ms(), w1 = now_ms();
	CHECK(n == 1 && e.op_context == (void *)1, "the client's hello: %zd", n);
	printf("slept cpu_ms %.1f wall_ms %.1f\n", c1 - c0, w1 - w0);
	fflush(stdout);

	fi_addr_t client;
	CHECK(fi_av_insert(av, hello, 1, &client, 0, NULL) == 1, "the client's address: %s", hello);
	unsigned char *target = calloc(1, RMA_LEN);
	struct fid_mr *mr;
	CHECK(fi_mr_reg(domain, target, RMA_LEN, FI_REMOTE_WRITE | FI_REMOTE_READ, 0, 0, 0, &mr, NULL) == 0, "mr_reg");
	struct reg_msg ans = { "answer", fi_mr_key(mr), (uint64_t)(uintptr_t)target }, done;
	CHECK(fi_recv(ep, &done, sizeof done, NULL, client, (void *)6) == 0, "recv done");
	CHECK(fi_send(ep, &ans, sizeof ans, NULL, client, (void *)2) == 0, "send");
	/* (the client's writes and reads are served while this waits) */
	int got = 0;
	while (got != 3) {
		CHECK(next(&e, 30000) == 1, "a completion");
		got |= e.op_context == (void *)2 ? 1 : e.op_context == (void *)6 ? 2 : 0;
	}
	for (size_t i = 0; i < RMA_LEN; i++)
		CHECK(target[i] == pattern(i), "byte %zu the client wrote: %d", i, target[i]);

	/* A receive only the client can complete. */
	char buf[64];
	CHECK(fi_trecv(ep, buf, sizeof buf, NULL, client, 5, 0, (void *)3) == 0, "directed receive");
	printf("ready\n");
	fflush(stdout);

	char line[64];
	CHECK(fgets(line, sizeof line, stdin) && !strncmp(line, "killed", 6), "told that the client is gone");
	double k = now_ms();
	n = next(&e, 10000);
	double took = now_ms() - k;
	CHECK(n == -FI_EAVAIL, "an error completion, got %zd", n);
	struct fi_cq_err_entry err = { 0 };
	CHECK(fi_cq_readerr(cq, &err, 0) == 1, "readerr");
	CHECK(err.op_context == (void *)3 && err.err == FI_ECONNRESET && (err.flags & FI_RECV),
	      "the directed receive failed: ctx %p err %d (%s)", err.op_context, err.err,
	      fi_cq_strerror(cq, err.prov_errno, err.err_data, NULL, 0));
	printf("receive failed after_ms %.1f: %s\n", took, fi_cq_strerror(cq, err.prov_errno, NULL, NULL, 0));

	/* A send to the gone client fails too: at once, or as an error completion. */
	ssize_t r = fi_send(ep, "late", 5, NULL, client, (void *)4);
	if (r == 0) {
		CHECK(next(&e, 10000) == -FI_EAVAIL, "the send completes in error");
		CHECK(fi_cq_readerr(cq, &err, 0) == 1 && err.op_context == (void *)4 && err.err == FI_ECONNRESET,
		      "the send's error: ctx %p err %d", err.op_context, err.err);
	} else {
		CHECK(r == -FI_ECONNRESET, "the send fails: %zd", r);
	}
	/* So does a read of its registered memory. */
	char small[16];
	r = fi_read(ep, small, sizeof small, NULL, client, done.addr, done.key, (void *)7);
	if (r == 0) {
		CHECK(next(&e, 10000) == -FI_EAVAIL, "the read completes in error");
		CHECK(fi_cq_readerr(cq, &err, 0) == 1 && err.op_context == (void *)7 && err.err == FI_ECONNRESET,
		      "the read's error: ctx %p err %d", err.op_context, err.err);
	} else {
		CHECK(r == -FI_ECONNRESET, "the read fails: %zd", r);
	}
	/* A receive directed to it, posted now, fails at once. */
	CHECK(fi_trecv(ep, buf, sizeof buf, NULL, client, 5, 0, (void *)5) == 0, "directed receive");
	CHECK(next(&e, 10000) == -FI_EAVAIL && fi_cq_readerr(cq, &err, 0) == 1 && err.op_context == (void *)5,
	      "a later directed receive fails");

	CHECK(fi_close(&ep->fid) == 0 && fi_close(&cq->fid) == 0 && fi_close(&av->fid) == 0, "close");
	CHECK(fi_close(&mr->fid) == 0, "close");
	CHECK(fi_close(&domain->fid) == 0 && fi_close(&fabric->fid) == 0, "close");
	printf("ok\n");
	return 0;
}

static int client(const char *server_addr)
{
	open_all();
	char addr[ADDR_LEN] = { 0 };
	strncpy(addr, server_addr, ADDR_LEN - 1);
	fi_addr_t srv;
	CHECK(fi_av_insert(av, addr, 1, &srv, 0, NULL) == 1, "the server's address: %s", addr);
	char name[ADDR_LEN] = { 0 };
	size_t len = sizeof name;
	CHECK(fi_getname(&ep->fid, name, &len) == 0, "getname");
	struct reg_msg answer = { { 0 } };
	CHECK(fi_recv(ep, &answer, sizeof answer, NULL, FI_ADDR_UNSPEC, (void *)1) == 0, "recv");
	usleep(400 * 1000); /* the server sleeps meanwhile */
	CHECK(fi_send(ep, name, ADDR_LEN, NULL, srv, (void *)2) == 0, "send");
	struct fi_cq_tagged_entry e;
	int got = 0;
	while (got < 2) {
		ssize_t n = next(&e, 30000);
		CHECK(n == 1, "a completion: %zd", n);
		got++;
	}
	CHECK(!strcmp(answer.text, "answer"), "the answer: %s", answer.text);

	/* Remote memory access to the server's buffer: write it all, read it back. */
	unsigned char *mine = malloc(RMA_LEN), *back = calloc(1, RMA_LEN);
	for (size_t i = 0; i < RMA_LEN; i++)
		mine[i] = pattern(i);
	CHECK(fi_write(ep, mine, RMA_LEN, NULL, srv, answer.addr, answer.key, (void *)3) == 0, "fi_write");
	CHECK(next(&e, 30000) == 1 && e.op_context == (void *)3, "the write completes");
	CHECK(fi_read(ep, back, RMA_LEN, NULL, srv, answer.addr, answer.key, (void *)4) == 0, "fi_read");
	CHECK(next(&e, 30000) == 1 && e.op_context == (void *)4, "the read completes");
	CHECK(!memcmp(mine, back, RMA_LEN), "read back what was written");
	/* A read through a key the server never gave fails, and nothing else does. */
	CHECK(fi_read(ep, back, 16, NULL, srv, answer.addr, answer.key + 1, (void *)5) == 0, "fi_read");
	CHECK(next(&e, 30000) == -FI_EAVAIL, "a forged key");
	struct fi_cq_err_entry err = { 0 };
	CHECK(fi_cq_readerr(cq, &err, 0) == 1 && err.err == FI_EKEYREJECTED, "rejected: %d", err.err);

	struct fid_mr *mr;
	CHECK(fi_mr_reg(domain, back, RMA_LEN, FI_REMOTE_READ, 0, 0, 0, &mr, NULL) == 0, "mr_reg");
	struct reg_msg done = { "done", fi_mr_key(mr), (uint64_t)(uintptr_t)back };
	CHECK(fi_send(ep, &done, sizeof done, NULL, srv, (void *)6) == 0, "send done");
	CHECK(next(&e, 30000) == 1 && e.op_context == (void *)6, "done sent");
	printf("answered\n");
	fflush(stdout);
	sleep(60); /* killed before this ends */
	return 1;
}

int main(int argc, char **argv)
{
	if (argc == 2 && !strcmp(argv[1], "server"))
		return server();
	if (argc == 3 && !strcmp(argv[1], "client"))
		return client(argv[2]);
	fprintf(stderr, "usage: peers server | peers client ADDR\n");
	return 2;
}
