// device_plan.h: what one thread block of a plan kernel does: plan.h's plans run on the GPU,
// the same records and numbering as the CPU transport's engine (csrc/host/host_plan.cpp),
// so any plan the checker accepts runs here too (docs/algorithms.md). ring_kernels.cu wraps
// plan_block() in a __global__ kernel; csrc/emulation/ runs it on the CPU, blocks as threads.
//
// The engine. For each slice j and each op of this rank, in order (one op: value = a [OP b]
// over chunks [first, first + count), to one or two of output, work and this rank's slots):
//   1. a receive waits until the sender's plan_published >= the number of the publication
//      it reads (rank k's m-th publication of slice j is base + j * pubs(k) + m, every rank
//      starting a plan call at the same base, as on the CPU);
//   2. a publication first waits until every reader of each slot it refills has read what
//      last filled it (that reader's consumed_from[me] >= the number);
//   3. the block's threads combine their tiles of each chunk (strip.h: block b takes tiles
//      b, b + B, .. of every chunk, on every rank, so block b of a reader reads what block b
//      of the writer wrote);
//   4. after a barrier thread 0 releases consumed_from[sender] (what it read) and
//      plan_published (what it wrote): the ring's barrier-then-release (device_ring.h).
// Flags are per block, as the ring's: block b of rank k waits only on block b of its peers.
// A plan's slots are the data area cut into kBanks x C slots (plan_slot_bytes), the data
// at offset 0 of each: a misaligned user pointer costs vectors (strip.h's scalar path), not
// correctness.
//
// Between calls. A plan lays its slots out its own way, so a plan call first waits until
// everything the ring and the last plan published has been read (the ring's: every block of
// the ring's last grid on the right neighbour has consumed up to the ring's step base; the
// plan's: drain_plan_publications), and the ring drains a plan's before it refills a slot.
// The ring and the plans number their publications separately (the ring in `published`, the
// plans in `plan_published`), so neither moves the other's counters.
//
// The mismatch check compares descriptors with both neighbours (DeviceBlock::check_call
// says why a plan needs the second), and every wait watches every peer's `aborted` flag: a
// plan's ops may wait on any rank, so a failure anywhere stops every rank within a poll.
//
// Peers' memory where it lies (the direct plans): an input (Operand::kPeerInput), or an output
// whose chunks a publication shares there (kShareOutput: the receive reads the sender's
// output instead of its slot). A peer's input or output is reachable where it lies in
// symmetric memory (its arena and offset, read through this rank's mapping of that arena:
// kernel_abi.h's SymmetricTable), or anywhere where every rank is a thread of one process
// (its plain device pointer). As on the CPU (host_comm.cpp's
// direct reads), rank k
//   1. posts where its input and output lie for its n-th such call (InputPost; before the
//      call check, since it writes only its own memory), and every block reads every rank's
//      post of call n (the calls compared: no rank reads past a peer's tensors; one out of
//      some rank's reach is an error on every rank, kNotSymmetric, before any data moves);
//   2. runs the plan, a kPeerInput operand being that peer's input at the chunk's place, a
//      receive of a shared publication that peer's output there (where some output a
//      shared publication lies in is out of some reader's reach, every rank finds so from
//      the same posts, and every rank then publishes and reads those through slots, as
//      kToSlot: an ordinary output of a peer in another process);
//   3. once each block has done its last such read (in the last slice), it says so
//      (inputs_read[b] = n), and before the kernel ends it waits until block b of every
//      peer has said so: the kernel, and with it the call on this rank's stream, completes
//      only when no peer still reads this rank's input or output.
// A call may carry a fallback plan (RingParams::fallback: what auto runs on symmetric memory,
// direct else the ring's plan): where some input is out of reach, every rank finds it so in
// step 1 from the same posts, so every rank runs the fallback instead, over the same chunks,
// slots and grid. It reads no input in place, but step 3 stays: its handshake is what keeps
// a rank from posting its next call's input while a peer may still read this call's post.
#pragma once

#include "device_ring.h"

namespace ringcoll::cuda {

// The plan loop's strip work (copy, reduce, final reduce) kept out of line on the GPU: inlined
// into the op loop, it kept the loop's state live across all three and spilled (ptxas, sm_90).
#if defined(__CUDACC__)
#define RINGCOLL_PLAN_NOINLINE __noinline__
#else
#define RINGCOLL_PLAN_NOINLINE
#endif

// What a plan kernel's block keeps in shared memory: BlockShared, and per slot of the call
// (kBanks x C) the number of the publication that last filled it and its readers. Only
// thread 0 reads or writes the slot words.
struct PlanShared {
  BlockShared block;
  int fall_back;                       // some input a plan reads in place is out of reach: run RingParams::fallback
  int shared_in_slots;                 // some output a publication is shared in is out of reach: through slots
  const void* peer_inputs[kMaxWorld];  // a direct plan's: every peer's input (kPeerInput), from its post
  const void* peer_outputs[kMaxWorld];  // ... and every peer's output that some rank receives a shared publication from
  uint64_t slot_last[kBanks * kMaxPlanChunks];
  uint64_t slot_readers[kBanks * kMaxPlanChunks];
};

template <typename T, class Op>
class DevicePlanContext : public DeviceBlock {
 public:
  RINGCOLL_DEVICE DevicePlanContext(const RingParams& p, PlanShared* shared, bool vectorise)
      : DeviceBlock(p, &shared->block, vectorise, /*watch_every_peer=*/true), slots_(shared),
        chunks_(p.plan.chunks), slice_elems_(slice_elems_for(p.plan.slot_bytes, sizeof(T))) {
    plan_base_ = p.state[kPlanBaseWord];
    input_posts_ = p.state[kInputPostsWord];
    fallbacks_ = p.state[kFallbacksWord];
  }

  // A plan that reads peers' memory (file comment). post_input: step 1, this rank's post of
  // its next such call (by block 0; every block counts it); find_peer_inputs: the peers'
  // posts of it; finish_reading: step 3's wait. Those two return false if a wait gave up.
  RINGCOLL_DEVICE void post_input() {
    ++input_posts_;
    if (block_ != 0 || threadIdx.x != 0) return;
    InputPost* mine = input_post(p_.my_base);
    word_store_relaxed(&mine->address, p_.plan.input_offset);
    store_call_fields(&mine->call, p_.call);
    word_store_relaxed(&mine->arena, p_.plan.input_arena);
    word_store_relaxed(&mine->output_address, p_.plan.output_offset);
    word_store_relaxed(&mine->output_arena, p_.plan.output_arena);
    flag_store_release(&mine->number, input_posts_, p_.flag_scope);
  }

  // Every rank's post is read, and the reach of each input and output some rank reads is
  // judged, this rank's own included (from its parameters: another block may not have posted
  // it yet), so one out of reach is found by every rank, and every rank raises the same error.
  RINGCOLL_DEVICE bool find_peer_inputs() {
    set_position(p_.first_unit, -1);
    if (threadIdx.x == 0) {
      for (int r = 0; r < p_.world && shared_->failed == 0; ++r) {
        int64_t arena = p_.plan.input_arena, output_arena = p_.plan.output_arena;
        uint64_t address = p_.plan.input_offset, output_address = p_.plan.output_offset;
        if (r != p_.rank) {
          const InputPost* theirs = input_post(base_of(r));
          poll(&theirs->number, p_.flag_scope, input_posts_, r, Awaited::kInputPost);
          if (shared_->failed != 0) break;
          // Without the call check (and with it, where it compares neighbours only: P >= 4)
          // the calls are still compared here, before anything of theirs is read
          const CallDescriptor seen = load_call_fields(&theirs->call);
          if (!same_call(seen, p_.call)) {
            give_up(AbortCause::kMismatch, AbortCause::kNone, r, Awaited::kInputPost, 0, 0, 0, &seen);
            break;
          }
          arena = word_load_relaxed(&theirs->arena);
          address = word_load_relaxed(&theirs->address);
          output_arena = word_load_relaxed(&theirs->output_arena);
          output_address = word_load_relaxed(&theirs->output_address);
        }
        if (has_bit(p_.plan.inputs_read, r)) {  // else nobody reads it (a broadcast's non-roots)
          const void* input = reachable_input(r, arena, address);
          if (input == nullptr) break;  // out of reach: falling back, or gave up saying why
          slots_->peer_inputs[r] = input;
        }
        if (has_bit(p_.plan.outputs_read, r)) {
          slots_->peer_outputs[r] = address_of(r, output_arena, output_address);
          if (slots_->peer_outputs[r] == nullptr) slots_->shared_in_slots = 1;
        }
      }
    }
    return block_agrees();
  }

  RINGCOLL_DEVICE bool finish_reading() {
    if (threadIdx.x == 0) {
      if (p_.plan.last_in_place_read_op < 0)  // read nobody's (a broadcast's root): nothing to wait for first
        flag_store_release(inputs_read_flag(p_.my_base, block_), input_posts_, p_.flag_scope);
      for (int r = 0; r < p_.world && shared_->failed == 0; ++r)
        if (r != p_.rank)
          poll(inputs_read_flag(base_of(r), block_), p_.flag_scope, input_posts_, r, Awaited::kInputsRead);
    }
    return block_agrees();
  }

  // The fallback plan instead of this one (RingParams::fallback: the same chunks and slot size).
  RINGCOLL_DEVICE void run_fallback() {
    p_.plan = p_.fallback;
    ++fallbacks_;
  }

  // Before the first slot is written: nothing the ring or the last plan published is unread
  // (file comment). The ring's step base is the number of its last publication; its grid,
  // the blocks of its last launch (0: none yet). False if this block gave up.
  RINGCOLL_DEVICE bool drain() {
    const uint64_t ring_published = p_.state[0];
    const int ring_grid = static_cast<int>(p_.state[kGridWord]);
    if (threadIdx.x == 0 && p_.world > 1)
      for (int b = 0; b < ring_grid && shared_->failed == 0; ++b)
        poll(block_flag(p_.right_base, b, BlockFlag::kConsumed), p_.flag_scope, ring_published, right(),
             Awaited::kConsume);
    if (!block_agrees()) return false;
    if (!drain_plan_publications()) return false;
    if (threadIdx.x == 0)
      for (int s = 0; s < kBanks * chunks_; ++s) slots_->slot_last[s] = 0, slots_->slot_readers[s] = 0;
    return true;
  }

  // Slices [first, last) of the call; false if a wait gave up.
  RINGCOLL_DEVICE bool run(int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j) {
      const int bank = static_cast<int>(j % kBanks);
      int published = 0;  // this rank's publications so far in this slice
      for (int i = 0; i < p_.plan.op_count; ++i) {
        const DevicePlanOp& op = p_.plan.ops[i];
        set_position(j, i);
        const bool receives = op.a == static_cast<uint8_t>(Operand::kPeer) || op.b == static_cast<uint8_t>(Operand::kPeer);
        const uint64_t reads = receives ? number(op.from, j, op.reads) : 0;
        // A publication shares the output (kShareOutput) unless some such output is out of reach
        const bool in_slot = (op.to & kToSlot) || ((op.to & kShareOutput) && slots_->shared_in_slots);
        const bool shared = op.shared && !slots_->shared_in_slots;
        const uint64_t writes = (op.to & (kToSlot | kShareOutput)) ? number(p_.rank, j, ++published) : 0;
        if (threadIdx.x == 0) {
          if (receives) poll(plan_published_flag(base_of(op.from), block_), p_.flag_scope, reads, op.from,
                             Awaited::kPublish);
          if (in_slot) wait_slots_free(bank, op);
        }
        if (!block_agrees()) return false;
        for (int c = op.first; c < op.first + op.count; ++c) combine(op, shared, in_slot, bank, j, c);
        __syncthreads();  // every thread's part is written: before the flags, and before the next op reads it
        if (threadIdx.x == 0) {
          if (receives) flag_store_release(consumed_from_flag(p_.my_base, block_, op.from), reads, p_.flag_scope);
          if (j + 1 == last && i == p_.plan.last_in_place_read_op)  // done with the peers' memory (step 3)
            flag_store_release(inputs_read_flag(p_.my_base, block_), input_posts_, p_.flag_scope);
          if (writes) {
            for (int c = op.first; c < op.first + op.count && in_slot; ++c) {
              slots_->slot_last[slot_index(bank, c, chunks_)] = writes;
              slots_->slot_readers[slot_index(bank, c, chunks_)] = op.readers;
            }
            flag_store_release(plan_published_flag(p_.my_base, block_), writes, p_.flag_scope);
          }
        }
      }
    }
    return true;
  }

  // At the end of a call that went well: the numbering moves on by the same amount on every
  // rank, and what each peer has yet to read of ours is kept for the next call's drain.
  RINGCOLL_DEVICE void save_if_last_block(int64_t slices) {
    if (slices == 0) return DeviceBlock::save_if_last_block([](uint64_t*) {});
    plan_grid_ = blocks_;
    DeviceBlock::save_if_last_block([&](uint64_t* state) {
      state[kInputPostsWord] = input_posts_;
      state[kFallbacksWord] = fallbacks_;
      state[kPlanBaseWord] = plan_base_ + static_cast<uint64_t>(slices) * static_cast<uint64_t>(p_.plan.most_publications);
      for (int r = 0; r < p_.world; ++r) state[kPlanUnreadWord + r] = 0;
      for (int s = 0; s < kBanks * chunks_; ++s)
        for (int r = 0; r < p_.world; ++r)
          if (has_bit(slots_->slot_readers[s], r) && slots_->slot_last[s] > state[kPlanUnreadWord + r])
            state[kPlanUnreadWord + r] = slots_->slot_last[s];
    });
  }

 private:
  // Where memory of rank r's posted at (arena, address) lies as this rank reads it (InputPost):
  // a plain address only where every peer is a thread of one process, else r's part of a
  // symmetric arena as mapped here plus the offset; null where this rank cannot reach it.
  RINGCOLL_DEVICE const void* address_of(int r, int64_t arena, uint64_t address) const {
    if (arena == kPlainAddress)
      return p_.plan.plain_addresses_readable ? reinterpret_cast<const void*>(address) : nullptr;
    if (arena >= 0 && arena < p_.plan.symmetric_arenas)
      return p_.plan.symmetric_bases[arena * kMaxWorld + r] + address;
    return nullptr;
  }

  // Rank r's input where it lies as this rank reads it (address_of). Null where it cannot be
  // reached, having marked the block to run the call's fallback plan if it has one, else
  // having given up.
  RINGCOLL_DEVICE const void* reachable_input(int r, int64_t arena, uint64_t address) {
    if (const void* input = address_of(r, arena, address)) return input;
    if (p_.fallback.chunks != 0) {  // every rank finds the same input out of reach: all run the fallback
      slots_->fall_back = 1;
      return nullptr;
    }
    give_up(AbortCause::kNotSymmetric, AbortCause::kNone, r, Awaited::kInputPost,
            static_cast<uint64_t>(p_.plan.symmetric_arenas), static_cast<uint64_t>(arena), 0, nullptr);
    return nullptr;
  }

  // The number of rank k's m-th publication of slice j.
  RINGCOLL_DEVICE uint64_t number(int k, int64_t j, int m) const {
    return plan_base_ + static_cast<uint64_t>(j) * static_cast<uint64_t>(p_.plan.publications[k]) +
           static_cast<uint64_t>(m);
  }

  // Thread 0: wait until every reader of what last filled the op's slots has read it.
  RINGCOLL_DEVICE void wait_slots_free(int bank, const DevicePlanOp& op) {
    for (int c = op.first; c < op.first + op.count; ++c) {
      const int s = slot_index(bank, c, chunks_);
      for (int r = 0; r < p_.world && shared_->failed == 0; ++r)
        if (has_bit(slots_->slot_readers[s], r))
          poll(consumed_from_flag(base_of(r), block_, p_.rank), p_.flag_scope, slots_->slot_last[s], r,
               Awaited::kConsume);
    }
  }

  RINGCOLL_DEVICE T* slot(const char* base, int bank, int c) const {
    return reinterpret_cast<T*>(const_cast<char*>(base) + kFlagAreaBytes +
                                static_cast<size_t>(slot_index(bank, c, chunks_)) * p_.plan.slot_bytes);
  }
  // All-gather's input is this rank's chunk only; reduce-scatter's output likewise (the
  // checker refuses plans that address any other chunk of them), as in host_plan.cpp.
  RINGCOLL_DEVICE T* user_at(const void* user, Collective only_own, int c, int64_t j) const {
    const bool own = p_.collective == static_cast<int>(only_own);
    return static_cast<T*>(const_cast<void*>(user)) + j * slice_elems_ + (own ? 0 : chunk_begin(p_.ring_count, chunks_, c));
  }
  // `shared`: a receive's publication lies in the sender's output (DevicePlanOp::shared).
  RINGCOLL_DEVICE T* operand(uint8_t which, int from, int bank, int c, int64_t j, bool shared = false) const {
    switch (static_cast<Operand>(which)) {
      case Operand::kPeer:
        return shared ? user_at(slots_->peer_outputs[from], Collective::kReduceScatter, c, j)
                      : slot(base_of(from), bank, c);
      case Operand::kInput: return user_at(p_.input, Collective::kAllGather, c, j);
      case Operand::kOutput: return user_at(p_.output, Collective::kReduceScatter, c, j);
      case Operand::kWork: return static_cast<T*>(p_.plan.work) + static_cast<int64_t>(c) * slice_elems_;
      case Operand::kPeerInput: return user_at(slots_->peer_inputs[from], Collective::kAllGather, c, j);
      case Operand::kNone: break;
    }
    return nullptr;
  }

  // Chunk c of slice j: this block's tiles, value = a [OP b] to the op's places (the slot
  // first, as on the CPU). A copy skips a place that is its source (in place).
  // `shared`: the op's receive reads the sender's output; `in_slot`: its value goes to a slot.
  RINGCOLL_DEVICE RINGCOLL_PLAN_NOINLINE void combine(const DevicePlanOp& op, bool shared, bool in_slot, int bank,
                                                      int64_t j, int c) {
    const int64_t len = slice_length(chunk_length(p_.ring_count, chunks_, c), slice_elems_, j);
    if (len == 0) return;
    T* places[2] = {nullptr, nullptr};  // a sharing op writes the output alone (plan.h), so a slot makes two
    int n = 0;
    if (in_slot) places[n++] = slot(p_.my_base, bank, c);
    if (op.to & kToWork) places[n++] = operand(static_cast<uint8_t>(Operand::kWork), -1, bank, c, j);
    if (op.to & kToOutput) places[n++] = operand(static_cast<uint8_t>(Operand::kOutput), -1, bank, c, j);
    const T* a = operand(op.a, op.from, bank, c, j, shared);
    const T* b = op.b == static_cast<uint8_t>(Operand::kNone) ? nullptr : operand(op.b, op.from, bank, c, j, shared);
    if (b == nullptr && places[0] == a) places[0] = places[1], places[1] = nullptr;
    for (int64_t t = block_; t < tile_count(len, sizeof(T)); t += blocks_) {
      const int64_t lo = tile_begin(t, sizeof(T)), hi = tile_end(len, t, sizeof(T));
      T* first = places[0] ? places[0] + lo : nullptr;
      T* second = places[1] ? places[1] + lo : nullptr;
      if (b == nullptr) copy_range<T>(first, second, a + lo, hi - lo, vectorise_);
      else if (op.final) reduce_range<T, Op, true>(first, second, a + lo, b + lo, hi - lo, p_.world, vectorise_);
      else reduce_range<T, Op, false>(first, second, a + lo, b + lo, hi - lo, p_.world, vectorise_);
    }
  }

  PlanShared* slots_;
  int chunks_;
  int64_t slice_elems_;
  uint64_t plan_base_ = 0;
  uint64_t input_posts_ = 0;  // this rank's calls that posted their input, this one included once posted
  uint64_t fallbacks_ = 0;    // of those, the calls that ran their fallback plan
};

// One block's part of a plan call (RingParams::plan says which plan).
template <typename T, class Op>
RINGCOLL_DEVICE void plan_block(const RingParams& p, PlanShared& shared, bool vectorise) {
  if (threadIdx.x == 0) {
    shared.block.failed = flag_load_relaxed(aborted_flag(p.my_base)) != 0;
    shared.fall_back = 0;
    shared.shared_in_slots = 0;
  }
  __syncthreads();
  const bool broken = shared.block.failed != 0;
  __syncthreads();
  if (broken) return;  // this rank gave up earlier: launches queued behind that do nothing
  DevicePlanContext<T, Op> ctx(p, &shared, vectorise);
  const int64_t slices = p.last_unit - p.first_unit;
  const bool reads_in_place = p.plan.reads_in_place != 0 && slices > 0;
  if (reads_in_place) ctx.post_input();  // writes only this rank's memory: before the check, as on the CPU
  bool ok = !p.check_call || ctx.check_call(/*both_sides=*/true);
  if (ok && reads_in_place) ok = ctx.find_peer_inputs();
  if (ok && reads_in_place && shared.fall_back != 0) ctx.run_fallback();  // set before find_peer_inputs' barrier
  if (ok && slices > 0) ok = ctx.drain() && ctx.run(p.first_unit, p.last_unit);
  if (ok && reads_in_place) ok = ctx.finish_reading();
  if (ok) ctx.save_if_last_block(slices);
}

}  // namespace ringcoll::cuda
