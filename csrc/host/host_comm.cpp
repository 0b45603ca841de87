// host_comm.cpp: the CPU transport. Bootstrap of the shared-memory segments, waits and
// failure, and native's paths: plans run by host_plan.cpp's engine (the one-shot for small
// messages, the direct-read all-gather, the ring) and symmetric memory read in place.
#include "host_comm.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <thread>

#include "host_strip.h"
#include "peer_memory.h"
#include "ringcoll/check.h"
#include "ringcoll/ring_loop.h"  // the slots' layout (slot_index), shared with the plan engine

namespace ringcoll::host {

size_t streaming_threshold_bytes() {
  // Past the last-level cache an output is written to memory anyway; below it, it may
  // still be in cache when the caller reads it. 8 MiB: a quarter of this EPYC's L3.
  static const size_t threshold = [] {
    const char* env = std::getenv("RINGCOLL_STREAMING_BYTES");
    return env != nullptr ? static_cast<size_t>(std::strtoull(env, nullptr, 10)) : size_t{8} << 20;
  }();
  return threshold;
}

SlotStores slot_stores_from_env() {
  const char* env = std::getenv("RINGCOLL_SLOT_STORES");
  const std::string value = env != nullptr ? env : "auto";
  if (value == "auto") return SlotStores::kAuto;
  if (value == "cache") return SlotStores::kCache;
  RINGCOLL_CHECK(value == "stream", std::invalid_argument,
                 "Communicator: RINGCOLL_SLOT_STORES must be auto, cache or stream, not '", value, "'");
  return SlotStores::kStream;
}

bool ranks_outnumber_cores(int world) {
  const unsigned cores = std::thread::hardware_concurrency();
  return cores != 0 && static_cast<unsigned>(world) > cores;
}

WaitPolicy host_wait_policy(int world, double timeout_seconds, bool shares_cores) {
  WaitPolicy policy;
  policy.timeout_seconds = timeout_seconds;
  // Oversubscribed: the peer we wait for may need this very core, so yield at once.
  if (ranks_outnumber_cores(world)) policy.spin_ns = 0;
  // Other busy threads on these cores (the link's): a spin or a long yield takes the core
  // from them, and the peer often waits for them. Two machines of 2 ranks on this 2-core
  // VM, 1 KiB hierarchical all-reduce: 1.3-5.0 ms with the default policy, 1.5-2.4 ms so.
  if (shares_cores) {
    policy.spin_ns = 0;
    policy.yield_ns = 50000;
  }
  return policy;
}

namespace {

// A text field of a header (abort_reason, probe_failure): written with strncpy, so it may
// fill its array without a NUL.
template <size_t N>
std::string header_text(const char (&field)[N]) {
  return std::string(field, strnlen(field, N));
}

void (*interrupt_check)() = nullptr;

std::atomic<uint64_t> forks{0};
// Registered when the extension loads: counts in each child, before any of its code runs.
const bool counting_forks = [] {
  pthread_atfork(nullptr, nullptr, [] { forks.fetch_add(1, std::memory_order_relaxed); });
  return true;
}();

}  // namespace

uint64_t forks_so_far() { return forks.load(std::memory_order_relaxed); }

void set_interrupt_check(void (*check)()) { interrupt_check = check; }

void HostComm::refuse_in_forked_child(const char* op) const {
  RINGCOLL_CHECK(made_at_fork_ == forks_so_far(), Error, op, ": this communicator was made before fork() (rank ",
                 rank_, ", pid ", made_by_pid_, "); a forked child has neither its threads nor its place "
                 "among the peers, which know the parent: make a new communicator in the child");
}

// ---------------------------------------------------------------------------------------
// Bootstrap

HostComm::HostComm(int rank, int world, const std::vector<std::string>& names, size_t buffer_bytes,
                   double timeout_seconds, bool check_calls, size_t small_bytes, size_t direct_bytes,
                   size_t direct_max_bytes, bool shares_cores)
    : rank_(rank), world_(world), buffer_bytes_(buffer_bytes),
      slot_bytes_(slot_bytes_for(buffer_bytes, world, kSlotAlignment)), small_bytes_(small_bytes),
      direct_bytes_(direct_bytes), direct_max_bytes_(direct_max_bytes),
      policy_(host_wait_policy(world, timeout_seconds, shares_cores)), check_calls_(check_calls),
      plan_unread_{std::vector<uint64_t>(static_cast<size_t>(world), 0),
                   std::vector<uint64_t>(static_cast<size_t>(world), 0)} {
  RINGCOLL_CHECK(world >= 1 && rank >= 0 && rank < world, std::invalid_argument, "Communicator: rank ", rank,
                 " is outside world size ", world);
  RINGCOLL_CHECK(static_cast<int>(names.size()) == world, std::invalid_argument,
                 "Communicator: expected one segment name per rank, got ", names.size());
  // The plan engine runs every collective, the ring included; its readers are a word's bits.
  RINGCOLL_CHECK(world <= kMaxPlanWorld, std::invalid_argument, "Communicator: the CPU transport runs at most ",
                 kMaxPlanWorld, " ranks on one host, not ", world,
                 " (a plan names the readers of a publication by the bits of one 64-bit word)");
  check_buffer_bytes("Communicator", buffer_bytes, world, kSlotAlignment);
  native_ring_.resize(kNumCollectives);
  native_one_shot_.resize(kNumCollectives);
  for (Collective coll : {Collective::kAllReduce, Collective::kReduceScatter, Collective::kAllGather}) {
    native_ring_[static_cast<size_t>(coll)] =
        compile_plan(ring_plan(coll, world), "ring", world, static_cast<uint32_t>(Algorithm::kRing));
    native_one_shot_[static_cast<size_t>(coll)] =
        compile_plan(one_shot_plan(coll, world), "oneshot", world, static_cast<uint32_t>(Algorithm::kOneShot));
  }
  native_direct_ = compile_plan(direct_plan(Collective::kAllGather, world), "direct", world,
                                static_cast<uint32_t>(Algorithm::kDirect));
  slot_stores_ = slot_stores_from_env();
  stream_slots_ = slot_stores_ == SlotStores::kStream;
  if (const char* env = std::getenv("RINGCOLL_SLOW_HOP_NS")) {
    slow_hop_ns_ = std::strtoull(env, nullptr, 10);
    slow_hop_given_ = true;
  }
  try {
    bootstrap(names);
  } catch (...) {
    // Tell peers that already mapped us, and leave a note in every segment we mapped (its
    // owner may not have mapped ours yet, and is about to lose the chance). Then leave
    // nothing of this job in /dev/shm. Our own name is removed only if we created it: if
    // creation failed because the name existed, that entry is someone else's.
    const bool created_own = !segments_.empty() && segments_[rank_].mapped();
    if (created_own) flag_store_release(&header(rank_).aborted.value, 1);
    for (int r = 0; r < static_cast<int>(segments_.size()); ++r)
      if (r != rank_ && segments_[r].mapped()) flag_store_release(&header(r).peer_gave_up.value, rank_ + 1);
    for (int r = 0; r < world_; ++r)
      if (r != rank_ || created_own) unlink_segment(names[r]);
    segments_.clear();
    throw;
  }
}

void HostComm::bootstrap(const std::vector<std::string>& names) {
  const size_t total = kHeaderBytes + buffer_bytes_ + kStoreProbeBytes;  // the store probe's block last
  names_ = names;
  segments_.resize(world_);
  segments_[rank_] = SegmentMapping::create(names[rank_], total, rank_);
  SegmentHeader& me = header(rank_);
  me.magic = kSegmentMagic;
  me.pid = made_by_pid_ = getpid();
  made_at_fork_ = forks_so_far();
  me.pid_namespace = own_pid_namespace();
  me.rank = rank_;
  me.world = world_;
  if (direct_bytes_ > 0) {
    allow_peer_reads();
    probe_token_ = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}() ^ 1;
    me.probe_address = reinterpret_cast<uintptr_t>(&probe_token_);
    me.probe_token = probe_token_;
  }

  current_op_ = "Communicator";
  map_peer_segments(names, total, segments_, "shared-memory segment");
  // Bootstrap barrier: once every rank has mapped every segment, no name is needed any more.
  flag_store_release(&me.attached.value, 1);
  for (int peer = 0; peer < world_; ++peer) {
    if (peer != rank_) wait_for(peer, &SegmentHeader::attached, 1, "map every segment");
  }
  for (const auto& name : names) unlink_segment(name);
  if (direct_bytes_ > 0 && world_ > 1) probe_direct_reads();
  else if (direct_bytes_ > 0) direct_unavailable_ = "one rank: no peer to read";
}

// A peer may not have created its segment yet, so retry until the timeout. All missing
// peers are tried each round and the mapped ones health-checked, so a peer that died is
// noticed even while an earlier one is still slow to appear.
void HostComm::map_peer_segments(const std::vector<std::string>& names, size_t bytes,
                                 std::vector<SegmentMapping>& into, const std::string& what) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(policy_.timeout_seconds));
  into.resize(world_);
  for (;;) {
    std::vector<int> missing;
    for (int peer = 0; peer < world_; ++peer) {
      if (peer == rank_ || into[peer].mapped()) continue;
      into[peer] = SegmentMapping::try_open(names[peer], bytes, peer);
      if (!into[peer].mapped()) missing.push_back(peer);
    }
    if (missing.empty()) return;
    std::ostringstream waiting;
    waiting << "waiting for rank " << missing[0];
    for (size_t i = 1; i < missing.size(); ++i) waiting << (i + 1 == missing.size() ? " and " : ", ") << missing[i];
    waiting << " to create " << (missing.size() > 1 ? "their " : "its ") << what;
    std::string why;
    for (int peer : missing) {  // its name says who makes it (and a dead maker's is removed)
      const int64_t maker = segment_maker(names[peer]);
      if (maker != 0 && !process_alive(maker) && why.empty())
        why = "rank " + std::to_string(peer) + " (pid " + std::to_string(maker) + ") has exited";
    }
    if (!why.empty() || !peers_look_alive(&why))
      fail<PeerError>(current_op_, "rank " + std::to_string(rank_) + " gave up " + waiting.str() + ": " + why);
    if (Clock::now() >= deadline) {
      std::ostringstream msg;  // a double as the other timeout messages print it
      msg << "rank " << rank_ << " timed out after " << policy_.timeout_seconds << " s " << waiting.str();
      fail<TimeoutError>(current_op_, msg.str());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Every rank reads every peer's probe word. Reading the right token proves both that the
// kernel lets us and that `pid` is that peer (a pid from another pid namespace could name
// some other process: skipped). All ranks then see all results, so all decide alike.
void HostComm::probe_direct_reads() {
  SegmentHeader& me = header(rank_);
  std::string failed;
  for (int peer = 0; peer < world_ && failed.empty(); ++peer) {
    if (peer == rank_) continue;
    const SegmentHeader& h = header(peer);
    uint64_t seen = 0;
    if (h.pid_namespace != me.pid_namespace) {
      failed = "it runs in another pid namespace";
    } else {
      failed = read_peer_memory(h.pid, h.probe_address, &seen, sizeof(seen));
      if (failed.empty() && seen != h.probe_token) failed = "the probe read the wrong value";
    }
    if (!failed.empty())
      failed = "rank " + std::to_string(rank_) + " cannot read rank " + std::to_string(peer) + ": " + failed;
  }
  std::strncpy(me.probe_failure, failed.c_str(), sizeof(me.probe_failure) - 1);
  me.cores_short = ranks_outnumber_cores(world_) ? 1 : 0;
  flag_store_release(&me.probed.value, failed.empty() ? kProbeReadAll : kProbeFailed);
  // All ranks take the same AND of the same P results (and OR of the cores); the reason
  // quoted is the first seen.
  oversubscribed_ = me.cores_short != 0;
  for (int peer = 0; peer < world_; ++peer) {
    if (peer == rank_) continue;
    wait_for(peer, &SegmentHeader::probed, kProbeReadAll, "probe direct reads");
    const SegmentHeader& h = header(peer);
    if (failed.empty() && flag_load_acquire(&h.probed.value) == kProbeFailed)
      failed = header_text(h.probe_failure);
    oversubscribed_ = oversubscribed_ || h.cores_short != 0;
  }
  direct_reads_ = failed.empty();
  direct_unavailable_ = failed;
}

// ---------------------------------------------------------------------------------------
// Waiting and failing

bool HostComm::peers_look_alive(std::string* why) const {
  if (interrupt_check != nullptr) interrupt_check();  // may throw (the binding's: Ctrl-C)
  const uint64_t my_namespace = header(rank_).pid_namespace;
  const uint64_t gave_up = flag_load_acquire(&header(rank_).peer_gave_up.value);
  if (gave_up != 0) {
    *why = "rank " + std::to_string(gave_up - 1) + " gave up while connecting (its own error says why)";
    return false;
  }
  for (int peer = 0; peer < world_; ++peer) {
    if (peer == rank_ || !segments_[peer].mapped()) continue;  // unmapped only during bootstrap
    const SegmentHeader& h = header(peer);
    if (flag_load_acquire(&h.aborted.value) != 0) {
      *why = "rank " + std::to_string(peer) + " has aborted: " + header_text(h.abort_reason);
      return false;
    }
    // A peer that completed the current call owes us nothing more in it (its data and
    // acknowledgements are all published), so its exit is not an error until the next call.
    if (calls_ > 0 && flag_load_acquire(&h.completed.value) >= calls_) continue;
    if (h.pid != 0 && h.pid_namespace == my_namespace && !process_alive(h.pid)) {
      *why = "rank " + std::to_string(peer) + " (pid " + std::to_string(h.pid) + ") has exited";
      return false;
    }
  }
  return true;
}

void HostComm::wait_for(int peer, const uint64_t* address, uint64_t target, const char* event) {
  std::string why;
  const WaitResult result =
      wait_flag_at_least(address, target, policy_, [&] { return peers_look_alive(&why); });
  if (result == WaitResult::kReady) return;
  // A peer's descriptor is published before its abort, so a mismatch that made it abort is
  // there to find (unchecked_call_).
  if (unchecked_call_ != nullptr) fail_if_any_call_differs(current_op_, *unchecked_call_);

  std::ostringstream msg;
  msg << "rank " << rank_ << " ";
  if (result == WaitResult::kTimedOut) msg << "timed out after " << policy_.timeout_seconds << " s";
  else msg << "gave up";
  const char* side = peer == left_neighbour(rank_, world_) ? "left neighbour " : (peer == right_neighbour(rank_, world_) ? "right neighbour " : "");
  msg << " waiting for " << side << "rank " << peer << " to " << event << where_in_call();
  msg << "; flag is " << flag_load_relaxed(address) << ", expected >= " << target;
  if (!why.empty()) msg << "; " << why;
  if (result == WaitResult::kTimedOut) fail<TimeoutError>(current_op_, msg.str());
  fail<PeerError>(current_op_, msg.str());
}

std::string HostComm::where_in_call() const {
  std::ostringstream at;
  if (position_.path == Path::kPlan) {
    const char* name = algorithm_name(static_cast<int>(position_.algorithm));
    at << " (call " << calls_ << ", slice " << position_.slice + 1 << "/" << position_.slices << ", plan op "
       << position_.step + 1 << "/" << position_.steps << " of " << (name != nullptr ? name : "a user plan") << ")";
  } else if (position_.path == Path::kZeroCopy) {
    at << " (call " << calls_ << ", reading symmetric memory in place)";
  } else if (calls_ > 0) {
    at << " (call " << calls_ << ", before any data moved)";
  }
  return at.str();
}

void HostComm::check_call(const char* op, const CallDescriptor& call) {
  // A peer that found a mismatch aborts at once, possibly while this rank still waits for a
  // slower peer's announcement: that wait then raises the mismatch (wait_for, unchecked_call_).
  for (int peer = 0; peer < world_; ++peer) {
    if (peer == rank_) continue;
    wait_for(peer, &header(peer).descriptor.seq, descriptor_seq_written(calls_), "announce its call");
    fail_if_call_differs(op, call, peer);
  }
}

void HostComm::fail_if_any_call_differs(const char* op, const CallDescriptor& call) {
  for (int peer = 0; peer < world_; ++peer)
    if (peer != rank_) fail_if_call_differs(op, call, peer);
}

void HostComm::fail_if_call_differs(const char* op, const CallDescriptor& call, int peer) {
  CallDescriptor theirs{};
  if (compare_descriptor(&header(peer).descriptor, call, calls_, &theirs) != PeerCall::kDiffers) return;
  std::ostringstream msg;
  msg << "mismatched collective calls (call " << calls_ << " on this communicator): rank " << rank_ << " called "
      << describe_call(call) << " but rank " << peer << " called " << describe_call(theirs);
  if (differ_in_algorithm_only(call, theirs) && call.algorithm < kFirstUserPlanCode &&
      theirs.algorithm < kFirstUserPlanCode)  // auto never chooses a plan written in Python
    msg << " (if both called with algorithm=\"auto\": auto chooses by the call's form too, from the table's in-place "
           "or out-of-place times, so ranks calling in different forms may choose differently; name the algorithm, "
           "or call in one form on every rank)";
  msg << "; no data was moved";
  fail<MismatchError>(op, msg.str());
}

void HostComm::ensure_usable(const char* op) const {
  RINGCOLL_CHECK(!closed_, Error, op, ": communicator is closed");
  RINGCOLL_CHECK(broken_reason_.empty(), Error, op, ": communicator is broken by an earlier error (",
                 broken_reason_, "); create a new one");
}


// ---------------------------------------------------------------------------------------
// The collectives
//
// The transport's own path ("native") for all-reduce, reduce-scatter and all-gather: the
// one-shot path for small messages, symmetric memory read in place, the direct-read
// all-gather, and otherwise the ring, which is the ring's plan (plan.h's ring_plan) run by
// the plan engine like any other plan: one step loop on the CPU. It is compiled once per
// collective when the communicator is made (native_ring_).

void HostComm::run_ring_call(const char* op, const RingCall& call, const void* input, void* output) {
  const bool one_shot = uses_one_shot(call);  // never with one rank (one_shot_fits)
  const bool direct = uses_direct_read(call);  // nor this (probed only with peers)
  const size_t coll = static_cast<size_t>(call.collective);
  const CompiledPlan& plan = one_shot ? native_one_shot_.at(coll) : direct ? native_direct_ : native_ring_.at(coll);
  // Symmetric memory (host_symmetric.cpp), once there is any: not for a one-shot call.
  const SymmetricArgs symmetric = one_shot ? SymmetricArgs{} : symmetric_args(call, input, output);
  run_collective(op, call.descriptor, [&] {
    one_shot_calls_ += one_shot;  // counted where its sends go, before the check
    before_the_check(call, plan, input, output);
    if (symmetric.posted) post_symmetric(call, symmetric);
  }, [&] {
    auto copy = [](void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); };
    run_call(call, world_, input, output, copy, [&] {
      if (symmetric.posted && run_zero_copy(call, symmetric, input, output)) return;
      direct_calls_ += direct;
      run_plan_steps(call, plan, input, output);
    });
  });
}

// ---------------------------------------------------------------------------------------
// Plans (plan.h): the engine is host_plan.cpp's

void HostComm::drain_plan_publications(int bank) {
  for (int b = 0; b < kBanks; ++b) {
    if (bank >= 0 && b != bank) continue;
    for (int peer = 0; peer < world_; ++peer) {
      uint64_t& unread = plan_unread_[b][peer];
      if (unread != 0) wait_for(peer, &header(peer).consumed_from[rank_], unread, "consume data");
      unread = 0;
    }
  }
}

// Before the call check of a call by `plan` (it writes nothing but this rank's own header
// and slots): where this rank's input and output lie, if the plan reads peers' memory where
// it lies, and the plan's early sends, where the call is one slice. Such calls fill the two
// banks in turn (the same on every rank: each counts them alike), so that a rank's sends
// wait only for its readers of the call before last, not of the last one: a rank may run a
// call ahead of a peer that still reads the last (the slack one-shot calls need).
void HostComm::before_the_check(const RingCall& call, const CompiledPlan& plan, const void* input,
                                const void* output) {
  if (plan.reads_in_place) post_direct_places(call, input, output);
  call_start_ = {};
  if (world_ == 1 || !plan.plan.sends_early) return;
  const int64_t slice = plan_slice_elems(plan, buffer_bytes_, call.ring_count, static_cast<size_t>(call.elem_size));
  if (slice <= 0 || num_slices(call.ring_count, plan.plan.chunks, slice) != 1) return;
  call_start_.first_bank = static_cast<int>(one_slice_early_calls_++ % kBanks);
  if (plan.early_sends[rank_] == 0) return;
  drain_plan_publications(call_start_.first_bank);
  run_host_plan_early_sends(*this, plan, call, input, step_base_, plan_scratch_, call_start_.first_bank);
  call_start_.early_ops_done = plan.early_sends[rank_];
}

// Slices of one call by `plan`, once its call check has passed (run_call's body).
void HostComm::run_plan_steps(const RingCall& call, const CompiledPlan& plan, const void* input, void* output) {
  // A plan that fills no slot (direct reads only) has nothing to wait for before it, nor
  // any stores to choose: a slot call after it drains what came before. Early sends
  // drained before they went.
  if (fills_slots(plan)) {
    if (call_start_.early_ops_done == 0) drain_plan_publications();
    choose_slot_stores(call);
  }
  step_base_ += run_host_plan(*this, plan, call, input, output, step_base_, plan_unread_, plan_scratch_, call_start_);
  if (plan.reads_in_place) finish_direct_reads();
  fail_if_a_peer_gave_up();
}

// The waits of a call return at once for what is already there, so a rank arriving after a
// peer gave up on this call (one that published all it had to, then timed out waiting for
// this rank) could finish the call with no error, and hear of it only in the next. A peer's
// `aborted` is one load. A peer that completed this call (its `completed`, stored before
// any later abort, is visible once `aborted` is acquired) aborted in a later call: this
// one stands.
void HostComm::fail_if_a_peer_gave_up() {
  for (int peer = 0; peer < world_; ++peer) {
    const SegmentHeader& h = header(peer);
    if (peer == rank_ || flag_load_acquire(&h.aborted.value) == 0) continue;
    if (flag_load_acquire(&h.completed.value) >= calls_) continue;
    fail<PeerError>(current_op_, "rank " + std::to_string(rank_) + " gave up after its last wait" + where_in_call() +
                                     ": rank " + std::to_string(peer) + " has aborted: " + header_text(h.abort_reason));
  }
}

void HostComm::run_plan(Collective coll, const CompiledPlan& plan, const void* input, void* output,
                        int64_t user_count, DType dtype, ReduceOp op) {
  RingCall call = ring_call(coll, user_count, dtype, op, world_, plan.root);
  call.descriptor.algorithm = static_cast<int32_t>(plan.id);
  run_plan_call(collective_info(coll).name, call, plan, input, output);
}

void HostComm::run_plan_call(const char* op, const RingCall& call, const CompiledPlan& plan, const void* input,
                             void* output) {
  check_plan_fits(plan, call.collective, world_, op);
  RINGCOLL_CHECK(!plan.reads_in_place || direct_reads_, std::invalid_argument, op, ": this plan reads peers' "
                 "memory where it lies (process_vm_readv), which this communicator cannot: ", direct_unavailable_,
                 " (RINGCOLL_DIRECT_BYTES=0 turns direct reads off; else the probe at bootstrap failed)");
  run_collective(op, call.descriptor, [&] { before_the_check(call, plan, input, output); }, [&] {
    auto copy = [](void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); };
    run_call(call, world_, input, output, copy, [&] { run_plan_steps(call, plan, input, output); });
  });
}


// ---------------------------------------------------------------------------------------
// The slots' stores (SlotStores in host_comm.h)
//
// A slot is read by a neighbour a moment after it is written. If the two cores share a
// last-level cache the reader finds the lines there, and ordinary stores are best. If not,
// each line the reader takes is still in the writer's cache, and fetching it from there
// costs a hop between dies for every line, far slower than reading memory: then streaming
// stores, which put the lines in memory, win by up to 10x. Which of the two holds can
// change while a job runs (a VM's cores move), so kAuto measures the hop itself, on the
// first large ring or plan call and every kHopProbeEvery-th after: a token passed round the
// ring. A probe costs a few microseconds (kHopLaps laps of P hops) on calls of at least
// 256 KiB, which take tens of microseconds or more. Every rank counts the same large calls,
// so all meet in the same probe; each decides for its own stores from the laps it saw.
// Ranks that take turns on cores do not probe (probes_hops): their laps time the scheduler.
//
// A hop's length is a proxy, though: what is slow between an EPYC's dies (~250 ns) is
// the usual hop between two cores of an Intel Xeon that share one last-level cache (165-200
// ns), where ordinary stores win. So a store probe that times the stores themselves
// (probe_slot_stores) follows the first two hop probes, every kStoreProbeEvery-th, and any
// whose hop (rank 0's) is unlike the one the last store probe was made at (the cores
// moved); its verdict holds for every later hop within kSameHopFactor of the one it was
// made at: the same cores, as far as the hop can tell. A hop unlike it falls back on the
// threshold until the next store probe. RINGCOLL_SLOW_HOP_NS, when set, is taken as said:
// the threshold alone decides.

void HostComm::choose_slot_stores(const RingCall& call) {
  const size_t message = message_bytes(call);
  if (!probes_hops() || message < kHopProbeMinBytes) return;
  if (large_slot_calls_++ % kHopProbeEvery == 0 && probe_neighbour_hops()) probe_slot_stores();
}

bool HostComm::near_store_probe_hop(uint64_t hop_ns) const {
  const double probed = static_cast<double>(store_probe_hop_ns_), hop = static_cast<double>(hop_ns);
  return store_probe_hop_ns_ != 0 && hop <= probed * kSameHopFactor && hop * kSameHopFactor >= probed;
}

bool HostComm::streams_at_hop(uint64_t hop_ns) const {
  return near_store_probe_hop(hop_ns) ? store_probe_streams_ : hop_ns >= slow_hop_ns_;
}

bool HostComm::probe_neighbour_hops() {
  using clock = std::chrono::steady_clock;
  const uint64_t base = hop_probes_++ * kHopLaps;
  const int left = left_neighbour(rank_, world_);
  auto fastest = clock::duration::max();
  auto lap_began = clock::now();
  auto lap_ends = [&] {  // the token is here again: one lap since it was here last
    const auto now = clock::now();
    fastest = std::min(fastest, now - lap_began);
    lap_began = now;
  };
  for (uint64_t lap = 1; lap <= kHopLaps; ++lap) {
    // Rank 0 starts each lap once the last came round; the others pass the token on.
    if (rank_ != 0) {
      wait_for(left, &SegmentHeader::hop, base + lap, "pass the hop token on");
      if (lap == 1) lap_began = clock::now();
      else lap_ends();
    } else if (lap > 1) {
      wait_for(left, &SegmentHeader::hop, base + lap - 1, "pass the hop token on");
      lap_ends();
    } else {
      lap_began = clock::now();
    }
    flag_store_release(&header(rank_).hop.value, base + lap);
  }
  if (rank_ == 0) {
    wait_for(left, &SegmentHeader::hop, base + kHopLaps, "pass the hop token on");
    lap_ends();
  }
  hop_ns_ = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(fastest).count()) /
            static_cast<uint64_t>(world_);
  // Microseconds per hop on every lap is a peer off its core (another process had it, or
  // ranks outnumber cores), not a distance between caches: keep the choice already made.
  if (hop_ns_ < kHopOffCoreNs) stream_slots_ = streams_at_hop(hop_ns_);
  slow_hop_probes_ += stream_slots_ ? 1 : 0;
  // Whether a store probe follows: rank 0 decides for all (they must meet there), on the
  // turns counted alike, or where its hop is unlike the one its last store probe was made at
  // (the cores moved), and says so after the laps: hop_verdict = 2n, + 1 for a probe.
  const uint64_t n = hop_probes_;
  if (rank_ == 0) {
    const bool turn = n <= 2 || (n - 1) % kStoreProbeEvery == 0;
    const bool moved = hop_ns_ < kHopOffCoreNs && !near_store_probe_hop(hop_ns_);
    flag_store_release(&header(0).hop_verdict.value, 2 * n + (!slow_hop_given_ && (turn || moved) ? 1 : 0));
  }
  wait_for(0, &SegmentHeader::hop_verdict, 2 * n, "say whether the stores are probed");
  return (flag_load_acquire(&header(0).hop_verdict.value) & 1) != 0;
}

void HostComm::probe_slot_stores() {
  using clock = std::chrono::steady_clock;
  auto ns_since = [](clock::time_point began) {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - began).count());
  };
  const uint64_t base = store_probes_++ * (kStoreProbeRounds + 1);
  const int left = left_neighbour(rank_, world_), right = right_neighbour(rank_, world_);
  const size_t bytes = kStoreProbeBytes;
  store_probe_scratch_.resize(bytes, 1);
  char* const mine = store_probe_block(rank_);
  uint64_t write_ns[2] = {UINT64_MAX, UINT64_MAX}, read_ns[2] = {UINT64_MAX, UINT64_MAX};
  // The block lies past the slots (whatever they hold: a call's early sends), in the segment
  // the neighbour reads; its pages are taken only once a probe writes them.
  for (int round = 0; round < kStoreProbeRounds; ++round) {
    const int streaming = round % 2;
    const uint64_t phase = base + static_cast<uint64_t>(round) + 1;
    if (round > 0) wait_for(right, &SegmentHeader::store_probe_read, phase - 1, "read the store probe's block");
    auto began = clock::now();
    copy_strip<char>(mine, nullptr, store_probe_scratch_.data(), static_cast<int64_t>(bytes), false, streaming);
    if (streaming) stream_fence();
    write_ns[streaming] = std::min(write_ns[streaming], ns_since(began));
    flag_store_release(&header(rank_).store_probe.value, phase);
    // The left neighbour's block, copied as a reader copies a slot out
    wait_for(left, &SegmentHeader::store_probe, phase, "write the store probe's block");
    began = clock::now();
    std::memcpy(store_probe_scratch_.data(), store_probe_block(left), bytes);
    read_ns[streaming] = std::min(read_ns[streaming], ns_since(began));
    flag_store_release(&header(rank_).store_probe_read.value, phase);
  }
  auto& times = header(rank_).store_probe_times;
  std::copy(write_ns, write_ns + 2, times.write_ns);
  std::copy(read_ns, read_ns + 2, times.read_ns);
  const uint64_t done = base + kStoreProbeRounds + 1;
  flag_store_release(&header(rank_).store_probe.value, done);
  // Its times are there once it says `done`, which it says after its last read of my block.
  wait_for(right, &SegmentHeader::store_probe, done, "time the store probe");
  const auto& theirs = header(right).store_probe_times;
  const uint64_t cost_ordinary = write_ns[0] + theirs.read_ns[0], cost_streaming = write_ns[1] + theirs.read_ns[1];
  if (hop_ns_ >= kHopOffCoreNs) return;  // a peer off its core: the times tell nothing either
  store_probe_hop_ns_ = hop_ns_;
  store_probe_streams_ = cost_streaming < cost_ordinary;
  stream_slots_ = store_probe_streams_;
}

// ---------------------------------------------------------------------------------------
// The one-shot path for small messages (plan.h's one_shot_plan, native_one_shot_)
//
// Below a crossover the ring's 2(P-1) steps (P-1 for reduce-scatter and all-gather), each a
// publication and a wait, cost more than the bytes. The one-shot takes one step: rank k
// publishes to its peers what they need (all-reduce: every chunk of its input to every
// peer; reduce-scatter: chunk c to rank c; all-gather: its input), and then, for every
// chunk it answers for, folds the P contributions itself, in the order the ring reduces
// them (rs_contributor: chunk c from rank c+1 round to rank c), with the ring's kernels
// (reduce_strip: the same per-combine rounding of 16-bit floats, AVG's finalize), so a
// one-shot call gives the ring's bits on every rank: the size at which the path changes
// never changes a result. Reads: P-1 peer slots of the published size each.
//
// Its publications are early sends (Plan::sends_early): they go before the call check
// (run_collective), so that a small call meets its peers once, not twice; before them,
// every publication of this rank in the bank they fill must have been read
// (drain_plan_publications; such calls take the banks in turn: before_the_check). Peers read
// them only after their own check passed, so a mismatch still moves nothing into any output.

bool HostComm::uses_one_shot(const RingCall& call) const {
  return one_shot_fits(call.collective, call.ring_count, call.elem_size, world_, small_bytes_, slot_bytes_) &&
         !uses_direct_read(call);
}

// ---------------------------------------------------------------------------------------
// The direct-read all-gather (16 KiB up to 32 MiB by default: direct_read_fits)
//
// Through the slots (the ring or the one-shot path), every byte of an all-gather is copied
// twice on its way: by its owner into a slot, and by each reader out of it (1.5 times per
// byte of output at P = 2, out of place). Where the kernel lets ranks read each other's
// memory (peer_memory.h, probed at bootstrap), native runs the direct plan instead (plan.h's
// direct_plan, on the plan engine like the ring; native_direct_): rank k
//
//   1. posts where its input lies (address, bytes, call number) in its header;
//   2. for j = k+1, k+2, .. (mod P): waits for rank j's post of this call and reads rank
//      j's input straight into chunk j of its output: one copy, in the kernel;
//   3. says it has read every peer (`direct_read` = the call number: say_peer_reads_done,
//      after its last read), copies its own chunk into chunk k of its output (nothing in
//      place) while peers may still read its input, and waits until every peer has said so
//      (finish_direct_reads): only then may the caller reuse its input.
//
// Each rank reads (P-1)/P of the message once, against the ring's P-1 steps that each
// write and read a slot. Readers start at different peers, so no input is read by all at
// once. The post goes before the call check (like the one-shot publication it writes
// only my own header), and peers read only after their own check passed: a mismatch
// still moves nothing. Without the check, the posted sizes are compared instead, so no
// rank reads past a peer's input. No slot is touched, so the slots' numbering is untouched
// too. The reads go straight into the output: staging them in a bounce buffer that stays
// in cache, so that the output could take streaming stores, costs a second copy and more
// than it saves (P = 2, 8 and 16 MiB, two runs: 1048-1116 and 2191-2247 us staged, 908-1021
// and 1621-1896 straight; bench/results/2026-12-01-cpu-in-place.txt). The own chunk, copied
// last, streams past the streaming threshold (streams_output), as the ring's output does:
// by then the reads have pushed the output's lines out of cache.

bool HostComm::uses_direct_read(const RingCall& call) const {
  if (!direct_read_fits(call.collective, call.ring_count, call.elem_size, direct_reads_, direct_bytes_,
                        direct_max_bytes_))
    return false;
  // With more ranks than cores each round of handshakes may wait for the scheduler, and a
  // direct read takes two (the posts; the reads done) to the one-shot's one: there the
  // one-shot path goes first (P = 4 on two cores, 4-64 KiB: the one-shot 0.7-0.8x the direct
  // read's time, bench/results/2026-12-01-cpu-plain-calls.txt).
  return !(oversubscribed_ && one_shot_fits(call.collective, call.ring_count, call.elem_size, world_, small_bytes_,
                                            slot_bytes_));
}

void HostComm::post_direct_places(const RingCall& call, const void* input, const void* output) {
  auto& post = header(rank_).direct_post;
  post.address = reinterpret_cast<uintptr_t>(input);
  post.bytes = input_bytes(call, world_);
  post.output_address = reinterpret_cast<uintptr_t>(output);
  post.output_bytes = output_bytes(call, world_);
  flag_store_release(&post.call, calls_);
}

void HostComm::say_peer_reads_done() { flag_store_release(&header(rank_).direct_read.value, calls_); }

void HostComm::finish_direct_reads() {
  say_peer_reads_done();
  for (int peer = 0; peer < world_; ++peer)
    if (peer != rank_)
      wait_for(peer, &SegmentHeader::direct_read, calls_, "finish reading this rank's input or shared output");
}

void HostComm::read_peer(int peer, PeerPlace place, size_t offset, void* into, size_t bytes) {
  const SegmentHeader& h = header(peer);
  wait_for(peer, &h.direct_post.call, calls_, "post where its input and output lie");
  // Every rank posts its whole input and output, the same sizes on every rank in a matching
  // call: a difference is a mismatch the call check (if off) did not see, named by both ranks.
  const auto& mine = header(rank_).direct_post;
  if (h.direct_post.bytes != mine.bytes || h.direct_post.output_bytes != mine.output_bytes)
    fail<MismatchError>(current_op_, "rank " + std::to_string(peer) + " posted " + std::to_string(h.direct_post.bytes) +
                                         " bytes of input and " + std::to_string(h.direct_post.output_bytes) +
                                         " of output but rank " + std::to_string(rank_) + " posted " +
                                         std::to_string(mine.bytes) + " and " + std::to_string(mine.output_bytes) +
                                         " (call " + std::to_string(calls_) + ")");
  const bool input = place == PeerPlace::kInput;
  const uint64_t address = input ? h.direct_post.address : h.direct_post.output_address;
  const std::string failed = read_peer_memory(h.pid, address + offset, into, bytes);
  if (!failed.empty())
    fail<PeerError>(current_op_, "rank " + std::to_string(rank_) + " could not read rank " + std::to_string(peer) +
                                     (input ? "'s input" : "'s output") + where_in_call() + ": " + failed);
}

void HostComm::all_reduce(const void* input, void* output, int64_t user_count, DType dtype, ReduceOp op) {
  run_ring_call("all_reduce", ring_call(Collective::kAllReduce, user_count, dtype, op, world_), input, output);
}

void HostComm::reduce_scatter(const void* input, void* output, int64_t user_count, DType dtype, ReduceOp op) {
  run_ring_call("reduce_scatter", ring_call(Collective::kReduceScatter, user_count, dtype, op, world_), input,
                output);
}

void HostComm::all_gather(const void* input, void* output, int64_t user_count, DType dtype) {
  run_ring_call("all_gather", ring_call(Collective::kAllGather, user_count, dtype, ReduceOp::kSum, world_), input,
                output);
}

void HostComm::barrier() {
  run_collective("barrier", CallDescriptor{kBarrierCollective, 0, 0, 0, 0}, [] {}, [&] {
    ++barrier_generation_;
    flag_store_release(&header(rank_).barrier.value, barrier_generation_);
    for (int peer = 0; peer < world_; ++peer) {
      if (peer != rank_) wait_for(peer, &SegmentHeader::barrier, barrier_generation_, "enter the barrier");
    }
  });
}

void HostComm::close() {
  // In a forked child the mutex may be held by a thread of the parent that the child does
  // not have: nothing else runs on this copy there, so unmap without it.
  std::unique_lock<std::mutex> lock(one_call_at_a_time_, std::defer_lock);
  if (made_at_fork_ == forks_so_far()) lock.lock();
  segments_.clear();  // unmaps; the names were unlinked at bootstrap
  peer_arenas_.clear();  // the peers' symmetric memory; this rank's own stays while its tensors do
  closed_ = true;
}

}  // namespace ringcoll::host
