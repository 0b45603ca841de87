// host_strip.h: the innermost loops of the CPU transport, the only part of a step that
// differs from the GPU's (see ring_loop.h): copy a strip, or reduce one into place.
//
// Why two kinds of store. A slot of the registered buffer is read by the right neighbour
// a moment later: where the two cores share a cache it should stay there (ordinary
// stores); where they do not, the reader would fetch every line from the writer's cache,
// a hop between dies each, and streaming stores, which put the lines in memory, are up to
// 10x faster. The transport measures which holds (SlotStores in host_comm.h). The user's
// output of a large message is not read again soon; an ordinary store first reads the
// line it will overwrite (read-for-ownership), doubling the memory traffic. Streaming
// (non-temporal) stores write around the cache and skip that read: on this project's
// 2-core EPYC they copy 64 MiB at ~19 GB/s against glibc memcpy's ~10 GB/s. They pay off
// only once the output no longer fits in cache, hence the threshold
// (streaming_threshold_bytes). Streaming stores are weakly ordered: a stream_fence goes
// between them and the flag that publishes what they wrote.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "host_vector16.h"
#include "ringcoll/reduce.h"
#include "ringcoll/ring.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace ringcoll::host {

// Output size from which streaming stores are used (RINGCOLL_STREAMING_BYTES overrides).
size_t streaming_threshold_bytes();

// Whether a call writes its output around the cache: an output too large to stay in cache
// (streaming_threshold_bytes), and not where the output is (part of) the input: the call
// read each of its lines as input, so an ordinary store finds it in cache, and a streaming
// store would have to evict it (P = 2, in place, 8-32 MiB: all-reduce 1.3-1.4x faster
// without, reduce-scatter from 16 MiB 1.6x; bench/results/2026-12-01-cpu-in-place.txt).
// `input_bytes` and `output_bytes` are the call's (all-gather's input and reduce-scatter's
// output are one rank's chunk). All-gather in place is not within: its output is P inputs.
inline bool streams_output(const void* input, size_t input_bytes, const void* output, size_t output_bytes) {
  const auto* in_begin = static_cast<const char*>(input);
  const auto* out_begin = static_cast<const char*>(output);
  const bool within_input = out_begin >= in_begin && out_begin + output_bytes <= in_begin + input_bytes;
  return output_bytes >= streaming_threshold_bytes() && !within_input;
}

// Copy with non-temporal stores where the ISA has them; ordinary memcpy elsewhere.
inline void stream_copy(void* dst, const void* src, size_t bytes) {
#if defined(__SSE2__)
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  const size_t head = (16 - reinterpret_cast<uintptr_t>(d) % 16) % 16;  // until d is 16-byte aligned
  if (bytes < head + 64) {
    std::memcpy(d, s, bytes);
    return;
  }
  std::memcpy(d, s, head);
  d += head, s += head, bytes -= head;
  for (; bytes >= 64; d += 64, s += 64, bytes -= 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
  }
  std::memcpy(d, s, bytes);
#else
  std::memcpy(dst, src, bytes);
#endif
}

// Make earlier streaming stores ordered before what follows (they are weakly ordered).
inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// dst (if any) and dst2 (if any) = src; each streamed when its flag says so.
template <typename T>
void copy_strip(T* dst, T* dst2, const T* src, int64_t len, bool stream_dst2, bool stream_dst = false) {
  const size_t bytes = static_cast<size_t>(len) * sizeof(T);
  if (bytes == 0) return;
  if (dst != nullptr) stream_dst ? stream_copy(dst, src, bytes) : (void)std::memcpy(dst, src, bytes);
  if (dst2 == nullptr || dst2 == src) return;  // in place: already there
  stream_dst2 ? stream_copy(dst2, src, bytes) : (void)std::memcpy(dst2, src, bytes);
}

// to_right[i] (if any) and to_output[i] (if any) = recv[i] op own[i], finalized when
// kFinal; each target streamed when its flag says so. `own` may alias `to_output`
// (in-place), so nothing here is __restrict. `isa`: which vector loop may run
// (host_vector16.h); kNone is the scalar reference, for tests.
template <typename T, class Op, bool kFinal>
void reduce_strip(T* to_right, T* to_output, const T* recv, const T* own, int64_t len, int world,
                  bool stream_output, bool stream_right = false, VectorIsa isa = VectorIsa::kBest) {
  // out[i] (and out2[i], if any) for i < n: the vector path's blocks where it has one
  // (host_vector16.h), the scalar loop for the rest.
  auto reduce_span = [&](T* out, T* out2, const T* r, const T* o, int64_t n) {
    const int64_t done = reduce_strip_vector<T, Op, kFinal>(out, out2, r, o, n, world, isa);
    reduce_scalar<T, Op, kFinal>(out, out2, r, o, done, n, world);
  };
  stream_output = stream_output && to_output != nullptr;
  stream_right = stream_right && to_right != nullptr;
  if (!stream_output && !stream_right) {
    if (to_output != nullptr && to_right != nullptr) reduce_span(to_right, to_output, recv, own, len);
    else reduce_span(to_right != nullptr ? to_right : to_output, nullptr, recv, own, len);
    return;
  }
  // Some target streamed: compute a block into the slot, if it takes ordinary stores (the
  // neighbour reads it from cache), else into an L1-sized scratch block; then copy the
  // block to the other targets. Reading a whole block of `own` before writing it keeps
  // in-place use correct.
  constexpr int64_t kBlock = 4096 / sizeof(T);
  alignas(64) T scratch[kBlock];
  for (int64_t i = 0; i < len; i += kBlock) {
    const int64_t n = len - i < kBlock ? len - i : kBlock;
    const size_t bytes = static_cast<size_t>(n) * sizeof(T);
    T* staged = to_right != nullptr && !stream_right ? to_right + i : scratch;
    reduce_span(staged, nullptr, recv + i, own + i, n);
    if (stream_right) stream_copy(to_right + i, staged, bytes);
    if (to_output != nullptr) stream_output ? stream_copy(to_output + i, staged, bytes)
                                            : (void)std::memcpy(to_output + i, staged, bytes);
  }
}

// out[0, len) = elements [begin, begin + len) of every rank's `source(r)`, folded in the
// order the ring reduces chunk `chunk` (rs_contributor), the last combine finalizing (AVG).
// Tile by tile, the partial in an L1-sized scratch: `out` may be the last contributor's
// own memory (in place), which each tile reads before it writes. Symmetric memory, which
// folds all P contributions itself, uses it: the ring's bits.
template <typename T, class Op, class Source>
void fold_in_ring_order(T* out, Source&& source, int chunk, int64_t begin, int64_t len, int world, bool stream) {
  constexpr int64_t kTile = 4096 / sizeof(T);
  alignas(64) T partial[kTile];
  const int first = rs_contributor(chunk, 0, world);
  for (int64_t t = 0; t < len; t += kTile) {
    const int64_t n = std::min(kTile, len - t);
    for (int i = 1; i < world; ++i) {
      const T* own = source(rs_contributor(chunk, i, world)) + begin + t;
      const T* so_far = i == 1 ? source(first) + begin + t : partial;
      if (i + 1 == world) reduce_strip<T, Op, true>(nullptr, out + t, so_far, own, n, world, stream);
      else reduce_strip<T, Op, false>(nullptr, partial, so_far, own, n, world, false);
    }
  }
}

}  // namespace ringcoll::host
