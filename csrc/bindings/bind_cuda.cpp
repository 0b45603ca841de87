// bind_cuda.cpp: what the CUDA transport offers Python (ringcoll/cuda.py is its user), and
// host-callable twins of the kernels' strip arithmetic (strip.h) for tests/test_kernel_logic.py,
// which are bound in every build, with or without CUDA.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ringcoll/strip.h"

#if defined(RINGCOLL_WITH_CUDA)
#include "../cuda/cuda_comm.h"
#endif

namespace py = pybind11;

void bind_cuda(py::module_& m) {
  py::module_ s = m.def_submodule("strip", "strip.h, the kernels' division of a slice among blocks and vectors");
  s.def("strip_begin", &ringcoll::strip_begin, py::arg("len"), py::arg("blocks"), py::arg("block"),
        py::arg("elem_size"));
  s.def("strip_end", &ringcoll::strip_end, py::arg("len"), py::arg("blocks"), py::arg("block"), py::arg("elem_size"));
  s.def("strip_granule", &ringcoll::strip_granule, py::arg("elem_size"));
  s.def(
      "vector_split",
      [](int64_t len, int elem_size, uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t d) {
        const ringcoll::VectorSplit v = ringcoll::vector_split(len, elem_size, a, b, c, d);
        return py::make_tuple(v.head, v.vec, v.tail);
      },
      py::arg("len"), py::arg("elem_size"), py::arg("a"), py::arg("b") = 0, py::arg("c") = 0, py::arg("d") = 0,
      "(head, vec, tail) element counts for pointers a..d (0 = unused)");
  s.attr("vector_bytes") = ringcoll::kVectorBytes;

#if defined(RINGCOLL_WITH_CUDA)
  using ringcoll::cuda::CudaComm;
  m.attr("built_with_cuda") = true;
  m.attr("cuda_max_blocks") = ringcoll::cuda::kMaxBlocks;
  m.attr("cuda_max_world") = ringcoll::cuda::kMaxWorld;
  m.def("cuda_slot_bytes_for", &ringcoll::cuda::slot_bytes_for, py::arg("buffer_bytes"), py::arg("world"));
  py::class_<CudaComm>(m, "CudaComm")
      .def(py::init<int, int, int, size_t, double, bool, int>(), py::arg("rank"), py::arg("world"), py::arg("device"),
           py::arg("buffer_bytes"), py::arg("timeout"), py::arg("check_calls") = true, py::arg("variant") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("handle_bytes", [](const CudaComm& c) { return py::bytes(c.handle_bytes()); })
      .def("open_peers", &CudaComm::open_peers, py::arg("handles"), py::call_guard<py::gil_scoped_release>())
      .def("all_reduce", &CudaComm::all_reduce, py::arg("input"), py::arg("output"), py::arg("count"), py::arg("dtype"),
           py::arg("op"), py::arg("stream"), py::arg("join") = true, py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter", &CudaComm::reduce_scatter, py::arg("input"), py::arg("output"), py::arg("output_count"),
           py::arg("dtype"), py::arg("op"), py::arg("stream"), py::arg("join") = true,
           py::call_guard<py::gil_scoped_release>())
      .def("all_gather", &CudaComm::all_gather, py::arg("input"), py::arg("output"), py::arg("input_count"),
           py::arg("dtype"), py::arg("stream"), py::arg("join") = true, py::call_guard<py::gil_scoped_release>())
      .def("check_error", &CudaComm::check_error)
      .def("synchronize", &CudaComm::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("close", &CudaComm::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("stream_handle", &CudaComm::stream_handle)
      .def_property_readonly("rank", &CudaComm::rank)
      .def_property_readonly("world", &CudaComm::world)
      .def_property_readonly("device", &CudaComm::device)
      .def_property_readonly("slot_bytes", &CudaComm::slot_bytes)
      .def_property_readonly("variant", &CudaComm::variant)
      .def_property_readonly("check_calls", &CudaComm::check_calls)
      .def_property_readonly("broken", &CudaComm::broken)
      .def_property_readonly("broken_reason", &CudaComm::broken_reason)
      .def_property("timeout", &CudaComm::timeout, &CudaComm::set_timeout);
#else
  m.attr("built_with_cuda") = false;
#endif
}
