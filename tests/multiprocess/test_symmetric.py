"""Symmetric memory (ringcoll.empty; csrc/include/ringcoll/symmetric_heap.h, host_symmetric.cpp), against gloo.

run_symmetric_cases is the matrix: every collective x dtype x op x form on tensors in
symmetric memory, bitwise against gloo (the exact inputs of test_collectives.py) and, for
random floats, bitwise against the same call on ordinary tensors (reading in place must give
the ring's bits); inputs and outputs misaligned views with guards; in place and out of
place; input symmetric with an ordinary output and the other way round; counted against
where the transport must read in place. It runs inside test_collectives.py's matrix
processes at P = 1..4 (no extra launches) and here at P = 5.

The rest tries to break it: ranks that disagree (one rank's input ordinary: every rank goes
through the slots), mismatched allocations (every rank raises), an input written the moment
the call returns while a slowed peer is still reading (never torn: the call returns only once
every peer has read), and lifetimes (a tensor outlives its communicator; freed space is
reused; a large tensor gets an arena of its own).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import ringcoll
import test_collectives as M
from ringcoll.harness.launcher import spawn
from ringcoll.learning.schedule import Collective

RANDOM_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class Scratch:
    """Views into one symmetric buffer per communicator, handed out in turn and taken back
    at each case (every rank takes the same views in the same order): a case then costs no
    collective allocation (those are tested on their own, below)."""

    def __init__(self, comm, nbytes: int = 4 << 20):
        self.buffer = comm.empty(nbytes, dtype=torch.uint8)
        self.used = 0

    def reset(self) -> "Scratch":
        self.used = 0
        return self

    def guarded(self, n: int, dtype, like=None):
        """M._guarded in symmetric memory: (view one element into a sentinel buffer, buffer)."""
        size = torch.empty(0, dtype=dtype).element_size()
        start = (self.used + 63) // 64 * 64
        self.used = start + (1 + n + M.GUARD) * size
        assert self.used <= self.buffer.numel(), "scratch too small for this case"
        base = self.buffer[start:self.used].view(dtype)
        base.copy_(M._sentinel(base.numel(), dtype))
        view = base[1:1 + n]
        if like is not None:
            view.copy_(like)
        return view, base


class ZeroCopyCount:
    """How many calls must read in place on each communicator: input in symmetric memory on
    every rank, peers, a message, and not the one-shot path (which keeps its slots)."""

    def __init__(self, comms):
        self.expected = {name: comm.transport.zero_copy_calls for name, comm, _ in comms}

    def add(self, name, comm, coll, ring_count, elem, symmetric_input=True):
        if symmetric_input and comm.world_size > 1 and ring_count > 0 and \
                not M._takes_one_shot(comm, coll, ring_count, elem):
            self.expected[name] += 1

    def check(self, chk, comms):
        for name, comm, _ in comms:
            got = comm.transport.zero_copy_calls
            if got != self.expected[name]:
                chk.fail(f"{name} zero-copy calls", f"{got}, expected {self.expected[name]}")


def _reduce_cases(chk, rank, world, comms, count, dtype, op_name, ar_sizes, rs_counts):
    kind = M._kind(op_name)
    ar_inputs = [M.make_input(kind, dtype, n, M._seed("sym", "ar", dtype, op_name, n, rank)) for n in ar_sizes]
    rs_inputs = [M.make_input(kind, dtype, world * c, M._seed("sym", "rs", dtype, op_name, c, rank))
                 for c in rs_counts]
    ar_refs = M.gloo_all_reduce(ar_inputs, op_name, world)
    rs_refs = M.gloo_reduce_scatter(rs_inputs, rs_counts, op_name, world)
    op = M._ops(op_name)[0]
    size = torch.empty(0, dtype=dtype).element_size()
    for name, comm, scratch in comms:
        for n, x, ref in zip(ar_sizes, ar_inputs, ar_refs):
            label = f"{name} all_reduce {M._name(dtype)} {op_name} n={n}"
            t, base = scratch.reset().guarded(n, dtype, x)
            comm.all_reduce(t, op=op)
            chk.equal(label + " in place", t, ref)
            M._guards_intact(chk, label + " in place", base, n)
            chk.record(label + " in place", t)
            for out_symmetric, in_symmetric in ((True, True), (False, True), (True, False)):
                form = f" out of place ({'symmetric' if in_symmetric else 'ordinary'} -> " \
                       f"{'symmetric' if out_symmetric else 'ordinary'})"
                scratch.reset()
                inp = scratch.guarded(n, dtype, x)[0] if in_symmetric else M._guarded(n, dtype, x)[0]
                out, base = scratch.guarded(n, dtype) if out_symmetric else M._guarded(n, dtype)
                comm.all_reduce(inp, op=op, output=out)
                chk.equal(label + form, out, ref)
                chk.equal(label + form + " (input must stay unchanged)", inp, x)
                M._guards_intact(chk, label + form, base, n)
                count.add(name, comm, Collective.ALL_REDUCE, n, size, in_symmetric)
            count.add(name, comm, Collective.ALL_REDUCE, n, size)
        for c, x, ref in zip(rs_counts, rs_inputs, rs_refs):
            label = f"{name} reduce_scatter_tensor {M._name(dtype)} {op_name} count={c}"
            inp, _ = scratch.reset().guarded(world * c, dtype, x)
            out, base = M._guarded(c, dtype)
            comm.reduce_scatter_tensor(out, inp, op=op)
            chk.equal(label, out, ref)
            chk.equal(label + " (input must stay unchanged)", inp, x)
            M._guards_intact(chk, label, base, c)
            buf, base = scratch.reset().guarded(world * c, dtype, x)
            comm.reduce_scatter_tensor(buf[rank * c:(rank + 1) * c], buf, op=op)
            chk.equal(label + " in place", buf[rank * c:(rank + 1) * c], ref)
            chk.equal(label + " in place (other chunks must stay unchanged)",
                      torch.cat([buf[:rank * c], buf[(rank + 1) * c:]]), torch.cat([x[:rank * c], x[(rank + 1) * c:]]))
            M._guards_intact(chk, label + " in place", base, world * c)
            count.add(name, comm, Collective.REDUCE_SCATTER, world * c, size, True)
            count.add(name, comm, Collective.REDUCE_SCATTER, world * c, size, True)


def _gather_cases(chk, rank, world, comms, count, dtype, counts):
    inputs = [M.make_input("bits", dtype, c, M._seed("sym", "ag", dtype, c, rank)) for c in counts]
    refs = M.gloo_all_gather(inputs, world)
    size = torch.empty(0, dtype=dtype).element_size()
    for name, comm, scratch in comms:
        for c, x, ref in zip(counts, inputs, refs):
            label = f"{name} all_gather_into_tensor {M._name(dtype)} count={c}"
            inp, _ = scratch.reset().guarded(c, dtype, x)
            out, base = M._guarded(world * c, dtype)
            comm.all_gather_into_tensor(out, inp)
            chk.equal(label, out, ref)
            chk.equal(label + " (input must stay unchanged)", inp, x)
            M._guards_intact(chk, label, base, world * c)
            buf, base = scratch.reset().guarded(world * c, dtype)
            buf[rank * c:(rank + 1) * c] = x
            comm.all_gather_into_tensor(buf, buf[rank * c:(rank + 1) * c])
            chk.equal(label + " in place", buf, ref)
            M._guards_intact(chk, label + " in place", base, world * c)
            chk.record(label + " in place", buf)
            for _ in range(2):
                count.add(name, comm, Collective.ALL_GATHER, world * c * size, 1)


def _random_float_cases(chk, rank, world, comms, count):
    """Generic random floats, SUM: the in-place read gives exactly the bits of the same call on
    ordinary tensors (the ring's fold order), whatever the rounding."""
    n = 70001
    for dtype in RANDOM_FLOATS:
        x = torch.randn(n, generator=torch.Generator().manual_seed(M._seed("symrand", dtype, rank))).to(dtype)
        m = n // world * world
        for name, comm, scratch in comms:
            ordinary = x.clone()
            comm.all_reduce(ordinary)
            scattered = torch.empty(m // world, dtype=dtype)
            comm.reduce_scatter_tensor(scattered, x[:m])
            t = scratch.reset().guarded(n, dtype, x)[0]
            comm.all_reduce(t)
            chk.equal(f"{name} all_reduce random {M._name(dtype)}: the bits of ordinary tensors", t, ordinary)
            s = torch.empty(m // world, dtype=dtype)
            comm.reduce_scatter_tensor(s, t.copy_(x)[:m])
            chk.equal(f"{name} reduce_scatter random {M._name(dtype)}: the bits of ordinary tensors", s, scattered)
            count.add(name, comm, Collective.ALL_REDUCE, n, t.element_size())
            count.add(name, comm, Collective.REDUCE_SCATTER, m, t.element_size())


def _mixed_ranks_cases(chk, rank, world, comms, count):
    """Rank 0's argument in symmetric memory, the others' ordinary: every rank goes through
    the slots (no rank reads in place), and the results are right."""
    n = 50000
    x = M.make_input("sum", torch.float32, n, M._seed("mixed", rank))
    ref = M.gloo_all_reduce([x], "SUM", world)[0]
    for name, comm, scratch in comms:
        t = scratch.reset().guarded(n, torch.float32, x)[0] if rank == 0 else x.clone()
        comm.all_reduce(t)
        chk.equal(f"{name} all_reduce, only rank 0's tensor symmetric", t, ref)


# Every dtype x op at P <= 2; above, where the fold order and the chunks change with P but the
# element loops do not (they are the ring's, tested in test_collectives.py), one dtype of each
# element size and kind, with the ops that differ in finishing (AVG) and in order (MIN).
FEW = [(torch.float32, "SUM"), (torch.float32, "AVG"), (torch.bfloat16, "SUM"), (torch.int8, "MIN"),
       (torch.float64, "PRODUCT"), (torch.int64, "MAX")]


def run_symmetric_cases(chk, rank, world):
    """The matrix above on two communicators: the default (small messages keep the one-shot
    path), and one that reads in place at every size (small_bytes=0)."""
    with ringcoll.Communicator(timeout=M.COMM_TIMEOUT) as native, \
            ringcoll.Communicator(timeout=M.COMM_TIMEOUT, small_bytes=0) as every:
        comms = [("symmetric", native, Scratch(native)), ("symmetric (small_bytes=0)", every, Scratch(every))]
        count = ZeroCopyCount(comms)
        ar_sizes = sorted({1, world + 1, 5003, 70001})
        counts = sorted({1, 3, 20011})
        cases = [(dtype, op) for dtype in M.DTYPES for op in M.OPS if op != "AVG" or dtype in M.FLOATING]
        for dtype, op_name in cases if world <= 2 else FEW:
            _reduce_cases(chk, rank, world, comms, count, dtype, op_name, ar_sizes, counts)
        for dtype in M.DTYPES if world <= 2 else {dtype for dtype, _ in FEW}:
            _gather_cases(chk, rank, world, comms, count, dtype, counts)
        _random_float_cases(chk, rank, world, comms, count)
        _mixed_ranks_cases(chk, rank, world, comms, count)
        count.check(chk, comms)
        for name, comm, _ in comms:
            if world > 1 and comm.transport.symmetric_arenas != 1:
                chk.fail(name, f"{comm.transport.symmetric_arenas} arenas for 4 MiB of tensors, expected 1")


def _matrix_rank(rank, world):
    chk = M.Checker(rank)
    run_symmetric_cases(chk, rank, world)
    return chk.finish()


def test_symmetric_collectives_match_gloo_at_five_ranks():
    """P = 5 (P = 1..4 run inside test_collectives.py's matrix processes)."""
    M._report(spawn(_matrix_rank, 5, timeout=M.SPAWN_TIMEOUT, env=M.CLEAN_ENV))


# --- the rules: collective allocation, reuse after return, lifetime ------------------------

def _raises(fn, kind):
    """(error type name, message) of fn(), or ("no error", "")."""
    try:
        fn()
    except kind as e:
        return type(e).__name__, str(e)
    return "no error", ""


def _mismatched_allocations(rank):
    """Each case on a fresh communicator (a mismatch breaks it): what every rank raised."""
    cases = {
        "sizes": lambda c: c.empty(10 + rank),
        "shapes of the same bytes": lambda c: c.empty((2, 8) if rank == 0 else (8, 2)),
        "dtypes of the same bytes": lambda c: c.empty(4, dtype=torch.float32 if rank == 0 else torch.int32),
        "an allocation against a collective": lambda c: c.empty(10) if rank == 0 else c.all_reduce(torch.ones(10)),
        # shapes that differ past the 8 dims posted one by one (the rest was not compared)
        "shapes past 8 dims": lambda c: c.empty((1,) * 8 + ((2, 3) if rank == 0 else (3, 2))),
    }
    seen = {}
    for label, call in cases.items():
        for check in (True, False):
            if label == "an allocation against a collective" and not check:
                continue  # without the call check a mismatched call is the caller's to avoid (it times out)
            with ringcoll.Communicator(timeout=M.COMM_TIMEOUT, check=check) as comm:
                seen[f"{label}, check={check}"] = _raises(lambda: call(comm), ringcoll.RingcollError)
    return seen


def _rules_rank(rank, world):
    chk = M.Checker(rank)
    shm_before = {name for name in os.listdir("/dev/shm") if name.startswith("ringcoll")}
    for label, (kind, message) in _mismatched_allocations(rank).items():
        if kind != "RingcollMismatchError":
            chk.fail(f"mismatched allocation: {label}", f"{kind}: {message}")
        elif "empty(" not in message or f"rank {rank} " not in message:
            chk.fail(f"mismatched allocation: {label}", f"the message names neither call: {message}")
    for size in ((-2, -2), (1 << 32, 1 << 32)):  # allocated collectively, then failed (or wrapped to 0 bytes)
        kind, message = _raises(lambda: ringcoll.get_communicator().empty(size), ValueError)
        if kind != "ValueError" or not message.startswith(f"empty: size {size}"):
            chk.fail(f"empty{size}", f"{kind}: {message}")
    kind, message = _mismatched_allocations(rank)["sizes, check=False"]
    if "empty((10,), float32, 40 bytes)" not in message or "empty((11,), float32, 44 bytes)" not in message:
        chk.fail("mismatched allocation", f"the message does not name both shapes: {message}")

    with ringcoll.Communicator(timeout=M.COMM_TIMEOUT) as comm:
        # Freed blocks are reused: 32 MiB at a time, five times, stays in the first 64 MiB arena.
        for _ in range(5):
            blocks = [comm.empty(2 << 20) for _ in range(4)]
            del blocks
        if comm.transport.symmetric_arenas != 1:
            chk.fail("reuse", f"{comm.transport.symmetric_arenas} arenas, expected 1")
        big = comm.empty(100 << 20, dtype=torch.uint8)  # more than an arena: one of its own
        if comm.transport.symmetric_arenas != 2 or not comm.is_symmetric(big[-1:]):
            chk.fail("a large tensor", f"{comm.transport.symmetric_arenas} arenas, expected 2")
        del big
        dirty = comm.empty(1000)
        dirty.fill_(7.0)
        del dirty
        chk.equal("zeros over a reused block", comm.zeros(1000), torch.zeros(1000))
        kept = comm.zeros(3, 4, dtype=torch.int64)
        kept += rank
        comm.all_reduce(kept)
    # The tensor outlives its communicator (it holds its segment mapped).
    chk.equal("a tensor after close()", kept, torch.full((3, 4), sum(range(world)), dtype=torch.int64))
    module_level = ringcoll.zeros(5, dtype=torch.float64)  # the default group's communicator
    module_level += 1
    ringcoll.all_reduce(module_level)
    chk.equal("ringcoll.zeros", module_level, torch.full((5,), float(world), dtype=torch.float64))
    if not ringcoll.get_communicator().is_symmetric(module_level):
        chk.fail("ringcoll.zeros", "not in the default communicator's symmetric memory")
    ringcoll.destroy_communicators()
    left = {name for name in os.listdir("/dev/shm") if name.startswith("ringcoll")} - shm_before
    if left:
        chk.fail("/dev/shm", f"{len(left)} segments left behind")
    return chk.finish()


def test_allocation_is_collective_and_blocks_are_reused_and_outlive_their_communicator():
    M._report(spawn(_rules_rank, 2, timeout=M.SPAWN_TIMEOUT, env=M.CLEAN_ENV))


def _busy(stop: threading.Event) -> None:
    while not stop.is_set():
        pass


def _written_at_once_rank(rank, world, calls: int):
    """Rank 0 overwrites its tensor the moment each call returns, while rank 1, sharing its
    core with a busy thread, reads at about half speed: had a call returned before its peers
    finished reading this rank's memory, rank 1's result would hold rank 0's overwrite."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})  # this thread; the busy one inherits it
    stop = threading.Event()
    if rank == 1:
        threading.Thread(target=_busy, args=(stop,), daemon=True).start()
    chk = M.Checker(rank)
    n = 2 << 20  # 8 MiB of float32 per rank: each read takes milliseconds
    with ringcoll.Communicator(timeout=M.COMM_TIMEOUT) as comm:
        gathered = torch.empty(world * n)
        mine = comm.empty(n)
        total = comm.empty(n)
        for i in range(calls):
            mine.fill_(float(rank + 1 + i))
            comm.all_gather_into_tensor(gathered, mine)
            if rank == 0:
                mine.fill_(-1.0)  # at once
            total.fill_(float(rank + 1 + i))
            comm.all_reduce(total)  # in place: read in two rounds
            if rank == 0:
                total.fill_(-1.0)
            if rank == 1:
                expected = torch.arange(1, world + 1, dtype=torch.float32).add_(i).repeat_interleave(n)
                chk.equal(f"all_gather {i}, rank 0 writing its input on return", gathered, expected)
                chk.equal(f"all_reduce in place {i}, rank 0 writing its tensor on return", total,
                          torch.full((n,), float(sum(range(1, world + 1)) + world * i)))
        if comm.transport.zero_copy_calls != 2 * calls:
            chk.fail("zero-copy calls", f"{comm.transport.zero_copy_calls}, expected {2 * calls}")
    stop.set()
    chk.checked += 1  # rank 0 checks only what rank 1 sees
    return chk.finish()


def test_a_tensor_written_as_soon_as_the_call_returns_never_tears_a_slow_peers_result():
    M._report(spawn(_written_at_once_rank, 2, 6, timeout=M.SPAWN_TIMEOUT, env=M.CLEAN_ENV))
