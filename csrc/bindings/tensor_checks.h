// tensor_checks.h: the argument checks of the tensor forms, written once, in C++.
//
// Every collective's tensors are checked before anything moves: a torch.Tensor on the
// communicator's device, contiguous, of a dtype ringcoll has; for a pair, one dtype, sized
// as the collective needs, and either disjoint or in place (the smaller one exactly this
// rank's chunk of the larger). ringcoll/communicator.py's ArgumentChecks calls these for
// every form and transport, and the host transport's plain calls (bind_host.cpp) run them
// and the collective in one binding call: a small call's Python layers cost more than its
// bytes (bench/small_call.py).
//
// The extension does not link libtorch, so a tensor is read through the Python C API:
// `is_cpu`, `is_contiguous()`, `dtype`, `data_ptr()`, `numel()`, each a fraction of a
// microsecond. torch's dtype and ReduceOp objects are known by identity (ringcoll/_types.py
// registers them at import: configure_tensor_checks); an op object not registered is
// resolved by _types.reduce_op, the one place that knows every spelling of an op.
// Errors are TypeError / ValueError naming the op, built only once a check has failed.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace ringcoll::bindings {

namespace py = pybind11;

// How the two tensors of a pair relate: as large as each other (all_reduce's output=),
// output = world x input (all-gather), input = world x output (reduce-scatter).
enum class PairSizes : int { kEqual = 0, kGather = 1, kScatter = 2 };

struct TensorFacts {
  int dtype;  // reduce.h's DType code
  uintptr_t address;
  int64_t count;
};

struct PairFacts {
  int dtype;
  uintptr_t input, output;
  int64_t input_count, output_count;
  bool in_place;  // the smaller tensor is this rank's chunk of the larger (equal sizes: the same tensor)
};

// `device`: the communicator's torch.device (the registered CPU device: `t.is_cpu`).
TensorFacts check_tensor(const char* op, const char* what, py::handle t, py::handle device);
PairFacts check_pair(const char* op, py::handle output, py::handle input, PairSizes sizes, py::handle device,
                     int rank, int world);
int dtype_code(const char* op, py::handle dtype);
// reduce.h's ReduceOp code of `reduce_op` for a tensor of dtype code `dtype` (AVG: floating only).
int op_code(const char* op, py::handle reduce_op, int dtype);
// Whether each of `tensors` still has the (address, element count, dtype object) that
// `layout` recorded for it when its call was prepared (Communicator.prepare_*).
bool same_layout(py::handle tensors, py::handle layout);
// The registered CPU torch.device (what a CPU communicator's `device` is).
py::handle cpu_device();

void bind_tensor_checks(py::module_& m);

}  // namespace ringcoll::bindings
