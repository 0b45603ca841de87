// flags.h: the flag protocol, and every wait in ringcoll. Which flag words there are, who
// writes and reads each, its values and where it lives: docs/flags.md, the one map of them.
//
// A flag is a 64-bit counter in shared (host) or IPC (device) memory with one writer. The
// writer publishes data, then stores a new, larger value with *release* ordering; a reader
// waits until it *acquires* a value >= the one it expects, then reads the data. Values only
// grow (publication, call and generation numbers of the communicator; 0 then a cause or a
// 1 for the flags set once), so no flag is ever reset and a late reader can never mistake
// an old value for a new one.
//
// Every access to a flag goes through one of the helpers below, whose names say what
// ordering they give. No bare volatile spins anywhere.
//
// Waits are bounded. On the host a wait spins briefly (cheap when the peer is running on
// another core), then yields the core (when ranks outnumber cores the peer may need this
// very core), then sleeps with growing naps; past the deadline it reports a timeout.
#pragma once

#include "ringcoll/platform.h"

#if !defined(__CUDA_ARCH__)
#include <chrono>
#include <thread>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#endif

namespace ringcoll {

// Which threads a flag's release and acquire order memory for (PTX scopes). kSystem: any
// thread of any GPU or CPU, what a flag read across devices or by a host needs. kDevice:
// the threads of one GPU, enough when writer and reader run on the same GPU (even in
// different processes: scopes are about where threads run, not which process owns them),
// and cheaper: the ordering is settled at the GPU's L2, never across the interconnect.
// (The PTX memory model does not spell out that kDevice orders grids of different processes;
// RINGCOLL_CUDA_FLAG_SCOPE=system makes the CUDA ring use kSystem there too: kernel_abi.h.)
// Host code (C++ atomics) has no scopes: both mean the same there.
enum class FlagScope : int { kSystem = 0, kDevice = 1 };

// Store `value` after all earlier writes of this thread (the data) are visible to any
// reader in `scope` that acquires it.
RINGCOLL_INLINE void flag_store_release(uint64_t* flag, uint64_t value, FlagScope scope = FlagScope::kSystem) {
#if defined(__CUDA_ARCH__)
  if (scope == FlagScope::kDevice)
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
  else
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
#else
  (void)scope;
  __atomic_store_n(flag, value, __ATOMIC_RELEASE);
#endif
}

// Load a flag; reads of the data it guards, issued after this, see what was published by
// a writer in `scope`.
RINGCOLL_INLINE uint64_t flag_load_acquire(const uint64_t* flag, FlagScope scope = FlagScope::kSystem) {
#if defined(__CUDA_ARCH__)
  uint64_t value;
  if (scope == FlagScope::kDevice)
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(value) : "l"(flag) : "memory");
  else
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(flag) : "memory");
  return value;
#else
  (void)scope;
  return __atomic_load_n(flag, __ATOMIC_ACQUIRE);
#endif
}

// Load a flag with no ordering: for diagnostics (which value did we see?), never to guard data.
RINGCOLL_INLINE uint64_t flag_load_relaxed(const uint64_t* flag) {
#if defined(__CUDA_ARCH__)
  uint64_t value;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(flag) : "memory");
  return value;
#else
  return __atomic_load_n(flag, __ATOMIC_RELAXED);
#endif
}

// Set a flag that is written once (the first writer wins; later ones leave it), with
// release ordering. For flags several writers may race to set, like a rank's `aborted`.
RINGCOLL_INLINE void flag_set_once(uint64_t* flag, uint64_t value) {
#if defined(__CUDA_ARCH__)
  __threadfence_system();
  atomicCAS_system(reinterpret_cast<unsigned long long*>(flag), 0ULL, static_cast<unsigned long long>(value));
#else
  uint64_t expected = 0;
  __atomic_compare_exchange_n(flag, &expected, value, false, __ATOMIC_RELEASE, __ATOMIC_RELAXED);
#endif
}

// Add to a counter that several threads of one device bump, ordered both ways: what this
// thread did before is visible to whoever sees the sum, and this thread sees what those
// that added before it did. Returns the value before the addition. Device scope: the
// counters it serves (device_ring.h's finished blocks) are private to one GPU.
RINGCOLL_INLINE uint64_t counter_add_acq_rel(uint64_t* counter, uint64_t value) {
#if defined(__CUDA_ARCH__)
  uint64_t before;
  asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], %2;" : "=l"(before) : "l"(counter), "l"(value) : "memory");
  return before;
#else
  return __atomic_fetch_add(counter, value, __ATOMIC_ACQ_REL);
#endif
}

// Plain words read or written while another thread may race them (the fields a sequence
// lock guards): no tearing, no ordering; pair them with the fences below.
template <typename T>
RINGCOLL_INLINE void word_store_relaxed(T* p, T value) {
#if defined(__CUDA_ARCH__)
  *static_cast<volatile T*>(p) = value;
#else
  __atomic_store_n(p, value, __ATOMIC_RELAXED);
#endif
}
template <typename T>
RINGCOLL_INLINE T word_load_relaxed(const T* p) {
#if defined(__CUDA_ARCH__)
  return *static_cast<const volatile T*>(p);
#else
  return __atomic_load_n(p, __ATOMIC_RELAXED);
#endif
}
// Fences at system scope (on the device: fence.sc.sys, stronger than needed, the only
// system-scope fence CUDA C++ exposes directly).
RINGCOLL_INLINE void fence_release() {
#if defined(__CUDA_ARCH__)
  __threadfence_system();
#else
  __atomic_thread_fence(__ATOMIC_RELEASE);
#endif
}
RINGCOLL_INLINE void fence_acquire() {
#if defined(__CUDA_ARCH__)
  __threadfence_system();
#else
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
#endif
}

#if defined(__CUDACC__)
// Nanoseconds from the GPU's global timer: the device-side clock for bounded waits.
__device__ inline uint64_t device_now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif

#if !defined(__CUDA_ARCH__)

// How a host wait spends its time before giving up. Phases are bounded in time, not in
// iterations, so the policy means the same on every CPU. Tuned by the transport (see
// host_wait_policy in csrc/host/host_comm.cpp), kept here so every host wait is the same.
struct WaitPolicy {
  int64_t spin_ns = 50000;        // pause-loop polls: cheapest wake-up, when the peer has a core
  int64_t yield_ns = 2000000;     // sched_yield polls: lets a peer sharing this core run
  int64_t first_sleep_ns = 5000;  // then naps, growing x2 from here ...
  int64_t max_sleep_ns = 200000;  // ... up to this: bounds the wake-up delay of a long wait
  double timeout_seconds = 300.0;
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

enum class WaitResult { kReady, kTimedOut, kAborted };

// Wait until flag >= target. Every `check_every` sleeps `still_hopeful()` is asked whether
// waiting can still succeed (a dead peer cannot publish); it returns false to abort early.
template <typename StillHopeful>
WaitResult wait_flag_at_least(const uint64_t* flag, uint64_t target, const WaitPolicy& policy,
                              StillHopeful&& still_hopeful) {
  if (flag_load_acquire(flag) >= target) return WaitResult::kReady;
  // Before giving up, read the flag once more: a peer may publish between our last read and
  // the deadline, or publish and then abort (a peer's abort is stored after everything it
  // published, so once still_hopeful() has acquired it, the publication is visible too).
  auto give_up = [&](WaitResult why) { return flag_load_acquire(flag) >= target ? WaitResult::kReady : why; };
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(policy.timeout_seconds));
  const auto spin_end = Clock::now() + std::chrono::nanoseconds(policy.spin_ns);
  for (int i = 1; policy.spin_ns > 0; ++i) {
    cpu_relax();
    if (flag_load_acquire(flag) >= target) return WaitResult::kReady;
    if ((i & 255) == 0 && Clock::now() > spin_end) break;
  }
  const auto yield_end = Clock::now() + std::chrono::nanoseconds(policy.yield_ns);
  for (int i = 1; policy.yield_ns > 0; ++i) {
    std::this_thread::yield();
    if (flag_load_acquire(flag) >= target) return WaitResult::kReady;
    if ((i & 15) == 0) {
      const auto now = Clock::now();
      if (now > deadline) return give_up(WaitResult::kTimedOut);
      if (now > yield_end) break;
    }
  }
  int64_t nap_ns = policy.first_sleep_ns;
  auto next_health_check = Clock::now();
  for (;;) {
    std::this_thread::sleep_for(std::chrono::nanoseconds(nap_ns));
    if (flag_load_acquire(flag) >= target) return WaitResult::kReady;
    const auto now = Clock::now();
    if (now > deadline) return give_up(WaitResult::kTimedOut);
    if (now >= next_health_check) {
      if (!still_hopeful()) return give_up(WaitResult::kAborted);
      next_health_check = now + std::chrono::milliseconds(50);
    }
    nap_ns = nap_ns * 2 < policy.max_sleep_ns ? nap_ns * 2 : policy.max_sleep_ns;
  }
}

#endif  // !__CUDA_ARCH__

}  // namespace ringcoll
