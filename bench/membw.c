// membw.c: the memory ceilings the CPU transport works under, on this machine.
//   gcc -O2 -msse2 -o /tmp/membw bench/membw.c && /tmp/membw 64 10
// memcpy (glibc), a copy with non-temporal (streaming) stores, and a plain read, over
// MiB-sized buffers: the reason host_strip.h streams large outputs. Last, the kernel's
// single copy out of another process (process_vm_readv, "CMA"): what an ordinary tensor's
// all-gather costs at best, in ringcoll's direct plans and in Open MPI's shared-memory
// transport alike, since no user-space copy can reach memory that is not mapped.
#define _GNU_SOURCE
#include <emmintrin.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

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

  pid_t holder = fork();  // a second process holding `a` (its copy-on-write twin: never written)
  if (holder == 0) {
    pause();
    _exit(0);
  }
  struct iovec mine = {b, bytes}, theirs = {a, bytes};
  // Untimed first read: pinning a page the two processes still share makes the kernel give
  // the holder its own copy first (a read pin must not see a later copy-on-write), a cost
  // a tensor never shared with a child does not pay.
  process_vm_readv(holder, &mine, 1, &theirs, 1, 0);
  t = now();
  for (int i = 0; i < iters; ++i)
    if (process_vm_readv(holder, &mine, 1, &theirs, 1, 0) != (ssize_t)bytes) {
      perror("process_vm_readv");
      break;
    }
  printf("CMA read       %4zu MiB: %6.2f GB/s copied\n", bytes >> 20, bytes * (double)iters / (now() - t) / 1e9);
  kill(holder, SIGKILL);
  waitpid(holder, NULL, 0);
  free(a);
  free(b);
  return 0;
}
