// emulated_ring.cpp: the CUDA transport's ring kernels run on the CPU, so CI (no GPU) tests
// the code the GPU runs: device_ring.h's ring_block, the launch plan of kernel_abi.h (both
// variants), the flag protocol per block, slicing, bookkeeping kept between launches, the
// mismatch check, and giving up (timeouts, and aborts that travel round the ring).
//
// What it is: P ranks as threads of this process, each with an "IPC allocation" in host
// memory laid out as on the GPU; a launch of B blocks of T threads runs B*T std::threads
// (cuda_shim.h: __syncthreads is a barrier per block, %globaltimer a steady clock). Each
// rank's copies and kernels go on its communicator's stream of a modelled device
// (emulated_streams.h: in-order streams, events, the legacy default stream, hardware
// queues, implicit syncs, graph capture), in the order CudaComm queues them
// (stream_order.h), so a deadlock of that order shows here as it would on a GPU.
// What it is not: the GPU's memory model, IPC, SM occupancy or the compiled PTX. Those are
// checked only on a GPU (tests/gpu/test_cuda.py, bench/device_check.sh).
#include "emulated_ring.h"

#include "emulated_launch.h"  // first: cuda_shim.h, before any device code
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <sys/mman.h>
#include <unistd.h>

#include "../cuda/close_protocol.h"
#include "../cuda/device_plan.h"
#include "../cuda/stream_order.h"
#include "ringcoll/check.h"

namespace ringcoll::emulation {

using cuda::AbortCause;
using cuda::CallEvents;
using cuda::ErrorRecord;
using cuda::KernelVariant;
using cuda::RingParams;

namespace {

const char* error_type(AbortCause cause) {
  switch (cause) {
    case AbortCause::kTimedOut: return "RingcollTimeoutError";
    case AbortCause::kMismatch:
    case AbortCause::kNotSymmetric: return "RingcollMismatchError";
    default: return "RingcollPeerError";
  }
}

// stream_order.h's adapter over the modelled device; a host wait outlasting `timeout` fails.
struct ModelStreams {
  using Stream = int;
  using Event = int;
  Device& device;
  double timeout;
  void record(int event, int stream) { device.record(event, stream); }
  void record_for_replays(int event, int stream) { device.record(event, stream, /*external=*/true); }
  void wait(int stream, int event) { device.wait(stream, event); }
  bool capturing(int stream) { return device.is_capturing(stream); }
  bool synchronize_stream(int stream) { return device.synchronize_stream(stream, timeout); }
  bool synchronize_event(int event) { return device.synchronize_event(event, timeout); }
};

// An arena's part in host memory that can be mapped again (emulated CUDA IPC): a memfd, the
// owner's mapping of it, and its handle, the descriptor a peer maps it by.
class SharedPart {
 public:
  explicit SharedPart(size_t bytes) : bytes_(bytes) {
    fd_ = memfd_create("ringcoll-emulated-arena", MFD_CLOEXEC);
    RINGCOLL_CHECK(fd_ >= 0, std::runtime_error, "empty: memfd_create failed: ", std::strerror(errno));
    if (ftruncate(fd_, static_cast<off_t>(bytes)) != 0) {
      const int err = errno;
      close(fd_);
      throw std::runtime_error(std::string("empty: cannot size an emulated arena: ") + std::strerror(err));
    }
    base_ = map(fd_, bytes);
  }
  ~SharedPart() {
    munmap(base_, bytes_);
    close(fd_);
  }
  SharedPart(const SharedPart&) = delete;
  SharedPart& operator=(const SharedPart&) = delete;
  static char* map(int fd, size_t bytes) {
    void* at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    RINGCOLL_CHECK(at != MAP_FAILED, std::runtime_error, "empty: cannot map an emulated arena: ", std::strerror(errno));
    return static_cast<char*>(at);
  }
  char* base() const { return base_; }
  size_t bytes() const { return bytes_; }
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  char* base_ = nullptr;
  size_t bytes_;
};

// A peer's part as this rank maps it: another address for the same memory.
struct PeerMapping {
  PeerMapping(int fd, size_t bytes) : base(SharedPart::map(fd, bytes)), bytes(bytes) {}
  ~PeerMapping() { munmap(base, bytes); }
  PeerMapping(const PeerMapping&) = delete;
  PeerMapping& operator=(const PeerMapping&) = delete;
  char* base;
  size_t bytes;
};

struct ArenaHandle {  // what goes round the bootstrap, as CUDA's IPC handle does
  int32_t fd, rank;
  uint64_t bytes;
};

}  // namespace

struct EmulatedRing::Rank {
  std::unique_ptr<char, decltype(&std::free)> memory{nullptr, &std::free};
  std::vector<uint64_t> state;
  cuda::PlanRecords plan_records;                 // as CudaComm's: which plans' records lie where
  std::vector<cuda::DevicePlanOp> plan_area;      // kPlanRecordCapacity records, never resized
  std::vector<char> plan_work;                    // plan_work_bytes
  std::vector<ErrorRecord> errors;
  std::string broken_reason;
  std::atomic<bool> closed{false};
  std::atomic<bool> freed{false};  // closed and let its memory go: nobody may touch it since
  int stream = 0;                  // its communicator's stream on the device
  bool stream_retired = false;     // kept from the device's idle streams (retire_stream)
  bool stream_given_back = false;  // at its close (close_rank), as CudaComm does
  CallEvents<int> events{};
  // Symmetric memory: this rank's parts (in the heap), its table of every rank's parts as
  // mapped here, the peers' parts it mapped, and its part of an arena being made.
  std::shared_ptr<SymmetricHeap> heap = std::make_shared<SymmetricHeap>();
  cuda::SymmetricTable table;
  std::vector<std::shared_ptr<PeerMapping>> peer_parts;
  std::shared_ptr<SharedPart> making;
  mutable std::mutex symmetric_mutex;  // the rank's Python thread allocates while its kernels run
};

EmulatedRing::EmulatedRing(int world, size_t buffer_bytes, double timeout_seconds, int variant, int threads_per_block,
                           bool check_calls, int max_blocks, std::shared_ptr<Device> device, bool peers_in_process)
    : world_(world), slot_bytes_(slot_bytes_for(buffer_bytes, world, cuda::kSlotAlignment)),
      timeout_seconds_(timeout_seconds), variant_(variant), threads_(threads_per_block), max_blocks_(max_blocks),
      check_calls_(check_calls), peers_in_process_(peers_in_process),
      device_(device ? std::move(device) : std::make_shared<Device>(32)) {
  RINGCOLL_CHECK(world >= 1 && world <= cuda::kMaxWorld, std::invalid_argument, "EmulatedRing: world ", world,
                 " is outside 1..", cuda::kMaxWorld);
  check_buffer_bytes("EmulatedRing", buffer_bytes, world, cuda::kSlotAlignment);
  RINGCOLL_CHECK(variant == 0 || variant == 1, std::invalid_argument, "EmulatedRing: unknown kernel variant ", variant);
  RINGCOLL_CHECK(threads_per_block >= 1 && threads_per_block <= 64, std::invalid_argument,
                 "EmulatedRing: threads_per_block must be in 1..64, got ", threads_per_block);
  RINGCOLL_CHECK(max_blocks >= 1 && max_blocks <= cuda::kMaxBlocks, std::invalid_argument,
                 "EmulatedRing: max_blocks must be in 1..", cuda::kMaxBlocks, ", got ", max_blocks);
  const size_t total = cuda::kFlagAreaBytes + static_cast<size_t>(kBanks) * world * slot_bytes_;
  for (int r = 0; r < world; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->memory.reset(static_cast<char*>(std::aligned_alloc(4096, (total + 4095) / 4096 * 4096)));
    RINGCOLL_CHECK(rank->memory != nullptr, std::runtime_error, "EmulatedRing: out of memory");
    std::memset(rank->memory.get(), 0, total);
    rank->state.assign(cuda::kStateWords, 0);
    rank->plan_area.resize(static_cast<size_t>(cuda::kPlanRecordCapacity));
    rank->plan_work.resize(cuda::plan_work_bytes(slot_bytes_, world));
    rank->errors.assign(cuda::kMaxBlocks, ErrorRecord{});
    rank->stream = device_->take_stream();
    rank->events = {device_->create_event(), device_->create_event(), device_->create_event()};
    ranks_.push_back(std::move(rank));
  }
}

// The kernels queued are done or give up within the timeout: the device waits for those
// running, and drops work that never started (whose memory is going).
// A stream given back at its rank's close was idle then, and may be another ring's now.
EmulatedRing::~EmulatedRing() {
  for (auto& rank : ranks_)
    if (!rank->stream_given_back) device_->synchronize_stream(rank->stream, host_wait_seconds());
  for (auto& rank : ranks_) {
    if (!rank->stream_retired && !rank->stream_given_back) device_->give_back_stream(rank->stream);
    for (int event : {rank->events.ready, rank->events.done, rank->events.replayed}) device_->destroy_event(event);
  }
}

void EmulatedRing::note_violation(const std::string& what) {
  std::lock_guard<std::mutex> lock(violations_mutex_);
  if (violations_.empty()) violations_ = what;
}

std::string EmulatedRing::violations() const {
  std::lock_guard<std::mutex> lock(violations_mutex_);
  return violations_;
}

double EmulatedRing::host_wait_seconds() const { return 2 * timeout_seconds_ + 5; }

int EmulatedRing::own_stream(int rank) const {
  RINGCOLL_CHECK(rank >= 0 && rank < world_, std::invalid_argument, "EmulatedRing: rank ", rank, " is outside 0..",
                 world_ - 1);
  return ranks_[rank]->stream;
}

void EmulatedRing::retire_stream(int rank) {
  own_stream(rank);  // the rank's range checked
  ranks_[rank]->stream_retired = true;
}

std::vector<CallResult> EmulatedRing::run(const std::vector<EmulatedCall>& calls) {
  // Each rank runs its calls in the order given, on its own thread, never waiting for the
  // other ranks between calls: a rank may run ahead, as a GPU rank's host thread does.
  std::vector<std::vector<size_t>> by_rank(static_cast<size_t>(world_));
  for (size_t k = 0; k < calls.size(); ++k) {
    RINGCOLL_CHECK(calls[k].rank >= 0 && calls[k].rank < world_, std::invalid_argument,
                   "EmulatedRing.run: rank ", calls[k].rank, " is outside 0..", world_ - 1);
    by_rank[calls[k].rank].push_back(k);
  }
  std::vector<CallResult> results(calls.size());
  std::vector<std::thread> ranks;
  for (const auto& mine : by_rank) {
    if (mine.empty()) continue;
    ranks.emplace_back([&, mine] {
      for (size_t k : mine) {
        const EmulatedCall& c = calls[k];
        if (c.collective == kClose || c.collective == kCloseWithoutWaiting) {
          results[k] = close_rank(c.rank, c.collective == kClose);
        } else {
          results[k] = enqueue(c, ranks_[c.rank]->stream, /*join=*/true);
          if (results[k].error_type.empty()) results[k] = synchronize(c.rank);
        }
      }
    });
  }
  for (auto& thread : ranks) thread.join();
  return results;
}

// What CudaComm::close does (cuda_comm.cu, steps 2 to 4; this rank's calls are all done,
// as after its stream synchronisation), then the caller's host rendezvous: write our
// `finished` word into every peer's memory (kKeeps when broken), set `aborted` = closed
// unless a kernel already gave up, then, unless broken, wait until every peer's word is in
// ours (telling them kKeeps if it does not come), meet every peer at the rendezvous, and
// "free" (mark freed: a later write into it by anyone is a protocol error, reported by the
// writer's close). The result's message says why the rank would keep its allocation
// (CudaComm::kept_on_close), "" if it freed it.
CallResult EmulatedRing::close_rank(int rank, bool wait_for_peers) {
  Rank& me = *ranks_[rank];
  if (me.closed) return {};
  ModelStreams streams{*device_, host_wait_seconds()};
  const bool idle = cuda::wait_for_own_work(streams, me.stream, me.events);
  if (!idle && me.broken_reason.empty())
    me.broken_reason = "its work did not finish within " + std::to_string(host_wait_seconds()) + " s";
  check_error(rank);  // an error not reported yet makes it broken, as in CudaComm::leave_peers
  std::string breach;
  auto tell_peers = [&](uint64_t word) {
    for (int r = 0; r < world_; ++r) {
      if (r == rank) continue;
      if (ranks_[r]->freed.load()) {
        if (breach.empty())
          breach = "rank " + std::to_string(r) + " freed its memory before rank " + std::to_string(rank) + " closed";
        continue;
      }
      flag_store_release(reinterpret_cast<uint64_t*>(ranks_[r]->memory.get() + cuda::finished_word_offset(rank)), word);
    }
  };
  tell_peers(me.broken_reason.empty() && wait_for_peers ? cuda::kWillFree : cuda::kKeeps);
  if (!breach.empty()) return {"AssertionError", breach};
  char* base = me.memory.get();
  flag_set_once(cuda::aborted_flag(base), static_cast<uint64_t>(AbortCause::kClosed));
  std::string kept;
  if (world_ > 1 && !me.broken_reason.empty()) {
    kept = "the communicator is broken (" + me.broken_reason + ")";
  } else if (world_ > 1 && !wait_for_peers) {
    kept = cuda::kKeptByFinalizer;
  } else if (world_ > 1) {
    kept = cuda::wait_for_peers_or_keep(rank, world_, timeout_seconds_, tell_peers, [&](int r, uint64_t* word) {
      *word = flag_load_acquire(reinterpret_cast<const uint64_t*>(base + cuda::finished_word_offset(r)));
      return true;
    });
    if (!breach.empty()) return {"AssertionError", breach};
    if (kept.empty()) kept = host_rendezvous(rank);
  }
  me.freed = kept.empty();
  me.closed = true;
  me.broken_reason = "closed";
  // CudaComm gives its stream back to the lender here (free_memory), idle (its wait for its
  // work has no timeout there), unless retired: a communicator made next (another rank's,
  // perhaps) may take it at once. A stream whose work is still stuck here is not lent again.
  if (idle && !me.stream_retired) device_->give_back_stream(me.stream);
  me.stream_given_back = idle;
  return {"", kept};
}

// The caller's host rendezvous between leaving the peers and freeing (transports/cuda.py:
// the group's barrier, bounded by the communicator's timeout): every rank has unmapped us.
std::string EmulatedRing::host_rendezvous(int rank) {
  std::unique_lock<std::mutex> lock(rendezvous_mutex_);
  ++at_rendezvous_;
  rendezvous_cv_.notify_all();
  const auto timeout = std::chrono::duration<double>(timeout_seconds_);
  if (rendezvous_cv_.wait_for(lock, timeout, [&] { return at_rendezvous_ >= world_; })) return "";
  std::ostringstream why;
  why << "not every peer reached the rendezvous before freeing (rank " << rank << " waited " << timeout_seconds_
      << " s)";
  return why.str();
}

// What CudaComm::launch does for one rank, with the GPU replaced by the modelled device and
// its kernels launched on threads (emulated_launch.h).
CallResult EmulatedRing::enqueue(const EmulatedCall& c, int user_stream, bool join) {
  RINGCOLL_CHECK(c.rank >= 0 && c.rank < world_, std::invalid_argument, "EmulatedRing: rank ", c.rank,
                 " is outside 0..", world_ - 1);
  Rank& me = *ranks_[c.rank];
  if (!me.broken_reason.empty()) return {"RingcollError", "communicator is broken by an earlier error"};
  const auto coll = static_cast<Collective>(c.collective);
  if (!is_supported(coll, static_cast<DType>(c.dtype), static_cast<ReduceOp>(c.op)))
    return {"ValueError", "unsupported dtype/op"};
  RingCall call = ring_call(coll, c.user_count, static_cast<DType>(c.dtype), static_cast<ReduceOp>(c.op), world_,
                            c.plan != nullptr ? c.plan->root : 0);
  cuda::PlanParams plan_part{}, fallback_part{};
  if (c.plan != nullptr) {  // CudaComm::device_plan, the copy a plain one
    call.descriptor.algorithm = static_cast<int32_t>(c.plan->id);
    auto prepare = [&](const CompiledPlan& plan) {
      return cuda::prepare_plan(me.plan_records, me.plan_area.data(), me.plan_work.data(), plan, coll, c.rank, world_,
                                slot_bytes_, collective_info(coll).name,
                                [](cuda::DevicePlanOp* to, const std::vector<cuda::DevicePlanOp>& kept) {
                                  std::copy(kept.begin(), kept.end(), to);
                                });
    };
    plan_part = prepare(*c.plan);
    fallback_part = cuda::prepare_fallback(plan_part, call, *c.plan, prepare);
    if (c.plan->reads_in_place) {  // the kernels read the host's table itself (CudaComm copies it to the GPU)
      std::lock_guard<std::mutex> lock(me.symmetric_mutex);
      cuda::place_arguments(plan_part, *me.heap, me.table, me.table.entries(), call, world_,
                            reinterpret_cast<const void*>(c.input), reinterpret_cast<const void*>(c.output),
                            peers_in_process_);
    }
  } else if (collective_info(coll).rooted) {
    return {"ValueError", std::string(collective_info(coll).name) + ": runs by a plan only"};
  }
  const auto input = reinterpret_cast<const void*>(c.input);
  const auto output = reinterpret_cast<void*>(c.output);
  Device& device = *device_;
  auto copy = [&](void* dst, const void* src, size_t bytes) {
    device.launch(me.stream, [dst, src, bytes] { std::memmove(dst, src, bytes); });
  };
  ModelStreams streams{device, host_wait_seconds()};
  cuda::queue_collective(streams, user_stream, me.stream, me.events, join, [&] {
    run_call(call, world_, input, output, copy, [&] {
      const auto variant = static_cast<KernelVariant>(variant_);
      // Host atomics have no scopes (flags.h): the emulator cannot tell device from system scope.
      std::vector<const char*> peers;
      for (const auto& rank : ranks_) peers.push_back(rank->memory.get());
      const cuda::LaunchMemory memory{me.memory.get(), peers.data(), FlagScope::kSystem,
                                      me.state.data(), me.errors.data(), input, output};
      RingParams p = cuda::call_params(call, c.rank, world_, slot_bytes_, timeout_seconds_, check_calls_, variant, memory);
      p.plan = plan_part;
      p.fallback = fallback_part;
      auto queue = [&](const RingParams& q, int blocks, bool vectorise) {
        device.launch(me.stream, [this, &me, rank = c.rank, q, blocks, threads = threads_, vectorise] {
          // A kernel (or a graph's replay of one) still running when its rank closed: the
          // close protocol failed to wait for it, and on a GPU its memory may be gone.
          if (me.closed) note_violation("a kernel of rank " + std::to_string(rank) + " ran after it closed");
          if (q.call.algorithm != 0) launch_plan_kernel(q, blocks, threads, vectorise);
          else launch_ring_kernel(q, blocks, threads, vectorise);
        });
        ++launches_;
        blocks_launched_ += static_cast<uint64_t>(blocks);
      };
      if (c.plan != nullptr) cuda::for_each_plan_launch(p, variant, call.elem_size, max_blocks_, queue);
      else cuda::for_each_launch(p, variant, call.elem_size, max_blocks_, queue);
    });
  });
  return {};
}

// --- symmetric memory: CudaComm's steps, with a memfd for cudaMalloc and mmap for IPC ----

std::string EmulatedRing::make_symmetric_arena(int rank, size_t bytes) {
  Rank& me = *ranks_.at(static_cast<size_t>(rank));
  std::lock_guard<std::mutex> lock(me.symmetric_mutex);
  me.making = std::make_shared<SharedPart>(bytes);
  const ArenaHandle handle{me.making->fd(), rank, bytes};
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

void EmulatedRing::open_symmetric_arena(int rank, const std::vector<std::string>& handles) {
  Rank& me = *ranks_.at(static_cast<size_t>(rank));
  std::lock_guard<std::mutex> lock(me.symmetric_mutex);
  RINGCOLL_CHECK(me.making != nullptr, std::logic_error, "empty: no arena of rank ", rank, " is being made");
  RINGCOLL_CHECK(static_cast<int>(handles.size()) == world_, std::invalid_argument, "empty: expected ", world_,
                 " arena handles, got ", handles.size());
  std::vector<const char*> row(static_cast<size_t>(world_));
  std::vector<std::shared_ptr<PeerMapping>> mapped;
  for (int r = 0; r < world_; ++r) {
    ArenaHandle h;
    RINGCOLL_CHECK(handles[r].size() == sizeof(h), std::invalid_argument, "empty: rank ", r, "'s arena handle has ",
                   handles[r].size(), " bytes");
    std::memcpy(&h, handles[r].data(), sizeof(h));
    RINGCOLL_CHECK(h.rank == r && h.bytes == me.making->bytes(), std::invalid_argument, "empty: handle ", r,
                   " is rank ", h.rank, "'s arena of ", h.bytes, " bytes; expected rank ", r, "'s of ",
                   me.making->bytes());
    if (r == rank) {
      row[r] = me.making->base();
      continue;
    }
    mapped.push_back(std::make_shared<PeerMapping>(h.fd, h.bytes));
    row[r] = mapped.back()->base;
  }
  char* base = me.making->base();
  const size_t bytes = me.making->bytes();
  me.table.add_arena(*me.heap, row, std::move(me.making), base, bytes, "empty");
  for (auto& m : mapped) me.peer_parts.push_back(std::move(m));
}

std::shared_ptr<SymmetricBlock> EmulatedRing::take_symmetric(int rank, size_t bytes) {
  return take_block(ranks_.at(static_cast<size_t>(rank))->heap, bytes);
}

bool EmulatedRing::symmetric_has_room(int rank, size_t bytes) const {
  return ranks_.at(static_cast<size_t>(rank))->heap->has_room_for(bytes);
}

uint64_t EmulatedRing::fallbacks(int rank) const { return ranks_.at(static_cast<size_t>(rank))->state[cuda::kFallbacksWord]; }

bool EmulatedRing::is_symmetric(int rank, uintptr_t address, size_t bytes) const {
  return ranks_.at(static_cast<size_t>(rank))->heap->locate(reinterpret_cast<const void*>(address), bytes).has_value();
}

CallResult EmulatedRing::check_error(int rank) {
  Rank& me = *ranks_[rank];
  if (!me.broken_reason.empty()) return {};  // reported once, as CudaComm does
  const ErrorRecord* rec = cuda::first_error(me.errors.data(), cuda::kMaxBlocks);
  if (rec == nullptr) return {};
  me.broken_reason = cuda::error_message(*rec, world_, timeout_seconds_);
  return {error_type(cuda::error_cause(*rec)), me.broken_reason};
}

CallResult EmulatedRing::synchronize(int rank) {
  Rank& me = *ranks_[rank];
  if (!device_->synchronize_stream(me.stream, host_wait_seconds()) && me.broken_reason.empty()) {
    me.broken_reason = "the emulated device did not finish this rank's work within " +
                       std::to_string(host_wait_seconds()) + " s: its queues are stuck (a cycle in the stream order)";
    return {"RingcollTimeoutError", me.broken_reason};
  }
  return check_error(rank);
}

}  // namespace ringcoll::emulation
