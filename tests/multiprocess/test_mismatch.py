"""Mismatched calls are an error on every rank, before any data moves."""

import pytest
import torch

from ringcoll.harness.launcher import spawn


def _call(comm, kind, rank, world):
    """Run one call of the given kind."""
    import ringcoll

    n = 64
    if kind == "all_reduce":
        out = torch.full((n,), -7.0)
        comm.all_reduce(out)  # in place: the sentinel is its input, must come back unchanged
        return out
    if kind == "all_reduce_int":
        out = torch.full((n,), -7, dtype=torch.int32)
        comm.all_reduce(out)
        return out
    if kind == "all_reduce_max":
        out = torch.full((n,), -7.0)
        comm.all_reduce(out, op=ringcoll.ReduceOp.MAX)
        return out
    if kind == "all_reduce_short":
        out = torch.full((n - 1,), -7.0)
        comm.all_reduce(out)
        return out
    if kind == "reduce_scatter":
        out = torch.full((n // world,), -7.0)
        comm.reduce_scatter_tensor(out, torch.ones(n // world * world))
        return out
    if kind == "all_gather":
        out = torch.full((n * world,), -7.0)
        comm.all_gather_into_tensor(out, torch.ones(n))
        return out
    if kind == "barrier":
        comm.barrier()
        return torch.full((1,), -7.0)
    raise AssertionError(kind)


def _mismatch(rank, world, kinds, odd_rank):
    import ringcoll

    with ringcoll.Communicator(timeout=20) as comm:
        comm.all_reduce(torch.ones(8))  # a matching call first: the check is per call number
        kind = kinds[1] if rank == odd_rank else kinds[0]
        try:
            _call(comm, kind, rank, world)
            return "no error", "", comm.broken
        except ringcoll.RingcollMismatchError as e:
            message = str(e)
        try:
            comm.all_reduce(torch.ones(8))
            later = "no error"
        except ringcoll.RingcollError as e:
            later = str(e)
        return message, later, comm.broken


# Each kind of mismatch the issue names: collective, dtype, op, count.
CASES = {
    "collective": ("all_reduce", "all_gather"),
    "dtype": ("all_reduce", "all_reduce_int"),
    "op": ("all_reduce", "all_reduce_max"),
    "count": ("all_reduce", "all_reduce_short"),
    "barrier vs collective": ("barrier", "reduce_scatter"),
}


@pytest.mark.parametrize("what", list(CASES))
def test_every_mismatch_kind_raises_on_every_rank(what):
    world, odd = 3, 1
    results = spawn(_mismatch, world, CASES[what], odd, timeout=120)
    for rank, (message, later, broken) in enumerate(results):
        assert message.startswith(("all_reduce: mismatched", "all_gather: mismatched", "reduce_scatter: mismatched",
                                   "barrier: mismatched")), (rank, message)
        # Both ranks and both descriptors are named.
        assert f"rank {rank} called" in message, message
        assert "but rank" in message and "no data was moved" in message, message
        assert broken and "broken" in later, later
    # The odd rank's message names what the others called, and vice versa.
    assert "rank 0" in results[odd][0] or "rank 2" in results[odd][0]


def _mismatch_output_untouched(rank, world):
    import ringcoll

    with ringcoll.Communicator(timeout=20) as comm:
        out = torch.full((10 if rank == 0 else 11,), 5.0)
        try:
            comm.all_reduce(out)
        except ringcoll.RingcollMismatchError:
            pass
        return out.tolist()


def test_mismatch_writes_nothing():
    for rank, values in enumerate(spawn(_mismatch_output_untouched, 2)):
        assert values == [5.0] * (10 if rank == 0 else 11)


def _zero_length_runs_ahead(rank, world):
    import ringcoll

    # Zero-length calls move no data, so a fast rank runs several calls ahead of a slow
    # one: the descriptor's sequence lock must still compare the right calls.
    import time

    with ringcoll.Communicator(timeout=20) as comm:
        if rank == 1:
            time.sleep(0.5)
        for _ in range(50):
            comm.all_reduce(torch.empty(0))
        comm.all_gather_into_tensor(torch.empty(0), torch.empty(0))
        t = torch.ones(4)
        comm.all_reduce(t)
        return t.tolist()


def test_zero_length_calls_may_run_ahead_without_false_mismatch():
    for values in spawn(_zero_length_runs_ahead, 3):
        assert values == [3.0] * 4


def _check_setting(rank, world, env_value):
    import os

    import ringcoll

    os.environ["RINGCOLL_CHECK"] = env_value if rank == 0 else "1"
    try:
        ringcoll.Communicator(timeout=10).close()
        return "ok"
    except ValueError as e:
        return str(e)


def test_check_setting_must_agree_across_ranks():
    for message in spawn(_check_setting, 2, "0"):
        assert message.startswith("Communicator: RINGCOLL_CHECK"), message
    assert spawn(_check_setting, 2, "1") == ["ok", "ok"]


def _buffer_setting(rank, world, sizes):
    import ringcoll

    try:
        ringcoll.Communicator(timeout=10, buffer_bytes=sizes[rank]).close()
        return "ok"
    except ValueError as e:
        return str(e)


def test_buffer_size_must_agree_across_ranks():
    """Peers read each other's buffers with their own slot layout: sizes must match."""
    for message in spawn(_buffer_setting, 3, [1 << 16, 1 << 17, 1 << 16]):
        assert message.startswith("Communicator: RINGCOLL_BUFFER_BYTES / buffer_bytes= differs between ranks: "
                                  "rank 0: 65536, rank 1: 131072, rank 2: 65536"), message
    assert spawn(_buffer_setting, 2, [1 << 16, 1 << 16]) == ["ok", "ok"]


def _unchecked(rank, world):
    import ringcoll

    with ringcoll.Communicator(check=False) as comm:
        t = torch.full((100,), float(rank))
        comm.all_reduce(t)
        return comm.check, t[0].item()


def test_check_can_be_turned_off():
    assert spawn(_unchecked, 2) == [(False, 1.0), (False, 1.0)]
