// plan_kernels.cu: the plan kernel. Each thread block runs device_plan.h's plan_block (the
// engine, its flags and why they are safe are stated there). One instantiation per (dtype,
// op), like the ring's, in a file of its own so the two compile in parallel.
#include <cuda_runtime.h>

#include "device_plan.h"
#include "ring_kernels.h"
#include "ringcoll/check.h"

namespace ringcoll::cuda {
namespace {

template <typename T, class Op>
__global__ void __launch_bounds__(kTileThreads) plan_kernel(RingParams p, bool vectorise) {
  __shared__ PlanShared shared;
  plan_block<T, Op>(p, shared, vectorise);
}

}  // namespace

void launch_plan(const RingParams& params, int blocks, bool vectorise, void* stream) {
  launch_for_call(params, blocks, vectorise, stream, [](auto t, auto o) { return &plan_kernel<decltype(t), decltype(o)>; });
}

// See preload_ring_kernels (ring_kernels.cu) for why every instantiation is loaded before
// any rank can wait on another: a plan's kernels spin on peers' flags just as the ring's do.
void preload_plan_kernels() {
  for_each_instantiation([](auto t, auto o) { load_kernel(&plan_kernel<decltype(t), decltype(o)>); });
}

}  // namespace ringcoll::cuda
