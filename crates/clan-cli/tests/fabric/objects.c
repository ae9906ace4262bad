/* The clan provider's objects through libfabric's own API: fabric, domain, address vector,
 * completion and event queues, endpoints, counters, memory registration and remote memory
 * access, peeks; bad arguments refused by code, never a crash. Prints "ok". */
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>
#include <stdint.h>
#include <time.h>
#include <rdma/fi_errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAILED %s:%d: ", __FILE__, __LINE__); \
	fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } } while (0)
#define ADDR_LEN 64

/* The next completion of `cq` within 5 s: 1 (in *e), -1 (an error, in *ee), 0 (none). */
static int next(struct fid_cq *cq, struct fi_cq_tagged_entry *e, struct fi_cq_err_entry *ee)
{
	time_t end = time(NULL) + 5;
	while (time(NULL) <= end) {
		ssize_t n = fi_cq_read(cq, e, 1);
		if (n == 1)
			return 1;
		if (n == -FI_EAVAIL) {
			CHECK(fi_cq_readerr(cq, ee, 0) == 1, "readerr");
			return -1;
		}
		if (n != -FI_EAGAIN)
			return 0;
	}
	return 0;
}

/* The error code `cq`'s next completion fails with (0: it succeeded; its context in *ctx). */
static int outcome(struct fid_cq *cq, void **ctx)
{
	struct fi_cq_tagged_entry e;
	struct fi_cq_err_entry ee = { 0 };
	int r = next(cq, &e, &ee);
	CHECK(r != 0, "no completion within 5 s");
	*ctx = r > 0 ? e.op_context : ee.op_context;
	return r > 0 ? 0 : ee.err;
}

int main(void)
{
	struct fi_info *hints = fi_allocinfo(), *info = NULL, *ours = NULL;
	hints->fabric_attr->prov_name = strdup("clan");
	hints->ep_attr->type = FI_EP_RDM;
	hints->caps = FI_MSG | FI_TAGGED;
	int r = fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &info);
	CHECK(r == 0, "fi_getinfo: %s", fi_strerror(-r));
	for (struct fi_info *i = info; i; i = i->next)
		if (!strcmp(i->fabric_attr->prov_name, "clan") && !ours)
			ours = i;
	CHECK(ours, "no info of the clan provider itself");
	CHECK(ours->ep_attr->type == FI_EP_RDM && (ours->caps & FI_TAGGED), "the RDM entry");
	CHECK(ours->domain_attr->data_progress == FI_PROGRESS_MANUAL, "data progress is manual");

	/* The threading level asked for is the one reported. */
	struct fi_info *h2 = fi_dupinfo(hints), *i2 = NULL;
	h2->domain_attr->threading = FI_THREAD_DOMAIN;
	CHECK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h2, &i2) == 0 && i2->domain_attr->threading == FI_THREAD_DOMAIN,
	      "FI_THREAD_DOMAIN asked, given");
	fi_freeinfo(i2);
	i2 = NULL;
	fi_freeinfo(h2);

	struct fid_fabric *fabric;
	r = fi_fabric(ours->fabric_attr, &fabric, NULL);
	CHECK(r == 0, "fi_fabric: %s", fi_strerror(-r));
	struct fid_domain *domain;
	r = fi_domain(fabric, ours, &domain, NULL);
	CHECK(r == 0, "fi_domain: %s", fi_strerror(-r));

	/* Address vector: a good address in, a bad one refused; lookup, text, remove. */
	struct fi_av_attr av_attr = { .type = FI_AV_TABLE };
	struct fid_av *av;
	r = fi_av_open(domain, &av_attr, &av, NULL);
	CHECK(r == 0, "fi_av_open: %s", fi_strerror(-r));
	char addrs[2][ADDR_LEN];
	memset(addrs, 0, sizeof addrs);
	strcpy(addrs[0], "127.0.0.1:7000/3");
	strcpy(addrs[1], "not an address");
	fi_addr_t fa[2];
	r = fi_av_insert(av, addrs, 2, fa, 0, NULL);
	CHECK(r == 1, "one of two inserted, got %d", r);
	CHECK(fa[0] == 0 && fa[1] == FI_ADDR_NOTAVAIL, "indices %llu %llu", (unsigned long long)fa[0],
	      (unsigned long long)fa[1]);
	char back[ADDR_LEN];
	size_t len = sizeof back;
	r = fi_av_lookup(av, fa[0], back, &len);
	CHECK(r == 0 && len == ADDR_LEN && !strcmp(back, "127.0.0.1:7000/3"), "lookup: %d %zu %s", r, len, back);
	char text[64];
	len = sizeof text;
	fi_av_straddr(av, addrs[0], text, &len);
	CHECK(!strcmp(text, "clan://127.0.0.1:7000/3"), "straddr: %s", text);
	CHECK(fi_av_lookup(av, 42, back, &len) < 0, "lookup of nothing");
	CHECK(fi_av_remove(av, fa, 1, 0) == 0, "remove");
	CHECK(fi_av_lookup(av, fa[0], back, &len) < 0, "lookup after remove");
	CHECK(fi_av_insert(av, NULL, 1, fa, 0, NULL) == -FI_EINVAL, "a null address array");

	/* Completion queue: nothing to read, a bounded blocking read, a signal. */
	struct fi_cq_attr cq_attr = { .format = FI_CQ_FORMAT_TAGGED, .wait_obj = FI_WAIT_UNSPEC, .size = 16 };
	struct fid_cq *cq;
	r = fi_cq_open(domain, &cq_attr, &cq, NULL);
	CHECK(r == 0, "fi_cq_open: %s", fi_strerror(-r));
	struct fi_cq_tagged_entry e[4];
	CHECK(fi_cq_read(cq, e, 4) == -FI_EAGAIN, "an empty queue");
	CHECK(fi_cq_sread(cq, e, 4, NULL, 10) == -FI_EAGAIN, "a blocking read that times out");
	CHECK(fi_cq_signal(cq) == 0 && fi_cq_sread(cq, e, 4, NULL, 10000) == -FI_ECANCELED, "signal");
	struct fi_cq_err_entry err = { 0 };
	CHECK(fi_cq_readerr(cq, &err, 0) == -FI_EAGAIN, "no error");
	CHECK(strlen(fi_cq_strerror(cq, 2, NULL, NULL, 0)) > 0, "strerror");
	int fd = -1;
	CHECK(fi_control(&cq->fid, FI_GETWAIT, &fd) == -FI_ENODATA, "no descriptor without FI_WAIT_FD");
	struct fi_cq_attr fd_attr = { .format = FI_CQ_FORMAT_TAGGED, .wait_obj = FI_WAIT_FD };
	struct fid_cq *cq2;
	CHECK(fi_cq_open(domain, &fd_attr, &cq2, NULL) == 0, "a queue with a wait descriptor");
	CHECK(fi_control(&cq2->fid, FI_GETWAIT, &fd) == 0 && fd >= 0, "its descriptor");
	enum fi_wait_obj obj;
	CHECK(fi_control(&cq2->fid, FI_GETWAITOBJ, &obj) == 0 && obj == FI_WAIT_FD, "its wait object");
	struct fid *fids[1] = { &cq2->fid };
	CHECK(fi_trywait(fabric, fids, 1) == 0, "nothing to read: may wait");
	CHECK(fi_trywait(fabric, NULL, 1) == -FI_EINVAL, "trywait without objects");
	CHECK(fi_control(&cq2->fid, FI_GETWAIT, NULL) == -FI_EINVAL, "no argument");
	CHECK(fi_close(&cq2->fid) == 0, "close");
	struct fi_cq_attr bad = { .format = FI_CQ_FORMAT_TAGGED, .wait_obj = FI_WAIT_MUTEX_COND };
	CHECK(fi_cq_open(domain, &bad, &cq2, NULL) == -FI_ENOSYS, "a mutex wait object is not offered");

	/* Event queue: what the application writes comes back, in order; sizes checked. */
	struct fi_eq_attr eq_attr = { .wait_obj = FI_WAIT_UNSPEC };
	struct fid_eq *eq;
	r = fi_eq_open(fabric, &eq_attr, &eq, NULL);
	CHECK(r == 0, "fi_eq_open: %s", fi_strerror(-r));
	uint32_t event;
	char ebuf[32];
	CHECK(fi_eq_read(eq, &event, ebuf, sizeof ebuf, 0) == -FI_EAGAIN, "an empty event queue");
	CHECK(fi_eq_write(eq, FI_NOTIFY, "hello", 5, 0) == 5, "fi_eq_write");
	CHECK(fi_eq_read(eq, &event, ebuf, 2, 0) == -FI_ETOOSMALL, "a buffer too small");
	CHECK(fi_eq_read(eq, &event, ebuf, sizeof ebuf, FI_PEEK) == 5, "peek");
	CHECK(fi_eq_sread(eq, &event, ebuf, sizeof ebuf, 1000, 0) == 5 && event == FI_NOTIFY &&
	      !memcmp(ebuf, "hello", 5), "the event back");
	CHECK(fi_eq_sread(eq, &event, ebuf, sizeof ebuf, 10, 0) == -FI_EAGAIN, "a blocking read that times out");
	CHECK(fi_close(&eq->fid) == 0, "close");

	/* An endpoint: enabling it before its queues are bound is refused; its name is an
	 * address the vector takes; what is not built (RMA) is refused by code. */
	struct fid_ep *ep;
	r = fi_endpoint(domain, ours, &ep, NULL);
	CHECK(r == 0, "fi_endpoint: %s", fi_strerror(-r));
	CHECK(fi_enable(ep) < 0, "enable without queues");
	CHECK(fi_ep_bind(ep, &av->fid, 0) == 0 && fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV) == 0, "bind");
	CHECK(fi_enable(ep) == 0, "enable");
	char name[ADDR_LEN];
	len = 4;
	CHECK(fi_getname(&ep->fid, name, &len) == -FI_ETOOSMALL && len == ADDR_LEN, "getname, too small");
	CHECK(fi_getname(&ep->fid, name, &len) == 0, "getname");
	CHECK(fi_av_insert(av, name, 1, fa, 0, NULL) == 1, "our own name is an address");
	CHECK(fi_close(&cq->fid) == -FI_EBUSY, "a queue an endpoint uses stays");
	/* A message to ourselves. */
	CHECK(fi_recv(ep, back, sizeof back, NULL, FI_ADDR_UNSPEC, (void *)7) == 0, "recv");
	CHECK(fi_send(ep, "ping", 5, NULL, fa[0], (void *)8) == 0, "send");
	int got = 0;
	for (int i = 0; i < 100000 && got < 2; i++) {
		ssize_t n = fi_cq_read(cq, e, 4);
		if (n > 0)
			for (ssize_t k = 0; k < n; k++)
				got += e[k].op_context == (void *)7 ? (e[k].len == 5 && !strcmp(back, "ping")) : 1;
	}
	CHECK(got == 2, "a send and a receive completion");

	/* Messages from another endpoint, several taken in by one read's progress (the first
	 * completion goes straight to the reader, the rest through the queue): they complete in
	 * the order they came, whether the reads take one entry at a time or four, and with
	 * more arriving while some wait in the queue. */
	{
		struct fid_cq *scq;
		struct fid_ep *sender;
		struct fi_cq_attr sattr = { .format = FI_CQ_FORMAT_TAGGED, .size = 16 };
		CHECK(fi_cq_open(domain, &sattr, &scq, NULL) == 0, "the sender's queue");
		CHECK(fi_endpoint(domain, ours, &sender, NULL) == 0, "a sending endpoint");
		CHECK(fi_ep_bind(sender, &av->fid, 0) == 0 && fi_ep_bind(sender, &scq->fid, FI_TRANSMIT | FI_RECV) == 0,
		      "bind the sender");
		CHECK(fi_enable(sender) == 0, "enable the sender");
		static char many[6][8];
		for (int round = 0; round < 2; round++) {
			for (int k = 0; k < 6; k++)
				CHECK(fi_recv(ep, many[k], sizeof many[k], NULL, FI_ADDR_UNSPEC, (void *)(uintptr_t)(100 + k)) == 0,
				      "recv %d", k);
			/* (one entry at a time: three sent, the first read, three more sent while two
			 * wait in the queue, which come after them) */
			int want = 100, sent = 0;
			for (int i = 0; i < 1000000 && want < 106; i++) {
				while (sent < (round == 0 && want == 100 ? 3 : 6)) {
					char m[8];
					snprintf(m, sizeof m, "m%d", sent);
					CHECK(fi_inject(sender, m, strlen(m) + 1, fa[0]) == 0, "inject %d", sent);
					sent++;
				}
				ssize_t n = fi_cq_read(cq, e, round == 0 ? 1 : 4);
				CHECK(n > 0 || n == -FI_EAGAIN, "read: %zd", n);
				for (ssize_t k = 0; k < n; k++) {
					CHECK(e[k].op_context == (void *)(uintptr_t)want, "round %d: entry %zd of a read is %p, not %d",
					      round, k, e[k].op_context, want);
					char m[8];
					snprintf(m, sizeof m, "m%d", want - 100);
					CHECK(!strcmp(many[want - 100], m) && e[k].len == strlen(m) + 1, "round %d: message %d", round,
					      want - 100);
					want++;
				}
			}
			CHECK(want == 106, "round %d: six receives completed, not %d", round, want - 100);
			CHECK(fi_cq_read(cq, e, 4) == -FI_EAGAIN, "nothing more");
		}
		/* Reading until the queue is empty, as Open MPI's mtl ofi does after every completion:
		 * the read right after one that found something returns only what is queued (no pass
		 * over the receivers), and the read after it takes in what came meanwhile. */
		CHECK(fi_recv(ep, many[0], sizeof many[0], NULL, FI_ADDR_UNSPEC, (void *)200) == 0 &&
		          fi_recv(ep, many[1], sizeof many[1], NULL, FI_ADDR_UNSPEC, (void *)201) == 0,
		      "two receives");
		CHECK(fi_inject(sender, "a", 2, fa[0]) == 0, "inject a");
		ssize_t n = -FI_EAGAIN;
		for (int i = 0; i < 1000000 && n == -FI_EAGAIN; i++)
			n = fi_cq_read(cq, e, 1);
		CHECK(n == 1 && e[0].op_context == (void *)200 && !strcmp(many[0], "a"), "the first: %zd", n);
		CHECK(fi_inject(sender, "b", 2, fa[0]) == 0, "inject b");
		n = fi_cq_read(cq, e, 1);
		CHECK(n == -FI_EAGAIN, "the read right after a find only looks at the queue: %zd (%p)", n, n > 0 ? e[0].op_context : NULL);
		CHECK(fi_cq_read(cq, e, 1) == 1 && e[0].op_context == (void *)201 && !strcmp(many[1], "b"),
		      "the read after it takes the second in");
		CHECK(fi_close(&sender->fid) == 0 && fi_close(&scq->fid) == 0, "close the sender");
	}

	/* Remote memory access to ourselves, counted. */
	static char target[4096], src[4096], dst[4096];
	struct fid_mr *mr, *ro, *bad_mr;
	CHECK(fi_mr_reg(domain, target, 4000, FI_REMOTE_WRITE | FI_REMOTE_READ, 0, 0, 0, &mr, NULL) == 0, "mr_reg");
	CHECK(fi_mr_reg(domain, target + 2048, 1024, FI_REMOTE_READ, 0, 0, 0, &ro, NULL) == 0, "a read-only one");
	CHECK(fi_mr_reg(domain, NULL, 10, FI_REMOTE_READ, 0, 0, 0, &bad_mr, NULL) == -FI_EINVAL, "no memory");
	CHECK(fi_mr_key(mr) != fi_mr_key(ro) && fi_mr_key(mr) != 0, "keys");
	uint64_t key = fi_mr_key(mr), at = (uint64_t)(uintptr_t)target;
	struct fi_cntr_attr cattr = { .events = FI_CNTR_EVENTS_COMP };
	struct fid_cntr *wc, *rc;
	CHECK(fi_cntr_open(domain, &cattr, &wc, NULL) == 0 && fi_cntr_open(domain, &cattr, &rc, NULL) == 0, "counters");
	CHECK(fi_ep_bind(ep, &wc->fid, FI_WRITE) == 0 && fi_ep_bind(ep, &rc->fid, FI_READ | FI_REMOTE_WRITE) == 0,
	      "bind counters");
	CHECK(fi_ep_bind(ep, &wc->fid, 1ULL << 40) == -FI_EINVAL, "a bind flag that means nothing");
	CHECK(fi_close(&wc->fid) == -FI_EBUSY, "a counter an endpoint uses stays");
	memset(src, 'w', sizeof src);
	void *ctx;
	CHECK(fi_write(ep, src, 100, NULL, fa[0], at + 10, key, (void *)20) == 0, "fi_write");
	CHECK(fi_cntr_wait(wc, 1, 5000) == 0 && fi_cntr_read(wc) == 1, "the write counted");
	CHECK(outcome(cq, &ctx) == 0 && ctx == (void *)20, "the write's completion");
	CHECK(target[9] == 0 && target[10] == 'w' && target[109] == 'w' && target[110] == 0, "written where asked");
	CHECK(fi_read(ep, dst, 50, NULL, fa[0], at + 60, key, (void *)21) == 0, "fi_read");
	CHECK(outcome(cq, &ctx) == 0 && ctx == (void *)21, "the read's completion");
	CHECK(dst[0] == 'w' && dst[49] == 'w' && dst[50] == 0, "read");
	/* (rc counts our reads and the remote writes we served: one of each so far) */
	CHECK(fi_cntr_wait(rc, 2, 5000) == 0, "counted");
	CHECK(fi_writedata(ep, src, 8, NULL, 0xabc, fa[0], at, key, (void *)22) == 0, "fi_writedata");
	int seen = 0;
	for (int k = 0; k < 2; k++) {
		struct fi_cq_tagged_entry x;
		struct fi_cq_err_entry xe;
		CHECK(next(cq, &x, &xe) == 1, "writedata completions");
		if (x.op_context == (void *)22)
			seen |= 1;
		else if ((x.flags & FI_REMOTE_CQ_DATA) && (x.flags & FI_REMOTE_WRITE) && x.data == 0xabc)
			seen |= 2;
	}
	CHECK(seen == 3, "the writer's completion and the target's remote CQ data");
	/* Refused: a wrong key, a range beyond the registration, a write through a read-only
	 * one; nothing is written, the errors are counted. */
	CHECK(fi_write(ep, src, 10, NULL, fa[0], at, key ^ 1, (void *)23) == 0, "post");
	CHECK(outcome(cq, &ctx) == FI_EKEYREJECTED && ctx == (void *)23, "a wrong key");
	CHECK(fi_write(ep, src, 100, NULL, fa[0], at + 3950, key, (void *)24) == 0, "post");
	CHECK(outcome(cq, &ctx) == FI_EINVAL && ctx == (void *)24 && target[3950] == 0, "beyond the registration");
	CHECK(fi_write(ep, src, 10, NULL, fa[0], at + 2048, fi_mr_key(ro), (void *)25) == 0, "post");
	CHECK(outcome(cq, &ctx) == FI_EACCES && ctx == (void *)25 && target[2048] == 0, "read-only");
	CHECK(fi_read(ep, dst, 10, NULL, fa[0], at + 2048, fi_mr_key(ro), (void *)26) == 0, "post");
	CHECK(outcome(cq, &ctx) == 0 && ctx == (void *)26, "but readable");
	CHECK(fi_cntr_readerr(wc) == 3, "three failed writes counted, %llu", (unsigned long long)fi_cntr_readerr(wc));
	CHECK(fi_close(&mr->fid) == 0, "close the registration");
	CHECK(fi_write(ep, src, 10, NULL, fa[0], at, key, (void *)27) == 0, "post");
	CHECK(outcome(cq, &ctx) == FI_EKEYREJECTED && target[0] == 'w' && target[8] == 0, "a closed registration");
	CHECK(fi_cntr_wait(wc, 100, 10) == -FI_ETIMEDOUT, "a bounded counter wait");

	/* Peeks: nothing there, a message there (not taken), claimed, then received. */
	CHECK(fi_tsend(ep, "tagged", 7, NULL, fa[0], 0x55, (void *)30) == 0, "tsend");
	CHECK(outcome(cq, &ctx) == 0 && ctx == (void *)30, "sent");
	char pbuf[16] = { 0 };
	struct iovec iov = { .iov_base = pbuf, .iov_len = sizeof pbuf };
	struct fi_context claim;
	struct fi_msg_tagged tm = { .msg_iov = &iov, .iov_count = 1, .addr = FI_ADDR_UNSPEC, .tag = 0x66,
				    .context = (void *)31 };
	CHECK(fi_trecvmsg(ep, &tm, FI_PEEK) == 0 && outcome(cq, &ctx) == FI_ENOMSG && ctx == (void *)31, "no tag 0x66");
	tm.tag = 0x55;
	struct fi_cq_tagged_entry pe;
	struct fi_cq_err_entry pee;
	CHECK(fi_trecvmsg(ep, &tm, FI_PEEK) == 0 && next(cq, &pe, &pee) == 1 && pe.len == 7 && pe.tag == 0x55,
	      "found, with its length and tag");
	tm.context = &claim;
	CHECK(fi_trecvmsg(ep, &tm, FI_PEEK | FI_CLAIM) == 0 && outcome(cq, &ctx) == 0 && ctx == &claim, "claimed");
	tm.context = (void *)32;
	CHECK(fi_trecvmsg(ep, &tm, FI_PEEK) == 0 && outcome(cq, &ctx) == FI_ENOMSG, "a claimed message is not found");
	tm.context = (void *)33;
	CHECK(fi_trecvmsg(ep, &tm, FI_CLAIM) == -FI_EINVAL, "nothing claimed under another context");
	tm.context = &claim;
	CHECK(fi_trecvmsg(ep, &tm, FI_CLAIM) == 0 && next(cq, &pe, &pee) == 1 && pe.op_context == &claim &&
	      pe.len == 7 && !strcmp(pbuf, "tagged"), "the claimed message received");
	CHECK(fi_ep_bind(ep, &wc->fid, 0) == -FI_EINVAL, "no flags");

	/* Automatic data progress: a domain whose thread serves a remote write into its
	 * registration while this program never calls into that domain's objects (with manual
	 * progress the write would wait forever). */
	struct fi_info *ah = fi_dupinfo(ours), *ai = NULL;
	ah->domain_attr->data_progress = FI_PROGRESS_AUTO;
	CHECK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, ah, &ai) == 0 && ai->domain_attr->data_progress == FI_PROGRESS_AUTO,
	      "automatic progress when asked");
	struct fid_domain *adom;
	struct fid_av *aav;
	struct fid_cq *acq;
	struct fid_ep *aep;
	struct fid_mr *amr;
	CHECK(fi_domain(fabric, ai, &adom, NULL) == 0, "auto domain");
	CHECK(fi_av_open(adom, &av_attr, &aav, NULL) == 0 && fi_cq_open(adom, &cq_attr, &acq, NULL) == 0, "its av, cq");
	CHECK(fi_endpoint(adom, ai, &aep, NULL) == 0, "its endpoint");
	CHECK(fi_ep_bind(aep, &aav->fid, 0) == 0 && fi_ep_bind(aep, &acq->fid, FI_TRANSMIT | FI_RECV) == 0 &&
	      fi_enable(aep) == 0, "bind, enable");
	static char auto_target[256];
	CHECK(fi_mr_reg(adom, auto_target, sizeof auto_target, FI_REMOTE_WRITE, 0, 0, 0, &amr, NULL) == 0, "mr_reg");
	char aname[ADDR_LEN];
	len = sizeof aname;
	fi_addr_t afa;
	CHECK(fi_getname(&aep->fid, aname, &len) == 0 && fi_av_insert(av, aname, 1, &afa, 0, NULL) == 1, "its address");
	CHECK(fi_write(ep, src, 64, NULL, afa, (uint64_t)(uintptr_t)auto_target, fi_mr_key(amr), (void *)50) == 0, "write");
	CHECK(outcome(cq, &ctx) == 0 && ctx == (void *)50, "served by the other domain's progress thread");
	CHECK(auto_target[0] == 'w' && auto_target[63] == 'w' && auto_target[64] == 0, "written");
	CHECK(fi_close(&adom->fid) == -FI_EBUSY, "a domain with endpoints stays");
	CHECK(fi_close(&aep->fid) == 0 && fi_close(&amr->fid) == 0 && fi_close(&acq->fid) == 0 &&
	      fi_close(&aav->fid) == 0 && fi_close(&adom->fid) == 0, "close the auto domain");
	fi_freeinfo(ai);
	fi_freeinfo(ah);

	/* A serial domain (FI_THREAD_DOMAIN: this program makes one call at a time), whose
	 * queue reads make the progress of its only endpoint without a lock: the queue follows
	 * its endpoints as they are bound and closed (one, none, two, one, none), and never
	 * uses one closed (memcheck would see it). */
	struct fi_info *sh = fi_dupinfo(ours), *si = NULL;
	sh->domain_attr->threading = FI_THREAD_DOMAIN;
	CHECK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, sh, &si) == 0 && si->domain_attr->threading == FI_THREAD_DOMAIN,
	      "a serial domain");
	struct fid_domain *sdom;
	struct fid_av *sav;
	struct fid_cq *scq2;
	struct fid_ep *sx, *sy, *sz;
	CHECK(fi_domain(fabric, si, &sdom, NULL) == 0, "serial domain");
	CHECK(fi_av_open(sdom, &av_attr, &sav, NULL) == 0 && fi_cq_open(sdom, &cq_attr, &scq2, NULL) == 0, "its av, cq");
#define SERIAL_EP(e)                                                                                                \
	CHECK(fi_endpoint(sdom, si, &e, NULL) == 0 && fi_ep_bind(e, &sav->fid, 0) == 0 &&                             \
	      fi_ep_bind(e, &scq2->fid, FI_TRANSMIT | FI_RECV) == 0 && fi_enable(e) == 0, "endpoint " #e)
	SERIAL_EP(sx);
	for (int round = 0; round < 3; round++) {
		if (round == 1) {
			SERIAL_EP(sy);
			SERIAL_EP(sz);
		}
		struct fid_ep *s = round == 0 ? sx : round == 1 ? sy : sz;
		char sname[ADDR_LEN], sbuf[16] = { 0 };
		len = sizeof sname;
		fi_addr_t sfa;
		CHECK(fi_getname(&s->fid, sname, &len) == 0 && fi_av_insert(sav, sname, 1, &sfa, 0, NULL) == 1,
		      "round %d: its address", round);
		CHECK(fi_recv(s, sbuf, sizeof sbuf, NULL, FI_ADDR_UNSPEC, (void *)(uintptr_t)(70 + round)) == 0,
		      "round %d: recv", round);
		CHECK(fi_inject(s, "serial", 7, sfa) == 0, "round %d: inject", round);
		CHECK(outcome(scq2, &ctx) == 0 && ctx == (void *)(uintptr_t)(70 + round) && !strcmp(sbuf, "serial"),
		      "round %d: received through the queue", round);
		/* (round 1 closes one of two: the other is now the queue's only endpoint) */
		CHECK(fi_close(&s->fid) == 0, "round %d: close", round);
		struct fi_cq_tagged_entry se;
		CHECK(fi_cq_read(scq2, &se, 1) == -FI_EAGAIN, "round %d: nothing more", round);
	}
#undef SERIAL_EP
	CHECK(fi_close(&scq2->fid) == 0 && fi_close(&sav->fid) == 0 &&
	      fi_close(&sdom->fid) == 0, "close the serial domain");
	fi_freeinfo(si);
	fi_freeinfo(sh);
	CHECK(fi_close(&ep->fid) == 0, "close the endpoint");
	CHECK(fi_close(&wc->fid) == 0 && fi_close(&rc->fid) == 0 && fi_close(&ro->fid) == 0, "close");

	/* Connected endpoints: a passive endpoint, a refused request, an accepted one with
	 * private data both ways, a message, the peer's name, a shutdown. */
	struct fi_info *mh = fi_allocinfo(), *mi = NULL;
	mh->fabric_attr->prov_name = strdup("clan");
	mh->ep_attr->type = FI_EP_MSG;
	mh->caps = FI_MSG;
	CHECK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, mh, &mi) == 0 && mi->ep_attr->type == FI_EP_MSG, "MSG info");
	struct fid_eq *ceq;
	CHECK(fi_eq_open(fabric, &eq_attr, &ceq, NULL) == 0, "eq");
	struct fid_pep *pep;
	CHECK(fi_passive_ep(fabric, mi, &pep, NULL) == 0, "passive endpoint");
	CHECK(fi_listen(pep) == -FI_ENOEQ, "listening needs an event queue");
	CHECK(fi_pep_bind(pep, &ceq->fid, 0) == 0 && fi_listen(pep) == 0, "listen");
	char pname[ADDR_LEN];
	len = sizeof pname;
	CHECK(fi_getname(&pep->fid, pname, &len) == 0 && len == ADDR_LEN, "its name");
	struct fid_ep *cep, *sep;
	CHECK(fi_endpoint(domain, mi, &cep, NULL) == 0, "client endpoint");
	CHECK(fi_connect(cep, pname, NULL, 0) == -FI_ENOEQ, "connecting needs an event queue");
	CHECK(fi_ep_bind(cep, &ceq->fid, 0) == 0 && fi_ep_bind(cep, &cq->fid, FI_TRANSMIT | FI_RECV) == 0, "bind");
	CHECK(fi_enable(cep) == 0, "enable");
	CHECK(fi_send(cep, "early", 6, NULL, 0, (void *)40) == -FI_ENOTCONN, "no send before connecting");
	char big[300] = { 0 };
	CHECK(fi_connect(cep, pname, big, sizeof big) == -FI_EINVAL, "too much private data");
	struct {
		struct fi_eq_cm_entry e;
		char data[16];
	} ev;
	uint32_t cev;
	struct fi_eq_err_entry eqerr = { 0 };
	for (int round = 0; round < 2; round++) {
		CHECK(fi_connect(cep, pname, "hi", 3) == 0, "connect");
		CHECK(fi_connect(cep, pname, "hi", 3) == -FI_EISCONN, "connecting already");
		ssize_t m = fi_eq_sread(ceq, &cev, &ev, sizeof ev, 5000, 0);
		CHECK(m == (ssize_t)sizeof(struct fi_eq_cm_entry) + 3 && cev == FI_CONNREQ && !strcmp(ev.data, "hi") &&
		      ev.e.info && ev.e.info->handle && ev.e.fid == &pep->fid, "a connection request: %zd %u", m, cev);
		if (round == 0) {
			/* Refused: the client hears it as an error event. */
			CHECK(fi_reject(pep, ev.e.info->handle, NULL, 0) == 0, "reject");
			CHECK(fi_reject(pep, ev.e.info->handle, NULL, 0) == -FI_EINVAL, "a request is answered once");
			/* Handles that are no request: looked up, never read. */
			CHECK(fi_reject(pep, (fid_t)(uintptr_t)0x10, NULL, 0) == -FI_EINVAL, "a made-up handle");
			CHECK(fi_reject(pep, &pep->fid, NULL, 0) == -FI_EINVAL, "another object's handle");
			fi_freeinfo(ev.e.info);
			CHECK(fi_eq_sread(ceq, &cev, &ev, sizeof ev, 5000, 0) == -FI_EAVAIL, "an error event");
			CHECK(fi_eq_readerr(ceq, &eqerr, 0) > 0 && eqerr.err == FI_ECONNREFUSED && eqerr.fid == &cep->fid,
			      "refused: %d", eqerr.err);
		}
	}
	CHECK(fi_endpoint(domain, ev.e.info, &sep, NULL) == 0, "the endpoint that takes the connection");
	fi_freeinfo(ev.e.info);
	CHECK(fi_ep_bind(sep, &ceq->fid, 0) == 0 && fi_ep_bind(sep, &cq->fid, FI_TRANSMIT | FI_RECV) == 0, "bind");
	CHECK(fi_enable(sep) == 0, "enable");
	CHECK(fi_accept(sep, "ok", 3) == 0, "accept");
	CHECK(fi_accept(sep, "ok", 3) == -FI_EISCONN, "accepted already");
	int connected = 0;
	for (int k = 0; k < 2; k++) {
		ssize_t m = fi_eq_sread(ceq, &cev, &ev, sizeof ev, 5000, 0);
		CHECK(m >= (ssize_t)sizeof(struct fi_eq_cm_entry) && cev == FI_CONNECTED, "connected: %zd %u", m, cev);
		if (ev.e.fid == &sep->fid)
			connected |= 1;
		if (ev.e.fid == &cep->fid && m == (ssize_t)sizeof(struct fi_eq_cm_entry) + 3 && !strcmp(ev.data, "ok"))
			connected |= 2;
	}
	CHECK(connected == 3, "both ends connected, the client with the server's private data");
	char mbuf[16] = { 0 }, peer[ADDR_LEN], sname[ADDR_LEN];
	CHECK(fi_recv(sep, mbuf, sizeof mbuf, NULL, FI_ADDR_UNSPEC, (void *)41) == 0, "recv");
	CHECK(fi_send(cep, "over", 5, NULL, 0, (void *)42) == 0, "send");
	void *c1, *c2;
	CHECK(outcome(cq, &c1) == 0 && outcome(cq, &c2) == 0 && c1 != c2 && !strcmp(mbuf, "over"), "delivered");
	len = sizeof peer;
	size_t slen = sizeof sname;
	CHECK(fi_getpeer(cep, peer, &len) == 0 && fi_getname(&sep->fid, sname, &slen) == 0 && !memcmp(peer, sname, ADDR_LEN),
	      "the client's peer is the accepting endpoint");
	CHECK(fi_shutdown(cep, 0) == 0, "shutdown");
	CHECK(fi_eq_sread(ceq, &cev, &ev, sizeof ev, 5000, 0) == (ssize_t)sizeof(struct fi_eq_cm_entry) &&
	      cev == FI_SHUTDOWN && ev.e.fid == &sep->fid, "the peer hears the shutdown");
	CHECK(fi_send(cep, "late", 5, NULL, 0, (void *)43) == -FI_ENOTCONN, "no send after shutdown");
	CHECK(fi_close(&ceq->fid) == -FI_EBUSY, "an event queue in use stays");
	CHECK(fi_close(&cep->fid) == 0 && fi_close(&sep->fid) == 0 && fi_close(&pep->fid) == 0, "close");
	CHECK(fi_close(&ceq->fid) == 0, "close");
	fi_freeinfo(mi);
	fi_freeinfo(mh);

	CHECK(fi_close(&cq->fid) == 0 && fi_close(&av->fid) == 0, "close");
	CHECK(fi_close(&domain->fid) == 0 && fi_close(&fabric->fid) == 0, "close");
	fi_freeinfo(info);
	fi_freeinfo(hints);
	printf("ok\n");
	return 0;
}
