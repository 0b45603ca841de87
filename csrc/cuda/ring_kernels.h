// ring_kernels.h: how cuda_comm.cu launches the ring kernels (ring_kernels.cu) and the plan
// kernels (plan_kernels.cu).
#pragma once

#include "kernel_abi.h"

namespace ringcoll::cuda {

// Launch one kernel of a collective (see for_each_launch), the one for params.call
// (dispatch_call), on `stream` (a cudaStream_t) with `blocks` thread blocks; 16-byte
// vectors when `vectorise`.
void launch_ring(const RingParams& params, int blocks, bool vectorise, void* stream);
// The same for a plan call (for_each_plan_launch): params.plan says which plan.
void launch_plan(const RingParams& params, int blocks, bool vectorise, void* stream);

// Load every ring_kernel<T, Op> instantiation into the current device's context now, so no
// launch of the ring ever has to load one (see ring_kernels.cu for why that matters under
// CUDA's lazy module loading). Call it before this rank's ring can be waited on, e.g. while
// the communicator is built. Idempotent and cheap: the work is done once per device and
// process; later calls return at once. Thread-safe. Throws ringcoll::Error on a CUDA error.
// The plan kernels are loaded with them.
void preload_ring_kernels();
// plan_kernels.cu's part of it (preload_ring_kernels calls it under its lock, once per device).
void preload_plan_kernels();

// `load(T{}, Op{})` for every (dtype, op) a kernel is instantiated for: the supported
// pairs (AVG of an integer type never is; all-gather's uint8 SUM is among them).
template <class Load>
void for_each_instantiation(Load&& load) {
  for (int d = 0; d < kNumDTypes; ++d)
    for (int o = 0; o < kNumReduceOps; ++o)
      if (is_supported(static_cast<DType>(d), static_cast<ReduceOp>(o)))
        dispatch_dtype_op(static_cast<DType>(d), static_cast<ReduceOp>(o), load);
}

#if defined(__CUDACC__)
// Launch the instantiation `kernel_of(T{}, Op{})` returns for params.call (dispatch_call):
// `blocks` blocks of kTileThreads threads (strip.h sizes a tile for this block size).
template <class KernelOf>
void launch_for_call(const RingParams& params, int blocks, bool vectorise, void* stream, KernelOf&& kernel_of) {
  dispatch_call(params.call, [&](auto t, auto o) {
    kernel_of(t, o)<<<blocks, kTileThreads, 0, static_cast<cudaStream_t>(stream)>>>(params, vectorise);
  });
  RINGCOLL_CUDA_CHECK(cudaGetLastError());
}

// Load one kernel into the current device's context: cudaFuncGetAttributes references it,
// which makes the runtime load it (ring_kernels.cu says why that must happen early).
template <typename Kernel>
void load_kernel(Kernel* kernel) {
  cudaFuncAttributes attributes;
  RINGCOLL_CUDA_CHECK(cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(kernel)));
}
#endif

}  // namespace ringcoll::cuda
