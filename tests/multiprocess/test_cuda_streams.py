"""The in-process CUDA mode's stream order, on the emulated device (csrc/emulation/
emulated_streams.h: in-order streams, events, the shared legacy default stream, hardware
queues, implicit syncs, graph capture): what a GPU run of issue 22's defects would show.

Each deadlock is first shown with its fix turned off (the old order: a clear timeout, not a
hang), then the fix holds at P = 2, 3, 4, 8, both kernel variants, sync and async calls,
with every rank calling only once the rank before it has queued its call (the order that
made the shared stream deadlock certain)."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import ringcoll
from ringcoll.harness import bench
from ringcoll.transports import emulated
from ringcoll.transports.emulated import EmulatedCudaTransport

TIMEOUT = 30.0  # a healthy call never comes near it
STUCK = 1.0  # the ring timeout where a deadlock is expected


class Staggered(EmulatedCudaTransport):
    """Rank k's first call starts once rank k-1's call is queued (its host is in the wait)."""

    queued: list = []

    def host_waits_for(self, op, stream):
        Staggered.queued[self.rank].set()
        super().host_waits_for(op, stream)

    def submit(self, *args, **kwargs):
        if self.rank > 0:
            assert Staggered.queued[self.rank - 1].wait(TIMEOUT)
        completion = super().submit(*args, **kwargs)
        Staggered.queued[self.rank].set()  # an async call is queued once submit returns
        return completion


class OldOrder(Staggered):
    own_stream_per_rank = False  # the ranks stay on the legacy default stream, all of them


def communicator(transport):
    """A Communicator class over `transport` (and the staggering's events, fresh)."""
    class Emulated(ringcoll.Communicator):
        @staticmethod
        def transport_class(device):
            return transport

    Staggered.queued = [threading.Event() for _ in range(8)]
    return Emulated


def _all_reduces(group, cls, timeout, async_op, calls=3):
    with cls(group=group, timeout=timeout, buffer_bytes=1 << 14) as comm:
        xs = [torch.full((1031,), float(group.rank + 1 + k)) for k in range(calls)]
        if async_op:
            works = [comm.all_reduce(x, async_op=True) for x in xs]
            for w in works:
                w.wait()
        else:
            for x in xs:
                comm.all_reduce(x)
        world = group.world_size
        return [bool(torch.all(x == sum(r + 1 + k for r in range(world)))) for k, x in enumerate(xs)]


def test_ranks_on_the_shared_default_stream_deadlock_until_the_timeout():
    """The old order: rank 0's stream waits for its kernel, rank 1's `ready` record is queued
    behind that wait, and rank 0's kernel waits for rank 1's: both stop at the timeout."""
    def body(group):
        with pytest.raises(ringcoll.RingcollError) as raised:
            _all_reduces(group, communicator(OldOrder), STUCK, async_op=False, calls=1)
        return type(raised.value).__name__

    with pytest.warns(RuntimeWarning, match="keeps its emulated buffer"):
        kinds = ringcoll.run_in_process(2, body, timeout=60)
    assert kinds[0] == "RingcollTimeoutError" and kinds[1] in ("RingcollTimeoutError", "RingcollPeerError"), kinds


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("variant", ["fused", "naive"])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_each_rank_on_a_stream_of_its_own_never_deadlocks(world, variant, async_op, monkeypatch):
    monkeypatch.setenv("RINGCOLL_CUDA_KERNEL", variant)
    results = ringcoll.run_in_process(world, _all_reduces, communicator(Staggered), TIMEOUT, async_op,
                                      timeout=60)
    assert results == [[True] * 3] * world


def test_a_call_from_the_shared_default_stream_is_refused_in_process():
    def body(group):
        with communicator(EmulatedCudaTransport)(group=group, timeout=TIMEOUT) as comm:
            assert emulated.current_stream() != emulated.LEGACY  # moved onto its own stream
            with emulated.stream(emulated.LEGACY):
                with pytest.raises(ringcoll.RingcollError, match="legacy default stream.*stream of its own"):
                    comm.all_reduce(torch.ones(4))
            comm.all_reduce(torch.ones(4))
        return emulated.current_stream() == emulated.LEGACY  # given back at close

    assert ringcoll.run_in_process(2, body, timeout=60) == [True, True]


def test_closing_the_communicator_that_moved_the_thread_keeps_the_others_working():
    """A rank with two communicators open closes the one that moved its thread off the legacy
    stream: the thread goes onto the other's stream (it used to go back to the legacy one,
    where the other refused every call), and to the legacy one once none is open."""
    def body(group):
        cls = communicator(EmulatedCudaTransport)
        first = cls(group=group, timeout=TIMEOUT)
        second = cls(group=group, timeout=TIMEOUT)
        first.all_reduce(torch.ones(4))
        first.close()
        on_second = emulated.current_stream() == second.transport._own
        x = torch.ones(1031)
        second.all_reduce(x)
        second.all_reduce(x, async_op=True).wait()
        second.close()
        return on_second, x.tolist() == [4.0] * 1031, emulated.current_stream() == emulated.LEGACY

    assert ringcoll.run_in_process(2, body, timeout=60) == [(True, True, True)] * 2


def test_a_stream_closed_from_another_thread_is_never_lent_again():
    """A communicator closed from another thread (a finalizer, a shutdown thread) cannot move
    its rank's thread off its stream: lent again, that stream became the next communicator's
    own stream for another rank while this rank's thread still queued its work there, and the
    two ranks deadlocked as on the shared legacy stream. The stream is retired instead."""
    def body(group):
        first = communicator(EmulatedCudaTransport)(group=group, timeout=TIMEOUT)
        closer = threading.Thread(target=first.close)
        closer.start()
        closer.join()
        del first  # every rank's ring goes, and its streams back to the device (those not retired)
        import gc

        gc.collect()
        group.barrier()
        stayed_on = emulated.current_stream()
        with communicator(Staggered)(group=group, timeout=STUCK) as second:
            owns = second.transport._own
            try:
                second.all_reduce(torch.ones(64))
                result = "ok"
            except ringcoll.RingcollError as e:
                result = type(e).__name__
        return stayed_on, owns, result

    results = ringcoll.run_in_process(2, body, timeout=60)
    threads_on = {stayed_on for stayed_on, _, _ in results}
    assert not threads_on & {owns for _, owns, _ in results}, results  # no rank's stream lent to a rank
    assert [result for _, _, result in results] == ["ok", "ok"], results


def _two_async_then_the_peer(group, cls, timeout):
    """Rank 0 queues two calls before rank 1 queues any: on one hardware queue, rank 0's
    second kernel (waiting for its first) holds back rank 1's first, which rank 0's first waits for."""
    with cls(group=group, timeout=timeout) as comm:
        xs = [torch.ones(64) for _ in range(2)]
        try:
            works = [comm.all_reduce(x, async_op=True) for x in xs]
            for w in works:
                w.wait()
        except ringcoll.RingcollError as e:
            return type(e).__name__
        return "ok"


def test_ranks_sharing_a_hardware_queue_deadlock_so_too_few_queues_are_refused(monkeypatch):
    monkeypatch.setattr(emulated, "_device", None)
    emulated.reset_device(1)  # CUDA_DEVICE_MAX_CONNECTIONS=1, as some training stacks set it
    try:
        def refused(group):
            with pytest.raises(ringcoll.RingcollError, match="need 3 hardware queues.*CUDA_DEVICE_MAX_CONNECTIONS=1"):
                communicator(EmulatedCudaTransport)(group=group, timeout=TIMEOUT)

        ringcoll.run_in_process(2, refused, timeout=60)
        # Why: without the check, the model deadlocks as a GPU would, until the timeout.
        monkeypatch.setattr(emulated, "check_hardware_queues", lambda world, queues: None)
        with pytest.warns(RuntimeWarning, match="keeps its emulated buffer"):
            kinds = ringcoll.run_in_process(2, _two_async_then_the_peer, communicator(Staggered), STUCK, timeout=60)
        assert "RingcollTimeoutError" in kinds, kinds
    finally:
        emulated.reset_device()


def test_run_in_process_gives_every_rank_a_hardware_queue(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    ringcoll.run_in_process(1, lambda group: None)
    import os

    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"


@contextlib.contextmanager
def _on_a_stream_of_its_own(group):
    """This rank's thread on an emulated stream of its own (a capture cannot begin on the
    legacy one) and an emulated communicator on it: (device, that stream, communicator).
    The caller closes the communicator."""
    dev = emulated.device()
    user = dev.create_stream()
    with emulated.stream(user):
        yield dev, user, communicator(EmulatedCudaTransport)(group=group, timeout=TIMEOUT, buffer_bytes=1 << 14)


def test_graph_replays_are_waited_for_at_close():
    """A captured all-reduce replayed on the caller's stream, then close() at once: closing
    must wait for the replays (the external `replayed` event), not only for its own stream;
    the emulator notes any kernel that runs after its rank closed."""
    replays = 4

    def body(group):
        with _on_a_stream_of_its_own(group) as (dev, user, comm):
            x = torch.ones(1 << 16)  # many slices: a replay lasts longer than the close protocol
            comm.all_reduce(x)  # warm-up outside the capture, as with torch.cuda.graphs
            dev.begin_capture(user)
            comm.all_reduce(x)
            graph = dev.end_capture(user)
            for _ in range(replays):
                dev.replay(graph, user)
            ring = comm.transport._ring
            comm.close()  # no synchronisation before it
        exact = bool(torch.all(x == group.world_size ** (replays + 1)))
        assert dev.synchronize_device(TIMEOUT)
        return exact, ring.violations

    assert ringcoll.run_in_process(3, body, timeout=60) == [(True, "")] * 3


def test_barrier_and_synchronize_are_refused_inside_a_capture():
    """Both block the host until the device is done, which a capture cannot contain (on a
    GPU cudaStreamSynchronize inside a capture invalidates it): refused by name, as
    CudaTransport refuses them; the capture and the communicator go on."""
    def body(group):
        with _on_a_stream_of_its_own(group) as (dev, user, comm):
            x = torch.ones(256)
            comm.all_reduce(x)  # warm-up
            dev.begin_capture(user)
            messages = []
            for op in (comm.barrier, comm.synchronize):
                with pytest.raises(ringcoll.RingcollError) as raised:
                    op()
                messages.append(str(raised.value).split(":")[0])
            comm.all_reduce(x)
            dev.replay(dev.end_capture(user), user)
            comm.synchronize()
            comm.close()
        return messages, bool(torch.all(x == group.world_size ** 2))

    assert ringcoll.run_in_process(2, body, timeout=60) == [(["barrier", "synchronize"], True)] * 2


def test_a_list_forms_copy_out_runs_in_stream_order_and_replays():
    """A list form's copy from its flat output into the caller's tensors is queued after the
    kernel, as CudaTransport queues it (on its stream for an async call, on the caller's for a
    sync one), not run by the host at wait(): so synchronize() alone finishes an async one,
    and a captured call's copy is part of the graph, run again by every replay (the model ran
    it once, on the host, while capturing, when the kernel had not run)."""
    def body(group):
        rank, world = group.rank, group.world_size
        with _on_a_stream_of_its_own(group) as (dev, user, comm):
            parts = [torch.zeros(5) for _ in range(world)]
            comm.all_gather(parts, torch.full((5,), float(rank)), async_op=True)  # never waited for
            comm.synchronize()
            async_filled = [p[0].item() for p in parts]
            x = torch.full((5,), float(rank))
            comm.all_gather(parts, x)  # warm-up
            dev.begin_capture(user)
            comm.all_gather(parts, x)
            graph = dev.end_capture(user)
            replayed = []
            for k in (10, 20):
                x.fill_(k + rank)
                dev.replay(graph, user)
                assert dev.synchronize_stream(user, TIMEOUT)
                replayed.append([p[0].item() for p in parts])
            comm.close()
        return async_filled, replayed

    world = 3
    assert ringcoll.run_in_process(world, body, timeout=60) == [
        ([0.0, 1.0, 2.0], [[10.0, 11.0, 12.0], [20.0, 21.0, 22.0]])] * world


def test_an_async_call_captured_in_a_graph_leaves_nothing_the_host_must_query():
    """Work.wait() inside the capture, as docs/cuda.md allows. Before, the captured call's
    event was held with the eager calls' (InFlight) and queried: while capturing (an eager
    call still held; a capture in global mode forbids the query), and after it (an event
    last recorded in a capture: cudaErrorCapturedEvent), so every later async call and
    empty() raised. The emulator now refuses both, as CUDA does."""
    replays = 2

    def body(group):
        with _on_a_stream_of_its_own(group) as (dev, user, comm):
            x, warm = torch.ones(1 << 10), torch.ones(1 << 10)
            held = comm.all_reduce(warm, async_op=True)  # eager, not yet waited for: still held
            dev.begin_capture(user)
            captured = comm.all_reduce(x, async_op=True)
            captured.wait()  # inside the capture: the caller's stream joins the call
            capture_errors = []
            for what, step in (("synchronize", captured.synchronize), ("empty", lambda: comm.empty(4))):
                try:
                    step()
                except ringcoll.RingcollError as e:
                    capture_errors.append((what, str(e)))
            graph = dev.end_capture(user)
            later = comm.all_reduce(torch.ones(8), async_op=True)  # after the capture: nothing stale to query
            block = comm.empty(16)
            later.wait()
            held.wait()
            for _ in range(replays):
                dev.replay(graph, user)
            assert dev.synchronize_stream(user, TIMEOUT)
            try:
                captured.wait()
                after = "no error"
            except ringcoll.RingcollError as e:
                after = str(e)
            done = captured.is_completed()
            comm.close()
        return bool(torch.all(x == group.world_size ** replays)), block.numel(), done, capture_errors, after

    for exact, numel, done, capture_errors, after in ringcoll.run_in_process(2, body, timeout=60):
        assert exact and numel == 16 and done
        assert [what for what, _ in capture_errors] == ["synchronize", "empty"], capture_errors
        assert capture_errors[0][1].startswith("all_reduce: synchronize() of a call captured in a CUDA graph"), \
            capture_errors
        assert capture_errors[1][1].startswith("empty: a collective allocation while the current stream captures"), \
            capture_errors
        assert after.startswith("all_reduce: wait() after the capture ended for a call captured in a CUDA graph"), \
            after


def test_the_benchmark_meets_after_allocating(monkeypatch):
    """Allocation can synchronise the whole GPU (cudaMalloc growing torch's cache): modelled
    as a device-wide sync after every allocation of the benchmark's buffers. A rank that
    allocates while a peer's first call of that size is already running would wait for that
    call, which waits for it; the benchmark's meeting point after allocating prevents it."""
    allocate = bench._buffers

    def allocate_and_sync(*args, **kwargs):
        buffers = allocate(*args, **kwargs)
        assert emulated.device().synchronize_device(TIMEOUT)  # what cudaMalloc may do
        return buffers

    monkeypatch.setattr(bench, "_buffers", allocate_and_sync)
    monkeypatch.setattr(bench, "Communicator", communicator(EmulatedCudaTransport))
    config = bench.Config(min_bytes=4096, max_bytes=16384, factor=4, iters=2, warmup=1, trials=1, min_seconds=0.0,
                          collectives=("all_reduce", "all_gather"), in_process=True, progress=False, check_cost=False)
    rows = ringcoll.run_in_process(2, bench.run_in_process_rank, config, timeout=120)[0]
    measured = [r for r in rows if "out_wrong" in r]
    assert measured and all(r["out_wrong"] == 0 and r.get("in_wrong", 0) == 0 for r in measured)


def test_the_emulated_cuda_ring_runs_plans_and_auto_stays_the_ring_kernels():
    """Like CUDA, the emulator runs plans by the plan kernels (csrc/cuda/device_plan.h): a
    broadcast, a reduce and a tree all-reduce give their results (the emulator once took its
    device, "cpu", for the CPU transport's and dropped the plan without a word; then it refused
    plans by name). Auto's table, which prices the CPU transport, is not read there: auto is
    the ring kernels at every size."""
    def body(group):
        rank = group.rank
        with communicator(EmulatedCudaTransport)(group=group, timeout=TIMEOUT) as comm:
            b = torch.full((4,), 7.0) if rank == 0 else torch.zeros(4)
            comm.broadcast(b, 0)
            r = torch.full((4,), float(rank + 1))
            comm.reduce(r, 1)
            t = torch.full((4,), float(rank + 1))
            comm.all_reduce(t, algorithm="tree")
            # 128 KiB: a band where the shipped table's auto picks a plan on the CPU
            native = all(comm._plan("all_reduce", "all_reduce", None, n) is None for n in (4, 128 << 10, 64 << 20))
            x = torch.ones(32 << 10)
            comm.all_reduce(x)
            return (b.tolist(), r.tolist() if rank == 1 else None, t.tolist(), native, bool((x == 2).all()))

    assert ringcoll.run_in_process(2, body, timeout=60) == [
        ([7.0] * 4, None, [3.0] * 4, True, True), ([7.0] * 4, [3.0] * 4, [3.0] * 4, True, True)]
