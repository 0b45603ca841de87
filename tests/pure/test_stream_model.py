"""The emulator's model of CUDA streams (csrc/emulation/emulated_streams.h), rule by rule,
with Python callables as kernels: in-order streams, events, the legacy default stream,
hardware queues, implicit device syncs, graph capture. The ring's use of it is tested in
tests/multiprocess/test_in_process.py."""

import threading

import pytest

from ringcoll import _C

D = _C.emulation.Device
LEGACY = D.LEGACY
WAIT = 10.0  # a host wait that must succeed; one that must not is given a short one


def kernel(log, name, gate=None):
    """A kernel that logs its start, then (with a gate) runs until the gate opens."""
    def run():
        log.append(name)
        if gate is not None:
            assert gate.wait(WAIT)
    return run


def test_a_stream_runs_in_order_and_streams_run_concurrently():
    dev, log, gate = D(8), [], threading.Event()
    a, b = dev.create_stream(), dev.create_stream()
    dev.launch(a, kernel(log, "a1", gate))
    dev.launch(a, kernel(log, "a2"))
    dev.launch(b, kernel(log, "b1"))
    assert dev.synchronize_stream(b, WAIT)  # b is not behind a's running kernel
    assert not dev.synchronize_stream(a, 0.05) and "a2" not in log  # a2 waits for a1
    gate.set()
    assert dev.synchronize_stream(a, WAIT) and log.index("a1") < log.index("a2")


def test_an_event_orders_one_stream_after_another():
    dev, log, gate = D(8), [], threading.Event()
    a, b, e = dev.create_stream(), dev.create_stream(), dev.create_event()
    dev.launch(a, kernel(log, "a1", gate))
    dev.record(e, a)
    dev.wait(b, e)
    dev.launch(b, kernel(log, "b1"))
    assert not dev.query_event(e) and not dev.synchronize_stream(b, 0.05)
    gate.set()
    assert dev.synchronize_event(e, WAIT) and dev.synchronize_stream(b, WAIT) and log == ["a1", "b1"]
    assert dev.synchronize_event(dev.create_event(), 0.0)  # never recorded: nothing to wait for


def test_the_legacy_stream_is_ordered_against_blocking_streams_only():
    dev, log, gate = D(8), [], threading.Event()
    blocking, non_blocking = dev.create_stream(blocking=True), dev.create_stream(blocking=False)
    dev.launch(LEGACY, kernel(log, "legacy", gate))
    dev.launch(non_blocking, kernel(log, "non-blocking"))
    dev.launch(blocking, kernel(log, "blocking"))
    assert dev.synchronize_stream(non_blocking, WAIT)
    assert not dev.synchronize_stream(blocking, 0.05)  # behind the legacy stream's kernel
    gate.set()
    assert dev.synchronize_stream(blocking, WAIT)
    assert log[-1] == "blocking" and sorted(log[:2]) == ["legacy", "non-blocking"]  # those two concurrently


def test_streams_on_one_hardware_queue_are_falsely_ordered():
    """A blocked head holds back the next stream's work on its queue: with 1 queue, b's
    kernel waits behind a's wait for an event; with 2 queues it does not."""
    for queues, b_runs_first in ((1, False), (2, True)):
        dev, log = D(queues), []
        a, b, e = dev.create_stream(), dev.create_stream(), dev.create_event()
        assert dev.queue_of(a) == a % queues and dev.queue_of(b) == b % queues
        c = dev.create_stream()  # the event's stream: records on it later
        gate = threading.Event()
        dev.launch(c, kernel(log, "c1", gate))
        dev.record(e, c)
        dev.wait(a, e)
        dev.launch(b, kernel(log, "b1"))
        assert dev.synchronize_stream(b, 0.05 if not b_runs_first else WAIT) == b_runs_first
        gate.set()
        assert dev.synchronize_stream(a, WAIT) and dev.synchronize_stream(b, WAIT)


def test_a_device_wide_sync_waits_for_every_stream():
    dev, log, gate = D(8), [], threading.Event()
    a = dev.create_stream()
    dev.launch(a, kernel(log, "a1", gate))
    assert not dev.synchronize_device(0.05)  # what cudaFree / cudaMalloc do: wait for a1 too
    gate.set()
    assert dev.synchronize_device(WAIT)


def test_a_replay_records_only_external_events_for_the_host():
    dev, log = D(8), []
    s, internal, external = dev.create_stream(), dev.create_event(), dev.create_event()
    dev.begin_capture(s)
    assert dev.is_capturing(s)
    dev.launch(s, kernel(log, "k"))
    dev.record(internal, s)
    dev.record(external, s, external=True)
    graph = dev.end_capture(s)
    assert log == [] and not dev.is_capturing(s)  # captured, not run
    gate = threading.Event()
    dev.launch(s, kernel(log, "before", gate))
    dev.replay(graph, s)
    for host_use in (lambda: dev.synchronize_event(internal, 0.0), lambda: dev.query_event(internal),
                     lambda: dev.wait(dev.create_stream(), internal)):
        # last recorded in the capture: only a point in the graph, nothing a host can wait for
        with pytest.raises(RuntimeError, match=r"last recorded in a capturing stream \(cudaErrorCapturedEvent\)"):
            host_use()
    assert not dev.synchronize_event(external, 0.05)  # the replay's record, behind "before" and "k"
    gate.set()
    assert dev.synchronize_event(external, WAIT) and log == ["before", "k"]


def test_a_capturing_thread_may_not_query_events():
    """torch's graphs capture in global mode: the capturing thread may not query an event (a
    finished one included) until the capture ends."""
    dev = D(8)
    s, other, e = dev.create_stream(), dev.create_stream(), dev.create_event()
    dev.record(e, other)
    assert dev.synchronize_event(e, WAIT)
    dev.begin_capture(s)
    for calling in (s, -1):  # the capturing thread's stream, or not told (any capture forbids it)
        with pytest.raises(RuntimeError, match=r"while a stream is capturing \(cudaErrorStreamCaptureUnsupported"):
            dev.query_event(e, calling)
    assert dev.query_event(e, other)  # a thread whose stream does not capture may (thread-local mode)
    dev.end_capture(s)
    assert dev.query_event(e, s)


def test_a_stream_waiting_on_a_captured_event_joins_the_capture():
    dev, log = D(8), []
    user, own, ready, done = dev.create_stream(), dev.create_stream(), dev.create_event(), dev.create_event()
    dev.begin_capture(user)
    dev.record(ready, user)
    dev.wait(own, ready)  # fork: own joins the capture
    assert dev.is_capturing(own)
    dev.launch(own, kernel(log, "on own"))
    dev.record(done, own)
    dev.wait(user, done)  # join
    graph = dev.end_capture(user)
    assert not dev.is_capturing(own) and log == []
    dev.replay(graph, user)
    dev.replay(graph, user)
    assert dev.synchronize_stream(user, WAIT) and log == ["on own", "on own"]


def unjoined(fn):
    """The message end_capture raised, or "" if it returned a graph."""
    try:
        fn()
    except RuntimeError as e:  # std::logic_error reaches Python as RuntimeError
        return str(e)
    return ""


def test_a_capture_whose_fork_is_not_joined_back_cannot_end():
    """cudaErrorStreamCaptureUnjoined: every node a forked stream adds must come before a
    point the origin stream waits for. The ringcoll order that broke on an H200 (2026-12-04):
    the `done` event recorded, then the external `replayed` record after it on the same
    stream, so the origin's wait for `done` left that last node unjoined."""
    dev = D(8)
    user, own = dev.create_stream(), dev.create_stream()
    ready, done, replayed = dev.create_event(), dev.create_event(), dev.create_event()

    def capture(order):
        dev.begin_capture(user)
        dev.record(ready, user)
        dev.wait(own, ready)
        dev.launch(own, lambda: None)
        for step in order:
            if step == "done":
                dev.record(done, own)
            else:
                dev.record(replayed, own, external=True)
        dev.wait(user, done)
        return dev.end_capture(user)

    message = unjoined(lambda: capture(["done", "replayed"]))
    assert "unjoined work" in message and "added 2 nodes; the origin waited for 1" in message, message
    assert not dev.is_capturing(user) and not dev.is_capturing(own)  # the capture ended all the same
    assert unjoined(lambda: capture(["replayed", "done"])) == ""  # the fixed order: the join covers both


def test_a_fork_joined_through_another_stream_counts_and_a_fork_never_joined_does_not():
    dev = D(8)
    user, a, b = dev.create_stream(), dev.create_stream(), dev.create_stream()
    e0, ea, eb = dev.create_event(), dev.create_event(), dev.create_event()
    dev.begin_capture(user)
    dev.record(e0, user)
    dev.wait(a, e0)
    dev.launch(a, lambda: None)
    dev.record(ea, a)
    dev.wait(b, ea)  # b comes after a's kernel
    dev.launch(b, lambda: None)
    dev.record(eb, b)
    dev.wait(user, eb)  # user joins b, and through it a
    assert unjoined(lambda: dev.end_capture(user)) == ""
    dev.begin_capture(user)
    dev.record(e0, user)
    dev.wait(a, e0)
    dev.launch(a, lambda: None)  # never waited for
    assert "unjoined work" in unjoined(lambda: dev.end_capture(user))


class _ReportsOnce:
    """CudaComm's check_error and synchronize as cuda_comm.cu has them: a kernel error is
    raised once, then the broken communicator's checks return quietly."""

    def __init__(self):
        self.reported = False

    def check_error(self):
        if not self.reported:
            self.reported = True
            from ringcoll.errors import RingcollMismatchError
            raise RingcollMismatchError("all_reduce: mismatched collective calls")

    synchronize = check_error


class _DoneEvent:
    def query(self):
        return True

    def synchronize(self):
        pass


def test_the_cuda_transport_raises_a_kernel_error_at_every_check_not_once():
    """CudaComm reports an error once: the second Work.exception() was None, is_success()
    True, and Work.synchronize() and comm.synchronize() returned, the outputs garbage (the
    emulated transport keeps its error, so CI never saw it). The CUDA transport keeps the
    first error and raises it at every check after."""
    from ringcoll.errors import RingcollMismatchError
    from ringcoll.transports.cuda import CudaTransport, StreamCompletion

    transport = object.__new__(CudaTransport)  # its checks only: no GPU needed
    transport._comm, transport._lock, transport._first_error = _ReportsOnce(), threading.Lock(), None
    transport._refuse_in_capture = lambda op: None
    work = StreamCompletion(transport, _DoneEvent(), "all_reduce", captured=False)
    assert isinstance(work.error(), RingcollMismatchError)
    assert isinstance(work.error(), RingcollMismatchError)  # was None
    with pytest.raises(RingcollMismatchError):
        work.synchronize()
    with pytest.raises(RingcollMismatchError):
        transport.synchronize()
    with pytest.raises(RingcollMismatchError):
        transport.check_error()


_HAMMER = """
import threading
from ringcoll import _C
dev = _C.emulation.Device(32)
def hammer(s):
    for _ in range(300):
        dev.launch(s, lambda: None)
        e = dev.create_event(); dev.record(e, s); dev.destroy_event(e)
    assert dev.synchronize_stream(s, 10)
threads = [threading.Thread(target=hammer, args=(dev.create_stream(),)) for _ in range(4)]
[t.start() for t in threads]; [t.join() for t in threads]
"""


def test_python_kernels_launched_from_several_threads_do_not_deadlock_the_model():
    """A kernel given as a Python function: its worker dropped the function (taking the GIL)
    only as the thread ended, after reporting it finished; the dispatcher joins finished
    workers holding the device's mutex, which a Python thread (holding the GIL) waited for:
    3 of 3 runs hung, 4 threads of 300 launches. In a process of its own, bounded."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", _HAMMER], check=True, timeout=120)
