"""The Communicator: one ring of P ranks over one process group and one device.

Construction is collective (every rank of the group calls it, in the same order as every
other collective): each rank draws a name for its shared-memory segment, the names go
round with ``dist.all_gather_object`` on the group, and the extension creates, maps and
unlinks the segments (csrc/host/host_comm.cpp). After that no collective touches the
process group again.

Every method validates its arguments completely before any data moves, so bad input
raises ValueError / TypeError (message starting with the op name) and leaves the output
untouched. Collectives run on the calling thread; with ``async_op=True`` they run, in
call order, on one worker thread of the communicator and a :class:`Work` is returned.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import os
import threading
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ringcoll import _C
from ringcoll._types import ReduceOp, dtype_code, op_code
from ringcoll.errors import RingcollError

DEFAULT_TIMEOUT_SECONDS = 300.0
DEFAULT_BUFFER_BYTES = 4 << 20  # per rank; messages of any size are sliced through it
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


def _resolve_timeout(timeout) -> float:
    if timeout is None:
        timeout = os.environ.get("RINGCOLL_TIMEOUT", DEFAULT_TIMEOUT_SECONDS)
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    seconds = float(timeout)
    if not seconds > 0:
        raise ValueError(f"Communicator: timeout must be a positive number of seconds, got {timeout!r}")
    if not seconds <= MAX_TIMEOUT_SECONDS:  # also catches inf and nan
        raise ValueError(f"Communicator: timeout must be at most {MAX_TIMEOUT_SECONDS:g} s, got {timeout!r}: "
                         "ringcoll never waits without a bound")
    return seconds


def _resolve_check(check) -> bool:
    if check is None:
        return os.environ.get("RINGCOLL_CHECK", "1").strip().lower() not in ("0", "false", "off", "no")
    return bool(check)


def _resolve_buffer_bytes(buffer_bytes) -> int:
    if buffer_bytes is None:
        env = os.environ.get("RINGCOLL_BUFFER_BYTES")
        buffer_bytes = parse_bytes(env) if env else DEFAULT_BUFFER_BYTES
    return int(buffer_bytes)


class Work:
    """Handle of an async collective, like the object ``torch.distributed`` returns.

    ``wait()`` blocks until the collective finished and re-raises its error, if any.
    """

    def __init__(self, future: concurrent.futures.Future, result: list, keep_alive: Sequence = ()):
        self._future = future
        self._result = result  # the output tensors
        self._keep_alive = keep_alive  # inputs and scratch the extension reads by address

    def wait(self, timeout: Optional[float] = None) -> bool:
        self._future.result(timeout=timeout)
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self._future.exception() is None

    def exception(self):
        return self._future.exception() if self._future.done() else None

    def result(self) -> list:
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A torch Future completed with the output tensors (for DDP communication hooks)."""
        torch_future: torch.futures.Future = torch.futures.Future()

        def finish(done: concurrent.futures.Future) -> None:
            error = done.exception()
            if error is not None:
                torch_future.set_exception(error)
            else:
                torch_future.set_result(self._result)

        self._future.add_done_callback(finish)
        return torch_future


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, a1 = _byte_range(a)
    b0, b1 = _byte_range(b)
    return a0 < b1 and b0 < a1


class Communicator:
    """A ring over the ranks of ``group`` (the default group when None) for tensors on
    ``device`` (CPU: the shared-memory transport).

    ``timeout``: seconds (or a timedelta) any single wait may last before it raises
    RingcollTimeoutError; default ``RINGCOLL_TIMEOUT`` or 300. ``buffer_bytes``: size of each
    rank's registered buffer; default ``RINGCOLL_BUFFER_BYTES`` or 4 MiB. Larger messages
    are sliced through it. ``check``: compare every call's collective, dtype, op and size
    across ranks before moving data (RingcollMismatchError on every rank if they differ);
    default ``RINGCOLL_CHECK`` or on. It must be the same on all ranks.

    Usable as a context manager; ``close()`` releases the shared memory.
    """

    def __new__(cls, group=None, device=None, *args, **kwargs):
        # Communicator(device="cuda...") is the CUDA transport's subclass (ringcoll/cuda.py).
        if cls is Communicator and device is not None and torch.device(device).type == "cuda":
            from ringcoll.cuda import CudaCommunicator

            return super().__new__(CudaCommunicator)
        return super().__new__(cls)

    def __init__(self, group=None, device=None, timeout=None, buffer_bytes=None, check=None):
        device = torch.device(device if device is not None else "cpu")
        if device.type != "cpu":
            raise RingcollError(f"Communicator: no ringcoll transport for device {device} in this build; "
                                "the shared-memory transport serves CPU tensors")
        self._configure(group, device, timeout, buffer_bytes, check, slot_alignment=64)
        names = self._exchange(_C.random_segment_name())
        self._impl = _C.HostComm(self.rank, self.world_size, names, self.buffer_bytes, self.timeout, self.check)
        self._start()

    def _exchange(self, mine, **settings) -> list:
        """Send this rank's `mine` (segment name, IPC handle) round the group together with
        the settings every rank must share (the call check, the buffer size, and any the
        transport adds); returns every rank's `mine`. Raises ValueError, on every rank, if a
        setting differs: peers would otherwise read each other's buffers with different
        layouts."""
        settings = {"RINGCOLL_CHECK / check=": self.check, "RINGCOLL_BUFFER_BYTES / buffer_bytes=": self.buffer_bytes,
                    **settings}
        offers: list = [None] * self.world_size
        dist.all_gather_object(offers, (mine, settings), group=self.group)
        for name in settings:
            values = [theirs[name] for _, theirs in offers]
            if len(set(values)) != 1:
                raise ValueError(f"Communicator: {name} differs between ranks: "
                                 + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)))
        return [theirs for theirs, _ in offers]

    def _configure(self, group, device: torch.device, timeout, buffer_bytes, check, slot_alignment: int) -> None:
        """Settings every transport shares, validated before any rank allocates anything."""
        if not dist.is_initialized():
            raise RingcollError("Communicator: torch.distributed is not initialised; "
                                "call dist.init_process_group first")
        self.group = group if group is not None else dist.group.WORLD
        self.device = device
        self.timeout = _resolve_timeout(timeout)
        self.buffer_bytes = _resolve_buffer_bytes(buffer_bytes)
        self.check = _resolve_check(check)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        if self.rank < 0:
            raise ValueError("Communicator: this process is not a member of the given group")
        minimum = 2 * slot_alignment * self.world_size  # two banks of one aligned slot per rank
        if self.buffer_bytes < minimum:
            raise ValueError(f"Communicator: buffer_bytes={self.buffer_bytes} is too small for "
                             f"{self.world_size} ranks (minimum {minimum})")

    def _start(self) -> None:
        """Ready to run collectives: no async work queued yet."""
        self._worker: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._last_async: Optional[concurrent.futures.Future] = None
        self._lock = threading.Lock()  # one collective at a time on the ring
        self._closed = False

    # --- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Finish queued async work, then unmap the shared memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        with self._lock:
            self._impl.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:
            pass

    @property
    def broken(self) -> bool:
        return self._impl.broken

    # --- validation, one place ------------------------------------------------------------

    def _check_tensor(self, op: str, what: str, t) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {what} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != self.device and not (self.device.type == "cpu" and t.device.type == "cpu"):
            raise ValueError(f"{op}: {what} is on {t.device}, but this communicator serves {self.device}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {what} must be contiguous")
        dtype_code(op, t.dtype)

    def _check_pair(self, op: str, output: torch.Tensor, input: torch.Tensor, output_per_input: float) -> None:
        """Both tensors valid, same dtype, output.numel() == input.numel() * output_per_input,
        and either disjoint or output/input aliasing exactly this rank's chunk."""
        self._check_tensor(op, "output", output)
        self._check_tensor(op, "input", input)
        if output.dtype != input.dtype:
            raise TypeError(f"{op}: output dtype {output.dtype} differs from input dtype {input.dtype}")
        if output.numel() != input.numel() * output_per_input:
            if output_per_input >= 1:
                expected = f"world_size ({self.world_size}) x input size ({input.numel()}) = {int(input.numel() * output_per_input)}"
            else:
                expected = f"input size ({input.numel()}) / world_size ({self.world_size}) = {input.numel() / self.world_size:g}"
            raise ValueError(f"{op}: output has {output.numel()} elements, expected {expected}")
        whole, part = (output, input) if output_per_input >= 1 else (input, output)
        # In place means the smaller tensor is exactly this rank's chunk of the larger one
        # (for equal sizes: the same tensor).
        chunk_offset = 0 if output_per_input == 1 else self.rank * part.numel() * part.element_size()
        in_place = part.data_ptr() == whole.data_ptr() + chunk_offset
        if _overlaps(whole, part) and not in_place:
            raise ValueError(f"{op}: output and input overlap; in place, the smaller one must be exactly "
                             f"this rank's chunk (rank {self.rank}) of the larger one")

    def _ensure_open(self, op: str) -> None:
        if self._closed:
            raise RingcollError(f"{op}: communicator is closed")

    # --- running --------------------------------------------------------------------------

    def _run(self, call: Callable[[], None], outputs: list, keep_alive: Sequence, async_op: bool):
        """Run `call` now (sync) or queue it (async) behind earlier async work."""
        if not async_op:
            pending = self._last_async
            if pending is not None:
                concurrent.futures.wait([pending])  # keep call order; its error is its own
            with self._lock:
                call()
            return None
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ringcoll")

        def locked_call():
            with self._lock:
                call()

        future = self._worker.submit(locked_call)
        self._last_async = future
        # The closure holds every tensor the extension reads by address, until it has run.
        return Work(future, list(outputs), keep_alive)

    # --- the collectives ------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False, *,
                   output: Optional[torch.Tensor] = None):
        """In place: ``tensor = op(tensor on rank 0, ..., tensor on rank P-1)``.

        Reference: ``torch.stack(all_ranks_tensors).sum(0)`` for SUM (``/ P`` more for AVG).
        ``output`` (keyword, not in torch.distributed): write the result there instead and
        leave ``tensor`` unchanged, NCCL's out-of-place form.
        """
        name = "all_reduce"
        self._ensure_open(name)
        if output is None:
            self._check_tensor(name, "tensor", tensor)
            output = tensor
        else:
            self._check_pair(name, output, tensor, 1)
        dtype, code = dtype_code(name, tensor.dtype), op_code(name, op, tensor.dtype)
        src, dst, count = tensor.data_ptr(), output.data_ptr(), tensor.numel()
        return self._run(lambda: self._impl.all_reduce(src, dst, count, dtype, code), [output], (tensor,), async_op)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM,
                              async_op: bool = False):
        """``output = op over ranks of input.view(P, -1)[rank]``; input has P x output.numel()
        elements. In place when output is exactly chunk ``rank`` of input."""
        name = "reduce_scatter_tensor"
        self._ensure_open(name)
        self._check_pair(name, output, input, 1 / self.world_size)
        dtype, code = dtype_code(name, input.dtype), op_code(name, op, input.dtype)
        src, dst, count = input.data_ptr(), output.data_ptr(), output.numel()
        return self._run(lambda: self._impl.reduce_scatter(src, dst, count, dtype, code), [output], (input,), async_op)

    def all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                               async_op: bool = False):
        """``output_tensor.view(P, -1)[r] = input_tensor on rank r`` for every r. In place when
        input_tensor is exactly chunk ``rank`` of output_tensor."""
        name = "all_gather_into_tensor"
        self._ensure_open(name)
        self._check_pair(name, output_tensor, input_tensor, self.world_size)
        dtype = dtype_code(name, input_tensor.dtype)
        src, dst, count = input_tensor.data_ptr(), output_tensor.data_ptr(), input_tensor.numel()
        return self._run(lambda: self._impl.all_gather(src, dst, count, dtype), [output_tensor], (input_tensor,),
                         async_op)

    def all_gather(self, tensor_list: list, tensor: torch.Tensor, async_op: bool = False):
        """``tensor_list[r] = tensor on rank r``. Gathers into one flat buffer, then copies out."""
        name = "all_gather"
        self._ensure_open(name)
        self._check_list(name, "tensor_list", tensor_list, tensor)
        flat = torch.empty(self.world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        dtype, src, dst, count = dtype_code(name, tensor.dtype), tensor.data_ptr(), flat.data_ptr(), tensor.numel()

        def call():
            self._impl.all_gather(src, dst, count, dtype)
            for r, out in enumerate(tensor_list):
                out.copy_(flat[r * count:(r + 1) * count].view_as(out))

        return self._run(call, list(tensor_list), (tensor, flat), async_op)

    def reduce_scatter(self, output: torch.Tensor, input_list: list, op=ReduceOp.SUM, async_op: bool = False):
        """``output = op over ranks of input_list[rank]``. Packs the list into one flat buffer."""
        name = "reduce_scatter"
        self._ensure_open(name)
        self._check_list(name, "input_list", input_list, output)
        code = op_code(name, op, output.dtype)
        # The packed copy is taken now, so output may alias an entry of input_list.
        flat = torch.cat([t.reshape(-1) for t in input_list]) if input_list else output.new_empty(0)
        dtype, src, dst, count = dtype_code(name, output.dtype), flat.data_ptr(), output.data_ptr(), output.numel()
        return self._run(lambda: self._impl.reduce_scatter(src, dst, count, dtype, code), [output],
                         (flat, *input_list), async_op)

    def barrier(self, async_op: bool = False):
        """Return once every rank of the group has entered the barrier."""
        self._ensure_open("barrier")
        return self._run(self._impl.barrier, [], (), async_op)

    def _check_list(self, op: str, what: str, tensors, reference: torch.Tensor) -> None:
        self._check_tensor(op, "tensor" if what == "tensor_list" else "output", reference)
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(f"{op}: {what} must be a list of tensors, got {type(tensors).__name__}")
        if len(tensors) != self.world_size:
            raise ValueError(f"{op}: {what} has {len(tensors)} tensors, expected world_size = {self.world_size}")
        for i, t in enumerate(tensors):
            self._check_tensor(op, f"{what}[{i}]", t)
            if t.dtype != reference.dtype:
                raise TypeError(f"{op}: {what}[{i}] has dtype {t.dtype}, expected {reference.dtype}")
            if t.numel() != reference.numel():
                raise ValueError(f"{op}: {what}[{i}] has {t.numel()} elements, expected {reference.numel()}")
