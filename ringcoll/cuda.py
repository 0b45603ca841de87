"""The CUDA transport, Python side: a ring of P processes whose GPU buffers are mapped into
one another through CUDA IPC (csrc/cuda/).

Bootstrap (collective over the group, like the shared-memory transport): each rank builds a
``_C.CudaComm`` (cudaMalloc of flags + data, cudaIpcGetMemHandle), the handle bytes go
round with ``dist.all_gather_object``, and each rank opens its peers' handles. After that
a collective is one kernel launch and needs no host communication.

Streams. A collective runs on the communicator's own CUDA stream, after all work already
queued on the caller's current stream (so inputs are ready). Synchronous calls then make
the current stream wait for it: like NCCL, the call returns before the GPU has finished,
and later work on the current stream is ordered after the collective. With
``async_op=True`` the current stream does not wait; ``work.wait()`` makes the then-current
stream wait on an event recorded after the collective. Neither blocks the host;
``synchronize()`` does.

Errors. A kernel whose wait outlasts the timeout records where (rank, peer, step) in
host-mapped memory, sets its rank's ``aborted`` flag (which its neighbours' waits watch, so
the whole ring stops) and returns. Before any data moves each rank's kernel compares its
call (collective, dtype, op, count, kernel variant) with its left neighbour's, so
mismatched calls raise RingcollMismatchError on every rank, as on the CPU transport
(``check=False`` / RINGCOLL_CHECK=0 turns the check off). The host sees a kernel's error at
the next synchronisation point: ``synchronize()``, ``Work.wait()``, ``barrier()`` or the
next collective call, which raise and leave the communicator broken.

Kernel variant: ``RINGCOLL_CUDA_KERNEL=fused`` (default: 8 thread blocks, 16-byte vectors,
one launch per collective) or ``naive`` (one block, scalar loops, one launch per ring
step: the teaching version); read at construction, must agree on all ranks (checked).
The kernels' code also runs on the CPU in CI, through ``_C.emulation``
(tests/test_emulated_kernels.py).

CuPy (or any DLPack / ``__cuda_array_interface__`` producer): the collectives take such
arrays wherever they take tensors, viewing them as tensors over the same memory, on
torch's current stream. :meth:`CudaCommunicator.all_reduce_array` and friends run on a
stream given explicitly instead (``stream=cupy.cuda.get_current_stream().ptr``), reading
pointer, shape and typestr with :func:`as_device_array`.
"""

from __future__ import annotations

import os
import warnings
from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from ringcoll import _C
from ringcoll._types import ReduceOp, dtype_code, op_code
from ringcoll.communicator import Communicator
from ringcoll.errors import RingcollError

KERNEL_VARIANTS = {"fused": 0, "naive": 1}


def kernel_variant() -> int:
    name = os.environ.get("RINGCOLL_CUDA_KERNEL", "fused").strip().lower()
    if name not in KERNEL_VARIANTS:
        raise ValueError(f"Communicator: RINGCOLL_CUDA_KERNEL={name!r}; expected one of "
                         + ", ".join(KERNEL_VARIANTS))
    return KERNEL_VARIANTS[name]


def _require_cuda_build() -> None:
    if not getattr(_C, "built_with_cuda", False):
        raise RingcollError("Communicator: this ringcoll build has no CUDA backend (nvcc was not found "
                            "when it was built); rebuild with nvcc on PATH to use CUDA tensors")
    if not torch.cuda.is_available():
        raise RingcollError("Communicator: CUDA tensors were requested but torch sees no CUDA device")


class CudaWork:
    """Handle of an async CUDA collective. ``wait()`` makes the current stream wait for it
    (no host blocking), then reports any kernel error already recorded."""

    def __init__(self, transport: "CudaTransport", event: torch.cuda.Event, result: list, keep_alive: Sequence):
        self._transport = transport
        self._event = event
        self._result = result
        self._keep_alive = keep_alive

    def wait(self, timeout: Optional[float] = None) -> bool:
        torch.cuda.current_stream(self._transport.device).wait_event(self._event)
        self._transport.check_error()
        return True

    def synchronize(self) -> None:
        """Block the host until the collective finished; raises its error, if any."""
        self._event.synchronize()
        self._transport.check_error()

    def is_completed(self) -> bool:
        return self._event.query()

    def is_success(self) -> bool:
        if not self._event.query():
            return False
        try:
            self._transport.check_error()
            return True
        except RingcollError:
            return False

    def exception(self):
        try:
            self._transport.check_error()
        except RingcollError as e:
            return e
        return None

    def result(self) -> list:
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        self.wait()
        future.set_result(self._result)
        return future


class CudaTransport:
    """The `_impl` of a Communicator on a CUDA device: HostComm's call surface
    (``all_reduce(src, dst, count, dtype, op)``, ...) over ``_C.CudaComm``, plus ``run``,
    which launches a call on the current stream (sync) or returns a :class:`CudaWork`."""

    def __init__(self, owner: Communicator):
        _require_cuda_build()
        self.device = device = owner.device
        self.rank = owner.rank
        self.world_size = owner.world_size
        variant = kernel_variant()
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._comm = _C.CudaComm(self.rank, self.world_size, index, owner.buffer_bytes, owner.timeout, owner.check,
                                 variant)
        try:
            variant_name = next(name for name, code in KERNEL_VARIANTS.items() if code == variant)
            handles = owner._exchange(self._comm.handle_bytes(), **{"RINGCOLL_CUDA_KERNEL": variant_name})
        except BaseException:
            self._comm.close()
            raise
        try:
            self._comm.open_peers(handles)
            # Every rank must have mapped every peer before anyone may close (and free) its buffer.
            dist.barrier(group=owner.group)
            self._stream = torch.cuda.ExternalStream(self._comm.stream_handle, device=device)
        except BaseException:
            self._comm.close(wait_for_peers=False)  # peers may be mapping us: keep the buffer
            raise
        self._launch_stream = 0
        self._join = True
        self._scratch = torch.zeros(1, dtype=torch.int32, device=device)  # barrier's payload

    # HostComm's surface, used by Communicator's call lambdas.
    def all_reduce(self, src, dst, count, dtype, op):
        self._comm.all_reduce(src, dst, count, dtype, op, self._launch_stream, self._join)

    def reduce_scatter(self, src, dst, count, dtype, op):
        self._comm.reduce_scatter(src, dst, count, dtype, op, self._launch_stream, self._join)

    def all_gather(self, src, dst, count, dtype):
        self._comm.all_gather(src, dst, count, dtype, self._launch_stream, self._join)

    def barrier(self):
        """An all-reduce of one int on the device, then a host wait for it (like NCCL's)."""
        self._comm.all_reduce(self._scratch.data_ptr(), self._scratch.data_ptr(), 1, 6, 0,
                              torch.cuda.current_stream(self.device).cuda_stream, True)
        self._comm.synchronize()

    def run(self, call, outputs: list, keep_alive: Sequence, async_op: bool):
        self._comm.check_error()
        self._launch_stream = torch.cuda.current_stream(self.device).cuda_stream
        self._join = not async_op
        if not async_op:
            call()  # anything the call queues after the kernel (list copies) follows it on this stream
            return None
        with torch.cuda.stream(self._stream):
            call()  # list copies go on our stream, after the kernel
        event = torch.cuda.Event()
        event.record(self._stream)
        for t in list(outputs) + list(keep_alive):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(self._stream)  # the caching allocator must not reuse them early
        return CudaWork(self, event, list(outputs), keep_alive)

    def check_error(self):
        self._comm.check_error()

    def synchronize(self):
        self._comm.synchronize()

    def close(self, wait_for_peers: bool = True):
        """Collective (cuda_comm.cu says why): returns once every peer has closed too, or
        after the timeout, keeping this rank's buffer until the process exits. Without
        `wait_for_peers` it does not wait and keeps the buffer."""
        self._comm.close(wait_for_peers)
        if self._comm.kept_on_close:  # stacklevel: the caller of CudaCommunicator.close()
            warnings.warn(f"ringcoll: rank {self.rank} keeps its GPU buffer until the process exits, since "
                          f"peers may still map it: {self._comm.kept_on_close}", RuntimeWarning, stacklevel=4)

    @property
    def broken(self) -> bool:
        return self._comm.broken

    @property
    def broken_reason(self) -> str:
        return self._comm.broken_reason

    @property
    def comm(self):
        return self._comm


class CudaCommunicator(Communicator):
    """:class:`ringcoll.Communicator` for CUDA tensors, over CUDA IPC (see the module doc).

    Same methods, signatures and validation as the CPU Communicator; tensors must live on
    ``device`` (default: the current CUDA device). Extra: :meth:`synchronize`, and the
    ``*_array`` methods for CuPy / ``__cuda_array_interface__`` arrays.
    """

    def __init__(self, group=None, device=None, timeout=None, buffer_bytes=None, check=None):
        _require_cuda_build()
        device = torch.device(device if device is not None else "cuda")
        if device.type != "cuda":
            raise ValueError(f"Communicator: CudaCommunicator serves CUDA devices, not {device}")
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self._configure(group, device, timeout, buffer_bytes, check, slot_alignment=128)
        self._impl = CudaTransport(self)
        self._start()

    def _run(self, call, outputs: list, keep_alive: Sequence, async_op: bool):
        with self._lock:
            return self._impl.run(call, outputs, keep_alive, async_op)

    def barrier(self, async_op: bool = False):
        self._ensure_open("barrier")
        with self._lock:
            self._impl.barrier()
        return None

    def synchronize(self) -> None:
        """Block until every collective issued so far finished; raise a recorded error."""
        with self._lock:
            self._impl.synchronize()

    def close(self) -> None:
        """Collective: returns once every peer has closed too, so call it on every rank at
        the same point (or use ``with``, or ``ringcoll.destroy_communicators()``)."""
        self._close(wait_for_peers=True)

    def __del__(self):
        # The garbage collector may get here on one rank only, at any point: waiting for
        # peers there could stall that rank for the whole timeout, so the buffer is kept
        # until the process exits instead (with a RuntimeWarning saying so).
        try:
            if not getattr(self, "_closed", True):
                self._close(wait_for_peers=False)
        except Exception:
            pass

    def _close(self, wait_for_peers: bool) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._impl.close(wait_for_peers)

    # --- CuPy arrays wherever tensors go ---------------------------------------------------
    # A CuPy array (or any DLPack / __cuda_array_interface__ producer) is viewed as a torch
    # tensor over the same memory, no copy (_tensor_view), and then validated and run like
    # one, on torch's current stream. DLPack's stream handshake orders the collective after
    # the producer's queued work; CuPy's default stream is the same legacy stream as torch's.
    # For work on another stream, the *_array forms below take the stream explicitly.

    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op: bool = False, *, output=None):
        return super().all_reduce(_tensor_view(tensor), op, async_op, output=_tensor_view(output))

    def reduce_scatter_tensor(self, output, input, op=ReduceOp.SUM, async_op: bool = False):
        return super().reduce_scatter_tensor(_tensor_view(output), _tensor_view(input), op, async_op)

    def all_gather_into_tensor(self, output_tensor, input_tensor, async_op: bool = False):
        return super().all_gather_into_tensor(_tensor_view(output_tensor), _tensor_view(input_tensor), async_op)

    def all_gather(self, tensor_list: list, tensor, async_op: bool = False):
        return super().all_gather([_tensor_view(t) for t in tensor_list], _tensor_view(tensor), async_op)

    def reduce_scatter(self, output, input_list: list, op=ReduceOp.SUM, async_op: bool = False):
        return super().reduce_scatter(_tensor_view(output), [_tensor_view(t) for t in input_list], op, async_op)

    # --- CuPy and other __cuda_array_interface__ arrays, on a given stream ------------------

    def all_reduce_array(self, array, op=ReduceOp.SUM, *, output=None, stream: Optional[int] = None) -> None:
        """In place (or into ``output``): all-reduce of a CUDA array. ``stream``: a
        cudaStream_t as an int (CuPy: ``cupy.cuda.get_current_stream().ptr``); default torch's
        current stream."""
        src = as_device_array(array)
        dst = as_device_array(output) if output is not None else src
        _same_shape("all_reduce", dst, src.count)
        self._raw("all_reduce", src, dst, src.count, op, stream)

    def reduce_scatter_array(self, output, input, op=ReduceOp.SUM, *, stream: Optional[int] = None) -> None:
        src, dst = as_device_array(input), as_device_array(output)
        _same_shape("reduce_scatter", src, dst.count * self.world_size)
        self._raw("reduce_scatter", src, dst, dst.count, op, stream)

    def all_gather_array(self, output, input, *, stream: Optional[int] = None) -> None:
        src, dst = as_device_array(input), as_device_array(output)
        _same_shape("all_gather", dst, src.count * self.world_size)
        self._raw("all_gather", src, dst, src.count, None, stream)

    def _raw(self, name, src: "DeviceArray", dst: "DeviceArray", count: int, op, stream) -> None:
        self._ensure_open(name)
        if src.dtype != dst.dtype:
            raise TypeError(f"{name}: output dtype {dst.dtype} differs from input dtype {src.dtype}")
        dtype = dtype_code(name, src.dtype)
        stream = torch.cuda.current_stream(self.device).cuda_stream if stream is None else int(stream)
        comm = self._impl.comm
        with self._lock:
            comm.check_error()
            if name == "all_gather":
                comm.all_gather(src.ptr, dst.ptr, count, dtype, stream, True)
            else:
                code = op_code(name, op, src.dtype)
                getattr(comm, name)(src.ptr, dst.ptr, count, dtype, code, stream, True)


def _tensor_view(array):
    """A torch tensor over the same memory as `array` (DLPack first, which also carries
    bfloat16, else __cuda_array_interface__); tensors and None pass through, anything else
    is left for the collective's own validation to name."""
    if array is None or isinstance(array, torch.Tensor):
        return array
    if hasattr(array, "__dlpack__"):
        return torch.from_dlpack(array, copy=False)  # raises rather than copy
    if hasattr(array, "__cuda_array_interface__"):
        return torch.as_tensor(array)  # no dtype or device given: a view, never a copy
    return array


class DeviceArray(NamedTuple):
    ptr: int
    count: int
    dtype: torch.dtype


_TYPESTRS = {"<f4": torch.float32, "<f8": torch.float64, "<f2": torch.float16, "|i1": torch.int8,
             "|u1": torch.uint8, "<i4": torch.int32, "<i8": torch.int64}


def as_device_array(array) -> DeviceArray:
    """(pointer, element count, torch dtype) of a torch CUDA tensor or any object with a
    ``__cuda_array_interface__`` (CuPy, Numba, JAX...). Must be C-contiguous. bfloat16 has
    no standard typestr, so it is only accepted from torch tensors."""
    if isinstance(array, torch.Tensor):
        if not array.is_cuda or not array.is_contiguous():
            raise ValueError("array: expected a contiguous CUDA tensor")
        return DeviceArray(array.data_ptr(), array.numel(), array.dtype)
    cai = getattr(array, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError(f"array: {type(array).__name__} has no __cuda_array_interface__")
    shape = tuple(cai["shape"])
    typestr = cai["typestr"]
    if typestr not in _TYPESTRS:
        raise TypeError(f"array: unsupported typestr {typestr!r}; supported: {', '.join(_TYPESTRS)}")
    dtype = _TYPESTRS[typestr]
    count = 1
    for s in shape:
        count *= s
    strides = cai.get("strides")
    if strides is not None:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        expected, step = [], itemsize
        for s in reversed(shape):
            expected.append(step)
            step *= s
        if tuple(reversed(expected)) != tuple(strides) and count > 1:
            raise ValueError("array: must be C-contiguous")
    return DeviceArray(int(cai["data"][0]), count, dtype)


def _same_shape(name: str, array: DeviceArray, expected: int) -> None:
    if array.count != expected:
        raise ValueError(f"{name}: array has {array.count} elements, expected {expected}")
