// ring_kernels.h: how cuda_comm.cu launches the ring kernels (ring_kernels.cu).
#pragma once

#include "kernel_abi.h"

namespace ringcoll::cuda {

// Launch one kernel of a collective (see for_each_launch) for (dtype, op) on `stream` (a
// cudaStream_t) with `blocks` thread blocks; 16-byte vectors when `vectorise`. All-gather
// ignores dtype and op (it moves bytes).
void launch_ring(const RingParams& params, int dtype, int op, int blocks, bool vectorise, void* stream);

}  // namespace ringcoll::cuda
