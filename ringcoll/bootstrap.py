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

Every wait here is bounded: by the process group's timeout, or by the thread group's, and a
thread that fails breaks its group for the others at once (they raise instead of waiting).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from ringcoll.errors import RingcollError, RingcollPeerError, RingcollTimeoutError


class ProcessGroupBootstrap:
    """A torch.distributed process group (default: WORLD) as a ring's bootstrap."""

    def __init__(self, group=None):
        if not dist.is_initialized():
            raise RingcollError("Communicator: torch.distributed is not initialised; "
                                "call dist.init_process_group first (or use ringcoll.run_in_process)")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        if self.rank < 0:
            raise ValueError("Communicator: this process is not a member of the given group")

    def all_gather_object(self, mine: Any) -> list:
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        return everyone

    def barrier(self, timeout: Optional[float] = None) -> None:
        """Every rank of the group is here; within `timeout` seconds if given (raises
        otherwise), else the group's own timeout."""
        if timeout is None:
            dist.barrier(group=self.group)
        else:
            dist.barrier(group=self.group, async_op=True).wait(timeout=timedelta(seconds=timeout))


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

    def all_gather_object(self, mine: Any) -> list:
        group = self._group
        group._offers[self.rank] = mine
        group._wait(self.rank, "Communicator")  # every offer is in
        everyone = list(group._offers)
        group._wait(self.rank, "Communicator")  # every rank has read: the next round may overwrite
        return everyone

    def barrier(self, timeout: Optional[float] = None) -> None:
        self._group._wait(self.rank, "barrier", timeout)

    def __repr__(self) -> str:
        return f"InProcessRank(rank={self.rank}, world_size={self.world_size})"


def bootstrap_for(group):
    """The bootstrap behind a Communicator's ``group=``: an in-process rank as it is, else a
    torch.distributed process group (None: WORLD)."""
    return group if isinstance(group, InProcessRank) else ProcessGroupBootstrap(group)
