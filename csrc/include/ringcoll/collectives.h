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

#include "ringcoll/platform.h"

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

// Whether `code` names an entry of the table (a descriptor read from a peer may not).
RINGCOLL_INLINE bool is_collective_code(int code) { return code >= 0 && code < kNumCollectives; }

}  // namespace ringcoll
