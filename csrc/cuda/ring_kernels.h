// ring_kernels.h: what cuda_comm.cu hands the ring kernels (ring_kernels.cu).
#pragma once

#include <cstdint>

#include "cuda_comm.h"

namespace ringcoll::cuda {

struct RingParams {
  char* my_base;            // my IPC allocation (flags, then data)
  const char* left_base;    // my left neighbour's, mapped here
  const char* right_base;   // my right neighbour's (only its consumed flags are read)
  uint64_t* state;          // kMaxBlocks x kStateWords, private
  ErrorRecord* errors;      // kMaxBlocks records, host-mapped
  const void* input;
  void* output;
  int64_t count;            // whole message (ring_loop.h's `count`), in elements of the kernel's type
  int64_t slot_bytes;
  uint64_t timeout_ns;
  int rank, world;
  int collective;           // ringcoll::Collective
};

// Launch the ring for (dtype, op) on `stream` (a cudaStream_t) with `blocks` thread blocks;
// vectorised 16-byte copies when `vectorise`. All-gather ignores dtype and op (bytes).
void launch_ring(const RingParams& params, int dtype, int op, int blocks, bool vectorise, void* stream);

}  // namespace ringcoll::cuda
