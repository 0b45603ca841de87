// host_comm.h: the CPU transport. P processes on one machine, each owning one POSIX
// shared-memory segment that every peer maps; the ring of ring_loop.h runs over them.
//
// Segment layout (one per rank, mapped by all):
//
//   [ SegmentHeader: identity and flags, one cache line per flag | 4 KiB ]
//   [ data area: kBanks x P slots of slot_bytes each (call.h)            ]
//
// Rank k writes its own data area and, but for `peer_gave_up`, only its own header; it
// reads the data areas of the peers a plan names (the ring's: its left neighbour's; the
// one-shot's for small messages: every peer's).
// docs/flags.md says who writes and reads each flag.
// Symmetric memory (ringcoll/symmetric_heap.h) lies in further segments, one per rank and arena.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ringcoll/call.h"
#include "ringcoll/descriptor.h"
#include "ringcoll/flags.h"
#include "ringcoll/plan.h"
#include "ringcoll/reduce.h"
#include "ringcoll/ring.h"
#include "shm_segment.h"
#include "ringcoll/symmetric_heap.h"

namespace ringcoll::host {

constexpr uint64_t kSegmentMagic = 0x72696e67636f6c6cull;  // "ringcoll"
constexpr size_t kHeaderBytes = 4096;
constexpr size_t kSlotAlignment = 64;  // a cache line: slots never share one

constexpr uint64_t kProbeReadAll = 1, kProbeFailed = 2;  // SegmentHeader::probed
constexpr int kAllocationDims = 8;  // an allocation's posted dims (past 7, the rest folded into the last)

// One flag per cache line, so a writer never invalidates its neighbour's flag.
struct alignas(64) Flag {
  uint64_t value;
};

struct SegmentHeader {
  uint64_t magic;
  int64_t pid;
  uint64_t pid_namespace;  // liveness checks only make sense inside one pid namespace
  int32_t rank, world;
  Flag attached;
  Flag published;  // the owner's latest publication (one numbering, every plan's)
  Flag barrier;
  Flag completed;
  Flag aborted;
  Flag peer_gave_up;
  DescriptorSlot descriptor;
  char abort_reason[1024];  // why `aborted` is set, written before it
  // Direct reads (peer_memory.h): a word at `probe_address` of the owner's memory holds
  // `probe_token`, which a peer reads back once to see that it may; `probed` then says
  // how the owner's probes of all its peers went (kProbeReadAll, or kProbeFailed and
  // `probe_failure` says why, written before it).
  uint64_t probe_address, probe_token;
  Flag probed;
  char probe_failure[256];
  // Whether the owner has fewer cores than there are ranks (host_wait_policy's test),
  // written before `probed`: every rank ORs them, so all order the paths alike.
  uint64_t cores_short;
  // A plan call that reads peers' memory where it lies (the direct plans): the owner's input
  // for call `call` lies at `address` (`bytes` long), its output at `output_address`
  // (`output_bytes`); `call` is stored last, with release. `direct_read` = c: the owner has
  // read all it reads of its peers' inputs and outputs in call c, so each may let go of its own.
  struct alignas(64) {
    uint64_t address, bytes, output_address, output_bytes, call;
  } direct_post;
  Flag direct_read;
  // The plan engine (host_plan.cpp): consumed_from[k] = v, the owner has read rank k's
  // publication v (flow control per connection: the ring's plan reads only its left one).
  alignas(64) uint64_t consumed_from[kMaxPlanWorld];
  // Symmetric memory (host_symmetric.cpp). `arenas_mapped` = k: the owner has mapped every
  // peer's segment of arenas 0 .. k-1. allocation[n % 2]: the owner's collective allocation
  // number n (`number` stored last; two, so that a peer already at n + 1 does not overwrite
  // what a slower one still reads). `symmetric_post`: where the owner's arguments of call
  // `call` lie (arena + 1 and offset; arena 0: not symmetric memory) and the message's
  // bytes, `call` stored last. `symmetric_round`: the zero-copy rounds the owner finished.
  Flag arenas_mapped;
  struct alignas(64) {
    uint64_t bytes, dtype, need_arena, ndim, dims[kAllocationDims], number;
  } allocation[2];
  struct alignas(64) {
    uint64_t input_arena, input_offset, output_arena, output_offset, bytes, call;
  } symmetric_post;
  Flag symmetric_round;
  // The neighbour-hop probe's token (probe_neighbour_hops): lap k of probe n is
  // n * kHopLaps + k, stored by each rank once its left neighbour's reached it.
  Flag hop;
  // Rank 0's, after the laps of hop probe n: 2n, + 1 if a store probe follows (every rank meets there).
  Flag hop_verdict;
  // The store probe (probe_slot_stores): in probe n, phase 5n + i + 1 of `store_probe` says
  // the owner's block of round i is written (5n + 5: its times below are there), the same
  // phase of `store_probe_read` that it has read its left neighbour's block of round i.
  Flag store_probe;
  Flag store_probe_read;
  struct alignas(64) {
    uint64_t write_ns[2], read_ns[2];  // [0] ordinary stores, [1] streaming: the fastest round
  } store_probe_times;
};
static_assert(sizeof(SegmentHeader) <= kHeaderBytes, "header must fit its page");

// How a rank writes the slots its neighbours read (RINGCOLL_SLOT_STORES): with ordinary
// stores (kCache: the reader takes the lines from the writer's cache), with streaming
// stores (kStream: around the cache, the reader takes them from memory), or kAuto: by the
// neighbour-hop probe (probe_neighbour_hops), repeated every kHopProbeEvery large calls.
// Why it matters: taking a line another core has just written costs one hop between the
// two cores, and on this project's VM that hop is sometimes ~60 ns (two cores sharing a
// last-level cache) and sometimes ~250 ns (on different dies of the EPYC: the hypervisor
// moves them, for seconds at a time). A 1 MiB all-reduce at P = 2 then takes 64 us with
// ordinary stores and 134 with streaming ones, or 760-890 us and 98-148
// (bench/slot_stores.py; bench/results/2026-12-05-cpu-slot-stores.txt). A hop's length
// alone does not say which: on an Intel Xeon VM (one 300 MiB last-level cache for both
// cores) every hop took 165-200 ns and ordinary stores were as fast or faster at every size
// (64 KiB 10 us against 19; 16 MiB 2.3 ms against 2.7). So kAuto also measures the stores
// themselves (probe_slot_stores) and takes that verdict wherever the hop is like the one
// it was made at; the hop's threshold decides elsewhere (2026-12-07-cpu-store-probe.txt).
enum class SlotStores { kAuto, kCache, kStream };
SlotStores slot_stores_from_env();  // RINGCOLL_SLOT_STORES: auto (default), cache or stream
constexpr int kHopLaps = 8;                              // laps of the token per probe
constexpr uint64_t kHopProbeEvery = 64;                  // large calls between probes
constexpr size_t kHopProbeMinBytes = size_t{256} << 10;  // "large": from this message size
// A hop at least this long means the neighbours do not share a cache (RINGCOLL_SLOW_HOP_NS).
constexpr uint64_t kDefaultSlowHopNs = 150;
// A hop this long was a wait for the scheduler, not for a cache line (4x the slowest hop
// between dies seen here): the probe tells nothing.
constexpr uint64_t kHopOffCoreNs = 1000;
// The store probe (probe_slot_stores): a block written with each kind of store and read by
// the right neighbour, timed; after the first two hop probes, every kStoreProbeEvery-th, and
// one whose hop is unlike the last store probe's (probe_neighbour_hops).
constexpr size_t kStoreProbeBytes = size_t{1} << 20;
constexpr uint64_t kStoreProbeEvery = 16;
constexpr int kStoreProbeRounds = 4;  // ordinary, streaming, ordinary, streaming
// A hop this close to the one the store probe was made at (within this factor either way)
// is between the same cores, as far as the probe can tell: its verdict holds.
constexpr double kSameHopFactor = 1.5;

// The one-shot all-reduce folds all P copies of the whole message on every rank, where the
// ring combines 1/P of it per rank: P-1 combines of n elements against (P-1)/P n. A 16-bit
// float combine (widen, add, round once: host_vector16.h) costs about three times a
// float32's per byte, so for these dtypes (the only 2-byte ones in reduce.h) the extra
// combines outweigh the saved ring steps sixteen times sooner: the one-shot all-reduce of
// float16 / bfloat16 stops at small_bytes / 16, 4 KiB by default (bench/crossover.py --paths
// oneshot, bench/results/2026-12-01-cpu-plain-calls.txt: at P = 2 the ring is level at 2-4 KiB
// and 25-37% faster from 8 KiB; at P = 4 on two cores the one-shot is 20% faster at 4-8 KiB).
// Reduce-scatter's one-shot combines only its own chunk, as the ring does.
constexpr size_t kSixteenBitOneShotShare = 16;

// The largest message (bytes) that may take the one-shot path, for this collective and element size.
inline size_t one_shot_limit(Collective coll, int elem_size, size_t small_bytes) {
  return coll == Collective::kAllReduce && elem_size == 2 ? small_bytes / kSixteenBitOneShotShare : small_bytes;
}

// Whether a call may take the one-shot path (host_comm.cpp, one_shot_plan) rather than the
// ring; an all-gather that reads its peers directly (direct_read_fits) does that instead:
// there are peers, the message (ring_count x elem_size bytes, nccl-tests' size) is not empty
// and at most one_shot_limit (`small_bytes`, less for 16-bit all-reduce), and what each rank
// publishes (its whole input; for all-gather its own part, 1/P of the message) fits one
// slot. Mirrored by ringcoll/learning/schedule.py's one_shot_fits (tests/pure/test_schedule.py ties them).
inline bool one_shot_fits(Collective coll, int64_t ring_count, int elem_size, int world, size_t small_bytes,
                          size_t slot_bytes) {
  const size_t message = static_cast<size_t>(ring_count) * static_cast<size_t>(elem_size);
  const size_t published = coll == Collective::kAllGather ? message / static_cast<size_t>(world) : message;
  return world > 1 && message > 0 && message <= one_shot_limit(coll, elem_size, small_bytes) &&
         published <= slot_bytes;
}

// Direct reads stop paying once the message is this large: the kernel's copy then costs
// more than the slots' pipeline with streaming stores (P = 2, direct / slots time: level at
// 8-16 MiB, 1.23-1.37 at 32 MiB; bench/results/2026-12-01-cpu-plain-calls.txt). The
// default of RINGCOLL_DIRECT_MAX_BYTES.
constexpr size_t kDefaultDirectMaxBytes = size_t{32} << 20;

// Whether an all-gather of `ring_count` bytes (ring_call's count) reads its peers' inputs
// directly (host_comm.cpp, "The direct-read all-gather") rather than through the slots:
// every rank could read every peer (`direct_reads`, agreed at bootstrap), and the message
// is at least `direct_bytes` (0: never) and below `direct_max_bytes`. It goes before the
// one-shot path: from about 16 KiB one read beats the one-shot's two copies.
inline bool direct_read_fits(Collective coll, int64_t ring_count, int elem_size, bool direct_reads,
                             size_t direct_bytes, size_t direct_max_bytes) {
  const size_t message = static_cast<size_t>(ring_count) * static_cast<size_t>(elem_size);
  return direct_reads && coll == Collective::kAllGather && direct_bytes > 0 && message >= direct_bytes &&
         message < direct_max_bytes;
}

// Whether `world` ranks outnumber this machine's cores (some then wait for the scheduler).
bool ranks_outnumber_cores(int world);
// How host waits spend their time: spinning only pays when every rank has a core, and
// yielding only when the peer waited for is what else runs here. `shares_cores`: each
// rank's cores also run other busy threads (the hierarchical communicator's link, which
// moves bytes while the node's ring waits): neither spin nor keep yielding, nap.
WaitPolicy host_wait_policy(int world, double timeout_seconds, bool shares_cores = false);

class HostComm;

// What the plan engine keeps from call to call, so that a call allocates nothing once the
// sizes have been seen: the work space (one slice of a message), and per slot (kBanks x
// chunks of them) the publication that last filled it and its readers, reset at every call.
// A peer's input that an op combines (or publishes) is read a piece of this many bytes at a
// time into the bounce buffer, and combined while the piece is still in cache (L2 here).
constexpr size_t kBounceBytes = size_t{256} << 10;

struct PlanScratch {
  std::vector<char> work;
  std::vector<char> bounce;  // kBounceBytes, for reads of peers' inputs (host_plan.cpp's combine)
  std::vector<uint64_t> slot_last, slot_readers;
};

// Per bank, per peer: this rank's latest plan publication in that bank the peer reads (0: none).
using UnreadPublications = std::array<std::vector<uint64_t>, kBanks>;

// Where a plan call starts: the bank of its slice 0 (slice j fills bank (j + first_bank)
// mod kBanks), and how many of this rank's ops of slice 0 already ran (its early sends).
struct PlanCallStart {
  int first_bank = 0;
  int early_ops_done = 0;
};

// The plan engine (host_plan.cpp): one call by `plan`, from publication number `base`
// (the same on every rank); returns the publication numbers the call took (the same on
// every rank), leaves this rank's `published` at base + that, and notes in `unread` this
// rank's latest publications its peers read.
uint64_t run_host_plan(HostComm& comm, const CompiledPlan& plan, const RingCall& call, const void* input,
                       void* output, uint64_t base, UnreadPublications& unread, PlanScratch& scratch,
                       PlanCallStart at);
// Before the call check of a call of one slice: this rank's early sends
// (CompiledPlan::early_sends) into bank `first_bank`; they write nothing but its slots.
void run_host_plan_early_sends(HostComm& comm, const CompiledPlan& plan, const RingCall& call, const void* input,
                               uint64_t base, PlanScratch& scratch, int first_bank);
// The elements of a chunk one slice holds (a slot's; a plan of direct reads only: the chunk).
int64_t plan_slice_elems(const CompiledPlan& plan, size_t buffer_bytes, int64_t ring_count, size_t elem_size);

class HostComm {
 public:
  // Collective over the `world` ranks: names[r] is rank r's segment name (drawn with
  // random_segment_name() and exchanged by the caller). Creates this rank's segment, maps
  // every peer's, waits until all ranks have done so, then unlinks every name.
  //
  // `small_bytes`: messages of at most this many bytes (and whose published part fits one
  // slot) take the one-shot path instead of the ring; 0 never. Ranks must agree (Python
  // checks). See "The one-shot path" in host_comm.cpp.
  //
  // `direct_bytes`: all-gathers of at least this many bytes, and below `direct_max_bytes`,
  // read every peer's input straight into the output (peer_memory.h) where every rank can
  // read every peer, probed once here; 0 never. Ranks must agree (Python checks). See
  // "The direct-read all-gather" in host_comm.cpp.
  //
  // `shares_cores`: this rank's cores also run other busy threads (host_wait_policy).
  HostComm(int rank, int world, const std::vector<std::string>& names, size_t buffer_bytes,
           double timeout_seconds, bool check_calls = true, size_t small_bytes = 0, size_t direct_bytes = 0,
           size_t direct_max_bytes = kDefaultDirectMaxBytes, bool shares_cores = false);
  ~HostComm() { close(); }
  HostComm(const HostComm&) = delete;
  HostComm& operator=(const HostComm&) = delete;

  // Pointers are raw addresses of contiguous arrays; counts are user counts (call.h).
  void all_reduce(const void* input, void* output, int64_t user_count, DType dtype, ReduceOp op);
  void reduce_scatter(const void* input, void* output, int64_t user_count, DType dtype, ReduceOp op);
  void all_gather(const void* input, void* output, int64_t user_count, DType dtype);
  // Any collective by a plan (plan.h) through the plan engine (host_plan.cpp). The call's
  // descriptor carries the plan's id, so ranks running different plans raise MismatchError.
  void run_plan(Collective coll, const CompiledPlan& plan, const void* input, void* output, int64_t user_count,
                DType dtype, ReduceOp op);
  void barrier();
  void close();

  // Symmetric memory (ringcoll/symmetric_heap.h; host_symmetric.cpp). Collective: every rank asks
  // for `bytes` of `dtype` shaped `dims`, in the same order (else MismatchError on every
  // rank); returns a block of this rank's segment of an arena, made with every rank first
  // if some rank has no room. Collectives whose arguments are such blocks read them in place.
  std::shared_ptr<SymmetricBlock> allocate_symmetric(size_t bytes, DType dtype, const std::vector<int64_t>& dims);
  size_t symmetric_arenas() const { return heap_->arenas(); }
  bool is_symmetric(const void* address, size_t bytes) const { return heap_->locate(address, bytes).has_value(); }
  uint64_t zero_copy_calls() const { return zero_copy_calls_; }  // calls that read peers' blocks (for tests)

  // Where "auto" runs a plan for `coll`, in place or not (ringcoll/tuning.py decides, in
  // Python, once per communicator): message sizes [from, to) in bytes, each with the held
  // plan (hold_plan's index) for it. A plain tensor call (bind_host.cpp) looks its size up
  // here, so auto costs what the algorithm it picks costs when named.
  struct AutoPlanSpan {
    size_t from, to;
    long held;
  };
  void set_auto_plan_spans(Collective coll, std::vector<AutoPlanSpan> spans, bool in_place) {
    for (const AutoPlanSpan& s : spans) (void)held_plan(s.held, "set_auto_plan_spans");  // held, or refused now
    auto_plan_spans_[in_place ? 1 : 0].at(static_cast<int>(coll)) = std::move(spans);
  }
  // The plan auto runs for a message of `bytes`; null: the transport's own path.
  const CompiledPlan* auto_plan(Collective coll, size_t bytes, bool in_place) const {
    for (const AutoPlanSpan& s : auto_plan_spans_[in_place ? 1 : 0][static_cast<int>(coll)])
      if (s.from <= bytes && bytes < s.to) return &held_plans_[static_cast<size_t>(s.held)];
    return nullptr;
  }
  // Plans held for the plain tensor calls (bind_host.cpp), which may name one by its index:
  // a small int is read in nanoseconds, where finding a plan object's C++ type costs a
  // 4 KiB call 0.04 us of its 1.6. Held plans never move (a deque) and stay till the end.
  int hold_plan(const CompiledPlan& plan) {
    held_plans_.push_back(plan);
    return static_cast<int>(held_plans_.size()) - 1;
  }
  const CompiledPlan& held_plan(long index, const char* op) const {
    RINGCOLL_CHECK(index >= 0 && static_cast<size_t>(index) < held_plans_.size(), std::invalid_argument, op,
                   ": no plan ", index, " is held by this communicator");
    return held_plans_[static_cast<size_t>(index)];
  }
  bool check_calls() const { return check_calls_; }
  bool closed() const { return closed_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  size_t slot_bytes() const { return slot_bytes_; }
  size_t buffer_bytes() const { return buffer_bytes_; }
  size_t small_bytes() const { return small_bytes_; }
  // Whether `call` takes the one-shot path (where it fits and does not read directly): a
  // function of the call and of settings every rank agreed on, so every rank decides alike.
  bool uses_one_shot(const RingCall& call) const;
  uint64_t one_shot_calls() const { return one_shot_calls_; }  // how many took it (for tests)
  // Calls of one slice by a plan that sends early (before_the_check; for tests).
  uint64_t one_slice_early_calls() const { return one_slice_early_calls_; }
  size_t direct_bytes() const { return direct_bytes_; }
  size_t direct_max_bytes() const { return direct_max_bytes_; }
  // Whether all-gathers from direct_bytes on read peers directly (the same on every rank);
  // if not, why not: "off", or the first failed probe this rank saw.
  bool direct_reads() const { return direct_reads_; }
  const std::string& direct_reads_unavailable() const { return direct_unavailable_; }
  bool uses_direct_read(const RingCall& call) const;
  // Whether some rank has fewer cores than there are ranks (agreed at the probe): the
  // one-shot path then goes before direct reads (uses_direct_read).
  bool oversubscribed() const { return oversubscribed_; }
  uint64_t direct_calls() const { return direct_calls_; }  // how many read directly (for tests)
  // The slots' stores (SlotStores): whether this rank now writes them around the cache, the
  // latest neighbour hop measured (ns; 0: never probed), and how many probes found the
  // hop slow, of how many.
  bool stream_slots() const { return stream_slots_; }
  // Whether this rank probes at all: auto, peers, and a core of its own to spin on (not
  // where ranks outnumber cores or share them with busy threads: host_wait_policy). Where
  // ranks take turns on a core, the neighbour often reads a slot from the very cache it was
  // written to, and every lap measures the scheduler: ordinary stores (P = 4 on 2 cores,
  // 16 MiB all-reduce, medians of two runs: 5.6 and 6.5 ms ordinary, 8.2 and 7.8 streaming).
  bool probes_hops() const { return slot_stores_ == SlotStores::kAuto && world_ > 1 && policy_.spin_ns > 0; }
  uint64_t hop_ns() const { return hop_ns_; }
  uint64_t hop_probes() const { return hop_probes_; }
  uint64_t slow_hop_probes() const { return slow_hop_probes_; }
  // The store probe's (probe_slot_stores): how many ran, the hop it was made at (0: none
  // that counts) and its verdict, streaming stores or not, for hops like that one.
  uint64_t store_probes() const { return store_probes_; }
  uint64_t store_probe_hop_ns() const { return store_probe_hop_ns_; }
  bool store_probe_streams() const { return store_probe_streams_; }
  // Read from any thread (Python's `broken`), while a call on another may be setting it.
  bool broken() const {
    std::lock_guard<std::mutex> lock(reason_mutex_);
    return !broken_reason_.empty();
  }
  std::string broken_reason() const {
    std::lock_guard<std::mutex> lock(reason_mutex_);
    return broken_reason_;
  }
  double timeout() const { return policy_.timeout_seconds; }
  const WaitPolicy& wait_policy() const { return policy_; }
  void set_timeout(double seconds) { policy_.timeout_seconds = seconds; }

  // --- used by the plan engine (host_plan.cpp); not part of the Python surface ---
  SegmentHeader& header(int r) const { return *reinterpret_cast<SegmentHeader*>(segments_[r].base()); }
  char* data(int r) const { return segments_[r].base() + kHeaderBytes; }
  // The store probe's block (kStoreProbeBytes), past rank r's slots: no call's data lies there.
  char* store_probe_block(int r) const { return data(r) + buffer_bytes_; }
  // Wait until header(peer).<flag> >= target; throws (and breaks the communicator) on
  // timeout or when a peer is known to be gone. `event` names what the peer should do
  // ("publish", ...); the message also gives the position (set_plan_position, ...). A wait
  // that fails before this call's check has passed looks for a mismatch first (unchecked_call_).
  void wait_for(int peer, const uint64_t* flag, uint64_t target, const char* event);
  void wait_for(int peer, Flag SegmentHeader::*flag, uint64_t target, const char* event) {
    wait_for(peer, &(header(peer).*flag).value, target, event);
  }
  // The plan engine's position: op `op` of `ops` in slice `slice` of a plan with this id.
  void set_plan_position(int64_t slice, int64_t slices, int op, int ops, uint32_t algorithm) {
    position_ = {slice, slices, op, ops, Path::kPlan, algorithm};
  }
  // The plan engine's read of a peer's input (Operand::kPeerInput) or output (a publication
  // shared there: kShareOutput) where it lies: `bytes` from `offset` of what rank `peer`
  // posted for this call, into `into`. Waits for the post; MismatchError where the peer
  // posted other sizes than this rank, PeerError where the read fails.
  enum class PeerPlace { kInput, kOutput };
  void read_peer(int peer, PeerPlace place, size_t offset, void* into, size_t bytes);
  // Wait until every reader has read what this rank published into `bank` (-1: both): the
  // slots' layout depends on the algorithm, so no slot is refilled across calls while a
  // peer still reads it (before a plan call; before its early sends, their bank only).
  void drain_plan_publications(int bank = -1);
  // This rank has read all it reads of its peers' memory in this call (finish_direct_reads'
  // first half, said early so that peers may return while this rank still writes).
  void say_peer_reads_done();

 private:
  // Where a message's arguments lie in symmetric memory, as every rank posts them (host_symmetric.cpp).
  struct SymmetricArgs {
    bool posted = false;  // arenas exist and the call may read in place: this rank posts
    std::optional<SymmetricPlace> input, output;
  };
  void bootstrap(const std::vector<std::string>& names);
  // Map every peer's segment names[peer] of `bytes` into into[peer], retrying until the
  // timeout: a peer may not have created it yet. `what` names the segment in errors.
  void map_peer_segments(const std::vector<std::string>& names, size_t bytes, std::vector<SegmentMapping>& into,
                         const std::string& what);
  // Symmetric memory: make arena `heap_->arenas()` of `bytes` with every rank.
  void add_symmetric_arena(size_t bytes);
  // Where this call's arguments lie in my arenas; posted before the call check.
  SymmetricArgs symmetric_args(const RingCall& call, const void* input, const void* output) const;
  void post_symmetric(const RingCall& call, const SymmetricArgs& mine);
  // Read in place if every rank's arguments are symmetric memory (read from their posts);
  // false, having moved nothing, if some rank's are not: the call then goes by the slots.
  bool run_zero_copy(const RingCall& call, const SymmetricArgs& mine, const void* input, void* output);
  // Tell every peer this rank finished round `symmetric_rounds_ + 1`; wait until all have.
  void symmetric_round(const char* event);
  void ensure_usable(const char* op) const;
  // Mark this communicator broken (and tell the peers), then throw E with the message.
  template <typename E> [[noreturn]] void fail(const char* op, const std::string& message);
  // fail()'s first half: broken, with the reason in my header and `aborted` set for the peers.
  void break_and_tell_peers(const char* op, const std::string& message);
  // Whether every peer could still make progress: no peer aborted, no peer process gone.
  bool peers_look_alive(std::string* why) const;
  // One collective: the call check (when on), with `early()` between publishing my
  // descriptor and comparing the peers', then `body()`.
  template <typename Early, typename Body>
  void run_collective(const char* op, const CallDescriptor& call, Early&& early, Body&& body);
  void run_ring_call(const char* op, const RingCall& call, const void* input, void* output);
  void run_plan_call(const char* op, const RingCall& call, const CompiledPlan& plan, const void* input, void* output);
  // After the call check: the plan's steps (but the early sends before_the_check sent).
  void run_plan_steps(const RingCall& call, const CompiledPlan& plan, const void* input, void* output);
  // Before the call check (run_collective's early step): post my input for peers' reads,
  // choose the call's first bank, and send the plan's early sends (call_start_ says).
  void before_the_check(const RingCall& call, const CompiledPlan& plan, const void* input, const void* output);
  // After a call's last wait: PeerError if a peer gave up on this call meanwhile.
  void fail_if_a_peer_gave_up();
  // Bootstrap: see whether this rank may read every peer; then agree with all on direct_reads_.
  void probe_direct_reads();
  // Before a call that reads peers' memory where it lies: post where my input and output lie
  // (before the call check, like the one-shot publication: it writes only my own header).
  void post_direct_places(const RingCall& call, const void* input, const void* output);
  // The end of a call that read peers' memory where it lies: tell every peer this rank has
  // finished reading, and wait until every peer has (only then may the caller reuse its
  // input, or touch its output).
  void finish_direct_reads();
  // Before a ring or plan call: how this rank writes its slots (SlotStores); probes the hop
  // on the large calls whose turn it is (counted alike on every rank: they meet there).
  void choose_slot_stores(const RingCall& call);
  // A token goes kHopLaps times round the ring, each rank passing it on to its right
  // neighbour; the fastest lap / P is one hop, the time a flag takes from core to core.
  // Returns whether a store probe follows (rank 0's word for every rank).
  bool probe_neighbour_hops();
  // A block of kStoreProbeBytes written past this rank's slots with each kind of store, in
  // turn, and read by its right neighbour; each kind's write time plus the neighbour's read
  // time decides this rank's stores for hops like the one just measured.
  void probe_slot_stores();
  // Whether a hop of `hop_ns` calls for streaming stores: the store probe's verdict for a
  // hop like its own (near_store_probe_hop), else the threshold (slow_hop_ns_).
  bool streams_at_hop(uint64_t hop_ns) const;
  bool near_store_probe_hop(uint64_t hop_ns) const;
  // Compare my published `call` with every peer's (descriptor.h); throws MismatchError.
  void check_call(const char* op, const CallDescriptor& call);
  // Throw MismatchError if `peer` has announced this call and it differs from `call`.
  void fail_if_call_differs(const char* op, const CallDescriptor& call, int peer);
  // MismatchError if any peer has announced a call other than `call` (its descriptor is there).
  void fail_if_any_call_differs(const char* op, const CallDescriptor& call);

  int rank_, world_;
  size_t buffer_bytes_, slot_bytes_, small_bytes_, direct_bytes_, direct_max_bytes_;
  WaitPolicy policy_;
  bool check_calls_;
  std::array<std::array<std::vector<AutoPlanSpan>, kNumCollectives>, 2> auto_plan_spans_;  // [in place]; none: native
  std::deque<CompiledPlan> held_plans_;  // hold_plan's
  // By collective code, native's plans (run_ring_call): the ring's, and the one-shot's for small messages
  std::vector<CompiledPlan> native_ring_, native_one_shot_;
  CompiledPlan native_direct_;  // the direct plan's all-gather: native's from direct_bytes_ (uses_direct_read)
  std::vector<SegmentMapping> segments_;
  std::vector<std::string> names_;  // the segments' names, long unlinked: arenas' names derive from them
  std::shared_ptr<SymmetricHeap> heap_ = std::make_shared<SymmetricHeap>();
  std::vector<std::vector<SegmentMapping>> peer_arenas_;  // [arena][rank]: peers' segments (mine: empty)
  uint64_t allocations_ = 0;      // collective allocations so far
  uint64_t symmetric_rounds_ = 0;  // zero-copy rounds so far (the same on every rank)
  uint64_t zero_copy_calls_ = 0;
  uint64_t step_base_ = 0;          // number of my latest publication (all ranks agree)
  uint64_t barrier_generation_ = 0;
  uint64_t calls_ = 0;              // collectives issued on this communicator
  uint64_t one_shot_calls_ = 0;    // native calls that took the one-shot plan (for tests)
  UnreadPublications plan_unread_;     // my latest publications that peers read, per bank (0: none left)
  PlanCallStart call_start_;           // the current plan call's (before_the_check)
  uint64_t one_slice_early_calls_ = 0;  // calls of one slice by a plan that sends early: they alternate banks
  PlanScratch plan_scratch_;           // the plan engine's work space and slot records
  uint64_t probe_token_ = 0;  // what peers read back at bootstrap (peer_memory.h)
  bool direct_reads_ = false;
  bool oversubscribed_ = false;
  std::string direct_unavailable_ = "off";
  uint64_t direct_calls_ = 0;
  SlotStores slot_stores_ = SlotStores::kAuto;
  uint64_t slow_hop_ns_ = kDefaultSlowHopNs;
  bool stream_slots_ = false;
  uint64_t large_slot_calls_ = 0;  // ring and plan calls of kHopProbeMinBytes or more (the same on every rank)
  uint64_t hop_probes_ = 0, slow_hop_probes_ = 0, hop_ns_ = 0;
  bool slow_hop_given_ = false;  // RINGCOLL_SLOW_HOP_NS set: the threshold alone decides, no store probe
  uint64_t store_probes_ = 0, store_probe_hop_ns_ = 0;
  bool store_probe_streams_ = false;
  std::vector<char> store_probe_scratch_;  // the block's source when writing, its copy when reading
  const char* current_op_ = "";
  // This call's descriptor until its call check has passed (run_collective's early step and
  // check_call): a peer that found a mismatch aborts at once, and a wait of this rank that
  // gives up meanwhile raises the mismatch, not a PeerError quoting the peer's abort.
  const CallDescriptor* unchecked_call_ = nullptr;
  // Where this rank is in the current call, for error messages: which path, and on a plan
  // which slice and op (kNone: before any data moved).
  enum class Path { kNone, kPlan, kZeroCopy };
  struct Position {
    int64_t slice, slices;
    int step, steps;
    Path path;
    uint32_t algorithm;  // kPlan: the plan's id (collectives.h's code, or a user plan's)
  } position_{};
  void set_single_step(Path path) { position_ = {0, 1, 0, 1, path, 0}; }
  // " (call 5, slice 3/8, plan op 2/3 of ring)" and the like: where an error struck.
  std::string where_in_call() const;
  std::string broken_reason_;  // set by the thread running a call (it holds one_call_at_a_time_)
  mutable std::mutex reason_mutex_;  // ... and read by others through broken() / broken_reason()
  bool closed_ = false;
  // One call at a time on the ring, whichever thread makes it: Python orders a rank's calls
  // (transports/host.py), but a plain call runs without taking its lock (bind_host.cpp).
  std::mutex one_call_at_a_time_;
  // The process's fork count when this communicator was made (forks_so_far): a child of
  // fork() has a copy of it, but not the threads that may hold its mutex, nor a place among
  // the peers, which know the parent. Checked before the mutex is taken.
  uint64_t made_at_fork_ = 0;
  int64_t made_by_pid_ = 0;
  void refuse_in_forked_child(const char* op) const;
};

// Called by every wait's health check (peers_look_alive: about every 50 ms of sleeping); it
// may throw to abandon the call, which then breaks the communicator and tells the peers.
// The Python module sets one that runs Python's signal handlers (a Ctrl-C waited for the
// timeout: the call holds no GIL). Set once, before any communicator exists.
void set_interrupt_check(void (*check)());

// How many times this process's ancestors forked it (0 in the process that loaded the
// extension; each fork() child counts one more): a zero-cost test for "made before fork".
uint64_t forks_so_far();

// The two templates of HostComm, here so that every file of the transport can use them
// (host_comm.cpp, host_plan.cpp, host_symmetric.cpp).

template <typename E>
inline void HostComm::fail(const char* op, const std::string& message) {
  break_and_tell_peers(op, message);
  throw E(broken_reason_);
}

inline void HostComm::break_and_tell_peers(const char* op, const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(reason_mutex_);
    broken_reason_ = std::string(op) + ": " + message;
  }
  // Let every peer's waits see it at their next health check instead of their timeout.
  if (!segments_.empty() && segments_[rank_].mapped()) {
    SegmentHeader& me = header(rank_);
    std::strncpy(me.abort_reason, broken_reason_.c_str(), sizeof(me.abort_reason) - 1);
    flag_store_release(&me.aborted.value, 1);
  }
}

template <typename Early, typename Body>
inline void HostComm::run_collective(const char* op, const CallDescriptor& call, Early&& early, Body&& body) {
  refuse_in_forked_child(op);
  std::lock_guard<std::mutex> lock(one_call_at_a_time_);
  ensure_usable(op);
  current_op_ = op;
  ++calls_;
  position_ = {};
  const bool check = check_calls_ && world_ > 1;
  if (check) publish_descriptor(&header(rank_).descriptor, call, calls_);
  // `early` writes nothing but this rank's own buffer (the one-shot publication), so it may
  // run before the peers' descriptors are compared: it overlaps the wait for them, and a
  // small call then waits for its peers once instead of twice. Peers read that buffer only
  // after their own check passed, so a mismatch still moves no data into any output.
  try {
    {
      struct Checked {  // once the check has passed (or anything before it threw)
        const CallDescriptor*& unchecked;
        ~Checked() { unchecked = nullptr; }
      } checked{unchecked_call_ = check ? &call : nullptr};
      early();
      position_ = {};
      if (check) check_call(op, call);
    }
    body();
  } catch (const std::exception& e) {
    // An error that did not come through fail() (a segment /dev/shm has no room for, a
    // failed allocation, a broken invariant) leaves the peers in this call waiting for us:
    // break and tell them too, or they wait out their timeout for a rank that has given up.
    if (broken_reason_.empty()) break_and_tell_peers(op, e.what());
    throw;
  }
  flag_store_release(&header(rank_).completed.value, calls_);
}

}  // namespace ringcoll::host
