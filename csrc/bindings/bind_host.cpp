// bind_host.cpp: the shared-memory transport. Takes raw addresses, or for the plain calls the
// tensors themselves, read through the Python C API (tensor_checks.h; no libtorch); releases
// the GIL for every collective so async work and other Python threads keep running.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <tuple>

#include "../host/host_comm.h"
#include "../host/host_strip.h"
#include "ringcoll/check.h"
#include "tensor_checks.h"

namespace py = pybind11;
using ringcoll::DType;
using ringcoll::ReduceOp;
using ringcoll::host::HostComm;

namespace {
const void* as_ptr(uintptr_t address) { return reinterpret_cast<const void*>(address); }
void* as_mut_ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }

// The plain tensor forms on a CPU communicator (Communicator.all_reduce, reduce_scatter_tensor,
// all_gather_into_tensor, broadcast, reduce; synchronous, nothing queued): the arguments are checked exactly as
// every other call's (tensor_checks.h), and the collective runs, in one binding call. Through
// the Python layers a 4 KiB call spent three times as long in Python as in the extension.
using ringcoll::bindings::check_pair;
using ringcoll::bindings::check_tensor;
using ringcoll::bindings::cpu_device;
using ringcoll::bindings::op_code;
using ringcoll::bindings::PairSizes;
using ringcoll::bindings::same_layout;

void ensure_open(const HostComm& c, const char* op) {
  if (c.closed()) throw ringcoll::Error(std::string(op) + ": communicator is closed");
}

using ringcoll::CompiledPlan;

// A plan argument: None, or a CompiledPlan (read with the GIL held). Taken as a handle and cast
// here: pybind11 accepts None for a pointer argument only in a second, converting pass over
// every argument, which cost a 4 KiB call 0.6 us.
const CompiledPlan* plan_of(py::handle plan) { return plan.is_none() ? nullptr : plan.cast<const CompiledPlan*>(); }

// `plan`: a call by a plan (its CompiledPlan, CollectiveCall.plan in ringcoll/transports/base.py);
// null for the default path.
void run_call(HostComm& c, const std::string& collective, uintptr_t in, uintptr_t out, int64_t count, int dtype,
              std::optional<int> op, const CompiledPlan* plan) {
  const auto d = static_cast<DType>(dtype);
  if (plan != nullptr) {
    const auto coll = ringcoll::collective_named(collective);
    RINGCOLL_CHECK(coll.has_value(), std::invalid_argument, "unknown collective ", collective);
    return c.run_plan(*coll, *plan, as_ptr(in), as_mut_ptr(out), count, d, static_cast<ReduceOp>(op.value_or(0)));
  }
  if (collective == "all_gather") return c.all_gather(as_ptr(in), as_mut_ptr(out), count, d);
  RINGCOLL_CHECK(op.has_value(), std::invalid_argument, collective, ": a reduction needs an op");
  const auto o = static_cast<ReduceOp>(*op);
  if (collective == "all_reduce") return c.all_reduce(as_ptr(in), as_mut_ptr(out), count, d, o);
  RINGCOLL_CHECK(collective == "reduce_scatter", std::invalid_argument, "unknown collective ", collective);
  c.reduce_scatter(as_ptr(in), as_mut_ptr(out), count, d, o);
}

// A prepared call (Communicator.prepare_*): its arguments read once, when prepared, so that a
// run is a call with none (a binding call that parsed eleven arguments and two strings each
// time made prepared calls 0.45 us slower than plain ones at 4 KiB). Running it is
// synchronous, nothing queued: false, and nothing runs, if a tensor changed since it was
// prepared (same_layout; Python says how); otherwise it runs and returns true.
class PreparedCall {
 public:
  PreparedCall(py::object comm, std::string name, py::tuple tensors, py::tuple layout, std::string collective,
               uintptr_t in, uintptr_t out, int64_t count, int dtype, std::optional<int> op, py::object plan)
      : owner_(std::move(comm)), comm_(owner_.cast<HostComm&>()), name_(std::move(name)),
        tensors_(std::move(tensors)), layout_(std::move(layout)), collective_(std::move(collective)), in_(in),
        out_(out), count_(count), dtype_(dtype), op_(op), plan_object_(std::move(plan)),
        plan_(plan_of(plan_object_)) {}

  bool run() {
    if (!same_layout(tensors_, layout_)) return false;
    ensure_open(comm_, name_.c_str());
    py::gil_scoped_release release;
    run_call(comm_, collective_, in_, out_, count_, dtype_, op_, plan_);
    return true;
  }

 private:
  py::object owner_;  // the HostComm's Python object: alive while this is
  HostComm& comm_;
  std::string name_;
  py::tuple tensors_, layout_;  // PreparedTensors' (ringcoll/communicator.py)
  std::string collective_;
  uintptr_t in_, out_;
  int64_t count_;
  int dtype_;
  std::optional<int> op_;
  py::object plan_object_;  // the CompiledPlan (None: native), alive while this is
  const CompiledPlan* plan_;
};

// How a plain tensor call runs, as Communicator passes it (one argument: this runs on every
// call): None, the transport's own path (native); True, auto: the plan auto's table gives
// the message's size (HostComm::auto_plan), else the own path; a _C.CompiledPlan, or the
// index of one the communicator holds (HostComm::hold_plan), that plan.
struct Choice {
  bool auto_choice = false;
  const CompiledPlan* plan = nullptr;
};

Choice choice_of(const HostComm& c, py::handle algorithm, const char* op) {
  if (algorithm.ptr() == Py_True) return {true, nullptr};
  if (PyLong_CheckExact(algorithm.ptr())) return {false, &c.held_plan(algorithm.cast<long>(), op)};
  return {false, plan_of(algorithm)};
}

// The plan a plain call runs (null: the transport's own path): the one it names, or auto's
// for the message (all-reduce's tensor, reduce-scatter's input, all-gather's output: `count`
// elements of `dtype`, times `per_rank`) and its form. Auto is native on a communicator with
// symmetric memory (Communicator._plan says why).
const CompiledPlan* plan_to_run(const HostComm& c, const Choice& choice, ringcoll::Collective coll, int64_t count,
                                int dtype, int per_rank, bool in_place) {
  if (!choice.auto_choice) return choice.plan;
  if (c.symmetric_arenas() != 0) return nullptr;
  return c.auto_plan(coll, static_cast<size_t>(count) * dtype_info(static_cast<DType>(dtype)).size_bytes * per_rank,
                     in_place);
}

// The plain tensor calls: checked and run in one binding call, by the chosen plan where there
// is one (a named algorithm, or auto's choice), else the transport's own path.
void all_reduce_tensor(HostComm& c, py::handle tensor, py::handle output, py::handle op, py::handle algorithm) {
  constexpr const char* name = "all_reduce";
  ensure_open(c, name);
  int dtype;
  uintptr_t src, dst;
  int64_t count;
  bool in_place = true;
  if (output.is_none()) {
    const auto t = check_tensor(name, "tensor", tensor, cpu_device());
    dtype = t.dtype, src = dst = t.address, count = t.count;
  } else {
    const auto p = check_pair(name, output, tensor, PairSizes::kEqual, cpu_device(), c.rank(), c.world());
    dtype = p.dtype, src = p.input, dst = p.output, count = p.input_count, in_place = p.in_place;
  }
  const auto code = static_cast<ReduceOp>(op_code(name, op, dtype));
  const CompiledPlan* plan = plan_to_run(c, choice_of(c, algorithm, name), ringcoll::Collective::kAllReduce, count,
                                         dtype, 1, in_place);
  py::gil_scoped_release release;
  if (plan != nullptr)
    c.run_plan(ringcoll::Collective::kAllReduce, *plan, as_ptr(src), as_mut_ptr(dst), count, static_cast<DType>(dtype),
               code);
  else
    c.all_reduce(as_ptr(src), as_mut_ptr(dst), count, static_cast<DType>(dtype), code);
}

void reduce_scatter_tensor(HostComm& c, py::handle output, py::handle input, py::handle op, py::handle algorithm) {
  constexpr const char* name = "reduce_scatter_tensor";
  ensure_open(c, name);
  const auto p = check_pair(name, output, input, PairSizes::kScatter, cpu_device(), c.rank(), c.world());
  const auto code = static_cast<ReduceOp>(op_code(name, op, p.dtype));
  const CompiledPlan* plan = plan_to_run(c, choice_of(c, algorithm, name), ringcoll::Collective::kReduceScatter,
                                         p.output_count, p.dtype, c.world(), p.in_place);
  py::gil_scoped_release release;
  if (plan != nullptr)
    c.run_plan(ringcoll::Collective::kReduceScatter, *plan, as_ptr(p.input), as_mut_ptr(p.output), p.output_count,
               static_cast<DType>(p.dtype), code);
  else
    c.reduce_scatter(as_ptr(p.input), as_mut_ptr(p.output), p.output_count, static_cast<DType>(p.dtype), code);
}

void all_gather_into_tensor(HostComm& c, py::handle output, py::handle input, py::handle algorithm) {
  constexpr const char* name = "all_gather_into_tensor";
  ensure_open(c, name);
  const auto p = check_pair(name, output, input, PairSizes::kGather, cpu_device(), c.rank(), c.world());
  const CompiledPlan* plan = plan_to_run(c, choice_of(c, algorithm, name), ringcoll::Collective::kAllGather,
                                         p.input_count, p.dtype, c.world(), p.in_place);
  py::gil_scoped_release release;
  if (plan != nullptr)
    c.run_plan(ringcoll::Collective::kAllGather, *plan, as_ptr(p.input), as_mut_ptr(p.output), p.input_count,
               static_cast<DType>(p.dtype), ReduceOp{});
  else
    c.all_gather(as_ptr(p.input), as_mut_ptr(p.output), p.input_count, static_cast<DType>(p.dtype));
}

// The rooted collectives, in place on `tensor` (torch's dist.broadcast / dist.reduce), always
// by a plan (the root travels in it: CompiledPlan::root).
bool rooted_tensor(HostComm& c, const char* name, ringcoll::Collective coll, py::handle tensor, py::handle op,
                   const CompiledPlan& plan) {
  ensure_open(c, name);
  const auto t = check_tensor(name, "tensor", tensor, cpu_device());
  const auto code = op.is_none() ? ReduceOp{} : static_cast<ReduceOp>(op_code(name, op, t.dtype));
  py::gil_scoped_release release;
  c.run_plan(coll, plan, as_ptr(t.address), as_mut_ptr(t.address), t.count, static_cast<DType>(t.dtype), code);
  return true;
}
// Ctrl-C during a wait. A call runs without the GIL, so Python's handler for SIGINT only
// ran once the call returned, at the timeout. Every wait's health check (about every 50 ms
// of sleeping) runs the handlers here; one that raises (KeyboardInterrupt) abandons the
// call as any error does (the communicator breaks, the peers are told), and the translator
// below raises that very exception in Python. Only the main thread runs handlers: elsewhere
// PyErr_CheckSignals returns 0 at once.
struct Interrupted : ringcoll::Error {
  using Error::Error;
};
thread_local PyObject* interruption[3] = {nullptr, nullptr, nullptr};  // type, value, traceback

void run_python_signal_handlers() {
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return;
  PyErr_Fetch(&interruption[0], &interruption[1], &interruption[2]);
  throw Interrupted("interrupted by a signal (its Python handler raised, e.g. KeyboardInterrupt on Ctrl-C)");
}
}  // namespace

void bind_host(py::module_& m) {
  ringcoll::host::set_interrupt_check(&run_python_signal_handlers);
  py::register_exception_translator([](std::exception_ptr raised) {
    try {
      if (raised) std::rethrow_exception(raised);
    } catch (const Interrupted&) {
      PyErr_Restore(interruption[0], interruption[1], interruption[2]);  // takes the references
      interruption[0] = interruption[1] = interruption[2] = nullptr;
    }
  });
  m.def("random_segment_name", &ringcoll::host::random_segment_name);
  m.def(
      "slot_bytes_for",
      [](size_t buffer_bytes, int world) {
        return ringcoll::slot_bytes_for(buffer_bytes, world, ringcoll::host::kSlotAlignment);
      },
      py::arg("buffer_bytes"), py::arg("world"));
  m.attr("host_slot_alignment") = ringcoll::host::kSlotAlignment;
  m.attr("host_default_direct_max_bytes") = ringcoll::host::kDefaultDirectMaxBytes;
  // The neighbour-hop probe (SlotStores in host_comm.h): for tests and the benchmark.
  m.attr("hop_probe_min_bytes") = ringcoll::host::kHopProbeMinBytes;
  m.attr("hop_probe_every") = ringcoll::host::kHopProbeEvery;
  m.attr("hop_off_core_ns") = ringcoll::host::kHopOffCoreNs;
  m.attr("default_slow_hop_ns") = ringcoll::host::kDefaultSlowHopNs;
  m.attr("store_probe_every") = ringcoll::host::kStoreProbeEvery;
  m.attr("same_hop_factor") = ringcoll::host::kSameHopFactor;
  // Read once per process from RINGCOLL_STREAMING_BYTES (host_strip.h): for tests.
  m.def("streaming_threshold_bytes", &ringcoll::host::streaming_threshold_bytes);
  // A copy as the CPU transport makes one (host_strip.h: streaming stores from the
  // threshold on): the benchmark's memory-bandwidth reference (ringcoll-bench --symmetric).
  m.def(
      "host_copy",
      [](uintptr_t dst, uintptr_t src, size_t bytes) {
        ringcoll::host::copy_strip(static_cast<char*>(nullptr), reinterpret_cast<char*>(dst),
                                   reinterpret_cast<const char*>(src), static_cast<int64_t>(bytes),
                                   bytes >= ringcoll::host::streaming_threshold_bytes());
        ringcoll::host::stream_fence();
      },
      py::arg("dst"), py::arg("src"), py::arg("bytes"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "one_shot_fits",
      [](int collective, int64_t ring_count, int elem_size, int world, size_t small_bytes, size_t slot_bytes) {
        return ringcoll::host::one_shot_fits(static_cast<ringcoll::Collective>(collective), ring_count, elem_size,
                                             world, small_bytes, slot_bytes);
      },
      py::arg("collective"), py::arg("ring_count"), py::arg("elem_size"), py::arg("world"), py::arg("small_bytes"),
      py::arg("slot_bytes"));
  m.def(
      "direct_read_fits",
      [](int collective, int64_t ring_count, int elem_size, bool direct_reads, size_t direct_bytes,
         size_t direct_max_bytes) {
        return ringcoll::host::direct_read_fits(static_cast<ringcoll::Collective>(collective), ring_count, elem_size,
                                                direct_reads, direct_bytes, direct_max_bytes);
      },
      py::arg("collective"), py::arg("ring_count"), py::arg("elem_size"), py::arg("direct_reads"),
      py::arg("direct_bytes"), py::arg("direct_max_bytes"));
  m.def("symmetric_block_bytes", &ringcoll::symmetric_block_bytes, py::arg("bytes"),
        "the bytes a symmetric tensor of `bytes` takes from the pool (ringcoll/symmetric_heap.h)");
  m.def("symmetric_arena_bytes", &ringcoll::symmetric_arena_bytes, py::arg("block_bytes"),
        "the size of each rank's part of the arena made for a block of `block_bytes`");
  // A block of symmetric memory (ringcoll/symmetric_heap.h): on the CPU a writable buffer
  // torch.frombuffer wraps (the tensor then holds the block, and the block this rank's
  // segment, alive); on CUDA its `address` is a device pointer (transports/cuda.py wraps it).
  py::class_<ringcoll::SymmetricBlock, std::shared_ptr<ringcoll::SymmetricBlock>>(m, "SymmetricBlock",
                                                                                               py::buffer_protocol())
      .def_buffer([](ringcoll::SymmetricBlock& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.bytes())}, {1}, /*readonly=*/false);
      })
      .def_property_readonly("bytes", &ringcoll::SymmetricBlock::bytes)
      .def_property_readonly("address", [](const ringcoll::SymmetricBlock& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_property_readonly("arena", [](const ringcoll::SymmetricBlock& b) { return b.place().arena; })
      .def_property_readonly("offset", [](const ringcoll::SymmetricBlock& b) { return b.place().offset; });
  py::class_<PreparedCall>(m, "PreparedHostCall", "a prepared call on a HostComm (HostComm.prepare)")
      .def("__call__", &PreparedCall::run);
  py::class_<HostComm>(m, "HostComm")
      .def(py::init<int, int, const std::vector<std::string>&, size_t, double, bool, size_t, size_t, size_t, bool>(),
           py::arg("rank"), py::arg("world"), py::arg("names"), py::arg("buffer_bytes"), py::arg("timeout"),
           py::arg("check_calls") = true, py::arg("small_bytes") = 0, py::arg("direct_bytes") = 0,
           py::arg("direct_max_bytes") = ringcoll::host::kDefaultDirectMaxBytes, py::arg("shares_cores") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("all_reduce",
           [](HostComm& c, uintptr_t in, uintptr_t out, int64_t count, int dtype, int op) {
             c.all_reduce(as_ptr(in), as_mut_ptr(out), count, static_cast<DType>(dtype), static_cast<ReduceOp>(op));
           },
           py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter",
           [](HostComm& c, uintptr_t in, uintptr_t out, int64_t output_count, int dtype, int op) {
             c.reduce_scatter(as_ptr(in), as_mut_ptr(out), output_count, static_cast<DType>(dtype),
                              static_cast<ReduceOp>(op));
           },
           py::call_guard<py::gil_scoped_release>())
      .def("all_gather",
           [](HostComm& c, uintptr_t in, uintptr_t out, int64_t input_count, int dtype) {
             c.all_gather(as_ptr(in), as_mut_ptr(out), input_count, static_cast<DType>(dtype));
           },
           py::call_guard<py::gil_scoped_release>())
      // The whole CollectiveCall (transports/base.py) in one call, as HostTransport passes it:
      // (collective, src, dst, user_count, dtype, op); op is None for all_gather. One
      // binding call instead of a Python-level unpack and a method lookup per collective.
      .def(
          "run",
          [](HostComm& c, const std::string& collective, uintptr_t in, uintptr_t out, int64_t count, int dtype,
             std::optional<int> op, py::handle plan) {
            const CompiledPlan* by = plan_of(plan);
            py::gil_scoped_release release;
            run_call(c, collective, in, out, count, dtype, op, by);
          },
          py::arg("collective"), py::arg("src"), py::arg("dst"), py::arg("count"), py::arg("dtype"), py::arg("op"),
          py::arg("plan") = py::none())
      .def(
          "run_plan",
          [](HostComm& c, const CompiledPlan& plan, int collective, uintptr_t in, uintptr_t out, int64_t count,
             int dtype, int op) {
            c.run_plan(static_cast<ringcoll::Collective>(collective), plan, as_ptr(in), as_mut_ptr(out), count,
                       static_cast<DType>(dtype), static_cast<ReduceOp>(op));
          },
          py::arg("plan"), py::arg("collective"), py::arg("src"), py::arg("dst"), py::arg("count"),
          py::arg("dtype"), py::arg("op"), py::call_guard<py::gil_scoped_release>())
      .def(
          "prepare",
          [](py::object self, std::string name, py::tuple tensors, py::tuple layout, std::string collective,
             uintptr_t in, uintptr_t out, int64_t count, int dtype, std::optional<int> op, py::object plan) {
            return PreparedCall(std::move(self), std::move(name), std::move(tensors), std::move(layout),
                                std::move(collective), in, out, count, dtype, op, std::move(plan));
          },
          py::arg("name"), py::arg("tensors"), py::arg("layout"), py::arg("collective"), py::arg("src"),
          py::arg("dst"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("plan") = py::none())
      .def("hold_plan", &HostComm::hold_plan, py::arg("plan"))
      // `algorithm`: None (native), True (auto), a _C.CompiledPlan or a held plan's index (choice_of)
      .def("all_reduce_tensor", &all_reduce_tensor, py::arg("tensor"), py::arg("output"), py::arg("op"),
           py::arg("algorithm"))
      .def("reduce_scatter_tensor", &reduce_scatter_tensor, py::arg("output"), py::arg("input"), py::arg("op"),
           py::arg("algorithm"))
      .def("all_gather_into_tensor", &all_gather_into_tensor, py::arg("output"), py::arg("input"),
           py::arg("algorithm"))
      .def(
          "broadcast_tensor",
          [](HostComm& c, py::handle tensor, const CompiledPlan& plan) {
            return rooted_tensor(c, "broadcast", ringcoll::Collective::kBroadcast, tensor, py::none(), plan);
          },
          py::arg("tensor"), py::arg("plan"))
      .def(
          "reduce_tensor",
          [](HostComm& c, py::handle tensor, py::handle op, const CompiledPlan& plan) {
            return rooted_tensor(c, "reduce", ringcoll::Collective::kReduce, tensor, op, plan);
          },
          py::arg("tensor"), py::arg("op"), py::arg("plan"))
      .def(
          "set_auto_plan_spans",
          [](HostComm& c, int collective, const std::vector<std::tuple<size_t, size_t, long>>& spans, bool in_place) {
            std::vector<HostComm::AutoPlanSpan> kept;
            for (const auto& [from, to, held] : spans) kept.push_back({from, to, held});
            c.set_auto_plan_spans(static_cast<ringcoll::Collective>(collective), std::move(kept), in_place);
          },
          py::arg("collective"), py::arg("spans"), py::arg("in_place") = false)
      .def(
          "allocate_symmetric",
          [](HostComm& c, size_t bytes, int dtype, const std::vector<int64_t>& dims) {
            ensure_open(c, "empty");
            return c.allocate_symmetric(bytes, static_cast<DType>(dtype), dims);
          },
          py::arg("bytes"), py::arg("dtype"), py::arg("dims"), py::call_guard<py::gil_scoped_release>())
      .def(
          "is_symmetric", [](const HostComm& c, uintptr_t address, size_t bytes) {
            return c.is_symmetric(as_ptr(address), bytes);
          },
          py::arg("address"), py::arg("bytes"))
      .def_property_readonly("symmetric_arenas", &HostComm::symmetric_arenas)
      .def_property_readonly("zero_copy_calls", &HostComm::zero_copy_calls)
      .def_property_readonly("stream_slots", &HostComm::stream_slots)
      .def_property_readonly("probes_hops", &HostComm::probes_hops)
      .def_property_readonly("hop_ns", &HostComm::hop_ns)
      .def_property_readonly("hop_probes", &HostComm::hop_probes)
      .def_property_readonly("slow_hop_probes", &HostComm::slow_hop_probes)
      .def_property_readonly("store_probes", &HostComm::store_probes)
      .def_property_readonly("store_probe_hop_ns", &HostComm::store_probe_hop_ns)
      .def_property_readonly("store_probe_streams", &HostComm::store_probe_streams)
      .def("barrier", &HostComm::barrier, py::call_guard<py::gil_scoped_release>())
      .def("close", &HostComm::close, py::call_guard<py::gil_scoped_release>())  // it may wait for a running call
      .def_property_readonly("rank", &HostComm::rank)
      .def_property_readonly("world", &HostComm::world)
      .def_property_readonly("slot_bytes", &HostComm::slot_bytes)
      .def_property_readonly("check_calls", &HostComm::check_calls)
      .def_property_readonly("small_bytes", &HostComm::small_bytes)
      .def_property_readonly("one_shot_calls", &HostComm::one_shot_calls)
      .def_property_readonly("one_slice_early_calls", &HostComm::one_slice_early_calls)
      .def_property_readonly("direct_bytes", &HostComm::direct_bytes)
      .def_property_readonly("direct_max_bytes", &HostComm::direct_max_bytes)
      .def_property_readonly("direct_reads", &HostComm::direct_reads)
      .def_property_readonly("direct_reads_unavailable", &HostComm::direct_reads_unavailable)
      .def_property_readonly("direct_calls", &HostComm::direct_calls)
      .def_property_readonly("oversubscribed", &HostComm::oversubscribed)
      .def_property_readonly("wait_policy",
                             [](const HostComm& c) {  // how its waits spend their time (host_wait_policy)
                               const auto& p = c.wait_policy();
                               return py::dict(py::arg("spin_ns") = p.spin_ns, py::arg("yield_ns") = p.yield_ns,
                                               py::arg("first_sleep_ns") = p.first_sleep_ns,
                                               py::arg("max_sleep_ns") = p.max_sleep_ns);
                             })
      .def_property_readonly("broken", &HostComm::broken)
      .def_property_readonly("broken_reason", &HostComm::broken_reason)
      .def_property("timeout", &HostComm::timeout, &HostComm::set_timeout);
}
