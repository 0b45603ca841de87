"""Hypothesis fuzzer for the CUDA transport, on the emulator: the CUDA kernels' own code
(the ring kernels, the plan kernels of every algorithm, symmetric memory) run on CPU threads
by ringcoll/transports/emulated.py, with the ranks as threads of this process.

    python -m ringcoll.harness.fuzz_cuda --examples 5000 [--seed S] [--case-timeout 60]

The cases, their inputs and their checks are ringcoll/harness/fuzz.py's (read its module
doc): an example is one collective call in one of its forms (plain, repeated, prepared,
coalesced), drawn by the same strategy over this transport's :data:`SPACE`: world 1-5,
every collective (all_reduce, reduce_scatter_tensor, all_gather_into_tensor, the list forms,
broadcast / reduce from a drawn root), dtype, op, count (0, tiny, at slice boundaries, over
the registered buffer), in place or not, async or not, the algorithm (auto, native: the
ring kernels, and every built-in plan the collective has: the plan kernels), a small
``buffer_bytes`` (so messages take several slices; a small ``small_bytes`` too, so native
broadcast and reduce take their pipelines above 1 KiB), misaligned views, special values,
symmetric memory (``comm.empty``) or ordinary tensors; and here also the kernel variant
(RINGCOLL_CUDA_KERNEL fused or naive, read when a communicator is built). What differs:

* Only the Communicator API, on the default group of the case's world: the module-level
  drop-ins choose their transport by the tensor's device (CPU: shared memory), and ranks
  that are threads of one group have no subgroups.
* No gloo: each rank checks its results against the plain reference alone (exact bits,
  NaN-aware for reductions), memory next to every output untouched, out-of-place inputs
  unchanged, what each call returned; the pool then checks that every rank's all_reduce /
  all_gather / broadcast results are bitwise identical (fuzz.check_replies).

Design (speed: the emulator is cheap, ~3 ms to build a 5-rank communicator and a few ms a
call; a run_in_process per example would add thread starts and a communicator each time):

* :class:`EmulatedPool` keeps one :class:`_World` per world size, started at its first
  case: ``run_in_process`` on a host thread of its own, whose rank threads take cases from
  an inbox each and put their replies on one queue. Each rank caches communicators per
  (buffer_bytes, variant), the least recently used closed past LIVE_COMMUNICATORS (every
  rank closes the same one at the same case: the close is collective on CUDA). The cap
  keeps every live stream on a hardware queue of its own (see LIVE_COMMUNICATORS).
* The kernel variant is an environment variable the transport reads when it is built: the
  pool sets it before handing out each case (one case at a time), and restores it at close.
* Every wait is bounded: the pool waits ``case_timeout`` seconds for a case's replies,
  every ring wait gives up after COMM_TIMEOUT. A case that runs over, a rank thread that
  raised, or a world whose run_in_process ended tears down EVERY world (threads told to
  stop, joined for a bounded time, else left to end at their communicators' timeout) and
  gives the process a fresh emulated device (a stuck rank's work stays queued on the old
  one, where it would falsely order a new ring's streams), so the next case, and a shrink,
  starts clean. A wrong value alone keeps the pool: every rank finished the call.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import traceback
import warnings

from ringcoll import _C, api
from ringcoll.harness import fuzz
from ringcoll.harness.fuzz import PoolError
from ringcoll.transports import emulated
from ringcoll.transports.cuda import IN_PROCESS_HARDWARE_QUEUES, KERNEL_VARIANTS

VARIANT_VARIABLE = "RINGCOLL_CUDA_KERNEL"
# Registered buffer per rank: 1280 is the 5-rank minimum (2 banks x 5 ranks x 128-byte
# slots); 1500 does not divide into slots (an unused tail); 8192 fits the rooted pipelines'
# 16 chunks at every world; 512 KiB gives slots of several 32 KiB tiles (strip.h), so the
# kernels run grids of several blocks (2 at P = 5, up to 8 at P = 1), smaller ones one block.
BUFFER_CHOICES = (1280, 1500, 2048, 4096, 8192, 1 << 19)
# The communicators' small_bytes: native (and auto, which is native on CUDA) broadcast and reduce
# take the one-shot up to it and their pipelines (the star, the chain) above. The default,
# 64 KiB, is above every message drawn here (at most 4 buffers), so it is lowered.
SMALL_BYTES = 1024
COMM_TIMEOUT = 20.0  # a ring wait, or a bootstrap exchange, that outlasts this raises in the rank
CASE_TIMEOUT = 60.0  # the pool gives up on a case (and tears down every world) after this
# Per world. The emulated device spreads ALL the process's streams over
# IN_PROCESS_HARDWARE_QUEUES in-order queues (stream i on queue i mod 32), and two ranks of a
# ring whose streams share a queue stop each other until the timeout, as on a GPU (docs/cuda.md,
# "One hardware queue per stream": a GPU does not say which queue a stream is on). Each
# communicator takes a stream per rank: 2 per world came to 30 streams of 32 queues, and
# streams past 32 (idle ones are reused, not all were back yet) made rare timeouts at P = 5;
# 1 per world is 15 streams.
LIVE_COMMUNICATORS = 1
JOIN_SECONDS = 5.0  # a world's threads told to stop, after a failure, are waited for this long


SPACE = fuzz.Space(groups=("default",), apis=("comm",), buffers=BUFFER_CHOICES,
                   slot_alignment=emulated.EmulatedCudaTransport.slot_alignment, variants=tuple(KERNEL_VARIANTS),
                   plan_slot_area=emulated.EmulatedCudaTransport.plan_slot_area)


def _communicator_class():
    from ringcoll.communicator import Communicator

    class EmulatedCudaCommunicator(Communicator):
        """A Communicator over the emulated CUDA transport (as the tests make one)."""

        @staticmethod
        def transport_class(device):
            return emulated.EmulatedCudaTransport

    return EmulatedCudaCommunicator


class _EmulatedRank(fuzz._Worker):
    """One rank thread's state: fuzz.py's case runner, over emulated CUDA communicators of the
    thread's in-process group, without gloo."""

    Communicator = None  # the class, made once

    def __init__(self, group):
        super().__init__(group.rank, group.world_size)
        self.bootstrap = group
        if _EmulatedRank.Communicator is None:
            _EmulatedRank.Communicator = _communicator_class()

    def group(self, case):
        return None  # the world's in-process group itself: the communicators hold it

    def gloo(self, case, x, group, world):
        return None  # no reference transport: the plain reference alone

    def _key(self, case):
        return case["buffer_bytes"], case["variant"]

    def communicator(self, case, group, grank):
        key = self._key(case)
        if key not in self.comms:  # RINGCOLL_CUDA_KERNEL is the case's variant now (EmulatedPool.run)
            self.comms[key] = self.Communicator(group=self.bootstrap, buffer_bytes=case["buffer_bytes"],
                                                small_bytes=SMALL_BYTES, timeout=COMM_TIMEOUT)
        return self.comms[key]

    def _keep_few_communicators(self, case: dict, group) -> None:
        """Close the least recently used communicators past LIVE_COMMUNICATORS, before this
        case may build one (every rank at the same case: the close is collective)."""
        key = self._key(case)
        self.last_used[key] = None
        self.last_used.move_to_end(key)
        while len(self.last_used) > LIVE_COMMUNICATORS:
            old, _ = self.last_used.popitem(last=False)
            comm = self.comms.pop(old, None)
            if comm is not None:
                comm.close()

    def close(self) -> None:
        for comm in self.comms.values():
            comm.close()
        self.comms.clear()


def _rank_main(group, inboxes, replies):
    """A rank thread of one world: answer cases from its inbox until it holds None; then
    close its communicators (a protocol error there ends run_in_process with it: _World)."""
    rank = _EmulatedRank(group)
    try:
        while True:
            case = inboxes[group.rank].get()
            if case is None:
                return
            try:
                reply = rank.handle(case)
            except BaseException as exc:  # noqa: BLE001 - outside the call (closing an old communicator)
                reply = ("error", [f"rank {group.rank}: {type(exc).__name__} around the call: {exc}\n"
                                   f"{traceback.format_exc()}"], None)
            replies.put((group.rank, reply))
    finally:
        rank.close()


class _World:
    """The rank threads of one world size: run_in_process on a host thread of its own."""

    def __init__(self, world: int):
        self.world = world
        self.inboxes = [queue.SimpleQueue() for _ in range(world)]
        self.replies: queue.SimpleQueue = queue.SimpleQueue()  # (rank, reply); rank None: the world ended
        self.host = threading.Thread(target=self._host, name=f"ringcoll-fuzz-cuda-world{world}", daemon=True)
        self.host.start()

    def _host(self) -> None:
        try:
            api.run_in_process(self.world, _rank_main, self.inboxes, self.replies, timeout=COMM_TIMEOUT)
            ended = "returned"
        except BaseException as exc:  # noqa: BLE001 - reported to the pool
            ended = f"raised {type(exc).__name__}: {exc}"
        self.replies.put((None, f"run_in_process of world {self.world} {ended}"))

    def stop(self, wait: float) -> tuple[bool, str]:
        """Tell every rank to stop (after the case it is in). Whether all have, within `wait`
        seconds, and how run_in_process ended ("" while it has not)."""
        for box in self.inboxes:
            box.put(None)
        self.host.join(wait)
        ended = ""
        while not self.replies.empty():  # (a reply of the case a failure left behind, then the end)
            rank, what = self.replies.get()
            ended = what if rank is None else ended
        return not self.host.is_alive(), ended


class EmulatedPool:
    """A :class:`_World` per world size (module doc), with fuzz.FuzzPool's interface:
    ``run(case)`` returns every rank's reply in rank order (``(status, failure lines,
    digest)``), or raises PoolError after tearing every world down."""

    def __init__(self, case_timeout: float = CASE_TIMEOUT):
        self.case_timeout = case_timeout
        self.worlds: dict = {}
        self.starts = 0  # worlds started (each world's first, plus restarts after failures)
        self.start_seconds = 0.0
        self.abandoned = 0  # worlds whose threads did not stop within JOIN_SECONDS of a failure
        self.close_errors: list = []  # a world whose communicators' close raised (at the end of a run)
        self._variant_before = None  # RINGCOLL_CUDA_KERNEL as it was before the first case

    @property
    def running(self) -> bool:
        return bool(self.worlds)

    def _world(self, world: int) -> _World:
        if not self.worlds:  # a fresh device, as a new process would get (32 hardware queues)
            self._variant_before = os.environ.get(VARIANT_VARIABLE)
            emulated.reset_device(IN_PROCESS_HARDWARE_QUEUES)
        if world not in self.worlds:
            t0 = time.monotonic()
            self.worlds[world] = _World(world)
            self.starts += 1
            self.start_seconds += time.monotonic() - t0
        return self.worlds[world]

    def run(self, case: dict) -> list:
        w = self._world(case["world"])
        os.environ[VARIANT_VARIABLE] = case.get("variant", "fused")
        for box in w.inboxes:
            box.put(case)
        replies: list = [None] * w.world
        deadline = time.monotonic() + self.case_timeout
        while any(r is None for r in replies):
            try:
                rank, reply = w.replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                late = [r for r, reply in enumerate(replies) if reply is None]
                self.close(graceful=False)
                raise PoolError(f"timeout after {self.case_timeout:g} s running case {{{fuzz.describe(case)}}}: "
                                f"rank(s) {late} did not answer (every world torn down)") from None
            if rank is None:
                self.close(graceful=False)
                raise PoolError(f"{reply} running case {{{fuzz.describe(case)}}} (every world torn down)")
            replies[rank] = reply
        return replies

    def close(self, graceful: bool = True) -> None:
        """Stop every world (graceful: each waited for until its communicators' close is done,
        which their timeout bounds; else JOIN_SECONDS, then left to end alone) and restore
        RINGCOLL_CUDA_KERNEL. After a failure the next case gets a fresh device. Idempotent."""
        for w in self.worlds.values():
            stopped, ended = w.stop(COMM_TIMEOUT + JOIN_SECONDS if graceful else JOIN_SECONDS)
            self.abandoned += not stopped
            if graceful and "raised" in ended:  # (after a failure, the close of a broken ring may raise)
                self.close_errors.append(ended)
        if self.worlds:
            if self._variant_before is None:
                os.environ.pop(VARIANT_VARIABLE, None)
            else:
                os.environ[VARIANT_VARIABLE] = self._variant_before
        self.worlds = {}

    def __enter__(self) -> "EmulatedPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fuzz_emulated(pool: EmulatedPool, max_examples: int, seed=None, derandomize: bool = False,
                  stats: fuzz.Stats | None = None) -> fuzz.Stats:
    """fuzz.fuzz over this transport's SPACE on `pool`."""
    return fuzz.fuzz(pool, max_examples, seed=seed, derandomize=derandomize,
                     stats=stats if stats is not None else fuzz.Stats(SPACE), space=SPACE)


# ============================================================================ CLI

def main(argv=None) -> int:
    args = fuzz.cli_arguments(argv, __doc__, 5000, 20261207, "every world is torn down")
    print(f"ringcoll fuzz (emulated CUDA): {args.examples} examples, seed {args.seed}, worlds 1-{SPACE.pool_size} "
          f"as threads, variants {SPACE.variants}, buffers {SPACE.buffers}, case timeout {args.case_timeout:g} s")
    print(fuzz.machine_line(f", ringcoll._C {_C.__file__}"))
    stats = fuzz.Stats(SPACE)
    error = None
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as warned:  # a ring that keeps its buffer says so (broken)
        warnings.simplefilter("always", RuntimeWarning)
        with EmulatedPool(case_timeout=args.case_timeout) as pool:
            try:
                fuzz_emulated(pool, args.examples, seed=args.seed, stats=stats)
            except Exception as exc:  # noqa: BLE001 - reported below
                error = exc
    fuzz.report(stats, time.monotonic() - t0, error, [
        f"worlds started: {pool.starts} ({pool.start_seconds:.1f} s), abandoned after a failure: {pool.abandoned}",
        f"runtime warnings: {len(warned)}" + "".join(f"\n  {w.message}" for w in warned[:5]),
        f"errors closing the worlds at the end: {len(pool.close_errors)}" + "".join(f"\n  {e}" for e in pool.close_errors)])
    return 1 if (error is not None or stats.failures or pool.close_errors) else 0


if __name__ == "__main__":
    sys.exit(main())
