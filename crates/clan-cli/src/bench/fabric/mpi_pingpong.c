/* clan bench fabric: an MPI ping-pong between ranks 0 and 1 (built with the system's mpicc
 * at run time). Usage: mpi_pingpong SIZE ITERS. Rank 0 prints
 *   size SIZE iters ITERS one_way_us_p50 X one_way_us_mean Y mbit_s Z
 * where one way is half a round trip (p50 over rounds of 100 round trips), and mbit_s is
 * SIZE over the mean one-way time. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
	int rank;
	MPI_Init(&argc, &argv);
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
	if (rank == 0) {
		qsort(t, rounds, sizeof *t, cmp);
		double mean = total / rounds;
		printf("size %zu iters %d one_way_us_p50 %.4f one_way_us_mean %.4f mbit_s %.1f\n", size, rounds * batch,
		       t[rounds / 2], mean, size * 8.0 / mean);
	}
	MPI_Finalize();
	return 0;
}
