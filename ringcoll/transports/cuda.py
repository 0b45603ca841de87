"""The CUDA transport, Python side: a ring of P ranks whose GPU buffers are mapped into one
another (csrc/cuda/): through CUDA IPC between processes, or as plain device pointers
between the threads of one process (ringcoll.run_in_process).

Bootstrap (collective over the group, like the shared-memory transport): each rank builds a
``_C.CudaComm`` (cudaMalloc of flags + data), its handle (IPC handle, address, process
token) goes round the group's bootstrap (ringcoll/bootstrap.py), and each rank opens its
peers'. After that a collective is one kernel launch and needs no host communication.

Streams. A collective runs on the communicator's own CUDA stream, after all work already
queued on the caller's current stream (so inputs are ready). Synchronous calls then make
the current stream wait for it: like NCCL, the call returns before the GPU has finished,
and later work on the current stream is ordered after the collective. With
``async_op=True`` the current stream does not wait; ``work.wait()`` makes the then-current
stream wait on an event recorded after the collective. Neither blocks the host;
``synchronize()`` does. The order is csrc/cuda/stream_order.h's.

In-process ranks (ringcoll.run_in_process) must not share a stream: on the legacy default
stream, which every thread of a process shares, rank 0's wait for its kernel would sit in
front of rank 1's "inputs ready" record, which rank 1's kernel (and so rank 0's) waits
for: a deadlock until the ring timeout. So a communicator built on such a rank moves the
rank's thread onto the communicator's own stream (one stream per rank: nothing of one rank
can queue behind another's), and a later call from the legacy default stream is refused.
Closing it moves the thread on (RankThreads: never back onto the legacy stream while the
rank has another communicator open).
The driver spreads streams over CUDA_DEVICE_MAX_CONNECTIONS in-order hardware queues (8 by
default); two ranks' streams on one queue are falsely ordered, and can deadlock the same
way, so run_in_process raises it to 32 before CUDA starts, and an in-process ring of P
ranks is refused with fewer than P + 1 queues. Calls that synchronise the whole device (cudaFree,
cudaMalloc growing torch's cache, cudaDeviceSynchronize) wait for a peer's ring that is
waiting for this rank: make every allocation before the ranks' first collective meets
(docs/cuda.md, "What not to call while a ring runs").

Errors. A kernel whose wait outlasts the timeout records where (rank, peer, step) in
host-mapped memory, sets its rank's ``aborted`` flag (which its neighbours' waits watch, so
the whole ring stops) and returns. Before any data moves each rank's kernel compares its
call (collective, dtype, op, count, kernel variant) with its left neighbour's, so
mismatched calls raise RingcollMismatchError on every rank, as on the CPU transport
(``check=False`` / RINGCOLL_CHECK=0 turns the check off). The host sees a kernel's error at
the next synchronisation point: ``synchronize()``, ``Work.wait()``, ``barrier()`` or the
next collective call, which raise and leave the communicator broken.

Kernel variant: ``RINGCOLL_CUDA_KERNEL=fused`` (default: up to one thread block per SM,
16-byte vectors, one launch per collective) or ``naive`` (one block, scalar loops, one launch per ring
step: the teaching version); read at construction, must agree on all ranks (checked).
The kernels' code also runs on the CPU in CI, through ``_C.emulation``
(tests/pure/test_emulated_kernels.py).

CuPy (or any DLPack / ``__cuda_array_interface__`` producer): the Communicator views such
arrays as tensors over the same memory (ringcoll/views.py) and runs them on torch's current
stream; its ``*_array`` methods run on a stream given explicitly instead
(``stream=cupy.cuda.get_current_stream().ptr``, through :meth:`CudaTransport.launch_on_stream`).
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Callable, Optional, Sequence

import torch

from ringcoll import _C
from ringcoll._types import ReduceOp, dtype_code
from ringcoll.bootstrap import InProcessRank
from ringcoll.errors import RingcollError
from ringcoll.transports.base import (CollectiveCall, InFlight, Settings, SymmetricAgreement, Transport,
                                      allocate_by_exchange)

KERNEL_VARIANTS = {"fused": 0, "naive": 1}


def kernel_variant() -> tuple[str, int]:
    """RINGCOLL_CUDA_KERNEL's variant: its name (which the ranks compare) and its code."""
    name = os.environ.get("RINGCOLL_CUDA_KERNEL", "fused").strip().lower()
    if name not in KERNEL_VARIANTS:
        raise ValueError(f"Communicator: RINGCOLL_CUDA_KERNEL={name!r}; expected one of "
                         + ", ".join(KERNEL_VARIANTS))
    return name, KERNEL_VARIANTS[name]


DEFAULT_HARDWARE_QUEUES = 8  # the driver's CUDA_DEVICE_MAX_CONNECTIONS when unset
IN_PROCESS_HARDWARE_QUEUES = 32  # the most it allows; what run_in_process sets


def hardware_queues() -> int:
    """The in-order hardware queues the driver spreads streams over (CUDA_DEVICE_MAX_CONNECTIONS,
    read by CUDA when it initialises)."""
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip()
    return int(value) if value.isdigit() and 1 <= int(value) <= 32 else DEFAULT_HARDWARE_QUEUES


def check_hardware_queues(world: int, queues: Optional[int] = None) -> None:
    """An in-process ring of `world` ranks needs a hardware queue per rank's stream, besides the
    legacy default stream's: with fewer, two ranks' streams share an in-order queue, and one
    rank's next kernel, waiting there for its previous one, holds back a peer's kernel that
    the previous one waits for. `queues`: the device's, default hardware_queues()."""
    queues = queues or hardware_queues()
    if world + 1 > queues:
        raise RingcollError(f"Communicator: {world} in-process ranks on one GPU need {world + 1} hardware queues, but "
                            f"CUDA_DEVICE_MAX_CONNECTIONS={queues}: set it to "
                            f"{IN_PROCESS_HARDWARE_QUEUES} before CUDA initialises (run_in_process does, when it "
                            "starts CUDA)")


def shared_stream_error(op: str, rank: int) -> RingcollError:
    return RingcollError(
        f"{op}: in-process rank {rank} is on the legacy default stream, which every thread of this process shares: "
        "its wait for this collective would sit in front of the next rank's launch, which its kernel waits for "
        "(a deadlock until the timeout). Run each rank on a stream of its own (`with torch.cuda.stream("
        "torch.cuda.Stream()):`); a communicator built on the default stream moves its rank onto its own")


# cudaStreamLegacy (0 and its alias 1): shared by every thread; cudaStreamPerThread (2) is not.
SHARED_STREAM_HANDLES = (0, 1)


class RankThreads:
    """Which in-process communicators each rank's thread has open, so that closing the one
    whose stream the thread was moved onto (module doc) breaks none of the others. The
    stream goes back to the lender at close, which may lend it to another rank's next
    communicator: the thread must leave it (two ranks on one stream deadlock as on the
    legacy one), but back on the legacy stream every other communicator of the rank would
    refuse its calls, so the thread moves onto the stream of one still open. A thread's
    current stream can only be changed by that thread: closed from another one (a finalizer,
    a shutdown thread), the stream is retired instead, never lent again."""

    def __init__(self):
        self._mine = threading.local()  # each thread's open transports, oldest first (gone with the thread)
        self._lock = threading.Lock()  # a list may be changed from another thread (a close)

    def opened(self, transport) -> None:
        """Note `transport`, made on this thread; sets its `thread_open`, the list it is in."""
        transport.thread_open = self._mine.__dict__.setdefault("open", [])
        with self._lock:
            transport.thread_open.append(transport)

    def closing(self, transport, on_its_stream: bool) -> tuple[str, Optional[object]]:
        """Forget `transport` (closing) and say what becomes of the stream it moved its
        thread onto (`transport.moved_thread`; `on_its_stream`: this thread is on it now):
        ("none", None) where it moved no thread; ("retire", None) where it cannot know its
        thread has left (closed from another thread, or the thread has stepped onto another
        stream and may step back); ("hand over", heir) to the newest transport the thread
        still has open; ("legacy", None) where it has none."""
        with self._lock:
            still = transport.thread_open
            if transport in still:
                still.remove(transport)
            heir = still[-1] if still else None
        if transport.moved_thread is None:
            return "none", None
        if transport.moved_thread != threading.get_ident() or not on_its_stream:
            return "retire", None
        if heir is not None:
            heir.moved_thread = transport.moved_thread
            return "hand over", heir
        return "legacy", None


rank_threads = RankThreads()  # both CUDA transports' (the emulated one models this one)


def one_word_barrier(device) -> tuple[torch.Tensor, CollectiveCall]:
    """The CUDA transport's barrier (like NCCL's): an all-reduce of one int32 word on
    `device`. Returns the word (kept alive by the caller) and the call."""
    word = torch.zeros(1, dtype=torch.int32, device=device)
    address = word.data_ptr()
    return word, CollectiveCall("all_reduce", address, address, 1, dtype_code("barrier", torch.int32),
                                int(ReduceOp.SUM))


def _require_cuda_build() -> None:
    if not getattr(_C, "built_with_cuda", False):
        raise RingcollError("Communicator: this ringcoll build has no CUDA backend (nvcc was not found "
                            "when it was built); rebuild with nvcc on PATH to use CUDA tensors")
    if not torch.cuda.is_available():
        raise RingcollError("Communicator: CUDA tensors were requested but torch sees no CUDA device")


def kernel_plan_slot_area(buffer_bytes: int, world: int) -> int:
    """Transport.plan_slot_area for the CUDA kernels (both CUDA transports'): they cut a plan's
    slots out of the ring's 2P slots (kernel_abi.h, plan_slot_bytes), which hold less than the
    whole buffer where it does not divide into them (P = 3, 4096 bytes: 3840)."""
    return _C.banks * world * _C.cuda_slot_bytes_for(buffer_bytes, world)


class DeviceBytes:
    """A block of symmetric memory on a GPU as torch takes device memory it does not own: through
    ``__cuda_array_interface__`` (bytes, no stream to wait for: nothing is queued on it). torch
    keeps this object, and so the block, alive as long as the tensor."""

    def __init__(self, block):
        self.block = block
        self.__cuda_array_interface__ = {"shape": (block.bytes,), "typestr": "|u1", "data": (block.address, False),
                                         "strides": None, "version": 3, "stream": None}


#: empty() while the current stream captures a CUDA graph
CAPTURED_ALLOCATION = ("empty: a collective allocation while the current stream captures a CUDA graph (cudaMalloc and "
                       "the exchange with the peers cannot be captured): allocate first")


def captured_call_error(op: str, what: str) -> RingcollError:
    """What a host wait on an async call captured in a CUDA graph raises: its event is only a
    point in the graph (a host query of it fails with cudaErrorCapturedEvent)."""
    return RingcollError(f"{op}: {what} a call captured in a CUDA graph: its work runs when the graph is "
                         "replayed, so wait() for it inside the capture, and synchronize the stream the graph "
                         "is launched on")


def refuse_in_capture(op: str, capturing: bool) -> None:
    """barrier() and synchronize() block the host until the GPU is done: not inside a capture."""
    if capturing:
        raise RingcollError(f"{op}: cannot run while the current stream is capturing a CUDA graph: it blocks "
                            "the host until the GPU is done, which a capture cannot contain. Call it before or "
                            "after the capture (collectives themselves can be captured)")


class StreamCompletion:
    """An async CUDA collective, as ringcoll.Work sees it: ``wait()`` makes the current stream
    wait for it (no host blocking), then reports any kernel error already recorded.
    `captured`: made while the caller's stream captured a CUDA graph; its event was recorded
    in the capture, so the host never queries it (done() says True: nothing is queued for
    the host; each replay runs the call), and only a wait() inside the capture may use it."""

    def __init__(self, transport: "CudaTransport", event: torch.cuda.Event, op: str, captured: bool):
        self._transport = transport
        self._event = event
        self._op, self._captured = op, captured

    def wait(self, timeout: Optional[float]) -> None:
        if self._captured and not self._transport.capturing():
            raise captured_call_error(self._op, "wait() after the capture ended for")
        torch.cuda.current_stream(self._transport.device).wait_event(self._event)
        self._transport.check_error()

    def done(self) -> bool:
        return self._captured or self._event.query()

    def error(self) -> Optional[BaseException]:
        try:
            self._transport.check_error()
        except RingcollError as e:
            return e
        return None

    def on_done(self, fn: Callable[[], None]) -> None:
        self.wait(None)  # ordered on the current stream: later work there sees the result
        fn()

    def synchronize(self) -> None:
        if self._captured:
            raise captured_call_error(self._op, "synchronize() of")
        self._event.synchronize()
        self._transport.check_error()


class CudaTransport(Transport):
    """CUDA IPC ring over ``_C.CudaComm`` (see the module doc)."""

    slot_alignment = _C.cuda_slot_alignment
    plan_slot_area = staticmethod(kernel_plan_slot_area)
    takes_arrays = True
    symmetric_by_plan = True  # auto over symmetric memory: the direct plan, else the ring's (base.py)

    @staticmethod
    def resolve_device(device: torch.device) -> torch.device:
        """The device with its index; raises RingcollError where CUDA cannot be used."""
        _require_cuda_build()
        return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())

    def __init__(self, settings: Settings, exchange: Callable[..., list]):
        self.device = device = settings.device  # resolved (and CUDA checked) by resolve_device
        self.rank = settings.rank
        self._bootstrap = settings.bootstrap
        self._in_process = isinstance(settings.bootstrap, InProcessRank)
        if self._in_process:
            check_hardware_queues(settings.world_size)
        variant_name, variant = kernel_variant()
        self._comm = _C.CudaComm(self.rank, settings.world_size, device.index, settings.buffer_bytes,
                                 settings.timeout, settings.check, variant)
        # The communicator's stream outlives it (cuda_comm.cu, StreamLender), so a tensor
        # recorded on it (record_stream, in submit) may be freed after close().
        self._stream = torch.cuda.ExternalStream(self._comm.stream_handle, device=device)
        # Before the exchange, where no peer can have started a ring yet: an allocation may
        # wait for all the device's work (docs/cuda.md), and after the barrier below a faster
        # peer's first ring, waiting for this rank, would be part of it.
        self._barrier_word, self._barrier_call = one_word_barrier(device)
        try:
            handles = exchange(self._comm.handle_bytes(), **{"RINGCOLL_CUDA_KERNEL": variant_name})
        except BaseException:
            self._comm.close()
            raise
        try:
            self._comm.open_peers(handles)
            # Every rank must have mapped every peer before anyone may close (and free) its buffer.
            self._bootstrap.barrier()
        except BaseException:
            self._comm.close(wait_for_peers=False)  # peers may be mapping us: keep the buffer
            raise
        self._lock = threading.Lock()  # launches from several host threads stay whole
        self._first_error: Optional[RingcollError] = None  # what _reporting raises from then on
        self._symmetric = SymmetricAgreement()
        self._in_flight = InFlight()
        self.moved_thread = None  # (RankThreads)
        if self._in_process:
            if torch.cuda.current_stream(device).cuda_stream in SHARED_STREAM_HANDLES:
                self._stream.wait_stream(torch.cuda.current_stream(device))  # what it queued there comes first
                torch.cuda.set_stream(self._stream)  # this rank's work on a stream of its own (module doc)
                self.moved_thread = threading.get_ident()
            rank_threads.opened(self)

    def _current_stream(self, op: str = "Communicator") -> int:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if self._in_process and stream in SHARED_STREAM_HANDLES:
            raise shared_stream_error(op, self.rank)
        return stream

    def submit(self, call: CollectiveCall, outputs: list, keep_alive: Sequence, async_op: bool,
               then: Optional[Callable[[], None]] = None, name: Optional[str] = None) -> Optional[StreamCompletion]:
        """Sync: the kernel follows the current stream's work and the current stream waits
        for it. Async: it follows the current stream's work, nothing waits; the Completion's
        wait() makes the then-current stream wait."""
        with self._lock:
            self.check_error()
            call.run(self._comm, self._current_stream(name or call.collective), not async_op)
            if not async_op:
                if then is not None:
                    then()  # on the current stream, which now follows the kernel
                return None
            with torch.cuda.stream(self._stream):
                if then is not None:
                    then()  # on our stream, after the kernel
            event = torch.cuda.Event()
            event.record(self._stream)
            tensors = list(outputs) + list(keep_alive)
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(self._stream)  # the caching allocator must not reuse them early
            captured = self.capturing()
            completion = StreamCompletion(self, event, name or call.collective, captured)
            if not captured:  # a graph's tensors outlive it (torch's rule), and its replays run the call
                self._in_flight.hold(completion, tensors)  # nor the symmetric pool, which record_stream misses
            return completion

    def launch_on_stream(self, call: CollectiveCall, stream: Optional[int]) -> None:
        """`call` on a caller-given cudaStream_t (an int; default torch's current stream),
        which then waits for it."""
        if stream is not None and self._in_process and int(stream) in SHARED_STREAM_HANDLES:
            raise shared_stream_error(call.collective, self.rank)  # as from torch's current stream
        with self._lock:
            self.check_error()
            call.run(self._comm, self._current_stream() if stream is None else int(stream), True)

    # --- symmetric memory (docs/symmetric.md; the steps: cuda_comm.h) -----------------------

    def allocate_symmetric(self, nbytes: int, dtype: int, dims: list) -> torch.Tensor:
        """A block of cudaMalloc'ed memory every peer has mapped (allocate_by_exchange), as a
        uint8 tensor on this device that holds the block."""
        if self.capturing():
            raise RingcollError(CAPTURED_ALLOCATION)
        with self._lock:
            self._in_flight.release_finished()  # blocks whose calls are done go back to the pool first
            block = allocate_by_exchange(self._comm, self._bootstrap, self.rank, nbytes, dtype, dims, self._symmetric)
        return torch.as_tensor(DeviceBytes(block), device=self.device)

    def is_symmetric(self, address: int) -> bool:
        return self._comm.is_symmetric(address, 1)

    @property
    def symmetric_arenas(self) -> int:
        return self._symmetric.arenas

    @property
    def run_mode(self) -> str:
        """How the peers are reached: "in-process" (threads of this process, plain device
        pointers), "IPC" (other processes), or "mixed"; "single" for one rank."""
        ipc, direct = self._comm.ipc_peers, self._comm.in_process_peers
        return "single" if ipc + direct == 0 else "IPC" if direct == 0 else "in-process" if ipc == 0 else "mixed"

    def capturing(self) -> bool:
        """Whether this thread's current stream on our device captures a CUDA graph (torch's
        is_current_stream_capturing asks about the current device, which may be another)."""
        return self._comm.stream_capturing(torch.cuda.current_stream(self.device).cuda_stream)

    def _refuse_in_capture(self, op: str) -> None:
        refuse_in_capture(op, self.capturing())

    def barrier(self, async_op: bool) -> None:
        """An all-reduce of one int on the device, then a host wait for it (like NCCL's);
        always synchronous, so refused inside a CUDA graph capture."""
        self._refuse_in_capture("barrier")
        with self._lock:
            self._barrier_call.run(self._comm, self._current_stream("barrier"), True)
            self._reporting(self._comm.synchronize)
        return None

    def _reporting(self, call: Callable[[], None]) -> None:
        """call() (CudaComm's check_error or synchronize), raising the first kernel error this
        communicator recorded every time from then on: CudaComm reports an error once, so a
        second wait, exception() or synchronize() returned as if the call had succeeded, its
        outputs garbage (the emulated transport keeps its error, which hid it in CI)."""
        if self._first_error is not None:
            raise self._first_error
        try:
            call()
        except RingcollError as e:
            self._first_error = e
            raise

    def check_error(self) -> None:
        self._reporting(self._comm.check_error)

    def synchronize(self) -> None:
        self._refuse_in_capture("synchronize")
        with self._lock:
            self._reporting(self._comm.synchronize)

    def close(self, wait_for_peers: bool = True) -> None:
        """Collective (cuda_comm.cu says why): every rank finishes and unmaps its peers, then
        the group's barrier, then every rank frees its buffer; returns once every peer has
        closed too, or after the timeout, keeping this rank's buffer until the process exits.
        Without `wait_for_peers` it does not wait and keeps the buffer."""
        if self._in_process:  # the thread leaves our stream, which goes back to the lender (RankThreads)
            fate, heir = rank_threads.closing(
                self, torch.cuda.current_stream(self.device).cuda_stream == self._stream.cuda_stream)
            if fate == "hand over":
                heir._stream.wait_stream(self._stream)  # what the thread queued on ours comes first
                torch.cuda.set_stream(heir._stream)
            elif fate == "legacy":
                torch.cuda.set_stream(torch.cuda.default_stream(self.device))
            elif fate == "retire":
                self._comm.retire_stream()
        with self._lock:
            self._comm.leave_peers(wait_for_peers)
            if wait_for_peers:
                self._in_flight.clear()  # leave_peers waited for our own work
            if wait_for_peers and not self._comm.kept_on_close and self._comm.world > 1:
                try:
                    # Bounded by the communicator's timeout: a peer that gave up on us skips it.
                    self._bootstrap.barrier(timeout=self._comm.timeout)
                except Exception as e:  # noqa: BLE001 - a peer may still map us: keep, say why
                    self._comm.keep_memory(f"not every peer reached the rendezvous before freeing ({e})")
            self._comm.free_memory()
        self._bootstrap = None  # the group, released (Communicator._close)
        if self._comm.kept_on_close:  # stacklevel: the caller of Communicator.close()
            warnings.warn(f"ringcoll: rank {self.rank} keeps its GPU buffer until the process exits, since "
                          f"peers may still map it: {self._comm.kept_on_close}", RuntimeWarning, stacklevel=4)

    @property
    def comm(self):
        return self._comm
