"""Algorithms as plans (csrc/include/ringcoll/plan.h): what a plan is, the built-in ones,
plans written in Python, and the checker that proves a plan right before it runs.

A plan gives every rank a list of ops, run in order on each slice of a message cut into
C chunks. An op computes, for each chunk of a range, ``value = a`` or ``value = a OP b``
(OP the call's reduction, ``a`` first) from

    PEER    the publication of rank ``frm`` that this op receives
    INPUT   the caller's input (all-gather: only the rank's own chunk)
    OUTPUT  the caller's output (reduce-scatter: only the rank's own chunk)
    WORK    the rank's private work space (C chunks)
    PEER_INPUT  rank ``frm``'s input, read where it lies, through no slot (all-gather: its own
            chunk; broadcast: the root's; reduce-scatter: any chunk but ``frm``'s own, which
            in place is its output; all-reduce: a chunk ``frm`` overwrites with its output
            only after hearing, through publications, that the read is done; never a
            reduce's. In place a read could otherwise race the owner's writes)

and writes it to one or two of OUTPUT, WORK and SLOT (the rank's buffer, published at once
to ``readers``). An op that writes OUTPUT alone may instead publish what it writes where it
lies (``TO_OUTPUT | SHARE_OUTPUT``): its readers' receives read it out of this rank's output,
no slot is filled, and the rank never writes those chunks again in the call (where a reader
cannot reach that output, a CUDA peer in another process, it goes through a slot instead,
so the checker proves the plan both ways). A rank's receives from a peer read that peer's
publications to it in the order it makes them. The ring, for one, is "publish my input's
chunk k-1 to my right neighbour; then receive a chunk from my left neighbour, add my copy,
publish it on" (see ``plan("ring", "all_reduce", 4)``).

A plan written in Python runs on the CPU transport with no rebuild::

    def bidirectional_ring(world, rank): ...           # returns this rank's ops
    ringcoll.register_algorithm("bidir", bidirectional_ring)
    ringcoll.all_reduce(t, algorithm="bidir")

Before it runs, :func:`check` proves it: every op addresses what exists; the ranks'
sends and receives pair up and cannot deadlock; nothing is read before it is written;
every output chunk holds every rank's contribution exactly once, combined in the same order
on every rank (so every rank gets the same bits); and it stays right when the output is the
input (in place). A wrong plan is refused with a message naming the first bad op (or, where every op
runs but a result is wrong, the rank, the output chunk and what is wrong with it).
docs/algorithms.md walks through one.
"""

from __future__ import annotations

import enum
import hashlib
import numbers
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Optional, Sequence

from ringcoll import _C
from ringcoll._types import COLLECTIVE_CODES, DATA_COLLECTIVES, ROOTED_COLLECTIVES

__all__ = ["Operand", "PEER", "INPUT", "OUTPUT", "WORK", "PEER_INPUT", "reads_in_place", "TO_OUTPUT", "TO_WORK",
           "TO_SLOT", "SHARE_OUTPUT", "PlanOp", "Plan", "PlanError", "op", "plan", "check", "simulate", "rounds",
           "register_algorithm", "load_plans", "algorithms", "builtin_algorithms"]


class Operand(enum.IntEnum):
    """Where an op's operand comes from (plan.h's Operand)."""

    NONE = 0
    PEER = 1
    INPUT = 2
    OUTPUT = 3
    WORK = 4
    PEER_INPUT = 5


PEER, INPUT, OUTPUT, WORK, PEER_INPUT = Operand.PEER, Operand.INPUT, Operand.OUTPUT, Operand.WORK, Operand.PEER_INPUT
TO_OUTPUT, TO_WORK, TO_SLOT = 1, 2, 4  # where an op's value goes (plan.h's kTo*)
SHARE_OUTPUT = 8  # with TO_OUTPUT: published to ``readers`` where it lies, in the output (plan.h's kShareOutput)
_PUBLISHES = TO_SLOT | SHARE_OUTPUT
_PLACES = {TO_OUTPUT: "output", TO_WORK: "work", TO_SLOT: "slot"}


class PlanOp(NamedTuple):
    """One op of one rank (plan.h's PlanOp; the tuple C++ takes, field for field)."""

    a: int
    b: int = Operand.NONE
    frm: int = -1  # with an operand PEER: the rank whose publication is read
    first: int = 0  # the chunks [first, first + count)
    count: int = 1
    to: int = 0  # TO_OUTPUT | TO_WORK | TO_SLOT (| SHARE_OUTPUT)
    final: bool = False  # the value is the chunks' result (AVG divides here)
    readers: int = 0  # with TO_SLOT or SHARE_OUTPUT: a bit per reading rank

    def __str__(self) -> str:
        if _field_problem(self) is not None:  # as given (the checker says what is wrong with it)
            return repr(self)

        def operand(o):
            return (f"rank {self.frm}'s publication" if o == PEER else f"rank {self.frm}'s input" if o == PEER_INPUT
                    else Operand(o).name.lower())

        chunks = f"chunk {self.first}" if self.count == 1 else f"chunks {self.first}..{self.first + self.count - 1}"
        value = operand(self.a) + ("" if self.b == Operand.NONE else f" OP {operand(self.b)}")
        places = [name for bit, name in _PLACES.items() if self.to & bit]
        readers = ("s " if bin(self.readers).count("1") > 1 else " ") + ", ".join(
            str(r) for r in range(64) if self.readers >> r & 1)
        if self.to & TO_SLOT:
            places[-1] = "published to rank" + readers
        if self.to & SHARE_OUTPUT:  # with the output alone (the checker refuses it elsewhere)
            shares = ("output, shared there with rank" if self.to & TO_OUTPUT
                      else "an output it does not write, shared with rank")
            places = [p for p in places if p != "output"] + [shares + readers]
        return f"{chunks}: {value} -> {' and '.join(places)}" + (" (final)" if self.final else "")


def _field_problem(o: PlanOp) -> Optional[str]:
    """What is wrong with an op's fields on their own (an operand that names nothing, a
    field that is not a whole number), or None."""
    for field in PlanOp._fields:
        if not isinstance(getattr(o, field), numbers.Integral):
            return f"its field {field} is {getattr(o, field)!r}, not a whole number"
    operands = {int(v) for v in Operand}
    if o.a not in operands or o.b not in operands:
        return (f"an operand (a={o.a}, b={o.b}) is none of ringcoll.plans.Operand's "
                f"{', '.join(f'{v.name} = {int(v)}' for v in Operand)}")
    return None


def op(a, chunks, to, b=Operand.NONE, frm: int = -1, readers: Iterable[int] = (), final: bool = False) -> PlanOp:
    """An op, spelled for people: ``chunks`` an int or a (first, count) pair; ``to`` one or
    two of TO_OUTPUT, TO_WORK, TO_SLOT (or'ed; SHARE_OUTPUT with TO_OUTPUT publishes the
    output where it lies); ``readers`` the ranks that read a publication.

        op(INPUT, c, TO_SLOT, readers=[right])                  # publish my chunk c
        op(PEER, c, TO_SLOT, b=INPUT, frm=left, readers=[right])  # add mine, pass it on
    """
    first, count = (chunks, 1) if isinstance(chunks, int) else chunks
    mask = 0
    for r in readers:
        mask |= 1 << r
    return PlanOp(int(a), int(b), frm, first, count, to, final, mask)


@dataclass(frozen=True)
class Plan:
    """Every rank's ops (``ops[rank]``) over ``chunks`` chunks, for one collective.
    ``sends_early``: each rank's leading ops that only publish its input run before the call
    check where the call is one slice (plan.h's Plan; the one-shot's: one meeting of the
    peers, not two). It changes when data moves, never what a plan computes."""

    name: str
    collective: str
    chunks: int
    ops: tuple
    sends_early: bool = False

    @property
    def world(self) -> int:
        return len(self.ops)


class PlanError(ValueError):
    """A plan the checker refuses (the message names the first bad op, or the wrong output chunk)."""


# --- the built-in plans (plan.h's generators) and plans written in Python --------------------

#: plan.h's algorithms: name -> code (the code travels in the call's descriptor)
BUILTIN: dict = {name: code for name, code, _ in _C.algorithm_table}
#: name -> the collectives it has plans for (rd: all-reduce only; rhd: not the rooted ones; ...)
BUILTIN_COLLECTIVES: dict = {name: collectives for name, _, collectives in _C.algorithm_table}
MAX_WORLD: int = _C.max_plan_world

CHOOSERS = ("auto", "native")  # names algorithm= takes that have no plan: auto picks by size, native is the engine's
_registry: dict = {}  # (name, collective) -> (plan_fn, sends_early)
_compiled: dict = {}  # (name, collective, world, root) -> (Plan, _C.CompiledPlan, plan id)
_lock = threading.Lock()


def builtin_algorithms(collective: Optional[str] = None) -> list:
    """The built-in algorithms' names ("auto" first: the communicator's choice by size;
    then "native", the transport's own path; then the plans), those that have
    ``collective`` where one is named."""
    plans = [name for name in BUILTIN if collective is None or collective in BUILTIN_COLLECTIVES[name]]
    return [*CHOOSERS, *plans]


def algorithms(collective: Optional[str] = None) -> list:
    """Every name ``algorithm=`` takes (for ``collective``, where one is named): the
    built-in ones, then those registered here."""
    mine = {name for name, coll in _registry if collective in (None, coll)}
    return builtin_algorithms(collective) + sorted(mine - set(BUILTIN))


def register_algorithm(name: str, plan_fn: Callable[[int, int], Sequence[PlanOp]],
                       collective: str = "all_reduce", *, sends_early: bool = False) -> None:
    """Make ``algorithm=name`` run ``plan_fn(world_size, rank)``'s ops (a list of PlanOp,
    :func:`op` makes them) for ``collective`` on the CPU transport. The plan is built and
    checked (:func:`check`) the first time it is used at a world size; a wrong plan raises
    PlanError there, on every rank, before anything moves. Register it on every rank. A
    broadcast or reduce plan is written for root 0; another root runs it relabelled (rank
    k does what rank (k - root) mod P does for root 0). ``sends_early``: each rank's
    leading ops that only publish its input go before the call check where a call is one
    slice, as the built-in one-shot's do (:class:`Plan`); it is part of the plan's id, so
    ranks that register it differently raise MismatchError."""
    if collective not in DATA_COLLECTIVES:
        raise ValueError(f"register_algorithm: collective must be one of {', '.join(DATA_COLLECTIVES)}, "
                         f"got {collective!r}")
    if not isinstance(name, str) or not name or name in CHOOSERS or name in BUILTIN:
        raise ValueError(f"register_algorithm: {name!r} is not a name a plan may take (not 'auto', 'native' nor a "
                         f"built-in one: {', '.join(BUILTIN)})")
    if not callable(plan_fn):
        raise TypeError(f"register_algorithm: plan_fn must be a function (world_size, rank) -> that rank's ops, "
                        f"got {type(plan_fn).__name__}")
    if not isinstance(sends_early, bool):
        raise TypeError(f"register_algorithm: sends_early must be True or False, got {sends_early!r}")
    with _lock:
        _registry[name, collective] = (plan_fn, sends_early)
        for key in [k for k in _compiled if k[:2] == (name, collective)]:
            del _compiled[key]  # built again from the new function
        for holder in list(_holders):  # and no communicator runs the one it replaces
            holder._forget_plan(name, collective)


# Communicators that keep the plans they have compiled (Communicator._known_plans), so that a
# call naming one finds it at once: told whenever a name is registered again.
_holders: "weakref.WeakSet" = weakref.WeakSet()


def hold_compiled_plans(holder) -> None:
    """Call ``holder._forget_plan(name, collective)`` whenever ``name`` is registered again."""
    with _lock:
        _holders.add(holder)


def load_plans(path: str) -> dict:
    """Run the Python file ``path``, which registers plans (``register_algorithm``), and
    return its names: how ``ringcoll-bench --plans`` and ``ringcoll trace --plans`` reach a
    plan written outside the package (each benchmark rank runs the file itself)."""
    import os
    import runpy

    if not os.path.isfile(path):
        raise ValueError(f"plans file {path!r} does not exist")
    return runpy.run_path(path)


def plan(name: str, collective: str, world: int) -> Plan:
    """The plan ``name`` runs for ``collective`` on ``world`` ranks (not yet checked; a
    rooted collective's for root 0)."""
    if collective not in DATA_COLLECTIVES:
        raise ValueError(f"plan: collective must be one of {', '.join(DATA_COLLECTIVES)}, got {collective!r}")
    if name in CHOOSERS:  # (the messages below list every name algorithm= takes: a call's mistakes reach them)
        planned = ", ".join(a for a in algorithms(collective) if a not in CHOOSERS)
        raise ValueError(f"{name!r} is not a plan of its own: auto chooses an algorithm by size, and native runs "
                         f"the engine's own path (the ring's plan, or the one-shot or direct path by size); the "
                         f"plans for {collective}: {planned}")
    if name in BUILTIN and collective not in BUILTIN_COLLECTIVES[name]:
        raise ValueError(f"algorithm {name!r} has no {collective} (it has {', '.join(BUILTIN_COLLECTIVES[name])}); "
                         f"for {collective} choose from {', '.join(algorithms(collective))}")
    if name in BUILTIN:
        chunks, ops, sends_early = _C.builtin_plan(BUILTIN[name], COLLECTIVE_CODES[collective], world)
        return Plan(name, collective, chunks, tuple(tuple(PlanOp(*o) for o in mine) for mine in ops), sends_early)
    entry = _registry.get((name, collective))
    if entry is None:
        raise ValueError(f"unknown algorithm {name!r} for {collective}; choose from {', '.join(algorithms(collective))}"
                         + (f" (registered for other collectives: {name!r})"
                            if any(n == name for n, _ in _registry) else ""))
    plan_fn, sends_early = entry
    if world == 1:  # one rank runs no plan: its output is its input
        return Plan(name, collective, 1, ((),), sends_early)
    ops = []
    for rank in range(world):
        try:
            mine = tuple(o if isinstance(o, PlanOp) else PlanOp(*o) for o in plan_fn(world, rank))
        except Exception as e:  # the user's function, or what it returned: named, with the call
            raise PlanError(f"{collective} plan {name!r}: plan_fn({world}, {rank}) must return that rank's ops, a "
                            f"list of ringcoll.plans.op(...) (or PlanOp field tuples); it gave "
                            f"{type(e).__name__}: {e}") from e
        for i, o in enumerate(mine):
            if (problem := _field_problem(o)) is not None:
                raise PlanError(f"{collective} plan {name!r} on {world} ranks: rank {rank}, op {i} ({o!r}): {problem}")
        ops.append(mine)
    # Reduce-scatter and all-gather have one chunk per rank, their outputs' layout: an op
    # past it is then named by the checker (_structure), not counted as one chunk more.
    chunks = world if collective in ("reduce_scatter", "all_gather") else \
        1 + max((o.first + o.count - 1 for mine in ops for o in mine), default=0)
    return Plan(name, collective, chunks, tuple(ops), sends_early)


def reads_in_place(name: str, collective: str, world: int) -> bool:
    """Whether ``name``'s plan for ``collective`` reads a peer's memory where it lies (its input,
    PEER_INPUT, or what it shares in its output, SHARE_OUTPUT): it needs a transport that can
    (direct reads on the CPU)."""
    return any(PEER_INPUT in (o.a, o.b) or o.to & SHARE_OUTPUT for ops in plan(name, collective, world).ops for o in ops)


def compiled(name: str, collective: str, world: int, root: int = 0) -> tuple:
    """(the Plan, its _C.CompiledPlan): built, checked and compiled once per (name,
    collective, world, root); the compiled plan is relabelled for ``root`` (a rooted
    collective's; the Plan stays as written, for root 0) and carries the id its calls'
    descriptors carry (``.id``: the built-in's code, or plan_id's hash). Built-in plans
    are checked by their tests; a plan written in Python is checked here before its first
    call."""
    key = (name, collective, world, root)
    found = _compiled.get(key)  # one dict read is atomic: the lock guards building and replacing
    if found is not None:
        return found
    p = plan(name, collective, world)
    if name not in BUILTIN:
        check(p)  # before the extension's own checks: its messages name the plan's ops as written
    try:
        resolved = _C.compile_plan(f"{collective} plan {name!r}", world, p.chunks, p.ops,
                                   BUILTIN[name] if name in BUILTIN else plan_id(p), root, p.sends_early)
    except ValueError as e:
        raise PlanError(str(e)) from None
    if name not in BUILTIN:
        _C.name_python_plan(resolved.id, name)  # for mismatch messages
    found = (p, resolved)
    with _lock:
        _compiled[key] = found
    return found


def plan_id(p: Plan) -> int:
    """A user plan's id in the call descriptor: from its ops (and ``sends_early``, which
    decides the banks its calls take), so ranks running different plans under one name
    raise MismatchError; above the built-ins' codes (1000 and up)."""
    written = (p.collective, p.chunks, p.ops) + (("sends early",) if p.sends_early else ())
    digest = hashlib.sha256(repr(written).encode()).digest()
    return 1000 + int.from_bytes(digest[:4], "little") % (2**31 - 1000)


# --- running a plan: on symbols (the checker) or on numbers (the trace, the tests) ----------
#
# One executor runs every rank's ops the way the engine does: a receive waits for its
# publication; a publication waits until every reader of what last filled its slots has
# taken it (two banks: slice j+2 refills slice j's slots); a rank runs its slices in order.
# Ranks take turns as far as each can go; a round in which none moves is a deadlock. What
# the values are is the algebra's business: for the checker, expressions (rank r's input
# chunk c is ("x", r, c), a combine ("+", a, b), a finished result ("=", v): AVG divides
# there), so the postcondition can be read off them.

SLICES = 3  # enough for the slots of both banks to be refilled


class _Bad(Exception):
    """Raised by an algebra; the executor names the rank and op."""


class _Symbols:
    """The checker's values: expressions, and the rules they must keep."""

    def __init__(self, world: int):
        self.world = world

    def leaf(self, rank, c):
        return ("x", rank, c)

    def combine(self, a, b, final):
        for v in (a, b):
            if v[0] == "=":
                raise _Bad("combines a value already marked final (AVG would divide it before all contributions)")
        v = ("+", a, b)
        if final:
            if len(_leaves(v)) != self.world:
                raise _Bad(f"marks final a value of {len(_leaves(v))} contributions, not all {self.world}")
            return ("=", v)
        return v


class _Numbers:
    """The simulator's values: lists of numbers, ``combine(a, b)`` element by element."""

    def __init__(self, inputs, chunk_of, combine, finalize):
        self.inputs, self.chunk_of, self.combine_one, self.finalize = inputs, chunk_of, combine, finalize

    def leaf(self, rank, c):
        return self.chunk_of(rank, c)

    def combine(self, a, b, final):
        v = [self.combine_one(x, y) for x, y in zip(a, b)]
        return [self.finalize(x) for x in v] if final else v


def _leaves(v) -> list:
    if v[0] == "x":
        return [(v[1], v[2])]
    return _leaves(v[1]) + (_leaves(v[2]) if v[0] == "+" else [])


@dataclass
class Step:
    """What rank ``rank`` did at op ``index`` of slice 0: the op, and its value per chunk."""

    rank: int
    index: int
    op: PlanOp
    values: list


def _fail(p: Plan, rank: int, i: int, why: str) -> PlanError:
    return PlanError(f"{p.collective} plan {p.name!r} on {p.world} ranks: rank {rank}, op {i} ({p.ops[rank][i]}): {why}")


def _execute(p: Plan, algebra, slices: int = SLICES) -> tuple:
    """(every rank's output of slice 0 as {chunk: value}, the steps of slice 0 in the order
    they ran); raises PlanError (deadlock, a read of nothing, an unsafe read in place)."""
    world = p.world
    pc = [[0] * slices for _ in range(world)]
    # [sender][slice]: [first, count, values, readers, readers left, sender's clock, sender's op index]
    pubs = [[[] for _ in range(slices)] for _ in range(world)]
    taken: dict = {}  # (reader, sender, slice) -> how many of the sender's publications to it it took
    filled: dict = {}  # (rank, bank, chunk) -> the publication that filled that slot last
    shared: dict = {}  # (rank, slice, chunk) -> the readers of the publication that shares that output chunk
    work = [[{} for _ in range(slices)] for _ in range(world)]
    output = [[{} for _ in range(slices)] for _ in range(world)]
    steps: list = []
    # Happens-before, for reads of peers' inputs where they lie: clock[r][k] = how many ops of
    # rank k rank r has heard of (its own ops, and through the publications it received, theirs);
    # peer_reads[f, j, c] = the (reader, its op count) of every read of chunk c of rank f's input in slice j.
    clock = [[0] * world for _ in range(world)]
    peer_reads: dict = {}

    def publication(reader, k, j):
        """The publication of rank k in slice j that `reader`'s next receive from k reads, or None."""
        n = taken.get((reader, k, j), 0)
        mine = [pub for pub in pubs[k][j] if pub[3] >> reader & 1]
        return mine[n] if n < len(mine) else None

    def can_run(rank, j):
        o = p.ops[rank][pc[rank][j]]
        if PEER in (o.a, o.b) and publication(rank, o.frm, j) is None:
            return False
        if o.to & TO_SLOT:
            for c in range(o.first, o.first + o.count):
                last = filled.get((rank, j % 2, c))
                if last is not None and last[4] != 0:
                    return False
        return True

    def operand(rank, j, i, which, c, got):
        if which == PEER:
            return got[c - p.ops[rank][i].first]
        if which == INPUT:
            return algebra.leaf(rank, c)
        if which == PEER_INPUT:  # read where it lies: posted at the start, nothing to wait for
            return algebra.leaf(p.ops[rank][i].frm, c)
        store = work[rank][j] if which == WORK else output[rank][j]
        if c in store:
            return store[c]
        if which == OUTPUT and rank == 0 and p.collective in ("reduce", "broadcast"):
            return algebra.leaf(rank, c)  # the root's one tensor (in place): its input until written
        raise _fail(p, rank, i, f"reads {Operand(which).name.lower()} chunk {c} before anything wrote it")

    def aliases(rank, c):
        """In place, is this rank's output chunk c the memory of its input chunk c? Every
        chunk for all-reduce, reduce and broadcast (the tensor is both); for reduce-scatter
        and all-gather only the rank's own."""
        return p.collective in ("all_reduce", "reduce", "broadcast") or c == rank

    def changes_input(rank, c, v):
        """In place, would writing v to this rank's output chunk c change its input? Any
        write counts where the output is a reduction; an all-gather's or broadcast's copy of
        the input onto itself changes nothing (their built-in plans make it), anything else
        does."""
        if not aliases(rank, c):
            return False
        return p.collective not in ("all_gather", "broadcast") or v != algebra.leaf(rank, c)

    def overwritten(rank, j, c):
        return c in output[rank][j] and changes_input(rank, c, output[rank][j][c])

    def peer_input_read(rank, j, i, o, c):
        """In place the input is the output: a peer's read of chunk c of this rank's input
        where it lies must happen before this rank changes its output chunk c over it, in every
        order the ranks may run in (write_over_reads checks the other side)."""
        if PEER_INPUT in (o.a, o.b) and aliases(o.frm, c):
            peer_reads.setdefault((o.frm, j, c), []).append((rank, clock[rank][rank]))
            if overwritten(o.frm, j, c):
                raise _fail(p, rank, i, f"reads chunk {c} of rank {o.frm}'s input where it lies, which rank {o.frm} "
                                        "may already have overwritten with its output chunk (in place)")

    def write_over_reads(rank, j, i, c, v):
        """Writing v to output chunk c: where that changes the input in place, only after this
        rank has heard (through publications) that every peer reading that input chunk where
        it lies has read it."""
        if changes_input(rank, c, v):
            for reader, when in peer_reads.get((rank, j, c), []):
                if clock[rank][reader] < when:
                    raise _fail(p, rank, i, f"writes output chunk {c}, which in place is the input chunk rank "
                                            f"{reader} reads where it lies, before hearing that rank {reader} has read it")

    def run(rank, j):
        i = pc[rank][j]
        o = p.ops[rank][i]
        got = None
        if PEER in (o.a, o.b):
            pub = publication(rank, o.frm, j)
            if (pub[0], pub[1]) != (o.first, o.count):
                raise _fail(p, rank, i, f"receives chunks {o.first}..{o.first + o.count - 1} from rank {o.frm}, whose "
                                        f"publication it reads holds {pub[0]}..{pub[0] + pub[1] - 1}")
            pub[4] &= ~(1 << rank)
            taken[rank, o.frm, j] = taken.get((rank, o.frm, j), 0) + 1
            got = pub[2]
            clock[rank] = [max(mine, theirs) for mine, theirs in zip(clock[rank], pub[5])]
        clock[rank][rank] += 1
        values = []
        for c in range(o.first, o.first + o.count):
            peer_input_read(rank, j, i, o, c)
            if INPUT in (o.a, o.b) and overwritten(rank, j, c):  # in place, the input is the output
                raise _fail(p, rank, i, f"reads input chunk {c} after writing output chunk {c}: wrong when the "
                                        "output is the input (in place)")
            a = operand(rank, j, i, o.a, c, got)
            try:
                v = a if o.b == Operand.NONE else algebra.combine(a, operand(rank, j, i, o.b, c, got), o.final)
            except _Bad as e:
                raise _fail(p, rank, i, str(e)) from None
            values.append(v)
            if o.to & TO_WORK:
                work[rank][j][c] = v
            if o.to & TO_OUTPUT:
                write_over_reads(rank, j, i, c, v)
                if (rank, j, c) in shared:  # its readers read it where it lies, whenever they come to it
                    readers = ", ".join(str(r) for r in range(world) if shared[rank, j, c] >> r & 1)
                    raise _fail(p, rank, i, f"writes output chunk {c} again after sharing it with rank(s) {readers}, "
                                            "which read it where it lies, perhaps after this write")
                output[rank][j][c] = v
        if o.to & _PUBLISHES:
            pub = [o.first, o.count, values, o.readers, o.readers, list(clock[rank]), i]
            pubs[rank][j].append(pub)
            for c in range(o.first, o.first + o.count):
                if o.to & TO_SLOT:
                    filled[rank, j % 2, c] = pub
                else:
                    shared[rank, j, c] = o.readers
        if j == 0:
            steps.append(Step(rank, i, o, values))
        pc[rank][j] += 1

    def ready(rank, j):  # the rank is on slice j: the earlier ones are done
        return pc[rank][j] < len(p.ops[rank]) and all(pc[rank][e] == len(p.ops[rank]) for e in range(j))

    def unmatched_publication():
        """The error naming a publication some reader has no receive left for (the wrong op of a
        send without its receive: the ranks left waiting behind it are not), or None."""
        for k in range(world):
            for j in range(slices):
                for pub in pubs[k][j]:
                    for reader in (r for r in range(world) if pub[4] >> r & 1):
                        if not any(PEER in (o.a, o.b) and o.frm == k for o in p.ops[reader][pc[reader][j]:]):
                            return _fail(p, k, pub[6], f"publishes chunks {pub[0]}..{pub[0] + pub[1] - 1} to rank "
                                                       f"{reader}, which never receives it (rank {reader} has no "
                                                       f"receive from rank {k} left)")
        return None

    while True:
        moved = False
        for rank in range(world):
            for j in range(slices):
                while ready(rank, j) and can_run(rank, j):
                    run(rank, j)
                    moved = True
        waiting = [(r, j) for r in range(world) for j in range(slices) if ready(r, j)]
        if not waiting:
            break
        if not moved:
            unmatched = unmatched_publication()
            if unmatched is not None:
                raise unmatched
            r, j = waiting[0]
            o = p.ops[r][pc[r][j]]
            if PEER in (o.a, o.b) and publication(r, o.frm, j) is None:
                why = f"this one for a publication of rank {o.frm} that never comes"
            else:
                c, last = next((c, filled[r, j % 2, c]) for c in range(o.first, o.first + o.count)
                               if filled.get((r, j % 2, c)) is not None and filled[r, j % 2, c][4])
                reader = next(k for k in range(world) if last[4] >> k & 1)
                why = f"this one to refill its slot of chunk {c}, whose last publication rank {reader} never reads"
            raise _fail(p, r, pc[r][j], f"deadlock (slice {j + 1}): every rank waits; {why}")
    unmatched = unmatched_publication()  # every rank has run all its ops: any publication left is unread
    if unmatched is not None:
        raise unmatched
    return [output[r][0] for r in range(world)], steps


def check(p: Plan) -> None:
    """Prove ``p`` right for its collective, or raise PlanError naming the first bad op (or the wrong output chunk)
    (the module docstring says what is proved). One rank runs no plan (its output is its
    input), so a plan for one rank is right whatever it holds."""
    world, coll = p.world, p.collective
    if world == 1:
        return
    if world > MAX_WORLD:
        raise PlanError(f"{coll} plan {p.name!r}: plans run on at most {MAX_WORLD} ranks, not {world}")
    if coll in ("reduce_scatter", "all_gather") and p.chunks != world:
        raise PlanError(f"{coll} plan {p.name!r} on {world} ranks: {p.chunks} chunks; {coll} needs one per rank")
    _structure(p)
    outputs, _ = _execute(p, _Symbols(world))
    _postcondition(p, outputs)
    if any(o.to & SHARE_OUTPUT for ops in p.ops for o in ops):  # where an output is out of reach (CUDA)
        through_slots = tuple(tuple(o._replace(to=TO_OUTPUT | TO_SLOT) if o.to & SHARE_OUTPUT else o for o in ops)
                              for ops in p.ops)
        slotted = Plan(p.name + " (its shared outputs through slots)", p.collective, p.chunks, through_slots,
                       p.sends_early)
        outputs, _ = _execute(slotted, _Symbols(world))
        _postcondition(slotted, outputs)


def _structure(p: Plan) -> None:
    """Each op on its own: ranges, places, peers, and the chunks of the input and output
    that exist (all-gather's input and reduce-scatter's output are the rank's own chunk)."""
    for rank, ops in enumerate(p.ops):
        for i, o in enumerate(ops):
            if o.count < 1 or o.first < 0 or o.first + o.count > p.chunks:
                raise _fail(p, rank, i, f"chunks outside 0..{p.chunks - 1}")
            if o.a == Operand.NONE:
                raise _fail(p, rank, i, "has no first operand")
            if not 1 <= bin(o.to & 7).count("1") <= 2 or o.to & ~15:
                raise _fail(p, rank, i, "must write to one or two of output, work and slot")
            if o.to & SHARE_OUTPUT and o.to != TO_OUTPUT | SHARE_OUTPUT:
                raise _fail(p, rank, i, "shares its output chunks where they lie, so must write the output "
                                        "(TO_OUTPUT) and nothing else")
            if o.a in (PEER, PEER_INPUT) and o.b in (PEER, PEER_INPUT):
                raise _fail(p, rank, i, "reads two peers' values (a publication or an input) in one op")
            if (PEER in (o.a, o.b) or PEER_INPUT in (o.a, o.b)) and not (0 <= o.frm < p.world and o.frm != rank):
                raise _fail(p, rank, i, f"receives from rank {o.frm}, which is not a peer")
            if PEER_INPUT in (o.a, o.b):
                if p.collective == "reduce":
                    raise _fail(p, rank, i, f"reads rank {o.frm}'s input where it lies, but a reduce's input is the "
                                            "root's output (in place), which the root overwrites while peers read")
                if p.collective == "reduce_scatter" and o.first <= o.frm < o.first + o.count:
                    raise _fail(p, rank, i, f"reads chunk {o.frm} of rank {o.frm}'s input where it lies, which in "
                                            "place is that rank's output, written while peers read: a reduce-scatter "
                                            "may read only the chunks of a peer's input that are not its own")
                if p.collective == "all_gather" and (o.first, o.count) != (o.frm, 1):
                    raise _fail(p, rank, i, f"reads chunks other than rank {o.frm}'s own from its input: an "
                                            "all-gather's input is one chunk")
                if p.collective == "broadcast" and o.frm != 0:
                    raise _fail(p, rank, i, f"reads rank {o.frm}'s input, but only the root (rank 0) has one")
            if o.to & _PUBLISHES and (o.readers == 0 or o.readers >> p.world or o.readers >> rank & 1):
                raise _fail(p, rank, i, "publishes to no peer, or to itself or a rank past the last")
            if not o.to & _PUBLISHES and o.readers:
                raise _fail(p, rank, i, "names readers but publishes nothing")
            own = (o.first, o.count) == (rank, 1)
            if p.collective == "all_gather" and INPUT in (o.a, o.b) and not own:
                raise _fail(p, rank, i, f"reads input chunks other than its own ({rank}): an all-gather's input is "
                                        "one chunk")
            if p.collective == "reduce_scatter" and (OUTPUT in (o.a, o.b) or o.to & TO_OUTPUT) and not own:
                raise _fail(p, rank, i, f"addresses output chunks other than its own ({rank}): a reduce-scatter's "
                                        "output is one chunk")
            # The rooted collectives, written for root 0, run in place on one tensor per rank
            if p.collective == "broadcast" and INPUT in (o.a, o.b) and rank != 0:
                raise _fail(p, rank, i, "reads its input, but only the root (rank 0) has one: a broadcast's other "
                                        "ranks' tensors are where the result lands")
            if p.collective == "broadcast" and o.b != Operand.NONE:
                raise _fail(p, rank, i, "combines two values: a broadcast only copies")
            if p.collective == "reduce" and (OUTPUT in (o.a, o.b) or o.to & TO_OUTPUT) and rank != 0:
                raise _fail(p, rank, i, "addresses its output, but only the root (rank 0) gets the result: a "
                                        "reduce leaves the other ranks' tensors as they were")


def _postcondition(p: Plan, outputs: list) -> None:
    """Every output chunk holds every contribution once (all-gather: its owner's chunk;
    broadcast: the root's), finished (AVG's division made, where the value became
    complete), and an all-reduce's chunk is the same expression on every rank. A reduce's
    result is the root's alone; a broadcast's root need write nothing (its tensor is the
    input)."""
    world, coll = p.world, p.collective
    for rank, out in enumerate(outputs):
        wanted = ([rank] if coll == "reduce_scatter" else [] if coll == "reduce" and rank != 0
                  else sorted(out) if coll == "broadcast" and rank == 0 else list(range(p.chunks)))
        for c in wanted:
            if c not in out:
                raise PlanError(f"{coll} plan {p.name!r} on {world} ranks: rank {rank} never writes output chunk {c}")
            if coll == "broadcast":  # the root's input (the root itself need write nothing)
                if out[c] != ("x", 0, c):
                    raise PlanError(f"{coll} plan {p.name!r} on {world} ranks: rank {rank}'s output chunk {c} is "
                                    "not the root's (rank 0's) input")
                continue
            if coll == "all_gather":
                if out[c] != ("x", c, c):
                    raise PlanError(f"{coll} plan {p.name!r} on {world} ranks: rank {rank}'s output chunk {c} is not "
                                    f"rank {c}'s input")
                continue
            leaves = _leaves(out[c])
            ranks = [r for r, _ in leaves]
            why = None
            if any(cc != c for _, cc in leaves):
                why = f"combines other chunks ({sorted({cc for _, cc in leaves if cc != c})}) into it"
            elif len(set(ranks)) != len(ranks):
                why = f"holds rank {min(r for r in ranks if ranks.count(r) > 1)}'s contribution more than once"
            elif len(ranks) != world:
                why = f"lacks rank {min(set(range(world)) - set(ranks))}'s contribution"
            elif out[c][0] != "=":
                why = "is never marked final (the op that completes it must say final: AVG divides there)"
            if why:
                raise PlanError(f"{coll} plan {p.name!r} on {world} ranks: rank {rank}'s output chunk {c} {why}")
        if coll == "all_reduce" and rank > 0:
            for c in range(p.chunks):
                if out[c] != outputs[0][c]:
                    raise PlanError(f"{coll} plan {p.name!r} on {world} ranks: ranks 0 and {rank} combine chunk {c} "
                                    "in different orders, so their results could differ in the last bits; every rank "
                                    "must end with the same expression (one rank reduces, the others copy its result)")


def rounds(p: Plan, inputs: Optional[Sequence[Sequence]] = None) -> list:
    """Slice 0's ops as ``(round, Step)``, in the order they ran on ``inputs`` (as for
    :func:`simulate`; zeros by default): an op that receives ends one round after the op
    that published what it reads, and no op before the rank's previous one; so round r
    holds what can happen at once once r messages have gone by in a chain. The last round
    is the plan's latency in messages (model.plan_cost)."""
    if p.world == 1:
        return []
    _, steps = simulate(p, inputs if inputs is not None else [[0] * p.chunks for _ in range(p.world)])
    finished: dict = {}  # rank -> the round its last op ended in
    published: dict = {}  # (sender, reader) -> the rounds its publications to reader ended in
    taken: dict = {}  # (sender, reader) -> publications read so far
    out = []
    for st in steps:
        o, t = st.op, finished.get(st.rank, 0)
        if PEER_INPUT in (o.a, o.b):  # the owner posted where its input lies: one message
            t = max(t, 1)
        if PEER in (o.a, o.b):
            n = taken[o.frm, st.rank] = taken.get((o.frm, st.rank), 0) + 1
            t = max(t, published[o.frm, st.rank][n - 1] + 1)
        finished[st.rank] = t
        if o.to & _PUBLISHES:
            for r in range(p.world):
                if o.readers >> r & 1:
                    published.setdefault((st.rank, r), []).append(t)
        out.append((t, st))
    return out


def simulate(p: Plan, inputs: Sequence[Sequence], combine: Callable = lambda x, y: x + y,
             finalize: Callable = lambda x: x) -> tuple:
    """Run ``p`` on lists, a slice being the whole message: ``inputs[r]`` is rank r's input
    (all-gather: its chunk, as ring.h cuts the output into P), cut as ring.h cuts a message
    into ``p.chunks``. Values combine with ``combine(a, b)``, ``a`` first, as in the engine,
    and ``finalize`` where an op is final (AVG's division). Broadcast and reduce run in
    place (root 0): an output starts as the rank's input. Returns (every rank's output, the
    steps as they ran)."""
    world, coll = p.world, p.collective
    n = sum(map(len, inputs)) if coll == "all_gather" else len(inputs[0])  # all-gather: chunks may differ by one

    def bounds(c):
        q, r = divmod(n, p.chunks)
        return c * q + min(c, r), (c + 1) * q + min(c + 1, r)

    def chunk_of(rank, c):
        if coll == "all_gather":
            return list(inputs[rank])
        lo, hi = bounds(c)
        return list(inputs[rank][lo:hi])

    if world == 1:
        return [list(inputs[0])], []
    outs, steps = _execute(p, _Numbers(inputs, chunk_of, combine, finalize), slices=1)
    results = []
    for rank, out in enumerate(outs):
        full = list(inputs[rank]) if coll in ROOTED_COLLECTIVES else [None] * n
        for c, values in out.items():
            lo, hi = bounds(c)
            full[lo:hi] = values
        results.append(full[slice(*bounds(rank))] if coll == "reduce_scatter" else full)
    return results, steps
