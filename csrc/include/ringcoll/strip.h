// strip.h: how a GPU kernel divides one chunk slice among its thread blocks, and how each
// piece divides into 16-byte vectors and scalar leftovers. Written once, used by the CUDA
// kernels (csrc/cuda/device_ring.h) and exposed to Python through host-callable twins
// (ringcoll._C.strip), so tests/pure/test_kernel_logic.py checks the very code the GPU runs.
//
// Tiles. A slice is cut into tiles of kTileBytes (kVectorsInFlight 16-byte vectors per
// thread of a 512-thread block, so one tile is one batch of loads per thread, which
// device_ring.h issues before any store); tile t is [t*E, min(len, (t+1)*E)) for E = kTileBytes / elem_size,
// and block b does tiles b, b + blocks, b + 2*blocks, ... So which block touches element i
// of a slot depends on i alone, never on the length of the slice in it. That matters: a
// block waits only for its own neighbour block to have consumed a slot before refilling
// it, which is safe only if no other block wrote or reads those elements in any earlier
// use of the slot (with a longer or shorter slice, or another call). Every tile starts
// 16-byte aligned whenever the slice does.
//
// Vector split. A piece whose pointers all sit at the same offset modulo 16 (a multiple of
// the element size) is done as: `head` scalar elements until the pointers reach a 16-byte
// boundary, `vec` elements in 16-byte loads/stores, `tail` scalar elements. Pointers that
// disagree modulo 16 cannot be vectorised together: all `head`, no vectors.
#pragma once

#include "ringcoll/platform.h"
#include "ringcoll/ring.h"

namespace ringcoll {

constexpr int kVectorBytes = 16;
// Independent 16-byte loads a GPU thread keeps in flight before it stores (device_ring.h):
// enough, with a block per SM, to cover memory latency at HBM bandwidth (docs/cuda.md).
constexpr int kVectorsInFlight = 4;
constexpr int kTileThreads = 512;  // the fused kernel's block size (ring_kernels.cu)
constexpr int64_t kTileBytes = int64_t{kTileThreads} * kVectorBytes * kVectorsInFlight;  // 32 KiB

RINGCOLL_INLINE int64_t tile_elems(int elem_size) { return kTileBytes / elem_size; }
RINGCOLL_INLINE int64_t tile_count(int64_t len, int elem_size) {
  return (len + tile_elems(elem_size) - 1) / tile_elems(elem_size);
}
RINGCOLL_INLINE int64_t tile_begin(int64_t tile, int elem_size) { return tile * tile_elems(elem_size); }
RINGCOLL_INLINE int64_t tile_end(int64_t len, int64_t tile, int elem_size) {
  const int64_t end = (tile + 1) * tile_elems(elem_size);
  return end < len ? end : len;
}

struct VectorSplit {
  int64_t head;  // scalar elements before the first 16-byte boundary
  int64_t vec;   // elements moved in 16-byte vectors (a multiple of 16 / elem_size)
  int64_t tail;  // scalar elements after the last whole vector
};

// Split `len` elements of size `elem_size` whose pointers are a, b, c, d (0 = unused).
RINGCOLL_INLINE VectorSplit vector_split(int64_t len, int elem_size, uintptr_t a, uintptr_t b = 0,
                                         uintptr_t c = 0, uintptr_t d = 0) {
  const uintptr_t ptrs[4] = {a, b, c, d};
  int misalign = -1;
  bool agree = elem_size <= kVectorBytes && kVectorBytes % elem_size == 0;
  for (int i = 0; i < 4; ++i) {
    if (ptrs[i] == 0) continue;
    const int m = static_cast<int>(ptrs[i] % kVectorBytes);
    if (misalign < 0) misalign = m;
    else if (m != misalign) agree = false;
  }
  if (misalign < 0) misalign = 0;
  if (!agree || misalign % elem_size != 0) return VectorSplit{len, 0, 0};
  int64_t head = ((kVectorBytes - misalign) % kVectorBytes) / elem_size;
  if (head > len) head = len;
  const int64_t per_vector = kVectorBytes / elem_size;
  const int64_t vec = (len - head) / per_vector * per_vector;
  return VectorSplit{head, vec, len - head - vec};
}

}  // namespace ringcoll
