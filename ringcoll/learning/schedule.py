"""The ring schedule in plain Python: ``ring.h``'s indexing and ``ring_loop.h``'s slicing
stated as arithmetic for reading, plus :func:`simulate`, which runs a whole collective on
Python lists so every step can be printed and checked.

The C++ headers are the single source of ring indexing for every transport. What
:func:`simulate` runs is not a restatement: it is the ring's plan, the very records the
engines run (``plan.h``'s ``ring_plan``, exported through ``ringcoll.plans``). The formulas
here are checked against the compiled twins in ``ringcoll._C.schedule``
(``tests/pure/test_schedule.py``), and every simulated step against the formulas
(``tests/pure/test_trace.py``).

The ring
========

P ranks stand on a ring. Rank k receives only from its *left* neighbour k-1 and sends
only to its *right* neighbour k+1 (indices mod P)::

        r0 ----> r1
        ^         |
        |         v            (P = 4 shown)
        r3 <---- r2

Chunks
------

A message of n elements is cut into P chunks. With ``q = n // P`` and ``r = n % P``::

    chunk c = [c*q + min(c, r), (c+1)*q + min(c+1, r))

so the chunks tile ``[0, n)`` in order, the first r chunks hold one element more than the
others, and when n < P the last P-n chunks are empty. ``chunk_begin(n, P, P) == n``.

Reduce-scatter (P-1 steps, s = 0 .. P-2)
----------------------------------------

Before step 0 rank k publishes its raw copy of chunk k-1. At step s rank k

* sends chunk ``k-s-1`` (at step 0 the raw copy, later the partial it reduced at s-1),
* receives chunk ``k-s-2`` from rank k-1, already reduced over ranks k-s-1 .. k-1 (s+1 of them),
* combines it with its own copy: ``partial = received op own``.

The received partial grows by one contribution per hop. At the last step (s = P-2) the
chunk rank k receives is ``k-P == k`` and it now holds all P contributions.
**Invariant: after reduce-scatter, rank k holds chunk k fully reduced** (the contract of
``torch.distributed.reduce_scatter_tensor``).

All-gather (P-1 steps, s = 0 .. P-2)
------------------------------------

At step s rank k sends chunk ``k-s`` (its own at step 0, afterwards the one it just
received) and receives chunk ``k-s-1``. The finished chunks travel round the ring; over
the P-1 steps rank k receives every chunk except its own exactly once.
**Invariant: after all-gather every rank holds every chunk.**

All-reduce is reduce-scatter followed by all-gather: 2(P-1) steps in one sequence, where
step t < P-1 is reduce-scatter step t and step t >= P-1 is all-gather step t-(P-1).

In every step of every collective, what rank k receives at step t is exactly what its
left neighbour sends at step t, and what rank k receives at step t it sends at step t+1.

Bytes moved
-----------

Each rank sends one chunk per step, P-1 chunks per phase: ``(P-1)/P * n`` elements for
reduce-scatter and all-gather, ``2(P-1)/P * n`` for all-reduce, independent of P in the
limit. That per-rank volume is what nccl-tests' *busbw* normalises by.

Slicing
-------

A chunk longer than a buffer slot travels in slices of at most S elements; slice j of
every chunk travels together, and the ring runs once per slice (:func:`num_slices`).

The one-shot path (small messages, CPU transport)
=================================================

Below a crossover (``RINGCOLL_SMALL_BYTES``) the shared-memory transport does not run the
ring at all: native runs the ``oneshot`` plan (``plan.h``'s ``one_shot_plan``;
``csrc/host/host_comm.cpp`` says why; :func:`one_shot_fits` mirrors its test). In one step
every rank publishes to its peers what they need (all-reduce: every chunk of its input to
every peer; reduce-scatter: chunk c to rank c; all-gather: its own chunk), before the call
check, so a small call meets its peers once; then every rank combines what it answers for
itself, each chunk c in the order the ring reduces it (:func:`rs_contributor`), so it
computes the ring's bits::

    all-reduce      chunk c of out = ((x_{c+1} op x_{c+2}) op ...) op x_c   (mod P; x_r rank r's chunk c)
    reduce-scatter  the same, on chunk k only
    all-gather      chunk r of out = x_r

One step per rank instead of 2(P-1) ring steps (P-1 for reduce-scatter and all-gather), but each rank reads P-1 whole
copies: (P-1) * n for all-reduce instead of 2(P-1)/P * n. :func:`simulate_one_shot` runs
the plan on lists.

The direct-read all-gather (CPU transport)
==========================================

Through the slots every byte of an all-gather is copied twice on its way: by its owner
into a slot, and by each reader out of it. Where every rank may read every peer's memory
(``process_vm_readv``, probed at bootstrap; :func:`direct_read_fits` mirrors the test) and
the message is between ``direct_bytes`` and ``direct_max_bytes`` (16 KiB and 32 MiB by
default; below 16 KiB the one-shot path, from 32 MiB the ring), native runs the ``direct``
plan (``plan.h``'s ``direct_plan``; ``csrc/host/host_comm.cpp`` says why), which skips the
slots. Rank k

1. posts where its input lies (address, bytes, call number) in its own header;
2. for j = k+1, k+2, .. k+P-1 (mod P, :func:`direct_read_order`) waits for rank j's post and
   reads rank j's input straight into chunk j of its output: one copy, in the kernel;
3. sets ``direct_read`` = the call number (it has read every peer), copies its own input
   into chunk k of its output (nothing to do in place) while peers may still be reading
   that input, and waits until every peer's ``direct_read`` says so: only then may the
   caller reuse its input.

Two handshakes (post, done) instead of the ring's P-1 steps, and each rank copies
(P-1)/P n read plus n/P of its own chunk (out of place). Readers start at different
peers, so at each turn every input is read by exactly one rank.
:func:`simulate_direct_read` runs it on lists.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass
from typing import Any, Callable, List, NamedTuple, Sequence

from ringcoll._types import COLLECTIVE_CODES, RING_COLLECTIVES

__all__ = [
    "Collective",
    "ring_mod",
    "left_neighbour",
    "right_neighbour",
    "chunk_begin",
    "chunk_end",
    "chunk_length",
    "max_chunk_length",
    "rs_send_chunk",
    "rs_recv_chunk",
    "rs_contributor",
    "ag_send_chunk",
    "ag_recv_chunk",
    "ring_steps",
    "step_reduces",
    "step_recv_chunk",
    "first_send_chunk",
    "step_writes_output",
    "step_forwards",
    "slice_length",
    "num_slices",
    "RankStep",
    "StepRecord",
    "Simulation",
    "simulate",
    "one_shot_fits",
    "one_shot_limit",
    "OneShotRank",
    "simulate_one_shot",
    "direct_read_fits",
    "direct_read_order",
    "DirectReadRank",
    "simulate_direct_read",
]


# ---------------------------------------------------------------------------------------
# ring.h


def ring_mod(x: int, world: int) -> int:
    """Non-negative remainder of ``x`` modulo ``world`` (the ring arithmetic subtracts past
    zero; Python's ``%`` already returns a non-negative result for a positive divisor)."""
    return x % world


def left_neighbour(rank: int, world: int) -> int:
    """The rank ``rank`` receives from."""
    return ring_mod(rank - 1, world)


def right_neighbour(rank: int, world: int) -> int:
    """The rank ``rank`` sends to."""
    return ring_mod(rank + 1, world)


def chunk_begin(n: int, world: int, chunk: int) -> int:
    """First element of chunk ``chunk`` of an ``n``-element message split over ``world``
    chunks; ``chunk == world`` gives ``n``."""
    q, r = n // world, n % world
    return chunk * q + min(chunk, r)


def chunk_end(n: int, world: int, chunk: int) -> int:
    """One past the last element of chunk ``chunk``."""
    return chunk_begin(n, world, chunk + 1)


def chunk_length(n: int, world: int, chunk: int) -> int:
    return chunk_end(n, world, chunk) - chunk_begin(n, world, chunk)


def max_chunk_length(n: int, world: int) -> int:
    """The longest chunk: the first one (chunks differ by at most one element)."""
    return chunk_length(n, world, 0)


def rs_send_chunk(rank: int, step: int, world: int) -> int:
    """Reduce-scatter step ``step`` in [0, P-2]: the chunk ``rank`` sends."""
    return ring_mod(rank - step - 1, world)


def rs_recv_chunk(rank: int, step: int, world: int) -> int:
    """Reduce-scatter step ``step`` in [0, P-2]: the chunk ``rank`` receives and reduces."""
    return ring_mod(rank - step - 2, world)


def rs_contributor(chunk: int, i: int, world: int) -> int:
    """The i-th rank whose copy the reduce-scatter folds into chunk ``chunk``, i in [0, P-1]:
    rank c+1 publishes its raw copy, each rank on the way round adds its own, rank c last.
    The one-shot path folds in this order too (:func:`simulate_one_shot`)."""
    return ring_mod(chunk + 1 + i, world)


def ag_send_chunk(rank: int, step: int, world: int) -> int:
    """All-gather step ``step`` in [0, P-2]: the chunk ``rank`` sends."""
    return ring_mod(rank - step, world)


def ag_recv_chunk(rank: int, step: int, world: int) -> int:
    """All-gather step ``step`` in [0, P-2]: the chunk ``rank`` receives."""
    return ring_mod(rank - step - 1, world)


#: The ring's collectives, as collectives.h numbers them (``Collective.ALL_REDUCE``,
#: ``REDUCE_SCATTER``, ``ALL_GATHER``): read from the C++ table, not restated.
Collective = enum.IntEnum("Collective", {name.upper(): COLLECTIVE_CODES[name] for name in RING_COLLECTIVES},
                          module=__name__)


def ring_steps(coll: Collective, world: int) -> int:
    """Number of ring steps: P-1 per phase, two phases for all-reduce."""
    return 2 * (world - 1) if coll == Collective.ALL_REDUCE else world - 1


def step_reduces(coll: Collective, step: int, world: int) -> bool:
    """Whether step ``step`` combines the received chunk with the rank's own copy
    (a reduce-scatter step) rather than copying it (an all-gather step)."""
    return coll == Collective.REDUCE_SCATTER or (coll == Collective.ALL_REDUCE and step < world - 1)


def step_recv_chunk(coll: Collective, rank: int, step: int, world: int) -> int:
    """The chunk ``rank`` receives at step ``step`` of the whole collective."""
    if step_reduces(coll, step, world):
        return rs_recv_chunk(rank, step, world)
    ag_step = step - (world - 1) if coll == Collective.ALL_REDUCE else step
    return ag_recv_chunk(rank, ag_step, world)


def first_send_chunk(coll: Collective, rank: int, world: int) -> int:
    """The chunk ``rank`` publishes before step 0: its raw copy of chunk k-1 for a reducing
    collective, its own chunk k for all-gather."""
    if coll == Collective.ALL_GATHER:
        return ag_send_chunk(rank, 0, world)
    return rs_send_chunk(rank, 0, world)


def step_writes_output(coll: Collective, step: int, world: int) -> bool:
    """Whether the chunk received at step ``step`` is final (reduced over every rank, or
    gathered) and so belongs in the output: the last reduce-scatter step and every
    all-gather step."""
    return not step_reduces(coll, step, world) or step == world - 2


def step_forwards(coll: Collective, step: int, world: int) -> bool:
    """Whether the chunk received at step ``step`` is passed on to the right neighbour:
    every step but the last (what rank k receives at step t it sends at step t+1)."""
    return step + 1 < ring_steps(coll, world)


# ---------------------------------------------------------------------------------------
# ring_loop.h: slicing


def slice_length(chunk_len: int, slice_elems: int, slice: int) -> int:
    """Elements of a ``chunk_len``-element chunk that belong to slice ``slice`` when slices
    hold ``slice_elems`` elements (0 when the chunk is shorter)."""
    left = chunk_len - slice * slice_elems
    return 0 if left <= 0 else min(left, slice_elems)


def num_slices(count: int, world: int, slice_elems: int) -> int:
    """Number of slices a ``count``-element message needs: every chunk fits in that many."""
    longest = max_chunk_length(count, world)
    return (longest + slice_elems - 1) // slice_elems


# ---------------------------------------------------------------------------------------
# simulate: the ring run on Python lists, step by step.


def _gathered_length(who: str, inputs: Sequence[Sequence[Any]]) -> int:
    """The length n of the message an all-gather of ``inputs`` builds, after checking that
    rank k's input is exactly chunk k of it (the chunking every path of the ring uses)."""
    world = len(inputs)
    n = sum(len(x) for x in inputs)
    for k, x in enumerate(inputs):
        if len(x) != chunk_length(n, world, k):
            raise ValueError(
                f"{who}: all_gather rank {k} has {len(x)} elements, chunk {k} of a "
                f"{n}-element message has {chunk_length(n, world, k)}"
            )
    return n


@dataclass
class RankStep:
    """What one rank did in one step.

    ``sent`` is the chunk it sent to its right neighbour and ``sent_values`` the values;
    ``received`` the chunk that arrived from its left neighbour; ``reduced`` whether it
    combined that chunk with its own contribution (else it copied it); ``final`` whether
    the chunk now holds its final value and went into the output; ``state`` the rank's
    working copy of the whole message after the step (``None`` where an all-gather rank
    has not received the element yet).
    """

    rank: int
    sent: int
    sent_values: List[Any]
    received: int
    reduced: bool
    final: bool
    state: List[Any]


@dataclass
class StepRecord:
    step: int
    phase: str  # "reduce-scatter" or "all-gather"
    ranks: List[RankStep]


class Simulation(NamedTuple):
    """``steps``: one :class:`StepRecord` per ring step; ``outputs``: per rank, the result
    the collective returns (all-reduce and all-gather: the full vector; reduce-scatter:
    rank k's chunk k)."""

    steps: List[StepRecord]
    outputs: List[List[Any]]


def simulate(
    coll: Collective,
    inputs: Sequence[Sequence[Any]],
    op: Callable[[Any, Any], Any] = operator.add,
) -> Simulation:
    """Run collective ``coll`` over ``P = len(inputs)`` ranks on Python lists.

    ``inputs[k]`` is rank k's contribution: the whole n-element message for all-reduce and
    reduce-scatter, rank k's own chunk for all-gather (the chunk lengths must be those of
    :func:`chunk_length` for ``n = sum of the lengths``). The reference results are::

        all_reduce:      out[k] = [op-fold over ranks of inputs[r][i] for i in range(n)]
        reduce_scatter:  out[k] = all_reduce result [chunk_begin(n,P,k):chunk_end(n,P,k)]
        all_gather:      out[k] = inputs[0] + inputs[1] + ... + inputs[P-1]

    What runs is the ring's *plan*, the records ``plan.h``'s ``ring_plan`` makes for every
    engine (the CPU transport's, the CUDA plan kernels), read from the extension
    (``ringcoll.plans.plan("ring", ...)``) and run on lists by ``ringcoll.plans.simulate``:
    one schedule, not a restatement of it. Rank k's op 0 is its first send
    (:func:`first_send_chunk`); its op t+1 is ring step t, which receives the left
    neighbour's publication of op t, combines it with its own copy if the step reduces
    (``op(received, own)``, the C++ ``reduce``'s order), writes the output if it is the
    chunk's final value, and publishes it for the right neighbour's step t+1. The formulas
    above (:func:`step_recv_chunk`, ...) say the same in arithmetic; the tests hold each
    step to them.
    """
    from ringcoll import plans  # the plan records come from the extension

    coll = Collective(coll)
    world = len(inputs)
    if world < 1:
        raise ValueError("simulate: need at least one rank")
    inputs = [list(x) for x in inputs]
    if coll == Collective.ALL_GATHER:
        n = _gathered_length("simulate", inputs)
        state = [[None] * n for _ in range(world)]
        for k in range(world):
            state[k][chunk_begin(n, world, k) : chunk_end(n, world, k)] = inputs[k]
    else:
        n = len(inputs[0])
        if any(len(x) != n for x in inputs):
            raise ValueError("simulate: every rank's input must have the same length")
        state = [list(x) for x in inputs]

    ring = plans.plan("ring", coll.name.lower(), world)
    outputs, ran = plans.simulate(ring, inputs, combine=op)
    done = [sorted((s for s in ran if s.rank == k), key=lambda s: s.index) for k in range(world)]
    records: List[StepRecord] = []
    for t in range(len(ring.ops[0]) - 1 if world > 1 else 0):
        rank_steps = []
        for k in range(world):
            sent, step = done[k][t], done[k][t + 1]
            c = step.op.first
            value = list(step.values[0])
            state[k][chunk_begin(n, world, c) : chunk_end(n, world, c)] = value
            rank_steps.append(RankStep(rank=k, sent=sent.op.first, sent_values=list(sent.values[0]), received=c,
                                       reduced=step.op.b != plans.Operand.NONE, final=step.op.final,
                                       state=list(state[k])))
        phase = "reduce-scatter" if rank_steps[0].reduced else "all-gather"
        records.append(StepRecord(step=t, phase=phase, ranks=rank_steps))
    return Simulation(steps=records, outputs=[list(out) for out in outputs])


# ---------------------------------------------------------------------------------------
# The one-shot path (csrc/host/host_comm.h: one_shot_fits; plan.h: one_shot_plan)


#: The one-shot all-reduce of a 16-bit float (the only 2-byte dtypes) stops at small_bytes
#: divided by this: every rank folds all P copies of the whole message, and a 16-bit combine
#: costs about three times a float32's per byte (csrc/host/host_comm.h, one_shot_limit).
SIXTEEN_BIT_ONE_SHOT_SHARE = 16


def one_shot_limit(coll: Collective, elem_size: int, small_bytes: int) -> int:
    """The largest message (bytes) that may take the one-shot path."""
    if coll == Collective.ALL_REDUCE and elem_size == 2:
        return small_bytes // SIXTEEN_BIT_ONE_SHOT_SHARE
    return small_bytes


def one_shot_fits(coll: Collective, ring_count: int, elem_size: int, world: int, small_bytes: int,
                  slot_bytes: int) -> bool:
    """Whether a call takes the one-shot path rather than the ring: there are peers, the
    message (``ring_count * elem_size`` bytes, nccl-tests' size) is not empty and at most
    ``one_shot_limit`` (``small_bytes``; a sixteenth of it for a 16-bit all-reduce), and what
    each rank publishes (its whole input; for all-gather its own part, 1/P of the message)
    fits one slot. Depends only on the call and on settings every rank agreed on, so every
    rank takes the same path."""
    message = ring_count * elem_size
    published = message // world if coll == Collective.ALL_GATHER else message
    return world > 1 and 0 < message <= one_shot_limit(coll, elem_size, small_bytes) and published <= slot_bytes


def direct_read_fits(coll: Collective, ring_count: int, elem_size: int, direct_reads: bool, direct_bytes: int,
                     direct_max_bytes: int) -> bool:
    """Whether an all-gather reads every peer's input straight into the output (one copy,
    csrc/host/peer_memory.h) rather than through the slots: every rank may read every peer
    (``direct_reads``, probed and agreed at bootstrap), the message is at least
    ``direct_bytes`` (0: never) and below ``direct_max_bytes`` (past which the slots' pipeline
    with streaming stores is faster than the kernel's copy). It goes before the one-shot
    path (one read beats the one-shot's two copies from about 16 KiB): a call takes the
    one-shot path where ``one_shot_fits`` and not this."""
    return (direct_reads and coll == Collective.ALL_GATHER and direct_bytes > 0
            and direct_bytes <= ring_count * elem_size < direct_max_bytes)


@dataclass
class OneShotRank:
    """What one rank did in the one-shot step: ``published`` the values it put in its slots
    (every chunk of its input for all-reduce; the chunks of the others for reduce-scatter;
    its own for all-gather); ``read`` what it took from every rank, in rank order (its own
    input's part for itself; for reduce-scatter chunk k of each); ``output`` what it
    returns."""

    rank: int
    published: List[Any]
    read: List[List[Any]]
    output: List[Any]


def simulate_one_shot(
    coll: Collective,
    inputs: Sequence[Sequence[Any]],
    op: Callable[[Any, Any], Any] = operator.add,
) -> List[OneShotRank]:
    """Run the one-shot path of ``coll`` on Python lists (inputs as for :func:`simulate`):
    the ``oneshot`` plan's records (``plan.h``'s ``one_shot_plan``, which native runs for
    small messages), run by ``ringcoll.plans.simulate``. Each rank folds chunk c in the order
    the ring reduces it (:func:`rs_contributor`: rank c+1 first, rank c last),
    ``op(partial, contribution)``: the argument order of the C++ ``reduce`` (received partial
    first). So every rank computes the ring's bits, whichever path a size takes."""
    from ringcoll import plans  # the plan records come from the extension

    coll = Collective(coll)
    world = len(inputs)
    if world < 1:
        raise ValueError("simulate_one_shot: need at least one rank")
    mine = [list(x) for x in inputs]
    if coll == Collective.ALL_GATHER:
        _gathered_length("simulate_one_shot", mine)
    outputs, ran = plans.simulate(plans.plan("oneshot", coll.name.lower(), world), mine, combine=op)
    # What each rank published, in the order it published it: in all, and to each reader
    published = [[] for _ in range(world)]
    sent = [[[] for _ in range(world)] for _ in range(world)]  # [sender][reader]
    for st in sorted(ran, key=lambda st: (st.rank, st.index)):
        if st.op.to & plans.TO_SLOT:
            values = [x for chunk in st.values for x in chunk]
            published[st.rank] += values
            for reader in range(world):
                if st.op.readers >> reader & 1:
                    sent[st.rank][reader] += values
    n = sum(map(len, mine)) if coll == Collective.ALL_GATHER else len(mine[0])
    ranks = []
    for k in range(world):
        own = mine[k][chunk_begin(n, world, k):chunk_end(n, world, k)] if coll == Collective.REDUCE_SCATTER \
            else mine[k]
        ranks.append(OneShotRank(rank=k, published=published[k],
                                 read=[own if r == k else sent[r][k] for r in range(world)],
                                 output=list(outputs[k])))
    return ranks


# ---------------------------------------------------------------------------------------
# The direct-read all-gather (plan.h's direct_plan, which csrc/host/host_comm.cpp runs for native)


def direct_read_order(rank: int, world: int) -> List[int]:
    """The peers ``rank`` reads, in order: k+1, k+2, .. k+P-1 (mod P). Each rank starts at
    its right neighbour, so at turn i the ranks read P different peers: no input is read by
    every rank at once."""
    return [ring_mod(rank + i, world) for i in range(1, world)]


@dataclass
class DirectReadRank:
    """What one rank did in a direct-read all-gather: ``posted`` its input, which its peers
    read in place; ``reads`` ``(peer, values)`` in the order it read them
    (:func:`direct_read_order`), each straight into chunk ``peer`` of its output; ``own``
    the chunk it copied into chunk ``rank`` of its output after the reads; ``output`` what
    it returns."""

    rank: int
    posted: List[Any]
    reads: List[tuple]
    own: List[Any]
    output: List[Any]


def simulate_direct_read(inputs: Sequence[Sequence[Any]]) -> List[DirectReadRank]:
    """Run the direct-read all-gather on Python lists (``inputs[k]`` rank k's own chunk, as
    for :func:`simulate`): the ``direct`` plan's records (``plan.h``'s ``direct_plan``: reads
    of each peer's input where it lies, in :func:`direct_read_order`, then the own chunk),
    run by ``ringcoll.plans.simulate``. Every value a rank returns was read from its
    owner's input, with no slot in between; with one rank there is no peer and only the own
    chunk is copied (the transports copy input to output for P = 1 the same way)."""
    from ringcoll import plans  # the plan records come from the extension

    world = len(inputs)
    if world < 1:
        raise ValueError("simulate_direct_read: need at least one rank")
    posted = [list(x) for x in inputs]  # a post names the input itself: peers read it in place
    _gathered_length("simulate_direct_read", posted)
    outputs, ran = plans.simulate(plans.plan("direct", "all_gather", world), posted)
    ranks = []
    for k in range(world):
        mine = sorted((st for st in ran if st.rank == k), key=lambda st: st.index)
        reads = [(st.op.frm, list(st.values[0])) for st in mine if st.op.a == plans.PEER_INPUT]
        ranks.append(DirectReadRank(rank=k, posted=posted[k], reads=reads, own=list(posted[k]),
                                    output=list(outputs[k])))
    return ranks


# ---------------------------------------------------------------------------------------
# Symmetric memory: reading the peers' tensors in place (csrc/host/host_symmetric.cpp:
# run_zero_copy; docs/symmetric.md)


@dataclass
class ZeroCopyRank:
    """What one rank did in a collective over symmetric memory: ``folded`` ``(chunk,
    [(rank, values), ...], result)`` for the chunk(s) it reduced, each from every rank's
    tensor in the ring's order; ``copied`` ``(rank, chunk, values)`` for the chunks it then
    copied from their owners (all-gather: every input; all-reduce: every reduced chunk but
    its own); ``rounds`` how many rounds of flags it took; ``output`` what it returns."""

    rank: int
    folded: List[tuple]
    copied: List[tuple]
    rounds: int
    output: List[Any]


def simulate_zero_copy(coll: Collective, inputs: Sequence[Sequence[Any]],
                       op: Callable[[Any, Any], Any] = operator.add) -> List[ZeroCopyRank]:
    """Run a collective over symmetric memory on Python lists (inputs as for :func:`simulate`;
    every output symmetric too, as in place): all-gather copies each peer's input from k+1 on
    (:func:`direct_read_order`), then its own; reduce-scatter folds chunk k of every input;
    all-reduce folds chunk k into its own tensor, meets, then copies chunk j from rank j. A
    fold visits the ranks as the ring reduces that chunk (:func:`rs_contributor`), so the
    results are the ring's bits."""
    coll = Collective(coll)
    world = len(inputs)
    if world < 1:
        raise ValueError("simulate_zero_copy: need at least one rank")
    if coll == Collective.ALL_GATHER:
        n = _gathered_length("simulate_zero_copy", inputs)
        ranks = []
        for k in range(world):
            order = direct_read_order(k, world) + [k]
            copied = [(r, r, list(inputs[r])) for r in order]
            output = [x for r in range(world) for x in inputs[r]]
            ranks.append(ZeroCopyRank(rank=k, folded=[], copied=copied, rounds=1 if world > 1 else 0, output=output))
        return ranks
    n = len(inputs[0])

    def fold(c: int) -> tuple:
        part = slice(chunk_begin(n, world, c), chunk_end(n, world, c))
        order = [rs_contributor(c, i, world) for i in range(world)]
        values = [(r, list(inputs[r][part])) for r in order]
        result = values[0][1]
        for _, v in values[1:]:
            result = [op(a, b) for a, b in zip(result, v)]
        return c, values, result

    reduced = [fold(c) for c in range(world)]  # chunk c, folded by rank c
    ranks = []
    for k in range(world):
        if coll == Collective.REDUCE_SCATTER:
            ranks.append(ZeroCopyRank(rank=k, folded=[reduced[k]], copied=[], rounds=1 if world > 1 else 0,
                                      output=list(reduced[k][2])))
            continue
        copied = [(j, j, list(reduced[j][2])) for j in direct_read_order(k, world)]
        output = [x for c in range(world) for x in reduced[c][2]]
        ranks.append(ZeroCopyRank(rank=k, folded=[reduced[k]], copied=copied, rounds=2 if world > 1 else 0,
                                  output=output))
    return ranks
