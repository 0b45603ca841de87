// host_vector16.h: the host's vector reduce loops, chosen at run time: mostly the float16 /
// bfloat16 loop (the wider dtypes' AVX2 loop is at the end), 16 elements at a time with
// AVX2 and F16C (two 8-lane halves) or AVX-512 (one 16-lane vector). The
// scalar loop in host_strip.h stays the reference: this one must give its bits exactly,
// for every input (tests/pure/test_reduce.py checks it).
//
// Why. The wheel is built for plain x86-64 (SSE2), where GCC cannot vectorise reduce.h's
// branchy float16 conversions at all, and bfloat16 only in part; a 16-bit all-reduce then
// cost several times float32's time per byte, though both are memory bound. So these few
// functions alone are compiled for AVX2 + F16C (a target attribute, not a flag for the
// whole file, so no AVX2 code can leak into code run on older CPUs), and used only where
// the CPU has both (vector16_supported); the AVX-512 twin of each step, where the CPU has
// AVX-512F too (vector16_avx512_supported), halves the instructions per element. Both
// give the scalar loop's bits; tests compare each ISA with it (VectorIsa).
//
// The algorithm, per block of 16 elements, the same three steps as combine_element:
//   1. widen both operands to float, exactly: float16 by VCVTPH2PS; bfloat16 by putting
//      its bits in the top half of a 32-bit lane;
//   2. combine (and finalize) in float with the same IEEE operations the scalar code uses,
//      so the same rounding: add, mul, div by `world`. MIN/MAX: VMINPS(b, a) is exactly
//      `b < a ? b : a` (it returns its second operand on ties, -0 vs 0, and NaNs), which
//      leaves one case to fix: b NaN, where reduce.h returns b. Then reduce.h's
//      nan_a_wins: a NaN `a` replaces the result;
//   3. round to storage, nearest-even, once: float16 by VCVTPS2PH, whose NaN keeps payload
//      bits that half_from_float drops (it returns sign | 0x7e00), so those are cleared
//      in NaN lanes; bfloat16 by reduce.h's own integer rounding, lane by lane.
// Every other NaN comes from the same hardware operations as in the scalar code (one NaN
// operand: that NaN, quieted; invalid operations: x86's default NaN), so its bits match.
// The loop leaves the last len % 16 elements to the scalar loop.
#pragma once

#include <cstdint>

#include "ringcoll/reduce.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ringcoll::host {

// The scalar loop, the reference: out[i] (and out2[i], if out2) = recv[i] op own[i] for i
// in [from, len), finalized when kFinal. Always inlined, so that a caller compiled for
// another target (reduce_wide_avx2 below) compiles this very loop for that target.
template <typename T, class Op, bool kFinal>
__attribute__((always_inline)) inline void reduce_scalar(T* out, T* out2, const T* recv, const T* own, int64_t from,
                                                         int64_t len, int world) {
  auto value = [world](T a, T b) __attribute__((always_inline)) {
    if constexpr (kFinal) return combine_final_element<T, Op>(a, b, world);
    else return combine_element<T, Op>(a, b);
  };
  if (out2 != nullptr) {
    for (int64_t i = from; i < len; ++i) out[i] = out2[i] = value(recv[i], own[i]);
  } else {
    for (int64_t i = from; i < len; ++i) out[i] = value(recv[i], own[i]);
  }
}

#if defined(__x86_64__)

// Checked once: __builtin_cpu_init first, since this may run before libgcc's constructor.
// (libgcc's avx512f also checks that the OS saves the ZMM registers.)
inline bool vector16_supported() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  }();
  return supported;
}
inline bool vector16_avx512_supported() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return vector16_supported() && __builtin_cpu_supports("avx512f");
  }();
  return supported;
}
inline const char* host_vector_isa() {
  return vector16_avx512_supported() ? "avx512f" : vector16_supported() ? "avx2+f16c" : "none";
}

#define RINGCOLL_AVX2_F16C __attribute__((target("avx2,f16c")))

namespace v16 {

// Elements go 16 at a time, as two vectors of 8 floats (lo, hi): which element sits in
// which lane is widen16's business, and narrow16 puts them back.

// Step 1: 16 storage values -> 2 x 8 floats, exactly. bfloat16: interleaving zeros below
// each value is the shift by 16; it takes elements 0-3 and 8-11 to lo, 4-7 and 12-15 to hi.
struct Pair { __m256 lo, hi; };
RINGCOLL_AVX2_F16C inline Pair widen16(const Half* p) {
  const auto* q = reinterpret_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(q)), _mm256_cvtph_ps(_mm_loadu_si128(q + 1))};
}
RINGCOLL_AVX2_F16C inline Pair widen16(const BFloat16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  return {_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v)), _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v))};
}

// Step 3: 2 x 8 floats -> 16 storage values, as half_from_float / bfloat16_from_float do.
RINGCOLL_AVX2_F16C inline void narrow16(Half* p, Pair x) {
  const __m256i h = _mm256_set_m128i(_mm256_cvtps_ph(x.hi, _MM_FROUND_TO_NEAREST_INT),
                                     _mm256_cvtps_ph(x.lo, _MM_FROUND_TO_NEAREST_INT));
  // A NaN keeps 9 payload bits below the quiet bit; half_from_float clears them.
  const __m256i is_nan = _mm256_cmpgt_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)), _mm256_set1_epi16(0x7c00));
  const __m256i payload = _mm256_and_si256(is_nan, _mm256_set1_epi16(0x01ff));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_andnot_si256(payload, h));
}
// bfloat16_from_float on 8 lanes, the result in the low 16 bits of each.
RINGCOLL_AVX2_F16C inline __m256i bfloat16_lanes(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
  const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));  // the 0x40 of the top half
  const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_srli_epi32(_mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded),
                                                                _mm256_castsi256_ps(quiet), is_nan)), 16);
}
RINGCOLL_AVX2_F16C inline void narrow16(BFloat16* p, Pair x) {
  // Lanes hold 0..0xffff, so the unsigned-saturating pack is exact; it undoes widen16's order.
  const __m256i packed = _mm256_packus_epi32(bfloat16_lanes(x.lo), bfloat16_lanes(x.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
}

// Step 2: reduce.h's functors on 8 lanes; a is the received partial, b the own value.
RINGCOLL_AVX2_F16C inline __m256 is_nan8(__m256 x) { return _mm256_cmp_ps(x, x, _CMP_UNORD_Q); }
RINGCOLL_AVX2_F16C inline __m256 combine8(SumOp, __m256 a, __m256 b) { return _mm256_add_ps(a, b); }
RINGCOLL_AVX2_F16C inline __m256 combine8(AvgOp, __m256 a, __m256 b) { return _mm256_add_ps(a, b); }
RINGCOLL_AVX2_F16C inline __m256 combine8(ProductOp, __m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
RINGCOLL_AVX2_F16C inline __m256 combine8(MinOp, __m256 a, __m256 b) {
  return _mm256_blendv_ps(_mm256_min_ps(b, a), b, is_nan8(b));
}
RINGCOLL_AVX2_F16C inline __m256 combine8(MaxOp, __m256 a, __m256 b) {
  return _mm256_blendv_ps(_mm256_max_ps(b, a), b, is_nan8(b));
}
template <class Op> RINGCOLL_AVX2_F16C inline __m256 finalize8(Op, __m256 x, __m256) { return x; }
RINGCOLL_AVX2_F16C inline __m256 finalize8(AvgOp, __m256 x, __m256 world) { return _mm256_div_ps(x, world); }

}  // namespace v16

// One combine on 8 lanes, as combine_element / combine_final_element.
template <class Op, bool kFinal>
RINGCOLL_AVX2_F16C inline __m256 value8(__m256 a, __m256 b, __m256 world) {
  __m256 x = v16::combine8(Op{}, a, b);
  if constexpr (kFinal) x = v16::finalize8(Op{}, x, world);
  return _mm256_blendv_ps(x, a, v16::is_nan8(a));  // nan_a_wins
}
// out[i] (and out2[i], if out2) = recv[i] op own[i] for i < len - len % 16; returns that
// count. `own` may be `out` itself: each block is read before it is written.
template <typename T, class Op, bool kFinal>
RINGCOLL_AVX2_F16C int64_t reduce16_avx2(T* out, T* out2, const T* recv, const T* own, int64_t len, int world) {
  const __m256 w = _mm256_set1_ps(static_cast<float>(world));
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const v16::Pair a = v16::widen16(recv + i), b = v16::widen16(own + i);
    const v16::Pair x = {value8<Op, kFinal>(a.lo, b.lo, w), value8<Op, kFinal>(a.hi, b.hi, w)};
    v16::narrow16(out + i, x);
    if (out2 != nullptr) v16::narrow16(out2 + i, x);
  }
  return i;
}

#undef RINGCOLL_AVX2_F16C

// The same three steps on one 16-lane vector. Masks replace blends; the rest is the AVX2
// code's operation for operation, so the same bits.
#define RINGCOLL_AVX512 __attribute__((target("avx512f,avx2,f16c")))

namespace v16x1 {

// Step 1: 16 storage values -> 16 floats, in element order.
RINGCOLL_AVX512 inline __m512 widen16(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
RINGCOLL_AVX512 inline __m512 widen16(const BFloat16* p) {
  const __m512i lanes = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(lanes, 16));
}
// Step 3: as v16::narrow16.
RINGCOLL_AVX512 inline void narrow16(Half* p, __m512 x) {
  const __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
  const __m256i is_nan = _mm256_cmpgt_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)), _mm256_set1_epi16(0x7c00));
  const __m256i payload = _mm256_and_si256(is_nan, _mm256_set1_epi16(0x01ff));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_andnot_si256(payload, h));
}
RINGCOLL_AVX512 inline void narrow16(BFloat16* p, __m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  const __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x400000));
  const __m512i bits = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), quiet);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

// Step 2: as v16's functors.
RINGCOLL_AVX512 inline __mmask16 is_nan16(__m512 x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); }
RINGCOLL_AVX512 inline __m512 combine16(SumOp, __m512 a, __m512 b) { return _mm512_add_ps(a, b); }
RINGCOLL_AVX512 inline __m512 combine16(AvgOp, __m512 a, __m512 b) { return _mm512_add_ps(a, b); }
RINGCOLL_AVX512 inline __m512 combine16(ProductOp, __m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
RINGCOLL_AVX512 inline __m512 combine16(MinOp, __m512 a, __m512 b) {
  return _mm512_mask_mov_ps(_mm512_min_ps(b, a), is_nan16(b), b);
}
RINGCOLL_AVX512 inline __m512 combine16(MaxOp, __m512 a, __m512 b) {
  return _mm512_mask_mov_ps(_mm512_max_ps(b, a), is_nan16(b), b);
}
template <class Op> RINGCOLL_AVX512 inline __m512 finalize16(Op, __m512 x, __m512) { return x; }
RINGCOLL_AVX512 inline __m512 finalize16(AvgOp, __m512 x, __m512 world) { return _mm512_div_ps(x, world); }

}  // namespace v16x1

template <typename T, class Op, bool kFinal>
RINGCOLL_AVX512 int64_t reduce16_avx512(T* out, T* out2, const T* recv, const T* own, int64_t len, int world) {
  const __m512 w = _mm512_set1_ps(static_cast<float>(world));
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m512 a = v16x1::widen16(recv + i), b = v16x1::widen16(own + i);
    __m512 x = v16x1::combine16(Op{}, a, b);
    if constexpr (kFinal) x = v16x1::finalize16(Op{}, x, w);
    x = _mm512_mask_mov_ps(x, v16x1::is_nan16(a), a);  // nan_a_wins
    v16x1::narrow16(out + i, x);
    if (out2 != nullptr) v16x1::narrow16(out2 + i, x);
  }
  return i;
}

#undef RINGCOLL_AVX512

// Every other dtype (float32, float64, the integers): the scalar loop itself (reduce_scalar),
// compiled a second time for AVX2, which GCC vectorises 32 bytes at a time where the x86-64
// build has SSE2's 16 (float32 sum of two 16 MiB arrays in place on this project's AMD VM:
// 2.7 ms SSE2, 1.7 ms so, as torch.add). Each element gets the same IEEE operations, so the
// same bits as the scalar loop (the target names AVX2 alone: no FMA, nothing contracted),
// but for which of two NaNs a sum returns, which IEEE leaves open and these types do not pin.
inline bool avx2_supported() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
  }();
  return supported;
}

template <typename T, class Op, bool kFinal>
__attribute__((target("avx2"))) int64_t reduce_wide_avx2(T* out, T* out2, const T* recv, const T* own,
                                                         int64_t len, int world) {
  reduce_scalar<T, Op, kFinal>(out, out2, recv, own, 0, len, world);
  return len;
}

#else  // not x86-64: the scalar loop only

inline bool vector16_supported() { return false; }
inline bool vector16_avx512_supported() { return false; }
inline bool avx2_supported() { return false; }
inline const char* host_vector_isa() { return "none"; }

#endif

// Which vector loop reduce_strip may use: the best the CPU has (what the rings run), or,
// for tests, one ISA (if the CPU has it; else none) or none (the scalar reference).
enum class VectorIsa { kBest, kAvx512, kAvx2, kNone };

// The entry point for host_strip.h: how many leading elements the vector path did (0 on
// other CPUs, or with VectorIsa::kNone; the wider dtypes have no AVX-512 loop: kAvx512
// gives them the scalar one).
template <typename T, class Op, bool kFinal>
inline int64_t reduce_strip_vector(T* out, T* out2, const T* recv, const T* own, int64_t len, int world,
                                   VectorIsa isa) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
    const bool best = isa == VectorIsa::kBest;
    if ((best || isa == VectorIsa::kAvx512) && vector16_avx512_supported())
      return reduce16_avx512<T, Op, kFinal>(out, out2, recv, own, len, world);
    if ((best || isa == VectorIsa::kAvx2) && vector16_supported())
      return reduce16_avx2<T, Op, kFinal>(out, out2, recv, own, len, world);
  } else if ((isa == VectorIsa::kBest || isa == VectorIsa::kAvx2) && avx2_supported()) {
    return reduce_wide_avx2<T, Op, kFinal>(out, out2, recv, own, len, world);
  }
#endif
  (void)out, (void)out2, (void)recv, (void)own, (void)len, (void)world, (void)isa;
  return 0;
}

}  // namespace ringcoll::host
