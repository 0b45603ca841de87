// cuda_comm.h: the CUDA transport. P processes, each with one GPU allocation (flags, then
// data; kernel_abi.h has the layout) that every peer maps through CUDA IPC; the ring of
// ring_loop.h runs in kernels over them (ring_kernels.cu, device_ring.h). Nothing here names
// a CUDA type, so the bindings compile with g++.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernel_abi.h"

namespace ringcoll::cuda {

class CudaComm {
 public:
  CudaComm(int rank, int world, int device, size_t buffer_bytes, double timeout_seconds, bool check_calls,
           int variant);
  ~CudaComm();
  CudaComm(const CudaComm&) = delete;
  CudaComm& operator=(const CudaComm&) = delete;

  // This rank's IPC handle (cudaIpcMemHandle_t bytes) plus its device ordinal.
  std::string handle_bytes() const;
  // Map every peer's allocation; handles[r] is what rank r's handle_bytes() returned.
  void open_peers(const std::vector<std::string>& handles);

  // Raw device addresses; counts are user counts (call.h); `stream` is a cudaStream_t as an
  // integer (0: legacy default).
  // The kernel runs on the communicator's own stream after `stream`'s prior work; with
  // `join`, `stream` then waits for it (no host synchronisation either way).
  void all_reduce(uintptr_t input, uintptr_t output, int64_t user_count, int dtype, int op, uintptr_t stream,
                  bool join);
  void reduce_scatter(uintptr_t input, uintptr_t output, int64_t user_count, int dtype, int op, uintptr_t stream,
                      bool join);
  void all_gather(uintptr_t input, uintptr_t output, int64_t user_count, int dtype, uintptr_t stream, bool join);

  // Throw (and mark the communicator broken) if a kernel has given up: TimeoutError,
  // MismatchError or PeerError as its record says. Cheap: reads host-mapped memory, no
  // synchronisation.
  void check_error();
  // Block until every launch so far has finished, then check_error().
  void synchronize();
  // Collective, like NCCL's finalize-then-destroy: see cuda_comm.cu. Never throws.
  // Without wait_for_peers (finalizers) it does not wait, and keeps its allocation.
  void close(bool wait_for_peers = true);
  // Why close() left this rank's allocation to be freed at process exit; empty if it freed it.
  const std::string& kept_on_close() const { return kept_on_close_; }

  uintptr_t stream_handle() const { return reinterpret_cast<uintptr_t>(stream_); }
  int rank() const { return rank_; }
  int world() const { return world_; }
  int device() const { return device_; }
  size_t slot_bytes() const { return slot_bytes_; }
  int max_blocks() const { return max_blocks_; }
  int flag_scope() const { return static_cast<int>(flag_scope_); }
  int variant() const { return static_cast<int>(variant_); }
  bool check_calls() const { return check_calls_; }
  bool broken() const { return !broken_reason_.empty(); }
  const std::string& broken_reason() const { return broken_reason_; }
  double timeout() const { return timeout_seconds_; }
  void set_timeout(double seconds) { timeout_seconds_ = seconds; }

 private:
  void ensure_usable(const char* op) const;
  void map_peers(const std::vector<std::string>& handles);
  void announce_closed();
  bool copy_flag(void* dst, const void* src, int kind);
  void launch(const char* op, Collective coll, uintptr_t input, uintptr_t output, int64_t user_count, int dtype,
              int reduce_op, uintptr_t stream, bool join);

  int rank_, world_, device_;
  size_t buffer_bytes_, slot_bytes_;
  int sm_count_ = 0;                     // this GPU's SMs
  int max_blocks_ = 1;                   // most blocks of a fused launch (max_blocks_for), agreed by all ranks
  FlagScope flag_scope_ = FlagScope::kSystem;  // of the data flags: kDevice once every peer is seen on this GPU
  double timeout_seconds_;
  bool check_calls_;
  KernelVariant variant_;
  char* base_ = nullptr;                 // own IPC allocation: flags, then data
  uint64_t* state_ = nullptr;            // private: the bookkeeping record, kStateWords
  ErrorRecord* errors_host_ = nullptr;   // host-mapped, kMaxBlocks records
  ErrorRecord* errors_device_ = nullptr;
  void* stream_ = nullptr;               // cudaStream_t
  void* done_ = nullptr;                 // cudaEvent_t, recorded after each launch
  void* ready_ = nullptr;                // cudaEvent_t, recorded on the caller's stream
  std::vector<char*> peers_;             // peers_[r]: rank r's allocation mapped here (own for r == rank)
  bool peers_open_ = false;
  std::string broken_reason_;
  bool closed_ = false;
  std::string kept_on_close_;
};

}  // namespace ringcoll::cuda
