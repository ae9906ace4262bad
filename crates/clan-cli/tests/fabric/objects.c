/* The clan provider's objects through libfabric's own API: fabric, domain, address vector
 * and completion queue, with bad arguments refused by code, never a crash. Prints "ok". */
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAILED %s:%d: ", __FILE__, __LINE__); \
	fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } } while (0)
#define ADDR_LEN 64

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
	char one[8] = "x";
	CHECK(fi_write(ep, one, 1, NULL, fa[0], 0, 0, NULL) == -FI_ENOSYS, "RMA comes later");
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
	CHECK(fi_close(&ep->fid) == 0, "close the endpoint");

	CHECK(fi_close(&cq->fid) == 0 && fi_close(&av->fid) == 0, "close");
	CHECK(fi_close(&domain->fid) == 0 && fi_close(&fabric->fid) == 0, "close");
	fi_freeinfo(info);
	fi_freeinfo(hints);
	printf("ok\n");
	return 0;
}
