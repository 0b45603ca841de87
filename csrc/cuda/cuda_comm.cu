// cuda_comm.cu: the CUDA transport's host side. IPC bootstrap, the launch of the ring
// kernels (ring_kernels.cu) on the communicator's own stream, and error reporting from the
// host-mapped records a kernel writes when a wait outlasts the timeout.
#include "cuda_comm.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "close_protocol.h"
#include "ring_kernels.h"
#include "ringcoll/check.h"
#include "ringcoll/reduce.h"
#include "ringcoll/ring.h"

namespace ringcoll::cuda {

namespace {
struct HandleMessage {
  cudaIpcMemHandle_t handle;
  int32_t device;
  int32_t rank;
  int32_t sm_count;    // its GPU's SMs (max_blocks_for)
  cudaUUID_t gpu;      // which physical GPU (ordinals differ between processes' CUDA_VISIBLE_DEVICES)
};

cudaUUID_t gpu_uuid(int device) {
  cudaDeviceProp prop;
  RINGCOLL_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return prop.uuid;
}
}  // namespace

CudaComm::CudaComm(int rank, int world, int device, size_t buffer_bytes, double timeout_seconds, bool check_calls,
                   int variant)
    : rank_(rank), world_(world), device_(device), buffer_bytes_(buffer_bytes),
      slot_bytes_(slot_bytes_for(buffer_bytes, world, kSlotAlignment)), timeout_seconds_(timeout_seconds), check_calls_(check_calls),
      variant_(static_cast<KernelVariant>(variant)), peers_(static_cast<size_t>(world), nullptr) {
  RINGCOLL_CHECK(world >= 1 && rank >= 0 && rank < world, std::invalid_argument, "Communicator: rank ", rank,
                 " is outside world size ", world);
  RINGCOLL_CHECK(world <= kMaxWorld, std::invalid_argument, "Communicator: the CUDA transport supports at most ",
                 kMaxWorld, " ranks, got ", world);
  check_buffer_bytes("Communicator", buffer_bytes, world, kSlotAlignment);
  RINGCOLL_CHECK(variant == 0 || variant == 1, std::invalid_argument, "Communicator: unknown CUDA kernel variant ",
                 variant);
  try {
    RINGCOLL_CUDA_CHECK(cudaSetDevice(device_));
    RINGCOLL_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_));
    const size_t total = kFlagAreaBytes + static_cast<size_t>(kBanks) * world_ * slot_bytes_;
    RINGCOLL_CUDA_CHECK(cudaMalloc(&base_, total));
    // Flags start at 0 and only grow; peers map this allocation only after the handles
    // went round (after this constructor), so the zeroing is done before anyone reads it.
    RINGCOLL_CUDA_CHECK(cudaMemset(base_, 0, kFlagAreaBytes));
    RINGCOLL_CUDA_CHECK(cudaMalloc(&state_, sizeof(uint64_t) * kStateWords));
    RINGCOLL_CUDA_CHECK(cudaMemset(state_, 0, sizeof(uint64_t) * kStateWords));
    RINGCOLL_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&errors_host_), sizeof(ErrorRecord) * kMaxBlocks,
                                      cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(errors_host_, 0, sizeof(ErrorRecord) * kMaxBlocks);
    RINGCOLL_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&errors_device_), errors_host_, 0));
    cudaStream_t stream;
    RINGCOLL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    stream_ = stream;
    cudaEvent_t done, ready;
    RINGCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    done_ = done;
    RINGCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    ready_ = ready;
    const uint64_t hello = kHelloMagic ^ static_cast<uint64_t>(rank_);
    RINGCOLL_CUDA_CHECK(cudaMemcpy(base_ + kHelloOffset, &hello, sizeof(hello), cudaMemcpyHostToDevice));
    RINGCOLL_CUDA_CHECK(cudaDeviceSynchronize());  // the memsets are done before the handle leaves
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
  RINGCOLL_CUDA_CHECK(cudaIpcGetMemHandle(&msg.handle, base_));
  msg.device = device_;
  msg.rank = rank_;
  msg.sm_count = sm_count_;
  msg.gpu = gpu_uuid(device_);
  return std::string(reinterpret_cast<const char*>(&msg), sizeof(msg));
}

void CudaComm::open_peers(const std::vector<std::string>& handles) {
  ensure_usable("Communicator");
  RINGCOLL_CHECK(!peers_open_, Error, "Communicator: peers are already open");
  RINGCOLL_CHECK(static_cast<int>(handles.size()) == world_, std::invalid_argument,
                 "Communicator: expected one IPC handle per rank, got ", handles.size());
  RINGCOLL_CUDA_CHECK(cudaSetDevice(device_));
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
  std::vector<bool> same_gpu(static_cast<size_t>(world_), true);
  std::vector<cudaUUID_t> gpus(static_cast<size_t>(world_), mine);
  int least_sms = sm_count_;
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    RINGCOLL_CHECK(handles[r].size() == sizeof(HandleMessage), std::invalid_argument,
                   "Communicator: rank ", r, "'s IPC handle has ", handles[r].size(), " bytes, expected ",
                   sizeof(HandleMessage));
    HandleMessage msg;
    std::memcpy(&msg, handles[r].data(), sizeof(msg));
    RINGCOLL_CHECK(msg.rank == r, std::invalid_argument, "Communicator: handle ", r, " came from rank ", msg.rank);
    if (msg.sm_count < least_sms) least_sms = msg.sm_count;
    gpus[r] = msg.gpu;
    same_gpu[r] = std::memcmp(&msg.gpu, &mine, sizeof(mine)) == 0;
    if (msg.device != device_) {
      int can = 0;
      RINGCOLL_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device_, msg.device));
      RINGCOLL_CHECK(can, Error, "Communicator: rank ", rank_, " on GPU ", device_, " cannot access GPU ",
                     msg.device, " of rank ", r, " (no peer access between them)");
      const cudaError_t err = cudaDeviceEnablePeerAccess(msg.device, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) (void)cudaGetLastError();
      else RINGCOLL_CUDA_CHECK(err);
    }
    void* mapped = nullptr;
    RINGCOLL_CUDA_CHECK(cudaIpcOpenMemHandle(&mapped, msg.handle, cudaIpcMemLazyEnablePeerAccess));
    peers_[r] = static_cast<char*>(mapped);
    // A mapping that opens but does not reach the peer's memory (seen in sandboxes and with
    // broken peer access) would otherwise surface as a timeout inside the first kernel.
    uint64_t hello = 0;
    RINGCOLL_CUDA_CHECK(cudaMemcpy(&hello, peers_[r] + kHelloOffset, sizeof(hello), cudaMemcpyDeviceToHost));
    RINGCOLL_CHECK(hello == (kHelloMagic ^ static_cast<uint64_t>(r)), Error, "Communicator: rank ", rank_,
                   " mapped rank ", r, "'s GPU memory through CUDA IPC but reads ", hello,
                   " instead of its hello word ", kHelloMagic ^ static_cast<uint64_t>(r),
                   "; IPC between these processes does not work here");
  }
  flag_scope_ = flag_scope_for(same_gpu);
  // Every rank sees every handle, so all compute the same grid bound (block b talks to block b).
  int ranks_per_gpu = 1;
  for (const cudaUUID_t& g : gpus) {
    int here = 0;
    for (const cudaUUID_t& h : gpus) here += std::memcmp(&g, &h, sizeof(g)) == 0;
    if (here > ranks_per_gpu) ranks_per_gpu = here;
  }
  max_blocks_ = max_blocks_for(least_sms, ranks_per_gpu);
  RINGCOLL_CHECK(max_blocks_ >= 1 && max_blocks_ <= kMaxBlocks, Error, "Communicator: a grid of ", max_blocks_,
                 " blocks does not fit the flag area (kMaxBlocks = ", kMaxBlocks, ")");
}

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
    case AbortCause::kMismatch: throw MismatchError(broken_reason_);
    default: throw PeerError(broken_reason_);
  }
}

void CudaComm::synchronize() {
  if (closed_) return;
  RINGCOLL_CUDA_CHECK(cudaSetDevice(device_));
  RINGCOLL_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
  check_error();
}

void CudaComm::launch(const char* op, Collective coll, uintptr_t input, uintptr_t output, int64_t user_count,
                      int dtype, int reduce_op, uintptr_t stream, bool join) {
  check_error();
  ensure_usable(op);
  RINGCOLL_CHECK(peers_open_ || world_ == 1, Error, op, ": peers are not mapped yet (open_peers)");
  RINGCOLL_CHECK(is_supported(coll, static_cast<DType>(dtype), static_cast<ReduceOp>(reduce_op)), std::invalid_argument,
                 op, ": unsupported dtype/op ", dtype, "/", reduce_op);
  RINGCOLL_CUDA_CHECK(cudaSetDevice(device_));
  auto user = reinterpret_cast<cudaStream_t>(stream);
  const FlagScope scope = flag_scope_;
  auto own = static_cast<cudaStream_t>(stream_);
  // Our stream runs after everything the caller queued so far (the inputs are ready), and
  // successive collectives stay in order on it whatever streams callers use.
  RINGCOLL_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(ready_), user));
  RINGCOLL_CUDA_CHECK(cudaStreamWaitEvent(own, static_cast<cudaEvent_t>(ready_), 0));
  const RingCall call = ring_call(coll, user_count, static_cast<DType>(dtype), static_cast<ReduceOp>(reduce_op), world_);
  auto copy = [&](void* dst, const void* src, size_t bytes) {
    RINGCOLL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, own));
  };
  run_call(call, world_, reinterpret_cast<const void*>(input), reinterpret_cast<void*>(output), copy, [&] {
    const LaunchMemory memory{base_, peers_[left_neighbour(rank_, world_)], peers_[right_neighbour(rank_, world_)],
                              scope, state_, errors_device_, reinterpret_cast<const void*>(input),
                              reinterpret_cast<void*>(output)};
    const RingParams p = call_params(call, rank_, world_, slot_bytes_, timeout_seconds_, check_calls_, variant_, memory);
    try {
      for_each_launch(p, variant_, call.elem_size, max_blocks_, [&](const RingParams& q, int blocks, bool vectorise) {
        launch_ring(q, blocks, vectorise, own);
      });
    } catch (const std::exception& e) {
      // Some of the call's launches may be queued: this rank's numbering no longer matches.
      broken_reason_ = std::string(op) + ": a kernel launch failed: " + e.what();
      throw;
    }
  });
  RINGCOLL_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(done_), own));
  if (join) RINGCOLL_CUDA_CHECK(cudaStreamWaitEvent(user, static_cast<cudaEvent_t>(done_), 0));
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
// be reading our last slot when our own kernels are done. So close() is collective:
//   1. wait for every launch that uses our memory (our stream's, and any CUDA-graph replay);
//      a kernel error the host has not checked yet still makes the communicator broken;
//   2. write our `finished` word into every peer's allocation, and set our `aborted` to
//      "closed" unless a kernel already gave up (a neighbour still waiting for us then
//      stops at once, naming us);
//   3. wait, bounded by the timeout, until every peer's word has arrived in ours: from then
//      on no peer reads or writes our memory (close_protocol.h; the emulator runs the same
//      loop in CI). Words are pushed, not pulled, so no rank ever reads the memory of a
//      peer that may already have freed it;
//   4. unmap the peers, then free our own allocation.
// One window remains that the documentation still covers: a finished peer may not yet have
// unmapped us when we free (that cannot be signalled through the memory being unmapped; it
// would take a host round trip). Nothing touches the memory in that window.
// Our allocation is kept, not freed (the driver releases it when the process exits, and
// kept_on_close() says why) when a peer does not close within the timeout (it died, or
// never closes), when the communicator is broken (a peer's kernel may still be stopping; a
// dead peer would make us wait the whole timeout), or without `wait_for_peers` (a
// finalizer, which must not stall one rank at an arbitrary point).
void CudaComm::close(bool wait_for_peers) {
  if (closed_) return;
  closed_ = true;
  // Errors below are ignored: close must not throw from a destructor, and a broken
  // communicator is closed all the same.
  cudaSetDevice(device_);
  cudaDeviceSynchronize();
  if (broken_reason_.empty() && errors_host_ != nullptr) {
    const ErrorRecord* rec = first_error(errors_host_, kMaxBlocks);
    if (rec != nullptr) broken_reason_ = "cuda collective: " + error_message(*rec, world_, timeout_seconds_);
  }
  announce_closed();
  const bool shared = peers_open_ && world_ > 1;  // peers map our allocation
  if (shared && !broken_reason_.empty()) {
    kept_on_close_ = "the communicator is broken (" + broken_reason_ + ")";
  } else if (shared && !wait_for_peers) {
    kept_on_close_ = "it was closed without waiting for its peers (by the garbage collector)";
  } else if (shared) {
    kept_on_close_ = wait_until_peers_finished(rank_, world_, timeout_seconds_, [&](int r, uint64_t* word) {
      return copy_flag(word, base_ + finished_word_offset(r), cudaMemcpyDeviceToHost);
    });
  }
  for (int r = 0; r < world_; ++r) {
    if (r != rank_ && peers_[r] != nullptr) cudaIpcCloseMemHandle(peers_[r]);
    peers_[r] = nullptr;
  }
  if (done_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(done_));
  if (ready_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(ready_));
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  if (errors_host_ != nullptr) cudaFreeHost(errors_host_);
  if (state_ != nullptr) cudaFree(state_);
  if (base_ != nullptr && kept_on_close_.empty()) cudaFree(base_);
  done_ = ready_ = stream_ = nullptr;
  errors_host_ = errors_device_ = nullptr;
  state_ = nullptr;
  base_ = nullptr;
  cudaGetLastError();  // leave no sticky non-fatal error behind for the caller's next call
}

// Step 2 of close(): our kernels are finished, so everything they published is visible
// before these words; device_ring.h's waits rely on that.
void CudaComm::announce_closed() {
  if (base_ == nullptr || !peers_open_ || world_ == 1) return;
  const uint64_t one = 1;
  for (int r = 0; r < world_; ++r) {
    if (r != rank_ && peers_[r] != nullptr) copy_flag(peers_[r] + finished_word_offset(rank_), &one, cudaMemcpyHostToDevice);
  }
  uint64_t* flag = reinterpret_cast<uint64_t*>(base_ + kAbortedOffset);
  uint64_t cause = 0;
  if (!copy_flag(&cause, flag, cudaMemcpyDeviceToHost) || cause != 0) return;
  cause = static_cast<uint64_t>(AbortCause::kClosed);
  copy_flag(flag, &cause, cudaMemcpyHostToDevice);
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
