// strip.h: how a GPU kernel divides one chunk slice among its thread blocks, and how one
// block's strip divides into 16-byte vectors and scalar leftovers. Written once, used by
// the CUDA kernels (csrc/cuda/ring_kernels.cu) and exposed to Python through host-callable
// twins (ringcoll._C.strip), so tests/test_kernel_logic.py checks the very code the GPU runs.
//
// Strips. A slice of `len` elements is cut into `blocks` strips, block b taking
//
//     [ min(len, U_b * g), min(len, U_{b+1} * g) )     U_b = chunk_begin(ceil(len / g), blocks, b)
//
// where g = 16 / sizeof(T) elements is one 16-byte granule: strips are balanced to within a
// granule (plus the partial granule at the end of the slice) and every strip but the last starts and ends on a granule boundary, so a block's
// strip is 16-byte aligned whenever the slice start is.
//
// Vector split. A strip whose pointers all sit at the same offset modulo 16 (a multiple of
// the element size) is done as: `head` scalar elements until the pointers reach a 16-byte
// boundary, `vec` elements in 16-byte loads/stores, `tail` scalar elements. Pointers that
// disagree modulo 16 cannot be vectorised together: all `head`, no vectors.
#pragma once

#include "ringcoll/platform.h"
#include "ringcoll/ring.h"

namespace ringcoll {

constexpr int kVectorBytes = 16;

RINGCOLL_INLINE int64_t strip_granule(int elem_size) {
  return elem_size >= kVectorBytes ? 1 : kVectorBytes / elem_size;
}

// First element of block `block`'s strip of a `len`-element slice; block == blocks gives len.
RINGCOLL_INLINE int64_t strip_begin(int64_t len, int blocks, int block, int elem_size) {
  const int64_t g = strip_granule(elem_size);
  const int64_t units = (len + g - 1) / g;
  const int64_t begin = chunk_begin(units, blocks, block) * g;
  return begin < len ? begin : len;
}
RINGCOLL_INLINE int64_t strip_end(int64_t len, int blocks, int block, int elem_size) {
  return strip_begin(len, blocks, block + 1, elem_size);
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
