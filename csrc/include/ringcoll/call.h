// call.h: how a collective call becomes ring work, written once for the three transports
// (host shared memory, CUDA IPC, the CPU emulator of the CUDA kernels).
//
// Two counts, never to be confused:
//   user_count  what the caller passes: elements of the all-reduce tensor, of the
//               reduce-scatter output, of the all-gather input (per rank)
//   ring_count  the whole message the ring cuts into P chunks (ring_loop.h's `count`), in
//               elements of the type the ring moves
//
// The registered buffer of every rank is kBanks x P slots, each slot a multiple of the
// transport's slot alignment (64 bytes on the host: a cache line; 128 on the GPU).
#pragma once

#include <cstddef>

#include "ringcoll/platform.h"

namespace ringcoll {

constexpr int kBanks = 2;  // double buffering: slice j+1 fills one bank while slice j is read

// Bytes of one slot when `buffer_bytes` is shared by kBanks x world slots.
RINGCOLL_INLINE size_t slot_bytes_for(size_t buffer_bytes, int world, size_t slot_alignment) {
  const size_t per_slot = buffer_bytes / (static_cast<size_t>(kBanks) * static_cast<size_t>(world));
  return per_slot / slot_alignment * slot_alignment;
}

// The smallest buffer_bytes a transport accepts: one aligned slot per bank and rank.
RINGCOLL_INLINE size_t min_buffer_bytes(int world, size_t slot_alignment) {
  return static_cast<size_t>(kBanks) * slot_alignment * static_cast<size_t>(world);
}

}  // namespace ringcoll
