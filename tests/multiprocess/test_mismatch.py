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
    if kind.startswith(("broadcast", "reduce")):  # "broadcast_from_1", "reduce_to_0", ...
        out = torch.full((n,), -7.0)
        getattr(comm, kind.split("_")[0])(out, int(kind[-1]))
        return out
    raise AssertionError(kind)


def _mismatch(rank, world, kinds, odd_rank, small_bytes=0):
    """One mismatched call after a matching one. small_bytes=0: the ring; otherwise these
    small calls take the one-shot path (checked: the matching call took it)."""
    import ringcoll

    with ringcoll.Communicator(timeout=20, small_bytes=small_bytes, algorithm="native") as comm:
        comm.all_reduce(torch.ones(8))  # a matching call first: the check is per call number
        if comm.transport.one_shot_calls != (1 if small_bytes else 0):
            return "wrong path", f"{comm.transport.one_shot_calls} one-shot calls", comm.broken
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


def _mismatch_every_kind(rank, world, odd_rank, small_bytes):
    """_mismatch for every kind of CASES in one launch (a fresh communicator for each)."""
    return {what: _mismatch(rank, world, kinds, odd_rank, small_bytes) for what, kinds in CASES.items()}


# Each kind of mismatch the issue names: collective, dtype, op, count; and the root.
CASES = {
    "collective": ("all_reduce", "all_gather"),
    "dtype": ("all_reduce", "all_reduce_int"),
    "op": ("all_reduce", "all_reduce_max"),
    "count": ("all_reduce", "all_reduce_short"),
    "barrier vs collective": ("barrier", "reduce_scatter"),
    "broadcast root": ("broadcast_from_0", "broadcast_from_1"),
    "reduce root": ("reduce_to_2", "reduce_to_1"),
    "rooted vs collective": ("reduce_to_0", "all_reduce"),
}


def _check_mismatch_results(results, odd):
    for rank, (message, later, broken) in enumerate(results):
        assert message.startswith(("all_reduce: mismatched", "all_gather: mismatched", "reduce_scatter: mismatched",
                                   "barrier: mismatched", "broadcast: mismatched", "reduce: mismatched")), (rank, message)
        # Both ranks and both descriptors are named.
        assert f"rank {rank} called" in message, message
        assert "but rank" in message and "no data was moved" in message, message
        assert broken and "broken" in later, later
    # The odd rank's message names what the others called, and vice versa.
    assert "rank 0" in results[odd][0] or "rank 2" in results[odd][0]


@pytest.mark.parametrize("what", list(CASES))
def test_every_mismatch_kind_raises_on_every_rank(what):
    world, odd = 3, 1
    _check_mismatch_results(spawn(_mismatch, world, CASES[what], odd, timeout=120), odd)


def test_every_mismatch_kind_raises_on_the_one_shot_path():
    """The same calls below the small-message threshold: each rank publishes its one-shot
    copy into its own slot before comparing the descriptors (run_collective), and combines
    only after the check passed."""
    world, odd = 3, 1
    per_rank = spawn(_mismatch_every_kind, world, odd, 1 << 20, timeout=120)
    for what in CASES:
        _check_mismatch_results([results[what] for results in per_rank], odd)


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


def _one_shot_against_ring(rank, world):
    import ringcoll

    # Rank 0's call is small (the one-shot path, which publishes before the check), the
    # others' large (the ring): every rank raises, no output and no input changes.
    n = 10 if rank == 0 else 100_003
    with ringcoll.Communicator(timeout=20, small_bytes=64 << 10) as comm:
        inp, out = torch.full((n,), float(rank + 1)), torch.full((n,), 5.0)
        try:
            comm.all_reduce(inp, output=out)
            message = "no error"
        except ringcoll.RingcollMismatchError as e:
            message = str(e)
        return message, bool((inp == rank + 1).all()), bool((out == 5.0).all()), comm.transport.one_shot_calls


def test_one_shot_against_ring_mismatch_writes_nothing():
    for rank, (message, input_kept, output_kept, one_shot) in enumerate(spawn(_one_shot_against_ring, 3)):
        assert "mismatched" in message and "no data was moved" in message, (rank, message)
        assert input_kept and output_kept, rank
        assert one_shot == (1 if rank == 0 else 0), rank  # rank 0 did take the one-shot path


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


def _mismatch_while_draining(rank, world):
    import os
    import signal
    import time

    import torch.distributed as dist

    import ringcoll

    # Rank 0 roots a star broadcast, which it finishes without waiting for its last reads, and
    # stops rank 2 (SIGSTOP) while it likely still reads the last slices. Rank 0's next call,
    # mismatched with rank 1's, first waits (ahead of its call check) until rank 2 has read
    # the broadcast; rank 1 finds the mismatch and aborts meanwhile. That wait's giving up is
    # the mismatch for rank 0 too, not a PeerError quoting rank 1's abort (seen once in CI
    # under DDP at P = 3). Rank 1 lets rank 2 go on once it has its error.
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    with ringcoll.Communicator(timeout=20) as comm:
        comm.broadcast(torch.ones(1 << 21), 0, algorithm="star")  # 8 MiB: many slices
        if rank == 0:
            os.kill(pids[2], signal.SIGSTOP)
        try:
            comm.all_reduce(torch.ones(4 + (rank == 1)))
            outcome = ("no error", "")
        except ringcoll.RingcollError as e:
            outcome = (type(e).__name__, str(e))
        if rank == 1:
            time.sleep(0.5)  # rank 0 gives up within its 50 ms health check
            os.kill(pids[2], signal.SIGCONT)
        return outcome


def test_a_mismatch_found_while_a_rank_drains_is_a_mismatch_there_too():
    outcomes = spawn(_mismatch_while_draining, 3)
    for rank in (0, 1):  # rank 2 may find the communicator already broken by then
        kind, message = outcomes[rank]
        assert kind == "RingcollMismatchError" and "mismatched" in message, (rank, kind, message)


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


def _small_setting(rank, world, env_values, arg_values):
    """The one-shot threshold from the environment, then from the argument, differing by rank."""
    import os

    import ringcoll

    messages = []
    os.environ["RINGCOLL_SMALL_BYTES"] = env_values[rank]
    for arg in (None, arg_values[rank], 8192):
        try:
            with ringcoll.Communicator(timeout=10, small_bytes=arg) as comm:
                messages.append(f"ok {comm.small_bytes}")
        except ValueError as e:
            messages.append(str(e))
    try:
        ringcoll.Communicator(timeout=10, small_bytes=-1).close()
        messages.append("accepted -1")
    except ValueError as e:
        messages.append(str(e))
    return messages


def test_small_message_threshold_must_agree_across_ranks():
    """Ranks on different paths would wait for each other's publications: the threshold
    (RINGCOLL_SMALL_BYTES or small_bytes=) is compared at construction."""
    prefix = "Communicator: RINGCOLL_SMALL_BYTES / small_bytes= differs between ranks: "
    for env_message, arg_message, agreed, negative in spawn(_small_setting, 3, ["64K", "0", "64K"],
                                                            [4096, 4096, 4097]):
        assert env_message == prefix + "rank 0: 65536, rank 1: 0, rank 2: 65536", env_message
        assert arg_message == prefix + "rank 0: 4096, rank 1: 4096, rank 2: 4097", arg_message
        assert agreed == "ok 8192", agreed  # the argument wins over the (differing) environment
        assert negative.startswith("Communicator: small_bytes must be >= 0"), negative


def _hop_probe_settings(rank, world):
    """Each rank with its own RINGCOLL_SLOT_STORES, then with its own shares_cores=."""
    import os

    import ringcoll

    messages = []
    for env, shares in ((["auto", "cache"][rank], False), ("auto", [False, True][rank])):
        os.environ["RINGCOLL_SLOT_STORES"] = env
        try:
            ringcoll.Communicator(timeout=10, shares_cores=shares).close()
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_what_decides_the_hop_probe_must_agree_across_ranks():
    """A rank that probes its neighbour hop waits for a token a non-probing neighbour never
    passes on: two ranks, one with RINGCOLL_SLOT_STORES=cache (or shares_cores=True), timed
    out on their first 256 KiB call, each blaming the other's silence. Both settings are
    compared at construction now."""
    for slot_stores, shares_cores in spawn(_hop_probe_settings, 2, timeout=60):
        assert slot_stores == "Communicator: RINGCOLL_SLOT_STORES differs between ranks: rank 0: auto, rank 1: cache"
        assert shares_cores == "Communicator: shares_cores= differs between ranks: rank 0: False, rank 1: True"


def _unchecked(rank, world):
    import ringcoll

    with ringcoll.Communicator(check=False) as comm:
        t = torch.full((100,), float(rank))
        comm.all_reduce(t)
        return comm.check, t[0].item()


def test_check_can_be_turned_off():
    assert spawn(_unchecked, 2) == [(False, 1.0), (False, 1.0)]
