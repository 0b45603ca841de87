// emulated_ring.h: the CUDA ring kernels run on the CPU, queued on the streams of a modelled
// device (emulated_streams.h); emulated_ring.cpp says what that covers and what it does not.
// Bound as ringcoll._C.emulation for tests/pure/test_emulated_kernels.py and the emulated
// CUDA transport (ringcoll/transports/emulated.py).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "emulated_streams.h"
#include "ringcoll/plan.h"
#include "ringcoll/symmetric_heap.h"

namespace ringcoll::emulation {

// One rank's part of a collective: the arguments CudaComm's methods take; or, with
// collective == kClose, the rank closing its communicator (kCloseWithoutWaiting: as a
// finalizer closes it, CudaComm::close(wait_for_peers=false)).
constexpr int kClose = -1, kCloseWithoutWaiting = -2;
struct EmulatedCall {
  int rank, collective, dtype, op;
  uintptr_t input, output;
  int64_t user_count;  // call.h
  const CompiledPlan* plan = nullptr;  // a plan's call (device_plan.h's kernel), else the ring's
};

// What the call raised: an empty type for success, else the Python error's name and message.
// For a close: an empty type, and in `message` why the rank keeps its allocation ("" if not).
struct CallResult {
  std::string error_type, message;
};

class EmulatedRing {
 public:
  // max_blocks: the emulated device's SM count, which bounds a fused launch (fused_blocks).
  // device: whose streams the ranks' work goes on (all ranks on one GPU, as in the
  // in-process CUDA mode); null: a device of its own with 32 hardware queues.
  // peers_in_process: the in-process CUDA mode, where a peer's plain device pointer can be
  // read; false models peers in other processes, which reach only symmetric memory.
  EmulatedRing(int world, size_t buffer_bytes, double timeout_seconds, int variant, int threads_per_block,
               bool check_calls, int max_blocks = 8, std::shared_ptr<Device> device = nullptr,
               bool peers_in_process = true);
  ~EmulatedRing();
  // Run the given calls: each rank runs its own in order, each call queued on the rank's own
  // stream and awaited, concurrently with the other ranks and without waiting for them
  // between calls. A rank not listed makes no call (a peer that never arrives). State
  // persists between runs, as in a communicator.
  std::vector<CallResult> run(const std::vector<EmulatedCall>& calls);

  // One rank's calls as the CUDA transport makes them (CudaComm::launch): queued after
  // `user_stream`'s work (stream_order.h), that stream then waiting for it where `join`.
  // The result reports only what is raised before anything is queued; a kernel's error
  // comes from check_error, after a synchronisation.
  CallResult enqueue(const EmulatedCall& call, int user_stream, bool join);
  CallResult check_error(int rank);  // CudaComm::check_error: a kernel's recorded error, once
  CallResult synchronize(int rank);  // CudaComm::synchronize: the rank's stream, then check_error
  int own_stream(int rank) const;    // the rank's communicator stream on the device
  void retire_stream(int rank);      // never given back to the device (CudaComm::retire_stream)

  // Symmetric memory as CudaComm makes it (cuda_comm.h says what each step does). An arena's
  // part is "exported" as CUDA IPC exports it: the owner's part is a memfd mapping, its
  // handle the descriptor, and each peer that opens it maps it again, at an address of its
  // own, as another process would: every rank's table of arenas differs from its peers'.
  std::string make_symmetric_arena(int rank, size_t bytes);
  void open_symmetric_arena(int rank, const std::vector<std::string>& handles);
  std::shared_ptr<SymmetricBlock> take_symmetric(int rank, size_t bytes);  // null: no room
  bool symmetric_has_room(int rank, size_t bytes) const;
  bool is_symmetric(int rank, uintptr_t address, size_t bytes) const;
  // How many of the rank's calls ran their plan's fallback (RingParams::fallback): read in
  // place, or not. Valid once its calls are synchronised.
  uint64_t fallbacks(int rank) const;
  Device& device() { return *device_; }
  double host_wait_seconds() const;  // how long a host wait lasts before the model calls itself stuck
  // The first breach of the close protocol seen ("" if none): a rank's kernel that ran after it closed.
  std::string violations() const;
  uint64_t launches() const { return launches_; }
  uint64_t blocks_launched() const { return blocks_launched_; }  // over all launches of all ranks
  size_t slot_bytes() const { return slot_bytes_; }

 private:
  struct Rank;
  CallResult close_rank(int rank, bool wait_for_peers);
  std::string host_rendezvous(int rank);
  void note_violation(const std::string& what);

  int world_;
  size_t slot_bytes_;
  double timeout_seconds_;
  int variant_, threads_, max_blocks_;
  bool check_calls_;
  bool peers_in_process_;
  std::shared_ptr<Device> device_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::atomic<uint64_t> launches_{0}, blocks_launched_{0};
  // The host rendezvous of a close (the group's barrier in transports/cuda.py): how many
  // ranks have reached it.
  std::mutex rendezvous_mutex_;
  std::condition_variable rendezvous_cv_;
  int at_rendezvous_ = 0;
  mutable std::mutex violations_mutex_;
  std::string violations_;
};

}  // namespace ringcoll::emulation
