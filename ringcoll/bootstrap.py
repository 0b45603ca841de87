"""How the ranks of a ring find each other before the ring exists: the bootstrap.

Building a communicator needs three things from its group, and nothing after that: this
rank and the world size, one all-gather of small Python objects (segment names or IPC
handles, with the settings every rank must share), and a barrier (on CUDA: every rank has
mapped every peer before anyone may free its buffer). Two things provide them::

    ProcessGroupBootstrap   P processes joined by a torch.distributed process group: the
                            product, and the correctness reference
    InProcessGroup          P threads of ONE process (ringcoll.run_in_process, in api.py):
                            the same transports and kernels, peers' buffers reached by
                            plain pointers

Why a second mode. Kernels of different processes on one GPU are time-sliced unless an MPS
server runs: a ring step then waits up to a whole timeslice for its neighbour, and a
one-GPU benchmark measures the scheduler. Kernels of one process on several streams run
side by side, so P rings of one process are co-resident: that is what the in-process mode
gives the one-GPU benchmark (docs/cuda.md says which figure comes from which mode). On the
CPU it runs the shared-memory transport unchanged, and the CUDA kernels through the
emulator (transports/emulated.py): that is how CI tests it.

Every wait here is bounded by the communicator's timeout (the process group's own, 30
minutes by default, only where no communicator gives one), in steps Ctrl-C can interrupt;
a thread that fails breaks its in-process group for the others at once (they raise
instead of waiting).
"""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from ringcoll.errors import RingcollError, RingcollPeerError, RingcollTimeoutError


class ProcessGroupBootstrap:
    """A torch.distributed process group (default: WORLD) as a ring's bootstrap. `timeout`:
    the seconds each exchange may wait for the other ranks (the communicator's; None: the
    group's own)."""

    def __init__(self, group=None, timeout: Optional[float] = None):
        if not dist.is_initialized():
            raise RingcollError("Communicator: torch.distributed is not initialised; "
                                "call dist.init_process_group first (or use ringcoll.run_in_process)")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        if self.rank < 0:
            raise ValueError("Communicator: this process is not a member of the given group")
        self.timeout = timeout

    def all_gather_object(self, mine: Any, what: str = "Communicator") -> list:
        """Every rank's `mine`, in rank order: torch's all_gather_object in its two steps (the
        pickles' sizes, then the pickles, padded to the longest), each waited for as
        _wait does. torch's own waited for the group's timeout, in C++: a rank that never
        constructed its communicator held the others 30 minutes, deaf to Ctrl-C."""
        device = _object_device(self.group)
        pickled = torch.frombuffer(bytearray(pickle.dumps(mine)), dtype=torch.uint8).to(device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.world_size)]
        mine_size = torch.tensor([pickled.numel()], dtype=torch.int64, device=device)
        self._wait(dist.all_gather(sizes, mine_size, group=self.group, async_op=True), what)
        sizes = [int(size.item()) for size in sizes]
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
        padded[:pickled.numel()] = pickled
        rows = [torch.empty_like(padded) for _ in range(self.world_size)]
        self._wait(dist.all_gather(rows, padded, group=self.group, async_op=True), what)
        return [pickle.loads(row[:size].cpu().numpy().tobytes()) for row, size in zip(rows, sizes)]

    def barrier(self, timeout: Optional[float] = None) -> None:
        """Every rank of the group is here; within `timeout` seconds if given, else the
        bootstrap's (RingcollTimeoutError past it)."""
        self._wait(dist.barrier(group=self.group, async_op=True), "barrier", timeout)

    def _wait(self, work, what: str, timeout: Optional[float] = None) -> None:
        """Wait for `work`, a collective of the group, at most `timeout` (default: the
        bootstrap's; None: the group's own): polled with naps, so Ctrl-C interrupts it."""
        timeout = self.timeout if timeout is None else timeout
        if timeout is None:
            work.wait()
            return
        deadline, nap = time.monotonic() + timeout, 1e-4
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise RingcollTimeoutError(
                    f"{what}: rank {self.rank} waited {timeout:g} s (the communicator's timeout) for the other "
                    f"{self.world_size - 1} ranks of its group to join it: some rank has not come (not started, "
                    "exited, or making another call); the group still holds this exchange, so use a new one")
            time.sleep(nap)
            nap = min(2 * nap, 0.01)
        work.wait()  # raises what the group raised (a peer that closed its connection)


def _object_device(group) -> torch.device:
    """Where the group's collectives take their tensors: the CPU, except for a group whose
    only backend is NCCL (its current CUDA device), as torch's object collectives choose."""
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class InProcessGroup:
    """P ranks as P threads of this process. ``group.rank_handle(r)`` is what rank r's thread
    passes as ``Communicator(group=...)``; :func:`run_in_process` makes the group and the
    threads. Waits give up after ``timeout`` seconds (RingcollTimeoutError), and at once
    (RingcollPeerError) when another rank has broken the group by failing."""

    def __init__(self, world_size: int, timeout: float):
        if world_size < 1:
            raise ValueError(f"run_in_process: world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self._everyone_here = threading.Barrier(world_size)
        self._offers: list = [None] * world_size
        self.failed_rank: Optional[int] = None

    def rank_handle(self, rank: int) -> "InProcessRank":
        if not 0 <= rank < self.world_size:
            raise ValueError(f"run_in_process: rank {rank} is outside 0..{self.world_size - 1}")
        return InProcessRank(self, rank)

    def fail(self, rank: int) -> None:
        """Rank `rank` gave up: every rank waiting in the bootstrap, now or later, raises."""
        if self.failed_rank is None:
            self.failed_rank = rank
        self._everyone_here.abort()

    def _wait(self, rank: int, what: str, timeout: Optional[float] = None) -> None:
        timeout = self.timeout if timeout is None else timeout
        try:
            self._everyone_here.wait(timeout)
        except threading.BrokenBarrierError:
            if self.failed_rank is not None:
                raise RingcollPeerError(f"{what}: rank {self.failed_rank} of the in-process group failed, "
                                        f"so rank {rank} stops waiting for it") from None
            self.fail(rank)  # a timeout breaks the barrier for the others too
            raise RingcollTimeoutError(f"{what}: rank {rank} waited {timeout:g} s for the other "
                                       f"{self.world_size - 1} ranks of its in-process group") from None


class InProcessRank:
    """Rank ``rank`` of an :class:`InProcessGroup`: the bootstrap one rank's thread uses."""

    def __init__(self, group: InProcessGroup, rank: int):
        self._group = group
        self.rank = rank
        self.world_size = group.world_size

    def all_gather_object(self, mine: Any, what: str = "Communicator") -> list:
        group = self._group
        group._offers[self.rank] = mine
        group._wait(self.rank, what)  # every offer is in
        everyone = list(group._offers)
        group._wait(self.rank, what)  # every rank has read: the next round may overwrite
        return everyone

    def barrier(self, timeout: Optional[float] = None) -> None:
        self._group._wait(self.rank, "barrier", timeout)

    def __repr__(self) -> str:
        return f"InProcessRank(rank={self.rank}, world_size={self.world_size})"


def bootstrap_for(group, timeout: Optional[float] = None):
    """The bootstrap behind a Communicator's ``group=``: an in-process rank as it is (its
    group's timeout), else a torch.distributed process group (None: WORLD) whose exchanges
    wait at most `timeout` seconds."""
    return group if isinstance(group, InProcessRank) else ProcessGroupBootstrap(group, timeout)
