// cuda_shim.h: the few CUDA built-ins device_ring.h uses, for running its thread blocks on
// the CPU (emulated_ring.cpp). Each emulated GPU thread is a std::thread; the threads of one
// block share a BlockBarrier (__syncthreads) and a BlockShared (__shared__). Host compilers
// only: nvcc has the real ones.
#pragma once

#if defined(__CUDACC__)
#error "cuda_shim.h stands in for CUDA on host compilers; nvcc has the real built-ins"
#endif

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

#if defined(RINGCOLL_WITH_CUDA)
#include <vector_types.h>  // CUDA's headers are in this build (check.h): use their uint4
#else
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
#endif
struct EmulatedDim {
  unsigned x;
};

// Where the calling thread sits in its launch; set by the emulator before the block code runs.
inline thread_local EmulatedDim threadIdx{0}, blockIdx{0}, blockDim{1}, gridDim{1};

namespace ringcoll::emulation {

// __syncthreads for the threads of one block: a reusable barrier (generation counting).
class BlockBarrier {
 public:
  explicit BlockBarrier(unsigned threads) : threads_(threads) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t generation = generation_;
    if (++arrived_ == threads_) {
      arrived_ = 0;
      ++generation_;
      all_arrived_.notify_all();
    } else {
      all_arrived_.wait(lock, [&] { return generation_ != generation; });
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable all_arrived_;
  unsigned threads_, arrived_ = 0;
  uint64_t generation_ = 0;
};

inline thread_local BlockBarrier* current_block_barrier = nullptr;

}  // namespace ringcoll::emulation

inline void __syncthreads() { ringcoll::emulation::current_block_barrier->arrive_and_wait(); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
// A waiting GPU thread naps; an emulated one gives its core away (ranks outnumber cores).
inline void __nanosleep(unsigned) { std::this_thread::yield(); }

namespace ringcoll {
// %globaltimer's stand-in: nanoseconds of a monotonic clock.
inline uint64_t device_now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}
}  // namespace ringcoll
