// ring.h: the ring algorithm and its indexing, written once (docs/ring.md shows it run).
// Every transport (host shared memory, CUDA IPC) and the Python mirror
// ringcoll/learning/schedule.py use exactly these functions; elsewhere the code points here.
//
// P ranks stand on a ring: rank k receives from its left neighbour k-1 and sends to its
// right neighbour k+1 (mod P). A message of n elements is cut into P chunks:
//
//     chunk c = [c*q + min(c, r), (c+1)*q + min(c+1, r)),   q = n / P, r = n % P
//
// so the first r chunks hold one element more; with n < P some chunks are empty.
//
// Reduce-scatter, P-1 steps. Before step 0 rank k publishes its own copy of chunk k-1.
// At step s rank k receives chunk k-s-2 from its left neighbour, already reduced over
// ranks k-s-1 .. k-1 (s+1 of them), and adds its own copy of that chunk; at the last step (s = P-2)
// that chunk is k itself and now holds the contributions of all P ranks:
//
//        step 0            step 1                        after P-1 steps
//   r0 --c3--> r1     r0 --c2--> r1                      rank k holds chunk k reduced
//   ^           |     ^           |     (P = 4 shown)
//   c1         c0     c0         c3
//   |           v     |           v
//   r3 <--c2-- r2     r3 <--c1-- r2
//
// All-gather, P-1 steps: at step s rank k sends chunk k-s (its own at step 0, then the
// one it just received) and receives chunk k-s-1. After P-1 steps every rank holds all.
//
// Each rank sends (P-1) chunks in either phase: (P-1)/P * n elements, 2(P-1)/P * n for
// all-reduce = reduce-scatter + all-gather.
#pragma once

#include "ringcoll/collectives.h"
#include "ringcoll/platform.h"

namespace ringcoll {

// Non-negative remainder: the ring arithmetic below subtracts past zero.
RINGCOLL_INLINE int ring_mod(int64_t x, int world) {
  int64_t m = x % world;
  return static_cast<int>(m < 0 ? m + world : m);
}

RINGCOLL_INLINE int left_neighbour(int rank, int world) { return ring_mod(rank - 1, world); }
RINGCOLL_INLINE int right_neighbour(int rank, int world) { return ring_mod(rank + 1, world); }

// First element of chunk c of an n-element message split over `world` chunks; c may be
// `world`, which gives n (the end of the last chunk).
RINGCOLL_INLINE int64_t chunk_begin(int64_t n, int world, int c) {
  const int64_t q = n / world, r = n % world;
  return c * q + (c < r ? c : r);
}
RINGCOLL_INLINE int64_t chunk_end(int64_t n, int world, int c) { return chunk_begin(n, world, c + 1); }
RINGCOLL_INLINE int64_t chunk_length(int64_t n, int world, int c) {
  return chunk_end(n, world, c) - chunk_begin(n, world, c);
}
// The longest chunk: the first one (chunks differ by at most one element).
RINGCOLL_INLINE int64_t max_chunk_length(int64_t n, int world) { return chunk_length(n, world, 0); }

// Reduce-scatter, step s in [0, P-2]: the chunk rank k sends and the one it receives.
RINGCOLL_INLINE int rs_send_chunk(int rank, int step, int world) { return ring_mod(rank - step - 1, world); }
RINGCOLL_INLINE int rs_recv_chunk(int rank, int step, int world) { return ring_mod(rank - step - 2, world); }
// The order in which the reduce-scatter reduces chunk c: its i-th contribution, i in
// [0, P-1], is rank c+1+i's (rank c+1 publishes its raw copy, each rank on the way round
// adds its own, rank c last). A path that reduces without the ring (the host's one-shot)
// folds in this order too, so every path gives the ring's bits.
RINGCOLL_INLINE int rs_contributor(int chunk, int i, int world) { return ring_mod(chunk + 1 + i, world); }
// All-gather, step s in [0, P-2].
RINGCOLL_INLINE int ag_send_chunk(int rank, int step, int world) { return ring_mod(rank - step, world); }
RINGCOLL_INLINE int ag_recv_chunk(int rank, int step, int world) { return ring_mod(rank - step - 1, world); }

// The three collectives (collectives.h) as sequences of ring steps. All-reduce is the
// reduce-scatter steps followed by the all-gather steps; ring_step_* describe step t of
// that sequence.

RINGCOLL_INLINE int ring_steps(Collective coll, int world) {
  return coll == Collective::kAllReduce ? 2 * (world - 1) : world - 1;
}
RINGCOLL_INLINE bool step_reduces(Collective coll, int step, int world) {
  return coll == Collective::kReduceScatter || (coll == Collective::kAllReduce && step < world - 1);
}
// The chunk rank k receives at step t of the whole collective.
RINGCOLL_INLINE int step_recv_chunk(Collective coll, int rank, int step, int world) {
  return step_reduces(coll, step, world) ? rs_recv_chunk(rank, step, world)
                                         : ag_recv_chunk(rank, coll == Collective::kAllReduce ? step - (world - 1) : step, world);
}
// The chunk rank k publishes before step 0: its raw copy of chunk k-1 for a reducing
// collective, its own chunk k for all-gather.
RINGCOLL_INLINE int first_send_chunk(Collective coll, int rank, int world) {
  return coll == Collective::kAllGather ? ag_send_chunk(rank, 0, world) : rs_send_chunk(rank, 0, world);
}
// Whether the chunk received at step t is final (reduced over every rank, or gathered)
// and so belongs in the output: the last reduce-scatter step and every all-gather step.
RINGCOLL_INLINE bool step_writes_output(Collective coll, int step, int world) {
  return !step_reduces(coll, step, world) || step == world - 2;
}
// Whether the chunk received at step t is passed on to the right neighbour: every step
// but the last. (What rank k receives at step t it sends at step t+1.)
RINGCOLL_INLINE bool step_forwards(Collective coll, int step, int world) {
  return step + 1 < ring_steps(coll, world);
}

}  // namespace ringcoll
