// device_ring.h: what one thread block of a ring kernel does. The step loop is ring_loop.h's,
// the same template the CPU transport runs; this file supplies the device execution context
// and the block's entry point, ring_block(). ring_kernels.cu wraps it in __global__ kernels;
// csrc/emulation/ compiles it for the CPU, blocks as threads, so CI runs this very code.
//
// The algorithm is ring.h's (and docs/ring.md's), its step loop and slicing ring_loop.h's;
// the flag words it uses are mapped in docs/flags.md.
//
// Memory ordering. Within a block, one thread (thread 0) does every flag access:
//   publish:  all threads store their part of the data; __syncthreads(); thread 0 does a
//             st.release of the flag (.gpu when every rank runs on this GPU, else, or with
//             RINGCOLL_CUDA_FLAG_SCOPE=system, .sys: RingParams::flag_scope). bar.sync
//             orders the other threads' stores before thread 0's subsequent operations at
//             CTA scope, and PTX release is cumulative:
//             writes observed-before the release by the releasing thread (which includes
//             those ordered before it by the barrier) become visible, at system scope, to
//             whoever acquires the flag. This is the pattern the PTX memory model's
//             causality order is built for (barrier then release), and the one vLLM's and
//             mscclpp's one-writer flags rely on.
//   wait:     thread 0 polls with ld.acquire (same scope) until the value arrives; __syncthreads();
//             the other threads then read the data: acquire -> barrier is again a causality
//             chain, so their reads see what the peer published.
//   consumed: the same as publish, for reads: a peer overwrites a slot only after acquiring
//             our `consumed`, which we release after a barrier that follows all our reads.
// Peer data is read with plain (weak, coherent) loads, never __ldg / const __restrict__:
// the same addresses are rewritten every step, and the non-coherent read-only path could
// serve a stale line.
//
// Giving up. Waits are bounded by the communicator's timeout, measured with %globaltimer,
// and end early when the awaited neighbour, or another block of this rank, has given up
// (its `aborted` flag; a plan's kernel, device_plan.h, watches every peer's). A block that gives up records why in its host-mapped ErrorRecord,
// sets this rank's `aborted` flag (so its neighbours stop too, and so on round the ring)
// and returns; the host raises at its next check. Later launches on a rank that gave up
// return at once.
//
// The mismatch check. Before any data moves, block 0 publishes this rank's call descriptor
// (descriptor.h) and every block compares its left neighbour's with its own (a plan's, its
// right neighbour's too: DeviceBlock::check_call says why). Neighbours
// compare round the whole ring, so a difference anywhere is found by some rank, and its
// `aborted` flag carries "mismatch" to every other.
#pragma once

#include "kernel_abi.h"
#include "ringcoll/flags.h"
#include "ringcoll/reduce.h"
#include "ringcoll/ring_loop.h"
#include "ringcoll/strip.h"

namespace ringcoll::cuda {

// 16 bytes viewed as elements of T.
template <typename T>
union Pack {
  static constexpr int kElems = kVectorBytes / sizeof(T);
  uint4 raw;
  T elems[kElems];
};

RINGCOLL_DEVICE inline uint4 load16(const void* p) { return *static_cast<const uint4*>(p); }
RINGCOLL_DEVICE inline void store16(void* p, uint4 v) { *static_cast<uint4*>(p) = v; }

// How a block's threads cover [0, len) of some pointers: in 16-byte vectors where all of
// them allow (and `vectorise`), else and around those one element at a time. Thread t takes
// vectors t, t + blockDim.x, ..., kVectorsInFlight of them at a time: `load(i)` reads the
// vector at element i into registers, for every vector of the batch, and only then
// `store(i, loaded)` combines and writes each. A thread that stored after every load would
// wait a whole memory round trip per vector; a batch keeps kVectorsInFlight loads
// outstanding (a store between two loads would keep the compiler, which must assume the
// pointers alias, from hoisting the second). What is left after the whole batches goes
// one vector at a time, then the scalar head and tail elements (`one_at(i)`) likewise.
template <typename T, class Load, class Store, class OneAt>
RINGCOLL_DEVICE void for_each_in_range(int64_t len, bool vectorise, const void* a, const void* b, const void* c,
                                       const void* d, Load&& load, Store&& store, OneAt&& one_at) {
  const VectorSplit split =
      vectorise ? vector_split(len, sizeof(T), reinterpret_cast<uintptr_t>(a), reinterpret_cast<uintptr_t>(b),
                               reinterpret_cast<uintptr_t>(c), reinterpret_cast<uintptr_t>(d))
                : VectorSplit{len, 0, 0};
  const int64_t tid = threadIdx.x, stride = blockDim.x;
  constexpr int64_t kPer = Pack<T>::kElems;
  const int64_t vectors = split.vec / kPer;
  auto element_of = [&](int64_t vector) { return split.head + vector * kPer; };
  int64_t v = tid;
  for (; v + (kVectorsInFlight - 1) * stride < vectors; v += kVectorsInFlight * stride) {
    decltype(load(int64_t{0})) loaded[kVectorsInFlight];
#pragma unroll
    for (int k = 0; k < kVectorsInFlight; ++k) loaded[k] = load(element_of(v + k * stride));
#pragma unroll
    for (int k = 0; k < kVectorsInFlight; ++k) store(element_of(v + k * stride), loaded[k]);
  }
  for (; v < vectors; v += stride) store(element_of(v), load(element_of(v)));
  for (int64_t k = tid; k < split.head + split.tail; k += stride) one_at(k < split.head ? k : k + split.vec);
}

// dst (if any) and dst2 (if any) = src over [0, len), by all threads of the block.
template <typename T>
RINGCOLL_DEVICE void copy_range(T* dst, T* dst2, const T* src, int64_t len, bool vectorise) {
  if (dst2 == src) dst2 = nullptr;  // in place: the value is already there
  if (dst == nullptr && dst2 == nullptr) return;
  for_each_in_range<T>(
      len, vectorise, dst, dst2, src, nullptr, [&](int64_t i) { return load16(src + i); },
      [&](int64_t i, uint4 x) {
        if (dst != nullptr) store16(dst + i, x);
        if (dst2 != nullptr) store16(dst2 + i, x);
      },
      [&](int64_t i) {
        const T x = src[i];
        if (dst != nullptr) dst[i] = x;
        if (dst2 != nullptr) dst2[i] = x;
      });
}

template <typename T, class Op, bool kFinal>
RINGCOLL_DEVICE inline T combine(T recv, T own, int world) {
  if constexpr (kFinal) return combine_final_element<T, Op>(recv, own, world);
  else return combine_element<T, Op>(recv, own);
}

// The two vectors a reduction combines, loaded together.
struct VectorPair {
  uint4 recv, own;
};

// to_right (if any) and to_output (if any) = recv op own over [0, len). `own` may alias
// `to_output` (in place): each element is read before it is written, by the same thread.
template <typename T, class Op, bool kFinal>
RINGCOLL_DEVICE void reduce_range(T* to_right, T* to_output, const T* recv, const T* own, int64_t len, int world,
                                  bool vectorise) {
  for_each_in_range<T>(
      len, vectorise, to_right, to_output, recv, own,
      [&](int64_t i) { return VectorPair{load16(recv + i), load16(own + i)}; },
      [&](int64_t i, const VectorPair& loaded) {
        Pack<T> a, b, r;
        a.raw = loaded.recv;
        b.raw = loaded.own;
#pragma unroll
        for (int e = 0; e < Pack<T>::kElems; ++e) r.elems[e] = combine<T, Op, kFinal>(a.elems[e], b.elems[e], world);
        if (to_right != nullptr) store16(to_right + i, r.raw);
        if (to_output != nullptr) store16(to_output + i, r.raw);
      },
      [&](int64_t i) {
        const T x = combine<T, Op, kFinal>(recv[i], own[i], world);
        if (to_right != nullptr) to_right[i] = x;
        if (to_output != nullptr) to_output[i] = x;
      });
}

// Where things sit in a rank's flag area (kernel_abi.h has the picture).
enum class BlockFlag : int { kPublished = 0, kConsumed = 1 };
RINGCOLL_DEVICE inline uint64_t* block_flag(const char* base, int block, BlockFlag which) {
  return reinterpret_cast<uint64_t*>(const_cast<char*>(base) + (2 * block + static_cast<int>(which)) * kFlagStride);
}
// A plan's words (device_plan.h): block b's latest plan publication, and the latest plan
// publication of rank `sender` that this rank's block b has read.
RINGCOLL_DEVICE inline uint64_t* plan_published_flag(const char* base, int block) {
  return reinterpret_cast<uint64_t*>(const_cast<char*>(base) + kPlanPublishedOffset + block * kFlagStride);
}
RINGCOLL_DEVICE inline uint64_t* consumed_from_flag(const char* base, int block, int sender) {
  return reinterpret_cast<uint64_t*>(const_cast<char*>(base) + kConsumedFromOffset + block * kFlagStride) + sender;
}
// Where a rank's input lies for its current call of a plan that reads peers' inputs, and
// whether its block b has read every peer's (kernel_abi.h's InputPost).
RINGCOLL_DEVICE inline InputPost* input_post(const char* base) {
  return reinterpret_cast<InputPost*>(const_cast<char*>(base) + kInputPostOffset);
}
RINGCOLL_DEVICE inline uint64_t* inputs_read_flag(const char* base, int block) {
  return reinterpret_cast<uint64_t*>(const_cast<char*>(base) + kInputsReadOffset + block * kFlagStride);
}
RINGCOLL_DEVICE inline uint64_t* aborted_flag(const char* base) {
  return reinterpret_cast<uint64_t*>(const_cast<char*>(base) + kAbortedOffset);
}
// Where a rank's data sits in its slots during calls of this parity (see my_placement_).
RINGCOLL_DEVICE inline uint64_t* placement_word(const char* base, uint64_t data_calls) {
  return reinterpret_cast<uint64_t*>(const_cast<char*>(base) + kPlacementOffset) + data_calls % 2;
}
RINGCOLL_DEVICE inline DescriptorSlot* descriptor_slot(const char* base) {
  return reinterpret_cast<DescriptorSlot*>(const_cast<char*>(base) + kDescriptorOffset);
}

// What a block's threads share (__shared__ on the GPU).
struct BlockShared {
  int failed;  // set by thread 0 when the block gave up
};

// How a wait polls. Only one poll in kPollsPerAbortCheck also reads the three `aborted`
// flags: they serve to give up, which may be noticed microseconds late, while on the fast
// path each extra load is one more round trip (to L2, or across the interconnect) before
// the awaited value is seen. The clock (%globaltimer, a register, not memory) is read at
// every poll, and a wait that runs out of time looks at the `aborted` flags once more, so
// a neighbour's earlier failure is reported as such. After kPollsBeforeNapping polls the
// waiter naps between polls, leaving issue slots to the blocks it waits for.
constexpr unsigned kPollsPerAbortCheck = 32;
constexpr unsigned kPollsBeforeNapping = 64;

// Which flag a wait is for, as ErrorRecord::waiting_for says it.
enum class Awaited : int { kPublish = 0, kConsume = 1, kDescriptor = 2, kInputPost = 3, kInputsRead = 4 };

// What every block of every kernel does alike, ring or plan: waiting on a peer's flag
// (bounded, giving up when someone gave up), recording why it gave up, the mismatch check,
// and the bookkeeping words all kernels share. The ring watches its two neighbours' `aborted`
// flags; a plan, whose ops may wait on any peer, watches every peer's.
class DeviceBlock {
 public:
  RINGCOLL_DEVICE DeviceBlock(const RingParams& p, BlockShared* shared, bool vectorise, bool watch_every_peer)
      : p_(p), shared_(shared), vectorise_(vectorise), watch_every_peer_(watch_every_peer), block_(blockIdx.x),
        blocks_(gridDim.x) {
    calls_ = p.state[kCallWord];
    plan_grid_ = static_cast<int>(p.state[kPlanGridWord]);
  }

  RINGCOLL_DEVICE int rank() const { return p_.rank; }
  RINGCOLL_DEVICE int world() const { return p_.world; }
  RINGCOLL_DEVICE void set_position(int64_t slice, int step) { slice_ = slice, step_ = step; }

  // The mismatch check (device_ring.h's file comment): compare this rank's descriptor with
  // the left neighbour's, and, for a plan (`both_sides`), with the right neighbour's too. A
  // ring's left neighbour cannot finish a call that moves data before this rank has started
  // it, so a left neighbour already in a later call means the calls differ. A plan's rank may
  // finish without this one (a broadcast's root reads nobody); but it compared its descriptor
  // with this rank's first (it checks both sides too), so a peer that moved on matched us.
  // False if this block gave up.
  RINGCOLL_DEVICE bool check_call(bool both_sides) {
    const uint64_t call = ++calls_;
    if (block_ == 0 && threadIdx.x == 0) publish_descriptor(descriptor_slot(p_.my_base), p_.call, call);
    if (!compare_call(left(), call, /*moved_on_matched=*/both_sides)) return false;
    return !both_sides || right() == left() || compare_call(right(), call, true);
  }

 protected:
  RINGCOLL_DEVICE int left() const { return left_neighbour(p_.rank, p_.world); }
  RINGCOLL_DEVICE int right() const { return right_neighbour(p_.rank, p_.world); }
  RINGCOLL_DEVICE const char* base_of(int rank) const { return p_.peer_bases[rank]; }

  RINGCOLL_DEVICE bool compare_call(int peer, uint64_t call, bool moved_on_matched) {
    const DescriptorSlot* theirs = descriptor_slot(base_of(peer));
    if (!wait(&theirs->seq, FlagScope::kSystem, descriptor_seq_written(call), peer, Awaited::kDescriptor)) return false;
    if (threadIdx.x == 0) {
      CallDescriptor seen{};
      const PeerCall verdict = compare_descriptor(theirs, p_.call, call, &seen);
      // A ring's left neighbour that already moved on finished this call without our data,
      // which only a call with no data to move can do: if ours moves data, the calls differ.
      if (verdict == PeerCall::kMovedOn && !moved_on_matched && p_.ring_count > 0) seen.collective = -1;
      if (verdict == PeerCall::kDiffers || (verdict == PeerCall::kMovedOn && seen.collective < 0))
        give_up(AbortCause::kMismatch, AbortCause::kNone, peer, Awaited::kDescriptor, 0, 0, 0, &seen);
    }
    return block_agrees();
  }

  // Before a call writes slots that the last plan call published: wait until each peer
  // that reads those publications has read them, in every block of that plan's grid (a
  // block's tiles in a plan's slots are not the ring's). Then nothing the plan published is
  // unread, and the last block records so (save_if_last_block). False if this block gave up.
  RINGCOLL_DEVICE bool drain_plan_publications() {
    if (plan_grid_ == 0) return true;
    if (threadIdx.x == 0) {
      for (int r = 0; r < p_.world && shared_->failed == 0; ++r) {
        const uint64_t unread = p_.state[kPlanUnreadWord + r];
        for (int b = 0; b < plan_grid_ && unread != 0 && shared_->failed == 0; ++b)
          poll(consumed_from_flag(base_of(r), b, p_.rank), p_.flag_scope, unread, r, Awaited::kConsume);
      }
    }
    plan_grid_ = 0;
    return block_agrees();
  }

  // By every thread at the end of a launch that went well: a block counts itself done once
  // all its threads have read the record, so the last one to count may write it; `save`
  // writes the kernel's own words, then the words every kernel keeps.
  template <class Save>
  RINGCOLL_DEVICE void save_if_last_block(Save&& save) {
    __syncthreads();
    if (threadIdx.x != 0) return;
    uint64_t* state = p_.state;
    if (counter_add_acq_rel(&state[kBlocksDoneWord], 1) != static_cast<uint64_t>(blocks_ - 1)) return;
    state[kBlocksDoneWord] = 0;  // the next launch is ordered after this one (stream order)
    save(state);
    state[kPlanGridWord] = static_cast<uint64_t>(plan_grid_);
    state[kCallWord] = calls_;
  }

  // See the file comment for why barrier + one release store orders every thread's writes.
  RINGCOLL_DEVICE void release(uint64_t* flag, uint64_t v) {
    __syncthreads();
    if (threadIdx.x == 0) flag_store_release(flag, v, p_.flag_scope);
  }
  // Every thread learns whether thread 0 gave up; false if it did.
  RINGCOLL_DEVICE bool block_agrees() {
    __syncthreads();
    const bool ok = shared_->failed == 0;
    __syncthreads();  // every thread has read `failed` before thread 0 may set it in a later wait
    return ok;
  }

  // Thread 0 waits (poll), then the block learns the outcome together.
  RINGCOLL_DEVICE bool wait(const uint64_t* flag, FlagScope scope, uint64_t target, int peer, Awaited what) {
    if (threadIdx.x == 0) poll(flag, scope, target, peer, what);
    return block_agrees();
  }

  // Thread 0 only: poll until *flag >= target (bounded by the timeout, ended early when
  // someone gave up; then shared_->failed is set). Most polls read the awaited flag alone;
  // every kPollsPerAbortCheck-th, and the last, also reads the `aborted` flags of the
  // watched ranks, *before* the awaited flag: a rank sets it only after everything it
  // published, so a peer that finished its part and closed is never mistaken for one that
  // left us waiting. A closed rank stops us only if it is the one we wait for.
  RINGCOLL_DEVICE void poll(const uint64_t* flag, FlagScope scope, uint64_t target, int peer, Awaited what) {
    if (flag_load_acquire(flag, scope) >= target) return;
    const uint64_t start = device_now_ns();
    for (unsigned polls = 1;; ++polls) {
      if (polls > kPollsBeforeNapping) __nanosleep(200);  // a long wait: leave issue slots to the peer
      const uint64_t waited = device_now_ns() - start;
      const bool out_of_time = waited > p_.timeout_ns;
      if (!out_of_time && polls % kPollsPerAbortCheck != 0) {
        if (flag_load_acquire(flag, scope) >= target) return;
        continue;
      }
      const uint64_t peer_cause = flag_load_acquire(aborted_flag(base_of(peer)));
      uint64_t other_cause = 0;
      int other = peer;
      for (int r = 0; r < p_.world && other_cause == 0; ++r) {
        if (r == peer || r == p_.rank || !(watch_every_peer_ || r == left() || r == right())) continue;
        const uint64_t cause = flag_load_acquire(aborted_flag(base_of(r)));
        if (cause != 0 && cause != static_cast<uint64_t>(AbortCause::kClosed)) other_cause = cause, other = r;
      }
      const uint64_t seen = flag_load_acquire(flag, scope);
      if (seen >= target) return;
      if (peer_cause != 0 || other_cause != 0) {
        const bool awaited = peer_cause != 0;
        give_up(AbortCause::kPeerAborted, static_cast<AbortCause>(awaited ? peer_cause : other_cause), peer, what,
                target, seen, 0, nullptr, awaited ? peer : other);
        return;
      }
      if (flag_load_relaxed(aborted_flag(p_.my_base)) != 0) {  // another block of mine gave up (and said why)
        shared_->failed = 1;
        return;
      }
      if (out_of_time) {
        give_up(AbortCause::kTimedOut, AbortCause::kNone, peer, what, target, seen, waited, nullptr);
        return;
      }
    }
  }

  // Thread 0 only: record why this block stops, and tell this rank's other blocks and its
  // peers (the aborted flag carries the cause at the origin; the first cause stays).
  RINGCOLL_DEVICE void give_up(AbortCause kind, AbortCause cause, int peer, Awaited what, uint64_t expected,
                               uint64_t seen, uint64_t waited, const CallDescriptor* theirs, int aborted_rank = -1) {
    ErrorRecord* rec = p_.errors + block_;
    rec->kind = static_cast<int32_t>(kind);
    rec->cause = static_cast<int32_t>(cause);
    rec->rank = p_.rank, rec->peer = peer, rec->block = block_, rec->aborted_rank = aborted_rank;
    rec->waiting_for = static_cast<int32_t>(what);
    rec->step = step_, rec->slice = slice_, rec->call = calls_;
    rec->expected = expected, rec->seen = seen, rec->waited_ns = waited;
    rec->mine = p_.call;
    if (theirs != nullptr) rec->theirs = *theirs;
    publish_record(&rec->valid);
    // Pass on the cause at the origin; a neighbour that closed on us becomes "a rank left".
    const AbortCause origin = kind != AbortCause::kPeerAborted ? kind
                              : cause == AbortCause::kClosed ? AbortCause::kPeerLeft : cause;
    flag_set_once(aborted_flag(p_.my_base), static_cast<uint64_t>(origin));
    shared_->failed = 1;
  }
  // The record's fields become visible to the host before its `valid` word.
  RINGCOLL_DEVICE static void publish_record(int32_t* valid) {
#if defined(__CUDA_ARCH__)
    __threadfence_system();
    *reinterpret_cast<volatile int32_t*>(valid) = 1;
#else
    __atomic_store_n(valid, 1, __ATOMIC_RELEASE);
#endif
  }

  RingParams p_;
  BlockShared* shared_;
  bool vectorise_;
  bool watch_every_peer_;
  int block_, blocks_;
  int plan_grid_;       // blocks of the last plan launch whose publications may be unread (0: none)
  uint64_t calls_ = 0;  // calls checked so far, this one included once check_call() ran
  int64_t slice_ = 0;
  int step_ = -1;
};

// The device execution context of ring_loop.h. Every thread of every block holds its own
// identical copy of the bookkeeping (step base, last publication per slot), read from the
// one record at the start: all threads run the same loop, so the copies agree without any
// sharing, and the last block to finish writes them back (save_if_last_block).
template <typename T, class Op>
class DeviceRingContext : public DeviceBlock {
 public:
  RINGCOLL_DEVICE DeviceRingContext(const RingParams& p, BlockShared* shared, bool vectorise)
      : DeviceBlock(p, shared, vectorise, /*watch_every_peer=*/false),
        slice_elems_(slice_elems_for(p.slot_bytes, sizeof(T))) {
    const void* user = p.collective == static_cast<int>(Collective::kAllGather) ? p.output : p.input;
    const int misalignment = static_cast<int>(reinterpret_cast<uintptr_t>(user) % kVectorBytes);
    my_placement_ = misalignment % static_cast<int>(sizeof(T)) == 0 ? misalignment : 0;
    base_ = p.state[0];
    for (int s = 0; s < kBanks * p.world; ++s) pubs_[s] = p.state[1 + s];
    last_placements_ = p.state[kPlacementsWord];
    data_calls_ = p.state[kDataCallWord];
    last_grid_ = static_cast<int>(p.state[kGridWord]);
  }
  RINGCOLL_DEVICE void save_if_last_block() {
    DeviceBlock::save_if_last_block([&](uint64_t* state) {
      state[0] = base_;
      for (int s = 0; s < kBanks * p_.world; ++s) state[1 + s] = pubs_[s];
      state[kPlacementsWord] = last_placements_;
      state[kDataCallWord] = data_calls_;
      state[kGridWord] = static_cast<uint64_t>(last_grid_);
    });
  }

  // Which block owns which tile depends on the grid (strip.h), and which bytes of a slot a
  // tile covers on where the rank places each chunk in it (slot_in: the offsets
  // placement_signature packs). So in a launch whose grid or offsets differ from those of
  // the last one that moved data, a slot byte a block refills may still be read by another
  // block of the right neighbour than its own. Before any slot is written, wait until every
  // block of that grid on the right neighbour has consumed all we published before this
  // call: then no slot holds anything unread, and the per-slot waits of ring_loop.h (on our
  // own neighbour block, which may not have run) are dropped. Costs one ring round trip,
  // only when the grid or the offsets change (with one block either side, never: one block
  // owns every byte). A plan call since the last ring call filled the slots its own way:
  // what it published is drained first (drain_plan_publications). False if this block gave up.
  RINGCOLL_DEVICE bool drain_if_grid_changed() {
    if (!drain_plan_publications()) return false;
    const uint64_t placements = placement_signature(my_placement_, p_.ring_count, p_.world, sizeof(T));
    const bool same_owners =
        last_grid_ == blocks_ && (last_placements_ == placements || (blocks_ == 1 && last_grid_ == 1));
    last_placements_ = placements;
    if (same_owners) return true;
    for (int b = 0; b < last_grid_; ++b)
      if (!wait(block_flag(p_.right_base, b, BlockFlag::kConsumed), p_.flag_scope, base_, right(), Awaited::kConsume))
        return false;
    for (int s = 0; s < kBanks * p_.world; ++s) pubs_[s] = 0;
    last_grid_ = blocks_;
    return true;
  }

  // At the start of a call that moves data (its first unit): tell the right neighbour where
  // this rank puts the data in its slots. Each block's thread 0 writes the (same) word
  // before its first publication, whose release carries it to the neighbour's block. A
  // word per call parity: a left neighbour may already be in the next call while we read.
  RINGCOLL_DEVICE void announce_placement() {
    ++data_calls_;
    if (threadIdx.x == 0)
      word_store_relaxed(placement_word(p_.my_base, data_calls_), static_cast<uint64_t>(my_placement_));
  }

  RINGCOLL_DEVICE int banks() const { return kBanks; }
  RINGCOLL_DEVICE int64_t slice_elems() const { return slice_elems_; }
  RINGCOLL_DEVICE uint64_t& step_base() { return base_; }
  RINGCOLL_DEVICE uint64_t& last_publication(int slot) { return pubs_[slot]; }

  RINGCOLL_DEVICE T* my_slot(int bank, int c) const { return slot_in(p_.my_base, bank, c, my_placement_); }
  RINGCOLL_DEVICE const T* left_slot(int bank, int c) const { return slot_in(p_.left_base, bank, c, left_placement_); }
  RINGCOLL_DEVICE const T* input_at(int c, int64_t offset) const {
    return static_cast<const T*>(p_.input) + offset +
           (p_.collective == static_cast<int>(Collective::kAllGather) ? 0 : chunk_begin(p_.ring_count, p_.world, c));
  }
  RINGCOLL_DEVICE T* output_at(int c, int64_t offset) const {
    return static_cast<T*>(p_.output) + offset +
           (p_.collective == static_cast<int>(Collective::kReduceScatter) ? 0 : chunk_begin(p_.ring_count, p_.world, c));
  }

  // This block's tiles of [0, len) (strip.h), each shared by the block's threads. `to_right`
  // is my slot; `src` (copy) is the left neighbour's slot or my input, `recv` (reduce) the
  // left neighbour's slot. Elements [0, fit) lie in place in every slot involved; those past
  // a slot's end (a full slice placed at a nonzero offset: its scalar tail, under 16 bytes,
  // all in one tile) wrap round to that slot's start (slot_in) and go one at a time, by the
  // block that owns their tile, after its other tiles.
  RINGCOLL_DEVICE void copy(T* to_right, T* to_output, const T* src, int64_t len) const {
    if (to_output == src) to_output = nullptr;  // in place: the value is already there
    const int64_t fit = in_place_elems(to_right, src, len);
    for (int64_t t = block_; t < tile_count(fit, sizeof(T)); t += blocks_) {
      const int64_t b = tile_begin(t, sizeof(T)), e = tile_end(fit, t, sizeof(T));
      copy_range<T>(to_right ? to_right + b : nullptr, to_output ? to_output + b : nullptr, src + b, e - b, vectorise_);
    }
    if (fit == len || (fit / tile_elems(sizeof(T))) % blocks_ != block_) return;
    const int64_t fit_right = slot_room(p_.my_base, to_right), fit_src = slot_room(p_.left_base, src);
    for (int64_t i = fit + threadIdx.x; i < len; i += blockDim.x) {
      const T x = *wrapped_at(src, i, fit_src);
      if (to_right != nullptr) *wrapped_at(to_right, i, fit_right) = x;
      if (to_output != nullptr) to_output[i] = x;
    }
  }
  RINGCOLL_DEVICE void reduce(T* to_right, T* to_output, const T* recv, const T* own, int64_t len, bool is_final) const {
    const int64_t fit = in_place_elems(to_right, recv, len);
    for (int64_t t = block_; t < tile_count(fit, sizeof(T)); t += blocks_) {
      const int64_t b = tile_begin(t, sizeof(T)), e = tile_end(fit, t, sizeof(T));
      T* r = to_right ? to_right + b : nullptr;
      T* o = to_output ? to_output + b : nullptr;
      if (is_final) reduce_range<T, Op, true>(r, o, recv + b, own + b, e - b, p_.world, vectorise_);
      else reduce_range<T, Op, false>(r, o, recv + b, own + b, e - b, p_.world, vectorise_);
    }
    if (fit == len || (fit / tile_elems(sizeof(T))) % blocks_ != block_) return;
    const int64_t fit_right = slot_room(p_.my_base, to_right), fit_recv = slot_room(p_.left_base, recv);
    for (int64_t i = fit + threadIdx.x; i < len; i += blockDim.x) {
      const T x = is_final ? combine<T, Op, true>(*wrapped_at(recv, i, fit_recv), own[i], p_.world)
                           : combine<T, Op, false>(*wrapped_at(recv, i, fit_recv), own[i], p_.world);
      if (to_right != nullptr) *wrapped_at(to_right, i, fit_right) = x;
      if (to_output != nullptr) to_output[i] = x;
    }
  }

  // Once a publication of this call has arrived, so has the left neighbour's placement word.
  RINGCOLL_DEVICE bool wait_left_published(uint64_t v) {
    if (!wait(block_flag(p_.left_base, block_, BlockFlag::kPublished), p_.flag_scope, v, left(), Awaited::kPublish))
      return false;
    left_placement_ = static_cast<int>(word_load_relaxed(placement_word(p_.left_base, data_calls_)));
    return true;
  }
  RINGCOLL_DEVICE bool wait_right_consumed(uint64_t v) {
    return wait(block_flag(p_.right_base, block_, BlockFlag::kConsumed), p_.flag_scope, v, right(), Awaited::kConsume);
  }
  // See the file comment for why barrier + one release store orders every thread's writes.
  RINGCOLL_DEVICE void publish(uint64_t v) { release(block_flag(p_.my_base, block_, BlockFlag::kPublished), v); }
  RINGCOLL_DEVICE void mark_consumed(uint64_t v) { release(block_flag(p_.my_base, block_, BlockFlag::kConsumed), v); }

 private:
  // Chunk c of the current slice in a slot, at the offset modulo 16 that chunk c of the
  // writer's user memory has (`placement`: of its base pointer), so that a chunk whose user
  // pointer is misaligned still agrees with the slot and moves in 16-byte vectors. Slices
  // are whole slots, multiples of 16 bytes (slice_elems_for), so the offset is the same in
  // every slice; the elements of a full slice that the offset pushes past the slot's end
  // (fewer than 16 bytes) wrap round to its start, bytes [0, offset), which nothing else
  // uses: element i sits at byte (offset + i * sizeof(T)) mod slot_bytes. The reader knows
  // the writer's offset (its placement word) and the slot size, so finds them there.
  RINGCOLL_DEVICE T* slot_in(const char* base, int bank, int c, int placement) const {
    const int64_t offset = (placement + chunk_begin(p_.ring_count, p_.world, c) * static_cast<int64_t>(sizeof(T))) %
                           kVectorBytes;
    return reinterpret_cast<T*>(const_cast<char*>(base) + kFlagAreaBytes +
                                static_cast<size_t>(slot_index(bank, c, p_.world)) * p_.slot_bytes + offset);
  }
  // How many elements from `p` on lie before the end of the slot `p` points into, if `p`
  // points into a slot of `base`'s data area (my slots, or my left neighbour's); else (user
  // memory, or none) as many as any slice has. Slot data begins under 16 bytes into its slot.
  RINGCOLL_DEVICE int64_t slot_room(const char* base, const T* p) const {
    const char* data = base + kFlagAreaBytes;
    const char* at = reinterpret_cast<const char*>(p);
    const int64_t slots_bytes = static_cast<int64_t>(kBanks) * p_.world * p_.slot_bytes;
    if (p == nullptr || at < data || at >= data + slots_bytes) return INT64_MAX;
    return (p_.slot_bytes - (at - data) % p_.slot_bytes) / static_cast<int64_t>(sizeof(T));
  }
  // How many of the `len` elements a step moves lie in place in both slots it touches:
  // `mine` (my slot, or null) and `theirs` (the left neighbour's slot, or user memory).
  RINGCOLL_DEVICE int64_t in_place_elems(const T* mine, const T* theirs, int64_t len) const {
    const int64_t a = slot_room(p_.my_base, mine), b = slot_room(p_.left_base, theirs);
    const int64_t fit = a < b ? a : b;
    return fit < len ? fit : len;
  }
  // Element i of a slice at `p` (see slot_room: `fit` elements lie in place): past the slot's
  // end it wraps round to the slot's start.
  template <typename P>
  RINGCOLL_DEVICE P* wrapped_at(P* p, int64_t i, int64_t fit) const {
    return p + (i < fit ? i : i - p_.slot_bytes / static_cast<int64_t>(sizeof(T)));
  }
  int64_t slice_elems_;
  uint64_t base_ = 0;
  uint64_t pubs_[kBanks * kMaxWorld];
  int last_grid_ = 0;   // blocks of the last launch that moved data (0: none yet)
  uint64_t last_placements_ = 0;  // offsets of every chunk in my slots in the last launch that moved data
  uint64_t data_calls_ = 0;  // calls that moved data, this one included once announced
  int my_placement_;         // my user pointer's offset modulo 16 (0 if not a multiple of sizeof(T))
  int left_placement_ = 0;   // the left neighbour's, read from its placement word
};

// One block's part of a launch (kernel_abi.h's RingParams says which).
template <typename T, class Op>
RINGCOLL_DEVICE void ring_block(const RingParams& p, BlockShared& shared, bool vectorise) {
  if (threadIdx.x == 0) shared.failed = flag_load_relaxed(aborted_flag(p.my_base)) != 0;
  __syncthreads();
  const bool broken = shared.failed != 0;
  __syncthreads();  // all have read it before thread 0 can change it
  if (broken) return;  // this rank gave up earlier: launches queued behind that do nothing
  DeviceRingContext<T, Op> ctx(p, &shared, vectorise);
  bool ok = !p.check_call || ctx.check_call(/*both_sides=*/false);
  if (ok && p.last_unit > p.first_unit) ok = ctx.drain_if_grid_changed();
  if (ok && p.first_unit == 0 && p.last_unit > 0) ctx.announce_placement();
  if (ok) ok = run_ring_units(ctx, static_cast<Collective>(p.collective), p.ring_count, p.first_unit, p.last_unit);
  // A block that gave up leaves the bookkeeping stale: the communicator is broken anyway.
  if (ok) ctx.save_if_last_block();
}

}  // namespace ringcoll::cuda
