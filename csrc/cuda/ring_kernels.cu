// ring_kernels.cu: the ring kernels. Each thread block runs device_ring.h's ring_block; the
// file comment there states the memory ordering and how waits give up (the algorithm is
// ring.h's).
//
// Variants (RINGCOLL_CUDA_KERNEL, chosen per communicator; all ranks must agree, and the
// mismatch check compares it):
//   fused   fused_blocks() thread blocks (kernel_abi.h: one per tile of a slice, at most one
//           per SM), each owning fixed 32 KiB tiles of every slot (strip.h)
//           with its own flags, so blocks never wait for one another; 16-byte vector
//           loads/stores wherever the pointers allow, a scalar head and tail elsewhere; one
//           launch per collective, every slice and ring step inside it.
//   naive   one thread block, scalar element loops, one launch per ring step of every slice
//           (kernel_abi.h's for_each_launch): the teaching version, and the fallback where
//           a long-running kernel is a problem (time-sliced processes, see docs/cuda.md).
// Both compile from the same template: the variant is a launch shape and runtime fields of
// RingParams, which keeps the instantiations (and the build time) at one per (dtype, op).
#include <cuda_runtime.h>

#include "device_ring.h"
#include "ring_kernels.h"
#include "ringcoll/check.h"

namespace ringcoll::cuda {
namespace {

constexpr int kThreads = kTileThreads;  // strip.h sizes a tile for this block size

template <typename T, class Op>
__global__ void __launch_bounds__(kThreads) ring_kernel(RingParams p, bool vectorise) {
  __shared__ BlockShared shared;
  ring_block<T, Op>(p, shared, vectorise);
}

}  // namespace

void launch_ring(const RingParams& params, int blocks, bool vectorise, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  dispatch_call(params.call, [&](auto t, auto o) {
    ring_kernel<decltype(t), decltype(o)><<<blocks, kThreads, 0, s>>>(params, vectorise);
  });
  RINGCOLL_CUDA_CHECK(cudaGetLastError());
}

void preload_ring_kernels() {
  // placeholder until the devcheck branch lands its version
}

}  // namespace ringcoll::cuda
