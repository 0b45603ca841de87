// bind_cuda.cpp: what the CUDA transport offers Python (ringcoll/transports/cuda.py is its
// user), and, in every build with or without CUDA, what lets CI test the kernels' code on the
// CPU: the strip arithmetic (strip.h, tests/pure/test_kernel_logic.py) and the kernels
// themselves run by the emulator (csrc/emulation/, tests/pure/test_emulated_kernels.py).
#include <optional>
#include <string>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "../cuda/kernel_abi.h"
#include "../emulation/emulated_ring.h"
#include "ringcoll/strip.h"

#if defined(RINGCOLL_WITH_CUDA)
#include "../cuda/cuda_comm.h"
#endif

namespace py = pybind11;

void bind_cuda(py::module_& m) {
  py::module_ s = m.def_submodule("strip", "strip.h, the kernels' division of a slice among blocks (tiles) and vectors");
  s.def("tile_elems", &ringcoll::tile_elems, py::arg("elem_size"));
  s.def("tile_count", &ringcoll::tile_count, py::arg("len"), py::arg("elem_size"));
  s.def("tile_begin", &ringcoll::tile_begin, py::arg("tile"), py::arg("elem_size"));
  s.def("tile_end", &ringcoll::tile_end, py::arg("len"), py::arg("tile"), py::arg("elem_size"));
  s.attr("tile_bytes") = ringcoll::kTileBytes;
  s.def(
      "vector_split",
      [](int64_t len, int elem_size, uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t d) {
        const ringcoll::VectorSplit v = ringcoll::vector_split(len, elem_size, a, b, c, d);
        return py::make_tuple(v.head, v.vec, v.tail);
      },
      py::arg("len"), py::arg("elem_size"), py::arg("a"), py::arg("b") = 0, py::arg("c") = 0, py::arg("d") = 0,
      "(head, vec, tail) element counts for pointers a..d (0 = unused)");
  s.attr("vector_bytes") = ringcoll::kVectorBytes;

  m.attr("cuda_max_blocks") = ringcoll::cuda::kMaxBlocks;
  m.def("cuda_fused_blocks", &ringcoll::cuda::fused_blocks, py::arg("ring_count"), py::arg("world"),
        py::arg("slice_elems"), py::arg("elem_size"), py::arg("max_blocks"),
        "blocks of a fused launch (kernel_abi.h): one per tile of the longest slice, at most max_blocks");
  m.def("cuda_slice_elems_for", &ringcoll::cuda::slice_elems_for, py::arg("slot_bytes"), py::arg("elem_size"),
        "elements of a slice in a CUDA slot: the whole slot (a full slice placed at an offset wraps round)");
  m.def("cuda_max_blocks_for", &ringcoll::cuda::max_blocks_for, py::arg("sm_count"), py::arg("ranks_per_gpu") = 1);
  m.def("cuda_default_buffer_bytes", &ringcoll::cuda::default_buffer_bytes, py::arg("world"),
        "the CUDA communicator's default buffer_bytes: a slot of kMaxBlocks tiles per bank and rank");
  using ringcoll::cuda::FlagScopeSetting;
  m.def(
      "cuda_flag_scope_setting",
      [](const std::optional<std::string>& value) {
        return static_cast<int>(ringcoll::cuda::parse_flag_scope_setting(value ? value->c_str() : nullptr));
      },
      py::arg("value"),
      "RINGCOLL_CUDA_FLAG_SCOPE's setting for a value (None: unset): 0 auto, 1 system; ValueError if unknown");
  m.def(
      "cuda_check_flag_scope_settings",
      [](const std::vector<int>& settings) {
        std::vector<FlagScopeSetting> s;
        for (int v : settings) s.push_back(static_cast<FlagScopeSetting>(v));
        ringcoll::cuda::check_flag_scope_settings(s);
      },
      py::arg("settings"), "every rank's setting must be the same (CudaComm's map_peers); ValueError naming them if not");
  m.def(
      "cuda_flag_scope_for",
      [](const std::vector<bool>& same_device, int setting) {
        return static_cast<int>(ringcoll::cuda::flag_scope_for(same_device, static_cast<FlagScopeSetting>(setting)));
      },
      py::arg("same_device"), py::arg("setting") = static_cast<int>(FlagScopeSetting::kAuto),
      "the data flags' scope (flags.h FlagScope: 0 system, 1 device) for ranks on these GPUs, under a setting");
  m.attr("cuda_flag_scope_system") = static_cast<int>(ringcoll::FlagScope::kSystem);
  m.attr("cuda_flag_scope_device") = static_cast<int>(ringcoll::FlagScope::kDevice);
  m.attr("cuda_max_world") = ringcoll::cuda::kMaxWorld;
  m.attr("cuda_slot_alignment") = ringcoll::cuda::kSlotAlignment;
  m.def(
      "cuda_slot_bytes_for",
      [](size_t buffer_bytes, int world) {
        return ringcoll::slot_bytes_for(buffer_bytes, world, ringcoll::cuda::kSlotAlignment);
      },
      py::arg("buffer_bytes"), py::arg("world"));

  using ringcoll::emulation::CallResult;
  using ringcoll::emulation::Device;
  using ringcoll::emulation::EmulatedCall;
  using ringcoll::emulation::EmulatedRing;
  py::module_ e = m.def_submodule("emulation", "the CUDA ring kernels run on the CPU, ranks and blocks as threads");
  auto result = [](const CallResult& r) { return py::make_tuple(r.error_type, r.message); };
  // (rank, collective, dtype, op, input, output, count[, plan]): the _C.CompiledPlan a
  // CollectiveCall carries (which Python keeps alive while it runs).
  auto parse_call = [](const py::tuple& c) {
    EmulatedCall call{c[0].cast<int>(),       c[1].cast<int>(),       c[2].cast<int>(),    c[3].cast<int>(),
                      c[4].cast<uintptr_t>(), c[5].cast<uintptr_t>(), c[6].cast<int64_t>()};
    if (c.size() > 7 && !c[7].is_none()) call.plan = c[7].cast<const ringcoll::CompiledPlan*>();
    return call;
  };
  py::class_<Device, std::shared_ptr<Device>>(e, "Device", "a modelled CUDA device's streams (emulated_streams.h)")
      .def(py::init([](int queues) {
             // Destroyed without the GIL: it joins kernel threads, and a Python kernel's
             // thread takes the GIL to finish (and to drop its callable).
             return std::shared_ptr<Device>(new Device(queues), [](Device* d) {
               if (PyGILState_Check()) {
                 py::gil_scoped_release release;
                 delete d;
               } else {
                 delete d;
               }
             });
           }),
           py::arg("hardware_queues") = 8)
      .def_property_readonly_static("LEGACY", [](py::object) { return Device::kLegacyStream; })
      .def_property_readonly("hardware_queues", &Device::hardware_queues)
      .def("create_stream", &Device::create_stream, py::arg("blocking") = false)
      .def("queue_of", &Device::queue_of, py::arg("stream"))
      .def("create_event", &Device::create_event)
      .def("destroy_event", &Device::destroy_event, py::arg("event"))
      .def("record", &Device::record, py::arg("event"), py::arg("stream"), py::arg("external") = false)
      .def("wait", &Device::wait, py::arg("stream"), py::arg("event"))
      .def(
          "launch",
          [](Device& d, int stream, py::function fn) {
            // A Python callable as a kernel (for the model's own tests): it runs on a worker
            // thread, taking the GIL; held and dropped under the GIL.
            auto held = std::shared_ptr<py::function>(new py::function(std::move(fn)), [](py::function* f) {
              py::gil_scoped_acquire gil;
              delete f;
            });
            d.launch(stream, [held] {
              py::gil_scoped_acquire gil;
              try {
                (*held)();
              } catch (py::error_already_set& err) {
                err.discard_as_unraisable("emulated kernel");
              }
            });
          },
          py::arg("stream"), py::arg("fn"))
      .def("synchronize_stream", &Device::synchronize_stream, py::arg("stream"), py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def("synchronize_event", &Device::synchronize_event, py::arg("event"), py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def("query_event", &Device::query_event, py::arg("event"), py::arg("calling_stream") = -1)
      .def("synchronize_device", &Device::synchronize_device, py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def("begin_capture", &Device::begin_capture, py::arg("stream"))
      .def("is_capturing", &Device::is_capturing, py::arg("stream"))
      .def("end_capture", &Device::end_capture, py::arg("stream"))
      .def("replay", &Device::replay, py::arg("graph"), py::arg("stream"));
  py::class_<EmulatedRing>(e, "Ring")
      .def(py::init<int, size_t, double, int, int, bool, int, std::shared_ptr<Device>, bool>(), py::arg("world"),
           py::arg("buffer_bytes"), py::arg("timeout"), py::arg("variant"), py::arg("threads_per_block") = 4,
           py::arg("check_calls") = true, py::arg("max_blocks") = 8, py::arg("device") = nullptr,
           py::arg("peers_in_process") = true)
      // Symmetric memory, one rank's steps (CudaComm's, with the rank first)
      .def("make_symmetric_arena",
           [](EmulatedRing& ring, int rank, size_t bytes) { return py::bytes(ring.make_symmetric_arena(rank, bytes)); },
           py::arg("rank"), py::arg("bytes"))
      .def("open_symmetric_arena", &EmulatedRing::open_symmetric_arena, py::arg("rank"), py::arg("handles"))
      .def("take_symmetric", &EmulatedRing::take_symmetric, py::arg("rank"), py::arg("bytes"))
      .def("symmetric_has_room", &EmulatedRing::symmetric_has_room, py::arg("rank"), py::arg("bytes"))
      .def("is_symmetric", &EmulatedRing::is_symmetric, py::arg("rank"), py::arg("address"), py::arg("bytes"))
      .def("fallbacks", &EmulatedRing::fallbacks, py::arg("rank"))
      .def(
          "enqueue",
          [=](EmulatedRing& ring, const py::tuple& call, int user_stream, bool join) {
            const EmulatedCall parsed = parse_call(call);
            CallResult r;
            {
              py::gil_scoped_release release;
              r = ring.enqueue(parsed, user_stream, join);
            }
            return result(r);
          },
          py::arg("call"), py::arg("user_stream"), py::arg("join"),
          "one rank's call queued as CudaComm queues it; (error_type, message) of what is raised before queuing")
      .def("check_error", [=](EmulatedRing& ring, int rank) { return result(ring.check_error(rank)); }, py::arg("rank"))
      .def("own_stream", &EmulatedRing::own_stream, py::arg("rank"))
      .def("retire_stream", &EmulatedRing::retire_stream, py::arg("rank"))
      .def_property_readonly("device", [](EmulatedRing& ring) { return &ring.device(); },
                             py::return_value_policy::reference_internal)
      .def_property_readonly("host_wait_seconds", &EmulatedRing::host_wait_seconds)
      .def_property_readonly("violations", &EmulatedRing::violations)
      .def(
          "run",
          [=](EmulatedRing& ring, const std::vector<py::tuple>& calls) {
            std::vector<EmulatedCall> parsed;
            for (const py::tuple& c : calls) parsed.push_back(parse_call(c));
            std::vector<CallResult> results;
            {
              py::gil_scoped_release release;
              results = ring.run(parsed);
            }
            py::list out;
            for (const CallResult& r : results) out.append(result(r));
            return out;
          },
          py::arg("calls"),
          "calls: (rank, collective, dtype, op, input_ptr, output_ptr, count[, plan]), collective "
          "Ring.CLOSE to close (Ring.CLOSE_WITHOUT_WAITING: as a finalizer does); "
          "each rank runs its calls in order, not waiting for the others between calls; "
          "returns (error_type, message) per call, ('', '') on success")
      .def_property_readonly("launches", &EmulatedRing::launches)
      .def_property_readonly("blocks_launched", &EmulatedRing::blocks_launched)
      .def_property_readonly_static("CLOSE", [](py::object) { return ringcoll::emulation::kClose; })
      .def_property_readonly_static("CLOSE_WITHOUT_WAITING",
                                    [](py::object) { return ringcoll::emulation::kCloseWithoutWaiting; })
      .def_property_readonly("slot_bytes", &EmulatedRing::slot_bytes);

#if defined(RINGCOLL_WITH_CUDA)
  using ringcoll::cuda::CudaComm;
  m.attr("built_with_cuda") = true;
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
      .def("run_plan", &CudaComm::run_plan, py::arg("plan"), py::arg("collective"),
           py::arg("input"), py::arg("output"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("stream"),
           py::arg("join") = true, py::call_guard<py::gil_scoped_release>())
      .def("all_gather", &CudaComm::all_gather, py::arg("input"), py::arg("output"), py::arg("input_count"),
           py::arg("dtype"), py::arg("stream"), py::arg("join") = true, py::call_guard<py::gil_scoped_release>())
      .def(
          "make_symmetric_arena",
          [](CudaComm& c, size_t bytes) {
            std::string handle;
            {  // cudaMalloc may wait for the whole device, an in-process peer's ring among it,
               // and that peer's thread may need the GIL to go on
              py::gil_scoped_release released;
              handle = c.make_symmetric_arena(bytes);
            }
            return py::bytes(handle);
          },
          py::arg("bytes"))
      .def("open_symmetric_arena", &CudaComm::open_symmetric_arena, py::arg("handles"),
           py::call_guard<py::gil_scoped_release>())
      .def("take_symmetric", &CudaComm::take_symmetric, py::arg("bytes"))
      .def("symmetric_has_room", &CudaComm::symmetric_has_room, py::arg("bytes"))
      .def("is_symmetric", &CudaComm::is_symmetric, py::arg("address"), py::arg("bytes"))
      .def("check_error", &CudaComm::check_error)
      .def("synchronize", &CudaComm::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("leave_peers", &CudaComm::leave_peers, py::arg("wait_for_peers") = true,
           py::call_guard<py::gil_scoped_release>())
      .def("free_memory", &CudaComm::free_memory, py::call_guard<py::gil_scoped_release>())
      .def("close", &CudaComm::close, py::arg("wait_for_peers") = true, py::call_guard<py::gil_scoped_release>())
      .def("keep_memory", &CudaComm::keep_memory, py::arg("why"))
      .def_property_readonly("kept_on_close", &CudaComm::kept_on_close)
      .def_property_readonly("ipc_peers", &CudaComm::ipc_peers)
      .def_property_readonly("in_process_peers", &CudaComm::in_process_peers)
      .def_property_readonly("stream_handle", &CudaComm::stream_handle)
      .def("retire_stream", &CudaComm::retire_stream)
      .def("stream_capturing", &CudaComm::stream_capturing, py::arg("stream"))
      .def_property_readonly("rank", &CudaComm::rank)
      .def_property_readonly("world", &CudaComm::world)
      .def_property_readonly("device", &CudaComm::device)
      .def_property_readonly("slot_bytes", &CudaComm::slot_bytes)
      .def_property_readonly("max_blocks", &CudaComm::max_blocks)
      .def_property_readonly("flag_scope", &CudaComm::flag_scope)
      .def_property_readonly("flag_scope_setting", &CudaComm::flag_scope_setting)
      .def_property_readonly("variant", &CudaComm::variant)
      .def_property_readonly("check_calls", &CudaComm::check_calls)
      .def_property_readonly("broken", &CudaComm::broken)
      .def_property_readonly("broken_reason", &CudaComm::broken_reason)
      .def_property("timeout", &CudaComm::timeout, &CudaComm::set_timeout);
#else
  m.attr("built_with_cuda") = false;
#endif
}
