// emulated_ring.h: the CUDA ring kernels run on the CPU (emulated_ring.cpp says what that
// covers and what it does not). Bound as ringcoll._C.emulation for tests/pure/test_emulated_kernels.py.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ringcoll::emulation {

// One rank's part of a collective: the arguments CudaComm's methods take; or, with
// collective == kClose, the rank closing its communicator.
constexpr int kClose = -1;
struct EmulatedCall {
  int rank, collective, dtype, op;
  uintptr_t input, output;
  int64_t user_count;  // call.h
};

// What the call raised: an empty type for success, else the Python error's name and message.
// For a close: an empty type, and in `message` why the rank keeps its allocation ("" if not).
struct CallResult {
  std::string error_type, message;
};

class EmulatedRing {
 public:
  // max_blocks: the emulated device's SM count, which bounds a fused launch (fused_blocks).
  EmulatedRing(int world, size_t buffer_bytes, double timeout_seconds, int variant, int threads_per_block,
               bool check_calls, int max_blocks = 8);
  ~EmulatedRing();
  // Run the given calls: each rank runs its own in order, concurrently with the other ranks
  // and without waiting for them between calls. A rank not listed makes no call (a peer that
  // never arrives). State persists between runs, as in a communicator.
  std::vector<CallResult> run(const std::vector<EmulatedCall>& calls);
  uint64_t launches() const { return launches_; }
  uint64_t blocks_launched() const { return blocks_launched_; }  // over all launches of all ranks
  size_t slot_bytes() const { return slot_bytes_; }

 private:
  struct Rank;
  CallResult run_on_rank(const EmulatedCall& call);
  CallResult close_rank(int rank);

  int world_;
  size_t slot_bytes_;
  double timeout_seconds_;
  int variant_, threads_, max_blocks_;
  bool check_calls_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::atomic<uint64_t> launches_{0}, blocks_launched_{0};
};

}  // namespace ringcoll::emulation
