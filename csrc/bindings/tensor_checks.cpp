// tensor_checks.cpp: see tensor_checks.h.
#include "tensor_checks.h"

#include <pybind11/stl.h>

#include <iomanip>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "dlpack_exchange.h"
#include "ringcoll/reduce.h"

namespace ringcoll::bindings {
namespace {

// What ringcoll/_types.py registers at import: torch's objects, known here by identity.
struct Registry {
  py::object tensor_type;  // torch.Tensor
  py::object parameter_type;  // torch.nn.Parameter (read by DLPack too: a plain subclass)
  py::object cpu_device;   // the one torch.device("cpu") communicators hold
  py::object resolve_op;   // _types.reduce_op(op_name, op) -> ringcoll.ReduceOp, or raises
  std::vector<std::pair<py::object, int>> dtypes;  // torch.dtype -> reduce.h's DType code
  std::vector<std::pair<py::object, int>> ops;     // ringcoll's and torch's ReduceOp objects -> code
  // DLPack's exchange table (dlpack_exchange.h), or null where torch has none; its capsule
  // is held so the table outlives us. dlpack_dtypes: DLPack's (code, bits) -> DType code,
  // learnt at configuration by exporting an empty tensor of each registered dtype.
  py::object dlpack_capsule;
  const dlpack::ExchangeApi* dlpack = nullptr;
  std::vector<std::pair<uint16_t, int>> dlpack_dtypes;
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

uint16_t dlpack_dtype_key(const dlpack::DLDataType& t) { return static_cast<uint16_t>(t.code << 8 | t.bits); }

// One C call instead of five attribute reads (dlpack_exchange.h), for a tensor of exactly
// torch.Tensor or nn.Parameter (a subclass may define its own data_ptr or __torch_function__,
// which only the attribute reads honour). False wherever it cannot vouch for the tensor:
// no table, another type, an export error (sparse, meta), another device, a dtype ringcoll
// lacks, not contiguous; then the attribute reads decide and word any error, so the
// messages and what is accepted are theirs. torch's rule for contiguous: every dimension
// of size other than 1 has the stride of the dimensions after it; an empty tensor is.
bool read_through_dlpack(const Registry& r, py::handle t, TensorFacts* facts) {
  const auto* type = reinterpret_cast<PyObject*>(Py_TYPE(t.ptr()));
  if (r.dlpack == nullptr || (type != r.tensor_type.ptr() && type != r.parameter_type.ptr())) return false;
  dlpack::DLTensor d{};
  if (r.dlpack->dltensor_from_py_object_no_sync(t.ptr(), &d) != 0) {
    PyErr_Clear();
    return false;
  }
  if (d.device.device_type != dlpack::kDLCPU || d.dtype.lanes != 1) return false;
  int dtype = -1;
  for (const auto& [key, code] : r.dlpack_dtypes)
    if (key == dlpack_dtype_key(d.dtype)) dtype = code;
  if (dtype < 0) return false;
  int64_t count = 1;
  bool contiguous = true;
  for (int i = d.ndim - 1; i >= 0; --i) {
    if (d.shape[i] != 1 && d.strides[i] != count) contiguous = false;
    count *= d.shape[i];
  }
  if (!contiguous && count != 0) return false;
  *facts = {dtype, reinterpret_cast<uintptr_t>(d.data) + d.byte_offset, count};
  return true;
}

// The exchange table from torch.Tensor's capsule, where it is one (an early torch exposed an
// integer under an older name) and its major version is DLPack's 1; else none, and the
// attribute reads serve.
const dlpack::ExchangeApi* exchange_api(py::handle capsule) {
  if (!PyCapsule_IsValid(capsule.ptr(), dlpack::kCapsuleName)) return nullptr;
  const auto* api = static_cast<const dlpack::ExchangeApi*>(PyCapsule_GetPointer(capsule.ptr(), dlpack::kCapsuleName));
  const bool usable = api != nullptr && api->header.version.major == dlpack::kMajorVersion &&
                      api->dltensor_from_py_object_no_sync != nullptr;
  return usable ? api : nullptr;
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
    TensorFacts now{};
    if (read_through_dlpack(r, ts[i], &now)) {
      if (now.address != PyLong_AsUnsignedLongLong(was[0].ptr()) || now.count != as_int(was[1]) ||
          now.dtype != dtype_code("same_layout", was[2]))
        return false;
    } else if (!call(ts[i], r.data_ptr).equal(was[0]) || !call(ts[i], r.numel).equal(was[1]) ||
               get(ts[i], r.dtype).ptr() != was[2].ptr()) {
      return false;
    }
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
  TensorFacts fast{};
  if (device.ptr() == r.cpu_device.ptr() && read_through_dlpack(r, t, &fast)) return fast;
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
  const bool in_place = part.address == whole.address + chunk_offset;
  if (!in_place && overlaps(whole.address, static_cast<uint64_t>(whole.count) * item, part.address,
                            static_cast<uint64_t>(part.count) * item))
    fail<py::value_error>(op, ": output and input overlap; in place, the smaller one must be exactly this rank's "
                          "chunk (rank ", rank, ") of the larger one");
  return {in.dtype, in.address, out.address, in.count, out.count, in_place};
}

void bind_tensor_checks(py::module_& m) {
  m.attr("EQUAL_SIZES") = static_cast<int>(PairSizes::kEqual);
  m.attr("GATHER_SIZES") = static_cast<int>(PairSizes::kGather);
  m.attr("SCATTER_SIZES") = static_cast<int>(PairSizes::kScatter);
  m.def(
      "configure_tensor_checks",
      [](py::object tensor_type, py::object cpu_device, py::object resolve_op,
         std::vector<std::pair<py::object, int>> dtypes, std::vector<std::pair<py::object, int>> ops,
         py::object parameter_type, py::object dlpack_capsule, std::vector<std::pair<py::object, int>> dtype_samples) {
        auto* fresh = new Registry{};
        fresh->tensor_type = std::move(tensor_type), fresh->parameter_type = std::move(parameter_type);
        fresh->cpu_device = std::move(cpu_device), fresh->resolve_op = std::move(resolve_op);
        fresh->dtypes = std::move(dtypes), fresh->ops = std::move(ops);
        fresh->dlpack = exchange_api(dlpack_capsule);
        fresh->dlpack_capsule = std::move(dlpack_capsule);
        if (fresh->dlpack != nullptr) {
          for (const auto& [sample, code] : dtype_samples) {  // what DLPack calls each of our dtypes
            dlpack::DLTensor d{};
            if (fresh->dlpack->dltensor_from_py_object_no_sync(sample.ptr(), &d) != 0) throw py::error_already_set();
            fresh->dlpack_dtypes.emplace_back(dlpack_dtype_key(d.dtype), code);
          }
        }
        std::swap(fresh, registry);
        delete fresh;  // a second configuration (a reload) replaces the first, with the GIL held
      },
      py::arg("tensor_type"), py::arg("cpu_device"), py::arg("resolve_op"), py::arg("dtypes"), py::arg("ops"),
      py::arg("parameter_type") = py::none(), py::arg("dlpack_api") = py::none(),
      py::arg("dtype_samples") = std::vector<std::pair<py::object, int>>{},
      "ringcoll/_types.py, at import: torch.Tensor, the CPU device, reduce_op, and the (object, code) pairs "
      "of every dtype and ReduceOp object known by identity; nn.Parameter, torch.Tensor's DLPack exchange "
      "capsule (or None) and an empty tensor of each dtype with its code, for the fast read");
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
        return py::make_tuple(f.dtype, f.input, f.input_count, f.output, f.output_count, f.in_place);
      },
      py::arg("op"), py::arg("output"), py::arg("input"), py::arg("sizes"), py::arg("device"), py::arg("rank"),
      py::arg("world"), "(dtype code, input address, input count, output address, output count, in place)");
  m.def(
      "read_tensor_facts",
      [](py::handle t) -> py::object {
        TensorFacts f{};
        if (!read_through_dlpack(known(), t, &f)) return py::none();
        return py::make_tuple(f.dtype, f.address, f.count);
      },
      py::arg("tensor"),
      "the fast read alone (DLPack's exchange table): (dtype code, address, element count) of a contiguous CPU "
      "tensor it vouches for, else None (the attribute reads then decide); for tests");
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
