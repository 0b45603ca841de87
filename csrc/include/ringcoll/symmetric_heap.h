// symmetric_heap.h: symmetric memory, where it lives and how it is handed out; one heap for
// the CPU transport (csrc/host/host_symmetric.cpp), the CUDA transport (csrc/cuda/cuda_comm.cu)
// and the emulator of its kernels (csrc/emulation/).
//
// A communicator's symmetric memory is a list of arenas. Arena a is one allocation per rank,
// all of the same size, made together by every rank (a collective) and mapped by every
// peer: on the CPU a shared-memory segment (shm_segment.h's rules: random names, 0600,
// unlinked once all have mapped), on CUDA a cudaMalloc whose IPC handle every peer has
// opened. A tensor from ringcoll.empty is a block of this rank's part of some arena; a
// collective whose arguments are such blocks on every rank reads its peers' blocks where
// they lie instead of staging them through the slots.
//
// Blocks need not lie at the same offset on every rank: each call posts where its arguments
// lie (arena, offset), so each rank keeps its own free list and a tensor may be freed
// whenever Python drops it, with no agreement. Only making an arena is collective.
//
// Lifetime. The heap is shared (std::shared_ptr) by the communicator and by every block it
// handed out, and an arena holds its owner (the mapping, the device allocation), so a tensor
// stays valid after the communicator is closed. A freed block goes back to the free list at
// once: peers read a block only inside a collective, and a collective returns only once
// every peer has finished reading this rank's blocks, so nothing reads it later.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace ringcoll {

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

// Where a block lies: which arena, how far into this rank's part of it.
struct SymmetricPlace {
  size_t arena, offset;
};

class SymmetricHeap {
 public:
  // Take the first free span of `bytes` (a multiple of kSymmetricAlignment) in any arena.
  std::optional<SymmetricPlace> take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t a = 0; a < arenas_.size(); ++a) {
      auto& free = arenas_[a].free;
      for (auto it = free.begin(); it != free.end(); ++it) {
        if (it->second < bytes) continue;
        const auto [offset, span] = *it;
        free.erase(it);
        if (span > bytes) free.emplace(offset + bytes, span - bytes);
        return SymmetricPlace{a, offset};
      }
    }
    return std::nullopt;
  }

  // Return a span to the free list, merged with free neighbours.
  void give_back(SymmetricPlace place, size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& free = arenas_.at(place.arena).free;
    auto [it, inserted] = free.emplace(place.offset, bytes);
    if (auto next = std::next(it); next != free.end() && it->first + it->second == next->first) {
      it->second += next->second;
      free.erase(next);
    }
    if (it != free.begin()) {
      if (auto prev = std::prev(it); prev->first + prev->second == it->first) {
        prev->second += it->second;
        free.erase(it);
      }
    }
  }

  bool has_room_for(size_t bytes) const {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& arena : arenas_)
      for (const auto& [offset, span] : arena.free)
        if (span >= bytes) return true;
    return false;
  }

  // The arena and offset of [address, address + bytes) if it lies within one of this rank's
  // parts of an arena; none otherwise.
  std::optional<SymmetricPlace> locate(const void* address, size_t bytes) const {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto* p = static_cast<const char*>(address);
    for (size_t a = 0; a < arenas_.size(); ++a) {
      const char* base = arenas_[a].base;
      if (p >= base && p + bytes <= base + arenas_[a].bytes) return SymmetricPlace{a, static_cast<size_t>(p - base)};
    }
    return std::nullopt;
  }

  // This rank's part of a new arena (index: arenas() before the call), all of it free:
  // `bytes` at `base`, kept valid by `owner` (a mapping, a device allocation) while the heap
  // lives.
  void add_arena(std::shared_ptr<void> owner, char* base, size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    arenas_.push_back(Arena{std::move(owner), base, bytes, {{0, bytes}}});
  }

  size_t arenas() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return arenas_.size();
  }

  char* base(size_t arena) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return arenas_.at(arena).base;
  }

 private:
  struct Arena {
    std::shared_ptr<void> owner;
    char* base;
    size_t bytes;
    std::map<size_t, size_t> free;  // offset -> bytes of each free span
  };
  mutable std::mutex mutex_;  // blocks are freed by whichever thread drops the tensor
  std::vector<Arena> arenas_;
};

// One block handed to Python (bind_host.cpp exposes it as a writable buffer that torch wraps
// on the CPU, bind_cuda.cpp through __cuda_array_interface__ on a GPU): it holds the heap and
// so this rank's part of the arena, and gives its span back when dropped.
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

// A block of `bytes` (a multiple of kSymmetricAlignment) from `heap`, which the block holds;
// null where no arena has room.
inline std::shared_ptr<SymmetricBlock> take_block(const std::shared_ptr<SymmetricHeap>& heap, size_t bytes) {
  const auto place = heap->take(bytes);
  return place ? std::make_shared<SymmetricBlock>(heap, *place, bytes) : nullptr;
}

}  // namespace ringcoll
