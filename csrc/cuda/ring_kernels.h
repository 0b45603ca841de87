// ring_kernels.h: how cuda_comm.cu launches the ring kernels (ring_kernels.cu).
#pragma once

#include "kernel_abi.h"

namespace ringcoll::cuda {

// Launch one kernel of a collective (see for_each_launch), the one for params.call
// (dispatch_call), on `stream` (a cudaStream_t) with `blocks` thread blocks; 16-byte
// vectors when `vectorise`.
void launch_ring(const RingParams& params, int blocks, bool vectorise, void* stream);

// Load every ring_kernel<T, Op> instantiation into the current device's context now, so no
// launch of the ring ever has to load one (see ring_kernels.cu for why that matters under
// CUDA's lazy module loading). Call it before this rank's ring can be waited on, e.g. while
// the communicator is built. Idempotent and cheap: the work is done once per device and
// process; later calls return at once. Thread-safe. Throws ringcoll::Error on a CUDA error.
void preload_ring_kernels();

}  // namespace ringcoll::cuda
