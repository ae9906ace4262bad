/* A TCP echo over loopback in one program: a server thread and a client, N round trips of
 * 64 bytes, then a close; with poll and epoll on the way. usage: echo N */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>
static int port;
static int lfd;
static void *server(void *a) {
	(void)a;
	int c = accept(lfd, NULL, NULL);
	if (c < 0) { perror("accept"); exit(1); }
	int ep = epoll_create1(0);
	struct epoll_event ev = { .events = EPOLLIN, .data.fd = c };
	epoll_ctl(ep, EPOLL_CTL_ADD, c, &ev);
	char b[64];
	for (;;) {
		struct epoll_event out;
		if (epoll_wait(ep, &out, 1, 10000) != 1) { fprintf(stderr, "epoll timeout\n"); exit(1); }
		ssize_t n = read(c, b, sizeof b);
		if (n <= 0) break;
		if (write(c, b, n) != n) { perror("write"); exit(1); }
	}
	close(c); close(ep);
	return NULL;
}
int main(int argc, char **argv) {
	int n = argc > 1 ? atoi(argv[1]) : 100;
	lfd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	if (bind(lfd, (struct sockaddr *)&sa, sizeof sa) || listen(lfd, 4)) { perror("bind"); return 1; }
	socklen_t sl = sizeof sa;
	getsockname(lfd, (struct sockaddr *)&sa, &sl);
	port = ntohs(sa.sin_port);
	pthread_t t;
	pthread_create(&t, NULL, server, NULL);
	int s = socket(AF_INET, SOCK_STREAM, 0);
	int one = 1;
	setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	if (connect(s, (struct sockaddr *)&sa, sizeof sa)) { perror("connect"); return 1; }
	char msg[64], back[64];
	for (int i = 0; i < n; i++) {
		memset(msg, i & 0xff, sizeof msg);
		if (write(s, msg, sizeof msg) != sizeof msg) { perror("write"); return 1; }
		size_t got = 0;
		while (got < sizeof back) {
			struct pollfd p = { .fd = s, .events = POLLIN };
			if (poll(&p, 1, 10000) != 1) { fprintf(stderr, "poll timeout\n"); return 1; }
			ssize_t r = read(s, back + got, sizeof back - got);
			if (r <= 0) { perror("read"); return 1; }
			got += r;
		}
		if (memcmp(msg, back, sizeof msg)) { fprintf(stderr, "mismatch\n"); return 1; }
	}
	close(s);
	pthread_join(t, NULL);
	printf("ok %d\n", n);
	return 0;
}
