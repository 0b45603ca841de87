// ring_loop.h: the ring kernels' step loop (CUDA, and the emulator that runs them on the
// CPU), and the slicing every engine shares (slice_length, num_slices).
//
// The CPU transport runs the ring as a plan (plan.h's ring_plan, host_plan.cpp's engine):
// the same chunks in the same order, so the same bits. On a GPU the ring kernels keep this
// loop, specialised for the two neighbours (device_ring.h), beside the plan kernels
// (device_plan.h). A context `Ctx` supplies
//
//   slot pointers    ctx.my_slot(bank, c) / ctx.left_slot(bank, c): where chunk c of the
//                    current slice sits in my registered buffer / my left neighbour's
//   user memory      ctx.input_at(c, offset) / ctx.output_at(c, offset)
//   strip work       ctx.copy(dst, dst2, src, len)      dst2 may be null
//                    ctx.reduce(dst, dst2, recv, own, len, is_final)
//                    (on a GPU each thread block handles its own tiles of [0, len), strip.h)
//   the protocol     ctx.wait_left_published(v), ctx.publish(v),
//                    ctx.wait_right_consumed(v), ctx.mark_consumed(v)
//                    each wait returns false when it gave up (timeout, peer gone)
//   bookkeeping      ctx.last_publication(slot) -> uint64_t&, ctx.step_base() -> uint64_t&
//                    ctx.set_position(slice, step) for error messages
//
// Protocol. Every publication of every rank carries a number; the numbers of a
// communicator only grow, and all ranks number identically because they run the same
// sequence of calls. In a slice with L ring steps, rank k makes L publications, numbered
// base+1 .. base+L: the first send before step 0, then one forward per step but the last.
// At step i it waits for its left neighbour's publication base+i+1, which is exactly the
// chunk it must receive (ring.h), combines it, and acknowledges by setting its `consumed`
// counter to base+i+1. Before it overwrites a slot of its own buffer it waits until its
// right neighbour has consumed the publication that last filled that slot, so a slow
// reader is never overwritten; with two banks of slots, slice j+1 fills one bank while
// slice j is still being read from the other.
//
// Slicing. Each chunk is cut into slices of at most S = ctx.slice_elems() elements; slice
// j of every chunk travels together. So the buffer size bounds the memory ringcoll uses,
// never the message size.
#pragma once

#include "ringcoll/ring.h"

namespace ringcoll {

// Elements of chunk c that belong to slice j (0 when the chunk is shorter).
RINGCOLL_INLINE int64_t slice_length(int64_t chunk_len, int64_t slice_elems, int64_t slice) {
  const int64_t left = chunk_len - slice * slice_elems;
  return left <= 0 ? 0 : (left < slice_elems ? left : slice_elems);
}
// Number of slices a message needs: every chunk fits in that many slices.
RINGCOLL_INLINE int64_t num_slices(int64_t ring_count, int world, int64_t slice_elems) {
  const int64_t longest = max_chunk_length(ring_count, world);
  return (longest + slice_elems - 1) / slice_elems;
}
RINGCOLL_INLINE int slot_index(int bank, int chunk, int world) { return bank * world + chunk; }

// One unit of ring work: step i of slice j, where i == -1 is the first send before step 0
// (so a slice is the units -1, 0, .., steps-1). Units must run in order: each reads the
// bookkeeping the previous one left. Returns false if a wait gave up.
template <class Ctx>
RINGCOLL_HD bool ring_step(Ctx& ctx, Collective coll, int64_t ring_count, int64_t j, int i) {
  const int rank = ctx.rank(), world = ctx.world();
  const int steps = ring_steps(coll, world);
  const int64_t slice_elems = ctx.slice_elems();
  const int bank = static_cast<int>(j % ctx.banks());
  const uint64_t base = ctx.step_base();  // numbers of this slice's publications start after it
  const int64_t offset = j * slice_elems;  // of this slice inside every chunk
  auto len_of = [&](int c) { return slice_length(chunk_length(ring_count, world, c), slice_elems, j); };
  ctx.set_position(j, i);

  if (i < 0) {
    // Put the first chunk to send into my buffer (and, for all-gather, my own chunk into
    // the output).
    const int first = first_send_chunk(coll, rank, world);
    uint64_t& first_slot_pub = ctx.last_publication(slot_index(bank, first, world));
    if (!ctx.wait_right_consumed(first_slot_pub)) return false;
    auto* own_output = coll == Collective::kAllGather ? ctx.output_at(first, offset) : nullptr;
    ctx.copy(ctx.my_slot(bank, first), own_output, ctx.input_at(first, offset), len_of(first));
    ctx.publish(base + 1);
    first_slot_pub = base + 1;
  } else {
    const int c = step_recv_chunk(coll, rank, i, world);
    const bool forwards = step_forwards(coll, i, world);
    const bool final_value = step_writes_output(coll, i, world);
    uint64_t& slot_pub = ctx.last_publication(slot_index(bank, c, world));

    if (!ctx.wait_left_published(base + i + 1)) return false;
    if (forwards && !ctx.wait_right_consumed(slot_pub)) return false;
    auto* to_right = forwards ? ctx.my_slot(bank, c) : nullptr;
    auto* to_output = final_value ? ctx.output_at(c, offset) : nullptr;
    if (step_reduces(coll, i, world))
      ctx.reduce(to_right, to_output, ctx.left_slot(bank, c), ctx.input_at(c, offset), len_of(c), final_value);
    else
      ctx.copy(to_right, to_output, ctx.left_slot(bank, c), len_of(c));
    ctx.mark_consumed(base + i + 1);
    if (forwards) {
      ctx.publish(base + i + 2);
      slot_pub = base + i + 2;
    }
  }
  if (i == steps - 1) ctx.step_base() = base + steps;  // the slice is done
  return true;
}

// The ring's work as a sequence of units, slice by slice: unit u is step
// (u mod (steps+1)) - 1 of slice u div (steps+1). A whole collective is units
// [0, ring_units(...)); the CUDA teaching variant launches one kernel per unit.
RINGCOLL_INLINE int64_t ring_units(Collective coll, int64_t ring_count, int world, int64_t slice_elems) {
  return num_slices(ring_count, world, slice_elems) * (ring_steps(coll, world) + 1);
}

// Run units [first, last) of collective `coll` on a message of `ring_count` elements
// (call.h). Returns false if a wait gave up.
template <class Ctx>
RINGCOLL_HD bool run_ring_units(Ctx& ctx, Collective coll, int64_t ring_count, int64_t first, int64_t last) {
  const int per_slice = ring_steps(coll, ctx.world()) + 1;
  for (int64_t u = first; u < last; ++u)
    if (!ring_step(ctx, coll, ring_count, u / per_slice, static_cast<int>(u % per_slice) - 1)) return false;
  return true;
}

template <class Ctx>
RINGCOLL_HD bool run_ring(Ctx& ctx, Collective coll, int64_t ring_count) {
  return run_ring_units(ctx, coll, ring_count, 0, ring_units(coll, ring_count, ctx.world(), ctx.slice_elems()));
}

}  // namespace ringcoll
