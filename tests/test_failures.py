"""Failure behaviour of the shared-memory transport: no unbounded wait, clear errors on
every rank that can notice, a broken communicator stays broken, and nothing is left in
/dev/shm after a normal run or after a rank is SIGKILLed mid-collective."""

import datetime
import os
import signal
import threading
import time

import pytest
import torch

from ringcoll.testing import spawn, spawn_outcomes

SHORT_TIMEOUT = 2.0


def shm_entries():
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith("ringcoll-"))


@pytest.fixture(autouse=True)
def no_leftover_segments():
    before = shm_entries()
    yield
    assert shm_entries() == before, "a test left ringcoll segments in /dev/shm"


# --- a peer that never arrives ----------------------------------------------------------

def _absent_peer(rank, world, timeout, check):
    import ringcoll

    comm = ringcoll.Communicator(timeout=timeout, check=check)
    absent = world - 1
    if rank == absent:
        # Arrives only after the others have given up: it must fail fast, not wait again.
        time.sleep(timeout + 3.0)
    t = torch.ones(1000)
    start = time.monotonic()
    try:
        comm.all_reduce(t)
    except ringcoll.RingcollError as e:
        elapsed = time.monotonic() - start
        # Every later call raises at once: the communicator is broken.
        later_start = time.monotonic()
        try:
            comm.all_reduce(t)
            later = "no error"
        except ringcoll.RingcollError as e2:
            later = str(e2)
        later_elapsed = time.monotonic() - later_start
        comm.close()
        return type(e).__name__, str(e), elapsed, later, later_elapsed, comm.broken
    return "no error", "", time.monotonic() - start, "", 0.0, False


@pytest.mark.parametrize("world,check", [(2, True), (3, True), (3, False)])
def test_peer_that_never_arrives_times_out_on_waiting_ranks(world, check):
    # With the call check on, the wait that times out is the one for the absent rank's
    # descriptor; with it off, a wait inside the ring.
    results = spawn(_absent_peer, world, SHORT_TIMEOUT, check, timeout=90)
    for rank, (kind, message, elapsed, later, later_elapsed, broken) in enumerate(results[:-1]):
        # Ranks that wait on the absent peer (directly or through a neighbour that gave up)
        assert kind in ("RingcollTimeoutError", "RingcollPeerError"), (rank, kind, message)
        assert elapsed < SHORT_TIMEOUT + 2.0, (rank, elapsed, message)
        assert message.startswith("all_reduce: rank "), message
        assert "waiting for" in message and "(call 1, " in message, message
        assert ("ring step" in message) if not check else ("announce its call" in message or "ring step" in message)
        assert "broken" in later and later_elapsed < 0.5, later
        assert broken
    # Rank 0's left neighbour is the absent rank: it is the one that times out.
    assert results[0][0] == "RingcollTimeoutError"
    assert f"rank {world - 1}" in results[0][1]
    # The latecomer sees that the others aborted and fails at once instead of waiting.
    kind, message, elapsed, _, _, broken = results[-1]
    assert kind == "RingcollPeerError", message
    assert "aborted" in message and elapsed < 1.5, (elapsed, message)
    assert broken


# --- a rank killed mid-collective -------------------------------------------------------

def _killed_mid_collective(rank, world, victim):
    import ringcoll

    comm = ringcoll.Communicator(timeout=60.0, buffer_bytes=64 * 1024)
    t = torch.ones(4 << 20)  # 16 MiB through a 64 KiB buffer: many slices, long enough to interrupt
    comm.all_reduce(t)  # one full round first: the kill lands in a later, running call
    if rank == victim:
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        for _ in range(1000):
            comm.all_reduce(t)
    except ringcoll.RingcollError as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return "no error", "", time.monotonic() - start


@pytest.mark.parametrize("world,victim", [(2, 1), (3, 0), (3, 2)])
def test_rank_killed_mid_collective(world, victim):
    outcomes = spawn_outcomes(_killed_mid_collective, world, victim, timeout=90)
    victim_outcome = outcomes[victim]
    assert not victim_outcome.ok and victim_outcome.exitcode == -signal.SIGKILL
    for o in outcomes:
        if o.rank == victim:
            continue
        assert o.ok, o.traceback
        kind, message, elapsed = o.value
        # Far sooner than the 60 s timeout: the survivors notice the exit itself.
        assert kind == "RingcollPeerError", message
        assert elapsed < 10.0, elapsed
        assert "has exited" in message or "aborted" in message, message
    # The autouse fixture checks /dev/shm is clean.


# --- segments: created 0600, unlinked once mapped ---------------------------------------

def _segments_unlinked(rank, world):
    import ringcoll

    with ringcoll.Communicator() as comm:
        # Construction returns only after every rank mapped every segment and unlinked it.
        names_after_construction = shm_entries()
        t = torch.full((10,), float(rank))
        comm.all_reduce(t)
        return names_after_construction, t.tolist()


def test_segments_are_unlinked_once_mapped():
    before = shm_entries()
    for names_after_construction, values in spawn(_segments_unlinked, 3):
        assert names_after_construction == before
        assert values == [3.0] * 10


def test_segment_name_is_random_and_private():
    from ringcoll import _C

    names = {_C.random_segment_name() for _ in range(100)}
    assert len(names) == 100
    for name in names:
        assert name.startswith("/ringcoll-") and len(name) == len("/ringcoll-") + 32


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), 1e12, datetime.timedelta.max])
def test_timeout_must_be_positive_and_finite(bad):
    from ringcoll.communicator import _resolve_timeout

    with pytest.raises(ValueError, match="Communicator: timeout must be"):
        _resolve_timeout(bad)
    assert _resolve_timeout(datetime.timedelta(minutes=30)) == 1800.0
