// ring_kernels.cu: the ring collectives on the GPU. The step loop is ring_loop.h's run_ring,
// the same template the CPU transport runs; this file supplies the device execution context.
//
// The algorithm, for P ranks (ring.h has the chunk indexing and the picture):
//   reduce-scatter  P-1 steps: at step s rank k reads chunk k-s-2 from its left neighbour's
//                   buffer, adds its own copy and (but at the last step) puts the sum in its
//                   own buffer for its right neighbour. After P-1 steps rank k holds chunk k
//                   reduced over all ranks.
//   all-gather      P-1 steps: finished chunks travel round the ring, each rank copying what
//                   it receives into its output and on to its right neighbour.
//   all-reduce      reduce-scatter then all-gather: 2(P-1)/P * n elements sent per rank.
// The message is cut into slices that fit one slot of the registered buffer (two banks, so
// slice j+1 fills one bank while slice j is read from the other).
//
// Variants (RINGCOLL_CUDA_KERNEL, chosen per communicator; all ranks must agree):
//   naive   one thread block, scalar element loops. Easiest to read and to check.
//   fused   kMaxBlocks thread blocks, each owning a strip of every chunk slice (strip.h)
//           with its own flags, so blocks never wait for one another; 16-byte vector
//           loads/stores wherever the pointers allow, a scalar head and tail elsewhere.
// Both are one launch per collective (every ring step of every slice inside the kernel)
// and compile from the same template: the variant is a launch shape and a runtime flag,
// which keeps the number of instantiations (and the build time) at one per (dtype, op).
//
// Memory ordering. Within a block, one thread (thread 0) does every flag access:
//   publish:  all threads store their part of the data; __syncthreads(); thread 0 does a
//             st.release.sys of the flag. bar.sync orders the other threads' stores before
//             thread 0's subsequent operations at CTA scope, and PTX release is cumulative:
//             writes observed-before the release by the releasing thread (which includes
//             those ordered before it by the barrier) become visible, at system scope, to
//             whoever acquires the flag. This is the pattern the PTX memory model's
//             causality order is built for (barrier then release), and the one vLLM's and
//             mscclpp's one-writer flags rely on.
//   wait:     thread 0 polls with ld.acquire.sys until the value arrives; __syncthreads();
//             the other threads then read the data: acquire -> barrier is again a causality
//             chain, so their reads see what the peer published.
//   consumed: the same as publish, for reads: a peer overwrites a slot only after acquiring
//             our `consumed`, which we release after a barrier that follows all our reads.
// Peer data is read with plain (weak, coherent) loads, never __ldg / const __restrict__:
// the same addresses are rewritten every step, and the non-coherent read-only path could
// serve a stale line.
//
// Waits are bounded by the communicator's timeout, measured with %globaltimer. A block
// that gives up records (rank, peer, step, slice, flag values) in its host-mapped
// ErrorRecord and returns; the host raises at its next check (CudaComm::check_error).
#include <cuda_runtime.h>

#include "ring_kernels.h"
#include "ringcoll/check.h"
#include "ringcoll/flags.h"
#include "ringcoll/reduce.h"
#include "ringcoll/ring_loop.h"
#include "ringcoll/strip.h"

namespace ringcoll::cuda {
namespace {

constexpr int kThreads = 512;

// 16 bytes viewed as elements of T.
template <typename T>
union Pack {
  static constexpr int kElems = kVectorBytes / sizeof(T);
  uint4 raw;
  T elems[kElems];
};

__device__ inline uint4 load16(const void* p) { return *static_cast<const uint4*>(p); }
__device__ inline void store16(void* p, uint4 v) { *static_cast<uint4*>(p) = v; }

// dst (if any) and dst2 (if any) = src over [0, len), by all threads of the block.
template <typename T>
__device__ void copy_range(T* dst, T* dst2, const T* src, int64_t len, bool vectorise) {
  if (dst2 == src) dst2 = nullptr;  // in place: the value is already there
  if (dst == nullptr && dst2 == nullptr) return;
  const VectorSplit split = vectorise ? vector_split(len, sizeof(T), reinterpret_cast<uintptr_t>(dst),
                                                     reinterpret_cast<uintptr_t>(dst2), reinterpret_cast<uintptr_t>(src))
                                      : VectorSplit{len, 0, 0};
  const int64_t tid = threadIdx.x, stride = blockDim.x;
  constexpr int64_t kPer = Pack<T>::kElems;
  for (int64_t v = tid; v < split.vec / kPer; v += stride) {
    const int64_t i = split.head + v * kPer;
    const uint4 x = load16(src + i);
    if (dst != nullptr) store16(dst + i, x);
    if (dst2 != nullptr) store16(dst2 + i, x);
  }
  for (int64_t k = tid; k < split.head + split.tail; k += stride) {
    const int64_t i = k < split.head ? k : k + split.vec;
    const T x = src[i];
    if (dst != nullptr) dst[i] = x;
    if (dst2 != nullptr) dst2[i] = x;
  }
}

template <typename T, class Op, bool kFinal>
__device__ inline T combine(T recv, T own, int world) {
  if constexpr (kFinal) return combine_final_element<T, Op>(recv, own, world);
  else return combine_element<T, Op>(recv, own);
}

// to_right (if any) and to_output (if any) = recv op own over [0, len). `own` may alias
// `to_output` (in place): each element is read before it is written, by the same thread.
template <typename T, class Op, bool kFinal>
__device__ void reduce_range(T* to_right, T* to_output, const T* recv, const T* own, int64_t len, int world,
                             bool vectorise) {
  const VectorSplit split =
      vectorise ? vector_split(len, sizeof(T), reinterpret_cast<uintptr_t>(to_right), reinterpret_cast<uintptr_t>(to_output),
                               reinterpret_cast<uintptr_t>(recv), reinterpret_cast<uintptr_t>(own))
                : VectorSplit{len, 0, 0};
  const int64_t tid = threadIdx.x, stride = blockDim.x;
  constexpr int64_t kPer = Pack<T>::kElems;
  for (int64_t v = tid; v < split.vec / kPer; v += stride) {
    const int64_t i = split.head + v * kPer;
    Pack<T> a, b, r;
    a.raw = load16(recv + i);
    b.raw = load16(own + i);
#pragma unroll
    for (int e = 0; e < Pack<T>::kElems; ++e) r.elems[e] = combine<T, Op, kFinal>(a.elems[e], b.elems[e], world);
    if (to_right != nullptr) store16(to_right + i, r.raw);
    if (to_output != nullptr) store16(to_output + i, r.raw);
  }
  for (int64_t k = tid; k < split.head + split.tail; k += stride) {
    const int64_t i = k < split.head ? k : k + split.vec;
    const T x = combine<T, Op, kFinal>(recv[i], own[i], world);
    if (to_right != nullptr) to_right[i] = x;
    if (to_output != nullptr) to_output[i] = x;
  }
}

__device__ inline uint64_t* flag_at(const char* base, int block, int which) {
  // which: 0 published, 1 consumed; each on its own 128-byte line.
  return reinterpret_cast<uint64_t*>(const_cast<char*>(base) + (2 * block + which) * kFlagStride);
}

// The device execution context of run_ring (interface: ring_loop.h). Every thread of the
// block holds its own identical copy of the bookkeeping (step base, last publication per
// slot): all threads run the same loop, so the copies agree without any sharing.
template <typename T, class Op>
class DeviceRingContext {
 public:
  __device__ DeviceRingContext(const RingParams& p, int* failed, bool vectorise)
      : p_(p), failed_(failed), vectorise_(vectorise), block_(blockIdx.x), blocks_(gridDim.x),
        slice_elems_(p.slot_bytes / static_cast<int64_t>(sizeof(T))) {
    const uint64_t* state = p.state + static_cast<int64_t>(block_) * kStateWords;
    base_ = state[0];
    for (int s = 0; s < kBanks * p.world; ++s) pubs_[s] = state[1 + s];
  }
  __device__ void save() const {
    uint64_t* state = p_.state + static_cast<int64_t>(block_) * kStateWords;
    state[0] = base_;
    for (int s = 0; s < kBanks * p_.world; ++s) state[1 + s] = pubs_[s];
  }

  __device__ int rank() const { return p_.rank; }
  __device__ int world() const { return p_.world; }
  __device__ int banks() const { return kBanks; }
  __device__ int64_t slice_elems() const { return slice_elems_; }
  __device__ uint64_t& step_base() { return base_; }
  __device__ uint64_t& last_publication(int slot) { return pubs_[slot]; }
  __device__ void set_position(int64_t slice, int step) { slice_ = slice, step_ = step; }

  __device__ T* my_slot(int bank, int c) const { return slot_in(p_.my_base, bank, c); }
  __device__ const T* left_slot(int bank, int c) const { return slot_in(p_.left_base, bank, c); }
  __device__ const T* input_at(int c, int64_t offset) const {
    return static_cast<const T*>(p_.input) + offset +
           (p_.collective == static_cast<int>(Collective::kAllGather) ? 0 : chunk_begin(p_.count, p_.world, c));
  }
  __device__ T* output_at(int c, int64_t offset) const {
    return static_cast<T*>(p_.output) + offset +
           (p_.collective == static_cast<int>(Collective::kReduceScatter) ? 0 : chunk_begin(p_.count, p_.world, c));
  }

  // This block's strip of [0, len), then the block's threads share it.
  __device__ void copy(T* to_right, T* to_output, const T* src, int64_t len) const {
    const int64_t b = strip_begin(len, blocks_, block_, sizeof(T)), e = strip_end(len, blocks_, block_, sizeof(T));
    if (e <= b) return;
    copy_range<T>(to_right ? to_right + b : nullptr, to_output ? to_output + b : nullptr, src + b, e - b, vectorise_);
  }
  __device__ void reduce(T* to_right, T* to_output, const T* recv, const T* own, int64_t len, bool is_final) const {
    const int64_t b = strip_begin(len, blocks_, block_, sizeof(T)), e = strip_end(len, blocks_, block_, sizeof(T));
    if (e <= b) return;
    T* r = to_right ? to_right + b : nullptr;
    T* o = to_output ? to_output + b : nullptr;
    if (is_final) reduce_range<T, Op, true>(r, o, recv + b, own + b, e - b, p_.world, vectorise_);
    else reduce_range<T, Op, false>(r, o, recv + b, own + b, e - b, p_.world, vectorise_);
  }

  __device__ bool wait_left_published(uint64_t v) {
    return wait(flag_at(p_.left_base, block_, 0), v, left_neighbour(p_.rank, p_.world), 0);
  }
  __device__ bool wait_right_consumed(uint64_t v) {
    return wait(flag_at(p_.right_base, block_, 1), v, right_neighbour(p_.rank, p_.world), 1);
  }
  // See the file comment for why barrier + one release store orders every thread's writes.
  __device__ void publish(uint64_t v) { release(flag_at(p_.my_base, block_, 0), v); }
  __device__ void mark_consumed(uint64_t v) { release(flag_at(p_.my_base, block_, 1), v); }

 private:
  __device__ T* slot_in(const char* base, int bank, int c) const {
    return reinterpret_cast<T*>(const_cast<char*>(base) + kFlagAreaBytes +
                                static_cast<size_t>(slot_index(bank, c, p_.world)) * p_.slot_bytes);
  }
  __device__ void release(uint64_t* flag, uint64_t v) {
    __syncthreads();
    if (threadIdx.x == 0) flag_store_release(flag, v);
  }
  // Thread 0 polls (bounded by the timeout), then the block learns the outcome together.
  __device__ bool wait(const uint64_t* flag, uint64_t target, int peer, int consume) {
    if (threadIdx.x == 0) {
      uint64_t seen = flag_load_acquire(flag);
      if (seen < target) {
        const uint64_t start = device_now_ns();
        for (unsigned polls = 0;; ++polls) {
          if (polls > 64) __nanosleep(200);  // a long wait: leave issue slots to the peer
          seen = flag_load_acquire(flag);
          if (seen >= target) break;
          const uint64_t waited = device_now_ns() - start;
          if (waited > p_.timeout_ns) {
            ErrorRecord* rec = p_.errors + block_;
            volatile ErrorRecord* out = rec;
            out->rank = p_.rank, out->peer = peer, out->block = block_, out->waiting_for_consume = consume;
            out->step = step_, out->slice = slice_, out->expected = target, out->seen = seen, out->waited_ns = waited;
            __threadfence_system();
            out->valid = 1;
            __threadfence_system();
            *failed_ = 1;
            break;
          }
        }
      }
    }
    __syncthreads();
    const bool ok = *failed_ == 0;
    __syncthreads();  // every thread has read *failed_ before thread 0 may set it in a later wait
    return ok;
  }

  RingParams p_;
  int* failed_;  // shared memory: set by thread 0 when a wait gave up
  bool vectorise_;
  int block_, blocks_;
  int64_t slice_elems_;
  uint64_t base_ = 0;
  uint64_t pubs_[kBanks * kMaxWorld];
  int64_t slice_ = 0;
  int step_ = -1;
};

template <typename T, class Op>
__global__ void __launch_bounds__(kThreads) ring_kernel(RingParams p, bool vectorise) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  DeviceRingContext<T, Op> ctx(p, &failed, vectorise);
  const bool ok = run_ring(ctx, static_cast<Collective>(p.collective), p.count);
  // A block that gave up leaves its bookkeeping stale: the communicator is broken anyway.
  if (ok && threadIdx.x == 0) ctx.save();
}

}  // namespace

void launch_ring(const RingParams& params, int dtype, int op, int blocks, bool vectorise, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (params.collective == static_cast<int>(Collective::kAllGather)) {
    // All-gather only moves bytes: one instantiation serves every dtype.
    ring_kernel<uint8_t, SumOp><<<blocks, kThreads, 0, s>>>(params, vectorise);
  } else {
    dispatch_dtype_op(static_cast<DType>(dtype), static_cast<ReduceOp>(op), [&](auto t, auto o) {
      ring_kernel<decltype(t), decltype(o)><<<blocks, kThreads, 0, s>>>(params, vectorise);
    });
  }
  RINGCOLL_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ringcoll::cuda
