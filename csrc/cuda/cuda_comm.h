// cuda_comm.h: the CUDA transport. P processes, each with one GPU buffer that every peer
// maps through CUDA IPC; the ring of ring_loop.h runs in a kernel over them
// (ring_kernels.cu). Nothing here names a CUDA type, so the bindings compile with g++.
//
// Per-rank IPC allocation (one cudaMalloc, one handle):
//
//   [ flag area: per thread block b < kMaxBlocks: published, consumed, each on its own 128-byte line | 4 KiB ]
//   [ data area: kBanks x P slots of slot_bytes each                                                       ]
//
// Block b of rank k talks only to block b of ranks k-1 and k+1 (its own strip of every
// chunk), so blocks never wait for each other. Per-block bookkeeping (step base and the
// last publication of every slot, see ring_loop.h) lives in a private device array that
// persists between launches, like HostComm's members.
//
// Not yet on CUDA: the call-descriptor check (descriptor.h, RINGCOLL_CHECK). `check` is
// accepted and ignored; mismatched calls on the CUDA transport time out instead of raising
// RingcollMismatchError.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ringcoll::cuda {

constexpr int kBanks = 2;
constexpr int kMaxBlocks = 8;          // fused kernel's grid; flag area sized for it
constexpr int kMaxWorld = 16;          // per-thread copy of the slot bookkeeping is sized for it
constexpr size_t kFlagAreaBytes = 4096;
constexpr size_t kFlagStride = 128;    // one flag per 128-byte line
constexpr size_t kSlotAlignment = 128;
constexpr int kStateWords = 2 * kMaxWorld + 8;  // per block: [0] step base, [1..] last publication per slot

// Where a kernel that gave up records why (host-mapped, one per block).
struct ErrorRecord {
  int32_t valid;     // written last
  int32_t rank, peer, block;
  int32_t waiting_for_consume;  // 0: waited for `peer` to publish, 1: to consume
  int32_t step;      // -1 before the first ring step
  int64_t slice;
  uint64_t expected, seen;
  uint64_t waited_ns;
};

enum class KernelVariant : int { kFused = 0, kNaive = 1 };

size_t slot_bytes_for(size_t buffer_bytes, int world);

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

  // Raw device addresses; `stream` is a cudaStream_t as an integer (0: legacy default).
  // The kernel runs on the communicator's own stream after `stream`'s prior work; with
  // `join`, `stream` then waits for it (no host synchronisation either way).
  void all_reduce(uintptr_t input, uintptr_t output, int64_t count, int dtype, int op, uintptr_t stream, bool join);
  void reduce_scatter(uintptr_t input, uintptr_t output, int64_t output_count, int dtype, int op, uintptr_t stream,
                      bool join);
  void all_gather(uintptr_t input, uintptr_t output, int64_t input_count, int dtype, uintptr_t stream, bool join);

  // Throw TimeoutError (and mark the communicator broken) if a kernel has recorded a
  // timed-out wait. Cheap: reads host-mapped memory, no synchronisation.
  void check_error();
  // Block until every launch so far has finished, then check_error().
  void synchronize();
  void close();

  uintptr_t stream_handle() const { return reinterpret_cast<uintptr_t>(stream_); }
  int rank() const { return rank_; }
  int world() const { return world_; }
  int device() const { return device_; }
  size_t slot_bytes() const { return slot_bytes_; }
  int variant() const { return static_cast<int>(variant_); }
  bool check_calls() const { return check_calls_; }
  bool broken() const { return !broken_reason_.empty(); }
  const std::string& broken_reason() const { return broken_reason_; }
  double timeout() const { return timeout_seconds_; }
  void set_timeout(double seconds) { timeout_seconds_ = seconds; }

 private:
  void ensure_usable(const char* op) const;
  void launch(const char* op, int coll, uintptr_t input, uintptr_t output, int64_t count, int dtype, int reduce_op,
              uintptr_t stream, bool join);

  int rank_, world_, device_;
  size_t buffer_bytes_, slot_bytes_;
  double timeout_seconds_;
  bool check_calls_;
  KernelVariant variant_;
  char* base_ = nullptr;                 // own IPC allocation: flags, then data
  uint64_t* state_ = nullptr;            // private: kMaxBlocks x kStateWords
  ErrorRecord* errors_host_ = nullptr;   // host-mapped, kMaxBlocks records
  ErrorRecord* errors_device_ = nullptr;
  void* stream_ = nullptr;               // cudaStream_t
  void* done_ = nullptr;                 // cudaEvent_t, recorded after each launch
  void* ready_ = nullptr;                // cudaEvent_t, recorded on the caller's stream
  std::vector<char*> peers_;             // peers_[r]: rank r's allocation mapped here (own for r == rank)
  bool peers_open_ = false;
  uint64_t launches_ = 0;
  std::string broken_reason_;
  bool closed_ = false;
};

}  // namespace ringcoll::cuda
