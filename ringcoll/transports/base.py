"""What every transport is given and what it must offer.

A transport moves one collective's bytes round the ring on one kind of memory. It sees
addresses and codes, never tensors: the Communicator (ringcoll/communicator.py) has
validated the arguments and turned them into a :class:`CollectiveCall`. The interface, which
``host.HostTransport`` and ``cuda.CudaTransport`` both implement::

    slot_alignment              bytes each slot of the registered buffer is aligned to (_C)
    takes_arrays                whether DLPack / CUDA-array-interface arrays are accepted
    resolve_device(device)      (static) the device with its index; raises where unusable
    __init__(settings, exchange)  collective: build the buffers; `exchange(mine, **shared)`
                                sends this rank's handle round the group, returns all ranks'
    submit(call, outputs, keep_alive, async_op, then, name)
                                run `call`, then `then()` (torch work that must follow it,
                                e.g. the list forms' copies); sync: return None once later
                                work is ordered after it; async: return a Completion
                                (`name`: the user's collective, for its messages)
    launch_on_stream(call, stream)   run `call` on a caller-given stream (CUDA only)
    tuned                       whether auto reads the recorded table (ringcoll/tuning.py), which
                                was measured on the CPU transport: elsewhere auto is native
    allocate_symmetric(nbytes, dtype, dims), is_symmetric(address), symmetric_arenas
                                symmetric memory (docs/symmetric.md): collective allocation as
                                a uint8 tensor, whether an address lies in it, arenas made
    bind(call)                  (optional) a zero-argument callable running `call`
                                synchronously by the shortest path: Communicator.prepare_*
    plain_calls                 (optional) what checks and runs a synchronous tensor-form call
                                in one go (HostComm), while nothing queued must go first
    hold_plan(compiled)         (optional, with plain_calls) keep a compiled plan; the index it
                                returns names it in a plain call
    prepare_plain(name, tensors, layout, call)
                                (optional, with plain_calls) `call` read once: a callable that
                                checks `tensors` against `layout` and runs it (False: changed)
    barrier(async_op)           return (or a Completion) once every rank has entered
    synchronize()               block until everything submitted so far finished
    close(wait_for_peers)       release the buffers (the Communicator calls it once)
    broken, broken_reason       the ring stopped (timeout, dead peer, mismatch): every call raises

A Completion is what ``ringcoll.Work`` wraps: ``wait(timeout)`` (raise the collective's
error; RingcollTimeoutError past `timeout`), ``done()``, ``error()`` (the error known so
far, or None), ``on_done(fn)`` (fn() once the call has run, before any waiter wakes: the
Work's torch Future is completed there) and ``synchronize()`` (block the host).
"""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple, Optional

import torch

from ringcoll import _C
from ringcoll._types import COLLECTIVE_CODES
from ringcoll.errors import RingcollError, RingcollMismatchError


class Settings(NamedTuple):
    """What the Communicator resolved, validated on every rank before anything is built."""

    bootstrap: object  # how the ranks meet (ringcoll/bootstrap.py): rank, world_size, all_gather_object, barrier
    device: torch.device
    rank: int
    world_size: int
    timeout: float  # seconds any single wait may last
    buffer_bytes: int  # each rank's registered buffer
    check: bool  # compare every call across ranks before data moves
    small_bytes: int = 0  # host: messages up to this size take the one-shot path (0: always the ring)
    direct_bytes: int = 0  # host: all-gathers from this size on read peers directly where they may (0: never)
    direct_max_bytes: int = 0  # ... and below this size
    shares_cores: bool = False  # host: the ranks' cores also run other busy threads, so waits nap, never spin


class CollectiveCall(NamedTuple):
    """One collective as the user called it, in addresses and codes. ``user_count`` is the
    count the user's call names: the whole tensor for all_reduce, the output for
    reduce_scatter, the input for all_gather. The extension turns it into the ring's work
    (``ring_call()`` in csrc/include/ringcoll/call.h, whose RingCall has the ring's count)."""

    collective: str  # "all_reduce" | "reduce_scatter" | "all_gather"
    src: int  # input address
    dst: int  # output address
    user_count: int
    dtype: int  # reduce.h's DType code
    op: Optional[int]  # reduce.h's ReduceOp code; None for all_gather
    # the _C.CompiledPlan that runs it (ringcoll/plans.py; every transport's plan engine; its
    # id travels in the call's descriptor); None: the default path
    plan: Optional[object] = None

    def run(self, comm, *stream_args) -> None:
        """Call CudaComm's method for this collective (the CPU transport hands the whole record
        to HostComm.run); `stream_args` are (stream, join)."""
        collective, src, dst, user_count, dtype, op, plan = self  # one unpack: this runs on every call
        if plan is not None:
            comm.run_plan(plan, COLLECTIVE_CODES[collective], src, dst, user_count, dtype, op or 0, *stream_args)
        elif op is None:
            getattr(comm, collective)(src, dst, user_count, dtype, *stream_args)
        else:
            getattr(comm, collective)(src, dst, user_count, dtype, op, *stream_args)


#: ``new_call((collective, src, dst, user_count, dtype, op, plan))``: the same CollectiveCall, built
#: in C from a plain tuple. ``CollectiveCall(...)`` runs namedtuple's generated Python
#: ``__new__``, ~0.3 us: a tenth of a small collective, so the per-call paths use this.
new_call = functools.partial(tuple.__new__, CollectiveCall)


class Transport:
    """What the two transports share: the extension object ``self._comm`` (HostComm or
    CudaComm) and how a broken ring is seen through it."""

    _comm = None
    # The extension object whose all_reduce_tensor, reduce_scatter_tensor and
    # all_gather_into_tensor check a synchronous plain call and run it in one binding call,
    # while the Communicator may hand it such a call (None: never, or not now).
    plain_calls = None
    tuned = False  # auto's recorded table prices the CPU transport only

    @property
    def broken(self) -> bool:
        return self._comm.broken

    @property
    def broken_reason(self) -> str:
        return self._comm.broken_reason

    def allocate_symmetric(self, nbytes: int, dtype: int, dims: list):
        """`nbytes` of this rank's symmetric memory as a uint8 tensor of at least that many
        bytes, which Communicator.empty views as the caller's shape and dtype. Collective."""
        raise NotImplementedError(f"empty: {type(self).__name__} has no symmetric memory")

    def is_symmetric(self, address: int) -> bool:
        """Whether `address` lies in this rank's symmetric memory of this communicator."""
        return False

    @staticmethod
    def plan_slot_area(buffer_bytes: int, world: int) -> int:
        """The bytes a plan's two banks of C aligned slots are cut from: on the CPU the whole
        buffer (host_plan.cpp); the CUDA transports say for their kernels."""
        return buffer_bytes

    symmetric_arenas = 0  # how many arenas of symmetric memory every rank has mapped
    # Whether auto over symmetric memory runs a plan that reads it in place, with the ring's
    # plan as fallback (CUDA: Communicator._symmetric_auto), rather than native (the CPU
    # transport's own zero-copy path)
    symmetric_by_plan = False


def describe_allocation(dims: list, dtype: int, nbytes: int) -> str:
    """An allocation as a mismatch names it (host_symmetric.cpp words the CPU's alike)."""
    shape = "(" + ", ".join(str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"
    name = next(n for n, code, _size, _floating in _C.dtype_table if code == dtype)
    return f"empty({shape}, {name}, {nbytes} bytes)"


class InFlight:
    """The tensors of a transport's async calls, held until each call's completion is done,
    whatever becomes of its Work. The caching allocator's record_stream keeps its own
    tensors from reuse while a kernel uses them, and does nothing for memory it did not
    allocate: a symmetric tensor dropped with its Work before the kernel ran gave its block
    back to the pool, and the next empty() handed it out while the kernel still read it.

    A call captured in a CUDA graph is not held (its work runs at each replay, and a graph's
    tensors must outlive it, as torch documents), and the transports call hold() and
    release_finished() only while the caller's stream does not capture: a capture in global
    mode (torch.cuda.graph's default) forbids event queries on the capturing thread."""

    def __init__(self):
        self._held: collections.deque = collections.deque()

    def hold(self, completion, tensors) -> None:
        self.release_finished()
        self._held.append((completion, tuple(tensors)))

    def release_finished(self) -> None:
        """Let go of the calls done so far (in order: a transport's calls finish in order)."""
        while self._held and self._held[0][0].done():
            self._held.popleft()

    def clear(self) -> None:
        self._held.clear()


class SymmetricAgreement:
    """What every rank of a transport holds alike about its symmetric memory, kept by
    allocate_by_exchange: the arenas every rank has mapped (auto's choice hangs on it, so it
    must not count an arena some rank lacks), and why, after a failed round, the
    communicator makes no more (every rank saw the same failures, so all refuse alike)."""

    def __init__(self):
        self.arenas = 0
        self.unusable = ""


def _attempt(step) -> tuple:
    """(step's result, "") or (None, why it raised): a failure said to every rank, not raised
    here, where the peers would wait for this rank in the next round until the bootstrap's
    timeout."""
    try:
        return step(), ""
    except Exception as e:  # noqa: BLE001 - said to every rank, then raised by all
        return None, f"{type(e).__name__}: {e}"


def allocate_by_exchange(parts, bootstrap, rank: int, nbytes: int, dtype: int, dims: list,
                         agreed: SymmetricAgreement):
    """The collective allocation of the CUDA transport and its emulator (the CPU transport's
    runs in C++ over its segments' flags: host_symmetric.cpp). `parts` is this rank's
    CudaComm, or its view of the emulator, with the steps cuda_comm.h states.

    Every rank's request, and whether it has room, go round the bootstrap once: a request
    unlike any peer's raises RingcollMismatchError on every rank (each sees every request),
    naming both. If some rank has no room, every rank makes its part of a new arena and the
    handles go round once more (a rank that could not make its part says why instead), then
    a last round says whether every rank mapped every part. A failure in either round (out of
    memory, a broken communicator, a handle that would not open) raises on every rank, and
    this communicator makes no more symmetric memory: an arena some rank lacks would be read
    through a row it does not have, and the next one numbered differently. Returns the block."""
    if agreed.unusable:
        raise RingcollError(f"empty: this communicator makes no more symmetric memory since {agreed.unusable}")
    block_bytes = _C.symmetric_block_bytes(nbytes)
    request = describe_allocation(dims, dtype, nbytes)
    posts = bootstrap.all_gather_object((request, parts.symmetric_has_room(block_bytes)), "empty")
    for peer, (theirs, _) in enumerate(posts):
        if theirs != request:
            raise RingcollMismatchError(f"empty: mismatched collective allocations: rank {rank} asked for "
                                        f"{request} but rank {peer} for {theirs}; nothing was allocated")
    if not all(room for _, room in posts):
        made = bootstrap.all_gather_object(_attempt(
            lambda: parts.make_symmetric_arena(_C.symmetric_arena_bytes(block_bytes))), "empty")
        failures = [f"rank {r} could not make its part of a new arena ({why})" for r, (_, why) in enumerate(made)
                    if why]
        if not failures:
            _, why = _attempt(lambda: parts.open_symmetric_arena([handle for handle, _ in made]))
            failures = [f"rank {r} could not map every rank's part of a new arena ({why})"
                        for r, why in enumerate(bootstrap.all_gather_object(why, "empty")) if why]
        if failures:
            agreed.unusable = failures[0]
            raise RingcollError(f"empty: {agreed.unusable}; this communicator makes no more symmetric memory")
        agreed.arenas += 1
    block = parts.take_symmetric(block_bytes)
    if block is None:
        raise RingcollError(f"empty: no room for {block_bytes} bytes in a new arena (a bug)")
    return block
