// membw.c: the memory ceilings the CPU transport works under, on this machine.
//   gcc -O2 -msse2 -o /tmp/membw bench/membw.c && /tmp/membw 64 10
// memcpy (glibc), a copy with non-temporal (streaming) stores, and a plain read, over
// MiB-sized buffers: the reason host_strip.h streams large outputs.
#include <emmintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  const size_t bytes = (size_t)atol(argc > 1 ? argv[1] : "64") << 20;
  const int iters = atoi(argc > 2 ? argv[2] : "10");
  char* a = aligned_alloc(64, bytes);
  char* b = aligned_alloc(64, bytes);
  memset(a, 1, bytes);
  memset(b, 2, bytes);

  double t = now();
  for (int i = 0; i < iters; ++i) memcpy(b, a, bytes);
  printf("memcpy         %4zu MiB: %6.2f GB/s copied\n", bytes >> 20, bytes * (double)iters / (now() - t) / 1e9);

  t = now();
  for (int i = 0; i < iters; ++i)
    for (size_t j = 0; j < bytes; j += 16)
      _mm_stream_si128((__m128i*)(b + j), _mm_load_si128((const __m128i*)(a + j)));
  _mm_sfence();
  printf("streaming copy %4zu MiB: %6.2f GB/s copied\n", bytes >> 20, bytes * (double)iters / (now() - t) / 1e9);

  volatile long long sink = 0;
  t = now();
  for (int i = 0; i < iters; ++i) {
    __m128i acc = _mm_setzero_si128();
    for (size_t j = 0; j < bytes; j += 16) acc = _mm_add_epi64(acc, _mm_load_si128((const __m128i*)(a + j)));
    sink += _mm_cvtsi128_si64(acc);
  }
  printf("read           %4zu MiB: %6.2f GB/s\n", bytes >> 20, bytes * (double)iters / (now() - t) / 1e9);
  free(a);
  free(b);
  return 0;
}
