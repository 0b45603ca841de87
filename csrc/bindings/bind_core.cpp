// bind_core.cpp: errors, the ring schedule and the reduction functors, exposed so that the
// Python mirror (ringcoll/learning/schedule.py) and the tier-1 tests can be checked against them.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "../host/host_strip.h"
#include "ringcoll/call.h"
#include "ringcoll/check.h"
#include "ringcoll/flags.h"
#include "ringcoll/plan.h"
#include "ringcoll/reduce.h"
#include "ringcoll/ring.h"
#include "ringcoll/ring_loop.h"

namespace py = pybind11;
using namespace ringcoll;

namespace {

// A plan's ops as Python sees them (ringcoll/plans.py's PlanOp): one tuple per op,
// (a, b, from, first, count, to, final, readers), the operands as Operand's codes.
py::tuple op_tuple(const PlanOp& op) {
  return py::make_tuple(static_cast<int>(op.a), static_cast<int>(op.b), op.from, op.first, op.count,
                        static_cast<int>(op.to), op.final, op.readers);
}

PlanOp op_from_tuple(const py::handle& t) {
  const auto items = py::cast<py::tuple>(t);
  RINGCOLL_CHECK(items.size() == 8, std::invalid_argument, "a plan op is 8 fields, got ", items.size());
  PlanOp op;
  op.a = static_cast<Operand>(py::cast<int>(items[0]));
  op.b = static_cast<Operand>(py::cast<int>(items[1]));
  op.from = static_cast<int16_t>(py::cast<int>(items[2]));
  op.first = static_cast<int16_t>(py::cast<int>(items[3]));
  op.count = static_cast<int16_t>(py::cast<int>(items[4]));
  op.to = static_cast<uint8_t>(py::cast<int>(items[5]));
  op.final = py::cast<bool>(items[6]);
  op.readers = py::cast<uint64_t>(items[7]);
  return op;
}

py::tuple plan_tuple(const Plan& plan) {
  py::list ranks;
  for (const auto& ops : plan.ops) {
    py::list mine;
    for (const auto& op : ops) mine.append(op_tuple(op));
    ranks.append(py::tuple(mine));
  }
  return py::make_tuple(plan.chunks, py::tuple(ranks), plan.sends_early);
}

// out[i] = a[i] op b[i] for raw arrays, via the very loop the host ring uses
// (host_strip.h's reduce_strip) and so reduce.h's functors; `final` applies finalize
// (AVG's division by `world`). path "auto" is the ring's choice (the best vector loop the
// CPU has: host_vector_isa), "avx512" / "avx2" that loop only (the scalar one where the CPU
// lacks it), "scalar" the reference loop: for tests of each; the hierarchical communicator
// combines shards between CPU nodes with it (path "auto").
void reduce_arrays(uintptr_t out, uintptr_t a, uintptr_t b, int64_t count, int dtype, int op, bool final, int world,
                   const std::string& path) {
  RINGCOLL_CHECK(is_supported(static_cast<DType>(dtype), static_cast<ReduceOp>(op)), std::invalid_argument,
                 "reduce_arrays: unsupported dtype/op ", dtype, "/", op);
  RINGCOLL_CHECK(path == "auto" || path == "avx512" || path == "avx2" || path == "scalar", std::invalid_argument,
                 "reduce_arrays: path must be 'auto', 'avx512', 'avx2' or 'scalar', not '", path, "'");
  const host::VectorIsa isa = path == "auto"     ? host::VectorIsa::kBest
                              : path == "avx512" ? host::VectorIsa::kAvx512
                              : path == "avx2"   ? host::VectorIsa::kAvx2
                                                 : host::VectorIsa::kNone;
  dispatch_dtype_op(static_cast<DType>(dtype), static_cast<ReduceOp>(op), [&](auto t, auto o) {
    using T = decltype(t);
    using Op = decltype(o);
    auto* dst = reinterpret_cast<T*>(out);
    const auto* x = reinterpret_cast<const T*>(a);
    const auto* y = reinterpret_cast<const T*>(b);
    if (final) host::reduce_strip<T, Op, true>(nullptr, dst, x, y, count, world, false, false, isa);
    else host::reduce_strip<T, Op, false>(nullptr, dst, x, y, count, world, false, false, isa);
  });
}

}  // namespace

void bind_core(py::module_& m) {
  // Translators are tried newest first, so the subclasses are registered after the base.
  auto& base_error = py::register_exception<Error>(m, "RingcollError", PyExc_RuntimeError);
  // A timeout is a RingcollError (a RuntimeError, as torch's own timeouts are: code that
  // catches RuntimeError around a gloo call catches ringcoll's) and a Python TimeoutError.
  // PyErr_NewException, which pybind11 calls, takes a tuple of bases.
  py::tuple timeout_bases = py::make_tuple(base_error, py::handle(PyExc_TimeoutError));
  py::register_exception<TimeoutError>(m, "RingcollTimeoutError", timeout_bases);
  py::register_exception<PeerError>(m, "RingcollPeerError", base_error.ptr());
  py::register_exception<MismatchError>(m, "RingcollMismatchError", base_error.ptr());

  py::module_ s = m.def_submodule("schedule", "ring.h, for checking ringcoll/learning/schedule.py");
  s.def("chunk_begin", &chunk_begin, py::arg("n"), py::arg("world"), py::arg("chunk"));
  s.def("chunk_end", &chunk_end, py::arg("n"), py::arg("world"), py::arg("chunk"));
  s.def("left_neighbour", &left_neighbour);
  s.def("right_neighbour", &right_neighbour);
  s.def("rs_send_chunk", &rs_send_chunk);
  s.def("rs_recv_chunk", &rs_recv_chunk);
  s.def("rs_contributor", &rs_contributor);
  s.def("ag_send_chunk", &ag_send_chunk);
  s.def("ag_recv_chunk", &ag_recv_chunk);
  auto as_coll = [](int c) { return static_cast<Collective>(c); };
  s.def("ring_steps", [=](int coll, int world) { return ring_steps(as_coll(coll), world); });
  s.def("first_send_chunk", [=](int coll, int rank, int world) { return first_send_chunk(as_coll(coll), rank, world); });
  s.def("step_recv_chunk", [=](int coll, int rank, int step, int world) { return step_recv_chunk(as_coll(coll), rank, step, world); });
  s.def("step_reduces", [=](int coll, int step, int world) { return step_reduces(as_coll(coll), step, world); });
  s.def("step_writes_output", [=](int coll, int step, int world) { return step_writes_output(as_coll(coll), step, world); });
  s.def("step_forwards", [=](int coll, int step, int world) { return step_forwards(as_coll(coll), step, world); });
  s.def("slice_length", &slice_length);
  s.def("num_slices", &num_slices);

  m.def("reduce_arrays", &reduce_arrays, py::arg("out"), py::arg("a"), py::arg("b"), py::arg("count"),
        py::arg("dtype"), py::arg("op"), py::arg("final") = false, py::arg("world") = 1, py::arg("path") = "auto",
        py::call_guard<py::gil_scoped_release>());
  // Which vector path the host reduce loop uses for 16-bit floats: "avx512f", "avx2+f16c" or "none".
  m.attr("host_vector_isa") = host::host_vector_isa();
  m.def("dtype_size", [](int d) { return dtype_size(static_cast<DType>(d)); });
  // reduce.h's dtype list, in code order: (name, code, size_bytes, is_floating).
  py::list dtypes;
  for (int code = 0; code < kNumDTypes; ++code) {
    const DTypeInfo info = dtype_info(static_cast<DType>(code));
    dtypes.append(py::make_tuple(info.name, code, info.size_bytes, info.is_floating));
  }
  m.attr("dtype_table") = py::tuple(dtypes);
  // collectives.h's list, in code order: (name, code, reduces, moves_data, rooted).
  py::list collectives;
  for (int code = 0; code < kNumCollectives; ++code) {
    const CollectiveInfo info = collective_info(static_cast<Collective>(code));
    collectives.append(py::make_tuple(info.name, code, info.reduces, info.moves_data, info.rooted));
  }
  m.attr("collective_table") = py::tuple(collectives);

  // plan.h: the built-in algorithms (name, code, the names of the collectives it has), their
  // plans, and the compile step.
  py::list algorithms;
  auto names_of = [](unsigned collectives) {
    py::list names;
    for (int code = 0; code < kNumCollectives; ++code)
      if (collectives & (1u << code)) names.append(collective_info(static_cast<Collective>(code)).name);
    return py::tuple(names);
  };
#define RINGCOLL_ALGORITHM_ROW(e, name, code, collectives) \
  algorithms.append(py::make_tuple(name, code, names_of(collectives)));
  RINGCOLL_ALGORITHMS(RINGCOLL_ALGORITHM_ROW)
#undef RINGCOLL_ALGORITHM_ROW
  m.attr("algorithm_table") = py::tuple(algorithms);
  m.attr("max_plan_world") = kMaxPlanWorld;
  m.def(
      "builtin_plan",
      [](int algorithm, int collective, int world) {
        return plan_tuple(builtin_plan(static_cast<Algorithm>(algorithm), static_cast<Collective>(collective), world));
      },
      py::arg("algorithm"), py::arg("collective"), py::arg("world"),
      "(chunks, ops of each rank, sends_early) of a built-in algorithm's plan");
  py::class_<CompiledPlan>(m, "CompiledPlan", "a plan resolved for the engine (plan.h's compile_plan)")
      .def_property_readonly("chunks", [](const CompiledPlan& p) { return p.plan.chunks; })
      .def_property_readonly("root", [](const CompiledPlan& p) { return p.root; })
      .def_property_readonly("id", [](const CompiledPlan& p) { return p.id; })
      .def_property_readonly("publications", [](const CompiledPlan& p) { return p.publications; })
      .def_property_readonly("publication_read", [](const CompiledPlan& p) { return p.publication_read; })
      .def_property_readonly("early_sends", [](const CompiledPlan& p) { return p.early_sends; })
      .def_property_readonly("fallback_id", [](const CompiledPlan& p) { return p.fallback ? p.fallback->id : 0u; });
  m.def("plan_with_fallback", &plan_with_fallback, py::arg("primary"), py::arg("fallback"),
        "`primary` (reads peers' inputs where they lie) with `fallback` to run where some input is out of a "
        "rank's reach (CUDA; plan.h)");
  m.def(
      "compile_plan",
      [](const std::string& name, int world, int chunks, const py::sequence& ranks, uint32_t id, int root,
         bool sends_early) {
        Plan plan;
        plan.chunks = chunks;
        plan.sends_early = sends_early;
        for (const auto& ops : ranks) {
          plan.ops.emplace_back();
          for (const auto& op : py::cast<py::sequence>(ops)) plan.ops.back().push_back(op_from_tuple(op));
        }
        return compile_plan(std::move(plan), name, world, id, root);
      },
      py::arg("name"), py::arg("world"), py::arg("chunks"), py::arg("ops"), py::arg("id"), py::arg("root") = 0,
      py::arg("sends_early") = false,
      "the plan (written for root 0) resolved for the engine, relabelled for `root`; `id` is what its calls' "
      "descriptors carry");

  m.def(
      "name_python_plan", [](int id, const std::string& name) { python_plan_name(id, &name); }, py::arg("id"),
      py::arg("name"), "the name a mismatch message gives the plan written in Python with this id (plans.compiled)");

  // The buffer's shape (call.h), so Python validates buffer_bytes without restating it.
  m.attr("banks") = kBanks;
  m.def(
      "min_buffer_bytes",
      [](int world, size_t slot_alignment) {
        RINGCOLL_CHECK(world >= 1 && slot_alignment >= 1, std::invalid_argument, "min_buffer_bytes: world=", world,
                       " and slot_alignment=", slot_alignment, " must be positive");
        return min_buffer_bytes(world, slot_alignment);
      },
      py::arg("world"), py::arg("slot_alignment"), "the smallest buffer_bytes the transports accept");

  // flags.h's host wait, with a peer that publishes and then aborts just before the health
  // check sees the abort: the wait must report the publication, not the abort.
  m.def("wait_for_a_publication_before_an_abort", [] {
    uint64_t flag = 0;
    WaitPolicy policy;
    policy.spin_ns = policy.yield_ns = 0;  // straight to the naps, where the health checks are
    const WaitResult result = wait_flag_at_least(&flag, 1, policy, [&] {
      flag_store_release(&flag, 1);  // the peer's last publication, then its abort
      return false;
    });
    return std::string(result == WaitResult::kReady ? "ready" : result == WaitResult::kTimedOut ? "timed out"
                                                                                               : "aborted");
  });
}
