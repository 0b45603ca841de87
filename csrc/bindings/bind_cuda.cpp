// bind_cuda.cpp: what the CUDA transport offers Python. Until the CUDA backend lands
// (csrc/cuda/), it only reports whether device code was compiled into this build.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void bind_cuda(py::module_& m) {
#if defined(RINGCOLL_WITH_CUDA)
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
}
