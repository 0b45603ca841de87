// platform.h: the one place that says how shared code is compiled for host and device.
//
// Every header in csrc/include/ringcoll/ is meant to be included by both the host backend
// (g++) and the CUDA backend (nvcc). RINGCOLL_HD marks functions usable on both sides.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define RINGCOLL_HD __host__ __device__
#define RINGCOLL_DEVICE __device__
#else
#define RINGCOLL_HD
#define RINGCOLL_DEVICE
#endif

#define RINGCOLL_INLINE RINGCOLL_HD inline
