// tensor_checks.cpp: see tensor_checks.h.
#include "tensor_checks.h"

#include <pybind11/stl.h>

#include <iomanip>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "ringcoll/reduce.h"

namespace ringcoll::bindings {
namespace {

// What ringcoll/_types.py registers at import: torch's objects, known here by identity.
struct Registry {
  py::object tensor_type;  // torch.Tensor
  py::object cpu_device;   // the one torch.device("cpu") communicators hold
  py::object resolve_op;   // _types.reduce_op(op_name, op) -> ringcoll.ReduceOp, or raises
  std::vector<std::pair<py::object, int>> dtypes;  // torch.dtype -> reduce.h's DType code
  std::vector<std::pair<py::object, int>> ops;     // ringcoll's and torch's ReduceOp objects -> code
  // Attribute names, interned once.
  py::object is_cpu{py::str("is_cpu")}, device{py::str("device")}, is_contiguous{py::str("is_contiguous")},
      dtype{py::str("dtype")}, data_ptr{py::str("data_ptr")}, numel{py::str("numel")};
};
// Never freed: Python objects must not be released after the interpreter has finalized.
Registry* registry = nullptr;

const Registry& known() {
  if (registry == nullptr) throw std::logic_error("ringcoll._C: configure_tensor_checks was never called");
  return *registry;
}

template <typename E, typename... Parts>
[[noreturn]] void fail(Parts&&... parts) {
  std::ostringstream msg;
  (msg << ... << parts);
  throw E(msg.str());
}

py::object checked(PyObject* result) {
  if (result == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(result);
}
py::object get(py::handle t, const py::object& name) { return checked(PyObject_GetAttr(t.ptr(), name.ptr())); }
py::object call(py::handle t, const py::object& name) {
  return checked(PyObject_CallMethodNoArgs(t.ptr(), name.ptr()));
}
bool truth(const py::object& value) {
  const int v = PyObject_IsTrue(value.ptr());
  if (v < 0) throw py::error_already_set();
  return v != 0;
}
int64_t as_int(const py::object& value) {
  const long long v = PyLong_AsLongLong(value.ptr());
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}
std::string text(py::handle o) { return py::str(o); }

int item_size(int dtype) { return dtype_size(static_cast<DType>(dtype)); }

// Whether two byte ranges share an address (empty ones never do).
bool overlaps(uintptr_t a, uint64_t a_bytes, uintptr_t b, uint64_t b_bytes) {
  return a_bytes > 0 && b_bytes > 0 && a < b + b_bytes && b < a + a_bytes;
}

// The output size `sizes` asks for, as check_pair's message says it.
std::string expected_output(PairSizes sizes, int64_t input_count, int world) {
  std::ostringstream s;
  if (sizes == PairSizes::kEqual) {
    s << "input size (" << input_count << ")";
  } else if (sizes == PairSizes::kGather) {
    s << "world_size (" << world << ") x input size (" << input_count << ") = " << input_count * world;
  } else {  // Python's {:g}: six significant digits
    s << "input size (" << input_count << ") / world_size (" << world
      << ") = " << std::setprecision(6) << static_cast<double>(input_count) / world;
  }
  return s.str();
}

std::string supported_dtypes() {
  std::string names;
  for (int code = 0; code < kNumDTypes; ++code)
    names += (code ? ", " : "") + std::string(dtype_info(static_cast<DType>(code)).name);
  return names;
}

}  // namespace

py::handle cpu_device() { return known().cpu_device; }

bool same_layout(py::handle tensors, py::handle layout) {
  const Registry& r = known();
  const auto ts = py::reinterpret_borrow<py::tuple>(tensors);
  const auto recorded = py::reinterpret_borrow<py::tuple>(layout);
  if (ts.size() != recorded.size()) return false;
  for (size_t i = 0; i < ts.size(); ++i) {
    const auto was = py::reinterpret_borrow<py::tuple>(recorded[i]);  // (address, count, dtype)
    if (!call(ts[i], r.data_ptr).equal(was[0]) || !call(ts[i], r.numel).equal(was[1]) ||
        get(ts[i], r.dtype).ptr() != was[2].ptr())
      return false;
  }
  return true;
}

int dtype_code(const char* op, py::handle dtype) {
  for (const auto& [known_dtype, code] : known().dtypes)
    if (known_dtype.ptr() == dtype.ptr()) return code;
  fail<py::type_error>(op, ": unsupported dtype ", text(dtype), "; ringcoll supports ", supported_dtypes());
}

int op_code(const char* op, py::handle reduce_op, int dtype) {
  int code = -1;
  for (const auto& [known_op, known_code] : known().ops)
    if (known_op.ptr() == reduce_op.ptr()) code = known_code;
  if (code < 0) code = as_int(known().resolve_op(op, reduce_op));  // raises naming the op if it is none of ours
  if (static_cast<ReduceOp>(code) == ReduceOp::kAvg && !dtype_is_floating(static_cast<DType>(dtype)))
    fail<py::value_error>(op, ": ReduceOp.AVG is only defined for floating dtypes, not torch.",
                          dtype_info(static_cast<DType>(dtype)).name);
  return code;
}

TensorFacts check_tensor(const char* op, const char* what, py::handle t, py::handle device) {
  const Registry& r = known();
  const int is_tensor = PyObject_IsInstance(t.ptr(), r.tensor_type.ptr());
  if (is_tensor < 0) throw py::error_already_set();
  if (!is_tensor)
    fail<py::type_error>(op, ": ", what, " must be a torch.Tensor, got ", text(py::type::handle_of(t).attr("__name__")));
  const bool on_device = device.ptr() == r.cpu_device.ptr() ? truth(get(t, r.is_cpu))
                                                            : get(t, r.device).equal(device);
  if (!on_device)
    fail<py::value_error>(op, ": ", what, " is on ", text(get(t, r.device)), ", but this communicator serves ",
                          text(device));
  if (!truth(call(t, r.is_contiguous))) fail<py::value_error>(op, ": ", what, " must be contiguous");
  const int dtype = dtype_code(op, get(t, r.dtype));
  const auto address = reinterpret_cast<uintptr_t>(PyLong_AsVoidPtr(call(t, r.data_ptr).ptr()));
  if (PyErr_Occurred()) throw py::error_already_set();
  return {dtype, address, as_int(call(t, r.numel))};
}

PairFacts check_pair(const char* op, py::handle output, py::handle input, PairSizes sizes, py::handle device,
                     int rank, int world) {
  const TensorFacts out = check_tensor(op, "output", output, device);
  const TensorFacts in = check_tensor(op, "input", input, device);
  if (out.dtype != in.dtype)  // one code per dtype
    fail<py::type_error>(op, ": output dtype ", text(get(output, known().dtype)), " differs from input dtype ",
                         text(get(input, known().dtype)));
  const bool scatter = sizes == PairSizes::kScatter;
  const TensorFacts& whole = scatter ? in : out;
  const TensorFacts& part = scatter ? out : in;
  const int64_t chunks = sizes == PairSizes::kEqual ? 1 : world;
  if (whole.count != part.count * chunks)  // in integers: exact for any world size
    fail<py::value_error>(op, ": output has ", out.count, " elements, expected ",
                          expected_output(sizes, in.count, world));
  // In place means the smaller tensor is exactly this rank's chunk of the larger one (for
  // equal sizes: the same tensor); otherwise they must not share a byte.
  const uint64_t item = static_cast<uint64_t>(item_size(in.dtype));
  const uint64_t chunk_offset = sizes == PairSizes::kEqual ? 0 : static_cast<uint64_t>(rank * part.count) * item;
  if (part.address != whole.address + chunk_offset &&
      overlaps(whole.address, static_cast<uint64_t>(whole.count) * item, part.address,
               static_cast<uint64_t>(part.count) * item))
    fail<py::value_error>(op, ": output and input overlap; in place, the smaller one must be exactly this rank's "
                          "chunk (rank ", rank, ") of the larger one");
  return {in.dtype, in.address, out.address, in.count, out.count};
}

void bind_tensor_checks(py::module_& m) {
  m.attr("EQUAL_SIZES") = static_cast<int>(PairSizes::kEqual);
  m.attr("GATHER_SIZES") = static_cast<int>(PairSizes::kGather);
  m.attr("SCATTER_SIZES") = static_cast<int>(PairSizes::kScatter);
  m.def(
      "configure_tensor_checks",
      [](py::object tensor_type, py::object cpu_device, py::object resolve_op,
         std::vector<std::pair<py::object, int>> dtypes, std::vector<std::pair<py::object, int>> ops) {
        auto* fresh = new Registry{std::move(tensor_type), std::move(cpu_device), std::move(resolve_op),
                                   std::move(dtypes), std::move(ops)};
        std::swap(fresh, registry);
        delete fresh;  // a second configuration (a reload) replaces the first, with the GIL held
      },
      py::arg("tensor_type"), py::arg("cpu_device"), py::arg("resolve_op"), py::arg("dtypes"), py::arg("ops"),
      "ringcoll/_types.py, at import: torch.Tensor, the CPU device, reduce_op, and the (object, code) pairs "
      "of every dtype and ReduceOp object known by identity");
  m.def(
      "check_tensor",
      [](const std::string& op, const std::string& what, py::handle t, py::handle device) {
        const TensorFacts f = check_tensor(op.c_str(), what.c_str(), t, device);
        return py::make_tuple(f.dtype, f.address, f.count);
      },
      py::arg("op"), py::arg("what"), py::arg("tensor"), py::arg("device"),
      "(dtype code, address, element count) of a valid tensor; TypeError / ValueError naming the op otherwise");
  m.def(
      "check_pair",
      [](const std::string& op, py::handle output, py::handle input, int sizes, py::handle device, int rank,
         int world) {
        if (sizes < 0 || sizes > 2)
          throw py::value_error("check_pair: sizes must be EQUAL_SIZES, GATHER_SIZES or SCATTER_SIZES");
        const PairFacts f = check_pair(op.c_str(), output, input, static_cast<PairSizes>(sizes), device, rank, world);
        return py::make_tuple(f.dtype, f.input, f.input_count, f.output, f.output_count);
      },
      py::arg("op"), py::arg("output"), py::arg("input"), py::arg("sizes"), py::arg("device"), py::arg("rank"),
      py::arg("world"), "(dtype code, input address, input count, output address, output count)");
  m.def("same_layout", &same_layout, py::arg("tensors"), py::arg("layout"),
        "whether each tensor still has the (address, element count, dtype) recorded for it");
  m.def(
      "dtype_code", [](const std::string& op, py::handle dtype) { return dtype_code(op.c_str(), dtype); },
      py::arg("op"), py::arg("dtype"));
  m.def(
      "op_code",
      [](const std::string& op, py::handle reduce_op, int dtype) { return op_code(op.c_str(), reduce_op, dtype); },
      py::arg("op"), py::arg("reduce_op"), py::arg("dtype"));
}

}  // namespace ringcoll::bindings
