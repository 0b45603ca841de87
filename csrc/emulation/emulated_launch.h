// emulated_launch.h: a kernel launch on the CPU. Each GPU thread of the grid is a std::thread,
// __syncthreads a barrier per block (cuda_shim.h). The two kernels are instantiated for every
// dtype and op in files of their own (emulated_ring_kernel.cpp, emulated_plan_kernel.cpp),
// apart from the ring's host side (emulated_ring.cpp): in one file the emulator's
// ThreadSanitizer build (tests/pure/tsan_build.py) took 25 s on CI's two cores.
#pragma once

// clang-format off
#include "cuda_shim.h"  // before device code: it supplies threadIdx, __syncthreads, ...
// clang-format on
#include <memory>
#include <thread>
#include <vector>

#include "../cuda/kernel_abi.h"

namespace ringcoll::emulation {

// ring_kernels.cu's launch_ring and plan_kernels.cu's launch_plan, with threads for the GPU.
void launch_ring_kernel(const cuda::RingParams& p, int blocks, int threads, bool vectorise);
void launch_plan_kernel(const cuda::RingParams& p, int blocks, int threads, bool vectorise);

// One launch: blocks x threads std::threads, each running the kernel's block function
// (ring_block, or plan_block for a plan's call) as its GPU thread would.
template <class Shared, class Block>
void launch_blocks(const cuda::RingParams& p, int blocks, int threads, bool vectorise, Block&& block) {
  std::vector<Shared> shared(static_cast<size_t>(blocks));
  std::vector<std::unique_ptr<BlockBarrier>> barriers;
  for (int b = 0; b < blocks; ++b) barriers.push_back(std::make_unique<BlockBarrier>(threads));
  std::vector<std::thread> running;
  for (int b = 0; b < blocks; ++b) {
    for (int t = 0; t < threads; ++t) {
      running.emplace_back([&, b, t] {
        threadIdx.x = t, blockIdx.x = b, blockDim.x = threads, gridDim.x = blocks;
        current_block_barrier = barriers[b].get();
        block(p, shared[b], vectorise);
      });
    }
  }
  for (auto& thread : running) thread.join();
}

}  // namespace ringcoll::emulation
