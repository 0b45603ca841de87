"""Module-level drop-ins for torch.distributed, one communicator per (group, device).

    import ringcoll
    ringcoll.all_reduce(t)                      # like dist.all_reduce(t)
    ringcoll.reduce_scatter_tensor(out, inp)    # like dist.reduce_scatter_tensor(out, inp)

The first call for a (group, device) builds that communicator, collectively: every rank of
the group must make its first ringcoll call on that group and device at the same point,
as with any collective. ``destroy_communicators()`` closes them all (also done at exit).
"""

from __future__ import annotations

import atexit

import torch
import torch.distributed as dist

from ringcoll._types import ReduceOp
from ringcoll.communicator import Communicator
from ringcoll.views import cuda_tensor_view

_communicators: dict = {}


def get_communicator(group=None, device="cpu") -> Communicator:
    """The cached communicator for (group, device), built on first use. A process group of
    the "ringcoll" backend (ringcoll/training/backend.py) already owns one: it is returned,
    not a second ring."""
    group = group if group is not None else dist.group.WORLD
    device = torch.device(device)
    if getattr(group, "owns_ringcoll_communicator", False):
        return group.communicator(device)
    key = (group, str(device))
    comm = _communicators.get(key)
    if comm is None:
        comm = Communicator(group=group, device=device)
        _communicators[key] = comm
    return comm


SERVED_DEVICE_TYPES = ("cpu", "cuda")


def _for_tensor(op: str, tensor, group) -> Communicator:
    """The communicator for `tensor`'s device; a device no transport serves is bad input."""
    if not isinstance(tensor, torch.Tensor):
        view = cuda_tensor_view(tensor)  # CuPy and other CUDA array producers go to their GPU's ring
        if view is not None:
            return get_communicator(group, view.device)
        return get_communicator(group, "cpu")  # the communicator's own validation names the problem
    if tensor.device.type not in SERVED_DEVICE_TYPES:
        raise ValueError(f"{op}: tensor is on {tensor.device}; ringcoll serves "
                         + " and ".join(SERVED_DEVICE_TYPES) + " tensors")
    return get_communicator(group, tensor.device)


def destroy_communicators() -> None:
    """Close every cached communicator (call before dist.destroy_process_group)."""
    while _communicators:
        _, comm = _communicators.popitem()
        comm.close()


atexit.register(destroy_communicators)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    return _for_tensor("all_reduce", tensor, group).all_reduce(tensor, op=op, async_op=async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    return _for_tensor("reduce_scatter_tensor", input, group).reduce_scatter_tensor(output, input, op=op, async_op=async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    return _for_tensor("all_gather_into_tensor", input_tensor, group).all_gather_into_tensor(output_tensor, input_tensor, async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    return _for_tensor("all_gather", tensor, group).all_gather(tensor_list, tensor, async_op=async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    return _for_tensor("reduce_scatter", output, group).reduce_scatter(output, input_list, op=op, async_op=async_op)


def barrier(group=None, async_op=False, device_ids=None):
    """Like dist.barrier; runs on the group's CPU communicator (device_ids is ignored)."""
    return get_communicator(group, "cpu").barrier(async_op=async_op)


# torch 2.13 renamed the tensor forms; both spellings are accepted there and here.
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor
