"""``torch.distributed.init_process_group(backend="ringcoll")``: ringcoll as a c10d backend.

    import ringcoll                                    # registers the backend (cheap)
    import torch.distributed as dist
    dist.init_process_group("ringcoll")                # or "cpu:ringcoll"; env:// / torchrun
    dist.all_reduce(t)                                 # -> ringcoll's shared-memory ring
    dist.broadcast(t, src=0)                           # -> ringcoll's plan engine (a chain, a tree)
    dist.scatter(t, [...], src=0)                      # -> the backend's internal gloo group

How it plugs in (torch's supported route for out-of-tree backends):
``torch.distributed.Backend.register_backend("ringcoll", creator, devices=["cpu"])``, where
``creator(store, rank, size, timeout)`` returns a :class:`RingcollProcessGroup`, a Python
subclass of the c10d ``ProcessGroup`` (pybind11 trampoline ``PyProcessGroup``; the pattern
of torch's own ``test/distributed/test_c10d_pypg.py``). ``dist.*`` calls it from Python and
C++ callers (DDP's reducer, ``_verify_params_across_processes``, functional collectives)
reach the same Python methods through the trampoline.

What goes where::

    all_reduce, reduce_scatter_tensor (_reduce_scatter_base, reduce_scatter_single),
    all_gather_into_tensor (_allgather_base, all_gather_single), all_gather (list),
    reduce_scatter (list), barrier, and the coalesced forms (allreduce_coalesced,
    allgather_into_tensor_coalesced, reduce_scatter_tensor_coalesced: one flat
    call each, as NCCL's grouped calls); broadcast and reduce of one CPU tensor
    (plans only: CUDA ones go to the fall-back)              -> a ringcoll Communicator
        when every tensor is contiguous, of one dtype ringcoll supports, on one
        device, and the op is SUM/PRODUCT/MIN/MAX (AVG for floating dtypes):
        CPU tensors to the shared-memory ring, tensors on cuda:N to the CUDA ring
        of that GPU (one communicator per device, made on first use, closed with
        the group; ``routing_device`` decides); else -> the fall-back
    everything else: FORWARDED_TO_GLOO below (gather, scatter, all_to_all,
    send/recv) and what c10d dispatches itself (object collectives, ...)
                                                             -> the fall-back

The fall-back is the internal gloo group for CPU tensors; for CUDA tensors an internal
NCCL group where torch has NCCL and a GPU (else gloo, which takes CUDA tensors for
broadcast, all-reduce and all-gather; ``RINGCOLL_CUDA_FALLBACK=gloo`` chooses it, as
needed when several ranks share one GPU, which NCCL refuses).

CUDA streams, as NCCL's under torch: a collective is enqueued after the work on the
caller's current stream and makes it wait (sync) or not (``async_op=True``: the Work's
``wait()`` makes the then-current stream wait); the call does not block the host.
(transports/cuda.py.)

Every call form c10d's ProcessGroup accepts works: ``pg.allreduce(t, op=MAX)``,
``pg.allreduce([t], MAX)``, ``pg.broadcast(t, root=0)``, ``pg.send([t], dstRank=1, tag=0)``,
``pg.barrier(timedelta)``, ... (tested form by form against gloo). Async work runs on the
communicator's worker thread with the caller's grad and inference mode.

The internal gloo group is a ``ProcessGroupGloo`` built in the creator from the same store
(under its own prefix), rank, size and timeout, and registered as this process group's CPU
backend. The collectives ringcoll does not implement are forwarded to it from Python (see
"everything else" below: left to c10d's dispatch they can deadlock, through torch's own
trampoline); any other method falls through c10d's own dispatch to gloo.
Routing depends only on what every rank of a correct program passes alike (device, dtype,
op, sizes, list lengths), so all ranks take the same path.

Several machines. When the group is made (in the creator, through the store), every rank
says which shared-memory domain it is in (``transports.host.shared_memory_domain``: the
kernel's boot id and the /dev/shm file system). All in one: the communicator is one ring.
On several machines (``torchrun --nnodes 2``) it is a
:class:`~ringcoll.training.hierarchical.HierarchicalCommunicator` instead, with the same
methods: the ring inside each machine, ringcoll's TCP link between them; nothing in the user's script
changes. Machines with different numbers of ranks are refused there, on every rank, with a
message saying what to do (start the same number on each).

Bootstrap. The ringcoll Communicator is built on the first call that goes to ringcoll (the
same point on every rank, as collectives are called in the same order), with
``group=<this process group>``: by then the group is registered with torch.distributed, so
``dist.get_rank(group)`` works. Its segment-name exchange (``dist.all_gather_object``) goes
through this group's own ``allgather``, which sends it to gloo while the communicator is
being built. It cannot be built inside the creator: there torch.distributed is not
initialised yet and the group is not registered.

Work objects. A synchronous call (``async_op=False``; ``opts.asyncOp`` False) runs on the
calling thread and raises its error there. An asynchronous one (DDP's reducer calls with
``asyncOp`` True) runs on the communicator's worker thread; the returned ``dist._Work``
subclass's ``wait()`` re-raises its error and ``get_future()`` is a torch Future of the
output tensors.

Timeouts: ``RINGCOLL_TIMEOUT`` if set, else the ``timeout`` given to init_process_group, bounds
each ringcoll wait; gloo uses the init_process_group timeout.

Limits (torch 2.13): the Python ProcessGroup replaces the whole process group, so a device
map naming another backend for a second device (``"cpu:ringcoll,cuda:nccl"``) does not
give that device its backend; ``"ringcoll"``, ``"cpu:ringcoll"`` and
``"cpu:ringcoll,cuda:ringcoll"`` work and serve both devices as above.
``dist.monitored_barrier`` checks the backend name and refuses anything but gloo, as it
does for NCCL.

Observability: :data:`call_counts` counts calls per route, e.g. ``call_counts["ringcoll:all_reduce"]``
and ``call_counts["gloo:all_reduce"]`` (explicit fall-backs from the overridden methods;
the methods not overridden go to gloo inside c10d and are not counted).
"""

from __future__ import annotations

import collections
import datetime
import os
import socket
import threading
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from ringcoll._types import DTYPE_CODES, ReduceOp, op_code
from ringcoll.api import SERVED_DEVICE_TYPES
from ringcoll.communicator import MAX_TIMEOUT_SECONDS, Communicator, wait_seconds
from ringcoll.errors import RingcollError
from ringcoll.training.hierarchical import HierarchicalCommunicator, uneven_nodes_message
from ringcoll.transports.host import ranks_by_domain, shared_memory_domain

BACKEND_NAME = "ringcoll"

#: calls per route and collective: "ringcoll:<op>" ran on the ring, "gloo:<op>" was handed to gloo
call_counts: collections.Counter = collections.Counter()

_c10d = torch._C._distributed_c10d


# --- Work --------------------------------------------------------------------------------


class _C10dWork(dist._Work):
    """c10d's view of one ringcoll call: `work` is its ringcoll Work when it runs async on
    the communicator's worker thread, None when it already ran on the calling thread.
    ``_get_op_type()`` names the collective as gloo's Work does (for torch.profiler and
    tools that read it)."""

    def __init__(self, work, outputs: list, op_type, timeout: Optional[datetime.timedelta] = None):
        super().__init__()
        self._work = work
        self._outputs = outputs
        self._op_type = op_type
        self._timeout = timeout  # the call's own (its options'), bounding a wait given none
        self._future: Optional[torch.futures.Future] = None

    def wait(self, timeout=None) -> bool:
        if self._work is not None:  # re-raises the collective's error
            self._work.wait(wait_seconds(timeout if timeout is not None else self._timeout))
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def is_success(self) -> bool:
        return self._work is None or self._work.is_success()

    def exception(self):
        return None if self._work is None else self._work.exception()

    def result(self) -> list:
        self.wait()
        return self._outputs

    def _get_op_type(self):
        return self._op_type

    def get_future(self) -> torch.futures.Future:
        """The Work's torch Future (made on first use: most synchronous calls never ask)."""
        if self._future is None:
            if self._work is None:
                self._future = torch.futures.Future()
                self._future.set_result(self._outputs)
            else:
                self._future = self._work.get_future()
        return self._future


#: each collective's c10d OpType name: gloo's for the same call where gloo's Work names one
#: (its all_gather_into_tensor says ALLGATHER), else NCCL's (gloo's reduce_scatter_tensor says
#: UNKNOWN)
OP_TYPE_NAMES = {
    "all_reduce": "ALLREDUCE", "all_reduce_coalesced": "ALLREDUCE_COALESCED",
    "reduce_scatter_tensor": "_REDUCE_SCATTER_BASE", "reduce_scatter": "REDUCE_SCATTER",
    "reduce_scatter_tensor_coalesced": "REDUCE_SCATTER_TENSOR_COALESCED",
    "all_gather_into_tensor": "ALLGATHER", "all_gather": "ALLGATHER",
    "all_gather_into_tensor_coalesced": "ALLGATHER_COALESCED", "barrier": "BARRIER",
    "broadcast": "BROADCAST", "reduce": "REDUCE"}


def op_types(op_type_enum) -> Dict[str, int]:
    """Each collective's OpType as an int (what Work._get_op_type gives); UNKNOWN where this
    torch has no such OpType (torch 2.11 has no REDUCE_SCATTER_TENSOR_COALESCED): importing
    ringcoll must not fail on an older torch."""
    return {name: int(getattr(op_type_enum, op_type, op_type_enum.UNKNOWN)) for name, op_type in OP_TYPE_NAMES.items()}


OP_TYPES = op_types(_c10d.OpType)


# --- routing -----------------------------------------------------------------------------


def _ringcoll_op(op, dtype: torch.dtype) -> Optional[ReduceOp]:
    """ringcoll's ReduceOp for (op, dtype), or None when ringcoll does not implement it: the
    communicator's own op check (op_code) refuses it."""
    if dtype not in DTYPE_CODES:
        return None
    try:
        return ReduceOp(op_code("ringcoll backend", op, DTYPE_CODES[dtype]))
    except (TypeError, ValueError):
        return None  # PREMUL_SUM, BAND, BOR, BXOR, ...; AVG of integers


def routing_device(tensors) -> Optional[torch.device]:
    """The device whose ring serves a call on `tensors`: their one device (CPU: the
    shared-memory ring; cuda:N: that GPU's CUDA ring) when they are contiguous, of one dtype
    ringcoll supports and all on that device; None sends the call to the fall-back (gloo, or
    NCCL for CUDA tensors). It reads only what every rank of a correct program passes alike,
    so all ranks take the same path."""
    if not tensors:
        return None
    first = tensors[0]
    if first.dtype not in DTYPE_CODES or first.device.type not in SERVED_DEVICE_TYPES:
        return None
    if all(t.is_contiguous() and t.dtype == first.dtype and t.device == first.device for t in tensors):
        return first.device
    return None


def _communicator_device(device) -> torch.device:
    """The key of a communicator: "cpu", or a CUDA device with its index (without a GPU the
    device is left as given, for the Communicator to refuse by name)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if device.type == "cpu" else device


def _tensors_in(args):
    """Every tensor in a call's arguments (nested lists, tuples and dicts of them)."""
    if isinstance(args, torch.Tensor):
        yield args
    elif isinstance(args, (list, tuple)):
        for a in args:
            yield from _tensors_in(a)
    elif isinstance(args, dict):
        for a in args.values():
            yield from _tensors_in(a)


def _overlaps_off_chunk(whole: torch.Tensor, part: torch.Tensor, rank: int) -> bool:
    """Whether `part` shares memory with `whole` without being chunk `rank` of it, the one
    in-place form ringcoll takes. That check is rank-dependent: one rank raised ValueError
    while its peers, whose view happened to be their own chunk, waited on the ring until the
    timeout. gloo computes such calls, so the backend does too, from a copy of the input."""
    if part.numel() == 0 or whole.numel() == 0 or part.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr():
        return False
    begin, end = part.data_ptr(), part.data_ptr() + part.numel() * part.element_size()
    whole_begin = whole.data_ptr()
    if end <= whole_begin or whole_begin + whole.numel() * whole.element_size() <= begin:
        return False
    return not (part.dtype == whole.dtype and part.is_contiguous() and whole.is_contiguous()
                and begin == whole_begin + rank * part.numel() * part.element_size())


def _as_list(tensors) -> list:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _options(cls, opts, op=None, timeout=None):
    """c10d's options object for a call made in any of ProcessGroup's forms: ``(tensors,
    opts)``, ``(tensors, op)``, ``(tensor, op)``, ``op=``/``timeout=`` keywords, or a
    timedelta where the options go (``barrier(timeout)``). A None opts means the defaults."""
    if isinstance(opts, datetime.timedelta):
        opts, timeout = None, opts
    elif opts is not None and not isinstance(opts, cls):  # the op, given positionally
        opts, op = None, opts
    opts = opts if opts is not None else cls()
    if op is not None:
        opts.reduceOp = op
    if timeout is not None:
        opts.timeout = timeout
    return opts


def _rooted_options(cls, args: tuple, kwargs: dict):
    """c10d's options for a broadcast or reduce made in any of ProcessGroup's forms:
    ``(tensors, opts)``, or ``(tensor, root[, op][, timeout])`` (broadcast has no op),
    positional or keyword."""
    if args and isinstance(args[0], cls) or "opts" in kwargs:
        opts = args[0] if args else kwargs["opts"]
        return opts if opts is not None else cls()
    if args and args[0] is None:  # c10d's "default options"
        return cls()
    given = dict(zip(("root", "op", "timeout") if cls is _c10d.ReduceOptions else ("root", "timeout"), args))
    given.update(kwargs)
    opts = cls()
    if given.get("root") is not None:
        opts.rootRank = int(given["root"])
    if given.get("op") is not None:
        opts.reduceOp = given["op"]
    if given.get("timeout") is not None:
        opts.timeout = given["timeout"]
    return opts


# --- the process group -------------------------------------------------------------------


class RingcollProcessGroup(dist.ProcessGroup):
    """The process group ``init_process_group(backend="ringcoll")`` builds (see module doc).

    ``communicator()`` returns the ringcoll Communicator (built on first use, collectively);
    ``fallback`` is the internal gloo backend.
    """

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self.fallback = dist.ProcessGroupGloo(dist.PrefixStore("ringcoll-gloo/", store), rank, size, timeout)
        # Methods not overridden below reach gloo (NCCL for CUDA tensors) through c10d's own dispatch.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self.fallback)
        self.cuda_fallback = _nccl_if_usable(store, rank, size, timeout)  # None: gloo takes CUDA tensors too
        if self.cuda_fallback is not None:
            self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, self.cuda_fallback)
        self.hosts = _exchange_hosts(store, rank, size, timeout)
        self._comms: dict = {}  # device -> its communicator, built on first use
        self._bootstrap_thread = None  # the thread building a communicator
        self._comm_lock = threading.Lock()
        self._closed = False
        self._sequence = 0  # calls issued on this group (_get_sequence_number_for_group)

    # --- identity -----------------------------------------------------------------------

    def _get_sequence_number_for_group(self) -> int:
        """The calls this rank has issued on the group, collectives and point-to-point alike,
        each counted once when issued (all_gather_object is two calls); gloo counts so too,
        but its reduce-scatters twice. The exchanges that build ringcoll's communicator are
        not counted."""
        return self._sequence

    def _set_sequence_number_for_group(self) -> None:
        self._sequence = 0

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"RingcollProcessGroup(rank={self._rank}, size={self._size})"

    # --- the communicator ---------------------------------------------------------------

    #: ringcoll.get_communicator(group) returns communicator() for such a group, not a second ring
    owns_ringcoll_communicator = True

    @property
    def spans_hosts(self) -> bool:
        """Whether this group's ranks are on several machines (shared-memory domains)."""
        return len(set(self.hosts)) > 1

    def communicator(self, device="cpu"):
        """The ringcoll Communicator over this group's ranks for tensors on `device` (CPU:
        the shared-memory ring; ``cuda:N``: the CUDA ring of that GPU), built on first use
        (collective: every rank's first call for a device comes at the same point); over
        several machines a HierarchicalCommunicator: the ring inside each, gloo (NCCL for
        CUDA) between them."""
        device = _communicator_device(device)
        comm = self._comms.get(device)
        if comm is not None:
            return comm
        with self._comm_lock:
            if device not in self._comms:
                if self._closed:
                    raise RuntimeError("ringcoll backend: the process group has been shut down")
                # The group's timeout, at most ringcoll's bound (~31 years): gloo takes any, and
                # init_process_group(timeout=50 years) made the first collective raise ValueError.
                timeout = None if os.environ.get("RINGCOLL_TIMEOUT") else min(self._timeout.total_seconds(),
                                                                               MAX_TIMEOUT_SECONDS)
                self._bootstrap_thread = threading.get_ident()  # its handle exchange goes to gloo
                try:
                    if self.spans_hosts:
                        comm = HierarchicalCommunicator(group=self, node_id=self.hosts[self._rank], device=device,
                                                        timeout=timeout)
                    else:
                        comm = Communicator(group=self, device=device, timeout=timeout)
                finally:
                    self._bootstrap_thread = None
                self._comms[device] = comm
            return self._comms[device]

    @property
    def _bootstrapping(self) -> bool:
        return self._bootstrap_thread == threading.get_ident()

    def _ring_for(self, tensors):
        """The communicator that serves `tensors` (routing_device says which), or None: the
        call goes to the fall-back."""
        device = None if self._bootstrapping else routing_device(tensors)
        return None if device is None else self.communicator(device)

    def _run(self, name: str, start: Callable[[bool], object], outputs: list, opts) -> dist._Work:
        """start(async_op) runs the collective on the ring; sync unless opts.asyncOp. A
        timeout in the options (``pg.allreduce(t, timeout=...)``, ``dist.barrier(timeout=...)``;
        c10d's unset one is negative, and 0 is its "no timeout") bounds the wait for this
        call, as gloo's does: a sync call then runs async and is waited for so long
        (RingcollTimeoutError, a RuntimeError, past it; the call itself stays bounded by the
        communicator's timeout)."""
        call_counts[f"ringcoll:{name}"] += 1
        self._sequence += 1
        async_op = getattr(opts, "asyncOp", True)
        timeout = getattr(opts, "timeout", None)
        timeout = timeout if timeout is not None and timeout > datetime.timedelta(0) else None
        if async_op or timeout is not None:
            work = _C10dWork(start(True), outputs, OP_TYPES[name], timeout)
            if not async_op:
                work.wait()
            return work
        start(False)
        return _C10dWork(None, outputs, OP_TYPES[name])

    def _fallback(self, name: str, tensors=()):
        """The backend for a call ringcoll does not serve: NCCL for CUDA tensors where it can
        run, else gloo (counted in call_counts as "nccl:<name>" / "gloo:<name>")."""
        on_cuda = self.cuda_fallback is not None and any(t.is_cuda for t in _tensors_in(tensors))
        call_counts[f"{'nccl' if on_cuda else 'gloo'}:{name}"] += 1
        if not self._bootstrapping:  # the communicator's own exchange is not the user's call
            self._sequence += 1
        return self.cuda_fallback if on_cuda else self.fallback

    # --- the collectives ringcoll implements --------------------------------------------

    def allreduce(self, tensors, opts=None, op=None, timeout=None):
        tensors = _as_list(tensors)
        opts = _options(_c10d.AllreduceOptions, opts, op, timeout)
        op = _ringcoll_op(opts.reduceOp, tensors[0].dtype) if tensors else None
        if len(tensors) == 1 and op is not None and (comm := self._ring_for(tensors)) is not None:
            t = tensors[0]
            return self._run("all_reduce", lambda a: comm.all_reduce(t, op=op, async_op=a), tensors, opts)
        return self._fallback("all_reduce", tensors).allreduce(tensors, opts)

    def _reduce_scatter_tensor(self, output, input, opts):
        opts = opts if opts is not None else _c10d.ReduceScatterOptions()
        op = _ringcoll_op(opts.reduceOp, input.dtype)
        if (op is not None and output.numel() * self._size == input.numel()
                and (comm := self._ring_for([output, input])) is not None):
            if _overlaps_off_chunk(input, output, self._rank):
                input = input.clone()
            return self._run("reduce_scatter_tensor",
                             lambda a: comm.reduce_scatter_tensor(output, input, op=op, async_op=a), [output], opts)
        return self._fallback("reduce_scatter_tensor", [input])._reduce_scatter_base(output, input, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_tensor(output, input, opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        return self._reduce_scatter_tensor(output, input, opts)

    def _all_gather_tensor(self, output, input, opts):
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        if output.numel() == input.numel() * self._size and (comm := self._ring_for([output, input])) is not None:
            if _overlaps_off_chunk(output, input, self._rank):
                input = input.clone()
            return self._run("all_gather_into_tensor",
                             lambda a: comm.all_gather_into_tensor(output, input, async_op=a), [output], opts)
        return self._fallback("all_gather_into_tensor", [input])._allgather_base(output, input, opts)

    def all_gather_single(self, output, input, opts=None):
        return self._all_gather_tensor(output, input, opts)

    def _allgather_base(self, output, input, opts=None):
        return self._all_gather_tensor(output, input, opts)

    def allgather(self, output_tensors, input_tensors, opts=None, timeout=None):
        """torch's list form: output_tensors = [[t_0, ..., t_{P-1}]], input_tensors = [t]
        (or ProcessGroup's other form: [t_0, ..., t_{P-1}], t)."""
        if isinstance(input_tensors, torch.Tensor):
            output_tensors = [list(output_tensors)]
        opts = _options(_c10d.AllgatherOptions, opts, timeout=timeout)
        input_tensors = _as_list(input_tensors)
        if (len(input_tensors) == 1 and len(output_tensors) == 1 and len(output_tensors[0]) == self._size
                and len({t.numel() for t in output_tensors[0]}) == 1
                and output_tensors[0][0].numel() == input_tensors[0].numel()
                and (comm := self._ring_for([input_tensors[0], *output_tensors[0]])) is not None):
            outs, t = list(output_tensors[0]), input_tensors[0]
            return self._run("all_gather", lambda a: comm.all_gather(outs, t, async_op=a), output_tensors, opts)
        return self._fallback("all_gather", input_tensors).allgather(output_tensors, input_tensors, opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None, op=None, timeout=None):
        """torch's list form: output_tensors = [out], input_tensors = [[in_0, ..., in_{P-1}]]
        (or ProcessGroup's other form: out, [in_0, ..., in_{P-1}], op)."""
        if isinstance(output_tensors, torch.Tensor):
            output_tensors, input_tensors = [output_tensors], [list(input_tensors)]
        opts = _options(_c10d.ReduceScatterOptions, opts, op, timeout)
        op = _ringcoll_op(opts.reduceOp, output_tensors[0].dtype) if output_tensors else None
        if (op is not None and len(output_tensors) == 1 and len(input_tensors) == 1
                and len(input_tensors[0]) == self._size
                and all(t.numel() == output_tensors[0].numel() for t in input_tensors[0])
                and (comm := self._ring_for([output_tensors[0], *input_tensors[0]])) is not None):
            out, ins = output_tensors[0], list(input_tensors[0])
            return self._run("reduce_scatter", lambda a: comm.reduce_scatter(out, ins, op=op, async_op=a),
                             output_tensors, opts)
        return self._fallback("reduce_scatter", output_tensors).reduce_scatter(output_tensors, input_tensors, opts)

    # The coalesced forms (FSDP2, DDP's coalesced paths, functional collectives): one flat
    # ring call each, as NCCL's grouped calls (ringcoll/packing.py).

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        if (len(outputs) == len(inputs) > 0
                and all(o.numel() == i.numel() * self._size for o, i in zip(outputs, inputs))
                and (comm := self._ring_for([*outputs, *inputs])) is not None):
            return self._run("all_gather_into_tensor_coalesced",
                             lambda a: comm.all_gather_into_tensor_coalesced(list(outputs), list(inputs), async_op=a),
                             list(outputs), opts)
        return self._fallback("all_gather_into_tensor_coalesced", inputs).allgather_into_tensor_coalesced(
            outputs, inputs, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else _c10d.ReduceScatterOptions()
        op = _ringcoll_op(opts.reduceOp, inputs[0].dtype) if inputs else None
        if (op is not None and len(outputs) == len(inputs) > 0
                and all(o.numel() * self._size == i.numel() for o, i in zip(outputs, inputs))
                and (comm := self._ring_for([*outputs, *inputs])) is not None):
            return self._run("reduce_scatter_tensor_coalesced",
                             lambda a: comm.reduce_scatter_tensor_coalesced(list(outputs), list(inputs), op=op,
                                                                            async_op=a),
                             list(outputs), opts)
        return self._fallback("reduce_scatter_tensor_coalesced", inputs).reduce_scatter_tensor_coalesced(
            outputs, inputs, opts)

    # The names c10d's coalescing manager calls (dist._coalescing_manager: FSDP-style grouped
    # all-gathers and reduce-scatters). Left to c10d's binding, they reached the methods above
    # through C++, and what came back was a c10d Work, not ours: its is_completed() stayed
    # False after wait() had returned True (the fuzzer's "backend" API found it).
    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        """One flat all-reduce of every tensor (as NCCL's grouped calls), copied back."""
        opts = opts if opts is not None else _c10d.AllreduceCoalescedOptions()
        op = _ringcoll_op(opts.reduceOp, tensors[0].dtype) if tensors else None
        if op is not None and (comm := self._ring_for(tensors)) is not None:
            return self._run("all_reduce_coalesced",
                             lambda a: comm.all_reduce_coalesced(list(tensors), op=op, async_op=a), list(tensors), opts)
        return self._fallback("all_reduce_coalesced", tensors).allreduce_coalesced(tensors, opts)

    def broadcast(self, tensors, *args, **kwargs):
        """One CPU tensor, in place, from ``opts.rootRank`` (a rank of this group), on the
        plan engine (Communicator.broadcast); CUDA tensors and several tensors go to the
        fall-back."""
        tensors, opts = _as_list(tensors), _rooted_options(_c10d.BroadcastOptions, args, kwargs)
        self._check_root("broadcast", opts.rootRank)
        if len(tensors) == 1 and opts.rootTensor == 0 and tensors[0].is_cpu and (comm := self._ring_for(tensors)):
            t, root = tensors[0], opts.rootRank
            return self._run("broadcast", lambda a: comm.broadcast(t, root, async_op=a), tensors, opts)
        return self._fallback("broadcast", tensors).broadcast(tensors, opts)

    def reduce(self, tensors, *args, **kwargs):
        """One CPU tensor, in place on ``opts.rootRank`` only, as broadcast."""
        tensors, opts = _as_list(tensors), _rooted_options(_c10d.ReduceOptions, args, kwargs)
        self._check_root("reduce", opts.rootRank)
        op = _ringcoll_op(opts.reduceOp, tensors[0].dtype) if tensors else None
        if (len(tensors) == 1 and op is not None and opts.rootTensor == 0 and tensors[0].is_cpu
                and (comm := self._ring_for(tensors))):
            t, root = tensors[0], opts.rootRank
            return self._run("reduce", lambda a: comm.reduce(t, root, op=op, async_op=a), tensors, opts)
        return self._fallback("reduce", tensors).reduce(tensors, opts)

    def _check_root(self, name: str, root: int) -> None:
        """A RuntimeError for a root outside the group, as gloo raises (the Communicator's
        check raises ValueError, which `except RuntimeError` around a torch call misses)."""
        if not 0 <= root < self._size:
            raise RuntimeError(f"ringcoll backend: {name}: invalid root rank {root} (this group's ranks are "
                               f"0..{self._size - 1})")

    def barrier(self, opts=None, timeout=None):
        opts = _options(_c10d.BarrierOptions, opts, timeout=timeout)
        if self._bootstrapping:
            return self._fallback("barrier").barrier(opts)
        comm = self.communicator()
        return self._run("barrier", lambda a: comm.barrier(async_op=a), [], opts)

    # --- everything else: straight to the fall-back (gloo; NCCL for CUDA tensors) --------
    # Forwarded here rather than left to c10d's dispatch (the backend registered above).
    # For a method a Python subclass does not override, torch's pybind11 trampoline calls
    # the C++ base class while still holding the GIL it took to look for an override; the
    # base enqueues on gloo and waits for gloo's queue mutex, which a gloo worker holds
    # while it needs the GIL to free a finished work's Python-made tensors: a lock-order
    # inversion that hung broadcast within a few hundred calls (never with plain gloo).
    # bench/c10d_python_pg_deadlock.py reproduces it without ringcoll. The gloo object's
    # own bindings release the GIL, so these calls are safe; so is every method ringcoll
    # overrides above. The trampoline's other such methods (all_to_all_single and the
    # coalesced forms) fall back to the older names overridden here.

    # They take c10d's arguments unchanged, in any of ProcessGroup's forms (positional or
    # keyword: broadcast(t, root=0), send([t], dstRank=1, tag=0), ...); defined after the
    # class by _forward_to_gloo.
    FORWARDED_TO_GLOO = ("gather", "scatter", "alltoall_base", "alltoall", "send", "recv", "recv_anysource")

    # --- lifetime -----------------------------------------------------------------------

    def shutdown(self) -> None:
        """Called by dist.destroy_process_group: release every communicator's buffers."""
        self._closed = True
        with self._comm_lock:
            comms, self._comms = list(self._comms.values()), {}
        # A CUDA ring's close ends in a barrier of this group (transports/cuda.py): like the
        # handle exchange, it goes to the fall-back, since our own rings are being closed.
        self._bootstrap_thread = threading.get_ident()
        try:
            for comm in comms:
                # A HierarchicalCommunicator's close meets every rank over its own two groups,
                # which destroy_process_group() shuts down too, in an order not ours: released
                # without meeting, its groups left idle (weakly held) for the next group's
                # communicator over the same ranks, or to torch to destroy with the world.
                if isinstance(comm, HierarchicalCommunicator):
                    comm._close(wait_for_peers=False, offer_groups=True)
                else:
                    comm._close(wait_for_peers=True)
        finally:
            self._bootstrap_thread = None

    def abort(self) -> None:
        self.shutdown()


def _forward_to_gloo(name: str):
    """A RingcollProcessGroup method that hands the call, as c10d made it, to the internal
    fall-back group (counted in call_counts as "gloo:<name>" or "nccl:<name>")."""
    def forward(self, *args, **kwargs):
        if args and args[-1] is None:  # c10d's "default options", which gloo's binding spells by omission
            args = args[:-1]
        return getattr(self._fallback(name, (args, kwargs)), name)(*args, **kwargs)

    forward.__name__ = name
    forward.__qualname__ = f"RingcollProcessGroup.{name}"
    return forward


for _name in RingcollProcessGroup.FORWARDED_TO_GLOO:
    setattr(RingcollProcessGroup, _name, _forward_to_gloo(_name))


CUDA_FALLBACKS = ("nccl", "gloo")


def _nccl_if_usable(store, rank: int, size: int, timeout: datetime.timedelta):
    """The internal NCCL group that CUDA tensors ringcoll does not serve go to, or None (no
    GPU, no NCCL, or RINGCOLL_CUDA_FALLBACK=gloo: gloo then takes them, as it takes CUDA
    tensors for broadcast, all-reduce and all-gather; choose gloo when several ranks share
    one GPU, which NCCL refuses)."""
    choice = os.environ.get("RINGCOLL_CUDA_FALLBACK", "nccl").strip().lower()
    if choice not in CUDA_FALLBACKS:
        raise ValueError(f"ringcoll backend: RINGCOLL_CUDA_FALLBACK={choice!r}; expected one of "
                         + ", ".join(CUDA_FALLBACKS))
    if choice != "nccl" or not torch.cuda.is_available() or not dist.is_nccl_available():
        return None
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(dist.PrefixStore("ringcoll-nccl/", store), rank, size, options)


def _exchange_hosts(store, rank: int, size: int, timeout: datetime.timedelta) -> list:
    """Every rank's shared-memory domain (the machine, as shared memory sees it:
    transports/host.py), through the store, when the group is made: so a group over several
    machines is known before anything is mapped, and one with machines of different rank
    counts is refused here, on every rank alike, saying what to do (naming each machine by
    its host name, its domain beside it)."""
    prefix = "ringcoll-host/"
    store.set(f"{prefix}{rank}", f"{socket.gethostname()}\n{shared_memory_domain()}")
    offers = []
    for peer in range(size):
        try:
            offers.append(store.get(f"{prefix}{peer}").decode().split("\n", 1))
        except Exception as exc:  # the store's timeout: the peer never reached init_process_group
            raise RingcollError(f"ringcoll backend: rank {peer} did not say which machine it is on within "
                                f"{timeout} ({type(exc).__name__}: {exc})") from exc
    hosts = [domain for _, domain in offers]
    members = ranks_by_domain(hosts)
    names = {domain: f"host {offers[ranks[0]][0]} ({domain})" for domain, ranks in members.items()}
    uneven = uneven_nodes_message("ringcoll backend", members, names)
    if uneven:
        raise RingcollError(uneven)
    return hosts


def _create(store, rank: int, size: int, timeout: datetime.timedelta) -> RingcollProcessGroup:
    return RingcollProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Register "ringcoll" with torch.distributed (``import ringcoll`` does it). Idempotent."""
    if BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=False, devices=list(SERVED_DEVICE_TYPES))


def _register_on_import() -> None:
    """``import ringcoll`` must not fail because a torch version moved this API."""
    try:
        register()
    except Exception as exc:  # noqa: BLE001
        import warnings

        warnings.warn(f"ringcoll: could not register the torch.distributed backend {BACKEND_NAME!r} "
                      f"({type(exc).__name__}: {exc}); the ringcoll.* calls still work", stacklevel=2)


_register_on_import()
