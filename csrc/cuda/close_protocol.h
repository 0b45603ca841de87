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

// read_finished(r, &word) reads word r of our own `finished` array; false if it cannot.
// Polls with growing naps (20 us .. 20 ms). Returns "" once every peer's word is set, else
// why not: which ranks did not close within the timeout, or which could not be read.
template <typename ReadFinished>
std::string wait_until_peers_finished(int rank, int world, double timeout_seconds, ReadFinished&& read_finished) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_seconds));
  std::vector<bool> finished(static_cast<size_t>(world), false);
  finished[rank] = true;
  for (auto nap = std::chrono::microseconds(20);; nap = std::min(nap * 2, std::chrono::microseconds(20000))) {
    std::string missing;
    for (int r = 0; r < world; ++r) {
      if (finished[r]) continue;
      uint64_t word = 0;
      if (!read_finished(r, &word)) return "the word of rank " + std::to_string(r) + " could not be read";
      finished[r] = word != 0;
      if (!finished[r]) missing += " " + std::to_string(r);
    }
    if (missing.empty()) return "";
    if (Clock::now() > deadline) {
      std::ostringstream why;
      why << "rank(s)" << missing << " did not close within the timeout (" << timeout_seconds << " s)";
      return why.str();
    }
    std::this_thread::sleep_for(nap);
  }
}

}  // namespace ringcoll::cuda
