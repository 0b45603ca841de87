"""The plain tensor forms on a CPU communicator (all_reduce, reduce_scatter_tensor,
all_gather_into_tensor, synchronous) are checked and run in one binding call
(csrc/bindings/bind_host.cpp); every other call goes through the Python layers, with the same
checks (csrc/bindings/tensor_checks.h). These tests hold the two entry points to one
behaviour: the same errors, word for word; calls behind queued async work still wait for it;
a closed communicator refuses them. The results themselves are checked against gloo, every
dtype and size, in test_collectives.py, which goes through the binding by default.

The ranks are threads of one process (ringcoll.run_in_process): the binding releases the GIL
while the ring runs, which threads need to meet at all.
"""

from __future__ import annotations

import pytest
import torch

import ringcoll

WORLD = 2


def _refusal(call) -> tuple:
    """(exception type, message) of a call that must be refused, or the call's result."""
    try:
        call()
    except (TypeError, ValueError, ringcoll.RingcollError) as e:
        return type(e), str(e)
    return "not refused", None


def test_the_binding_and_the_python_path_refuse_alike():
    """Each bad call, once synchronous (the binding) and once async (checked in Python before
    it is queued), is refused with the same exception and message, and moves nothing."""

    def body(group):
        rank, world = group.rank, group.world_size
        f32, n = torch.float32, 4
        with ringcoll.Communicator(group=group) as comm:
            whole = torch.full((world * n,), -7.0)
            ones, empty, AVG = torch.ones, torch.empty, ringcoll.ReduceOp.AVG
            # (method, args, keywords): each refused the same way, synchronous or async.
            bad = [
                ("all_reduce", (ones(n, dtype=torch.bool),), {}),
                ("all_reduce", (ones(2 * n)[::2],), {}),
                ("all_reduce", ([1.0],), {}),
                ("all_reduce", (ones(n, dtype=torch.int32),), {"op": AVG}),
                ("all_reduce", (ones(n),), {"op": "bxor"}),
                ("all_reduce", (ones(n),), {"output": empty(n + 1)}),
                ("all_reduce", (ones(n),), {"output": empty(n, dtype=torch.float64)}),
                ("all_reduce", (whole[:n],), {"output": whole[1:n + 1]}),
                ("reduce_scatter_tensor", (empty(n), ones(world * n + 1)), {}),
                ("reduce_scatter_tensor", (empty(n, dtype=torch.int32), whole), {}),
                ("reduce_scatter_tensor", (whole[(rank + 1) % world * n:][:n] if world > 1 else whole[1:], whole), {}),
                ("reduce_scatter_tensor", (empty(n, dtype=torch.complex64), ones(world * n, dtype=torch.complex64)), {}),
                ("all_gather_into_tensor", (empty(world * n - 1), ones(n)), {}),
                ("all_gather_into_tensor", (empty(world * n), ones(2 * n, dtype=f32)[::2]), {}),
                ("all_gather_into_tensor", (empty(world * n), ones(n, device="meta")), {}),
                ("all_gather_into_tensor", (whole, whole[1:n + 1]), {}),
            ]
            differences = []
            for name, args, keywords in bad:
                method = getattr(comm, name)
                first = _refusal(lambda: method(*args, **keywords))
                second = _refusal(lambda: method(*args, **keywords, async_op=True))
                if first[0] == "not refused" or first != second:
                    differences.append(f"{name}{args!r} {keywords!r}: binding {first}, python {second}")
            assert torch.all(whole == -7.0), "a refused call wrote"
            assert not comm.broken
            return differences

    for differences in ringcoll.run_in_process(WORLD, body, timeout=60):
        assert differences == []


def test_a_plain_call_behind_queued_work_waits_for_it():
    """An async all-reduce is queued, then a synchronous one: the second goes through the
    queue (the binding would run it at once, ahead of the first, on one rank and not on
    another), so when it returns the first has finished too; once the queue is drained, the
    plain calls take the binding again."""

    def body(group):
        rank, world = group.rank, group.world_size
        with ringcoll.Communicator(group=group) as comm:
            transport = comm.transport
            assert transport.plain_calls is not None
            big, small = torch.full((4 << 20,), float(rank + 1)), torch.full((16,), float(rank + 1))
            work = comm.all_reduce(big, async_op=True)
            assert transport.plain_calls is None, "plain calls offered while work is queued"
            comm.all_reduce(small)
            finished_first = work.is_completed()
            work.wait()
            assert transport.plain_calls is not None, "plain calls not offered again once the queue drained"
            total = sum(range(1, world + 1))
            comm.all_reduce(small)
            return finished_first, bool(torch.all(big == total)), bool(torch.all(small == total * world))

    for finished_first, big_ok, small_ok in ringcoll.run_in_process(WORLD, body, timeout=60):
        assert finished_first and big_ok and small_ok


@pytest.mark.parametrize("form", ["all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor"])
def test_a_closed_communicator_refuses_plain_calls(form):
    def body(group):
        world = group.world_size
        comm = ringcoll.Communicator(group=group)
        comm.close()
        t = torch.full((world * 2,), -7.0)
        args = {"all_reduce": (t,), "reduce_scatter_tensor": (t[:2].clone(), t),
                "all_gather_into_tensor": (t, t[:2].clone())}[form]
        with pytest.raises(ringcoll.RingcollError, match=rf"^{form}: communicator is closed$"):
            getattr(comm, form)(*args)
        return bool(torch.all(t == -7.0))

    assert ringcoll.run_in_process(WORLD, body, timeout=60) == [True] * WORLD
