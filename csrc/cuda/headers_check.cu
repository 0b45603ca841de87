// headers_check.cu: compiles every shared header as device code, for every dtype and op,
// so a change to ring.h / reduce.h / flags.h / ring_loop.h that breaks the CUDA side fails
// the build (CI builds with RINGCOLL_REQUIRE_CUDA=1). The CUDA backend proper lives beside
// this file; this kernel is never launched.
#include "ringcoll/check.h"
#include "ringcoll/flags.h"
#include "ringcoll/reduce.h"
#include "ringcoll/ring.h"
#include "ringcoll/ring_loop.h"

namespace ringcoll {
namespace {

template <typename T, class Op>
__global__ void combine_kernel(T* out, const T* a, const T* b, int64_t n, int world) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = combine_final_element<T, Op>(a[i], combine_element<T, Op>(a[i], b[i]), world);
}

// The smallest device context run_ring accepts: one thread, flags in global memory.
template <typename T>
struct SingleThreadDeviceContext {
  T* mine; const T* left; const T* in; T* out; uint64_t* flags; uint64_t base = 0; uint64_t pubs[4] = {};
  int64_t count;
  __device__ int rank() const { return 0; }
  __device__ int world() const { return 2; }
  __device__ int banks() const { return 2; }
  __device__ int64_t slice_elems() const { return 64; }
  __device__ uint64_t& step_base() { return base; }
  __device__ uint64_t& last_publication(int slot) { return pubs[slot]; }
  __device__ void set_position(int64_t, int) {}
  __device__ T* my_slot(int bank, int c) const { return mine + slot_index(bank, c, 2) * 64; }
  __device__ const T* left_slot(int bank, int c) const { return left + slot_index(bank, c, 2) * 64; }
  __device__ const T* input_at(int c, int64_t off) const { return in + chunk_begin(count, 2, c) + off; }
  __device__ T* output_at(int c, int64_t off) const { return out + chunk_begin(count, 2, c) + off; }
  __device__ void copy(T* d, T* d2, const T* s, int64_t n) const {
    for (int64_t i = 0; i < n; ++i) { if (d) d[i] = s[i]; if (d2) d2[i] = s[i]; }
  }
  __device__ void reduce(T* d, T* d2, const T* r, const T* o, int64_t n, bool fin) const {
    for (int64_t i = 0; i < n; ++i) {
      const T v = fin ? combine_final_element<T, SumOp>(r[i], o[i], 2) : combine_element<T, SumOp>(r[i], o[i]);
      if (d) d[i] = v;
      if (d2) d2[i] = v;
    }
  }
  __device__ bool wait(const uint64_t* f, uint64_t v) const {
    const uint64_t start = device_now_ns();
    while (flag_load_acquire(f) < v) if (device_now_ns() - start > 1000000000ull) return false;
    return true;
  }
  __device__ bool wait_left_published(uint64_t v) { return wait(flags + 0, v); }
  __device__ bool wait_right_consumed(uint64_t v) { return wait(flags + 1, v); }
  __device__ void publish(uint64_t v) { flag_store_release(flags + 2, v); }
  __device__ void mark_consumed(uint64_t v) { flag_store_release(flags + 3, v); }
};

template <typename T>
__global__ void ring_loop_kernel(SingleThreadDeviceContext<T> ctx, int* ok) {
  *ok = run_ring(ctx, Collective::kAllReduce, ctx.count) ? 1 : 0;
}

}  // namespace

// Taking the kernels' addresses makes nvcc compile them for every architecture.
int instantiate_headers_check() {
  int kernels = 0;
  for (int d = 0; d < kNumDTypes; ++d)
    for (int op = 0; op < kNumReduceOps; ++op)
      if (is_supported(static_cast<DType>(d), static_cast<ReduceOp>(op)))
        kernels += dispatch_dtype_op(static_cast<DType>(d), static_cast<ReduceOp>(op), [](auto t, auto o) {
          return &combine_kernel<decltype(t), decltype(o)> != nullptr ? 1 : 0;
        });
  kernels += &ring_loop_kernel<float> != nullptr ? 1 : 0;
  kernels += &ring_loop_kernel<Half> != nullptr ? 1 : 0;
  return kernels;
}

}  // namespace ringcoll
