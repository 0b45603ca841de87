// host_symmetric.cpp: symmetric memory on the CPU (ringcoll/symmetric_heap.h): the collective
// allocation, and the collectives that read their peers' arguments where they lie.
//
// The zero-copy collectives. When every rank's input lies in symmetric memory (and, where
// it matters, its output), no byte goes through the slots. Rank k of P, message n:
//
//   all-gather      for j = k+1, k+2, .. (mod P): copy rank j's input into chunk j of my
//                   output; then my own (nothing in place).                  1 round
//   reduce-scatter  fold chunk k of every rank's input into my output.        1 round
//   all-reduce      reduce, then gather, where every output is symmetric too (in place
//                   always is): fold chunk k of every input into chunk k of my output;
//                   round; copy chunk j of rank j's output into mine, j != k.  2 rounds
//                   Otherwise fold every chunk of every input into my output.  1 round
//
// A fold visits the ranks in the ring's order for that chunk (rs_contributor: rank c+1
// first, rank c last), through the same reduce_strip, so every path gives the ring's bits.
// Per rank the two-round all-reduce reads n and writes n/P to reduce, then copies
// (P-1)/P n: no staging copy at all, against the slots' publish-then-read of every byte.
//
// Rounds. A round is a counter in my header that I raise and then wait for every peer to
// raise: the last round of every call says "I have finished reading your arguments", so a
// call returns only once no peer still reads this rank's blocks. That is the guarantee:
// a symmetric tensor may be written again as soon as the call that used it has returned
// on this rank (with async_op, once its Work is done), as with any tensor.
//
// Agreement. Every rank posts, before the call check, where its arguments lie (or that
// they are not symmetric memory). A rank whose own arguments are symmetric reads every
// peer's post after the check and reads in place only if all are; every rank sees the
// same posts, so all choose alike, and a rank with ordinary arguments goes straight to
// the slots, where the others join it. The one-shot path for small messages keeps its
// slots (one round where reading in place needs two: the post, and the last round).
#include <algorithm>
#include <cstring>
#include <sstream>

#include "host_comm.h"
#include "host_strip.h"
#include "ringcoll/check.h"

namespace ringcoll::host {

// ---------------------------------------------------------------------------------------
// The collective allocation

namespace {
std::string describe_allocation(const uint64_t* dims, uint64_t ndim, uint64_t dtype, uint64_t bytes) {
  std::ostringstream text;
  text << "empty((";
  const uint64_t shown = ndim > kAllocationDims ? kAllocationDims - 1 : ndim;  // past it: the folded rest
  for (uint64_t d = 0; d < shown; ++d) text << (d ? ", " : "") << dims[d];
  if (ndim > kAllocationDims) text << ", ...";
  if (ndim == 1) text << ",";
  text << "), " << dtype_info(static_cast<DType>(dtype)).name << ", " << bytes << " bytes)";
  return text.str();
}
}  // namespace

std::shared_ptr<SymmetricBlock> HostComm::allocate_symmetric(size_t bytes, DType dtype,
                                                             const std::vector<int64_t>& dims) {
  const size_t block = symmetric_block_bytes(bytes);
  std::shared_ptr<SymmetricBlock> result;
  const CallDescriptor call{kAllocateCall, static_cast<int32_t>(dtype), 0, 0, static_cast<int64_t>(bytes)};
  run_collective("empty", call, [] {}, [&] {
    // Post what I ask for and whether I have room; compare with every peer's (always: the
    // call check may be off, and it does not see the shape).
    const uint64_t n = ++allocations_;
    auto& mine = header(rank_).allocation[n % 2];
    mine.bytes = bytes;
    mine.dtype = static_cast<uint64_t>(dtype);
    mine.need_arena = heap_->has_room_for(block) ? 0 : 1;
    mine.ndim = dims.size();
    for (size_t d = 0; d < std::min<size_t>(dims.size(), kAllocationDims); ++d)
      mine.dims[d] = static_cast<uint64_t>(dims[d]);
    if (dims.size() > kAllocationDims) {  // the last slot holds the rest folded (FNV-1a): all compared
      uint64_t folded = 1469598103934665603ull;
      for (size_t d = kAllocationDims - 1; d < dims.size(); ++d)
        folded = (folded ^ static_cast<uint64_t>(dims[d])) * 1099511628211ull;
      mine.dims[kAllocationDims - 1] = folded;
    }
    flag_store_release(&mine.number, n);
    bool make_arena = mine.need_arena != 0;
    for (int peer = 0; peer < world_; ++peer) {
      if (peer == rank_) continue;
      const auto& theirs = header(peer).allocation[n % 2];
      wait_for(peer, &theirs.number, n, "allocate symmetric memory");
      const bool same = theirs.bytes == mine.bytes && theirs.dtype == mine.dtype && theirs.ndim == mine.ndim &&
                        std::equal(mine.dims, mine.dims + std::min<uint64_t>(mine.ndim, kAllocationDims), theirs.dims);
      if (!same)
        fail<MismatchError>(current_op_, "mismatched collective allocations (allocation " + std::to_string(n) +
                                             " on this communicator): rank " + std::to_string(rank_) + " asked for " +
                                             describe_allocation(mine.dims, mine.ndim, mine.dtype, mine.bytes) +
                                             " but rank " + std::to_string(peer) + " for " +
                                             describe_allocation(theirs.dims, theirs.ndim, theirs.dtype, theirs.bytes));
      make_arena = make_arena || theirs.need_arena != 0;
    }
    if (make_arena) add_symmetric_arena(symmetric_arena_bytes(block));
    result = take_block(heap_, block);
    RINGCOLL_CHECK(result != nullptr, Error, "empty: no room for ", block, " bytes in a new arena (a bug)");
  });
  return result;
}

// Like the bootstrap (host_comm.cpp), with names derived from the transport's own
// segments' (random, and unlinked long ago, so these are new): create, map every peer's,
// tell them, wait until all have, unlink. On failure nothing is left in /dev/shm.
void HostComm::add_symmetric_arena(size_t bytes) {
  const size_t index = heap_->arenas();
  std::vector<std::string> names;
  for (const auto& name : names_) names.push_back(name + "-arena" + std::to_string(index));
  std::vector<SegmentMapping> peers;
  bool created_own = false;
  try {
    auto mine = std::make_shared<SegmentMapping>(SegmentMapping::create(names[rank_], bytes, rank_));
    created_own = true;
    map_peer_segments(names, bytes, peers, "segment of symmetric arena " + std::to_string(index));
    flag_store_release(&header(rank_).arenas_mapped.value, index + 1);
    for (int peer = 0; peer < world_; ++peer)
      if (peer != rank_) wait_for(peer, &SegmentHeader::arenas_mapped, index + 1, "map every segment of the new arena");
    char* base = mine->base();
    const size_t mapped = mine->bytes();
    heap_->add_arena(std::move(mine), base, mapped);
  } catch (...) {
    for (int r = 0; r < world_; ++r)
      if (r != rank_ || created_own) unlink_segment(names[r]);
    throw;
  }
  for (const auto& name : names) unlink_segment(name);
  peer_arenas_.push_back(std::move(peers));
}

// ---------------------------------------------------------------------------------------
// Reading in place

HostComm::SymmetricArgs HostComm::symmetric_args(const RingCall& call, const void* input, const void* output) const {
  SymmetricArgs args;
  if (world_ == 1 || call.ring_count == 0 || heap_->arenas() == 0) return args;
  const size_t message = message_bytes(call);
  const size_t in_bytes = input_bytes(call, world_);
  const size_t out_bytes = call.collective == Collective::kReduceScatter ? message / world_ : message;
  args.posted = true;
  args.input = heap_->locate(input, in_bytes);
  args.output = heap_->locate(output, out_bytes);
  return args;
}

void HostComm::post_symmetric(const RingCall& call, const SymmetricArgs& mine) {
  auto& post = header(rank_).symmetric_post;
  post.input_arena = mine.input ? mine.input->arena + 1 : 0;
  post.input_offset = mine.input ? mine.input->offset : 0;
  post.output_arena = mine.output ? mine.output->arena + 1 : 0;
  post.output_offset = mine.output ? mine.output->offset : 0;
  post.bytes = message_bytes(call);
  flag_store_release(&post.call, calls_);
}

void HostComm::symmetric_round(const char* event) {
  ++symmetric_rounds_;
  flag_store_release(&header(rank_).symmetric_round.value, symmetric_rounds_);
  for (int peer = 0; peer < world_; ++peer)
    if (peer != rank_) wait_for(peer, &SegmentHeader::symmetric_round, symmetric_rounds_, event);
}

bool HostComm::run_zero_copy(const RingCall& call, const SymmetricArgs& mine, const void* input, void* output) {
  if (!mine.input) return false;  // mine are not: I go by the slots, and my post tells the peers to
  set_single_step(Path::kZeroCopy);
  const size_t message = message_bytes(call);
  std::vector<const char*> inputs(world_), outputs(world_);
  bool every_output = true, some_in_place = false;
  for (int r = 0; r < world_; ++r) {  // every rank's post, mine included (already in my header)
    const auto& post = header(r).symmetric_post;
    if (r != rank_) wait_for(r, &post.call, calls_, "post where its arguments lie");
    const uint64_t in_arena = post.input_arena, in_offset = post.input_offset, out_arena = post.output_arena,
                   out_offset = post.output_offset, bytes = post.bytes;
    fence_acquire();  // the fields were read before `call` is read again
    if (flag_load_relaxed(&post.call) != calls_ || bytes != message)
      fail<MismatchError>(current_op_, "rank " + std::to_string(r) + " posted a message of " +
                                           std::to_string(bytes) + " bytes for call " +
                                           std::to_string(flag_load_relaxed(&post.call)) + " but rank " +
                                           std::to_string(rank_) + " has " + std::to_string(message) +
                                           " bytes for call " + std::to_string(calls_));
    if (in_arena == 0) return false;  // some rank's are not: every rank goes by the slots
    every_output = every_output && out_arena != 0;
    some_in_place = some_in_place || (in_arena == out_arena && in_offset == out_offset);
    if (r == rank_) {
      inputs[r] = static_cast<const char*>(input), outputs[r] = static_cast<const char*>(output);
      continue;
    }
    inputs[r] = peer_arenas_.at(in_arena - 1).at(r).base() + in_offset;
    if (out_arena != 0) outputs[r] = peer_arenas_.at(out_arena - 1).at(r).base() + out_offset;
  }
  // An all-reduce that folds every chunk on every rank would overwrite an in-place rank's
  // input while its peers still read it: with some outputs ordinary and some in place,
  // go by the slots (every rank sees the same posts, so all decide alike).
  if (call.collective == Collective::kAllReduce && !every_output && some_in_place) return false;
  ++zero_copy_calls_;
  // Large outputs are written around the cache (host_strip.h), but not where the output is
  // the input: the fold has just read those lines (as streams_output decides for the plans).
  const bool stream = message >= streaming_threshold_bytes();
  const bool stream_fold = stream && !(mine.output && mine.output->arena == mine.input->arena &&
                                       mine.output->offset >= mine.input->offset &&
                                       mine.output->offset < mine.input->offset + message);
  auto* out = static_cast<char*>(output);
  if (call.collective == Collective::kAllGather) {
    const size_t chunk = message / static_cast<size_t>(world_);
    for (int i = 1; i <= world_; ++i) {  // peers from my right neighbour on; my own last
      const int r = (rank_ + i) % world_;
      copy_strip(static_cast<char*>(nullptr), out + r * chunk, inputs[r], static_cast<int64_t>(chunk), stream);
    }
    stream_fence();
    symmetric_round("finish reading this rank's input");
    return true;
  }
  const bool scatter = call.collective == Collective::kReduceScatter;
  const bool reduce_then_gather = !scatter && every_output;
  dispatch_call(call.descriptor, [&](auto t, auto o) {
    using T = decltype(t);
    auto source = [&](int r) { return reinterpret_cast<const T*>(inputs[r]); };
    auto fold = [&](int c, T* to) {
      fold_in_ring_order<T, decltype(o)>(to, source, c, chunk_begin(call.ring_count, world_, c),
                                         chunk_length(call.ring_count, world_, c), world_, stream_fold);
    };
    if (scatter) return fold(rank_, reinterpret_cast<T*>(out));
    if (!reduce_then_gather) {  // every chunk from every input
      for (int c = 0; c < world_; ++c) fold(c, reinterpret_cast<T*>(out) + chunk_begin(call.ring_count, world_, c));
      return;
    }
    fold(rank_, reinterpret_cast<T*>(out) + chunk_begin(call.ring_count, world_, rank_));
    stream_fence();
    symmetric_round("reduce its chunk");
    for (int i = 1; i < world_; ++i) {  // chunk j from rank j, who reduced it
      const int r = (rank_ + i) % world_;
      const int64_t begin = chunk_begin(call.ring_count, world_, r);
      copy_strip(static_cast<T*>(nullptr), reinterpret_cast<T*>(out) + begin,
                 reinterpret_cast<const T*>(outputs[r]) + begin, chunk_length(call.ring_count, world_, r), stream);
    }
  });
  stream_fence();
  symmetric_round(reduce_then_gather ? "finish reading this rank's output" : "finish reading this rank's input");
  return true;
}

}  // namespace ringcoll::host
