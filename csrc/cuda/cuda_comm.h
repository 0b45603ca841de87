// cuda_comm.h: the CUDA transport. P ranks, each with one GPU allocation (flags, then data;
// kernel_abi.h has the layout) that every peer maps: through CUDA IPC when the peer is
// another process, as the plain device pointer when it is another thread of this one (the
// in-process mode, ringcoll/bootstrap.py). The ring of ring_loop.h runs in kernels over them
// (ring_kernels.cu, device_ring.h). Nothing here names a CUDA type, so the bindings compile
// with g++.
#pragma once

#include <cstdint>
#include <memory>
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

  // What a peer needs to reach this rank's allocation: its IPC handle, its address and this
  // process's token (a peer of the same process uses the address, cuda_comm.cu says why),
  // plus the GPU's UUID and SM count.
  std::string handle_bytes() const;
  // Map every peer's allocation; handles[r] is what rank r's handle_bytes() returned.
  void open_peers(const std::vector<std::string>& handles);
  // How many peers are reached by CUDA IPC (other processes) and how many directly (threads
  // of this process); valid after open_peers.
  int ipc_peers() const;
  int in_process_peers() const;

  // Raw device addresses; counts are user counts (call.h); `stream` is a cudaStream_t as an
  // integer (0: legacy default).
  // The kernel runs on the communicator's own stream after `stream`'s prior work; with
  // `join`, `stream` then waits for it (no host synchronisation either way).
  void all_reduce(uintptr_t input, uintptr_t output, int64_t user_count, int dtype, int op, uintptr_t stream,
                  bool join);
  void reduce_scatter(uintptr_t input, uintptr_t output, int64_t user_count, int dtype, int op, uintptr_t stream,
                      bool join);
  void all_gather(uintptr_t input, uintptr_t output, int64_t user_count, int dtype, uintptr_t stream, bool join);
  // Any collective by a plan (plan.h; device_plan.h runs it): its id travels in the call's
  // descriptor, so ranks running different plans get a mismatch. A plan's records are copied
  // to the GPU the first time it runs, which a CUDA graph capture cannot contain: run a plan
  // once before capturing it.
  void run_plan(const CompiledPlan& plan, int collective, uintptr_t input, uintptr_t output,
                int64_t user_count, int dtype, int op, uintptr_t stream, bool join);

  // Symmetric memory (ringcoll/symmetric_heap.h; docs/symmetric.md). Making an arena is
  // collective, in two steps with the caller's exchange between them (transports/cuda.py):
  // make_symmetric_arena cudaMallocs this rank's part and returns its handle (IPC handle,
  // address, process token); open_symmetric_arena maps every peer's part (CUDA IPC, or the
  // address itself for a peer of this process), adds the arena's row to the kernels' table
  // (copied to the GPU on our stream, before any later kernel) and hands the part to the heap.
  // A part is freed when the heap and every block are gone, and only if this communicator's
  // close saw every peer leave (else it is kept until the process exits, like the buffer).
  std::string make_symmetric_arena(size_t bytes);
  void open_symmetric_arena(const std::vector<std::string>& handles);
  std::shared_ptr<SymmetricBlock> take_symmetric(size_t bytes);  // null: no room
  bool symmetric_has_room(size_t bytes) const { return heap_->has_room_for(bytes); }
  bool is_symmetric(uintptr_t address, size_t bytes) const {
    return heap_->locate(reinterpret_cast<const void*>(address), bytes).has_value();
  }

  // Throw (and mark the communicator broken) if a kernel has given up: TimeoutError,
  // MismatchError or PeerError as its record says. Cheap: reads host-mapped memory, no
  // synchronisation.
  void check_error();
  // Block until every launch so far has finished, then check_error().
  void synchronize();
  // Collective, like NCCL's finalize-then-destroy, in two halves (cuda_comm.cu states the
  // protocol): leave_peers() (finish our work, tell every peer, wait for theirs, unmap them),
  // then, after the caller's host rendezvous of every rank, free_memory(). close() is both
  // without the rendezvous (destructors). None of them throws. Without wait_for_peers
  // (finalizers) leave_peers does not wait, and the allocation is kept.
  void leave_peers(bool wait_for_peers = true);
  void free_memory();
  void close(bool wait_for_peers = true);
  // Keep the allocation (not freed until the process exits), saying why: e.g. the caller's
  // rendezvous between leave_peers and free_memory failed.
  void keep_memory(const std::string& why) {
    if (kept_on_close_.empty()) kept_on_close_ = why;
  }
  // Why close() left this rank's allocation to be freed at process exit; empty if it freed it.
  const std::string& kept_on_close() const { return kept_on_close_; }

  uintptr_t stream_handle() const { return reinterpret_cast<uintptr_t>(stream_); }
  // Whether `stream` (a cudaStream_t of our device; 0 is its legacy stream) captures a CUDA
  // graph now. torch.cuda.is_current_stream_capturing() asks about the current device's.
  bool stream_capturing(uintptr_t stream) const;
  // Never lend our stream again (ringcoll/transports/cuda.py, RankThreads): a thread may still
  // be on it as its current stream.
  void retire_stream() { stream_retired_ = true; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  int device() const { return device_; }
  size_t slot_bytes() const { return slot_bytes_; }
  int max_blocks() const { return max_blocks_; }
  int flag_scope() const { return static_cast<int>(flag_scope_); }
  int flag_scope_setting() const { return static_cast<int>(flag_scope_setting_); }
  int variant() const { return static_cast<int>(variant_); }
  bool check_calls() const { return check_calls_; }
  bool broken() const { return !broken_reason_.empty(); }
  const std::string& broken_reason() const { return broken_reason_; }
  double timeout() const { return timeout_seconds_; }
  void set_timeout(double seconds) { timeout_seconds_ = seconds; }

 private:
  void ensure_usable(const char* op) const;
  void map_peers(const std::vector<std::string>& handles);
  void announce_closed(bool will_free);
  void tell_peers_finished(uint64_t word);
  bool copy_flag(void* dst, const void* src, int kind);
  void launch(const char* op, Collective coll, uintptr_t input, uintptr_t output, int64_t user_count, int dtype,
              int reduce_op, uintptr_t stream, bool join, const CompiledPlan* plan = nullptr);
  // The plan part of a call's parameters, its records copied to plan_records_device_ on first use.
  PlanParams device_plan(const char* op, Collective coll, const CompiledPlan& plan, uintptr_t user_stream);

  int rank_, world_, device_;
  size_t buffer_bytes_, slot_bytes_;
  int sm_count_ = 0;                     // this GPU's SMs
  int max_blocks_ = 1;                   // most blocks of a fused launch (max_blocks_for), agreed by all ranks
  FlagScope flag_scope_ = FlagScope::kSystem;  // of the data flags: kDevice once every peer is seen on this GPU
  FlagScopeSetting flag_scope_setting_ = FlagScopeSetting::kAuto;  // RINGCOLL_CUDA_FLAG_SCOPE, read at construction
  double timeout_seconds_;
  bool check_calls_;
  KernelVariant variant_;
  char* base_ = nullptr;                 // own IPC allocation: flags, then data
  uint64_t* state_ = nullptr;            // private: the bookkeeping record, kStateWords
  ErrorRecord* errors_host_ = nullptr;   // host-mapped, kMaxBlocks records
  ErrorRecord* errors_device_ = nullptr;
  PlanRecords plan_records_;                   // which plans' records lie where in plan_records_device_
  DevicePlanOp* plan_records_device_ = nullptr;  // kPlanRecordCapacity records
  void* plan_work_ = nullptr;                  // private plan scratch, plan_work_bytes
  void* stream_ = nullptr;               // cudaStream_t, lent for our lifetime (cuda_comm.cu: StreamLender)
  bool stream_retired_ = false;          // kept from the lender at close (retire_stream)
  void* done_ = nullptr;                 // cudaEvent_t, recorded after each launch
  void* ready_ = nullptr;                // cudaEvent_t, recorded on the caller's stream
  void* replayed_ = nullptr;             // cudaEvent_t, recorded by CUDA-graph replays (stream_order.h)
  std::vector<char*> peers_;             // peers_[r]: rank r's allocation mapped here (own for r == rank)
  std::vector<bool> peer_by_ipc_;        // peers_[r] came from cudaIpcOpenMemHandle (else: same process)
  // Symmetric memory: this rank's parts (in the heap), the table of every rank's parts as
  // mapped here (and its copy on the GPU), the peers' parts opened by IPC (closed when we
  // leave), the part being made, and whether our parts may be freed (close saw every peer go).
  std::shared_ptr<SymmetricHeap> heap_ = std::make_shared<SymmetricHeap>();
  SymmetricTable symmetric_table_;
  const char** symmetric_table_device_ = nullptr;  // kSymmetricTableEntries
  std::vector<void*> symmetric_ipc_parts_;
  std::shared_ptr<void> making_;
  size_t making_bytes_ = 0;
  std::shared_ptr<bool> parts_may_be_freed_ = std::make_shared<bool>(false);
  bool left_peers_ = false;
  bool peers_open_ = false;
  std::string broken_reason_;
  bool closed_ = false;
  std::string kept_on_close_;
};

}  // namespace ringcoll::cuda
