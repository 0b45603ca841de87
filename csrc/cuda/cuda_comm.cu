// cuda_comm.cu: the CUDA transport's host side. The bootstrap (peers reached through CUDA IPC
// or, in one process, directly), the launch of the ring kernels (ring_kernels.cu) on the
// communicator's stream, error reporting from the host-mapped records a kernel writes when a
// wait outlasts the timeout, and the collective close.
#include "cuda_comm.h"

#include <cuda_runtime.h>

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <sstream>
#include <stdexcept>

#include "close_protocol.h"
#include "ring_kernels.h"
#include "stream_order.h"
#include "ringcoll/check.h"
#include "ringcoll/reduce.h"
#include "ringcoll/ring.h"

namespace ringcoll::cuda {

namespace {
struct HandleMessage {
  cudaIpcMemHandle_t handle;  // for peers in other processes
  uint64_t address;           // the allocation's device address, for peers in this process
  uint64_t process;           // process_token() of the process that made it
  int32_t ipc_error;          // cudaIpcGetMemHandle's result: cudaSuccess, or why `handle` is unusable
  int32_t rank;
  int32_t sm_count;           // its GPU's SMs (max_blocks_for)
  int32_t flag_scope_setting; // its RINGCOLL_CUDA_FLAG_SCOPE (FlagScopeSetting): the ranks must agree
  cudaUUID_t gpu;             // which physical GPU (ordinals differ between processes' CUDA_VISIBLE_DEVICES)
};

// Which process a handle comes from. A process cannot open its own IPC handles
// (cudaIpcOpenMemHandle refuses them), and needs not: its threads share one address space,
// so a peer of the same process is reached through the address itself. A pid alone would
// not do (two containers' processes can share one); a random draw alone would survive a
// fork(), so the token is drawn again when the pid changes.
uint64_t process_token() {
  static std::mutex mutex;
  static pid_t drawn_for = 0;
  static uint64_t token = 0;
  std::lock_guard<std::mutex> lock(mutex);
  if (drawn_for != getpid()) {
    drawn_for = getpid();
    std::random_device entropy;
    token = (static_cast<uint64_t>(entropy()) << 32 | entropy()) ^ static_cast<uint64_t>(drawn_for);
  }
  return token;
}

cudaUUID_t gpu_uuid(int device) {
  cudaDeviceProp prop;
  RINGCOLL_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return prop.uuid;
}

// The communicators' streams: lent, never destroyed. torch's caching allocator records an
// event on our stream when it frees a tensor recorded there (record_stream), which can come
// after close(); a destroyed stream would be a dead handle inside that deleter. And no two
// live communicators of a process may share a stream: ranks that are threads of one process
// would queue behind each other's spinning kernels. So a communicator borrows a stream no
// live one holds, and gives it back at close; the process keeps as many as were ever
// alive at once.
class StreamLender {
 public:
  static StreamLender& instance() {
    static StreamLender* lender = new StreamLender;  // never destroyed: streams outlive exit handlers
    return *lender;
  }
  void* take(int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < idle_.size(); ++i) {
      if (idle_[i].first == device) {
        void* stream = idle_[i].second;
        idle_.erase(idle_.begin() + static_cast<std::ptrdiff_t>(i));
        return stream;
      }
    }
    cudaStream_t stream;  // non-blocking: never ordered behind the legacy default stream
    RINGCOLL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return stream;
  }
  void give_back(int device, void* stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    idle_.emplace_back(device, stream);
  }

 private:
  std::mutex mutex_;
  std::vector<std::pair<int, void*>> idle_;
};

// stream_order.h's adapter over the CUDA runtime.
struct CudaStreams {
  using Stream = cudaStream_t;
  using Event = cudaEvent_t;
  void record(Event e, Stream s) { RINGCOLL_CUDA_CHECK(cudaEventRecord(e, s)); }
  // Inside a capture, a plain record is only a point in the graph; an external one is a node
  // that records the event for the host on every replay.
  void record_for_replays(Event e, Stream s) {
    RINGCOLL_CUDA_CHECK(cudaEventRecordWithFlags(e, s, cudaEventRecordExternal));
  }
  void wait(Stream s, Event e) { RINGCOLL_CUDA_CHECK(cudaStreamWaitEvent(s, e, 0)); }
  bool capturing(Stream s) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    RINGCOLL_CUDA_CHECK(cudaStreamIsCapturing(s, &status));
    return status == cudaStreamCaptureStatusActive;
  }
  // For closing, which must not throw: a failure is reported, and cleared.
  bool synchronize_stream(Stream s) { return cleared(cudaStreamSynchronize(s)); }
  bool synchronize_event(Event e) { return cleared(cudaEventSynchronize(e)); }
  static bool cleared(cudaError_t err) {
    if (err != cudaSuccess) (void)cudaGetLastError();
    return err == cudaSuccess;
  }
};

// The calling thread's current device: the communicator's for a scope, then the caller's
// again (as NCCL and torch's device guards do). A collective on GPU 1 must not leave a thread
// that was working on GPU 0 there: its next torch.empty(device="cuda") would land on GPU 1.
// `checked`: throw on failure; closing, which must not throw, clears the error instead.
class OnDevice {
 public:
  OnDevice(int device, bool checked = true) {
    if (!set(cudaGetDevice(&caller_), checked)) return;
    if (caller_ != device) restore_ = set(cudaSetDevice(device), checked);
  }
  ~OnDevice() {
    if (restore_) CudaStreams::cleared(cudaSetDevice(caller_));
  }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

 private:
  static bool set(cudaError_t err, bool checked) {
    if (checked) RINGCOLL_CUDA_CHECK(err);
    return CudaStreams::cleared(err);
  }
  int caller_ = 0;
  bool restore_ = false;
};

CallEvents<cudaEvent_t> call_events(void* ready, void* done, void* replayed) {
  return {static_cast<cudaEvent_t>(ready), static_cast<cudaEvent_t>(done), static_cast<cudaEvent_t>(replayed)};
}

bool same_gpu(const cudaUUID_t& a, const cudaUUID_t& b) { return std::memcmp(&a, &b, sizeof(a)) == 0; }

// This process's ordinal of the GPU `gpu`, or -1 where this process does not see it.
int local_ordinal(const cudaUUID_t& gpu) {
  int count = 0;
  RINGCOLL_CUDA_CHECK(cudaGetDeviceCount(&count));
  for (int d = 0; d < count; ++d) {
    if (same_gpu(gpu_uuid(d), gpu)) return d;
  }
  return -1;
}
}  // namespace

CudaComm::CudaComm(int rank, int world, int device, size_t buffer_bytes, double timeout_seconds, bool check_calls,
                   int variant)
    : rank_(rank), world_(world), device_(device), buffer_bytes_(buffer_bytes),
      slot_bytes_(slot_bytes_for(buffer_bytes, world, kSlotAlignment)), timeout_seconds_(timeout_seconds), check_calls_(check_calls),
      variant_(static_cast<KernelVariant>(variant)),
      peers_(static_cast<size_t>(world), nullptr), peer_by_ipc_(static_cast<size_t>(world), false) {
  RINGCOLL_CHECK(world >= 1 && rank >= 0 && rank < world, std::invalid_argument, "Communicator: rank ", rank,
                 " is outside world size ", world);
  RINGCOLL_CHECK(world <= kMaxWorld, std::invalid_argument, "Communicator: the CUDA transport supports at most ",
                 kMaxWorld, " ranks, got ", world);
  check_buffer_bytes("Communicator", buffer_bytes, world, kSlotAlignment);
  RINGCOLL_CHECK(variant == 0 || variant == 1, std::invalid_argument, "Communicator: unknown CUDA kernel variant ",
                 variant);
  // Read once, here: every launch of this communicator uses the scope map_peers settles.
  flag_scope_setting_ = parse_flag_scope_setting(std::getenv(kFlagScopeVariable));
  try {
    const OnDevice on_device(device_);
    RINGCOLL_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_));
    // Load every kernel now: under lazy loading (CUDA's default) the first launch of each
    // would load it then, which can wait for the whole context, a peer's spinning ring included.
    preload_ring_kernels();
    const size_t total = kFlagAreaBytes + static_cast<size_t>(kBanks) * world_ * slot_bytes_;
    RINGCOLL_CUDA_CHECK(cudaMalloc(&base_, total));
    RINGCOLL_CUDA_CHECK(cudaMalloc(&state_, sizeof(uint64_t) * kStateWords));
    RINGCOLL_CUDA_CHECK(cudaMalloc(&plan_records_device_, sizeof(DevicePlanOp) * kPlanRecordCapacity));
    RINGCOLL_CUDA_CHECK(cudaMalloc(&plan_work_, plan_work_bytes(slot_bytes_, world_)));
    RINGCOLL_CUDA_CHECK(cudaMalloc(&symmetric_table_device_, sizeof(const char*) * kSymmetricTableEntries));
    RINGCOLL_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&errors_host_), sizeof(ErrorRecord) * kMaxBlocks,
                                      cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(errors_host_, 0, sizeof(ErrorRecord) * kMaxBlocks);
    RINGCOLL_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&errors_device_), errors_host_, 0));
    stream_ = StreamLender::instance().take(device_);
    for (void** event : {&done_, &ready_, &replayed_}) {
      cudaEvent_t made;
      RINGCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&made, cudaEventDisableTiming));
      *event = made;
    }
    // Flags start at 0 and only grow; peers map this allocation only after the handles went
    // round (after this constructor), so the zeroing is done before anyone reads it. On our
    // stream, and waiting for it alone: a cudaDeviceSynchronize would also wait for every
    // other kernel of the process, a peer thread's spinning ring among them.
    auto own = static_cast<cudaStream_t>(stream_);
    RINGCOLL_CUDA_CHECK(cudaMemsetAsync(base_, 0, kFlagAreaBytes, own));
    RINGCOLL_CUDA_CHECK(cudaMemsetAsync(state_, 0, sizeof(uint64_t) * kStateWords, own));
    RINGCOLL_CUDA_CHECK(cudaMemsetAsync(symmetric_table_device_, 0, sizeof(const char*) * kSymmetricTableEntries, own));
    const uint64_t hello = kHelloMagic ^ static_cast<uint64_t>(rank_);
    RINGCOLL_CUDA_CHECK(cudaMemcpyAsync(base_ + kHelloOffset, &hello, sizeof(hello), cudaMemcpyHostToDevice, own));
    RINGCOLL_CUDA_CHECK(cudaStreamSynchronize(own));  // `hello` is a local: copied before it goes
  } catch (...) {
    close();
    throw;
  }
  peers_[rank_] = base_;
}

CudaComm::~CudaComm() {
  try {
    close(/*wait_for_peers=*/false);  // a destructor must not stall (Python holds the GIL here)
  } catch (...) {
  }
}

std::string CudaComm::handle_bytes() const {
  ensure_usable("Communicator");
  HandleMessage msg{};
  // A process that cannot export (no IPC in some sandboxes) still serves peers of its own
  // process; one in another process then says why it cannot map us (map_peers).
  msg.ipc_error = cudaIpcGetMemHandle(&msg.handle, base_);
  if (msg.ipc_error != cudaSuccess) (void)cudaGetLastError();
  msg.address = reinterpret_cast<uint64_t>(base_);
  msg.process = process_token();
  msg.rank = rank_;
  msg.sm_count = sm_count_;
  msg.flag_scope_setting = static_cast<int32_t>(flag_scope_setting_);
  msg.gpu = gpu_uuid(device_);
  return std::string(reinterpret_cast<const char*>(&msg), sizeof(msg));
}

void CudaComm::open_peers(const std::vector<std::string>& handles) {
  ensure_usable("Communicator");
  RINGCOLL_CHECK(!peers_open_, Error, "Communicator: peers are already open");
  RINGCOLL_CHECK(static_cast<int>(handles.size()) == world_, std::invalid_argument,
                 "Communicator: expected one IPC handle per rank, got ", handles.size());
  const OnDevice on_device(device_);
  peers_open_ = true;  // from here close() unmaps whatever was opened
  try {
    map_peers(handles);
  } catch (const std::exception& e) {
    broken_reason_ = std::string("bootstrap failed: ") + e.what();  // close() then waits for no one
    throw;
  }
}

void CudaComm::map_peers(const std::vector<std::string>& handles) {
  const cudaUUID_t mine = gpu_uuid(device_);
  std::vector<bool> on_my_gpu(static_cast<size_t>(world_), true);
  std::vector<cudaUUID_t> gpus(static_cast<size_t>(world_), mine);
  int least_sms = sm_count_;
  std::vector<FlagScopeSetting> scope_settings(static_cast<size_t>(world_), flag_scope_setting_);
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    RINGCOLL_CHECK(handles[r].size() == sizeof(HandleMessage), std::invalid_argument,
                   "Communicator: rank ", r, "'s IPC handle has ", handles[r].size(), " bytes, expected ",
                   sizeof(HandleMessage));
    HandleMessage msg;
    std::memcpy(&msg, handles[r].data(), sizeof(msg));
    RINGCOLL_CHECK(msg.rank == r, std::invalid_argument, "Communicator: handle ", r, " came from rank ", msg.rank);
    if (msg.sm_count < least_sms) least_sms = msg.sm_count;
    scope_settings[r] = static_cast<FlagScopeSetting>(msg.flag_scope_setting);
    gpus[r] = msg.gpu;
    on_my_gpu[r] = same_gpu(msg.gpu, mine);
    // Peer access between two GPUs this process sees must be possible, and is enabled here
    // (a direct pointer needs it; IPC would enable it lazily). A GPU this process does not
    // see (CUDA_VISIBLE_DEVICES) can only be reached through IPC, checked by the hello below.
    const int peer_device = on_my_gpu[r] ? device_ : local_ordinal(msg.gpu);
    if (peer_device >= 0 && peer_device != device_) {
      int can = 0;
      RINGCOLL_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device_, peer_device));
      RINGCOLL_CHECK(can, Error, "Communicator: rank ", rank_, " on GPU ", device_, " cannot access GPU ",
                     peer_device, " of rank ", r, " (no peer access between them)");
      const cudaError_t err = cudaDeviceEnablePeerAccess(peer_device, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) (void)cudaGetLastError();
      else RINGCOLL_CUDA_CHECK(err);
    }
    if (msg.process == process_token()) {
      peers_[r] = reinterpret_cast<char*>(msg.address);  // a thread of this process: same address space
    } else {
      RINGCOLL_CHECK(msg.ipc_error == cudaSuccess, Error, "Communicator: rank ", r, " could not export its GPU memory "
                     "through CUDA IPC (", cudaGetErrorString(static_cast<cudaError_t>(msg.ipc_error)),
                     "), so rank ", rank_, " in another process cannot map it");
      void* mapped = nullptr;
      RINGCOLL_CUDA_CHECK(cudaIpcOpenMemHandle(&mapped, msg.handle, cudaIpcMemLazyEnablePeerAccess));
      peers_[r] = static_cast<char*>(mapped);
      peer_by_ipc_[r] = true;
    }
    // A mapping that opens but does not reach the peer's memory (seen in sandboxes and with
    // broken peer access) would otherwise surface as a timeout inside the first kernel.
    uint64_t hello = 0;
    RINGCOLL_CHECK(copy_flag(&hello, peers_[r] + kHelloOffset, cudaMemcpyDeviceToHost), Error, "Communicator: rank ",
                   rank_, " cannot read rank ", r, "'s GPU memory (", peer_by_ipc_[r] ? "CUDA IPC" : "same process",
                   ")");
    RINGCOLL_CHECK(hello == (kHelloMagic ^ static_cast<uint64_t>(r)), Error, "Communicator: rank ", rank_,
                   " mapped rank ", r, "'s GPU memory (", peer_by_ipc_[r] ? "through CUDA IPC" : "in this process",
                   ") but reads ", hello, " instead of its hello word ", kHelloMagic ^ static_cast<uint64_t>(r),
                   "; the ranks cannot share GPU memory here");
  }
  // Every rank sees every handle, so all agree on the scope, or all raise here.
  check_flag_scope_settings(scope_settings);
  flag_scope_ = flag_scope_for(on_my_gpu, flag_scope_setting_);
  // Every rank sees every handle, so all compute the same grid bound (block b talks to block b).
  int ranks_per_gpu = 1;
  for (const cudaUUID_t& g : gpus) {
    int here = 0;
    for (const cudaUUID_t& h : gpus) here += same_gpu(g, h);
    if (here > ranks_per_gpu) ranks_per_gpu = here;
  }
  max_blocks_ = max_blocks_for(least_sms, ranks_per_gpu);
  RINGCOLL_CHECK(max_blocks_ >= 1 && max_blocks_ <= kMaxBlocks, Error, "Communicator: a grid of ", max_blocks_,
                 " blocks does not fit the flag area (kMaxBlocks = ", kMaxBlocks, ")");
}

int CudaComm::ipc_peers() const {
  int n = 0;
  for (bool ipc : peer_by_ipc_) n += ipc;
  return n;
}

int CudaComm::in_process_peers() const { return peers_open_ ? world_ - 1 - ipc_peers() : 0; }

void CudaComm::ensure_usable(const char* op) const {
  RINGCOLL_CHECK(!closed_, Error, op, ": communicator is closed");
  RINGCOLL_CHECK(broken_reason_.empty(), Error, op, ": communicator is broken by an earlier error (",
                 broken_reason_, "); create a new one");
}

void CudaComm::check_error() {
  if (errors_host_ == nullptr || !broken_reason_.empty()) return;
  const ErrorRecord* rec = first_error(errors_host_, kMaxBlocks);
  if (rec == nullptr) return;
  broken_reason_ = "cuda collective: " + error_message(*rec, world_, timeout_seconds_);
  switch (error_cause(*rec)) {
    case AbortCause::kTimedOut: throw TimeoutError(broken_reason_);
    case AbortCause::kMismatch:
    case AbortCause::kNotSymmetric: throw MismatchError(broken_reason_);
    default: throw PeerError(broken_reason_);
  }
}

bool CudaComm::stream_capturing(uintptr_t stream) const {
  const OnDevice on_device(device_);  // the legacy stream's handle means the current device's
  return CudaStreams{}.capturing(reinterpret_cast<cudaStream_t>(stream));
}

void CudaComm::synchronize() {
  if (closed_) return;
  const OnDevice on_device(device_);
  RINGCOLL_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
  check_error();
}

PlanParams CudaComm::device_plan(const char* op, Collective coll, const CompiledPlan& plan, uintptr_t user_stream) {
  auto copy_new = [&](DevicePlanOp* to, const std::vector<DevicePlanOp>& kept) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    RINGCOLL_CUDA_CHECK(cudaStreamIsCapturing(reinterpret_cast<cudaStream_t>(user_stream), &capturing));
    RINGCOLL_CHECK(capturing == cudaStreamCaptureStatusNone, Error, op, ": this plan has not run on this "
                   "communicator yet, and its records are copied to the GPU on its first run, which a CUDA graph "
                   "capture cannot contain: run it once before capturing");
    // On our stream, before the kernel that reads them, from the copy plan_records_ keeps
    RINGCOLL_CUDA_CHECK(cudaMemcpyAsync(to, kept.data(), kept.size() * sizeof(DevicePlanOp), cudaMemcpyHostToDevice,
                                        static_cast<cudaStream_t>(stream_)));
  };
  return prepare_plan(plan_records_, plan_records_device_, plan_work_, plan, coll, rank_, world_, slot_bytes_, op,
                      copy_new);
}

// --- symmetric memory (cuda_comm.h) --------------------------------------------------------

namespace {
struct ArenaHandle {
  cudaIpcMemHandle_t handle;  // for peers in other processes
  uint64_t address;           // for peers in this process
  uint64_t process;           // process_token() of the process that made it
  uint64_t bytes;
  int32_t ipc_error;          // cudaIpcGetMemHandle's result
  int32_t rank;
};
}  // namespace

std::string CudaComm::make_symmetric_arena(size_t bytes) {
  ensure_usable("empty");
  const OnDevice on_device(device_);
  void* part = nullptr;
  RINGCOLL_CUDA_CHECK(cudaMalloc(&part, bytes));
  // Freed with the last block, unless a peer may still map it (parts_may_be_freed_: set by a
  // close that saw every peer leave); cudaFree is then the caller's, after the collectives.
  const int device = device_;
  making_ = std::shared_ptr<void>(part, [device, may = parts_may_be_freed_](void* p) {
    if (!*may) return;
    const OnDevice on_device(device, /*checked=*/false);
    cudaFree(p);
    cudaGetLastError();
  });
  making_bytes_ = bytes;
  ArenaHandle msg{};
  msg.ipc_error = cudaIpcGetMemHandle(&msg.handle, part);
  if (msg.ipc_error != cudaSuccess) (void)cudaGetLastError();
  msg.address = reinterpret_cast<uint64_t>(part);
  msg.process = process_token();
  msg.bytes = bytes;
  msg.rank = rank_;
  return std::string(reinterpret_cast<const char*>(&msg), sizeof(msg));
}

void CudaComm::open_symmetric_arena(const std::vector<std::string>& handles) {
  ensure_usable("empty");
  RINGCOLL_CHECK(making_ != nullptr, Error, "empty: no arena is being made (make_symmetric_arena)");
  RINGCOLL_CHECK(static_cast<int>(handles.size()) == world_, std::invalid_argument, "empty: expected ", world_,
                 " arena handles, got ", handles.size());
  const OnDevice on_device(device_);
  std::vector<const char*> row(static_cast<size_t>(world_));
  for (int r = 0; r < world_; ++r) {
    ArenaHandle msg;
    RINGCOLL_CHECK(handles[r].size() == sizeof(msg), std::invalid_argument, "empty: rank ", r, "'s arena handle has ",
                   handles[r].size(), " bytes, expected ", sizeof(msg));
    std::memcpy(&msg, handles[r].data(), sizeof(msg));
    RINGCOLL_CHECK(msg.rank == r && msg.bytes == making_bytes_, std::invalid_argument, "empty: handle ", r,
                   " is rank ", msg.rank, "'s arena part of ", msg.bytes, " bytes; expected rank ", r, "'s of ",
                   making_bytes_);
    if (r == rank_ || msg.process == process_token()) {
      row[r] = reinterpret_cast<const char*>(msg.address);  // ours, or a thread of this process
      continue;
    }
    RINGCOLL_CHECK(msg.ipc_error == cudaSuccess, Error, "empty: rank ", r, " could not export its arena part through "
                   "CUDA IPC (", cudaGetErrorString(static_cast<cudaError_t>(msg.ipc_error)), ")");
    void* mapped = nullptr;
    RINGCOLL_CUDA_CHECK(cudaIpcOpenMemHandle(&mapped, msg.handle, cudaIpcMemLazyEnablePeerAccess));
    symmetric_ipc_parts_.push_back(mapped);
    row[r] = static_cast<const char*>(mapped);
  }
  char* base = static_cast<char*>(making_.get());
  const size_t arena = symmetric_table_.add_arena(*heap_, row, std::move(making_), base, making_bytes_, "empty");
  making_bytes_ = 0;
  // The new row, on our stream: every later kernel of ours reads it; none running reads it
  // (their inputs were allocated before). From the table itself, which never moves.
  RINGCOLL_CUDA_CHECK(cudaMemcpyAsync(symmetric_table_device_ + arena * kMaxWorld, symmetric_table_.row(arena),
                                      sizeof(const char*) * static_cast<size_t>(world_), cudaMemcpyHostToDevice,
                                      static_cast<cudaStream_t>(stream_)));
}

std::shared_ptr<SymmetricBlock> CudaComm::take_symmetric(size_t bytes) {
  return take_block(heap_, bytes);
}

void CudaComm::run_plan(const CompiledPlan& plan, int collective, uintptr_t input, uintptr_t output,
                        int64_t user_count, int dtype, int op, uintptr_t stream, bool join) {
  const auto coll = static_cast<Collective>(collective);
  launch(collective_info(coll).name, coll, input, output, user_count, dtype, op, stream, join, &plan);
}

void CudaComm::launch(const char* op, Collective coll, uintptr_t input, uintptr_t output, int64_t user_count,
                      int dtype, int reduce_op, uintptr_t stream, bool join, const CompiledPlan* plan) {
  check_error();
  ensure_usable(op);
  RINGCOLL_CHECK(peers_open_ || world_ == 1, Error, op, ": peers are not mapped yet (open_peers)");
  RINGCOLL_CHECK(is_supported(coll, static_cast<DType>(dtype), static_cast<ReduceOp>(reduce_op)), std::invalid_argument,
                 op, ": unsupported dtype/op ", dtype, "/", reduce_op);
  const OnDevice on_device(device_);
  auto user = reinterpret_cast<cudaStream_t>(stream);
  const FlagScope scope = flag_scope_;
  auto own = static_cast<cudaStream_t>(stream_);
  RingCall call = ring_call(coll, user_count, static_cast<DType>(dtype), static_cast<ReduceOp>(reduce_op), world_,
                            plan != nullptr ? plan->root : 0);
  PlanParams plan_part{}, fallback_part{};
  if (plan != nullptr) {
    call.descriptor.algorithm = static_cast<int32_t>(plan->id);
    plan_part = device_plan(op, coll, *plan, stream);
    fallback_part = prepare_fallback(plan_part, call, *plan,
                                     [&](const CompiledPlan& fallback) { return device_plan(op, coll, fallback, stream); });
    // A peer in this process reaches a plain device pointer; one in another, only symmetric memory.
    if (plan->reads_in_place)
      place_arguments(plan_part, *heap_, symmetric_table_, symmetric_table_device_, call, world_,
                      reinterpret_cast<const void*>(input), reinterpret_cast<const void*>(output), ipc_peers() == 0);
  } else {
    RINGCOLL_CHECK(!collective_info(coll).rooted, std::invalid_argument, op, ": runs by a plan only");
  }
  auto copy = [&](void* dst, const void* src, size_t bytes) {
    RINGCOLL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, own));
  };
  CudaStreams streams;
  queue_collective(streams, user, own, call_events(ready_, done_, replayed_), join, [&] {
    run_call(call, world_, reinterpret_cast<const void*>(input), reinterpret_cast<void*>(output), copy, [&] {
      const LaunchMemory memory{base_, peers_.data(), scope, state_, errors_device_,
                                reinterpret_cast<const void*>(input), reinterpret_cast<void*>(output)};
      RingParams p = call_params(call, rank_, world_, slot_bytes_, timeout_seconds_, check_calls_, variant_, memory);
      p.plan = plan_part;
      p.fallback = fallback_part;
      try {
        if (plan != nullptr)
          for_each_plan_launch(p, variant_, call.elem_size, max_blocks_,
                               [&](const RingParams& q, int blocks, bool vectorise) { launch_plan(q, blocks, vectorise, own); });
        else
          for_each_launch(p, variant_, call.elem_size, max_blocks_, [&](const RingParams& q, int blocks, bool vectorise) {
            launch_ring(q, blocks, vectorise, own);
          });
      } catch (const std::exception& e) {
        // Some of the call's launches may be queued: this rank's numbering no longer matches.
        broken_reason_ = std::string(op) + ": a kernel launch failed: " + e.what();
        throw;
      }
    });
  });
}

void CudaComm::all_reduce(uintptr_t input, uintptr_t output, int64_t user_count, int dtype, int op,
                          uintptr_t stream, bool join) {
  launch("all_reduce", Collective::kAllReduce, input, output, user_count, dtype, op, stream, join);
}

void CudaComm::reduce_scatter(uintptr_t input, uintptr_t output, int64_t user_count, int dtype, int op,
                              uintptr_t stream, bool join) {
  launch("reduce_scatter", Collective::kReduceScatter, input, output, user_count, dtype, op, stream, join);
}

void CudaComm::all_gather(uintptr_t input, uintptr_t output, int64_t user_count, int dtype, uintptr_t stream,
                          bool join) {
  launch("all_gather", Collective::kAllGather, input, output, user_count, dtype, 0, stream, join);
}

// Closing. CUDA calls it undefined to cudaFree an allocation another process still maps
// (cudaIpcOpenMemHandle's documentation), and a neighbour that is one step behind may still
// be reading our last slot when our own kernels are done. So closing is collective:
// leave_peers()
//   1. waits for every launch that uses our memory (stream_order.h's wait_for_own_work: our
//      stream's, and any CUDA-graph replay of one, which records our `replayed` event). A
//      kernel error the host has not checked yet makes us broken;
//   2. writes our `finished` word into every peer's allocation (whether we will free after
//      the rendezvous, or keep our allocation: close_protocol.h), and sets our `aborted` to
//      "closed" unless a kernel already gave up (a neighbour still waiting for us then
//      stops at once, naming us);
//   3. waits, bounded by the timeout, until every peer's word has arrived in ours: from then
//      on no peer reads or writes our memory (close_protocol.h; the emulator runs the same
//      loop in CI). Words are pushed, not pulled, so no rank ever reads the memory of a
//      peer that may already have freed it. A rank that gives up waiting tells every peer
//      again that it keeps its allocation, so a late peer skips the rendezvous below;
//   4. unmaps the peers.
// Then, where every rank will free (each saw only kWillFree words, so all of them go), the
// caller's host rendezvous (ringcoll/transports/cuda.py: the group's barrier, bounded by
// the communicator's timeout) makes sure every peer has unmapped us too, which no word in
// GPU memory can say (it would have to be read through the very mapping just closed), and
// free_memory() frees our allocation.
// Our allocation is kept, not freed (the driver releases it when the process exits, and
// kept_on_close() says why) when a peer does not close within the timeout (it died, or
// never closes), when the communicator is broken (a peer's kernel may still be stopping; a
// dead peer would make us wait the whole timeout), when the rendezvous fails
// (keep_memory), or without `wait_for_peers` (a finalizer, which must not stall one rank
// at an arbitrary point). Errors are ignored throughout: closing must not throw from a
// destructor, and a broken communicator is closed all the same.
void CudaComm::leave_peers(bool wait_for_peers) {
  if (closed_) return;
  closed_ = true;
  const OnDevice on_device(device_, /*checked=*/false);
  if (stream_ != nullptr && done_ != nullptr && replayed_ != nullptr) {
    CudaStreams streams;
    wait_for_own_work(streams, static_cast<cudaStream_t>(stream_), call_events(ready_, done_, replayed_));
  }
  if (broken_reason_.empty() && errors_host_ != nullptr) {
    const ErrorRecord* rec = first_error(errors_host_, kMaxBlocks);
    if (rec != nullptr) broken_reason_ = "cuda collective: " + error_message(*rec, world_, timeout_seconds_);
  }
  announce_closed(/*will_free=*/broken_reason_.empty() && wait_for_peers);
  const bool shared = peers_open_ && world_ > 1;  // peers map our allocation
  if (shared && !broken_reason_.empty()) {
    keep_memory("the communicator is broken (" + broken_reason_ + ")");
  } else if (shared && !wait_for_peers) {
    keep_memory(kKeptByFinalizer);
  } else if (shared) {
    keep_memory(wait_for_peers_or_keep(
        rank_, world_, timeout_seconds_, [&](uint64_t word) { tell_peers_finished(word); },
        [&](int r, uint64_t* word) { return copy_flag(word, base_ + finished_word_offset(r), cudaMemcpyDeviceToHost); }));
  }
  for (void* part : symmetric_ipc_parts_) cudaIpcCloseMemHandle(part);
  symmetric_ipc_parts_.clear();
  for (int r = 0; r < world_; ++r) {
    if (peer_by_ipc_[r]) cudaIpcCloseMemHandle(peers_[r]);
    peers_[r] = nullptr;
    peer_by_ipc_[r] = false;
  }
  cudaGetLastError();  // leave no sticky non-fatal error behind for the caller's next call
}

void CudaComm::free_memory() {
  leave_peers(/*wait_for_peers=*/false);  // no-op after leave_peers; else keeps the allocation
  const OnDevice on_device(device_, /*checked=*/false);
  for (void* event : {done_, ready_, replayed_})
    if (event != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event));
  if (errors_host_ != nullptr) cudaFreeHost(errors_host_);
  if (state_ != nullptr) cudaFree(state_);
  if (plan_records_device_ != nullptr) cudaFree(plan_records_device_);
  if (plan_work_ != nullptr) cudaFree(plan_work_);
  if (base_ != nullptr && kept_on_close_.empty()) cudaFree(base_);
  if (symmetric_table_device_ != nullptr) cudaFree(symmetric_table_device_);
  symmetric_table_device_ = nullptr;
  // Our arena parts: freed with their last block from now on, if every peer has unmapped them.
  *parts_may_be_freed_ = kept_on_close_.empty() && closed_;
  if (stream_ != nullptr && !stream_retired_)
    StreamLender::instance().give_back(device_, stream_);  // idle: leave_peers waited for it
  done_ = ready_ = replayed_ = stream_ = nullptr;
  errors_host_ = errors_device_ = nullptr;
  state_ = nullptr;
  plan_records_device_ = nullptr;
  plan_work_ = nullptr;
  base_ = nullptr;
  cudaGetLastError();
}

void CudaComm::close(bool wait_for_peers) {
  leave_peers(wait_for_peers);
  free_memory();
}

// Step 2 of close(): our kernels are finished, so everything they published is visible
// before these words; device_ring.h's waits rely on that.
void CudaComm::announce_closed(bool will_free) {
  if (base_ == nullptr || !peers_open_ || world_ == 1) return;
  tell_peers_finished(will_free ? kWillFree : kKeeps);
  uint64_t* flag = reinterpret_cast<uint64_t*>(base_ + kAbortedOffset);
  uint64_t cause = 0;
  if (!copy_flag(&cause, flag, cudaMemcpyDeviceToHost) || cause != 0) return;
  cause = static_cast<uint64_t>(AbortCause::kClosed);
  copy_flag(flag, &cause, cudaMemcpyHostToDevice);
}

// Our `finished` word (close_protocol.h), into every peer's allocation.
void CudaComm::tell_peers_finished(uint64_t word) {
  for (int r = 0; r < world_; ++r) {
    if (r != rank_ && peers_[r] != nullptr) copy_flag(peers_[r] + finished_word_offset(rank_), &word, cudaMemcpyHostToDevice);
  }
}

// One flag word between host and device, on our own non-blocking stream: a plain cudaMemcpy
// would go on the legacy default stream and queue behind other threads' work there.
bool CudaComm::copy_flag(void* dst, const void* src, int kind) {
  auto own = static_cast<cudaStream_t>(stream_);
  const bool ok = own != nullptr &&
                  cudaMemcpyAsync(dst, src, sizeof(uint64_t), static_cast<cudaMemcpyKind>(kind), own) == cudaSuccess &&
                  cudaStreamSynchronize(own) == cudaSuccess;
  if (!ok) cudaGetLastError();
  return ok;
}

}  // namespace ringcoll::cuda
