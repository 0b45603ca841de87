// emulator_races.cpp: the emulated CUDA ring kernels under ThreadSanitizer.
//
// x86 is TSO: on it a missing acquire or release still "works", so the emulator's bit-exact
// tests cannot see one. ThreadSanitizer can: it tracks happens-before through every atomic
// (flags.h's helpers are C++ atomics on the host) and reports any payload read or write that
// is not ordered after the write it races with. Built and run by
// tests/pure/test_emulated_kernels.py::test_kernels_have_no_data_races; standalone:
//   g++ -std=c++20 -O1 -g -fsanitize=thread -Icsrc/include tests/pure/sanitize/emulator_races.cpp \
//       csrc/emulation/emulated_ring.cpp -o /tmp/races && /tmp/races
//
// Each case runs a few back-to-back calls of one collective on int32 sums (exact), with a
// buffer small enough that every call is cut into several slices, so slots are reused
// within a call and across calls, on both kernel variants, then every rank closes (the
// close protocol's `finished` words); then fused calls whose grids change; then the paths
// that give up (a rank that never
// calls, mismatched calls); and every built-in plan on the plan kernels, interleaved with
// the ring's (run_plan_cases); and the direct plans reading symmetric memory across modelled
// processes (run_symmetric_cases). Exit status: 0 when every result is exact and every failure
// raised where it should (TSan itself exits non-zero on a report).
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "../../csrc/emulation/emulated_ring.h"
#include "run_plan.h"

using ringcoll::emulation::EmulatedCall;
using ringcoll::emulation::EmulatedRing;

namespace {

constexpr int kAllReduce = 0, kReduceScatter = 1, kAllGather = 2;
constexpr int kInt32 = 6, kSum = 0;

int32_t value_of(int rank, int call, int64_t i) { return static_cast<int32_t>((rank + 1) * 1000 + call * 7 + i % 97); }

// Runs one call of `collective` per entry of `counts` on every rank, in a buffer of
// `buffer_bytes`; returns the number of wrong elements.
int64_t run_case(int world, int variant, int collective, const std::vector<int64_t>& counts, size_t buffer_bytes) {
  EmulatedRing ring(world, buffer_bytes, /*timeout=*/60.0, variant, /*threads_per_block=*/3, /*check_calls=*/true);
  const int calls = static_cast<int>(counts.size());
  // A count is elements per rank's input (all-gather), per rank's output (reduce-scatter), per tensor (all-reduce).
  auto in_len = [&](int c) { return collective == kReduceScatter ? counts[c] * world : counts[c]; };
  auto out_len = [&](int c) { return collective == kAllGather ? counts[c] * world : counts[c]; };
  std::vector<std::vector<std::vector<int32_t>>> in(world), out(world);
  std::vector<EmulatedCall> plan;
  for (int c = 0; c < calls; ++c) {
    for (int r = 0; r < world; ++r) {
      in[r].emplace_back(in_len(c));
      out[r].emplace_back(out_len(c), -1);
      for (int64_t i = 0; i < in_len(c); ++i) in[r][c][i] = value_of(r, c, i);
    }
  }
  for (int c = 0; c < calls; ++c)
    for (int r = 0; r < world; ++r)
      plan.push_back({r, collective, kInt32, kSum, reinterpret_cast<uintptr_t>(in[r][c].data()),
                      reinterpret_cast<uintptr_t>(out[r][c].data()), counts[c]});
  for (int r = 0; r < world; ++r) plan.push_back({r, ringcoll::emulation::kClose, 0, 0, 0, 0, 0});  // collective close
  int64_t wrong = run_plan(ring, plan);
  for (int c = 0; c < calls; ++c) {
    const int64_t count = counts[c];
    for (int r = 0; r < world; ++r) {
      for (int64_t i = 0; i < out_len(c); ++i) {
        int64_t expected = 0;
        if (collective == kAllGather) {
          expected = value_of(static_cast<int>(i / count), c, i % count);
        } else {
          const int64_t at = collective == kReduceScatter ? r * count + i : i;
          for (int q = 0; q < world; ++q) expected += value_of(q, c, at);
        }
        wrong += out[r][c][i] != expected;
      }
    }
  }
  return wrong;
}

// The giving-up paths: error records, `aborted` flags travelling round the ring, the
// descriptor's sequence lock. Returns 1 unless every rank raised the expected error.
int run_failure_case(const char* what, int world, const std::vector<int64_t>& counts, const char* expected) {
  EmulatedRing ring(world, 4096 * world, /*timeout=*/0.5, /*variant=*/0, /*threads_per_block=*/3, true);
  std::vector<std::vector<int32_t>> in(world, std::vector<int32_t>(4096, 1)), out(world, std::vector<int32_t>(4096));
  std::vector<EmulatedCall> plan;
  for (int r = 0; r < world; ++r) {
    if (counts[r] < 0) continue;  // this rank never calls
    plan.push_back({r, kAllReduce, kInt32, kSum, reinterpret_cast<uintptr_t>(in[r].data()),
                    reinterpret_cast<uintptr_t>(out[r].data()), counts[r]});
  }
  int bad = 0;
  for (const auto& result : ring.run(plan)) bad += result.error_type.empty();
  std::printf("%-26s ranks without an error: %d (each should raise, e.g. %s)\n", what, bad, expected);
  return bad == 0 ? 0 : 1;
}

// Every built-in plan of every collective it has (the rooted ones at root 1; the direct
// plans read the peers' inputs where they lie, as every rank is a thread here), run by the plan
// kernels (device_plan.h) at P = 3 (the recursive plans pair a rank), int32 sums, each case
// twice and then a ring all-reduce, in one run per variant: slots refilled across plans of
// other layouts and between the plans and the ring (the drains) are the hazard. Returns the
// number of wrong elements (and of calls that raised).
int64_t run_plan_cases(int variant) {
  using ringcoll::Algorithm;
  using ringcoll::Collective;
  const int world = 3, root = 1;
  const int64_t count = 3 * 700 + 2;  // several slices of every plan in the buffer below
  struct Case {
    int collective;
    ringcoll::CompiledPlan plan;
  };
  std::vector<Case> cases;
  // The rooted collectives run in place (one buffer), and every all-reduce's second call too:
  // in place a direct plan's peers read the very memory its owner then overwrites with its
  // output, on ordinary memory that ThreadSanitizer sees as one (run_symmetric_cases reads
  // through second mappings of each arena, which it cannot compare with the owner's).
  auto in_place = [&](int coll, int rep) {
    return ringcoll::collective_info(static_cast<Collective>(coll)).rooted || (coll == kAllReduce && rep == 1);
  };
#define RINGCOLL_PLAN_CASES(e, name, code, collectives)                                                     \
  for (int c = 0; c < ringcoll::kNumCollectives; ++c)                                                       \
    if (c != static_cast<int>(Collective::kBarrier) && ringcoll::algorithm_has(Algorithm::e, static_cast<Collective>(c))) \
      cases.push_back({c, ringcoll::compile_plan(ringcoll::builtin_plan(Algorithm::e, static_cast<Collective>(c), world), \
                                                 name, world, static_cast<uint32_t>(code),                  \
                                                 ringcoll::collective_info(static_cast<Collective>(c)).rooted ? root : 0)});
  RINGCOLL_ALGORITHMS(RINGCOLL_PLAN_CASES)
#undef RINGCOLL_PLAN_CASES
  EmulatedRing ring(world, 4096 * world, /*timeout=*/60.0, variant, /*threads_per_block=*/3, /*check_calls=*/true);
  const size_t n = cases.size();
  // [case][repeat][rank]: input and output (in place: one buffer)
  std::vector<std::vector<std::vector<std::vector<int32_t>>>> in(n), out(n);
  std::vector<EmulatedCall> calls;
  for (size_t k = 0; k < n; ++k) {
    const int coll = cases[k].collective;
    const int64_t in_len = coll == kReduceScatter ? count * world : count;
    const int64_t out_len = coll == kAllGather ? count * world : count;
    in[k].resize(2), out[k].resize(2);
    for (int rep = 0; rep < 2; ++rep) {
      for (int r = 0; r < world; ++r) {
        in[k][rep].emplace_back(in_len);
        for (int64_t i = 0; i < in_len; ++i) in[k][rep][r][i] = value_of(r, rep, i);
        out[k][rep].emplace_back(in_place(coll, rep) ? in[k][rep][r] : std::vector<int32_t>(out_len, -1));
      }
    }
  }
  std::vector<std::vector<std::vector<int32_t>>> ring_bufs(n, std::vector<std::vector<int32_t>>(world));
  for (size_t k = 0; k < n; ++k) {
    const int coll = cases[k].collective;
    for (int rep = 0; rep < 2; ++rep)
      for (int r = 0; r < world; ++r) {
        auto* src = in_place(coll, rep) ? out[k][rep][r].data() : in[k][rep][r].data();
        EmulatedCall call{r, coll, kInt32, kSum, reinterpret_cast<uintptr_t>(src),
                          reinterpret_cast<uintptr_t>(out[k][rep][r].data()), count};
        call.plan = &cases[k].plan;
        calls.push_back(call);
      }
    for (int r = 0; r < world; ++r) {  // the ring kernels, in place, between plans
      ring_bufs[k][r].assign(count, r + 1);
      calls.push_back({r, kAllReduce, kInt32, kSum, reinterpret_cast<uintptr_t>(ring_bufs[k][r].data()),
                       reinterpret_cast<uintptr_t>(ring_bufs[k][r].data()), count});
    }
  }
  for (int r = 0; r < world; ++r) calls.push_back({r, ringcoll::emulation::kClose, 0, 0, 0, 0, 0});
  int64_t wrong = run_plan(ring, calls);
  for (size_t k = 0; k < n; ++k) {
    const int coll = cases[k].collective;
    int64_t case_wrong = 0;
    for (int rep = 0; rep < 2; ++rep)
      for (int r = 0; r < world; ++r) {
        const auto& got = out[k][rep][r];
        for (int64_t i = 0; i < static_cast<int64_t>(got.size()); ++i) {
          int64_t expected = 0;
          if (coll == kAllGather) expected = value_of(static_cast<int>(i / count), rep, i % count);
          else if (coll == static_cast<int>(Collective::kBroadcast)) expected = value_of(root, rep, i);
          else if (coll == static_cast<int>(Collective::kReduce) && r != root) expected = value_of(r, rep, i);
          else
            for (int q = 0; q < world; ++q) expected += value_of(q, rep, coll == kReduceScatter ? r * count + i : i);
          case_wrong += got[i] != expected;
        }
      }
    for (int r = 0; r < world; ++r)
      for (int32_t v : ring_bufs[k][r]) case_wrong += v != world * (world + 1) / 2;
    std::printf("variant %d plan %-8s %-14s wrong %lld\n", variant, ringcoll::algorithm_name(static_cast<int>(cases[k].plan.id)),
                ringcoll::collective_info(static_cast<Collective>(coll)).name, static_cast<long long>(case_wrong));
    wrong += case_wrong;
  }
  return wrong;
}

// The direct plans across modelled processes (EmulatedRing's peers_in_process = false): every
// input in symmetric memory, made as CudaComm makes it (each rank's part, the handles round,
// every peer's part mapped again at an address of its own), read through each rank's table
// of arenas. All-gather, broadcast (root 1), reduce-scatter and all-reduce (in place), twice
// each, each followed by a ring all-reduce, both
// variants; returns the number of wrong elements (and of calls that raised).
int64_t run_symmetric_cases(int variant) {
  using ringcoll::Algorithm;
  using ringcoll::Collective;
  const int world = 3, root = 1;
  const int64_t count = 3 * 700 + 2;
  EmulatedRing ring(world, 4096 * world, /*timeout=*/60.0, variant, /*threads_per_block=*/3, /*check_calls=*/true,
                    /*max_blocks=*/8, nullptr, /*peers_in_process=*/false);
  std::vector<std::string> handles;
  for (int r = 0; r < world; ++r) handles.push_back(ring.make_symmetric_arena(r, size_t{1} << 20));
  for (int r = 0; r < world; ++r) ring.open_symmetric_arena(r, handles);
  // The last kind is auto's pair (direct, else the ring's plan), whose second repeat has the
  // last rank's input in ordinary memory: every rank falls back to the ring's plan.
  const int colls[] = {kAllGather, static_cast<int>(Collective::kBroadcast), kReduceScatter, kAllReduce, kAllReduce};
  const int kinds = 5;
  std::vector<ringcoll::CompiledPlan> plans;
  for (int coll : colls)
    plans.push_back(ringcoll::compile_plan(ringcoll::builtin_plan(Algorithm::kDirect, static_cast<Collective>(coll), world),
                                           "direct", world, static_cast<uint32_t>(Algorithm::kDirect),
                                           coll == static_cast<int>(Collective::kBroadcast) ? root : 0));
  plans.back() = ringcoll::plan_with_fallback(
      plans.back(), ringcoll::compile_plan(ringcoll::builtin_plan(Algorithm::kRing, Collective::kAllReduce, world), "ring",
                                           world, static_cast<uint32_t>(Algorithm::kRing), 0));
  // [coll][repeat][rank]: the input (a symmetric block, or for the fallback case an ordinary
  // vector; a broadcast's and an all-reduce's result in place) and an ordinary output
  std::vector<std::shared_ptr<ringcoll::SymmetricBlock>> blocks;
  std::vector<std::vector<int32_t>> outputs, ring_bufs, ordinary;
  std::vector<int32_t*> inputs;
  std::vector<EmulatedCall> calls;
  auto in_len = [&](int k) { return colls[k] == kReduceScatter ? count * world : count; };
  // all-gather and reduce-scatter into an ordinary output; broadcast and all-reduce in place
  auto out_len = [&](int k) { return colls[k] == kAllGather ? count * world : colls[k] == kReduceScatter ? count : 0; };
  for (int k = 0; k < kinds; ++k) {
    for (int rep = 0; rep < 2; ++rep) {
      for (int r = 0; r < world; ++r) {
        blocks.push_back(ring.take_symmetric(r, ringcoll::symmetric_block_bytes(in_len(k) * sizeof(int32_t))));
        auto* in = reinterpret_cast<int32_t*>(blocks.back()->data());
        if (k == kinds - 1 && rep == 1 && r == world - 1) in = ordinary.emplace_back(in_len(k)).data();
        inputs.push_back(in);
        for (int64_t i = 0; i < in_len(k); ++i) in[i] = value_of(r, rep, i);
        outputs.emplace_back(out_len(k), -1);
        auto* out = out_len(k) > 0 ? outputs.back().data() : in;
        EmulatedCall call{r, colls[k], kInt32, kSum, reinterpret_cast<uintptr_t>(in), reinterpret_cast<uintptr_t>(out),
                          count};
        call.plan = &plans[k];
        calls.push_back(call);
      }
    }
    for (int r = 0; r < world; ++r) {
      ring_bufs.emplace_back(count, r + 1);
      calls.push_back({r, kAllReduce, kInt32, kSum, reinterpret_cast<uintptr_t>(ring_bufs.back().data()),
                       reinterpret_cast<uintptr_t>(ring_bufs.back().data()), count});
    }
  }
  for (int r = 0; r < world; ++r) calls.push_back({r, ringcoll::emulation::kClose, 0, 0, 0, 0, 0});
  int64_t wrong = run_plan(ring, calls);
  size_t at = 0;
  for (int k = 0; k < kinds; ++k) {
    int64_t case_wrong = 0;
    for (int rep = 0; rep < 2; ++rep)
      for (int r = 0; r < world; ++r, ++at) {
        const auto* got = out_len(k) > 0 ? outputs[at].data() : inputs[at];
        for (int64_t i = 0; i < count * (colls[k] == kAllGather ? world : 1); ++i) {
          int64_t expected = 0;
          if (colls[k] == kAllGather) expected = value_of(static_cast<int>(i / count), rep, i % count);
          else if (colls[k] == kReduceScatter)
            for (int q = 0; q < world; ++q) expected += value_of(q, rep, r * count + i);
          else if (colls[k] == kAllReduce)
            for (int q = 0; q < world; ++q) expected += value_of(q, rep, i);
          else expected = value_of(root, rep, i);
          case_wrong += got[i] != expected;
        }
      }
    std::printf("variant %d symmetric, peers in other processes: direct %-10s%s wrong %lld\n", variant,
                ringcoll::collective_info(static_cast<Collective>(colls[k])).name,
                k == kinds - 1 ? " (else ring; fell back once)" : "", static_cast<long long>(case_wrong));
    wrong += case_wrong;
  }
  for (int r = 0; r < world; ++r) wrong += ring.fallbacks(r) != 1;  // the second repeat of the pair, on every rank
  for (const auto& buf : ring_bufs)
    for (int32_t v : buf) wrong += v != world * (world + 1) / 2;
  return wrong;
}

}  // namespace

int main() {
  const char* names[] = {"all_reduce", "reduce_scatter", "all_gather"};
  int64_t wrong = 0;
  for (int variant = 0; variant < 2; ++variant) {
    for (int world : {2, 3}) {
      for (int collective : {kAllReduce, kReduceScatter, kAllGather}) {
        // 3 slices' worth and an odd tail: slots are reused inside the call and by the next one.
        const int64_t count = 3 * 1024 + 5;
        const int64_t w = run_case(world, variant, collective, {count, count, count}, 4096 * world);
        std::printf("variant %d world %d %-14s wrong %lld\n", variant, world, names[collective],
                    static_cast<long long>(w));
        wrong += w;
      }
    }
  }
  // Fused launches whose grids change from call to call (1 to 3 blocks: slots of three 32 KiB
  // tiles), so tiles change owner between calls while the ranks run ahead of each other:
  // the drain before the first write of a changed grid is what orders it (device_ring.h).
  {
    const int world = 3;
    const int64_t tile = 8192;  // int32 elements of a 32 KiB tile
    const std::vector<int64_t> counts = {world * 3 * tile, world * tile / 2, world * 2 * tile - 5, world * 3 * tile};
    const int64_t w = run_case(world, /*variant=*/0, kAllReduce, counts, 2 * world * 3 * 4 * tile);
    std::printf("variant 0 world %d %-14s wrong %lld (grids 3, 1, 2, 3)\n", world, "all_reduce",
                static_cast<long long>(w));
    wrong += w;
  }
  for (int variant = 0; variant < 2; ++variant) wrong += run_plan_cases(variant);
  for (int variant = 0; variant < 2; ++variant) wrong += run_symmetric_cases(variant);
  int failures = 0;
  failures += run_failure_case("missing rank 2 of 3", 3, {4000, 4000, -1}, "RingcollTimeoutError");
  failures += run_failure_case("mismatched counts", 3, {4000, 4000, 3999}, "RingcollMismatchError");
  return wrong == 0 && failures == 0 ? 0 : 1;
}
