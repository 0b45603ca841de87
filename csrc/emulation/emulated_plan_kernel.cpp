// emulated_plan_kernel.cpp: the plan kernel (device_plan.h's plan_block) launched on the CPU
// (emulated_launch.h), for every dtype and op.
#include "emulated_launch.h"

#include "../cuda/device_plan.h"

namespace ringcoll::emulation {

void launch_plan_kernel(const cuda::RingParams& p, int blocks, int threads, bool vectorise) {
  dispatch_call(p.call, [&](auto t, auto o) {
    launch_blocks<cuda::PlanShared>(p, blocks, threads, vectorise, cuda::plan_block<decltype(t), decltype(o)>);
  });
}

}  // namespace ringcoll::emulation
