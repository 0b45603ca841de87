// placement_races.cpp: the emulated CUDA ring kernels under ThreadSanitizer, with data placed
// in the slots at changing offsets (tests/pure/test_cuda_grid.py builds and runs it).
//
// A rank puts chunk c in its slot at the offset modulo 16 that chunk c of its user memory
// has (device_ring.h: placement), and a full slice's last bytes past the slot's end wrap
// round to its start. Which block touches a byte of a slot then depends on that offset:
// element i sits at byte (offset + i * size) mod slot_bytes and belongs to the block of its
// tile. So when a rank's offsets change from one call to the next while the grid stays the
// same, the bytes near a tile boundary (and the wrapped ones) change owner, and the block
// that refills them has waited only for its own neighbour block, not for the one that read
// them last: the kernel must drain first, as it does when the grid changes. This program
// runs back-to-back calls whose offsets change (every rank's input shifted by 0..3 int32
// elements, the ranks running ahead of each other) on a fixed grid of two blocks, with
// slices that fill whole slots; TSan reports any slot byte written while unordered with
// the neighbour's last read of it (without the drain on a changed placement it does, in
// nearly every run). Then the same calls with each rank at its own offset.
// Exit status: 0 when every result is exact (TSan itself exits non-zero on a report).
//   g++ -std=c++20 -O1 -g -fsanitize=thread -Icsrc/include tests/pure/sanitize/placement_races.cpp \
//       csrc/emulation/emulated_ring.cpp csrc/emulation/emulated_streams.cpp -o /tmp/placement && /tmp/placement
#include <cstdint>
#include <cstdio>
#include <vector>

#include "../../csrc/cuda/kernel_abi.h"
#include "../../csrc/emulation/emulated_ring.h"
#include "run_plan.h"

using ringcoll::emulation::EmulatedCall;
using ringcoll::emulation::EmulatedRing;

namespace {

constexpr int kAllReduce = 0, kInt32 = 6, kSum = 0;
constexpr int64_t kTileInts = 8192;  // int32 elements of a 32 KiB tile (strip.h)

int32_t value_of(int rank, int call, int64_t i) { return static_cast<int32_t>((rank + 1) * 1000 + call * 7 + i % 97); }

// All-reduces of `count` int32 elements, call c's input of rank r shifted by shift(r, c)
// elements into its storage; returns the number of wrong elements.
template <class Shift>
int64_t run_case(int world, int64_t count, size_t buffer_bytes, int calls, Shift&& shift) {
  EmulatedRing ring(world, buffer_bytes, /*timeout=*/60.0, /*variant=*/0, /*threads_per_block=*/3, true,
                    /*max_blocks=*/8);
  std::vector<std::vector<std::vector<int32_t>>> in(world), out(world);
  std::vector<EmulatedCall> plan;
  for (int c = 0; c < calls; ++c) {
    for (int r = 0; r < world; ++r) {
      in[r].emplace_back(count + 4);
      out[r].emplace_back(count, -1);
      for (int64_t i = 0; i < count; ++i) in[r][c][shift(r, c) + i] = value_of(r, c, i);
    }
  }
  for (int c = 0; c < calls; ++c)
    for (int r = 0; r < world; ++r)
      plan.push_back({r, kAllReduce, kInt32, kSum, reinterpret_cast<uintptr_t>(in[r][c].data() + shift(r, c)),
                      reinterpret_cast<uintptr_t>(out[r][c].data()), count});
  for (int r = 0; r < world; ++r) plan.push_back({r, ringcoll::emulation::kClose, 0, 0, 0, 0, 0});
  int64_t wrong = run_plan(ring, plan);
  for (int c = 0; c < calls; ++c) {
    for (int r = 0; r < world; ++r) {
      for (int64_t i = 0; i < count; ++i) {
        int64_t expected = 0;
        for (int q = 0; q < world; ++q) expected += value_of(q, c, i);
        wrong += out[r][c][i] != expected;
      }
    }
  }
  return wrong;
}

}  // namespace

int main() {
  int64_t wrong = 0;
  const int world = 3;
  // Slots of two tiles and chunks of one slot: every call is one slice that fills every slot,
  // on a grid of two blocks. A rank's first send of a call refills the slot its right
  // neighbour read last in the call before (ring.h: the chunk a rank forwards last is the one
  // it sends first), and nothing of the ring orders that refill after the neighbour's other
  // block's read: only the drain does.
  const size_t buffer = 2 * world * 2 * kTileInts * 4;
  const int64_t count = world * ringcoll::cuda::slice_elems_for(2 * kTileInts * 4, 4);
  {
    const int64_t w = run_case(world, count, buffer, 16, [](int, int c) { return c % 4; });
    std::printf("offsets change every call, the same on every rank: wrong %lld\n", static_cast<long long>(w));
    wrong += w;
  }
  {
    const int64_t w = run_case(world, count, buffer, 16, [](int r, int c) { return (r + c) % 4; });
    std::printf("offsets change every call, rank by rank: wrong %lld\n", static_cast<long long>(w));
    wrong += w;
  }
  return wrong == 0 ? 0 : 1;
}
