"""Module-level drop-ins for torch.distributed, one communicator per (group, device).

    import ringcoll
    ringcoll.all_reduce(t)                      # like dist.all_reduce(t)
    ringcoll.reduce_scatter_tensor(out, inp)    # like dist.reduce_scatter_tensor(out, inp)

The first call for a (group, device) builds that communicator, collectively: every rank of
the group must make its first ringcoll call on that group and device at the same point,
as with any collective. ``destroy_communicators()`` closes them all (also done at exit).

``run_in_process(P, fn)`` is the launcher of the other run mode: P ranks as threads of this
process, no torch.distributed (ringcoll/bootstrap.py).
"""

from __future__ import annotations

import atexit
import os
import threading
import warnings
from typing import Any, Callable, List

import torch
import torch.distributed as dist

from ringcoll._types import ReduceOp
from ringcoll.bootstrap import InProcessGroup
from ringcoll.communicator import Communicator, resolve_timeout
from ringcoll.transports.cuda import IN_PROCESS_HARDWARE_QUEUES
from ringcoll.views import cuda_tensor_view

_communicators: dict = {}
# get_communicator's device argument -> (torch.device, its name in _communicators' keys):
# building a torch.device and its name costs ~1 us, a third of a small call.
_devices: dict = {}


def get_communicator(group=None, device="cpu") -> Communicator:
    """The cached communicator for (group, device), built on first use. A process group of
    the "ringcoll" backend (ringcoll/training/backend.py) already owns one: it is returned,
    not a second ring."""
    group = group if group is not None else dist.group.WORLD
    known = _devices.get(device)
    if known is None:
        known = _devices[device] = (torch.device(device), str(torch.device(device)))
    device, name = known
    comm = _communicators.get((group, name))
    if comm is not None:
        return comm
    if getattr(group, "owns_ringcoll_communicator", False):  # never cached here: its group owns it
        return group.communicator(device)
    comm = _communicators[(group, name)] = Communicator(group=group, device=device)
    return comm


SERVED_DEVICE_TYPES = ("cpu", "cuda")


class _NotAMember:
    """What a collective runs on where this process is not in its group: torch.distributed
    warns and does nothing (returns None), so a script may call it on every rank; so does
    ringcoll. (torch hands a non-member GroupMember.NON_GROUP_MEMBER for the group.)"""

    def __init__(self, op: str):
        self._op = op

    def __getattr__(self, method: str):
        return self._skip

    def _skip(self, *args, **kwargs) -> None:
        warnings.warn(f"Running {self._op} on global rank {dist.get_rank()} which does not belong to the given group.",
                      stacklevel=3)


def _not_a_member(group) -> bool:
    return isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER


def _for_tensor(op: str, tensor, group) -> Communicator:
    """The communicator for `tensor`'s device; a device no transport serves is bad input."""
    if group is not None and _not_a_member(group):
        return _NotAMember(op)
    if not isinstance(tensor, torch.Tensor):
        view = cuda_tensor_view(tensor)  # CuPy and other CUDA array producers go to their GPU's ring
        if view is not None:
            return get_communicator(group, view.device)
        return get_communicator(group, "cpu")  # the communicator's own validation names the problem
    if tensor.is_cpu:  # the common case, without reading tensor.device (~0.5 us)
        return get_communicator(group, "cpu")
    if tensor.device.type not in SERVED_DEVICE_TYPES:
        raise ValueError(f"{op}: tensor is on {tensor.device}; ringcoll serves "
                         + " and ".join(SERVED_DEVICE_TYPES) + " tensors")
    return get_communicator(group, tensor.device)


def empty(*size, dtype=None, group=None, device="cpu") -> torch.Tensor:
    """``torch.empty`` in symmetric memory of (group, device)'s communicator: collectives over
    such tensors read peers' memory in place (Communicator.empty says the rules). Collective."""
    return _symmetric_communicator(group, device).empty(*size, dtype=dtype)


def zeros(*size, dtype=None, group=None, device="cpu") -> torch.Tensor:
    """``empty``, filled with zeros. Collective."""
    return _symmetric_communicator(group, device).zeros(*size, dtype=dtype)


def _symmetric_communicator(group, device) -> Communicator:
    comm = get_communicator(group, device)
    if not isinstance(comm, Communicator):  # the two-level one of a group across machines
        raise RuntimeError("empty: symmetric memory needs every rank of the group on one machine (it is memory "
                           f"they all map); this group's communicator is a {type(comm).__name__}")
    return comm


def destroy_communicators() -> None:
    """Close every cached communicator (call before dist.destroy_process_group)."""
    while _communicators:
        _, comm = _communicators.popitem()
        comm.close()


atexit.register(destroy_communicators)


# ``algorithm`` (keyword, not in torch.distributed): the call's algorithm, a name from
# ringcoll.algorithms() or one registered with ringcoll.register_algorithm; by default the
# communicator's (RINGCOLL_ALGORITHM, else "auto").


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm=None):
    return _for_tensor("all_reduce", tensor, group).all_reduce(tensor, op, async_op, algorithm=algorithm)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm=None):
    return _for_tensor("reduce_scatter_tensor", input, group).reduce_scatter_tensor(output, input, op, async_op,
                                                                                    algorithm=algorithm)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False, *, algorithm=None):
    return _for_tensor("all_gather_into_tensor", input_tensor, group).all_gather_into_tensor(
        output_tensor, input_tensor, async_op, algorithm=algorithm)


def all_gather(tensor_list, tensor, group=None, async_op=False, *, algorithm=None):
    return _for_tensor("all_gather", tensor, group).all_gather(tensor_list, tensor, async_op=async_op,
                                                               algorithm=algorithm)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm=None):
    return _for_tensor("reduce_scatter", output, group).reduce_scatter(output, input_list, op=op, async_op=async_op,
                                                                       algorithm=algorithm)


def _group_rank(op: str, group, rank, group_rank, names: tuple) -> int:
    """A root as torch.distributed names it: ``rank`` in the default group, or ``group_rank``
    in ``group`` (exactly one of them), as the group's own number. The in-process groups of
    run_in_process have no default group: there the two are one."""
    global_name, group_name = names
    if (rank is None) == (group_rank is None):
        raise ValueError(f"{op}: give exactly one of {global_name}= (a rank of the default group) and {group_name}= "
                         f"(a rank of group), got {global_name}={rank!r}, {group_name}={group_rank!r}")
    if group_rank is not None:
        return group_rank
    if group is None or group is dist.group.WORLD or not isinstance(group, dist.ProcessGroup):
        return rank
    return dist.get_group_rank(group, rank)


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None, *, algorithm=None):
    """Like dist.broadcast: ``src`` a rank of the default group, or ``group_src`` one of ``group``."""
    root = _group_rank("broadcast", group, src, group_src, ("src", "group_src"))
    return _for_tensor("broadcast", tensor, group).broadcast(tensor, root, async_op, algorithm=algorithm)


def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None, *, algorithm=None):
    """Like dist.reduce: ``dst`` a rank of the default group, or ``group_dst`` one of ``group``."""
    root = _group_rank("reduce", group, dst, group_dst, ("dst", "group_dst"))
    return _for_tensor("reduce", tensor, group).reduce(tensor, root, op, async_op, algorithm=algorithm)


def barrier(group=None, async_op=False, device_ids=None):
    """Like dist.barrier; runs on the group's CPU communicator (device_ids is ignored)."""
    comm = _NotAMember("barrier") if _not_a_member(group) else get_communicator(group, "cpu")
    return comm.barrier(async_op=async_op)


# torch 2.13 renamed the tensor forms; both spellings are accepted there and here.
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor


def run_in_process(world_size: int, fn: Callable[..., Any], *args, timeout=None) -> List[Any]:
    """Run ``fn(group, *args)`` on ``world_size`` threads of this process, one per rank, and
    return their results in rank order. Each thread builds its own ``Communicator(group=group,
    device=...)`` and uses it as one process of a torch.distributed group would. If a rank
    raises, the others' bootstrap waits stop at once and their collectives give up within
    the communicators' timeout; the error of the rank that failed first is raised here.

    ``timeout``: seconds (or timedelta) a bootstrap wait may last; default RINGCOLL_TIMEOUT
    or 300, like the communicators'. Every wait inside a communicator is bounded by its own
    timeout, so this returns once ``fn`` does on every rank.

    On CUDA the ranks share one GPU: each rank's work goes on a stream of its own (a CUDA
    communicator built on the shared default stream moves its rank onto its own), and
    CUDA_DEVICE_MAX_CONNECTIONS is raised to 32 if CUDA has not started yet (it is read
    then), so no two ranks' streams share a hardware queue (ringcoll/transports/cuda.py)."""
    if not torch.cuda.is_initialized():
        # Read once, when CUDA starts: a hardware queue for every rank's stream, so no two
        # ranks' streams are falsely ordered (ringcoll/transports/cuda.py's module doc).
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", str(IN_PROCESS_HARDWARE_QUEUES))
    group = InProcessGroup(world_size, resolve_timeout(timeout))
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def rank_main(rank: int) -> None:
        try:
            results[rank] = fn(group.rank_handle(rank), *args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            errors[rank] = e
            group.fail(rank)

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"ringcoll-rank-{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [r for r in range(world_size) if errors[r] is not None]
    if failed:
        # The rank that broke the group is the cause; the others' errors only say they stopped.
        first = group.failed_rank if group.failed_rank in failed else failed[0]
        error = errors[first]
        error.add_note(f"(in rank {first} of run_in_process; ranks that failed: {failed})")
        raise error
    return results
