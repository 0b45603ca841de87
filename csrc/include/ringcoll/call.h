// call.h: how a collective call becomes ring work, written once for the three transports
// (host shared memory, CUDA IPC, the CPU emulator of the CUDA kernels).
//
// Two counts, never to be confused:
//   user_count  what the caller passes: elements of the all-reduce tensor, of the
//               reduce-scatter output, of the all-gather input (per rank), of the
//               broadcast or reduce tensor
//   ring_count  the whole message the ring cuts into P chunks (ring_loop.h), in elements
//               of the type the ring moves: n for all-reduce and reduce, P*m for
//               reduce-scatter, and for the collectives that only move bytes, in bytes:
//               P*m*dtype_size for all-gather, n*dtype_size for broadcast
//
// The registered buffer of every rank is kBanks x P slots, each a multiple of the
// transport's slot alignment (host: 64 bytes, a cache line; CUDA: 128).
#pragma once

#include <cstddef>
#include <stdexcept>

#include "ringcoll/check.h"
#include "ringcoll/descriptor.h"
#include "ringcoll/platform.h"
#include "ringcoll/reduce.h"
#include "ringcoll/ring.h"

namespace ringcoll {

constexpr int kBanks = 2;  // double buffering: slice j+1 fills one bank while slice j is read

// Bytes of one slot when `buffer_bytes` is shared by kBanks x world slots.
RINGCOLL_INLINE size_t slot_bytes_for(size_t buffer_bytes, int world, size_t slot_alignment) {
  const size_t per_slot = buffer_bytes / (static_cast<size_t>(kBanks) * static_cast<size_t>(world));
  return per_slot / slot_alignment * slot_alignment;
}

// Bytes of one bank, the same whatever the number of slots in it: bank b starts at
// b * bank_bytes_for(...) for every plan, and its C slots (slot_bytes_for(..., C, ...) each)
// fit in it. A bank laid out as C slots from bank * C * slot_bytes began a little lower
// for some C than for others (the slots round down), so calls of different chunk counts
// that each wait only for their own bank overlapped (host_plan.cpp).
RINGCOLL_INLINE size_t bank_bytes_for(size_t buffer_bytes, size_t slot_alignment) {
  return buffer_bytes / static_cast<size_t>(kBanks) / slot_alignment * slot_alignment;
}

// The smallest buffer_bytes a transport accepts: one aligned slot per bank and rank.
RINGCOLL_INLINE size_t min_buffer_bytes(int world, size_t slot_alignment) {
  return static_cast<size_t>(kBanks) * slot_alignment * static_cast<size_t>(world);
}

// Throws std::invalid_argument, naming `who`, when buffer_bytes is below that minimum.
inline void check_buffer_bytes(const char* who, size_t buffer_bytes, int world, size_t slot_alignment) {
  RINGCOLL_CHECK(buffer_bytes >= min_buffer_bytes(world, slot_alignment), std::invalid_argument, who,
                 ": buffer_bytes=", buffer_bytes, " is too small for ", world, " ranks: need at least ",
                 min_buffer_bytes(world, slot_alignment));
}

// One call, as the ring sees it.
struct RingCall {
  Collective collective;
  int64_t ring_count;
  int elem_size;              // bytes of the type the ring moves
  CallDescriptor descriptor;  // what ranks compare first (descriptor.h); its count is user_count
};

// The whole message in bytes (all-reduce's tensor, reduce-scatter's input, all-gather's output).
inline size_t message_bytes(const RingCall& call) {
  return static_cast<size_t>(call.ring_count) * static_cast<size_t>(call.elem_size);
}

// The caller's input in bytes: all-gather's is its own chunk of the message, every other's
// the whole message.
inline size_t input_bytes(const RingCall& call, int world) {
  const size_t message = message_bytes(call);
  return call.collective == Collective::kAllGather ? message / static_cast<size_t>(world) : message;
}

inline size_t output_bytes(const RingCall& call, int world) {
  const size_t message = message_bytes(call);
  return call.collective == Collective::kReduceScatter ? message / static_cast<size_t>(world) : message;
}

RINGCOLL_INLINE RingCall ring_call(Collective coll, int64_t user_count, DType dtype, ReduceOp op, int world,
                                   int root = 0) {
  const int size = dtype_size(dtype);
  CallDescriptor descriptor{static_cast<int32_t>(coll), static_cast<int32_t>(dtype),
                            collective_info(coll).reduces ? static_cast<int32_t>(op) : 0, 0, user_count};
  descriptor.root = root;
  switch (coll) {
    case Collective::kAllReduce:
    case Collective::kReduce: return RingCall{coll, user_count, size, descriptor};
    case Collective::kReduceScatter: return RingCall{coll, user_count * world, size, descriptor};
    case Collective::kBroadcast: return RingCall{coll, user_count * size, 1, descriptor};
    case Collective::kAllGather:
    case Collective::kBarrier: break;  // no message: callers never ask
  }
  return RingCall{coll, user_count * size * world, 1, descriptor};
}

// What the GPU transports refuse before anything moves (the host trusts Python's checks):
// a reduction a dtype lacks. All-gather and broadcast take any dtype: they move bytes.
RINGCOLL_INLINE bool is_supported(Collective coll, DType dtype, ReduceOp op) {
  return !collective_info(coll).reduces || is_supported(dtype, op);
}

// The ring's element type and op for a call: all-gather and broadcast move bytes, so one
// instantiation (uint8_t; its op unused) serves every dtype; the reducing collectives
// dispatch on (dtype, op). `fn` takes (T{}, Op{}) tags, as dispatch_dtype_op's.
template <typename Fn>
void dispatch_call(const CallDescriptor& call, Fn&& fn) {
  if (!collective_info(static_cast<Collective>(call.collective)).reduces) fn(uint8_t{}, SumOp{});
  else dispatch_dtype_op(static_cast<DType>(call.dtype), static_cast<ReduceOp>(call.op), fn);
}

// Run a call on a transport: `ring()` when there are peers. With one rank every
// collective's output is its input (each op's finalize is the identity for one rank: AVG
// divides by 1), so `copy(dst, src, bytes)` does it, called only when bytes must move.
template <class Copy, class Ring>
void run_call(const RingCall& call, int world, const void* input, void* output, Copy&& copy, Ring&& ring) {
  if (world > 1) return ring();
  const size_t bytes = message_bytes(call);
  if (input != output && bytes > 0) copy(output, input, bytes);
}

}  // namespace ringcoll
