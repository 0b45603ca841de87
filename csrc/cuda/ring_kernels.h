// ring_kernels.h: how cuda_comm.cu launches the ring kernels (ring_kernels.cu).
#pragma once

#include "kernel_abi.h"

namespace ringcoll::cuda {

// Launch one kernel of a collective (see for_each_launch), the one for params.call
// (dispatch_call), on `stream` (a cudaStream_t) with `blocks` thread blocks; 16-byte
// vectors when `vectorise`.
void launch_ring(const RingParams& params, int blocks, bool vectorise, void* stream);

// Load every ring_kernel instantiation on the current device now (see cuda_comm.cu).
void preload_ring_kernels();

}  // namespace ringcoll::cuda
