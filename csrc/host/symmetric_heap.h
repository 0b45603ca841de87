// symmetric_heap.h: symmetric memory on the CPU, where it lives and how it is handed out.
//
// A communicator's symmetric memory is a list of arenas. Arena a is one shared-memory
// segment per rank, all of the same size, created together by every rank (a collective:
// HostComm::allocate_symmetric) and mapped by every peer, by the same rules as the
// transport's own segments (shm_segment.h: random names, 0600, unlinked once all have
// mapped). A tensor from ringcoll.empty is a block of this rank's segment of some arena;
// a collective whose arguments are such blocks on every rank reads its peers' blocks
// where they lie (host_symmetric.cpp) instead of staging them through the slots.
//
// Blocks need not lie at the same offset on every rank: each call posts where its
// arguments lie (arena, offset), so each rank keeps its own free list and a tensor may be
// freed whenever Python drops it, with no agreement. Only making an arena is collective.
//
// Lifetime. The heap is shared (std::shared_ptr) by the communicator and by every block
// it handed out, and a block holds this rank's segment mapped: a tensor stays valid after
// the communicator is closed. A freed block goes back to the free list at once: peers
// read a block only inside a collective, and a collective returns only once every peer
// has finished reading this rank's blocks (host_symmetric.cpp), so nothing reads it later.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "shm_segment.h"

namespace ringcoll::host {

// Blocks start on this boundary: a cache line and more, for any dtype's vector loads.
constexpr size_t kSymmetricAlignment = 256;
// An arena is at least this large (and otherwise the block that needed it, rounded up to
// kSymmetricArenaGranule), so that small tensors share one arena and one rendezvous.
constexpr size_t kSymmetricArenaBytes = size_t{64} << 20;
constexpr size_t kSymmetricArenaGranule = size_t{2} << 20;

// The size every rank gives the arena made for a block of `block_bytes` (the same on
// every rank: block_bytes is agreed before it is made).
inline size_t symmetric_arena_bytes(size_t block_bytes) {
  const size_t rounded = (block_bytes + kSymmetricArenaGranule - 1) / kSymmetricArenaGranule * kSymmetricArenaGranule;
  return rounded > kSymmetricArenaBytes ? rounded : kSymmetricArenaBytes;
}

inline size_t symmetric_block_bytes(size_t bytes) {
  const size_t at_least_one = bytes == 0 ? 1 : bytes;
  return (at_least_one + kSymmetricAlignment - 1) / kSymmetricAlignment * kSymmetricAlignment;
}

// Where a block lies: which arena, how far into this rank's segment of it.
struct SymmetricPlace {
  size_t arena, offset;
};

class SymmetricHeap {
 public:
  // Take the first free span of `bytes` (a multiple of kSymmetricAlignment) in any arena.
  std::optional<SymmetricPlace> take(size_t bytes);
  // Return a span to the free list, merged with free neighbours.
  void give_back(SymmetricPlace place, size_t bytes);
  bool has_room_for(size_t bytes);
  // The arena and offset of [address, address + bytes) if it lies within one of this
  // rank's segments; none otherwise.
  std::optional<SymmetricPlace> locate(const void* address, size_t bytes) const;
  // This rank's segment of a new arena (index: arenas() before the call), all of it free.
  void add_arena(std::shared_ptr<SegmentMapping> mine);
  size_t arenas() const;
  char* base(size_t arena) const;

 private:
  struct Arena {
    std::shared_ptr<SegmentMapping> mine;
    std::map<size_t, size_t> free;  // offset -> bytes of each free span
  };
  mutable std::mutex mutex_;  // blocks are freed by whichever thread drops the tensor
  std::vector<Arena> arenas_;
};

// One block handed to Python (bind_host.cpp exposes it as a writable buffer that torch
// wraps): it holds the heap and so this rank's segment, and gives its span back when dropped.
class SymmetricBlock {
 public:
  SymmetricBlock(std::shared_ptr<SymmetricHeap> heap, SymmetricPlace place, size_t bytes)
      : heap_(std::move(heap)), place_(place), bytes_(bytes) {}
  ~SymmetricBlock() { heap_->give_back(place_, bytes_); }
  SymmetricBlock(const SymmetricBlock&) = delete;
  SymmetricBlock& operator=(const SymmetricBlock&) = delete;
  char* data() const { return heap_->base(place_.arena) + place_.offset; }
  size_t bytes() const { return bytes_; }
  SymmetricPlace place() const { return place_; }

 private:
  std::shared_ptr<SymmetricHeap> heap_;
  SymmetricPlace place_;
  size_t bytes_;
};

}  // namespace ringcoll::host
