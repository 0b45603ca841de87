// collectives.h: the collectives, listed once (beside RINGCOLL_DTYPES in reduce.h).
//
// Everything that names a collective reads this table: the enum and the descriptor's
// codes here, the error messages (descriptor.h), the bindings, and Python through
// `_C.collective_table` (ringcoll/_types.py: COLLECTIVE_CODES, and from there the
// schedule, the trace, the emulated transport, the model, the benchmark and the fuzzer).
//
//   X(enumerator, name, code, reduces, moves_data)
//     name        what Python and error messages call it
//     code        its number in a CallDescriptor (the order of the list: 0, 1, 2, ...)
//     reduces     combines the ranks' contributions with an op (else it only moves bytes)
//     moves_data  has a message at all (barrier has none)
#pragma once

#if !defined(__CUDA_ARCH__)
#include <optional>
#include <string>
#endif

#include "ringcoll/platform.h"

// The built-in algorithms (plan.h's generators), listed once the same way:
//   X(enumerator, name, code, all_reduce_only)
//     code             what a call's descriptor carries (0: the default path; plans
//                      written in Python take codes from 1000 on)
//     all_reduce_only  the algorithm has no reduce-scatter or all-gather (one whole-message
//                      chunk: recursive doubling, the tree)
#define RINGCOLL_ALGORITHMS(X)             \
  X(kRing, "ring", 1, false)               \
  X(kOneShot, "oneshot", 2, false)         \
  X(kHalvingDoubling, "rhd", 3, false)     \
  X(kRecursiveDoubling, "rd", 4, true)     \
  X(kTree, "tree", 5, true)

#define RINGCOLL_COLLECTIVES(X)                             \
  X(kAllReduce, "all_reduce", 0, true, true)                \
  X(kReduceScatter, "reduce_scatter", 1, true, true)        \
  X(kAllGather, "all_gather", 2, false, true)               \
  X(kBarrier, "barrier", 3, false, false)

namespace ringcoll {

enum class Collective : int {
#define RINGCOLL_COLLECTIVE_ENUMERATOR(e, name, code, reduces, moves_data) e = code,
  RINGCOLL_COLLECTIVES(RINGCOLL_COLLECTIVE_ENUMERATOR)
#undef RINGCOLL_COLLECTIVE_ENUMERATOR
};

#define RINGCOLL_COLLECTIVE_CODE(e, name, code, reduces, moves_data) code,
constexpr int kCollectiveCodes[] = {RINGCOLL_COLLECTIVES(RINGCOLL_COLLECTIVE_CODE)};
#undef RINGCOLL_COLLECTIVE_CODE
constexpr int kNumCollectives = sizeof(kCollectiveCodes) / sizeof(kCollectiveCodes[0]);
constexpr bool collective_codes_in_order(int i = 0) {
  return i == kNumCollectives || (kCollectiveCodes[i] == i && collective_codes_in_order(i + 1));
}
static_assert(collective_codes_in_order(), "RINGCOLL_COLLECTIVES: codes must run 0, 1, 2, ... in list order");

struct CollectiveInfo {
  const char* name;
  bool reduces;
  bool moves_data;
};

RINGCOLL_INLINE CollectiveInfo collective_info(Collective c) {
  switch (c) {
#define RINGCOLL_COLLECTIVE_INFO(e, name, code, reduces, moves_data) \
  case Collective::e: return CollectiveInfo{name, reduces, moves_data};
    RINGCOLL_COLLECTIVES(RINGCOLL_COLLECTIVE_INFO)
#undef RINGCOLL_COLLECTIVE_INFO
  }
  return CollectiveInfo{"unknown collective", false, false};
}

enum class Algorithm : int {
#define RINGCOLL_ALGORITHM_ENUMERATOR(e, name, code, all_reduce_only) e = code,
  RINGCOLL_ALGORITHMS(RINGCOLL_ALGORITHM_ENUMERATOR)
#undef RINGCOLL_ALGORITHM_ENUMERATOR
};
constexpr int kFirstUserPlanCode = 1000;

// The name of a built-in algorithm's code, or null for any other code.
RINGCOLL_INLINE const char* algorithm_name(int code) {
  switch (code) {
#define RINGCOLL_ALGORITHM_NAME(e, name, c, all_reduce_only) \
  case c: return name;
    RINGCOLL_ALGORITHMS(RINGCOLL_ALGORITHM_NAME)
#undef RINGCOLL_ALGORITHM_NAME
  }
  return nullptr;
}

// Whether `code` names an entry of the table (a descriptor read from a peer may not).
RINGCOLL_INLINE bool is_collective_code(int code) { return code >= 0 && code < kNumCollectives; }

#if !defined(__CUDA_ARCH__)
// The collective the table calls `name`, if any (host code: the bindings take names).
inline std::optional<Collective> collective_named(const std::string& name) {
  for (int code = 0; code < kNumCollectives; ++code)
    if (name == collective_info(static_cast<Collective>(code)).name) return static_cast<Collective>(code);
  return std::nullopt;
}
#endif

}  // namespace ringcoll
