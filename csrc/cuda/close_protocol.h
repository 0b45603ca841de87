// close_protocol.h: step 3 of closing a CUDA communicator (cuda_comm.cu states the whole
// protocol, docs/flags.md the `finished` words): wait until every peer's word has arrived in
// our allocation, so that it may be freed. Host code with no CUDA types: CudaComm reads its
// own allocation through the GPU, the emulator (csrc/emulation/) from host memory, so CI
// runs this very loop.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace ringcoll::cuda {

// A `finished` word: 0 until rank r's kernels are all done, then what r does with its own
// allocation. kWillFree: it takes part in the host rendezvous that follows, then frees.
// kKeeps: it keeps the allocation and skips the rendezvous (broken, or closed by a finalizer);
// a peer that sees it skips the rendezvous too, so no rank waits there for one that never comes.
constexpr uint64_t kWillFree = 1, kKeeps = 2;

// Why a rank closed by a finalizer keeps its allocation (it must not wait for its peers there).
constexpr const char* kKeptByFinalizer = "it was closed without waiting for its peers (by the garbage collector)";

// read_finished(r, &word) reads word r of our own `finished` array; false if it cannot.
// Polls with growing naps (20 us .. 20 ms). Returns "" once every peer's word is set, else
// why not: which ranks did not close within the timeout, or which could not be read. Once
// all are set, a peer that keeps its allocation makes it say so too: then this rank cannot
// learn when that peer unmapped it, and keeps its own.
template <typename ReadFinished>
std::string wait_until_peers_finished(int rank, int world, double timeout_seconds, ReadFinished&& read_finished) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_seconds));
  std::vector<bool> finished(static_cast<size_t>(world), false);
  finished[rank] = true;
  std::string keeping;
  for (auto nap = std::chrono::microseconds(20);; nap = std::min(nap * 2, std::chrono::microseconds(20000))) {
    std::string missing;
    for (int r = 0; r < world; ++r) {
      if (finished[r]) continue;
      uint64_t word = 0;
      if (!read_finished(r, &word)) return "the word of rank " + std::to_string(r) + " could not be read";
      finished[r] = word != 0;
      if (!finished[r]) missing += " " + std::to_string(r);
      if (word == kKeeps) keeping += " " + std::to_string(r);
    }
    if (missing.empty() && keeping.empty()) return "";
    if (missing.empty()) return "rank(s)" + keeping + " keep their buffers, so they cannot say when they unmapped ours";
    if (Clock::now() > deadline) {
      std::ostringstream why;
      why << "rank(s)" << missing << " did not close within the timeout (" << timeout_seconds << " s)";
      return why.str();
    }
    std::this_thread::sleep_for(nap);
  }
}

// Step 3 as both CudaComm and the emulator run it, with what follows a failed wait. By
// then we have told every peer kWillFree (step 2), so a peer that closes after we gave up
// would go to the host rendezvous and wait there for us in vain: so we tell every peer again,
// kKeeps this time (`tell_peers(word)` writes our word into each peer's allocation). Safe:
// no peer frees before a rendezvous we now skip, so every peer's allocation is still there.
// A peer that read our first word just before the second still waits at the rendezvous,
// which is bounded by the communicator's timeout too (transports/cuda.py). Returns "" when
// every peer will free (the rendezvous follows), else why we keep our allocation.
template <typename TellPeers, typename ReadFinished>
std::string wait_for_peers_or_keep(int rank, int world, double timeout_seconds, TellPeers&& tell_peers,
                                   ReadFinished&& read_finished) {
  std::string why = wait_until_peers_finished(rank, world, timeout_seconds, read_finished);
  if (!why.empty()) tell_peers(kKeeps);
  return why;
}

}  // namespace ringcoll::cuda
