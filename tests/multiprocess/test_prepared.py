"""Prepared (persistent) collectives: Communicator.prepare_* checks a call once and runs it
many times (MPI-4's MPI_Allreduce_init and friends). The ranks are threads of one process
(ringcoll.run_in_process) over the shared-memory transport, plus one run as processes.

Each run must give exactly what the plain call gives on the values the tensors hold at that
moment; a tensor moved, resized or recast since it was prepared must be refused before
anything is written; the call check across ranks still applies.
"""

from __future__ import annotations

import pytest
import torch

import ringcoll
from ringcoll.harness.launcher import spawn


def _values(rank: int, n: int, round_: int, dtype) -> torch.Tensor:
    return ((torch.arange(n) * 3 + rank * 7 + round_ * 11) % 13).to(dtype)


def _prepared_rounds(group, n: int, buffer_bytes, dtype) -> list[str]:
    """Three rounds of each prepared collective, both forms, inputs rewritten in place between
    rounds; each result compared with the plain call on a copy of the same values."""
    rank, world = group.rank, group.world_size
    wrong = []
    with ringcoll.Communicator(group=group, buffer_bytes=buffer_bytes) as comm:
        x, out = torch.empty(n * world, dtype=dtype), torch.empty(n * world, dtype=dtype)
        shard, gathered = torch.empty(n, dtype=dtype), torch.empty(n * world, dtype=dtype)
        runs = {
            "all_reduce out": (comm.prepare_all_reduce(x, output=out), lambda: out,
                               lambda: _plain_all_reduce(comm, x)),
            "all_reduce in": (comm.prepare_all_reduce(x), lambda: x, lambda: _plain_all_reduce(comm, x)),
            "reduce_scatter out": (comm.prepare_reduce_scatter_tensor(shard, x), lambda: shard,
                                   lambda: _plain_reduce_scatter(comm, x, n)),
            "reduce_scatter in": (comm.prepare_reduce_scatter_tensor(x.view(world, -1)[rank], x),
                                  lambda: x.view(world, -1)[rank], lambda: _plain_reduce_scatter(comm, x, n)),
            "all_gather out": (comm.prepare_all_gather_into_tensor(gathered, shard), lambda: gathered,
                               lambda: _plain_all_gather(comm, shard, n)),
        }
        for round_ in range(3):
            for name, (run, result, plain) in runs.items():
                x.copy_(_values(rank, n * world, round_, dtype))
                shard.copy_(_values(rank, n, round_, dtype))
                expected = plain()
                run()
                if not torch.equal(result(), expected):
                    wrong.append(f"rank {rank} {name} round {round_} world {world} n {n} {dtype}")
    return wrong


def _plain_all_reduce(comm, x):
    y = x.clone()
    comm.all_reduce(y)
    return y


def _plain_reduce_scatter(comm, x, n):
    y = torch.empty(n, dtype=x.dtype)
    comm.reduce_scatter_tensor(y, x.clone())
    return y


def _plain_all_gather(comm, shard, n):
    y = torch.empty(n * comm.world_size, dtype=shard.dtype)
    comm.all_gather_into_tensor(y, shard.clone())
    return y


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_prepared_runs_match_the_plain_calls(world, dtype):
    # 1 and 999 elements per rank: the one-shot path; 3000 through a 4 KiB buffer: the ring, sliced.
    wrong = []
    for n, buffer_bytes in ((1, None), (999, None), (3000, 4096)):
        wrong += sum(ringcoll.run_in_process(world, _prepared_rounds, n, buffer_bytes, dtype, timeout=60), [])
    assert not wrong, wrong[:5]


def test_a_prepared_async_run_is_waited_on():
    def body(group):
        with ringcoll.Communicator(group=group) as comm:
            t = torch.full((100,), float(group.rank + 1))
            run = comm.prepare_all_reduce(t)
            work = run(async_op=True)
            work.wait()
            first = t.clone()
            run()  # a synchronous run after an async one waits for it first
            return first, t

    for first, second in ringcoll.run_in_process(2, body, timeout=60):
        assert torch.equal(first, torch.full((100,), 3.0)) and torch.equal(second, torch.full((100,), 6.0))


@pytest.mark.parametrize("change", ["resize", "repoint", "recast"])
def test_a_tensor_changed_since_prepared_is_refused_before_anything_moves(change):
    def body(group):
        with ringcoll.Communicator(group=group) as comm:
            t = torch.ones(64)
            out = torch.full((64,), -7.0)
            run = comm.prepare_all_reduce(t, output=out)
            if change == "resize":
                t.resize_(32)
            elif change == "repoint":
                t.data = torch.ones(64)
            else:
                t.data = t.data.view(torch.int32)
            with pytest.raises(ValueError, match="prepare_all_reduce: a tensor of this prepared call changed"):
                run()
            return out

    for out in ringcoll.run_in_process(2, body, timeout=60):
        assert torch.all(out == -7.0), "the refused run wrote its output"


def test_bad_arguments_are_refused_when_prepared():
    def body(group):
        with ringcoll.Communicator(group=group) as comm:
            with pytest.raises(ValueError, match="prepare_reduce_scatter_tensor: output has 3 elements"):
                comm.prepare_reduce_scatter_tensor(torch.empty(3), torch.empty(8))
            with pytest.raises(TypeError, match="prepare_all_gather_into_tensor: output dtype"):
                comm.prepare_all_gather_into_tensor(torch.empty(8, dtype=torch.int32), torch.empty(4))
            with pytest.raises(ValueError, match="prepare_all_reduce: .*AVG"):
                comm.prepare_all_reduce(torch.ones(4, dtype=torch.int32), op=ringcoll.ReduceOp.AVG)
            run = comm.prepare_all_reduce(torch.ones(4))
        with pytest.raises(ringcoll.RingcollError, match="prepare_all_reduce: communicator is closed"):
            run()
        return True

    assert ringcoll.run_in_process(2, body, timeout=60) == [True, True]


def _mismatched(rank, world):
    with ringcoll.Communicator() as comm:
        t = torch.full((64 if rank == 0 else 65,), -7.0)
        run = comm.prepare_all_reduce(t)
        with pytest.raises(ringcoll.RingcollMismatchError):
            run()
        return bool(torch.all(t == -7.0))


def test_the_call_check_applies_to_prepared_runs_across_processes():
    assert spawn(_mismatched, 2) == [True, True]
