"""The CUDA transport's kernels on the CPU, as a transport: CI's stand-in for the in-process
CUDA mode (there is no GPU in CI).

The ranks are threads of one process (ringcoll.run_in_process), as in the in-process CUDA
mode; their "GPU allocations" are host memory laid out as on the GPU, and each call runs
device_ring.h's thread blocks as std::threads (``_C.emulation.Ring``, csrc/emulation/) over
the caller's CPU tensors: the same launch plan, flags, mismatch check, errors and collective
close as ``_C.CudaComm``. So a Communicator over it takes the benchmark's exact checks
(ringcoll/harness/exact.py) through the whole Python path, kernels included.

Streams are modelled (csrc/emulation/emulated_streams.h): one emulated device per process,
made at first use as a CUDA context is, with CUDA_DEVICE_MAX_CONNECTIONS hardware queues;
each thread has a current stream (the shared legacy default stream unless
:func:`stream` / :func:`set_stream` say otherwise), and calls are queued on streams in the
order CudaComm queues them (csrc/cuda/stream_order.h). Host code stands for the work a GPU
program would queue on its current stream after the call, so where that code reads a
result the host waits for the stream: at the end of a synchronous call, in ``Work.wait()``.
What CudaTransport itself queues after a kernel (a list form's copy into the caller's
tensors) is a Python kernel on the same stream here, so it runs in stream order, is captured
with the call and runs again at each replay (its closure keeps the call's flat buffer alive
as long as the graph, as torch's graph pool does on a GPU).
Where rank-thread code says it allocates (``wait_for_the_whole_device``), the host waits for
all the device's work, as an allocation may on a GPU. What it does not have is what only a
GPU has: IPC, SM occupancy, the memory model and the compiled PTX. For tests (tests/multiprocess/test_in_process.py); a Communicator gets it by
overriding ``Communicator.transport_class``.
"""

from __future__ import annotations

import builtins
import contextlib
import threading
import warnings
from typing import Callable, Optional, Sequence

import torch

from ringcoll import _C, errors
from ringcoll._types import COLLECTIVE_CODES
from ringcoll.bootstrap import InProcessRank
from ringcoll.errors import RingcollError, RingcollTimeoutError
from ringcoll.transports.base import (CollectiveCall, InFlight, Settings, SymmetricAgreement, Transport,
                                      allocate_by_exchange)
from ringcoll.transports.cuda import (CAPTURED_ALLOCATION, captured_call_error, check_hardware_queues,
                                      hardware_queues, kernel_plan_slot_area, kernel_variant, one_word_barrier,
                                      rank_threads, refuse_in_capture, shared_stream_error)

LEGACY = _C.emulation.Device.LEGACY  # the legacy default stream: every thread's, unless told otherwise
_device = None
_device_lock = threading.Lock()
_current = threading.local()


def device():
    """This process's emulated GPU, made at first use (CUDA_DEVICE_MAX_CONNECTIONS read then)."""
    with _device_lock:
        made = _device
    return made if made is not None else reset_device()


def reset_device(queues: Optional[int] = None):
    """A fresh emulated GPU, as a new process would get (for tests): `queues` hardware
    queues, default CUDA_DEVICE_MAX_CONNECTIONS's. Rings built before keep the old one."""
    global _device
    with _device_lock:
        _device = _C.emulation.Device(queues or hardware_queues())
        return _device


def current_stream() -> int:
    """This thread's current emulated stream (torch.cuda.current_stream's counterpart)."""
    return getattr(_current, "stream", LEGACY)


def set_stream(stream: int) -> None:
    _current.stream = stream


@contextlib.contextmanager
def stream(s: int):
    """Make `s` this thread's current emulated stream inside the block (torch.cuda.stream's counterpart)."""
    before = current_stream()
    set_stream(s)
    try:
        yield s
    finally:
        set_stream(before)


EMULATED_SMS = 8  # the emulated device's SM count: bounds a fused launch's grid
THREADS_PER_BLOCK = 4  # each a std::thread; the kernels' loops stride by it as by blockDim


class EmulatedCompletion:
    """An async emulated call, as ringcoll.Work sees it (StreamCompletion's counterpart):
    ``wait()`` makes the current stream wait for the call's event, then (host code standing
    for that stream's later work) waits for the stream on the host. `captured`: as
    StreamCompletion's."""

    def __init__(self, transport: "EmulatedCudaTransport", op: str, event: int, captured: bool):
        self._transport, self._op, self._event = transport, op, event
        self._finished, self._captured = False, captured

    def _finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        self._transport.device.destroy_event(self._event)
        self._transport.check_error(self._op)

    def wait(self, timeout: Optional[float]) -> None:
        if self._captured and not self._transport.device.is_capturing(current_stream()):
            raise captured_call_error(self._op, "wait() after the capture ended for")
        if self._finished:
            return self._transport.check_error(self._op)
        user = self._transport.user_stream(self._op)
        self._transport.device.wait(user, self._event)
        self._transport.host_waits_for(self._op, user)
        self._finish()

    def done(self) -> bool:
        return self._finished or self._captured or self._transport.device.query_event(self._event, current_stream())

    def error(self) -> Optional[BaseException]:
        if not self.done():
            return None
        try:
            self._transport.check_error(self._op)
        except RingcollError as e:
            return e
        return None

    def on_done(self, fn: Callable[[], None]) -> None:
        self.wait(None)
        fn()

    def synchronize(self) -> None:
        if self._captured:
            raise captured_call_error(self._op, "synchronize() of")
        if not self._finished and not self._transport.device.synchronize_event(self._event,
                                                                             self._transport.host_wait_seconds):
            self._transport.stuck(self._op)
        self._finish()


class RankParts:
    """One rank's symmetric-memory steps on the emulator, named as CudaComm's (allocate_by_exchange)."""

    def __init__(self, ring, rank: int):
        self._ring, self._rank = ring, rank

    def __getattr__(self, step: str):
        method = getattr(self._ring, step)
        return lambda *args: method(self._rank, *args)


class EmulatedCudaTransport(Transport):
    """Rank ``settings.rank`` of one ``_C.emulation.Ring`` that rank 0 builds on the process's
    emulated device and the bootstrap hands round (threads of one process share it)."""

    slot_alignment = _C.cuda_slot_alignment
    plan_slot_area = staticmethod(kernel_plan_slot_area)
    takes_arrays = False
    symmetric_by_plan = True  # auto over symmetric memory: the direct plan, else the ring's (base.py)
    plain_calls = None  # every call goes through the Python path, as on CUDA
    # Issue 22's defect 1 fixed: an in-process rank on the shared legacy stream is moved onto
    # its communicator's stream, and a call from the shared stream refused. A test turns it
    # off to show the deadlock of the old order.
    own_stream_per_rank = True
    # The in-process CUDA mode, whose peers read plain device pointers; a test sets it False to
    # model peers in other processes, which reach only symmetric memory (EmulatedRing's
    # peers_in_process).
    peers_in_process = True

    @staticmethod
    def resolve_device(device):
        if device.type != "cpu":
            raise ValueError(f"Communicator: the emulated CUDA transport runs on CPU tensors, not {device}")
        return device

    def __init__(self, settings: Settings, exchange: Callable[..., list]):
        if not isinstance(settings.bootstrap, InProcessRank):
            raise RingcollError("Communicator: the emulated CUDA transport needs the ranks as threads of one "
                                "process (ringcoll.run_in_process)")
        self.rank = settings.rank
        self._bootstrap = settings.bootstrap  # the other ranks' threads, for symmetric memory's exchanges
        check_hardware_queues(settings.world_size, device().hardware_queues)
        name, variant = kernel_variant()
        # Made before the exchange, as CudaTransport makes it (there an allocation may wait for
        # the whole device, after the exchange a faster peer's first ring among it)
        self._barrier_word, self._barrier_call = one_word_barrier("cpu")  # CUDA's barrier, on the CPU
        ring = None
        if settings.rank == 0:
            ring = _C.emulation.Ring(settings.world_size, settings.buffer_bytes, settings.timeout, variant,
                                     threads_per_block=THREADS_PER_BLOCK, check_calls=settings.check,
                                     max_blocks=EMULATED_SMS, device=device(),
                                     peers_in_process=self.peers_in_process)
        self._ring = exchange(ring, RINGCOLL_CUDA_KERNEL=name)[0]
        self.device = self._ring.device
        self.host_wait_seconds = self._ring.host_wait_seconds
        self._own = self._ring.own_stream(self.rank)
        self._parts = RankParts(self._ring, self.rank)  # symmetric memory's steps (a test may make one fail)
        self._symmetric = SymmetricAgreement()
        self._in_flight = InFlight()
        self.moved_thread = None  # (RankThreads)
        if self.own_stream_per_rank and current_stream() == LEGACY:
            self._order(LEGACY, before=self._own)  # as CudaTransport does: what it queued so far comes first,
            set_stream(self._own)  # then this rank's work goes on a stream of its own
            self.moved_thread = threading.get_ident()
        rank_threads.opened(self)
        self._error: Optional[RingcollError] = None

    def _order(self, first: int, before: int) -> None:
        """Stream `before`'s later work after what stream `first` holds now (wait_stream)."""
        queued = self.device.create_event()
        self.device.record(queued, first)
        self.device.wait(before, queued)
        self.device.destroy_event(queued)

    @property
    def broken(self) -> bool:
        return self._error is not None

    @property
    def broken_reason(self) -> str:
        return str(self._error) if self._error is not None else ""

    def _raise(self, op: str, result: tuple) -> None:
        """Raise what CudaComm would for a (error type, message) result of the ring."""
        kind, message = result
        if not kind:
            return
        error = getattr(errors, kind, None) or getattr(builtins, kind, RingcollError)
        if issubclass(error, RingcollError):
            self._error = error(f"{op}: {message}")
            raise self._error
        raise error(f"{op}: {message}")

    def check_error(self, op: str) -> None:
        """A kernel's recorded error, or the one that broke the communicator, raised."""
        if self._error is not None:
            raise self._error
        self._raise(op, self._ring.check_error(self.rank))

    def stuck(self, op: str) -> None:
        self._error = RingcollTimeoutError(
            f"{op}: rank {self.rank}'s work on the emulated device did not finish within {self.host_wait_seconds:g} "
            "s: its queues are stuck (a cycle in the order of the streams)")
        raise self._error

    def wait_for_the_whole_device(self, what: str) -> None:
        """What an allocation (cudaMalloc growing torch's cache), a free or a copy to or from
        pageable memory may do on a GPU: wait for all the device's work, a peer's ring among
        it (docs/cuda.md, "What not to call while a ring runs"). Rank-thread code that
        allocates calls it (harness/exact.py), so the CPU tests stop where a GPU would: if a
        peer's ring already waits for this rank, its timeout ends the wait, and the calls
        that follow raise."""
        if not self.device.synchronize_device(self.host_wait_seconds):
            self.stuck(what)

    def user_stream(self, op: str) -> int:
        """The current stream, which the call follows; the shared one refused where ranks share it."""
        stream = current_stream()
        if stream == LEGACY and self.own_stream_per_rank:
            raise shared_stream_error(op, self.rank)
        return stream

    def host_waits_for(self, op: str, stream: int) -> None:
        if not self.device.synchronize_stream(stream, self.host_wait_seconds):
            self.stuck(op)
        self.check_error(op)

    def submit(self, call: CollectiveCall, outputs: list, keep_alive: Sequence, async_op: bool,
               then: Optional[Callable[[], None]] = None, name: Optional[str] = None):
        """CudaTransport.submit's order on the emulated device."""
        op = name or call.collective
        if self._error is not None:
            raise RingcollError(f"{op}: communicator is broken by an earlier error ({self._error})")
        user = self.user_stream(op)
        emulated = (self.rank, COLLECTIVE_CODES[call.collective], call.dtype, call.op or 0, call.src, call.dst,
                    call.user_count, call.plan)
        self._raise(op, self._ring.enqueue(emulated, user, not async_op))
        if then is not None:  # CudaTransport's: queued after the kernel on the stream that follows it (so
            self.device.launch(self._own if async_op else user, then)  # captured, and replayed, with it)
        if async_op:
            event = self.device.create_event()
            self.device.record(event, self._own)
            captured = self.device.is_capturing(user)
            completion = EmulatedCompletion(self, op, event, captured)
            if not captured:  # a graph's tensors outlive it (torch's rule), and its replays run the call
                self._in_flight.hold(completion, list(outputs) + list(keep_alive))  # the queued kernel's tensors
            return completion
        self.host_waits_for(op, user)  # host code stands for the current stream's later work
        return None

    def barrier(self, async_op: bool):
        """CudaTransport's: an all-reduce of one int, then a host wait; always synchronous,
        so refused inside a capture."""
        refuse_in_capture("barrier", self.device.is_capturing(current_stream()))
        self.submit(self._barrier_call, [], (), False, name="barrier")
        self.synchronize()

    def synchronize(self) -> None:
        refuse_in_capture("synchronize", self.device.is_capturing(current_stream()))
        self.host_waits_for("synchronize", self._own)

    def launch_on_stream(self, call: CollectiveCall, stream) -> None:
        raise ValueError(f"{call.collective}: the emulated CUDA transport takes no caller-given stream")

    # --- symmetric memory: CudaTransport's, over the emulator's arenas (memfd parts) ---------

    def allocate_symmetric(self, nbytes: int, dtype: int, dims: list):
        if self.device.is_capturing(current_stream()):
            raise RingcollError(CAPTURED_ALLOCATION)
        self._in_flight.release_finished()  # blocks whose calls are done go back to the pool first
        block = allocate_by_exchange(self._parts, self._bootstrap, self.rank, nbytes, dtype, dims, self._symmetric)
        return torch.frombuffer(block, dtype=torch.uint8)  # host memory: the tensor holds the block

    def is_symmetric(self, address: int) -> bool:
        return self._ring.is_symmetric(self.rank, address, 1)

    @property
    def symmetric_arenas(self) -> int:
        return self._symmetric.arenas

    def close(self, wait_for_peers: bool = True) -> None:
        """The collective close of cuda_comm.cu, as the emulator runs it (its own work waited
        for, then every peer's `finished` word); a kept allocation is warned about, as on a GPU."""
        fate, heir = rank_threads.closing(self, current_stream() == self._own)  # CudaTransport.close's
        if fate == "hand over":
            self._order(self._own, before=heir._own)
            set_stream(heir._own)
        elif fate == "legacy":
            set_stream(LEGACY)
        elif fate == "retire":
            self._ring.retire_stream(self.rank)
        how = _C.emulation.Ring.CLOSE if wait_for_peers else _C.emulation.Ring.CLOSE_WITHOUT_WAITING  # (a finalizer)
        [(kind, kept)] = self._ring.run([(self.rank, how, 0, 0, 0, 0, 0)])
        self._in_flight.clear()  # its own work is done
        if kind:
            raise AssertionError(f"close: {kept}")  # the emulator caught a protocol error
        if kept:
            warnings.warn(f"ringcoll: rank {self.rank} keeps its emulated buffer: {kept}", RuntimeWarning,
                          stacklevel=4)
