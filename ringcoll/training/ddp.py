"""A DDP communication hook that all-reduces gradient buckets with ringcoll.

    import ringcoll
    model = DistributedDataParallel(model)                  # any backend, e.g. gloo
    model.register_comm_hook(ringcoll.training.ddp.RingcollHookState(), ringcoll.ddp_hook)
    # or, like torch's default_hooks.allreduce_hook: model.register_comm_hook(None, ringcoll.ddp_hook)

DDP calls the hook once per gradient bucket, as soon as the bucket's gradients are ready
during backward. The hook starts a ringcoll all-reduce of ``bucket.buffer()`` on the
communicator's worker thread (``async_op=True``) and returns at once with a
``torch.futures.Future`` of the averaged bucket, so DDP's bucketing and its overlap of
communication with the rest of backward are kept. The average is ``ReduceOp.AVG``: the sum
over ranks, then one division by the world size, done by ringcoll (every rank gets bitwise
the same result); integer buckets, which DDP does not make in practice, are summed and
floor-divided.

Reference computation: ``bucket.buffer() = sum over ranks of bucket.buffer() / world_size``.
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook compares the
# hook's annotations with dist.GradBucket and torch.futures.Future[torch.Tensor] as objects.
from typing import Optional

import torch
import torch.distributed as dist

from ringcoll._types import FLOATING_DTYPES, ReduceOp
from ringcoll.api import get_communicator

__all__ = ["RingcollHookState", "ddp_hook"]


class RingcollHookState:
    """State for :func:`ddp_hook`: the ranks to average over (``group``; None is the default
    group; it must hold the same ranks as DDP's process group) and the ringcoll communicator
    for the device the model's gradients are on (``device``: "cpu", or "cuda" for the current
    GPU's CUDA ring).

    The communicator is built when the state is (collectively: every rank constructs its
    state at the same point), so the first backward does not pay for it. On a process
    group of the "ringcoll" backend the group's own communicator is reused. ``calls``
    counts the buckets the hook has started.
    """

    def __init__(self, group=None, communicator=None, device="cpu"):
        self.group = group
        self.communicator = communicator if communicator is not None else _communicator_for(group, device)
        self.calls = 0

    def __repr__(self) -> str:
        return f"RingcollHookState(group={self.group!r}, world_size={self.communicator.world_size})"


def _communicator_for(group, device):
    return get_communicator(group, device)  # on a "ringcoll" group: the group's own ring


def _state_communicator(state: Optional[object], bucket: dist.GradBucket):
    """The communicator for the bucket's device; the state is checked before the bucket is read."""
    if not (state is None or isinstance(state, (RingcollHookState, dist.ProcessGroup))):
        raise TypeError(f"ddp_hook: state must be a ringcoll.training.ddp.RingcollHookState, a ProcessGroup or None, "
                        f"got {type(state).__name__}")
    tensor = bucket.buffer()
    if isinstance(state, RingcollHookState):
        state.calls += 1
        served = state.communicator.device
        if tensor.device != served and not (served.type == tensor.device.type == "cpu"):
            raise ValueError(f"ddp_hook: the bucket is on {tensor.device}, but the hook state's communicator "
                             f"serves {served}: make it with RingcollHookState(device={str(tensor.device)!r})")
        return state.communicator
    return _communicator_for(state, tensor.device)


def ddp_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce ``bucket.buffer()`` with ringcoll, asynchronously; the Future resolves to the
    averaged bucket (same tensor, in place)."""
    comm = _state_communicator(state, bucket)
    tensor = bucket.buffer()
    if tensor.dtype in FLOATING_DTYPES:
        work = comm.all_reduce(tensor, op=ReduceOp.AVG, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    work = comm.all_reduce(tensor, op=ReduceOp.SUM, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0].div_(comm.world_size, rounding_mode="floor"))
