/* clan bench fabric: an MPI ping-pong between ranks 0 and 1 (built with the system's mpicc
 * at run time). Usage: mpi_pingpong SIZE ITERS. Rank 0 prints
 *   size SIZE iters ITERS one_way_us_p50 X one_way_us_mean Y mbit_s Z
 *   cpus RANK0 RANK1
 * where one way is half a round trip (p50 over rounds of 100 round trips), mbit_s is SIZE
 * over the mean one-way time, and cpus are the CPUs each rank may run on (a mask of the
 * first 64, in hex): what the caller checks its placement by (a binding mpirun was asked
 * for and silently did not make shows there).
 *
 * mpi_pingpong idle SECONDS: after a first exchange, rank 1 sleeps SECONDS before it sends
 * one message, which rank 0 waits for in MPI_Recv; rank 0 prints
 *   waited_ms W cpu_ms C value V
 * the wall and CPU time of its process over that wait (a rank that blocks uses little CPU;
 * one that spins, all of it), and the value received (42).
 *
 * mpi_pingpong rate SIZE ITERS: rank 0 sends ITERS messages of SIZE bytes to rank 1 in
 * windows of 64 (MPI_Isend, then MPI_Waitall), rank 1 receiving each window the same way
 * (MPI_Irecv) and answering it with an acknowledgement (OSU's osu_mbw_mr, one pair); rank 0
 * prints
 *   rate msgs_per_s R size SIZE
 *   cpus RANK0 RANK1
 * R counting from before the first window to the last acknowledgement. */
#define _GNU_SOURCE
#include <mpi.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double ms(clockid_t c)
{
	struct timespec t;
	clock_gettime(c, &t);
	return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static int idle(double secs)
{
	int rank, v = 0;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	/* A first exchange: the connections are made. */
	if (rank == 0) {
		MPI_Send(&v, 1, MPI_INT, 1, 1, MPI_COMM_WORLD);
		MPI_Recv(&v, 1, MPI_INT, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
		double w0 = ms(CLOCK_MONOTONIC), c0 = ms(CLOCK_PROCESS_CPUTIME_ID);
		MPI_Recv(&v, 1, MPI_INT, 1, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
		double w1 = ms(CLOCK_MONOTONIC), c1 = ms(CLOCK_PROCESS_CPUTIME_ID);
		printf("waited_ms %.1f cpu_ms %.1f value %d\n", w1 - w0, c1 - c0, v);
	} else if (rank == 1) {
		MPI_Recv(&v, 1, MPI_INT, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
		MPI_Send(&v, 1, MPI_INT, 0, 1, MPI_COMM_WORLD);
		usleep((useconds_t)(secs * 1e6));
		v = 42;
		MPI_Send(&v, 1, MPI_INT, 0, 2, MPI_COMM_WORLD);
	}
	MPI_Finalize();
	return 0;
}

#define WINDOW 64

static unsigned long long cpus(void);

static int rate(size_t size, int iters)
{
	int rank, n, ack = 0;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &n);
	int windows = iters / WINDOW > 0 ? iters / WINDOW : 1;
	char *buf = calloc(WINDOW, size ? size : 1);
	MPI_Request req[WINDOW];
	double t0 = 0;
	/* A first window unmeasured (connections, buffers), then the measured ones. */
	for (int w = -1; w < windows && rank < 2; w++) {
		if (w == 0)
			t0 = MPI_Wtime();
		for (int k = 0; k < WINDOW; k++) {
			if (rank == 0)
				MPI_Isend(buf + k * size, size, MPI_BYTE, 1, 3, MPI_COMM_WORLD, &req[k]);
			else
				MPI_Irecv(buf + k * size, size, MPI_BYTE, 0, 3, MPI_COMM_WORLD, &req[k]);
		}
		MPI_Waitall(WINDOW, req, MPI_STATUSES_IGNORE);
		if (rank == 0)
			MPI_Recv(&ack, 1, MPI_INT, 1, 4, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
		else
			MPI_Send(&ack, 1, MPI_INT, 0, 4, MPI_COMM_WORLD);
	}
	double t = MPI_Wtime() - t0;
	unsigned long long mine = cpus(), all[2] = { 0, 0 };
	if (n == 2)
		MPI_Gather(&mine, 1, MPI_UNSIGNED_LONG_LONG, all, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
	if (rank == 0) {
		printf("rate msgs_per_s %.0f size %zu\n", (double)windows * WINDOW / t, size);
		printf("cpus %llx %llx\n", all[0], all[1]);
	}
	free(buf);
	MPI_Finalize();
	return 0;
}

static int cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

/* The CPUs this process may run on, as a mask of the first 64. */
static unsigned long long cpus(void)
{
	cpu_set_t set;
	unsigned long long m = 0;
	if (sched_getaffinity(0, sizeof set, &set) != 0)
		return 0;
	for (int c = 0; c < 64; c++)
		if (CPU_ISSET(c, &set))
			m |= 1ULL << c;
	return m;
}

int main(int argc, char **argv)
{
	int rank;
	MPI_Init(&argc, &argv);
	if (argc > 2 && strcmp(argv[1], "idle") == 0)
		return idle(atof(argv[2]));
	if (argc > 3 && strcmp(argv[1], "rate") == 0)
		return rate(strtoul(argv[2], NULL, 10), atoi(argv[3]));
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	size_t size = argc > 1 ? strtoul(argv[1], NULL, 10) : 8;
	int iters = argc > 2 ? atoi(argv[2]) : 10000;
	int batch = 100, rounds = iters / batch > 0 ? iters / batch : 1;
	char *buf = calloc(size ? size : 1, 1);
	double *t = calloc(rounds, sizeof *t);
	/* Warm up. */
	for (int i = 0; i < 100 && rank < 2; i++) {
		if (rank == 0) {
			MPI_Send(buf, size, MPI_BYTE, 1, 1, MPI_COMM_WORLD);
			MPI_Recv(buf, size, MPI_BYTE, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
		} else {
			MPI_Recv(buf, size, MPI_BYTE, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
			MPI_Send(buf, size, MPI_BYTE, 0, 1, MPI_COMM_WORLD);
		}
	}
	double total = 0;
	for (int r = 0; r < rounds && rank < 2; r++) {
		double t0 = MPI_Wtime();
		for (int i = 0; i < batch; i++) {
			if (rank == 0) {
				MPI_Send(buf, size, MPI_BYTE, 1, 2, MPI_COMM_WORLD);
				MPI_Recv(buf, size, MPI_BYTE, 1, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
			} else {
				MPI_Recv(buf, size, MPI_BYTE, 0, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
				MPI_Send(buf, size, MPI_BYTE, 0, 2, MPI_COMM_WORLD);
			}
		}
		t[r] = (MPI_Wtime() - t0) / batch / 2 * 1e6;
		total += t[r];
	}
	unsigned long long mine = cpus(), all[2] = { 0, 0 };
	int n;
	MPI_Comm_size(MPI_COMM_WORLD, &n);
	if (n == 2)
		MPI_Gather(&mine, 1, MPI_UNSIGNED_LONG_LONG, all, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
	if (rank == 0) {
		qsort(t, rounds, sizeof *t, cmp);
		double mean = total / rounds;
		printf("size %zu iters %d one_way_us_p50 %.4f one_way_us_mean %.4f mbit_s %.1f\n", size, rounds * batch,
		       t[rounds / 2], mean, size * 8.0 / mean);
		printf("cpus %llx %llx\n", all[0], all[1]);
	}
	MPI_Finalize();
	return 0;
}
