"""The in-process mode (ringcoll.run_in_process): P ranks as threads of one process.

On a GPU it is what the one-GPU benchmark measures (every ring co-resident); its CUDA side
is in tests/gpu/test_cuda.py. Here it runs the shared-memory transport, which is the same
Communicator over the other bootstrap (ringcoll/bootstrap.py), with the same exact checks
the benchmark applies to both modes (ringcoll/harness/exact.py): every collective x dtype x op
x form at awkward sizes, P = 1..5, against values every rank computes itself,
through a 4 KiB buffer (many slices, the ring) and the default one (the one-shot path below
64 KiB). Then what a thread group must do that a process group does for free: mismatched
calls raise on every rank, a failing rank stops the others at once, a missing one is a
timeout, and the bootstrap's rounds do not leak into one another.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import ringcoll
from ringcoll.bootstrap import InProcessGroup
from ringcoll.harness.exact import wrong_cases


def _matrix(group, counts) -> list[str]:
    """Every case on a ring-only 4 KiB communicator and a default one; the wrong ones, named."""
    with ringcoll.Communicator(group=group, buffer_bytes=4096, small_bytes=0) as ring, \
            ringcoll.Communicator(group=group) as default:
        return wrong_cases(ring, counts) + wrong_cases(default, counts)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_every_collective_dtype_op_and_form_is_exact(world):
    # Multiples of P (the benchmark's shapes): one element each, a prime number of 60-element
    # chunks, and over the 4 KiB buffer many times.
    counts = [world, world * 61, world * 2503]
    wrong = sum(ringcoll.run_in_process(world, _matrix, counts, timeout=60), [])
    assert not wrong, f"{len(wrong)} wrong cases, e.g. " + "; ".join(wrong[:5])


def test_results_are_identical_to_the_same_run_as_processes():
    """One case, in threads and in processes: the same bits (the transport does not know
    which bootstrap made it)."""
    from ringcoll.harness.launcher import spawn

    def in_threads(group):
        with ringcoll.Communicator(group=group, buffer_bytes=4096) as comm:
            t = torch.randn(10007, generator=torch.Generator().manual_seed(group.rank))
            comm.all_reduce(t)
            return t

    threads = ringcoll.run_in_process(3, in_threads, timeout=60)
    processes = spawn(_as_process, 3)
    for a, b in zip(threads, processes):
        assert torch.equal(a, b)


def _as_process(rank, world):
    with ringcoll.Communicator(buffer_bytes=4096) as comm:
        t = torch.randn(10007, generator=torch.Generator().manual_seed(rank))
        comm.all_reduce(t)
        return t


def test_mismatched_calls_raise_on_every_rank():
    def body(group):
        with ringcoll.Communicator(group=group) as comm:
            t = torch.ones(64 if group.rank == 0 else 65)
            with pytest.raises(ringcoll.RingcollMismatchError):
                comm.all_reduce(t)
            return t

    for t in ringcoll.run_in_process(3, body, timeout=60):
        assert torch.all(t == 1), "a mismatched call wrote its output"


def test_a_failing_rank_stops_the_others_at_once():
    """Rank 1 raises before its Communicator exists: the others, waiting for it in the
    bootstrap, stop at once (RingcollPeerError naming it), and the caller gets rank 1's own
    error, not the others'."""
    def body(group):
        if group.rank == 1:
            raise KeyError("rank 1's own error")
        ringcoll.Communicator(group=group)

    start = time.monotonic()
    with pytest.raises(KeyError, match="rank 1's own error") as info:
        ringcoll.run_in_process(3, body, timeout=120)
    assert time.monotonic() - start < 30, "the others waited for the failed rank"
    assert any("rank 1 of run_in_process" in note for note in info.value.__notes__)


def test_the_others_name_the_failed_rank():
    seen = {}

    def body(group):
        if group.rank == 2:
            raise ValueError("boom")
        try:
            ringcoll.Communicator(group=group)
        except ringcoll.RingcollPeerError as e:
            seen[group.rank] = str(e)
            raise

    with pytest.raises(ValueError):
        ringcoll.run_in_process(3, body, timeout=120)
    assert sorted(seen) == [0, 1]
    assert all("rank 2 of the in-process group failed" in message for message in seen.values())


def test_a_rank_that_never_comes_is_a_timeout():
    group = InProcessGroup(2, timeout=0.5)
    start = time.monotonic()
    with pytest.raises(ringcoll.RingcollTimeoutError, match="waited 0.5 s for the other 1 ranks"):
        ringcoll.Communicator(group=group.rank_handle(0))
    assert time.monotonic() - start < 10
    with pytest.raises(ringcoll.RingcollPeerError):  # the group stays broken for a late rank
        group.rank_handle(1).barrier()


def test_a_rank_that_dies_inside_a_collective_is_an_error_not_a_hang():
    """Rank 0 leaves after one collective (its Communicator closes); rank 1's next call
    waits for it and must give up within the timeout."""
    def body(group):
        with ringcoll.Communicator(group=group, timeout=3) as comm:
            comm.all_reduce(torch.ones(8))
            if group.rank == 0:
                return "left"
            comm.all_reduce(torch.ones(8))

    start = time.monotonic()
    with pytest.raises((ringcoll.RingcollPeerError, ringcoll.RingcollTimeoutError)):
        ringcoll.run_in_process(2, body, timeout=60)
    assert time.monotonic() - start < 30


def test_bootstrap_rounds_do_not_overwrite_each_other():
    """all_gather_object twice in a row, ranks skewed: each round returns its own offers."""
    def body(group):
        rounds = []
        for k in range(20):
            if (group.rank + k) % 3 == 0:
                time.sleep(0.002)  # a late rank must not see the next round's offers
            rounds.append(group.all_gather_object((k, group.rank)))
        return rounds

    for rounds in ringcoll.run_in_process(4, body, timeout=60):
        assert rounds == [[(k, r) for r in range(4)] for k in range(20)]


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        ringcoll.run_in_process(0, lambda group: None)
    with pytest.raises(ValueError, match="rank 3 is outside 0..1"):
        InProcessGroup(2, timeout=1).rank_handle(3)


def test_a_barrier_given_a_timeout_gives_up_then():
    """The bootstrap's barrier with its own timeout (a CUDA close's rendezvous is bounded by
    the communicator's, not the group's): a rank that never comes is a timeout after it."""
    group = InProcessGroup(2, timeout=60)
    start = time.monotonic()
    with pytest.raises(ringcoll.RingcollTimeoutError, match="waited 0.3 s for the other 1 ranks"):
        group.rank_handle(0).barrier(timeout=0.3)
    assert time.monotonic() - start < 10


def test_threads_are_joined():
    before = threading.active_count()
    ringcoll.run_in_process(4, lambda group: group.barrier(), timeout=60)
    assert threading.active_count() == before


# --- the CUDA kernels in-process, through the emulator (CI's stand-in for a GPU) ------------


class EmulatedCudaCommunicator(ringcoll.Communicator):
    """A Communicator whose transport runs the CUDA ring kernels on CPU threads
    (ringcoll/transports/emulated.py)."""

    @staticmethod
    def transport_class(device):
        from ringcoll.transports.emulated import EmulatedCudaTransport

        return EmulatedCudaTransport


def _emulated_matrix(group, counts, buffer_bytes):
    with EmulatedCudaCommunicator(group=group, buffer_bytes=buffer_bytes, timeout=60) as comm:
        wrong = wrong_cases(comm, counts)
        comm.barrier()
        return wrong


@pytest.mark.parametrize("variant", ["fused", "naive"])
@pytest.mark.parametrize("world", [2, 3])
def test_cuda_kernels_in_process_are_exact(world, variant, monkeypatch):
    """The in-process CUDA mode's kernels under the benchmark's exact checks: every
    collective x dtype x op x form, through a buffer small enough that the larger message
    takes several slices."""
    monkeypatch.setenv("RINGCOLL_CUDA_KERNEL", variant)
    wrong = sum(ringcoll.run_in_process(world, _emulated_matrix, [world, world * 1031], 1 << 14, timeout=60), [])
    assert not wrong, f"{len(wrong)} wrong cases, e.g. " + "; ".join(wrong[:5])


def test_emulated_cuda_mismatch_and_errors_reach_every_rank():
    def body(group):
        with EmulatedCudaCommunicator(group=group, timeout=30) as comm:
            t = torch.ones(64 if group.rank == 0 else 65)
            with pytest.raises(ringcoll.RingcollMismatchError):
                comm.all_reduce(t)
            with pytest.raises(ringcoll.RingcollError, match="broken"):
                comm.all_reduce(t)
            return bool(torch.all(t == 1))

    # A broken ring keeps its buffers (a peer's kernel might still be stopping), saying so.
    with pytest.warns(RuntimeWarning, match="keeps its emulated buffer: the communicator is broken"):
        assert ringcoll.run_in_process(3, body, timeout=60) == [True] * 3


def _close_late(group, late_seconds):
    """Rank 1 closes `late_seconds` after rank 0 (the GPU test's scenario, test_cuda.py):
    each rank's close time and its warnings."""
    import warnings

    comm = EmulatedCudaCommunicator(group=group, timeout=1.0)
    comm.all_reduce(torch.ones(64))
    if group.rank == 1:
        time.sleep(late_seconds)
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm.close()
    return time.monotonic() - started, [str(w.message) for w in caught]


def test_emulated_cuda_close_with_a_peer_past_the_timeout_keeps_both_buffers_without_waiting():
    """Rank 0 gives up on rank 1 after the timeout and keeps its buffer; rank 1, closing
    later, learns that at once and keeps its own, instead of waiting at the rendezvous for
    rank 0 (the hang the H200 showed on 2026-12-04)."""
    (took0, warned0), (took1, warned1) = ringcoll.run_in_process(2, _close_late, 1.5, timeout=60)
    assert 1.0 <= took0 < 3.0 and took1 < 0.5, (took0, took1)
    assert len(warned0) == 1 and "rank(s) 1 did not close within the timeout" in warned0[0], warned0
    assert len(warned1) == 1 and "rank(s) 0 keep their buffers" in warned1[0], warned1


def _one_rank_closed_by_its_finalizer(group):
    """Rank 1 drops its communicator unclosed (the garbage collector closes it, without
    waiting for its peers); rank 0 closes as usual."""
    import gc

    comm = EmulatedCudaCommunicator(group=group, timeout=30)
    comm.all_reduce(torch.ones(64))
    group.barrier()
    if group.rank == 1:
        del comm
        gc.collect()
    else:
        comm.close()


def test_emulated_cuda_finalizer_close_tells_the_peers_at_once():
    """CudaComm closed by a finalizer tells its peers it keeps its buffer (the kKeeps word),
    so a peer closing as usual keeps its own at once instead of waiting for it until the
    timeout; the model used to run no close at all there, and the peer waited."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # the process's: caught here, not in the ranks
        warnings.simplefilter("always")
        ringcoll.run_in_process(2, _one_rank_closed_by_its_finalizer, timeout=60)
    warned = sorted(str(w.message) for w in caught)
    assert len(warned) == 2, warned
    assert warned[0].startswith("ringcoll: rank 0 keeps its emulated buffer: rank(s) 1 keep their buffers"), warned
    assert warned[1].startswith("ringcoll: rank 1 keeps its emulated buffer: it was closed without waiting"), warned


def _allocate_while_a_peer_ring_waits(group):
    """Rank 1 starts an all-reduce; only then does rank 0 allocate (a device-wide wait on a
    GPU) before its own call: what the exact harness's meeting prevents."""
    with EmulatedCudaCommunicator(group=group, timeout=1.0) as comm:
        t = torch.ones(64)
        if group.rank == 1:
            work = comm.all_reduce(t, async_op=True)
            group.barrier()
            with pytest.raises(ringcoll.RingcollError):
                work.wait()
            return None
        group.barrier()
        started = time.monotonic()
        comm.transport.wait_for_the_whole_device("an allocation")  # waits for rank 1's ring, which waits for us
        waited = time.monotonic() - started
        with pytest.raises(ringcoll.RingcollError):
            comm.all_reduce(t)  # too late: rank 1's ring gave up
        return waited


def test_an_allocation_while_a_peer_ring_waits_for_this_rank_stops_that_ring():
    """The emulated device models what an allocation may do on a GPU (wait for all the
    device's work): rank 0's wait lasts until rank 1's ring gives up at its timeout, and the
    ring is broken. This is how the H200's in-process exact tests stopped (2026-12-04);
    the exact harness meets after allocating so that it cannot happen there."""
    with pytest.warns(RuntimeWarning, match="keeps its emulated buffer"):
        waited, _ = ringcoll.run_in_process(2, _allocate_while_a_peer_ring_waits, timeout=60)
    assert 0.9 <= waited < 10, waited
