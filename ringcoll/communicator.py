"""The Communicator: one ring of P ranks over one process group and one device.

It owns what every transport shares: the settings (validated alike on every rank), the
argument checks, the Work handles and closing. The bytes are moved by a transport chosen by
device in one place (ringcoll/transports/): POSIX shared memory for CPU tensors, CUDA IPC
for CUDA tensors. A call goes, in all::

    Communicator.all_reduce          validate, turn tensors into a CollectiveCall (addresses, codes)
      -> transport.submit            host: this thread or the worker; CUDA: the streams
        -> _C.HostComm / _C.CudaComm csrc/host/host_comm.cpp, csrc/cuda/cuda_comm.cu

Construction is collective (every rank of the group calls it, in the same order as every
other collective): each rank's transport builds its buffer and the handles (segment names,
IPC handles) go round the group's bootstrap (ringcoll/bootstrap.py: a torch.distributed
process group, or the threads of ``ringcoll.run_in_process``). After that no collective
touches the group again.

Every method validates its arguments completely before any data moves, so bad input
raises ValueError / TypeError (message starting with the op name) and leaves the output
untouched. With ``async_op=True`` a :class:`Work` is returned.
"""

from __future__ import annotations

import datetime
import math
import os
from typing import Callable, Optional, Sequence

import torch

from ringcoll import _C, packing, plans, tuning
from ringcoll.bootstrap import bootstrap_for
from ringcoll._types import (CPU, COLLECTIVE_CODES, DATA_COLLECTIVES, DTYPE_NAMES, DTYPE_SIZES, ROOTED_COLLECTIVES,
                             ReduceOp, dtype_code, op_code)
from ringcoll.errors import RingcollError
from ringcoll.transports import CollectiveCall, Settings, new_call, transport_for
from ringcoll.views import as_device_array, check_count, tensor_view

DEFAULT_TIMEOUT_SECONDS = 300.0
DEFAULT_BUFFER_BYTES = 4 << 20  # per rank (CPU); messages of any size are sliced through it
# CPU: messages up to this size take the one-shot path instead of the ring (csrc/host/host_comm.cpp,
# "The one-shot path"); the crossover measured in bench/results/2026-12-01-cpu-small-message-crossover.txt.
DEFAULT_SMALL_BYTES = 64 << 10
# CPU: all-gathers from this size on, and below the second, read each peer's input directly
# (csrc/host/peer_memory.h) where the kernel allows it; measured in bench/results/2026-12-01-cpu-direct-read.txt.
DEFAULT_DIRECT_BYTES = 16 << 10
DEFAULT_DIRECT_MAX_BYTES = _C.host_default_direct_max_bytes  # 32 MiB
_SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
                  "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_bytes(text: str) -> int:
    """'4194304', '4M', '4MiB' -> 4194304 (binary units)."""
    stripped = text.strip().upper()
    digits = stripped.rstrip("KMGIB")
    suffix = stripped[len(digits):]
    if not digits.isdigit() or suffix not in _SIZE_SUFFIXES:
        raise ValueError(f"cannot read {text!r} as a byte count (e.g. 4194304, 4M, 4MiB)")
    return int(digits) * _SIZE_SUFFIXES[suffix]


MAX_TIMEOUT_SECONDS = 1e9  # ~31 years: a bound that still fits every clock it is converted to


def resolve_timeout(timeout) -> float:
    if timeout is None:
        timeout = os.environ.get("RINGCOLL_TIMEOUT", DEFAULT_TIMEOUT_SECONDS)
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    try:
        if isinstance(timeout, bool):  # float(True) is 1.0: timeout=True meant 1 s
            raise TypeError
        seconds = float(timeout)
    except (TypeError, ValueError):
        raise ValueError(f"Communicator: timeout= / RINGCOLL_TIMEOUT must be a number of seconds, got "
                         f"{timeout!r}") from None
    if not seconds > 0:
        raise ValueError(f"Communicator: timeout must be a positive number of seconds, got {timeout!r}")
    if not seconds <= MAX_TIMEOUT_SECONDS:  # also catches inf and nan
        raise ValueError(f"Communicator: timeout must be at most {MAX_TIMEOUT_SECONDS:g} s, got {timeout!r}: "
                         "ringcoll never waits without a bound")
    return seconds


def _resolve_check(check) -> bool:
    if check is None:
        setting = os.environ.get("RINGCOLL_CHECK", "1").strip().lower()
        if setting not in ("0", "false", "off", "no", "1", "true", "on", "yes"):
            raise ValueError(f"Communicator: RINGCOLL_CHECK must be 1/true/on/yes or 0/false/off/no, got "
                             f"{os.environ['RINGCOLL_CHECK']!r}")
        return setting in ("1", "true", "on", "yes")
    return bool(check)


def default_buffer_bytes(device_type: str, world: int) -> int:
    """Each rank's registered buffer when neither ``buffer_bytes=`` nor RINGCOLL_BUFFER_BYTES
    says: 4 MiB on the CPU; on CUDA a slot of one 32 KiB tile for each of the most blocks a
    launch may have (kernel_abi.h's default_buffer_bytes: 16 MiB x world), so a large message
    takes a block per SM (docs/cuda.md, "Blocks and tiles"). From the world size alone, so
    the same on every rank."""
    return _C.cuda_default_buffer_bytes(world) if device_type == "cuda" else DEFAULT_BUFFER_BYTES


def resolve_buffer_bytes(buffer_bytes, device_type: str, world: int) -> int:
    if buffer_bytes is None:
        env = os.environ.get("RINGCOLL_BUFFER_BYTES")
        buffer_bytes = parse_bytes(env) if env else default_buffer_bytes(device_type, world)
    return int(buffer_bytes)


def _resolve_threshold(value, name: str, env: str, default: int, zero_means: str) -> int:
    """A message-size threshold: `value`, else the environment variable, else the default."""
    if value is None:
        text = os.environ.get(env)
        value = parse_bytes(text) if text else default
    value = int(value)
    if value < 0:
        raise ValueError(f"Communicator: {name} must be >= 0 (0: {zero_means}), got {value}")
    return value


# --- torch.profiler -------------------------------------------------------------------------

#: Whether a torch.profiler is recording (one C call, cheap enough for the plain calls' test).
profiler_enabled = torch.autograd._profiler_enabled


def call_details(dtype: Optional[int], op: Optional[int], count: int) -> dict:
    """What a profiler range says of a call beside its tensors: dtype, element count, op
    (each where the call has one)."""
    details = {"count": count}
    if dtype is not None:
        details["dtype"] = DTYPE_NAMES[dtype]
    if op is not None:
        details["op"] = ReduceOp(op).name
    return details


def submit_profiled(name: str, tensors: Sequence, details: Callable[[], dict], submit: Callable):
    """submit(), and while a torch.profiler records, inside a range named ``ringcoll:<name>``
    with the tensors' shapes and types (under ``record_shapes``) and details() (call_details,
    worked out only then). The range is opened on the calling thread and closed when the
    call has run, on whichever thread ran it (as c10d's own Work ranges are: the profiler
    records only threads it started on, not ringcoll's worker)."""
    if not profiler_enabled():
        return submit()
    span = torch._C._profiler._RecordFunctionFast(f"ringcoll:{name}", tuple(tensors), details())
    span.__enter__()
    try:
        completion = submit()
    except BaseException:
        span.__exit__(None, None, None)
        raise
    if completion is None:
        span.__exit__(None, None, None)
    else:
        completion.on_done(lambda: span.__exit__(None, None, None))
    return completion


def wait_seconds(timeout) -> Optional[float]:
    """A wait's limit in seconds, or None for none: torch's Work.wait takes a timedelta (c10d
    passes one), ringcoll's also takes seconds; zero or less (c10d's kNoTimeout) is no limit."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return seconds if seconds > 0 else None


class Work:
    """Handle of an async collective, like the object ``torch.distributed`` returns.

    ``wait()`` re-raises the collective's error, if any. On CPU it blocks until the
    collective finished (``wait(timeout)`` past its timeout raises RingcollTimeoutError, a
    RuntimeError and a TimeoutError, as torch's own timeouts are RuntimeErrors); on CUDA it
    makes the current stream wait for it, as NCCL's does (``synchronize()`` blocks the
    host). The transport's Completion (transports/base.py) says how. The queued call holds
    its tensors until it has run, kept or not (as gloo's Work does).
    """

    def __init__(self, completion, result: list, keep_alive: Sequence = ()):
        self._completion = completion
        self._result = result  # the output tensors
        self._keep_alive = keep_alive  # inputs and scratch the extension reads by address
        self._future: Optional[torch.futures.Future] = None

    def wait(self, timeout=None) -> bool:
        """`timeout`: seconds or a timedelta, as torch's Work.wait takes (wait_seconds)."""
        self._completion.wait(wait_seconds(timeout))
        return True

    def synchronize(self) -> None:
        """Block the host until the collective finished; raises its error, if any."""
        self._completion.synchronize()

    def is_completed(self) -> bool:
        return self._completion.done()

    def is_success(self) -> bool:
        return self._completion.done() and self._completion.error() is None

    def exception(self):
        return self._completion.error()

    def result(self) -> list:
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A torch Future of the output tensors (for DDP communication hooks), completed when
        the collective is, before any waiter of this Work wakes; the same Future on every
        call. If the collective failed, the Future fails as C++ sees a failure (DDP's reducer,
        a ``then`` chain): its ``wait()`` raises a RuntimeError quoting the ringcoll error."""
        if self._future is None:
            self._future = future_of(self._completion, self._result)
        return self._future


def future_of(completion, result) -> torch.futures.Future:
    """A torch Future completed, when `completion` is, with `result` or with its error.

    Python's ``Future.set_exception`` does not fail a Future for C++: it stores the
    exception as the value and only Python's ``wait()`` raises it, so DDP's reducer read the
    exception object as its tensor list and crashed (SIGSEGV). A Future fails in C++'s sense
    only when a ``then`` callback raises, so the one returned is a callback's: `trigger`
    completes on the completion's thread, and `settle` returns the tensors or raises."""
    trigger: torch.futures.Future = torch.futures.Future()

    def settle(_) -> list:
        error = completion.error()
        if error is not None:
            raise error
        return result

    future = trigger.then(settle)
    completion.on_done(lambda: trigger.set_result(None))
    return future


class PreparedTensors:
    """What a prepared call keeps of its tensors, for both communicators' prepared calls:
    each tensor once (in place: one), and where and what it was when prepared (the address,
    size and dtype the extension writes by), so that each run can see it still is."""

    def __init__(self, name: str, tensors: Sequence[torch.Tensor]):
        self._name = name
        self._tensors = tuple({id(t): t for t in tensors}.values())
        self._layout = tuple((t.data_ptr(), t.numel(), t.dtype) for t in self._tensors)

    def _unchanged(self) -> bool:
        return _C.same_layout(self._tensors, self._layout)

    def _changed(self) -> ValueError:
        """The error of a run whose tensors are no longer as prepared (naming the first that changed)."""
        for t, was in zip(self._tensors, self._layout):
            if not _C.same_layout((t,), (was,)):
                return ValueError(f"{self._name}: a tensor of this prepared call changed since it was prepared "
                                  f"(address, size or dtype: now {t.dtype}, {t.numel()} elements; was "
                                  f"{was[2]}, {was[1]}); prepare the call again")
        raise AssertionError("_changed called on an unchanged prepared call")


class PreparedCollective(PreparedTensors):
    """One collective on fixed tensors, checked once (Communicator.prepare_*), run by calling it:
    ``run = comm.prepare_all_reduce(t); run(); run(async_op=True).wait()``.

    Each run still makes sure the tensors are where and what they were when prepared (the
    same address, size and dtype: what the extension writes by), at a few attribute reads
    instead of the full checks (on the CPU in the same binding call as the run); a tensor
    resized, re-pointed (``t.data = ...``, ``set_``) or recast since raises ValueError naming
    the op before anything moves. The values may change freely between runs. Like every
    collective, each run must be made on every rank.
    """

    def __init__(self, comm: "Communicator", name: str, call: CollectiveCall, outputs: list, inputs: Sequence):
        super().__init__(name, (*outputs, *inputs))
        self._comm, self._call, self._outputs, self._inputs = comm, call, outputs, inputs
        # The transport's shortest synchronous paths for this call, where it has them: the call
        # read once by the extension (run while plain calls are), and a run through its queue.
        prepare_plain, bind = (getattr(comm.transport, name, None) for name in ("prepare_plain", "bind"))
        self._run_plain = prepare_plain(name, self._tensors, self._layout, call) if prepare_plain else None
        self._run_now = bind(call) if bind is not None else None

    def __call__(self, async_op: bool = False):
        if (self._run_plain is not None and self._comm._transport.plain_calls is not None and not async_op
                and not profiler_enabled()):  # checked and run in one binding call
            if not self._run_plain():
                raise self._changed()
            return None
        if not self._unchanged():
            raise self._changed()
        self._comm._ensure_open(self._name)
        if async_op or self._run_now is None or profiler_enabled():
            return self._comm._submit(self._name, self._call, self._outputs, self._inputs, async_op)
        self._run_now()
        return None


# How the two tensors of a pair relate (_check_pair's `sizes`): as large as each other
# (all_reduce's output=), output = world_size x input (all-gather: input is a rank's chunk of
# output), input = world_size x output (reduce-scatter: output is a rank's chunk of input).
EQUAL, GATHER, SCATTER = _C.EQUAL_SIZES, _C.GATHER_SIZES, _C.SCATTER_SIZES


# The algorithms a plain call runs without looking further: native, and auto where its table
# picks native (the binding hands the call back, writing nothing, where auto may pick a plan;
# the call then runs plain again, with the plan _plan gives, as a named plan's does). As the
# binding reads them (its choice_of): None and True.
PLAIN_ALGORITHMS = {tuning.NATIVE: None, "auto": True}
_NOT_YET = object()  # an algorithm a communicator's _plain_choices does not hold (yet)
# How many message sizes a communicator keeps auto's and native's broadcast/reduce choice for.
ROOTED_CHOICES = 1024


def _call(collective: str, src: torch.Tensor, dst: torch.Tensor, user_count: int, dtype: int,
          op: Optional[int] = None, plan: Optional[tuple] = None) -> CollectiveCall:
    """The transports' record of a call on checked tensors (the list and packed forms; the
    tensor forms take the addresses their checks already read)."""
    return new_call((collective, src.data_ptr(), dst.data_ptr(), user_count, dtype, op, plan))


def check_root(name: str, what: str, root, world_size: int) -> None:
    """A rooted call's root (broadcast's src, reduce's dst) is a rank of the communicator:
    ValueError naming the call otherwise."""
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < world_size:
        raise ValueError(f"{name}: {what}={root!r} is not a rank of this communicator (0..{world_size - 1})")


class ArgumentChecks:
    """The argument checks, one place for both communicators (this one and the hierarchical
    one in training/hierarchical.py). They read ``self.device``, ``self.world_size`` and
    ``self.rank``, and raise TypeError / ValueError naming the op before anything moves.

    The checks of one tensor and of a pair are the extension's (csrc/bindings/tensor_checks.h),
    which the CPU transport's plain calls also run without coming back to Python; the list
    forms build on them here."""

    device: torch.device
    world_size: int
    rank: int

    def _check_tensor(self, op: str, what: str, t) -> tuple[int, int, int]:
        """`t` is a contiguous tensor on this communicator's device of a supported dtype;
        returns (dtype code, address, element count)."""
        return _C.check_tensor(op, what, t, self.device)

    def _check_pair(self, op: str, output: torch.Tensor, input: torch.Tensor,
                    sizes: int) -> tuple[int, int, int, int, int]:
        """Both tensors valid, of one dtype, sized as `sizes` (EQUAL, GATHER, SCATTER) says, and
        either disjoint or the smaller one exactly this rank's chunk of the larger (for equal
        sizes: the same tensor); returns (dtype code, input address, input count, output
        address, output count, whether the pair is in place)."""
        return _C.check_pair(op, output, input, sizes, self.device, self.rank, self.world_size)

    def _check_list(self, op: str, what: str, tensors, reference: torch.Tensor) -> int:
        """`tensors`: world_size valid tensors like `reference`; returns the dtype's code."""
        dtype, _, count = self._check_tensor(op, "tensor" if what == "tensor_list" else "output", reference)
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(f"{op}: {what} must be a list of tensors, got {type(tensors).__name__}")
        if len(tensors) != self.world_size:
            raise ValueError(f"{op}: {what} has {len(tensors)} tensors, expected world_size = {self.world_size}")
        for i, t in enumerate(tensors):
            entry_dtype, _, entry_count = self._check_tensor(op, f"{what}[{i}]", t)
            if entry_dtype != dtype:
                raise TypeError(f"{op}: {what}[{i}] has dtype {t.dtype}, expected {reference.dtype}")
            if entry_count != count:
                raise ValueError(f"{op}: {what}[{i}] has {entry_count} elements, expected {count}")
        return dtype

    def _check_same_dtype(self, op: str, what: str, tensors) -> int:
        """A non-empty list of valid tensors of one dtype; returns its code."""
        if not isinstance(tensors, (list, tuple)) or not tensors:
            raise TypeError(f"{op}: {what} must be a non-empty list of tensors")
        for i, t in enumerate(tensors):
            dtype = self._check_tensor(op, f"{what}[{i}]", t)[0]
            if t.dtype != tensors[0].dtype:
                raise TypeError(f"{op}: {what}[{i}] has dtype {t.dtype}, expected {tensors[0].dtype}")
        return dtype

    def _check_pairs(self, op: str, outputs, inputs, sizes: str) -> int:
        """The coalesced forms: two lists of one length and one dtype, each pair as
        _check_pair; returns the dtype's code."""
        self._check_same_dtype(op, "outputs", outputs)
        dtype = self._check_same_dtype(op, "inputs", inputs)
        if len(outputs) != len(inputs):
            raise ValueError(f"{op}: {len(outputs)} outputs for {len(inputs)} inputs")
        for i, (output, input) in enumerate(zip(outputs, inputs)):
            self._check_pair(f"{op}: pair {i}", output, input, sizes)  # messages name the pair
        return dtype


class Communicator(ArgumentChecks):
    """A ring over the ranks of ``group`` (a torch.distributed process group, the default group
    when None, or the in-process rank ``ringcoll.run_in_process`` hands each thread) for tensors on
    ``device`` (default CPU: the shared-memory transport; ``"cuda"`` / ``"cuda:N"``: CUDA IPC,
    the current CUDA device when no index is given).

    ``timeout``: seconds (or a timedelta) any single wait may last before it raises
    RingcollTimeoutError; default ``RINGCOLL_TIMEOUT`` or 300. ``buffer_bytes``: size of each
    rank's registered buffer; default ``RINGCOLL_BUFFER_BYTES``, else 4 MiB on the CPU and
    16 MiB x world size on CUDA (:func:`default_buffer_bytes`). Larger messages are sliced
    through it. ``check``: compare every call's collective, dtype, op and size
    across ranks before moving data (RingcollMismatchError on every rank if they differ);
    default ``RINGCOLL_CHECK`` or on. It must be the same on all ranks. ``small_bytes``
    (CPU): messages of at most this many bytes that fit one slot of the buffer take the
    one-shot path (one publication per rank, every rank combines all P copies) instead of
    the ring (an all-reduce of float16 / bfloat16 up to a sixteenth of it: every rank folds
    the whole message, and their combines are dear); 0 turns it off; default
    ``RINGCOLL_SMALL_BYTES`` or 64 KiB. It must be the
    same on all ranks (checked). ``direct_bytes`` (CPU): all-gathers of at least this many
    bytes, and under ``RINGCOLL_DIRECT_MAX_BYTES`` (default 32 MiB: from there the buffer's
    pipeline is faster), read every peer's input straight into the output (one copy, Linux cross-memory attach) where every rank
    may read every peer (probed once; otherwise they go through
    the buffer as before: ``transport.direct_reads`` says which, ``transport.direct_reads_unavailable`` why);
    0 turns it off; default ``RINGCOLL_DIRECT_BYTES`` or 16 KiB (it goes before the one-shot
    path). The same on all ranks (checked). ``algorithm``: the algorithm every call runs
    unless it names one (``algorithm=`` on each collective): ``"auto"`` (the default, or
    ``RINGCOLL_ALGORITHM``: on the CPU, whichever of native and the built-in plans the
    recorded cost model prices lowest for the call's size, ringcoll/tuning.py, where its table
    was recorded on this machine, else native, and ``tuning_note`` says why; on CUDA the
    ring kernels), ``"native"`` (the CPU transport's own path: the ring, with the one-shot
    and direct-read paths where the thresholds above say), a built-in plan
    (``ringcoll.algorithms()``: ``"ring"``, ``"oneshot"``, ... run by the CPU transport's
    plan engine) or one registered with ``ringcoll.register_algorithm``; the same on all
    ranks (checked, as is auto's table; a call that runs another on some rank raises
    RingcollMismatchError). ``shares_cores`` (CPU): this rank's cores also
    run other busy threads, so its waits nap instead of spinning (HierarchicalCommunicator
    sets it for its node's ring where ranks and their link threads outnumber the cores).

    Usable as a context manager; ``close()`` releases the buffers. On CUDA ``close()`` is
    collective (every peer must close before anyone frees memory the others map).
    """

    transport_class = staticmethod(transport_for)  # device -> its transport (tests substitute the emulated one)

    def __init__(self, group=None, device=None, timeout=None, buffer_bytes=None, check=None, small_bytes=None,
                 direct_bytes=None, shares_cores: bool = False, algorithm: Optional[str] = None):
        device = torch.device(device if device is not None else "cpu")
        self.algorithm = algorithm if algorithm is not None else os.environ.get("RINGCOLL_ALGORITHM", "auto")
        if not isinstance(self.algorithm, str):
            raise TypeError(f"Communicator: algorithm must be a name, got {self.algorithm!r}")
        transport_cls = self.transport_class(device)
        self._tuned = transport_cls.tuned  # whether auto reads the recorded table
        self._configure(group, transport_cls.resolve_device(device), timeout, buffer_bytes, check,
                        transport_cls.slot_alignment)
        self._choose_automatically()
        self.small_bytes = _resolve_threshold(small_bytes, "small_bytes", "RINGCOLL_SMALL_BYTES", DEFAULT_SMALL_BYTES,
                                              "always the ring")
        self.direct_bytes = _resolve_threshold(direct_bytes, "direct_bytes", "RINGCOLL_DIRECT_BYTES",
                                               DEFAULT_DIRECT_BYTES, "never read peers directly")
        self.direct_max_bytes = _resolve_threshold(None, "RINGCOLL_DIRECT_MAX_BYTES", "RINGCOLL_DIRECT_MAX_BYTES",
                                                   DEFAULT_DIRECT_MAX_BYTES, "never read peers directly")
        self._closed = True  # until the transport exists: nothing to close
        settings = Settings(self._bootstrap, self.device, self.rank, self.world_size, self.timeout, self.buffer_bytes,
                            self.check, self.small_bytes, self.direct_bytes, self.direct_max_bytes, shares_cores)
        self._transport = transport_cls(settings, self._exchange)
        self._view = tensor_view if transport_cls.takes_arrays else (lambda t: t)
        self._closed = False
        self._set_auto_bands()

    def _exchange(self, mine, **settings) -> list:
        """Send this rank's `mine` (segment name, IPC handle) round the group together with
        the settings every rank must share (the call check, the buffer size, and any the
        transport adds); returns every rank's `mine`. Raises ValueError, on every rank, if a
        setting differs: peers would otherwise read each other's buffers with different
        layouts."""
        settings = {"RINGCOLL_CHECK / check=": self.check, "RINGCOLL_BUFFER_BYTES / buffer_bytes=": self.buffer_bytes,
                    "RINGCOLL_ALGORITHM / algorithm=": self.algorithm,
                    "RINGCOLL_TUNING (auto's table, its digest)": self._tuning_digest, **settings}
        offers = self._bootstrap.all_gather_object((mine, settings))
        for name in settings:
            values = [theirs[name] for _, theirs in offers]
            if len(set(values)) != 1:
                raise ValueError(f"Communicator: {name} differs between ranks: "
                                 + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)))
        if self._tuning_error is not None:
            raise self._tuning_error
        return [theirs for theirs, _ in offers]

    def _configure(self, group, device: torch.device, timeout, buffer_bytes, check, slot_alignment: int) -> None:
        """Settings every transport shares, validated before any rank allocates anything."""
        self.timeout = resolve_timeout(timeout)
        self._bootstrap = bootstrap_for(group, self.timeout)
        self.group = getattr(self._bootstrap, "group", group)  # a process group, or the in-process rank
        self.device = CPU if device.type == "cpu" else device
        self.check = _resolve_check(check)
        self.rank = self._bootstrap.rank
        self.world_size = self._bootstrap.world_size
        self.buffer_bytes = resolve_buffer_bytes(buffer_bytes, self.device.type, self.world_size)
        minimum = _C.min_buffer_bytes(self.world_size, slot_alignment)
        if self.buffer_bytes < minimum:
            raise ValueError(f"Communicator: buffer_bytes={self.buffer_bytes} is too small for "
                             f"{self.world_size} ranks (minimum {minimum})")
        # A plan of C chunks needs two banks of C aligned slots (plan.h): this many bytes per chunk
        self._plan_chunk_bytes = _C.min_buffer_bytes(1, slot_alignment)

    # --- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Finish queued work, then release the buffers. Idempotent. On CUDA it is
        collective: it returns once every peer has closed too, so call it on every rank at
        the same point (or use ``with``, or ``ringcoll.destroy_communicators()``)."""
        self._close(wait_for_peers=True)

    def _close(self, wait_for_peers: bool) -> None:
        if self._closed:
            return
        self._closed = True  # no call from another thread joins the queue while it drains
        try:
            self._transport.close(wait_for_peers)
        except BaseException:  # not closed (a close from a Future's callback): it may be closed again
            self._closed = False
            raise
        # Let go of the process group: held on, it outlives dist.destroy_process_group(), and
        # gloo's worker threads with it, until the interpreter's exit, where one that frees a
        # finished call's tensors needs the GIL and aborts the process (a torch race).
        self._bootstrap = self.group = None

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # The garbage collector may get here on one rank only, at any point: waiting for
        # peers there could stall that rank for the whole timeout, so a CUDA buffer is kept
        # until the process exits instead (with a RuntimeWarning saying so).
        try:
            if not getattr(self, "_closed", True):
                self._close(wait_for_peers=False)
        except Exception:
            pass

    @property
    def broken(self) -> bool:
        return self._transport.broken

    @property
    def transport(self):
        """The transport object (HostTransport or CudaTransport) moving this ring's bytes."""
        return self._transport

    def synchronize(self) -> None:
        """Block until every collective issued so far finished (on CUDA: raise a recorded
        kernel error)."""
        self._transport.synchronize()

    def _ensure_open(self, op: str) -> None:
        if self._closed:
            raise RingcollError(f"{op}: communicator is closed")

    # --- running --------------------------------------------------------------------------

    def _submit(self, name: str, call: CollectiveCall, outputs: list, keep_alive: Sequence, async_op: bool,
                then: Optional[Callable[[], None]] = None) -> Optional[Work]:
        """Hand `call` (the user's `name`) to the transport; a Work when async. The Work holds
        every tensor the extension reads by address until the call has run."""
        def submit():
            return self._transport.submit(call, outputs, keep_alive, async_op, then, name)

        completion = submit_profiled(name, keep_alive, lambda: call_details(call.dtype, call.op, call.user_count),
                                     submit)
        return None if completion is None else Work(completion, list(outputs), keep_alive)

    def _choose_automatically(self) -> None:
        """Read auto's table (ringcoll/tuning.py) for this world size: per collective, the
        bands of sizes where each algorithm is the cheapest. On CUDA (and its emulator) auto
        is native, the ring kernels: the table prices the CPU transport."""
        table, self._tuning_error = None, None
        try:
            table = tuning.load() if self._tuned else None
        except ValueError as e:  # raised once every rank has said so (_exchange): no rank waits for it
            self._tuning_error = e
        self._tuning_digest = (table.digest if table is not None
                               else f"unreadable ({self._tuning_error})" if self._tuning_error else None)
        self.tuning_note = ""
        if table is not None and not table.holds_here():  # recorded elsewhere: native (tuning.py says why)
            self.tuning_note = (f"auto's table {table.source} was recorded on {table.machine}; this machine is "
                                f"{tuning.this_machine()}: auto runs native here (ringcoll-bench --record-tuning "
                                "FILE records one, RINGCOLL_TUNING=FILE reads it)")
            table = None
        self._tuning_table = table
        self._known_plans = {}  # (collective, algorithm, root) -> compiled plan: _plan's
        self._rooted_choices = {}  # (collective, auto or native, root, bytes) -> compiled plan: _plain_plan's
        # What a plain call of the ring's three collectives passes the binding, per algorithm
        # name: PLAIN_ALGORITHMS, and each plan once _plan has built it, a user's as a
        # built-in one (the index the transport holds it under). One dict read per call (a
        # 4 KiB call is ~1.5 us; a method call here would cost 0.15 more).
        self._plain_choices = {c: dict(PLAIN_ALGORITHMS) for c in ("all_reduce", "reduce_scatter", "all_gather")}
        plans.hold_compiled_plans(self)  # a user's plan registered again replaces what is kept here

    def _set_auto_bands(self) -> None:
        """Once the transport exists: per collective, auto's bands from the table, leaving out
        the plans this transport cannot run (those that read peers' memory where it lies,
        without direct reads: every rank agreed on those at bootstrap, so on the bands too; and
        those of more chunks than this buffer has slots for); and, for the plain calls, each
        band's plan, built and held, so that the binding runs auto's choice itself."""
        table, readable = self._tuning_table, getattr(self._transport, "direct_reads", False)

        def cannot(collective):
            return [name for name in tuning.candidates(collective) if name in plans.BUILTIN
                    and ((not readable and plans.reads_in_place(name, collective, self.world_size))
                         or not self._plan_fits(plans.compiled(name, collective, self.world_size)[0].chunks))]

        # Per form: an in-place call chooses by the table's in-place times, where it has them
        excluded = {c: cannot(c) for c in DATA_COLLECTIVES} if table is not None else {}
        self._auto_bands, self._auto_bands_in_place = (
            {c: table.bands(c, self.world_size, excluded[c], in_place) if table is not None
             else [(0, tuning.NATIVE)] for c in DATA_COLLECTIVES} for in_place in (False, True))
        plain = self._transport.plain_calls
        for collective in self._plain_choices if plain is not None else ():
            for in_place, by_collective in ((False, self._auto_bands), (True, self._auto_bands_in_place)):
                bands = by_collective[collective]
                ends = [start for start, _ in bands[1:]] + [2**64 - 1]
                spans = []
                for (start, name), end in zip(bands, ends):
                    if name != tuning.NATIVE:
                        self._plan(collective, collective, name, start)  # built and held: _plain_choices has its index
                        spans.append((start, end, self._plain_choices[collective][name]))
                plain.set_auto_plan_spans(COLLECTIVE_CODES[collective], spans, in_place)

    def _message_bytes(self, collective: str, count: int, dtype: int) -> int:
        """The message of a call of `count` elements as its descriptor counts them (all-reduce,
        broadcast, reduce: the tensor; reduce-scatter: the input; all-gather: the output), in
        bytes."""
        return count * DTYPE_SIZES[dtype] * (self.world_size if collective in ("reduce_scatter", "all_gather") else 1)

    def _plan(self, name: str, collective: str, algorithm: Optional[str], message_bytes: int,
              root: int = 0, in_place: bool = False):
        """The plan a call runs: None for native (the transport's own path), else the
        compiled plan (_C.CompiledPlan: its id travels in the call's descriptor) of a built-in
        or registered algorithm (ringcoll/plans.py), built and checked on first use (for a
        rooted collective, relabelled for `root`);
        auto chooses by the message's size and form (``in_place``: the table's in-place times).
        ValueError naming the call for an unknown name, PlanError for a plan the checker refuses.

        On a communicator with symmetric memory (``empty``) auto reads symmetric arguments in
        place for the ring's three collectives: on the CPU native does, on CUDA the direct plan
        with the ring's plan as its fallback (the kernels run the one every rank's posts allow:
        device_plan.h). The choice must not hang on whether this rank's tensor is symmetric (a
        peer's may not be, and ranks must choose alike), so it hangs on the arenas, which
        every rank makes together."""
        algorithm = self.algorithm if algorithm is None else algorithm
        if algorithm == "auto":
            # (one rank has no peer to read: its plans are no-ops, and the direct one is no such plan)
            if collective not in ROOTED_COLLECTIVES and self._transport.symmetric_arenas and self.world_size > 1:
                return self._symmetric_auto(name, collective, message_bytes) \
                    if self._transport.symmetric_by_plan else None
            bands = self._auto_bands_in_place if in_place else self._auto_bands
            algorithm = tuning.choose(bands[collective], message_bytes)
        native_rooted = False
        if collective in ROOTED_COLLECTIVES:
            if algorithm == tuning.NATIVE:
                # No path of its own: the one-shot up to small_bytes, as for the others, then the
                # pipelined star for a broadcast (shared memory: every rank reads the root's copy at
                # once) and the chain for a reduce (its additions spread over the ranks; the one-shot
                # folds in the chain's order, so both give the same bits)
                algorithm = "oneshot" if message_bytes <= self.small_bytes else \
                    "star" if collective == "broadcast" else "ring"
                native_rooted = True
        elif algorithm == tuning.NATIVE:
            return None  # the transport's own path (on CUDA: the ring kernels)
        found = self._known_plans.get((collective, algorithm, root))  # a plan looked up before
        if found is not None:
            return found
        try:
            plan, compiled = plans.compiled(algorithm, collective, self.world_size, root)
        except plans.PlanError:
            raise  # it names the plan, the rank and the op
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        if not self._plan_fits(plan.chunks):
            if native_rooted:  # the one-shot's single chunk fits any buffer a communicator accepts
                return self._plan(name, collective, "oneshot", message_bytes, root)
            area = self._transport.plan_slot_area(self.buffer_bytes, self.world_size)
            raise ValueError(f"{name}: algorithm {algorithm!r} cuts the message into {plan.chunks} chunks, which "
                             f"need two banks of one {self._plan_chunk_bytes // 2}-byte slot per chunk: "
                             f"{plan.chunks * self._plan_chunk_bytes} bytes of slots; this communicator's "
                             f"buffer_bytes is {self.buffer_bytes}"
                             + (f", which leaves {area} for them (its kernels cut a plan's slots from the ring's "
                                f"{2 * self.world_size})" if area != self.buffer_bytes else "")
                             + ": raise it or choose another algorithm")
        # Later calls find it at once, a user's plan as a built-in one, so that the two are
        # timed alike (_forget_plan drops a user's when its name is registered again)
        self._known_plans[collective, algorithm, root] = compiled
        hold = getattr(self._transport, "hold_plan", None)  # the plain calls name it by index
        if hold is not None and collective in self._plain_choices:
            self._plain_choices[collective][algorithm] = hold(compiled)
        return compiled

    def _plan_fits(self, chunks: int) -> bool:
        """Whether this communicator's buffer holds a plan of `chunks` chunks: two banks of one
        aligned slot per chunk, cut from what its transport cuts plans' slots from."""
        return self._transport.plan_slot_area(self.buffer_bytes, self.world_size) >= chunks * self._plan_chunk_bytes

    def _symmetric_auto(self, name: str, collective: str, message_bytes: int):
        """auto over symmetric memory where the transport reads it by a plan (CUDA): the direct
        plan, with the ring's plan to run where some rank's input is not symmetric memory."""
        key = (collective, "auto over symmetric memory", 0)
        found = self._known_plans.get(key)
        if found is None:
            direct = self._plan(name, collective, "direct", message_bytes)
            ring = self._plan(name, collective, "ring", message_bytes)
            found = self._known_plans[key] = _C.plan_with_fallback(direct, ring)
        return found

    def _forget_plan(self, algorithm: str, collective: str) -> None:
        """``algorithm`` is registered again (plans.register_algorithm): drop what was kept of
        the plan it replaces (the transport keeps holding that one, unused)."""
        for key in [k for k in self._known_plans if k[:2] == (collective, algorithm)]:
            del self._known_plans[key]
        self._plain_choices.get(collective, {}).pop(algorithm, None)

    def _plain_plan(self, name: str, collective: str, algorithm: str, tensor, root: int = 0):
        """_plan for a plain call: a plan the call names, once built, is found without the
        message's size (getattr(tensor, "nbytes") alone costs 0.2 us, _plan 0.5: a third of a
        4 KiB call). A broadcast's or reduce's auto and native choose by the size, which
        nothing else changes for them: their choice is kept per size (a training loop
        repeats a few), up to ROOTED_CHOICES of them."""
        found = self._known_plans.get((collective, algorithm, root))
        if found is not None:
            return found
        nbytes = getattr(tensor, "nbytes", 0)
        if collective not in ROOTED_COLLECTIVES or algorithm not in PLAIN_ALGORITHMS:
            return self._plan(name, collective, algorithm, nbytes, root)
        key = (collective, algorithm, root, nbytes)
        found = self._rooted_choices.get(key)
        if found is None:
            found = self._plan(name, collective, algorithm, nbytes, root)
            if len(self._rooted_choices) >= ROOTED_CHOICES:
                self._rooted_choices.clear()
            self._rooted_choices[key] = found
        return found

    # --- symmetric memory -----------------------------------------------------------------

    def empty(self, *size, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A tensor in symmetric memory: storage every rank of this communicator has mapped.
        A collective whose arguments are such tensors on every rank reads its peers' where
        they lie instead of staging every byte through the ring's buffer (docs/symmetric.md).
        Uninitialised, like ``torch.empty``; ``size`` as torch takes it (``3, 4`` or ``(3, 4)``).

        Collective: every rank calls it with the same size and dtype, in the same order as its
        other calls on this communicator (RingcollMismatchError on every rank otherwise). A
        tensor may be written again as soon as a collective that read it has returned on this
        rank (with ``async_op``, once its Work is done), as any tensor. It stays valid after
        ``close()``. On CUDA, also across processes, the plans that read peers' inputs read
        such tensors in place: auto (the ring's plan on a call where some rank's tensor is not
        symmetric) and ``algorithm="direct"`` (docs/symmetric.md, "On CUDA")."""
        shape = torch.Size(size[0] if len(size) == 1 and not isinstance(size[0], int) else size)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        code = _C.dtype_code("empty", dtype)
        # Checked before the collective allocation: a negative size made it allocate and then
        # fail in view(), and a product past 64 bits wrapped to a small one
        if any(d < 0 for d in shape):
            raise ValueError(f"empty: size {tuple(shape)} has a negative dimension")
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes >= 1 << 63:
            raise ValueError(f"empty: size {tuple(shape)} of {dtype} is {nbytes} bytes, more than any memory")
        self._ensure_open("empty")
        data = self._transport.allocate_symmetric(nbytes, code, list(shape))  # holds the block, which holds the arena
        return data[:nbytes].view(dtype).view(shape)

    def zeros(self, *size, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``empty``, filled with zeros."""
        return self.empty(*size, dtype=dtype).zero_()

    def is_symmetric(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in this rank's symmetric memory of this communicator."""
        return tensor.numel() > 0 and self._transport.is_symmetric(tensor.data_ptr())

    # --- the collectives ------------------------------------------------------------------
    # On CUDA, arrays (CuPy, DLPack) are first viewed as tensors over the same memory
    # (ringcoll/views.py), then validated and run like tensors.

    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False, *,
                   output: Optional[torch.Tensor] = None, algorithm: Optional[str] = None):
        """In place: ``tensor = op(tensor on rank 0, ..., tensor on rank P-1)``.

        Reference: ``torch.stack(all_ranks_tensors).sum(0)`` for SUM (``/ P`` more for AVG),
        exact for integers and up to rounding for float32/float64. float16 and bfloat16 are
        rounded after every combine, so they match, bit for bit, a fold round the ring with
        one rounding per step: element i of chunk c (ring.h's chunks) is
        ``((x[c+1] + x[c+2]) + ...) + x[c]`` over ranks (indices mod P) in that dtype, not
        ``stack.sum(0)``, which rounds once. That is native's order and the ring plan's; another
        plan folds in its own (docs/algorithms.md), also where auto's table picks one.
        ``output`` (keyword, not in torch.distributed): write the result there instead and
        leave ``tensor`` unchanged, NCCL's out-of-place form. ``algorithm`` (keyword): this
        call's algorithm (see the class), the communicator's by default.
        """
        plain = self._transport.plain_calls
        # Checked and run in one binding call (not while torch.profiler records: _submit's range)
        if plain is not None and not async_op and not profiler_enabled():
            chosen = self.algorithm if algorithm is None else algorithm
            choice = self._plain_choices["all_reduce"].get(chosen, _NOT_YET)
            if choice is _NOT_YET:
                choice = self._plain_plan("all_reduce", "all_reduce", chosen, tensor)
            plain.all_reduce_tensor(tensor, output, op, choice)
            return None
        return self._submit("all_reduce", *self._all_reduce_call("all_reduce", tensor, op, output, algorithm),
                            async_op)

    def _all_reduce_call(self, name: str, tensor, op, output, algorithm=None):
        """all_reduce's checks; its call, outputs and inputs (for _submit or a PreparedCollective)."""
        tensor, output = self._view(tensor), self._view(output)
        self._ensure_open(name)
        if output is None:
            dtype, src, count = self._check_tensor(name, "tensor", tensor)
            output, dst = tensor, src
        else:
            dtype, src, count, dst, _, _ = self._check_pair(name, output, tensor, EQUAL)
        plan = self._plan(name, "all_reduce", algorithm, self._message_bytes("all_reduce", count, dtype),
                          in_place=src == dst)
        return new_call(("all_reduce", src, dst, count, dtype, op_code(name, op, dtype), plan)), [output], (tensor,)

    def all_reduce_coalesced(self, tensors: list, op=ReduceOp.SUM, async_op: bool = False, *,
                             algorithm: Optional[str] = None):
        """Each tensor all-reduced in place, as one flat call: the tensors are packed into
        one buffer, reduced once (one ring, not one per tensor), and copied back."""
        name = "all_reduce_coalesced"
        tensors = self._view_list(tensors)
        self._ensure_open(name)
        dtype = self._check_same_dtype(name, "tensors", tensors)
        code = op_code(name, op, dtype)
        flat = packing.concat(tensors)
        call = _call("all_reduce", flat, flat, flat.numel(), dtype, code,
                     self._plan(name, "all_reduce", algorithm, flat.nbytes, in_place=True))
        return self._submit(name, call, list(tensors), (flat,), async_op,
                            then=lambda: packing.split_into(flat, tensors))

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM,
                              async_op: bool = False, *, algorithm: Optional[str] = None):
        """``output = op over ranks of input.view(P, -1)[rank]``; input has P x output.numel()
        elements. In place when output is exactly chunk ``rank`` of input."""
        plain = self._transport.plain_calls
        if plain is not None and not async_op and not profiler_enabled():
            chosen = self.algorithm if algorithm is None else algorithm
            choice = self._plain_choices["reduce_scatter"].get(chosen, _NOT_YET)
            if choice is _NOT_YET:
                choice = self._plain_plan("reduce_scatter_tensor", "reduce_scatter", chosen, input)
            plain.reduce_scatter_tensor(output, input, op, choice)
            return None
        name = "reduce_scatter_tensor"
        return self._submit(name, *self._reduce_scatter_call(name, output, input, op, algorithm), async_op)

    def _reduce_scatter_call(self, name: str, output, input, op, algorithm=None):
        output, input = self._view(output), self._view(input)
        self._ensure_open(name)
        dtype, src, _, dst, count, in_place = self._check_pair(name, output, input, SCATTER)
        call = ("reduce_scatter", src, dst, count, dtype, op_code(name, op, dtype),
                self._plan(name, "reduce_scatter", algorithm, self._message_bytes("reduce_scatter", count, dtype),
                           in_place=in_place))
        return new_call(call), [output], (input,)

    def all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                               async_op: bool = False, *, algorithm: Optional[str] = None):
        """``output_tensor.view(P, -1)[r] = input_tensor on rank r`` for every r. In place when
        input_tensor is exactly chunk ``rank`` of output_tensor."""
        plain = self._transport.plain_calls
        if plain is not None and not async_op and not profiler_enabled():
            chosen = self.algorithm if algorithm is None else algorithm
            choice = self._plain_choices["all_gather"].get(chosen, _NOT_YET)
            if choice is _NOT_YET:
                choice = self._plain_plan("all_gather_into_tensor", "all_gather", chosen, output_tensor)
            plain.all_gather_into_tensor(output_tensor, input_tensor, choice)
            return None
        name = "all_gather_into_tensor"
        return self._submit(name, *self._all_gather_call(name, output_tensor, input_tensor, algorithm), async_op)

    def _all_gather_call(self, name: str, output, input, algorithm=None):
        output, input = self._view(output), self._view(input)
        self._ensure_open(name)
        dtype, src, count, dst, _, in_place = self._check_pair(name, output, input, GATHER)
        plan = self._plan(name, "all_gather", algorithm, self._message_bytes("all_gather", count, dtype),
                          in_place=in_place)
        return new_call(("all_gather", src, dst, count, dtype, None, plan)), [output], (input,)

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False, *, algorithm: Optional[str] = None):
        """In place: ``tensor = tensor on rank src`` on every rank (``src`` a rank of this
        communicator). Bytes are copied as they are, so every dtype works and every rank
        ends with the root's bits. ``algorithm``: "ring" (a chain from the root, pipelined
        over chunks), "tree" (binomial), "star" (every rank reads the root's copy, pipelined
        over chunks), "oneshot" (the same in one piece), a registered plan, "native" (the
        one-shot up to ``small_bytes``, the star above), or "auto": whichever auto's table
        prices lowest at this size, native where it holds nothing (CPU only)."""
        return self._rooted("broadcast", tensor, src, None, async_op, algorithm)

    def reduce(self, tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, async_op: bool = False, *,
               algorithm: Optional[str] = None):
        """In place on rank ``dst`` only: ``tensor = op(tensor on rank 0, ..., rank P-1)``
        there; every other rank's tensor is left as it was (NCCL's and gloo's contract says
        nothing of it; ringcoll guarantees it). The fold's order is the plan's: the chain
        ("ring") and the one-shot fold ``((x[dst-1] OP x[dst-2]) ...) OP x[dst]`` round the
        ring from the rank before ``dst`` (the same bits for both), "tree" up a binomial tree.
        ``algorithm`` as for :meth:`broadcast` (no star: its root would do every addition);
        "native": the one-shot up to ``small_bytes``, the chain above."""
        return self._rooted("reduce", tensor, dst, op, async_op, algorithm)

    def _rooted(self, name: str, tensor, root, op, async_op: bool, algorithm: Optional[str]):
        """broadcast and reduce: the root a rank of this communicator, the plan for it, then
        the plain binding (synchronous: it checks the tensor and the op itself, as the other
        plain calls do) or the checks here and a queued call."""
        check_root(name, "src" if name == "broadcast" else "dst", root, self.world_size)
        plain = self._transport.plain_calls
        if plain is not None and not async_op and not profiler_enabled():
            compiled = self._plain_plan(name, name, self.algorithm if algorithm is None else algorithm, tensor, root)
            if name == "broadcast":
                plain.broadcast_tensor(tensor, compiled)
            else:
                plain.reduce_tensor(tensor, op, compiled)
            return None
        tensor = self._view(tensor)
        self._ensure_open(name)
        dtype, address, count = self._check_tensor(name, "tensor", tensor)
        code = None if op is None else op_code(name, op, dtype)
        call = new_call((name, address, address, count, dtype, code,
                         self._plan(name, name, algorithm, self._message_bytes(name, count, dtype), root)))
        return self._submit(name, call, [tensor], (tensor,), async_op)

    # --- prepared (persistent) collectives -------------------------------------------------

    def prepare_all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM, *, output: Optional[torch.Tensor] = None,
                           algorithm: Optional[str] = None) -> "PreparedCollective":
        """all_reduce(tensor, op, output=output), validated now and run by calling the result
        as often as wanted: MPI-4's persistent collectives (MPI_Allreduce_init). For small
        messages in a loop, where the per-call checks cost as much as the ring step."""
        name = "prepare_all_reduce"
        return PreparedCollective(self, name, *self._all_reduce_call(name, tensor, op, output, algorithm))

    def prepare_reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, *,
                                      algorithm: Optional[str] = None) -> "PreparedCollective":
        """reduce_scatter_tensor(output, input, op), prepared (see prepare_all_reduce)."""
        name = "prepare_reduce_scatter_tensor"
        return PreparedCollective(self, name, *self._reduce_scatter_call(name, output, input, op, algorithm))

    def prepare_all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, *,
                                       algorithm: Optional[str] = None) -> "PreparedCollective":
        """all_gather_into_tensor(output_tensor, input_tensor), prepared (see prepare_all_reduce)."""
        name = "prepare_all_gather_into_tensor"
        return PreparedCollective(self, name, *self._all_gather_call(name, output_tensor, input_tensor, algorithm))

    def all_gather(self, tensor_list: list, tensor: torch.Tensor, async_op: bool = False, *,
                   algorithm: Optional[str] = None):
        """``tensor_list[r] = tensor on rank r``. Gathers into one flat buffer, then copies out."""
        name = "all_gather"
        tensor_list, tensor = self._view_list(tensor_list), self._view(tensor)
        self._ensure_open(name)
        dtype = self._check_list(name, "tensor_list", tensor_list, tensor)
        flat = tensor.new_empty(self.world_size * tensor.numel())
        call = _call("all_gather", tensor, flat, tensor.numel(), dtype, None,
                     self._plan(name, "all_gather", algorithm, flat.nbytes))
        return self._submit(name, call, list(tensor_list), (tensor, flat), async_op,
                            then=lambda: packing.split_into(flat, tensor_list))

    def reduce_scatter(self, output: torch.Tensor, input_list: list, op=ReduceOp.SUM, async_op: bool = False, *,
                       algorithm: Optional[str] = None):
        """``output = op over ranks of input_list[rank]``. Packs the list into one flat buffer."""
        name = "reduce_scatter"
        output, input_list = self._view(output), self._view_list(input_list)
        self._ensure_open(name)
        dtype = self._check_list(name, "input_list", input_list, output)
        code = op_code(name, op, dtype)
        # The packed copy is taken now, so output may alias an entry of input_list.
        flat = packing.concat(input_list)
        call = _call(name, flat, output, output.numel(), dtype, code,
                     self._plan(name, "reduce_scatter", algorithm, flat.nbytes))
        return self._submit(name, call, [output], (flat, *input_list), async_op)

    def all_gather_into_tensor_coalesced(self, outputs: list, inputs: list, async_op: bool = False, *,
                                         algorithm: Optional[str] = None):
        """all_gather_into_tensor for each (outputs[i], inputs[i]) pair, as one flat call
        (ringcoll/packing.py): what FSDP2 and the functional collectives issue."""
        name = "all_gather_into_tensor_coalesced"
        outputs, inputs = self._view_list(outputs), self._view_list(inputs)
        self._ensure_open(name)
        dtype = self._check_pairs(name, outputs, inputs, GATHER)
        flat_in = packing.concat(inputs)
        gathered = flat_in.new_empty(self.world_size * flat_in.numel())
        call = _call("all_gather", flat_in, gathered, flat_in.numel(), dtype, None,
                     self._plan(name, "all_gather", algorithm, gathered.nbytes))
        return self._submit(name, call, list(outputs), (flat_in, gathered), async_op,
                            then=lambda: packing.gathered_rows_into(gathered, outputs, self.world_size))

    def reduce_scatter_tensor_coalesced(self, outputs: list, inputs: list, op=ReduceOp.SUM,
                                        async_op: bool = False, *, algorithm: Optional[str] = None):
        """reduce_scatter_tensor for each (outputs[i], inputs[i]) pair, as one flat call."""
        name = "reduce_scatter_tensor_coalesced"
        outputs, inputs = self._view_list(outputs), self._view_list(inputs)
        self._ensure_open(name)
        dtype = self._check_pairs(name, outputs, inputs, SCATTER)
        code = op_code(name, op, dtype)
        flat_in = packing.chunks_by_rank(inputs, self.world_size)
        mine = flat_in.new_empty(flat_in.numel() // self.world_size)
        call = _call("reduce_scatter", flat_in, mine, mine.numel(), dtype, code,
                     self._plan(name, "reduce_scatter", algorithm, flat_in.nbytes))
        return self._submit(name, call, list(outputs), (flat_in, mine), async_op,
                            then=lambda: packing.split_into(mine, outputs))

    def barrier(self, async_op: bool = False):
        """Return once every rank of the group has entered the barrier (on CUDA: always
        synchronous, like NCCL's, and with ``async_op`` a Work already done: it returned
        None, where the CPU's is a Work, so ``barrier(async_op=True).wait()`` failed there)."""
        self._ensure_open("barrier")

        def submit():
            return self._transport.barrier(async_op)

        completion = submit_profiled("barrier", (), dict, submit)
        if completion is None and async_op:
            from ringcoll.transports.host import ThreadCompletion

            completion = ThreadCompletion.finished("barrier")
        return None if completion is None else Work(completion, [], ())

    # --- CuPy and other __cuda_array_interface__ arrays, on a given stream (CUDA only) ------

    def all_reduce_array(self, array, op=ReduceOp.SUM, *, output=None, stream: Optional[int] = None) -> None:
        """In place (or into ``output``): all-reduce of a CUDA array. ``stream``: a
        cudaStream_t as an int (CuPy: ``cupy.cuda.get_current_stream().ptr``); default torch's
        current stream."""
        src = as_device_array(array)
        dst = as_device_array(output) if output is not None else src
        check_count("all_reduce", dst, src.count)
        self._launch_array("all_reduce", src, dst, src.count, op, stream)

    def reduce_scatter_array(self, output, input, op=ReduceOp.SUM, *, stream: Optional[int] = None) -> None:
        src, dst = as_device_array(input), as_device_array(output)
        check_count("reduce_scatter", src, dst.count * self.world_size)
        self._launch_array("reduce_scatter", src, dst, dst.count, op, stream)

    def all_gather_array(self, output, input, *, stream: Optional[int] = None) -> None:
        src, dst = as_device_array(input), as_device_array(output)
        check_count("all_gather", dst, src.count * self.world_size)
        self._launch_array("all_gather", src, dst, src.count, None, stream)

    def _launch_array(self, name: str, src, dst, count: int, op, stream) -> None:
        self._ensure_open(name)
        if src.dtype != dst.dtype:
            raise TypeError(f"{name}: output dtype {dst.dtype} differs from input dtype {src.dtype}")
        dtype = dtype_code(name, src.dtype)
        code = None if name == "all_gather" else op_code(name, op, dtype)
        self._transport.launch_on_stream(CollectiveCall(name, src.ptr, dst.ptr, count, dtype, code), stream)

    def _view_list(self, tensors):
        """Each entry viewed (CUDA); anything but a list or tuple is left for _check_list to name."""
        return [self._view(t) for t in tensors] if isinstance(tensors, (list, tuple)) else tensors


class CudaCommunicator(Communicator):
    """``Communicator(device="cuda...")``, spelled as a class (default: the current CUDA
    device). Same methods; it only refuses a non-CUDA device."""

    def __init__(self, group=None, device=None, timeout=None, buffer_bytes=None, check=None, small_bytes=None,
                 direct_bytes=None, algorithm: Optional[str] = None):
        device = torch.device(device if device is not None else "cuda")
        if device.type != "cuda":
            raise ValueError(f"Communicator: CudaCommunicator serves CUDA devices, not {device}")
        super().__init__(group, device, timeout, buffer_bytes, check, small_bytes, direct_bytes, algorithm=algorithm)
