"""The CPU transports' call queue (transports/host.py, CallQueue): call order, callbacks, and
what a waiter sees, with plain Python calls standing in for collectives (no processes).

The multi-process checks of the same contract through torch.distributed are in
tests/multiprocess/test_backend.py (test_wait_returns_only_once_the_future_is_done, ...).
"""

import threading
import time

import pytest
import torch

from ringcoll.communicator import Work
from ringcoll.errors import RingcollError, RingcollTimeoutError
from ringcoll.transports.host import CallQueue


def _gated(queue: CallQueue, log: list, name: str):
    """Queue a call that records `name` once its gate is opened; (gate, its Work)."""
    gate = threading.Event()

    def run():
        assert gate.wait(10)
        log.append(name)

    return gate, Work(queue.submit(run, async_op=True, name=name), [torch.zeros(1)])


def _noting_errors(seen: list, action, errors=RingcollError):
    """A Future callback that runs action() and notes the message of the error it raises."""
    def callback(_):
        try:
            action()
        except errors as e:
            seen.append(str(e))
    return callback


def test_a_collective_issued_in_a_callback_runs_next_in_line():
    """A callback on the worker issues a call and waits for it (torch's PowerSGD hook): it runs
    at once, before a call queued earlier by the caller, so every rank runs the same order."""
    queue, log = CallQueue(), []
    gate, first = _gated(queue, log, "first")
    nested_results = []

    def callback(_):
        nested = Work(queue.submit(lambda: log.append("nested"), async_op=True, name="nested"), [torch.ones(1)])
        nested_results.append(nested.get_future().wait()[0].item())  # would wait for itself if queued
        return torch.ones(1)

    chained = first.get_future().then(callback)
    second = Work(queue.submit(lambda: log.append("second"), async_op=True, name="second"), [])
    gate.set()
    second.wait(10)
    assert chained.wait().item() == 1.0 and nested_results == [1.0]
    assert log == ["first", "nested", "second"]
    queue.close(lambda: None)


def test_waiting_in_a_callback_for_a_call_queued_behind_it_is_refused():
    queue, log = CallQueue(), []
    gate, first = _gated(queue, log, "first")
    second = Work(queue.submit(lambda: log.append("second"), async_op=True, name="all_gather"), [])
    seen = []
    first.get_future().then(_noting_errors(seen, second.wait))
    gate.set()
    second.wait(10)
    assert len(seen) == 1 and seen[0].startswith("all_gather: waited for on the ringcoll worker thread"), seen
    assert log == ["first", "second"]
    queue.close(lambda: None)


def test_a_callback_waiting_for_a_later_calls_future_fails_at_the_timeout_instead_of_hanging():
    """The Future of a call queued behind the callback's own, taken before and waited for in
    the callback (torch's Future.wait, which ringcoll cannot refuse as it refuses
    Work.wait): it waited forever, and so did close(). Past the queue's timeout the calls
    still queued are given up with an error, the Future fails, the callback returns; later
    calls are refused, as on a broken communicator."""
    queue, log = CallQueue(timeout=0.5), []
    gate, first = _gated(queue, log, "first")
    second = Work(queue.submit(lambda: log.append("second"), async_op=True, name="all_gather"), [torch.ones(1)])
    later = second.get_future()
    seen = []
    chained = first.get_future().then(_noting_errors(seen, later.wait, RuntimeError))
    started = time.monotonic()
    gate.set()
    chained.wait()
    assert 0.5 <= time.monotonic() - started < 3.0
    assert len(seen) == 1 and "all_gather: given up: the callbacks of first's Future held the ringcoll worker, making no call" in seen[0]
    assert log == ["first"]  # the call given up never ran
    with pytest.raises(RingcollError, match="all_gather: given up"):
        second.wait(1)
    with pytest.raises(RingcollError, match="reduce: this communicator's queue gave up its calls"):
        queue.submit(lambda: None, async_op=True, name="reduce")
    queue.close(lambda: None)


def test_wait_returns_only_after_the_future_and_its_callbacks():
    queue, log = CallQueue(), []
    gate, work = _gated(queue, log, "call")
    future = work.get_future()
    in_callback = []
    future.then(lambda fut: in_callback.append(work.wait()))  # on the worker: answered at once
    gate.set()
    work.wait(10)
    assert future.done() and in_callback == [True]
    queue.close(lambda: None)


def test_a_failed_call_fails_its_future_for_cpp_too():
    """The Future fails as a `then` chain (C++: DDP's reducer) sees a failure: its callbacks
    see the error, and wait() raises a RuntimeError quoting it."""
    queue = CallQueue()

    def run():
        raise RingcollError("all_reduce: peer rank 1 has exited")

    work = Work(queue.submit(run, async_op=True, name="all_reduce"), [torch.zeros(1)])
    chained = work.get_future().then(lambda fut: fut.value())
    with pytest.raises(RuntimeError, match="RingcollError: all_reduce: peer rank 1 has exited"):
        chained.wait()
    with pytest.raises(RingcollError, match="peer rank 1 has exited"):
        work.wait()
    assert work.is_completed() and not work.is_success()
    queue.close(lambda: None)


def test_wait_timeout_names_the_op_and_is_a_runtime_error():
    queue, log = CallQueue(), []
    gate, work = _gated(queue, log, "reduce_scatter_tensor")
    with pytest.raises(RingcollTimeoutError) as caught:
        work.wait(0.01)
    assert isinstance(caught.value, RuntimeError) and isinstance(caught.value, TimeoutError)
    assert str(caught.value).startswith("reduce_scatter_tensor: Work.wait(timeout=0.01 s) timed out")
    gate.set()
    assert work.wait(10) and log == ["reduce_scatter_tensor"]
    queue.close(lambda: None)


def test_close_in_a_callback_is_refused_and_leaves_the_queue_usable():
    """close() from a Future's callback joined the worker from itself (RuntimeError: cannot
    join current thread) after the communicator had marked itself closed, so its memory
    stayed mapped and no later close() released it."""
    queue, log, released = CallQueue(), [], []
    gate, first = _gated(queue, log, "first")
    seen = []
    chained = first.get_future().then(_noting_errors(seen, lambda: queue.close(lambda: released.append(True))))
    gate.set()
    chained.wait()
    assert len(seen) == 1 and seen[0].startswith("close: called on the ringcoll worker thread"), seen
    assert released == []
    Work(queue.submit(lambda: log.append("second"), async_op=True, name="second"), []).wait(10)
    queue.close(lambda: released.append(True))
    assert log == ["first", "second"] and released == [True]


def _close_in_a_callback(group):
    import ringcoll

    comm = ringcoll.Communicator(group=group)
    seen = []
    comm.all_reduce(torch.ones(4), async_op=True).get_future().then(_noting_errors(seen, comm.close)).wait()
    still_open = not comm._closed
    comm.close()
    return seen, still_open, comm._closed


def test_a_communicator_closed_from_a_callback_stays_open_and_closes_later():
    import ringcoll

    [(seen, still_open, closed)] = ringcoll.run_in_process(1, _close_in_a_callback)
    assert len(seen) == 1 and "close: called on the ringcoll worker thread" in seen[0]
    assert still_open and closed


def test_a_callback_that_keeps_making_calls_is_not_given_up():
    """The watch counts time since the callbacks last ran a call (PowerSGD's make several,
    in line), not since they began: a long chain of nested calls, each well within the
    timeout, while a later call waits behind it, runs to its end."""
    queue, log = CallQueue(timeout=0.3), []
    gate, first = _gated(queue, log, "first")
    second = Work(queue.submit(lambda: log.append("second"), async_op=True, name="second"), [])

    def callback(_):
        for i in range(8):  # 0.8 s in all, 0.1 s between calls
            time.sleep(0.1)
            Work(queue.submit(lambda i=i: log.append(f"nested {i}"), async_op=True, name="nested"), []).wait()

    chained = first.get_future().then(callback)
    gate.set()
    chained.wait()
    second.wait(10)
    assert log == ["first", *(f"nested {i}" for i in range(8)), "second"]
    queue.close(lambda: None)
