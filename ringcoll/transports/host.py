"""The shared-memory transport: CPU tensors of P processes on one machine (csrc/host/).

Bootstrap: each rank draws a name for its shared-memory segment, the names go round the
group, and the extension creates, maps and unlinks the segments (host_comm.cpp). After that
no collective touches the process group again.

Collectives run on the calling thread; with ``async_op=True`` they run, in call order, on
one worker thread and a Completion (ThreadCompletion) is returned. One collective at a time
is on the ring: a synchronous call first waits for the queued ones (CallQueue; a call made
from a Future callback on the worker runs in line there).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import os
import socket
import threading
import time
import weakref
from typing import Callable, Optional, Sequence

import torch

from ringcoll import _C
from ringcoll.errors import RingcollError, RingcollTimeoutError
from ringcoll.transports.base import CollectiveCall, Settings, Transport


def shared_memory_domain() -> str:
    """What two processes must share to map each other's segments: the same kernel (boot
    id: a hostname can repeat, and containers share one) and the same /dev/shm file system
    (device number: a container or a private mount namespace may mount its own)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()  # no procfs (not Linux): the best name we have
    return f"{boot}/shm-dev-{os.stat('/dev/shm').st_dev if os.path.isdir('/dev/shm') else 'none'}"


def ranks_by_domain(domains: list) -> dict:
    """Rank r's domain is domains[r]: each domain -> its ranks, domains in the order of their
    first rank (the same dict on every rank that holds the same list)."""
    ranks: dict = {}
    for rank, domain in enumerate(domains):
        ranks.setdefault(domain, []).append(rank)
    return ranks


def _require_one_domain(domains: list) -> None:
    """Raise at once, on every rank alike (they all hold the same list), when ranks cannot
    share memory: their segments could never appear to each other, so waiting would only
    run into the timeout."""
    if len(set(domains)) == 1:
        return
    hosts = ranks_by_domain(domains)
    groups = "; ".join(f"ranks {', '.join(map(str, ranks))} on {domain}" for domain, ranks in hosts.items())
    raise RingcollError("Communicator: the shared-memory transport needs every rank on one machine (one "
                        f"kernel and one /dev/shm), but the ranks are on {len(hosts)}: {groups}. Across "
                        "machines use init_process_group(\"ringcoll\"), which goes hierarchical by itself, or "
                        "ringcoll.training.hierarchical.HierarchicalCommunicator (the ring inside each machine, "
                        "torch.distributed between them).")


class ThreadCompletion:
    """A collective queued on the worker thread, as ringcoll.Work sees it.

    It finishes in one step, on the worker, before the worker takes the next call: the
    error (if any) is recorded, the ``on_done`` callbacks run (Work.get_future's torch
    Future is completed there, so its ``then`` callbacks run there too), and only then are
    waiters woken. So a waiter never sees the call done before its Future is (gloo does the
    same). A callback that waits for this call itself is answered at once (``wait`` on the
    worker); one that waits for a later call would wait for itself and is refused (see
    CallQueue)."""

    def __init__(self, name: str, queue: Optional["CallQueue"] = None):
        self._name = name
        self._queue = queue  # the queue whose worker runs it (None: finished when made)
        self._lock = threading.Lock()
        self._claimed = False  # taken by the worker (start) or given up (give_up): one of them, once
        self._ran = False  # the collective itself has run; its callbacks may still be running
        self._error: Optional[BaseException] = None
        self._callbacks: list = []
        self._finished = threading.Event()  # ... and so have its callbacks: waiters may go

    @classmethod
    def finished(cls, name: str, error: Optional[BaseException] = None) -> "ThreadCompletion":
        """A completion for a call that has already run (inline, or synchronously)."""
        completion = cls(name)
        completion.finish(error)
        return completion

    def finish(self, error: Optional[BaseException]) -> None:
        """Record the outcome, run the callbacks, then wake the waiters (on the worker)."""
        with self._lock:
            self._ran, self._error = True, error
            callbacks, self._callbacks = self._callbacks, []
        try:
            for fn in callbacks:
                fn()
        finally:
            self._finished.set()  # whatever a callback did, no waiter is left hanging

    def _claim(self) -> bool:
        """True for the first of start() and give_up() to ask, False for the other."""
        with self._lock:
            claimed, self._claimed = self._claimed, True
            return not claimed

    def start(self) -> bool:
        """The worker takes the call: False if it was given up while queued (give_up)."""
        return self._claim()

    def give_up(self, error: BaseException) -> bool:
        """Finish a call the worker has not taken with `error` (its callbacks run here);
        False if the worker had taken it."""
        if not self._claim():
            return False
        self.finish(error)
        return True

    def wait(self, timeout: Optional[float]) -> None:
        on_worker = self._queue is not None and self._queue.on_worker()
        if on_worker and not self._ran:
            raise RingcollError(f"{self._name}: waited for on the ringcoll worker thread (in a callback of an "
                                "earlier call's Future), but it is queued behind that call on this very thread, "
                                "so it could never run: wait for it outside the callback")
        if not on_worker and not self._finished.wait(timeout):
            raise RingcollTimeoutError(f"{self._name}: Work.wait(timeout={timeout:g} s) timed out: the collective "
                                       "had not finished (it is still bounded by the communicator's own timeout)")
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        return self._finished.is_set()

    def error(self) -> Optional[BaseException]:
        return self._error if self._ran else None

    def on_done(self, fn: Callable[[], None]) -> None:
        """fn() once the call has run: on the worker, before waiters wake; at once if it has."""
        with self._lock:
            if not self._ran:
                self._callbacks.append(fn)
                return
        fn()

    def synchronize(self) -> None:
        self.wait(None)

    def wait_finished(self) -> None:
        """Block until the call and its callbacks have run, raising nothing (its error is its Work's)."""
        self._finished.wait()


class CallQueue:
    """Collectives in call order: run now on the calling thread (sync) or queued on one
    worker thread (async). A synchronous call first waits for the queued ones, and one
    call at a time runs, so every rank's calls reach the ring in the order they were made.
    The hierarchical communicator (training/hierarchical.py) orders its calls the same way.

    Callbacks. A queued call's Future (Work.get_future) is completed on the worker, so its
    ``then`` callbacks run there, right after the call. A collective issued from such a
    callback (torch's PowerSGD hook issues one and waits for it) runs at once, in line on
    the worker: had it been queued, the worker would wait for itself. It is thus the next
    call on the ring on every rank whatever the timing (nested calls go depth first, before
    anything queued later), as a callback chain under NCCL runs within its parent's call.
    A callback that waits for a later call's Future waits for itself: past `timeout` the
    queue gives the later calls up with an error (_watch). In a child of fork() the queue
    forgets the parent's threads and locks (_after_fork_in_child)."""

    def __init__(self, timeout: Optional[float] = None):
        self._worker: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._worker_ident: Optional[int] = None
        self._last_async: Optional[ThreadCompletion] = None
        self._lock = threading.Lock()  # one collective at a time
        self._queue_lock = threading.Lock()  # the worker made once, _last_async set and cleared whole
        self._timeout = timeout  # how long a call's callbacks may hold the worker (the communicator's)
        self._queued: collections.deque = collections.deque()  # submitted, not yet taken by the worker
        self._in_callbacks: Optional[tuple] = None  # (the call whose callbacks run, since when)
        self._given_up: Optional[str] = None  # why the queue gave its calls up (_watch)
        self._closing = threading.Event()
        _queues.add(self)

    def _after_fork_in_child(self) -> None:
        """In a child of fork(): the worker and the watch are the parent's threads, which the
        child does not have, and either may have held a lock at the fork. Fresh locks and no
        worker, so close() returns (the extension refuses calls there: HostComm)."""
        self._worker = self._worker_ident = self._last_async = None
        self._lock, self._queue_lock, self._closing = threading.Lock(), threading.Lock(), threading.Event()
        self._queued.clear()
        self._in_callbacks = None

    def on_worker(self) -> bool:
        """Whether this thread is the worker (running a call or one of its callbacks)."""
        return self._worker_ident == threading.get_ident()

    def submit(self, run: Callable[[], None], async_op: bool, name: str = "collective") -> Optional[ThreadCompletion]:
        """Run `run` now (sync) or queue it (async) behind earlier async work; on the worker
        itself (in a callback) run it now either way (the class doc)."""
        self._refuse_if_given_up(name)
        if self.on_worker():  # the worker holds the lock already
            try:
                if not async_op:
                    run()
                    return None
                return ThreadCompletion.finished(name, _error_of(run))
            finally:
                self._progressed()
        if not async_op:
            self.run_now(run)
            return None

        # The worker thread does not inherit the caller's thread-local autograd state: carry
        # it, so the copies after the ring behave as they would on the calling thread (an
        # output made under inference_mode may only be written under it).
        grad_enabled, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        completion = ThreadCompletion(name, self)

        def locked_run() -> None:
            with self._queue_lock:
                self._queued.popleft()  # this one: the worker takes them in order
            if not completion.start():  # given up while queued (_watch)
                return
            with self._lock, torch.inference_mode(inference), torch.set_grad_enabled(grad_enabled):
                error = _error_of(run)
                self._in_callbacks = (completion, time.monotonic())
                try:
                    completion.finish(error)
                finally:
                    self._in_callbacks = None

        with self._queue_lock:  # two threads queueing at once still make one worker, one order
            if self._worker is None:
                self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ringcoll",
                                                                     initializer=self._become_worker)
                if self._timeout is not None:
                    threading.Thread(target=self._watch, name="ringcoll-watch", daemon=True).start()
            self._queued.append(completion)
            self._worker.submit(locked_run)
            self._last_async = completion
        return completion

    def _progressed(self) -> None:
        """A call made in a callback has run: the callbacks are moving (_watch)."""
        busy = self._in_callbacks
        if busy is not None:
            self._in_callbacks = (busy[0], time.monotonic())

    def _watch(self) -> None:
        """A callback may wait for a later call (a Future it was handed before): that call is
        queued behind the callback on this one worker, so it would wait forever. When the
        callbacks have run no call for longer than the timeout (the bound of any wait on the
        ring: peers waiting for this rank's next call give up then too), every call still
        queued is given up with an error (the Future waited for then fails, and the callback
        returns), and the queue refuses new calls: on this rank those calls never ran, so the
        communicator cannot go on with its peers."""
        period = min(max(self._timeout / 10, 0.05), 5.0)
        while not self._closing.wait(period):
            busy = self._in_callbacks
            if busy is None or time.monotonic() - busy[1] < self._timeout or not self._queued:
                continue
            with self._queue_lock:
                queued = list(self._queued)
                self._given_up = (f"the callbacks of {busy[0]._name}'s Future held the ringcoll worker, making no call, "
                                  f"for more than the {self._timeout:g} s timeout while {len(queued)} later call(s) "
                                  "waited behind them; a callback that waits for a later call's Future waits for itself (wait for "
                                  "it outside the callback). Those calls never ran here: make a new communicator")
            for completion in queued:
                completion.give_up(RingcollError(f"{completion._name}: given up: {self._given_up}"))

    def _refuse_if_given_up(self, name: str) -> None:
        if self._given_up is not None:
            raise RingcollError(f"{name}: this communicator's queue gave up its calls: {self._given_up}")

    def _become_worker(self) -> None:
        self._worker_ident = threading.get_ident()

    def run_now(self, fn: Callable, *args) -> None:
        """fn(*args) on this thread, after the queued calls: a synchronous call (no closure
        and no Future, which cost a small call as much as its ring step)."""
        if self._given_up is not None:
            self._refuse_if_given_up("collective")
        if self.on_worker():  # in a callback: in line (the class doc); the worker holds the lock
            try:
                fn(*args)
            finally:
                self._progressed()
            return
        if self._last_async is not None:
            self.synchronize()  # keep call order; a queued call's error is its own
        # acquire/release rather than `with`: the same, at half the cost (~0.2 us)
        self._lock.acquire()
        try:
            fn(*args)
        finally:
            self._lock.release()

    @property
    def idle(self) -> bool:
        """Nothing queued or running on the worker (as of the last synchronize)."""
        return self._last_async is None

    def synchronize(self) -> None:
        """Wait until the queued calls have run; their errors are their Works'. (On the
        worker, in a callback, they have: the queue runs in order.)"""
        pending = self._last_async
        if pending is not None and not self.on_worker():
            pending.wait_finished()  # bounded: each queued call is bounded by the ring's timeout
            with self._queue_lock:
                if self._last_async is pending:  # nothing queued since: the worker is idle
                    self._last_async = None

    def close(self, last: Callable[[], None]) -> None:
        """Finish the queued calls, then run `last` (the release) alone."""
        if self.on_worker():  # it would wait for the calls queued behind this very callback
            raise RingcollError("close: called on the ringcoll worker thread (in a callback of a call's Future), "
                                "where the calls queued behind the callback cannot finish; close the communicator "
                                "outside the callback")
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self._closing.set()
        with self._lock:
            last()


_queues: "weakref.WeakSet[CallQueue]" = weakref.WeakSet()  # every live queue, for fork's child


def _reset_queues_in_child() -> None:
    for queue in list(_queues):
        queue._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_queues_in_child)


def _error_of(run: Callable[[], None]) -> Optional[BaseException]:
    """Run `run`; the exception it raised, or None."""
    try:
        run()
    except BaseException as e:  # noqa: BLE001 -- it is the call's outcome, raised by whoever waits for it
        return e
    return None


class HostTransport(Transport):
    """Shared-memory ring over ``_C.HostComm`` (see the module doc)."""

    slot_alignment = _C.host_slot_alignment
    takes_arrays = False  # a CPU array is not viewed as a tensor: the caller passes tensors
    tuned = True  # auto reads ringcoll/tuning_cpu.json, measured on this transport

    @staticmethod
    def resolve_device(device):
        return device  # "cpu": nothing to pick

    def __init__(self, settings: Settings, exchange: Callable[..., list]):
        # The one-shot threshold decides, call by call, which algorithm every rank runs: it
        # must agree, like the buffer size (a rank on the ring and one on the one-shot path
        # would wait for each other's publications until the timeout).
        # So must the direct-read threshold; whether peers may be read is agreed in the probe.
        # And what decides whether a rank probes its neighbour hop (the slots' stores, and
        # whether its waits spin): a rank that probes waits for a token its neighbour, not
        # probing, never passes on, and both time out naming the wrong cause.
        offers = exchange((_C.random_segment_name(), shared_memory_domain()),
                          **{"RINGCOLL_SMALL_BYTES / small_bytes=": settings.small_bytes,
                             "RINGCOLL_DIRECT_BYTES / direct_bytes=": settings.direct_bytes,
                             "RINGCOLL_DIRECT_MAX_BYTES": settings.direct_max_bytes,
                             "RINGCOLL_SLOT_STORES": os.environ.get("RINGCOLL_SLOT_STORES", "auto"),
                             "shares_cores=": bool(settings.shares_cores)})
        _require_one_domain([domain for _, domain in offers])
        names = [name for name, _ in offers]
        self._comm = _C.HostComm(settings.rank, settings.world_size, names, settings.buffer_bytes,
                                 settings.timeout, settings.check, settings.small_bytes, settings.direct_bytes,
                                 settings.direct_max_bytes, settings.shares_cores)
        self._calls = CallQueue(settings.timeout)
        self.plain_calls = self._comm

    def submit(self, call: CollectiveCall, outputs: list, keep_alive: Sequence, async_op: bool,
               then: Optional[Callable[[], None]] = None, name: Optional[str] = None) -> Optional[ThreadCompletion]:
        if not async_op:
            if then is None:  # the plain tensor forms: straight to the binding, one frame less
                self._calls.run_now(self._comm.run, *call)
            else:
                self._calls.run_now(self._run, call, then)
            self._plain_calls_when_idle()
            return None
        # The queued run holds the call's tensors itself: `call` has their addresses only, and
        # a Work dropped before the worker got to it took the last references with it (the
        # run then read and wrote freed memory: SIGSEGV), where gloo's Work keeps them alive.
        held = (outputs, keep_alive)
        completion = self._calls.submit(lambda: (held, self._run(call, then)) and None, async_op,
                                        name or call.collective)
        self._plain_calls_when_idle()  # not until the queue is drained: later calls must wait for it
        return completion

    def _plain_calls_when_idle(self) -> None:
        """Hand the Communicator the plain calls again once the worker has nothing queued."""
        self.plain_calls = self._comm if self._calls.idle else None

    def _run(self, call: CollectiveCall, then: Optional[Callable[[], None]]) -> None:
        self._comm.run(*call)  # one binding call takes the whole record (bind_host.cpp)
        if then is not None:
            then()

    def bind(self, call: CollectiveCall) -> Callable[[], None]:
        """`call` as a synchronous run with nothing left to decide (Communicator.prepare_*)."""
        return functools.partial(self._calls.run_now, self._comm.run, *call)

    def hold_plan(self, compiled) -> int:
        """Keep `compiled` (a _C.CompiledPlan) in the extension, for the plain calls to name by
        the index returned (HostComm::hold_plan says why)."""
        return self._comm.hold_plan(compiled)

    def prepare_plain(self, name: str, tensors: tuple, layout: tuple, call: CollectiveCall):
        """`call` read once by the extension: calling the result checks that `tensors` are
        still as `layout` says, then runs the call (true), or runs nothing (false). Only
        while ``plain_calls`` is set (nothing queued), as the plain calls."""
        return self._comm.prepare(name, tensors, layout, *call)

    def barrier(self, async_op: bool) -> Optional[ThreadCompletion]:
        completion = self._calls.submit(self._comm.barrier, async_op, "barrier")
        self._plain_calls_when_idle()
        return completion

    def synchronize(self) -> None:
        """Wait until the queued async calls have run; their errors are their Works'."""
        self._calls.synchronize()
        self._plain_calls_when_idle()

    @property
    def one_shot_calls(self) -> int:
        """How many collectives took the one-shot path for small messages (for tests)."""
        return self._comm.one_shot_calls

    @property
    def one_slice_early_calls(self) -> int:
        """How many calls of one slice ran a plan whose sends go before the call check (native's
        one-shot, the oneshot plan, a plan registered with sends_early; for tests)."""
        return self._comm.one_slice_early_calls

    @property
    def direct_reads(self) -> bool:
        """Whether all-gathers from direct_bytes read peers directly (every rank could read every peer)."""
        return self._comm.direct_reads

    @property
    def direct_reads_unavailable(self) -> str:
        """Why not, if not: "off", or the first failed probe this rank saw."""
        return self._comm.direct_reads_unavailable

    @property
    def oversubscribed(self) -> bool:
        """Whether some rank has fewer cores than there are ranks (agreed at bootstrap, where
        direct reads are on): the one-shot path then goes before direct reads."""
        return self._comm.oversubscribed

    @property
    def direct_calls(self) -> int:
        """How many all-gathers read peers directly (for tests)."""
        return self._comm.direct_calls

    @property
    def slot_bytes(self) -> int:
        return self._comm.slot_bytes

    @property
    def slot_stores(self) -> dict:
        """How this rank writes the slots its neighbours read (RINGCOLL_SLOT_STORES; the
        neighbour-hop probe in csrc/host/host_comm.cpp): `streaming` (now), the latest `hop_ns`
        measured (0: never probed), how many `probes` found the hop slow (`slow_probes`),
        whether this rank `probing` at all (not where ranks take turns on cores), and the store
        probe's: how many ran (`store_probes`), the hop its verdict holds near
        (`store_probe_hop_ns`, 0: none) and the verdict (`store_probe_streams`)."""
        c = self._comm
        return {"streaming": c.stream_slots, "hop_ns": c.hop_ns, "probes": c.hop_probes,
                "slow_probes": c.slow_hop_probes, "probing": c.probes_hops, "store_probes": c.store_probes,
                "store_probe_hop_ns": c.store_probe_hop_ns, "store_probe_streams": c.store_probe_streams}

    def allocate_symmetric(self, nbytes: int, dtype: int, dims: list) -> torch.Tensor:
        """A block of this rank's symmetric memory (ringcoll/symmetric_heap.h) as bytes: collective,
        so in call order with the queued collectives. The tensor holds the block
        (torch.frombuffer keeps its buffer), the block the arena."""
        block = []
        self._calls.run_now(lambda: block.append(self._comm.allocate_symmetric(nbytes, dtype, dims)))
        return torch.frombuffer(block[0], dtype=torch.uint8)

    def is_symmetric(self, address: int) -> bool:
        return self._comm.is_symmetric(address, 1)

    @property
    def zero_copy_calls(self) -> int:
        """How many collectives read their peers' symmetric memory in place (for tests)."""
        return self._comm.zero_copy_calls

    @property
    def symmetric_arenas(self) -> int:
        """How many arenas of symmetric memory this communicator has made."""
        return self._comm.symmetric_arenas

    def launch_on_stream(self, call: CollectiveCall, stream) -> None:
        raise ValueError(f"{call.collective}: arrays on a given stream need a CUDA communicator; "
                         "this one serves CPU tensors")

    def close(self, wait_for_peers: bool = True) -> None:
        """Finish queued async work, then unmap the shared memory."""
        self._calls.close(self._comm.close)
