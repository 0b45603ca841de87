// emulated_ring_kernel.cpp: the ring kernel (device_ring.h's ring_block) launched on the CPU
// (emulated_launch.h), for every dtype and op.
#include "emulated_launch.h"

#include "../cuda/device_ring.h"

namespace ringcoll::emulation {

void launch_ring_kernel(const cuda::RingParams& p, int blocks, int threads, bool vectorise) {
  dispatch_call(p.call, [&](auto t, auto o) {
    launch_blocks<cuda::BlockShared>(p, blocks, threads, vectorise, cuda::ring_block<decltype(t), decltype(o)>);
  });
}

}  // namespace ringcoll::emulation
