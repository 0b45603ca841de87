// reduce.h: how two contributions combine. One functor per reduction op, one storage type
// per dtype, usable on host and device.
//
// Rules (the same as torch's, so results can be compared bit for bit):
//   * float16 / bfloat16 are widened to float, combined, and rounded back to nearest-even,
//     one rounding per combine, as torch does for `a + b` on half tensors.
//   * integers wrap on overflow (torch's behaviour); the arithmetic is done on the unsigned
//     type because signed overflow is undefined in C++.
//   * MIN / MAX propagate NaN, like torch.minimum / torch.maximum; for 16-bit floats a NaN
//     `a` is the result of every op (nan_a_wins), so the NaN's bits are defined too.
//   * AVG is SUM followed by one division by the world size at the end (finalize), for
//     floating types only.
#pragma once

#include <type_traits>

#include "ringcoll/platform.h"

namespace ringcoll {

// ---------------------------------------------------------------------------------------
// 16-bit floating storage types. Plain structs holding the bits, so the same code compiles
// with g++ and nvcc without cuda_fp16.h; conversions are written out to show the rounding.

struct Half { uint16_t bits; };
struct BFloat16 { uint16_t bits; };

// ---------------------------------------------------------------------------------------
// The dtypes, listed once: X(enumerator, name, code, storage type, is_floating). Names are
// torch's spellings, codes what Python passes (never renumber: append). Whatever in C++
// names, sizes or dispatches on a dtype expands this list; Python reads it as
// ringcoll._C.dtype_table.
#define RINGCOLL_DTYPES(X)                    \
  X(kFloat32, "float32", 0, float, true)      \
  X(kFloat64, "float64", 1, double, true)     \
  X(kFloat16, "float16", 2, Half, true)       \
  X(kBFloat16, "bfloat16", 3, BFloat16, true) \
  X(kInt8, "int8", 4, int8_t, false)          \
  X(kUInt8, "uint8", 5, uint8_t, false)       \
  X(kInt32, "int32", 6, int32_t, false)       \
  X(kInt64, "int64", 7, int64_t, false)

enum class DType : int {
#define RINGCOLL_DTYPE_ENUMERATOR(e, name, code, T, floating) e = code,
  RINGCOLL_DTYPES(RINGCOLL_DTYPE_ENUMERATOR)
#undef RINGCOLL_DTYPE_ENUMERATOR
};

#define RINGCOLL_DTYPE_CODE(e, name, code, T, floating) code,
constexpr int kDTypeCodes[] = {RINGCOLL_DTYPES(RINGCOLL_DTYPE_CODE)};
#undef RINGCOLL_DTYPE_CODE
constexpr int kNumDTypes = sizeof(kDTypeCodes) / sizeof(kDTypeCodes[0]);
// Code c is entry c of the list, so a dtype code can index a table.
constexpr bool dtype_codes_in_order(int i = 0) {
  return i == kNumDTypes || (kDTypeCodes[i] == i && dtype_codes_in_order(i + 1));
}
static_assert(dtype_codes_in_order(), "RINGCOLL_DTYPES: codes must run 0, 1, 2, ... in list order");

struct DTypeInfo {
  const char* name;
  int size_bytes;
  bool is_floating;
};
RINGCOLL_INLINE DTypeInfo dtype_info(DType d) {
  switch (d) {
#define RINGCOLL_DTYPE_INFO(e, name, code, T, floating) \
  case DType::e: return DTypeInfo{name, static_cast<int>(sizeof(T)), floating};
    RINGCOLL_DTYPES(RINGCOLL_DTYPE_INFO)
#undef RINGCOLL_DTYPE_INFO
  }
  return DTypeInfo{"unknown dtype", 0, false};
}
RINGCOLL_INLINE int dtype_size(DType d) { return dtype_info(d).size_bytes; }
RINGCOLL_INLINE bool dtype_is_floating(DType d) { return dtype_info(d).is_floating; }

enum class ReduceOp : int { kSum = 0, kProduct = 1, kMin = 2, kMax = 3, kAvg = 4 };
constexpr int kNumReduceOps = 5;

RINGCOLL_INLINE uint32_t float_bits(float f) {
  union { float f; uint32_t u; } v{f};
  return v.u;
}
RINGCOLL_INLINE float bits_float(uint32_t u) {
  union { uint32_t u; float f; } v{u};
  return v.f;
}

RINGCOLL_INLINE float to_float(BFloat16 x) { return bits_float(static_cast<uint32_t>(x.bits) << 16); }
RINGCOLL_INLINE BFloat16 bfloat16_from_float(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BFloat16{static_cast<uint16_t>((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return BFloat16{static_cast<uint16_t>(u >> 16)};
}

RINGCOLL_INLINE float to_float(Half x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t exp = (x.bits >> 10) & 0x1fu;
  uint32_t mant = x.bits & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_float(sign);  // signed zero
  // Subnormal half: value = mant * 2^-24, exact in float.
  const float magnitude = static_cast<float>(mant) * 5.9604644775390625e-08f;
  return sign ? -magnitude : magnitude;
}
RINGCOLL_INLINE Half half_from_float(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return Half{static_cast<uint16_t>(sign | 0x7e00u)};  // NaN
  if (abs >= 0x477ff000u) return Half{static_cast<uint16_t>(sign | 0x7c00u)};  // rounds to inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero) in half: value / 2^-24, rounded to nearest-even.
    // Adding 0.5 (2^-1) in float aligns the bits so the FPU does the rounding for us.
    const float scaled = bits_float(abs) + 0.5f;
    return Half{static_cast<uint16_t>(sign | static_cast<uint16_t>(float_bits(scaled) - 0x3f000000u))};
  }
  // Normal: rebias exponent (127 -> 15) and round the 13 dropped mantissa bits.
  uint32_t r = abs - (112u << 23);
  r += 0xfffu + ((r >> 13) & 1u);
  return Half{static_cast<uint16_t>(sign | (r >> 13))};
}

// ---------------------------------------------------------------------------------------
// Compute type: what a combine is done in. Float for 16-bit floats, the type itself else.

template <typename T> struct Compute { using type = T; };
template <> struct Compute<Half> { using type = float; };
template <> struct Compute<BFloat16> { using type = float; };

template <typename T> RINGCOLL_INLINE typename Compute<T>::type widen(T x) { return x; }
RINGCOLL_INLINE float widen(Half x) { return to_float(x); }
RINGCOLL_INLINE float widen(BFloat16 x) { return to_float(x); }

template <typename T> RINGCOLL_INLINE T narrow(typename Compute<T>::type x) { return x; }
template <> RINGCOLL_INLINE Half narrow<Half>(float x) { return half_from_float(x); }
template <> RINGCOLL_INLINE BFloat16 narrow<BFloat16>(float x) { return bfloat16_from_float(x); }

// Wrapping integer arithmetic via the unsigned type (well defined), plain for floats.
template <typename C> RINGCOLL_INLINE C wrap_add(C a, C b) {
  if constexpr (std::is_integral_v<C>) {
    using U = std::make_unsigned_t<C>;
    return static_cast<C>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}
template <typename C> RINGCOLL_INLINE C wrap_mul(C a, C b) {
  if constexpr (std::is_integral_v<C>) {
    // Promote to at least unsigned int: uint8/uint16 would promote to (signed) int first.
    using U = std::conditional_t<(sizeof(C) < sizeof(unsigned)), unsigned, std::make_unsigned_t<C>>;
    return static_cast<C>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
  } else {
    return a * b;
  }
}
template <typename C> RINGCOLL_INLINE bool is_nan(C x) {
  if constexpr (std::is_floating_point_v<C>) return x != x;
  else return false;
}

// ---------------------------------------------------------------------------------------
// The op functors: combine(a, b) in the compute type; finalize(x, world) after the last
// combine (identity except for AVG).

struct SumOp {
  template <typename C> RINGCOLL_INLINE static C combine(C a, C b) { return wrap_add(a, b); }
  template <typename C> RINGCOLL_INLINE static C finalize(C x, int) { return x; }
};
struct ProductOp {
  template <typename C> RINGCOLL_INLINE static C combine(C a, C b) { return wrap_mul(a, b); }
  template <typename C> RINGCOLL_INLINE static C finalize(C x, int) { return x; }
};
struct MinOp {
  template <typename C> RINGCOLL_INLINE static C combine(C a, C b) {
    return is_nan(a) ? a : (is_nan(b) ? b : (b < a ? b : a));
  }
  template <typename C> RINGCOLL_INLINE static C finalize(C x, int) { return x; }
};
struct MaxOp {
  template <typename C> RINGCOLL_INLINE static C combine(C a, C b) {
    return is_nan(a) ? a : (is_nan(b) ? b : (a < b ? b : a));
  }
  template <typename C> RINGCOLL_INLINE static C finalize(C x, int) { return x; }
};
struct AvgOp {
  template <typename C> RINGCOLL_INLINE static C combine(C a, C b) { return a + b; }
  // Divide (not multiply by 1/P) so the result matches torch's `sum / P` bit for bit.
  template <typename C> RINGCOLL_INLINE static C finalize(C x, int world) { return x / static_cast<C>(world); }
};

// Which NaN comes out when both operands are NaN: IEEE lets `a + b` return either, and
// compilers swap the operands of a commutative operation freely, so one source line can give
// different NaN bits at different call sites (a loop's vectorised body and its scalar tail,
// say). For float16 / bfloat16, whose host loop has a second, vectorised path that must match
// the scalar one bit for bit (host_vector16.h), the rule is pinned: a NaN `a` is the result,
// as MIN / MAX already have it; narrow() quiets it. One NaN operand gave that NaN anyway.
template <typename T, typename C>
RINGCOLL_INLINE C nan_a_wins(C a, C result) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
    // A mask, not `is_nan(a) ? a : result`: GCC does not if-convert a float compare, and
    // the branch would keep it from vectorising the scalar loop.
    const uint32_t a_is_nan = 0u - static_cast<uint32_t>(is_nan(a));
    return bits_float((float_bits(a) & a_is_nan) | (float_bits(result) & ~a_is_nan));
  } else {
    return result;
  }
}

// One element: a (received partial) op b (own contribution), rounded once to storage.
template <typename T, class Op>
RINGCOLL_INLINE T combine_element(T a, T b) {
  const auto x = widen(a);
  return narrow<T>(nan_a_wins<T>(x, Op::combine(x, widen(b))));
}
// The last combine of a chunk: rounding happens once, after finalize.
template <typename T, class Op>
RINGCOLL_INLINE T combine_final_element(T a, T b, int world) {
  const auto x = widen(a);
  return narrow<T>(nan_a_wins<T>(x, Op::finalize(Op::combine(x, widen(b)), world)));
}
template <typename T, class Op>
RINGCOLL_INLINE T finalize_element(T x, int world) {
  return narrow<T>(Op::finalize(widen(x), world));
}

// ---------------------------------------------------------------------------------------
// Runtime (dtype, op) -> template dispatch, in one place. `fn` is a generic lambda taking
// (T{}, Op{}) tag values; AVG on integers never reaches here (validated in Python and by
// is_supported below).

RINGCOLL_INLINE bool is_supported(DType d, ReduceOp op) {
  return static_cast<int>(d) >= 0 && static_cast<int>(d) < kNumDTypes && static_cast<int>(op) >= 0 &&
         static_cast<int>(op) < kNumReduceOps && (op != ReduceOp::kAvg || dtype_is_floating(d));
}

// AVG exists for floating types only: integer types never instantiate AvgOp.
template <typename T, bool kFloating, typename Fn>
decltype(auto) dispatch_op(ReduceOp op, Fn&& fn) {
  switch (op) {
    case ReduceOp::kSum: return fn(T{}, SumOp{});
    case ReduceOp::kProduct: return fn(T{}, ProductOp{});
    case ReduceOp::kMin: return fn(T{}, MinOp{});
    case ReduceOp::kMax: break;
    default:
      if constexpr (kFloating) return fn(T{}, AvgOp{});
  }
  return fn(T{}, MaxOp{});
}
template <typename Fn>
decltype(auto) dispatch_dtype_op(DType d, ReduceOp op, Fn&& fn) {
  switch (d) {
#define RINGCOLL_DTYPE_DISPATCH(e, name, code, T, floating) \
  case DType::e: return dispatch_op<T, floating>(op, fn);
    RINGCOLL_DTYPES(RINGCOLL_DTYPE_DISPATCH)
#undef RINGCOLL_DTYPE_DISPATCH
  }
  return dispatch_op<int64_t, false>(op, fn);  // not a dtype: never reached (is_supported)
}

}  // namespace ringcoll
