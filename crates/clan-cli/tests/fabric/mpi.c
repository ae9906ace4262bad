/* An MPI program of our own, run by Open MPI and by MPICH over the clan libfabric provider:
 * a ping-pong with every byte checked (1 B to 1 MiB), an all-reduce, many messages from
 * every rank to rank 0 received with MPI_ANY_SOURCE / MPI_ANY_TAG, some of them
 * nonblocking, and one-sided puts and gets through a window. Prints "ok" on rank 0. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "rank %d FAILED line %d: ", rank, __LINE__); \
	fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); MPI_Abort(MPI_COMM_WORLD, 1); } } while (0)

static unsigned char pat(size_t i, int round) { return (unsigned char)(i * 31 + round * 7 + (i >> 9)); }

int main(int argc, char **argv)
{
	int rank, n;
	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &n);
	size_t max = 1 << 20;
	unsigned char *buf = malloc(max);

	/* Ping-pong between ranks 0 and 1, every byte checked both ways. */
	size_t sizes[] = { 1, 8, 100, 4096, 65536, 300000, 1 << 20 };
	for (int s = 0; s < (int)(sizeof sizes / sizeof *sizes); s++) {
		size_t len = sizes[s];
		for (int r = 0; r < 5 && rank < 2; r++) {
			if (rank == 0) {
				for (size_t i = 0; i < len; i++) buf[i] = pat(i, r);
				MPI_Send(buf, (int)len, MPI_BYTE, 1, s, MPI_COMM_WORLD);
				memset(buf, 0, len);
				MPI_Recv(buf, (int)len, MPI_BYTE, 1, s, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
				for (size_t i = 0; i < len; i++) CHECK(buf[i] == (unsigned char)~pat(i, r), "echo byte %zu of %zu", i, len);
			} else {
				MPI_Status st;
				MPI_Recv(buf, (int)len, MPI_BYTE, 0, s, MPI_COMM_WORLD, &st);
				int got;
				MPI_Get_count(&st, MPI_BYTE, &got);
				CHECK((size_t)got == len, "length %d of %zu", got, len);
				for (size_t i = 0; i < len; i++) {
					CHECK(buf[i] == pat(i, r), "byte %zu of %zu", i, len);
					buf[i] = ~buf[i];
				}
				MPI_Send(buf, (int)len, MPI_BYTE, 0, s, MPI_COMM_WORLD);
			}
		}
	}

	/* All-reduce of a vector. */
	double v[1000], sum[1000];
	for (int i = 0; i < 1000; i++) v[i] = rank * 1000 + i;
	MPI_Allreduce(v, sum, 1000, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
	for (int i = 0; i < 1000; i++)
		CHECK(sum[i] == (double)n * i + 1000.0 * n * (n - 1) / 2, "allreduce %d: %f", i, sum[i]);

	/* Many messages to rank 0: wildcards, tags, sources, and nonblocking sends. */
	const int per = 500;
	if (rank == 0) {
		int *seen = calloc(n, sizeof(int));
		for (int k = 0; k < per * (n - 1); k++) {
			int msg[2];
			MPI_Status st;
			MPI_Recv(msg, 2, MPI_INT, MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &st);
			CHECK(st.MPI_SOURCE == msg[0] && st.MPI_TAG == msg[1] % 16, "source %d tag %d for %d/%d",
			      st.MPI_SOURCE, st.MPI_TAG, msg[0], msg[1]);
			CHECK(msg[1] == seen[msg[0]], "order from %d: %d, expected %d", msg[0], msg[1], seen[msg[0]]);
			seen[msg[0]]++;
		}
		free(seen);
	} else {
		MPI_Request req[16];
		int msgs[16][2];
		for (int k = 0; k < per; k += 16) {
			for (int j = 0; j < 16 && k + j < per; j++) {
				msgs[j][0] = rank;
				msgs[j][1] = k + j;
				MPI_Isend(msgs[j], 2, MPI_INT, 0, (k + j) % 16, MPI_COMM_WORLD, &req[j]);
			}
			MPI_Waitall(k + 16 <= per ? 16 : per - k, req, MPI_STATUSES_IGNORE);
		}
	}
	MPI_Barrier(MPI_COMM_WORLD);

	/* One-sided: every rank puts into its right neighbour's window and gets from its left
	 * neighbour's, both checked (MPICH does these through the provider's RMA). */
	{
		const int words = 4096;
		int *win_buf = calloc(words, sizeof(int)), *mine = malloc(words * sizeof(int));
		MPI_Win win;
		MPI_Win_create(win_buf, words * sizeof(int), sizeof(int), MPI_INFO_NULL, MPI_COMM_WORLD, &win);
		int right = (rank + 1) % n, left = (rank + n - 1) % n;
		for (int i = 0; i < words; i++) mine[i] = rank * 100000 + i;
		MPI_Win_fence(0, win);
		MPI_Put(mine, words, MPI_INT, right, 0, words, MPI_INT, win);
		MPI_Win_fence(0, win);
		for (int i = 0; i < words; i++) CHECK(win_buf[i] == left * 100000 + i, "put word %d: %d", i, win_buf[i]);
		memset(mine, 0, words * sizeof(int));
		MPI_Get(mine, words, MPI_INT, left, 0, words, MPI_INT, win);
		MPI_Win_fence(0, win);
		for (int i = 0; i < words; i++)
			CHECK(mine[i] == ((left + n - 1) % n) * 100000 + i, "get word %d: %d", i, mine[i]);
		MPI_Win_free(&win);
		free(win_buf);
		free(mine);
	}
	MPI_Barrier(MPI_COMM_WORLD);
	if (rank == 0) printf("ok\n");
	free(buf);
	MPI_Finalize();
	return 0;
}
