// ring_kernels.cu: the ring kernels. Each thread block runs device_ring.h's ring_block; the
// file comment there states the memory ordering and how waits give up (the algorithm is
// ring.h's).
//
// Variants (RINGCOLL_CUDA_KERNEL, chosen per communicator; all ranks must agree, and the
// mismatch check compares it):
//   fused   fused_blocks() thread blocks (kernel_abi.h: one per tile of a slice, at most one
//           per SM), each owning fixed 32 KiB tiles of every slot (strip.h)
//           with its own flags, so blocks never wait for one another; 16-byte vector
//           loads/stores wherever the pointers allow, a scalar head and tail elsewhere; one
//           launch per collective, every slice and ring step inside it.
//   naive   one thread block, scalar element loops, one launch per ring step of every slice
//           (kernel_abi.h's for_each_launch): the teaching version. It is NOT a fallback
//           for time-sliced processes: each of its launches still spins in the kernel on
//           the neighbour's flag, so a neighbour that is not running stalls it just as it
//           stalls the fused kernel (docs/cuda.md, "Several processes on one GPU").
// Both compile from the same template: the variant is a launch shape and runtime fields of
// RingParams, which keeps the instantiations (and the build time) at one per (dtype, op).
#include <cuda_runtime.h>

#include <mutex>
#include <set>

#include "device_ring.h"
#include "ring_kernels.h"
#include "ringcoll/check.h"

namespace ringcoll::cuda {
namespace {

template <typename T, class Op>
__global__ void __launch_bounds__(kTileThreads) ring_kernel(RingParams p, bool vectorise) {
  __shared__ BlockShared shared;
  ring_block<T, Op>(p, shared, vectorise);
}

}  // namespace

void launch_ring(const RingParams& params, int blocks, bool vectorise, void* stream) {
  launch_for_call(params, blocks, vectorise, stream, [](auto t, auto o) { return &ring_kernel<decltype(t), decltype(o)>; });
}

// Lazy loading. Since CUDA 12.2 the runtime loads a kernel into a context when the kernel is
// first used, not when the context is created (CUDA_MODULE_LOADING=LAZY, the default on
// Linux; EAGER restores loading everything up front). The CUDA Programming Guide's "Lazy
// Loading" chapter (12.2 edition) says the runtime gets a kernel's function
// (cuModuleGetFunction) only "when a kernel is used/referenced for the first time", and
// lists potential hazards of the change. The one that matters here is explained in NVIDIA's
// forum thread "Persistent Kernel does not work properly on some GPUs": loading a kernel
// may require synchronising the context, i.e. waiting for every kernel running in it to
// finish, so a kernel that spins until a second kernel runs can wait forever when the
// second one's launch triggers its load. The cure is to load such kernels first.
//
// A ring is that program. Rank k's kernel spins on rank k-1's flag; if rank k-1's first
// launch of some (dtype, op) has to load that instantiation and the load waits for the
// context to go idle (in-process mode: every rank's kernels share one context), the two
// wait for each other until the ring's timeout. So every instantiation is loaded here,
// before the ring exists, and no launch of the ring ever loads one.
//
// How. cudaFuncGetAttributes on an instantiation references it, so the runtime must get it
// for the current context, which loads it; among the attributes it returns is
// maxThreadsPerBlock, which cuda.h's cuFuncGetAttribute documents as one that "requires
// the function to be loaded" (cuFuncLoad being the driver's explicit form). NCCL forces
// its kernels in the same way at init (ncclInitKernelsForDevice calls cudaFuncGetAttributes
// on every kernel). That this really loads under LAZY is read from those documents, not yet
// seen on a GPU: bench/device_check.sh runs the ring with CUDA_MODULE_LOADING as found and
// prints it.
//
// One pass per (process, device): a context per device per process (the primary context,
// as torch uses), and a loaded kernel stays loaded for its lifetime. 36 instantiations of each kernel, ring and plan
// (8 dtypes x 4 ops, 4 floating dtypes x AVG; all-gather's is uint8 SUM's).
void preload_ring_kernels() {
  static std::mutex mutex;
  static std::set<int> loaded;  // devices already done in this process
  int device = 0;
  RINGCOLL_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  if (loaded.count(device)) return;
  for_each_instantiation([](auto t, auto o) { load_kernel(&ring_kernel<decltype(t), decltype(o)>); });
  preload_plan_kernels();
  loaded.insert(device);
}

}  // namespace ringcoll::cuda
