// descriptor.h: what a rank says it is about to do, so mismatched calls are caught before
// any data moves (RINGCOLL_CHECK, on by default).
//
// Before a collective touches data, each rank publishes a CallDescriptor (which
// collective, dtype, op, element count, root, algorithm, and the communicator's call number) in its own
// flag area, then reads every peer's descriptor for the same call number and compares. A
// difference raises RingcollMismatchError on the rank that sees it; since every rank
// compares itself with every peer, and two ranks that differ cannot both agree with a
// third, every rank that reaches the call sees some difference and raises.
//
// The descriptor is guarded by a sequence lock, because a rank can run ahead into its next
// call (a zero-length one moves no data, so nothing else holds it back):
//   writer:  seq = 2c+1 (writing) ... fields ... seq = 2c+2 (release)
//   reader:  wait for seq >= 2c+2; if seq == 2c+2 read the fields, then re-read seq;
//            a changed or larger seq means the peer already finished call c's check.
// A peer that finished call c's check compared its descriptor with everyone's, and the
// first rank to finish saw all P descriptors of call c published and equal; so "moved
// on" implies "matched", and the reader may skip that peer.
//
// The CUDA kernels use the same descriptor and lock but compare with their left neighbour
// only (round the ring, that still finds any difference), so for them "moved on" means
// something else: see check_call in csrc/cuda/device_ring.h.
#pragma once

#include <map>
#include <mutex>
#include <sstream>
#include <string>

#include "ringcoll/flags.h"
#include "ringcoll/platform.h"
#include "ringcoll/reduce.h"
#include "ringcoll/ring.h"

namespace ringcoll {

// Collective codes of descriptors: collectives.h's.
constexpr int kBarrierCollective = static_cast<int>(Collective::kBarrier);
// A collective allocation of symmetric memory (host: HostComm::allocate_symmetric) is
// checked as a call is, so a rank allocating while a peer calls a collective raises
// MismatchError: its descriptor carries this code (outside the collective table, for it
// moves no data), the dtype, and the bytes as its count.
constexpr int kAllocateCall = 64;

struct CallDescriptor {
  int32_t collective;  // Collective (collectives.h)
  int32_t dtype;       // DType
  int32_t op;          // ReduceOp (0 where the collective does not reduce)
  int32_t variant;     // CUDA transport: its kernel variant (ranks must agree); 0 on the CPU
  int64_t user_count;  // the count the caller passed (call.h)
  int32_t algorithm = 0;  // the plan (plan.h: a built-in's code, a user plan's id); 0: the default path
  int32_t root = 0;       // a rooted collective's root (collectives.h); 0 for the others
  int32_t fallback = 0;   // CUDA: the plan run where `algorithm`'s in-place reads cannot be (CompiledPlan::fallback); 0: none
  int32_t unused = 0;     // (explicit padding)
};

RINGCOLL_INLINE bool same_call(const CallDescriptor& a, const CallDescriptor& b) {
  return a.collective == b.collective && a.dtype == b.dtype && a.op == b.op && a.user_count == b.user_count &&
         a.variant == b.variant && a.algorithm == b.algorithm && a.root == b.root && a.fallback == b.fallback;
}

// Whether two calls differ in their algorithm alone (the plan and its fallback).
RINGCOLL_INLINE bool differ_in_algorithm_only(const CallDescriptor& a, const CallDescriptor& b) {
  CallDescriptor same_plan = b;
  same_plan.algorithm = a.algorithm, same_plan.fallback = a.fallback;
  return same_call(a, same_plan) && !same_call(a, b);
}

// The descriptor area of one rank: one sequence flag, then the fields.
struct alignas(64) DescriptorSlot {
  uint64_t seq;
  CallDescriptor call;
};

RINGCOLL_INLINE uint64_t descriptor_seq_written(uint64_t call_number) { return 2 * call_number + 2; }

// The sequence lock (Boehm's): the writer makes seq odd, fences, writes the fields, then
// releases the even seq; the reader acquires seq, reads the fields, fences, re-reads seq.
// Fields are relaxed words: a reader may race a writer, and seq decides whether what it
// read counts. One code path for host and device: only the primitives of flags.h differ.
// A descriptor's fields as relaxed words, stored and loaded one by one (a reader may race
// the writer: whatever orders them, a sequence lock here, a release flag in device_plan.h's
// input post, says when what was read counts).
RINGCOLL_INLINE void store_call_fields(CallDescriptor* to, const CallDescriptor& call) {
  word_store_relaxed(&to->collective, call.collective);
  word_store_relaxed(&to->dtype, call.dtype);
  word_store_relaxed(&to->op, call.op);
  word_store_relaxed(&to->variant, call.variant);
  word_store_relaxed(&to->user_count, call.user_count);
  word_store_relaxed(&to->algorithm, call.algorithm);
  word_store_relaxed(&to->root, call.root);
  word_store_relaxed(&to->fallback, call.fallback);
}

RINGCOLL_INLINE CallDescriptor load_call_fields(const CallDescriptor* from) {
  CallDescriptor call;
  call.collective = word_load_relaxed(&from->collective);
  call.dtype = word_load_relaxed(&from->dtype);
  call.op = word_load_relaxed(&from->op);
  call.variant = word_load_relaxed(&from->variant);
  call.user_count = word_load_relaxed(&from->user_count);
  call.algorithm = word_load_relaxed(&from->algorithm);
  call.root = word_load_relaxed(&from->root);
  call.fallback = word_load_relaxed(&from->fallback);
  return call;
}

RINGCOLL_INLINE void publish_descriptor(DescriptorSlot* slot, const CallDescriptor& call, uint64_t call_number) {
  flag_store_release(&slot->seq, 2 * call_number + 1);
  fence_release();  // the odd seq is visible before any new field
  store_call_fields(&slot->call, call);
  flag_store_release(&slot->seq, descriptor_seq_written(call_number));
}

enum class PeerCall { kMatches, kDiffers, kMovedOn };

// Compare a peer's published descriptor of `call_number` with ours; the caller has already
// waited until the peer's seq >= descriptor_seq_written(call_number). `theirs` receives
// what the peer published when it differs.
RINGCOLL_INLINE PeerCall compare_descriptor(const DescriptorSlot* slot, const CallDescriptor& mine,
                                            uint64_t call_number, CallDescriptor* theirs) {
  const uint64_t seq = flag_load_acquire(&slot->seq);
  if (seq != descriptor_seq_written(call_number)) return PeerCall::kMovedOn;
  *theirs = load_call_fields(&slot->call);
  fence_acquire();  // the fields are read before seq is re-checked
  if (flag_load_relaxed(&slot->seq) != seq) return PeerCall::kMovedOn;  // overwritten meanwhile
  return same_call(mine, *theirs) ? PeerCall::kMatches : PeerCall::kDiffers;
}

// The names of plans written in Python, by the id their calls' descriptors carry
// (plans.plan_id), as this process registered them (plans.compiled): a mismatch then names
// the algorithm its user wrote, not only a hash. Host only.
inline std::string python_plan_name(int id, const std::string* set_name = nullptr) {
  static std::mutex mutex;
  static std::map<int, std::string> names;
  std::lock_guard<std::mutex> lock(mutex);
  if (set_name != nullptr) names[id] = *set_name;
  const auto found = names.find(id);
  return found == names.end() ? "" : found->second;
}

// A plan written in Python as a mismatch message names it.
inline std::string describe_python_plan(int id) {
  const std::string name = python_plan_name(id);
  std::ostringstream text;
  if (name.empty())
    text << "plan " << id << " written in Python, not one registered here (a plan registered under the same name "
         << "but different, or only on that rank)";
  else
    text << "plan '" << name << "' written in Python (id " << id << ")";
  return text.str();
}

// A call as error messages show it, e.g. "all_reduce(float32, SUM, count=1024)". Host only.
inline std::string describe_call(const CallDescriptor& call) {
  static const char* const kOps[] = {"SUM", "PRODUCT", "MIN", "MAX", "AVG"};
  if (call.collective == kAllocateCall) {
    std::ostringstream text;
    text << "empty(" << dtype_info(static_cast<DType>(call.dtype)).name << ", " << call.user_count << " bytes)";
    return text.str();
  }
  const CollectiveInfo info = collective_info(static_cast<Collective>(call.collective));
  std::ostringstream text;
  text << info.name << "(";
  if (info.moves_data) {
    text << dtype_info(static_cast<DType>(call.dtype)).name;
    if (info.reduces)
      text << ", " << (call.op >= 0 && call.op < kNumReduceOps ? kOps[call.op] : "unknown op");
    text << ", count=" << call.user_count;
    if (info.rooted) text << ", root=" << call.root;
    if (call.variant != 0) text << ", kernel variant " << call.variant;
    if (algorithm_name(call.algorithm) != nullptr) text << ", algorithm " << algorithm_name(call.algorithm);
    else if (call.algorithm != 0) text << ", " << describe_python_plan(call.algorithm);
    if (algorithm_name(call.fallback) != nullptr) text << " where every input it reads can be, else " << algorithm_name(call.fallback);
    else if (call.fallback != 0) text << " where every input it reads can be, else " << describe_python_plan(call.fallback);
  }
  text << ")";
  return text.str();
}

}  // namespace ringcoll
