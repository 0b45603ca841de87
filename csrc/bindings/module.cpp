// module.cpp: the one PYBIND11_MODULE of ringcoll._C; each area binds itself.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void bind_core(py::module_& m);
namespace ringcoll::bindings {
void bind_tensor_checks(py::module_& m);
}
void bind_host(py::module_& m);
void bind_cuda(py::module_& m);

PYBIND11_MODULE(_C, m) {
  m.doc() = "ringcoll's compiled core: ring schedule, reductions, host and CUDA transports.";
  bind_core(m);
  ringcoll::bindings::bind_tensor_checks(m);
  bind_host(m);
  bind_cuda(m);
}
