// collectives.h: the collectives, listed once (beside RINGCOLL_DTYPES in reduce.h).
//
// Everything that names a collective reads this table: the enum and the descriptor's
// codes here, the error messages (descriptor.h), the bindings, and Python through
// `_C.collective_table` (ringcoll/_types.py: COLLECTIVE_CODES, and from there the
// schedule, the trace, the emulated transport, the model, the benchmark and the fuzzer).
//
//   X(enumerator, name, code, reduces, moves_data, rooted)
//     name        what Python and error messages call it
//     code        its number in a CallDescriptor (the order of the list: 0, 1, 2, ...)
//     reduces     combines the ranks' contributions with an op (else it only moves bytes)
//     moves_data  has a message at all (barrier has none)
//     rooted      one rank is the root (broadcast's source, reduce's destination): the call
//                 names it, its descriptor carries it, and only plans run it (plan.h)
#pragma once

#if !defined(__CUDA_ARCH__)
#include <optional>
#include <string>
#endif

#include "ringcoll/platform.h"

#define RINGCOLL_COLLECTIVES(X)                                    \
  X(kAllReduce, "all_reduce", 0, true, true, false)                \
  X(kReduceScatter, "reduce_scatter", 1, true, true, false)        \
  X(kAllGather, "all_gather", 2, false, true, false)               \
  X(kBarrier, "barrier", 3, false, false, false)                   \
  X(kBroadcast, "broadcast", 4, false, true, true)                 \
  X(kReduce, "reduce", 5, true, true, true)

// The built-in algorithms (plan.h's generators), listed once the same way:
//   X(enumerator, name, code, collectives)
//     code         what a call's descriptor carries (0: the default path; plans written
//                  in Python take codes from 1000 on)
//     collectives  the collectives it has plans for (a mask of collective_bit(c))
#define RINGCOLL_ALGORITHMS(X)                                              \
  X(kRing, "ring", 1, kEveryDataCollective)                                 \
  X(kOneShot, "oneshot", 2, kEveryDataCollective)                           \
  X(kHalvingDoubling, "rhd", 3, kUnrootedCollectives)                       \
  X(kRecursiveDoubling, "rd", 4, collective_bit(Collective::kAllReduce))    \
  X(kTree, "tree", 5, collective_bit(Collective::kAllReduce) | kRootedCollectives) \
  X(kStar, "star", 6, collective_bit(Collective::kBroadcast))                \
  X(kDirect, "direct", 7,                                                  \
    kUnrootedCollectives | collective_bit(Collective::kBroadcast))

namespace ringcoll {

enum class Collective : int {
#define RINGCOLL_COLLECTIVE_ENUMERATOR(e, name, code, reduces, moves_data, rooted) e = code,
  RINGCOLL_COLLECTIVES(RINGCOLL_COLLECTIVE_ENUMERATOR)
#undef RINGCOLL_COLLECTIVE_ENUMERATOR
};

#define RINGCOLL_COLLECTIVE_CODE(e, name, code, reduces, moves_data, rooted) code,
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
  bool rooted;
};

RINGCOLL_INLINE CollectiveInfo collective_info(Collective c) {
  switch (c) {
#define RINGCOLL_COLLECTIVE_INFO(e, name, code, reduces, moves_data, rooted) \
  case Collective::e: return CollectiveInfo{name, reduces, moves_data, rooted};
    RINGCOLL_COLLECTIVES(RINGCOLL_COLLECTIVE_INFO)
#undef RINGCOLL_COLLECTIVE_INFO
  }
  return CollectiveInfo{"unknown collective", false, false, false};
}

// Sets of collectives, one bit per code (the algorithms' table says which each has), read
// off the table: the data collectives, rooted or not.
RINGCOLL_INLINE constexpr unsigned collective_bit(Collective c) { return 1u << static_cast<int>(c); }
#define RINGCOLL_COLLECTIVE_ROW(e, name, code, reduces, moves_data, rooted) {name, reduces, moves_data, rooted},
constexpr CollectiveInfo kCollectiveRows[] = {RINGCOLL_COLLECTIVES(RINGCOLL_COLLECTIVE_ROW)};
#undef RINGCOLL_COLLECTIVE_ROW
constexpr unsigned data_collectives(bool rooted, int code = 0) {
  return code == kNumCollectives ? 0u
         : ((kCollectiveRows[code].moves_data && kCollectiveRows[code].rooted == rooted) ? 1u << code : 0u) |
               data_collectives(rooted, code + 1);
}
constexpr unsigned kRootedCollectives = data_collectives(true);
constexpr unsigned kUnrootedCollectives = data_collectives(false);
constexpr unsigned kEveryDataCollective = kRootedCollectives | kUnrootedCollectives;

enum class Algorithm : int {
#define RINGCOLL_ALGORITHM_ENUMERATOR(e, name, code, collectives) e = code,
  RINGCOLL_ALGORITHMS(RINGCOLL_ALGORITHM_ENUMERATOR)
#undef RINGCOLL_ALGORITHM_ENUMERATOR
};
constexpr int kFirstUserPlanCode = 1000;

// The name of a built-in algorithm's code, or null for any other code.
RINGCOLL_INLINE const char* algorithm_name(int code) {
  switch (code) {
#define RINGCOLL_ALGORITHM_NAME(e, name, c, collectives) \
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
