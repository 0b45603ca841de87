// run_plan.h: what the sanitizer programs share: run a plan of calls on an emulated ring and
// count the calls that raised (each printed).
#pragma once

#include <cstdint>
#include <cstdio>
#include <vector>

#include "../../csrc/emulation/emulated_ring.h"

inline int64_t run_plan(ringcoll::emulation::EmulatedRing& ring,
                        const std::vector<ringcoll::emulation::EmulatedCall>& plan) {
  int64_t failed = 0;
  for (const auto& result : ring.run(plan)) {
    if (!result.error_type.empty() || !result.message.empty()) {
      std::printf("  error %s: %s\n", result.error_type.c_str(), result.message.c_str());
      ++failed;
    }
  }
  return failed;
}
