"""``ringcoll trace``: a ring collective printed (and drawn) step by step.

Everything shown comes from :func:`ringcoll.learning.schedule.simulate`, which runs the collective
using only the schedule functions mirrored from ``ring.h`` (tied to the C++ by
``tests/pure/test_schedule.py``). Nothing here restates the schedule: the chunk a rank sends,
the chunk it receives, whether it reduces or copies, and what it holds afterwards are the
simulation's records of the real ring.

What a trace shows, for P ranks and an n-element message:

* the chunk boundaries ``chunk c = [chunk_begin(n, P, c), chunk_begin(n, P, c+1))``,
  i.e. ``[c*q + min(c, r), (c+1)*q + min(c+1, r))`` with ``q = n // P``, ``r = n % P``;
* for each of the ring steps (P-1 for reduce-scatter and all-gather, 2(P-1) for
  all-reduce) and each rank k: the chunk k sends to k+1, the chunk it receives from k-1,
  and either ``received + own = new partial`` (a reduce-scatter step) or ``copy``
  (an all-gather step);
* every rank's working copy after every step, chunks separated by ``|``;
* the result and a check against the plain reference computation::

      all_reduce:      out[k] = sum over ranks r of inputs[r]           (elementwise)
      reduce_scatter:  out[k] = chunk k of that sum
      all_gather:      out[k] = inputs[0] + inputs[1] + ... + inputs[P-1] (concatenation)

Default inputs, chosen so the sums can be done by eye:

* all_reduce, reduce_scatter: rank r's element i is ``(i+1) * 10**r``. Rank 0 writes in
  the units digit, rank 1 in the tens, rank 2 in the hundreds, ... so the digits of a
  partial sum say which ranks it already contains: 303 is element 2 from ranks 0 and 2.
  (Digits stay separate while n <= 9.)
* all_gather: rank r's input is its own chunk, element j of it ``10*r + j``: the tens
  digit says where an element came from.

:func:`trace` with ``algorithm="oneshot"`` (``ringcoll trace ... --algorithm oneshot``)
shows the small-message path instead, from :func:`ringcoll.learning.schedule.simulate_one_shot` (the
``oneshot`` plan's records): the one step in which every rank publishes what its peers need
and combines all P contributions itself.

:func:`trace` with ``algorithm="direct"`` on an all-gather shows the CPU transport's
large-message path, from :func:`ringcoll.learning.schedule.simulate_direct_read`: every rank
posts its input, reads each peer's input straight into its output in the order k+1, k+2, ..
(mod P), copies its own chunk, and waits until every peer has finished reading. On a
reduce-scatter or all-reduce it shows the direct plan, as any plan below.

``algorithm="symmetric"`` shows a call over tensors in symmetric memory (``ringcoll.empty``),
from :func:`ringcoll.learning.schedule.simulate_zero_copy`: every rank posts where its tensor
lies, folds its chunk of every rank's tensor in the ring's order, copies the rest from the
ranks that hold it, and meets its peers once or twice (docs/symmetric.md).

Any other algorithm (``ringcoll.algorithms()``: rhd, rd, tree, or a plan registered with
``ringcoll.register_algorithm``) is traced from its plan (ringcoll/plans.py), the records
the engine runs: round by round (``plans.rounds``), each rank's ops as the plan states
them (``chunks 0..1: rank 2's publication OP work -> output (final)``) with the values they
make, then the result, the check, and the plan's cost (rounds, bytes received). So are
broadcast and reduce, which are plans only, with rank 0 as the root (the plans are written
for root 0; another root relabels them).

:func:`draw` renders the same simulation with matplotlib (Agg): one panel per ring step,
the ranks on a circle, an arrow from each rank to its right neighbour labelled with the
chunk it carries and whether the receiver reduces (+) or copies it, and each rank's values
beside it.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, List, Optional, Sequence

from ringcoll.learning.schedule import (
    Collective,
    Simulation,
    StepRecord,
    chunk_begin,
    chunk_end,
    left_neighbour,
    right_neighbour,
    ring_steps,
    simulate,
    simulate_direct_read,
    simulate_one_shot,
    simulate_zero_copy,
)
from ringcoll import plans
from ringcoll._types import ROOTED_COLLECTIVES
from ringcoll.learning.model import all_gather_copied_bytes, plan_cost, symmetric_traffic

__all__ = ["COLLECTIVES", "ALGORITHMS", "default_inputs", "describe_inputs", "reference", "trace", "draw"]
MAX_ELEMENTS = 4096  # the largest n a trace prints
ALGORITHMS = ("ring", "oneshot", "direct", "symmetric")
# in the trace's first line
_ALGORITHM_NAMES = {"oneshot": "one-shot", "direct": "direct read", "symmetric": "symmetric memory, read in place"}

COLLECTIVES = {coll.name.lower(): coll for coll in Collective}  # "all_reduce": Collective.ALL_REDUCE, ...


# ---------------------------------------------------------------------------------------
# inputs and the plain reference


def _collective(name: str) -> Collective:
    try:
        return COLLECTIVES[name]
    except KeyError:
        raise ValueError(f"trace: collective must be one of {', '.join(COLLECTIVES)}, got {name!r}") from None


def default_inputs(collective: str, world: int, n: int) -> List[List[int]]:
    """The inputs a trace uses unless given others (see the module docstring)."""
    if collective == "all_gather":
        return [[10 * r + j for j in range(chunk_end(n, world, r) - chunk_begin(n, world, r))]
                for r in range(world)]
    return [[(i + 1) * 10 ** r for i in range(n)] for r in range(world)]


def describe_inputs(collective: str) -> str:
    """One line saying what the default inputs are."""
    if collective == "all_gather":
        return ("inputs: rank r holds its own chunk r, element j of it = 10*r + j "
                "(the tens digit names the source rank)")
    return ("inputs: rank r's element i = (i+1) * 10**r (rank 0 writes the units digit, rank 1 "
            "the tens, ...; a partial sum's digits show which ranks it contains)")


def reference(collective: str, inputs: Sequence[Sequence[Any]]) -> List[List[Any]]:
    """What each rank must end with, computed the plain way (no ring); the rooted
    collectives with rank 0 as the root, in place (a reduce's other ranks keep their input)."""
    if collective == "broadcast":
        return [list(inputs[0]) for _ in inputs]
    if collective == "reduce":
        return [[sum(column) for column in zip(*inputs)], *(list(x) for x in inputs[1:])]
    coll = _collective(collective)
    world = len(inputs)
    if coll == Collective.ALL_GATHER:
        whole = [x for rank_input in inputs for x in rank_input]
        return [list(whole) for _ in range(world)]
    total = [sum(column) for column in zip(*inputs)]
    if coll == Collective.ALL_REDUCE:
        return [list(total) for _ in range(world)]
    n = len(total)
    return [total[chunk_begin(n, world, k):chunk_end(n, world, k)] for k in range(world)]


# ---------------------------------------------------------------------------------------
# text


def _fmt(values: Sequence[Any]) -> str:
    return "[" + " ".join("." if v is None else str(v) for v in values) + "]"


def _chunk_text(state: Sequence[Any], world: int, c: int) -> str:
    n = len(state)
    values = state[chunk_begin(n, world, c):chunk_end(n, world, c)]
    return " ".join("." if v is None else str(v) for v in values) or "-"


def _chunked(state: Sequence[Any], world: int, final: Optional[set] = None) -> str:
    """A rank's whole working copy with ``|`` at the chunk boundaries ('-' = empty chunk),
    followed by the list of chunks that are final."""
    text = "[" + " | ".join(_chunk_text(state, world, c) for c in range(world)) + "]"
    if final is not None:
        text += "  final: " + (" ".join(f"c{c}" for c in sorted(final)) or "none yet")
    return text


def _own_chunk(sim_inputs: Sequence[Sequence[Any]], rank: int, c: int, world: int, n: int) -> List[Any]:
    return list(sim_inputs[rank][chunk_begin(n, world, c):chunk_end(n, world, c)])


def _message_length(coll: Collective, inputs: Sequence[Sequence[Any]]) -> int:
    return sum(len(x) for x in inputs) if coll == Collective.ALL_GATHER else len(inputs[0])


def _final_chunks(coll: Collective, world: int, sim: Simulation) -> List[List[set]]:
    """For each step and rank, the chunks that hold their final value after that step: an
    all-gather rank starts with its own chunk final; afterwards a chunk is final once the
    step that delivered it says so (``RankStep.final``, i.e. ``step_writes_output``)."""
    done = [{k} if coll == Collective.ALL_GATHER else set() for k in range(world)]
    per_step = []
    for record in sim.steps:
        for rs in record.ranks:
            if rs.final:
                done[rs.rank].add(rs.received)
        per_step.append([set(d) for d in done])
    return per_step


def _phase_header(record: StepRecord, coll: Collective, world: int) -> str:
    t = record.step
    phase_step = t - (world - 1) if (coll == Collective.ALL_REDUCE and t >= world - 1) else t
    if record.phase == "reduce-scatter":
        what = "each rank adds the chunk from its left neighbour to its own copy"
    else:
        what = "each rank copies the finished chunk from its left neighbour"
    return f"step {t}  ({record.phase} step {phase_step} of {world - 1}: {what})"


def _step_lines(record: StepRecord, inputs, coll: Collective, world: int, n: int,
                final: List[set]) -> List[str]:
    lines = [_phase_header(record, coll, world)]
    for rs in record.ranks:
        left, right = left_neighbour(rs.rank, world), right_neighbour(rs.rank, world)
        received = rs.state[chunk_begin(n, world, rs.received):chunk_end(n, world, rs.received)]
        line = (f"  rank {rs.rank}: sends chunk {rs.sent} to rank {right}, "
                f"receives chunk {rs.received} from rank {left}: ")
        if rs.reduced:
            incoming = next(r.sent_values for r in record.ranks if r.rank == left)
            own = _own_chunk(inputs, rs.rank, rs.received, world, n)
            line += f"{_fmt(incoming)} + own {_fmt(own)} = {_fmt(received)}"
        else:
            line += f"copy {_fmt(received)}"
        if rs.final:
            line += "  (final)"
        lines.append(line)
    lines.append("  holds after the step (its working copy; 'final' = chunks that hold their result):")
    for rs in record.ranks:
        lines.append(f"    rank {rs.rank}: {_chunked(rs.state, world, final[rs.rank])}")
    return lines


def trace(collective: str, world: int, n: int, inputs: Optional[Sequence[Sequence[int]]] = None,
          algorithm: str = "ring") -> str:
    """The step-by-step trace of ``collective`` over ``world`` ranks and ``n`` elements, as
    text (what ``ringcoll trace`` prints). ``inputs`` default to :func:`default_inputs`;
    for all_gather ``inputs[r]`` is rank r's chunk and ``n`` must be their total length.
    ``algorithm``: ``"ring"``, ``"oneshot"`` for the small-message path, ``"direct"`` for
    the direct-read all-gather (the direct reduce-scatter's and all-reduce's plans otherwise),
    or ``"symmetric"`` for tensors in symmetric memory, read in place; broadcast and reduce
    trace their plans."""
    if not 1 <= world <= plans.MAX_WORLD:  # the schedules traced are plan records, made for at most this many
        raise ValueError(f"trace: world must be 1 to {plans.MAX_WORLD} (ringcoll's most ranks), got {world}")
    if not 0 <= n <= MAX_ELEMENTS:  # every element is printed, at every step (n = 3e6 wrote 1.5 GB)
        raise ValueError(f"trace: n must be 0 to {MAX_ELEMENTS} (a trace prints every element at every step; "
                         f"ringcoll-bench times large messages), got {n}")
    if collective in ROOTED_COLLECTIVES:
        return _rooted_trace(collective, world, n, inputs, algorithm)
    coll = _collective(collective)
    choices = [*ALGORITHMS, *(a for a in plans.algorithms(collective) if a not in (*ALGORITHMS, "auto", "native"))]
    if algorithm not in choices:
        raise ValueError(f"trace: algorithm for {collective} must be one of {', '.join(choices)}, got {algorithm!r}")
    given = inputs is not None
    inputs = [list(x) for x in (inputs if given else default_inputs(collective, world, n))]
    if len(inputs) != world:
        raise ValueError(f"trace: {len(inputs)} inputs for {world} ranks")
    if _message_length(coll, inputs) != n:
        raise ValueError(f"trace: the inputs make a {_message_length(coll, inputs)}-element message, not n = {n}")

    q, r = n // world, n % world
    op = "" if coll == Collective.ALL_GATHER else ", op = sum"
    out = [f"ringcoll trace: {collective}, P = {world} ranks, n = {n} elements{op}"
           + (f", algorithm = {_ALGORITHM_NAMES[algorithm]}" if algorithm in _ALGORITHM_NAMES else ""),
           "inputs: as given" if given else describe_inputs(collective)]
    for k, x in enumerate(inputs):
        out.append(f"  rank {k}: {_fmt(x)}")
    out.append(f"chunks: chunk c = [chunk_begin(c), chunk_begin(c+1)) with q = n // P = {q}, r = n % P = {r}:")
    out.append("  " + "  ".join(f"chunk {c} = [{chunk_begin(n, world, c)}, {chunk_end(n, world, c)})"
                                for c in range(world)))
    if algorithm not in ALGORITHMS or (algorithm == "direct" and coll != Collective.ALL_GATHER):
        # the direct reduce-scatter and all-reduce have no native path of their own: their plans
        return "\n".join(out + _plan_lines(plans.plan(algorithm, collective, world), n, inputs)) + "\n"
    if algorithm == "oneshot":
        return "\n".join(out + _one_shot_lines(collective, coll, world, n, inputs)) + "\n"
    if algorithm == "direct":
        return "\n".join(out + _direct_read_lines(collective, coll, world, n, inputs)) + "\n"
    if algorithm == "symmetric":
        return "\n".join(out + _zero_copy_lines(collective, coll, world, n, inputs)) + "\n"
    sim = simulate(coll, inputs)
    out.append("ring: " + " -> ".join(f"rank {k}" for k in range(world)) + " -> rank 0 "
               "(each rank sends to its right neighbour k+1, receives from its left k-1)")
    if coll == Collective.ALL_GATHER:
        out.append("start: each rank holds only its own chunk ('.' = not received yet)")
    else:
        out.append("start: each rank holds its whole input; reduce-scatter steps add into it")
    for k in range(world):
        start = [None] * n if coll == Collective.ALL_GATHER else inputs[k]
        if coll == Collective.ALL_GATHER:
            start[chunk_begin(n, world, k):chunk_end(n, world, k)] = inputs[k]
        out.append(f"    rank {k}: {_chunked(start, world)}")
    if world == 1:
        out.append("P = 1: no ring steps; the input is the result")
    for record, final in zip(sim.steps, _final_chunks(coll, world, sim)):
        out.append("")
        out.extend(_step_lines(record, inputs, coll, world, n, final))
    out.append("")
    out.extend(_result_lines(collective, coll, sim.outputs, inputs))
    return "\n".join(out) + "\n"


def _one_shot_lines(collective: str, coll: Collective, world: int, n: int, inputs) -> List[str]:
    """The one-shot step (schedule.simulate_one_shot, the oneshot plan), the result, and what it saved."""
    gather = coll == Collective.ALL_GATHER
    what = {Collective.ALL_GATHER: "its own chunk to every peer", Collective.ALL_REDUCE: "every chunk of its input to "
            "every peer", Collective.REDUCE_SCATTER: "chunk c of its input to rank c"}[coll]
    lines = [f"one-shot: each rank publishes {what}, before the call check (so a small call meets its",
             "  peers once); then every rank waits for each peer's publication and "
             + ("copies rank r's into chunk r of its output" if gather else "combines the P contributions itself:"
                                                                             " chunk c in the")]
    if not gather:
        lines.append("  order the ring reduces it (rank c+1 first, rank c last), so every rank gets the ring's bits")
        lines.append("  (each line below lists the P contributions in rank order, its own among them: the cost line "
                     "counts the P-1 peers')")
    if world == 1:
        lines += ["P = 1: no peers, no step (the transports take no one-shot path either); the input is the result"]
        ranks = simulate_one_shot(coll, inputs)
    else:
        ranks = simulate_one_shot(coll, inputs)
        lines += ["", "step 0  (the only step: each rank's publications, then its waits for the P-1 peers')"]
        for rs in ranks:
            line = f"  rank {rs.rank}: publishes {_fmt(rs.published)}; "
            if gather:
                line += "reads the slots of ranks " + ", ".join(map(str, range(world))) + f": {_fmt(rs.output)}"
            else:
                part = f"chunk {rs.rank} of " if coll == Collective.REDUCE_SCATTER else ""
                line += (f"reads {part}the slots of ranks {', '.join(map(str, range(world)))}: "
                         + " + ".join(_fmt(x) for x in rs.read) + f" = {_fmt(rs.output)}")
            lines.append(line)
    lines.append("")
    lines.extend(_result_lines(collective, coll, [rs.output for rs in ranks], inputs))
    if world > 1:
        steps = ring_steps(coll, world)
        reduce_all = coll == Collective.ALL_REDUCE
        read = (world - 1) * n if reduce_all else (world - 1) * n / world
        lines.append(f"cost: 1 step instead of the ring's {steps}; each rank reads {read:.4g} elements of its peers' "
                     f"slots ({'(P-1) n' if reduce_all else '(P-1)/P n'}), the ring {steps * n / world:.4g} "
                     f"({'2(P-1)/P n' if reduce_all else '(P-1)/P n'})")
    return lines


def _rooted_trace(collective: str, world: int, n: int, inputs, algorithm: str) -> str:
    """broadcast or reduce, root rank 0, traced from its plan (they have no other path)."""
    choices = [a for a in plans.algorithms(collective) if a not in ("auto", "native")]
    if algorithm not in choices:
        raise ValueError(f"trace: algorithm for {collective} must be one of {', '.join(choices)}, got {algorithm!r}")
    given = inputs is not None
    inputs = [list(x) for x in (inputs if given else default_inputs(collective, world, n))]
    if len(inputs) != world or any(len(x) != n for x in inputs):
        raise ValueError(f"trace: {collective} takes {world} inputs of n = {n} elements")
    what = "op = sum, the result on the root" if collective == "reduce" else "the root's tensor to every rank"
    out = [f"ringcoll trace: {collective}, P = {world} ranks, n = {n} elements, root = rank 0 ({what})",
           "inputs: as given" if given else describe_inputs(collective)]
    out += [f"  rank {k}: {_fmt(x)}" for k, x in enumerate(inputs)]
    return "\n".join(out + _plan_lines(plans.plan(algorithm, collective, world), n, inputs)) + "\n"


def _plan_lines(p: plans.Plan, n: int, inputs) -> List[str]:
    """A plan run on the inputs (plans.simulate), round by round (plans.rounds), each op as
    the plan states it with the values it makes; the result, the check and the cost."""
    coll = COLLECTIVES.get(p.collective)  # None for broadcast and reduce: no ring schedule
    outputs, _ = plans.simulate(p, inputs)
    lines = [f"plan {p.name!r}: {p.chunks} chunk{'s' * (p.chunks > 1)} per message, ops per rank "
             f"{', '.join(str(len(ops)) for ops in p.ops)}; an op computes a or a OP b per chunk and writes it to "
             "output, work (the rank's own) or its slot (published to the ranks named)"]
    if any(o.to & plans.SHARE_OUTPUT for ops in p.ops for o in ops):
        lines.append("  (an output 'shared there' is published where it lies: its readers copy it out of that rank's "
                     "output, not out of a slot)")
    if p.chunks != p.world and coll is not None:
        lines.append(f"  (this plan cuts the message into {p.chunks} chunk{'s' * (p.chunks > 1)}, not the P above)")
    timeline = plans.rounds(p, inputs)
    if not timeline:
        lines.append("P = 1: no ops; the input is the result")
    for t in sorted({t for t, _ in timeline}):
        lines += ["", f"round {t}" + ("  (no message waited for yet)" if t == 0 else "")]
        steps = sorted((st for t2, st in timeline if t2 == t), key=lambda st: (st.rank, st.index))
        # A message of fewer elements than chunks leaves chunks empty: a run of ops over empty
        # chunks only (one rank's, one after another) is said once, not op by op.
        for _, run in itertools.groupby(steps, key=lambda st: (st.rank, st.index if any(map(len, st.values)) else -1)):
            run = list(run)
            if len(run) == 1:
                st = run[0]
                lines.append(f"  rank {st.rank}, op {st.index}: {st.op}  = {' | '.join(_fmt(v) for v in st.values)}")
            else:
                lines.append(f"  rank {run[0].rank}, ops {run[0].index}-{run[-1].index}: their chunks are empty "
                             f"(n = {n} elements in {p.chunks} chunks): nothing moves")
    lines.append("")
    lines.extend(_result_lines(p.collective, coll, outputs, inputs))
    try:  # these inputs are one case; what a call runs first is the proof for every input
        plans.check(p)
        lines.append("checker: plans.check proves the plan for every input, as every call's first run does")
    except plans.PlanError as e:
        lines.append(f"{REFUSED}: {e}")
    if p.world > 1:
        cost = plan_cost(p)
        ring = f" (the ring's: {ring_steps(coll, p.world)})" if coll is not None else ""
        lines.append(f"cost: {cost.rounds} rounds{ring}; the busiest rank receives {cost.received:.4g} n "
                     "(learning.model.plan_cost)")
    return lines


def _direct_read_lines(collective: str, coll: Collective, world: int, n: int, inputs) -> List[str]:
    """The direct-read all-gather (schedule.simulate_direct_read): post, reads, own chunk and
    done; the result; and what it saved against the ring through the slots."""
    ranks = simulate_direct_read(inputs)
    lines = ["direct read: every rank may read every peer's memory (process_vm_readv, probed at bootstrap), so it",
             "  reads each peer's input straight into its own output: one copy, in the kernel, no slot"]
    if world == 1:
        lines += ["P = 1: no peers, nothing to read (the transports take no direct path either); the input is the "
                  "result"]
    else:
        lines += ["", "1. post: each rank writes where its input lies (address, bytes, call number) in its own header"]
        lines += [f"  rank {rs.rank}: posts {_fmt(rs.posted)}" for rs in ranks]
        lines += ["", "2. read: rank k waits for each peer's post and reads that peer's input into the peer's chunk of",
                  "  its output, in the order k+1, k+2, .. (mod P): at each turn every rank reads a different peer"]
        for rs in ranks:
            lines.append(f"  rank {rs.rank}: reads " + ", ".join(f"rank {peer} {_fmt(values)} -> chunk {peer}"
                                                                 for peer, values in rs.reads))
        lines += ["", "3. own chunk and done: each rank sets direct_read = the call number (it has read every peer),",
                  "  copies its own input into chunk k of its output (in place it is already there) while peers may",
                  "  still be reading it, and waits until every peer's direct_read says so: then the input is free"]
        for rs in ranks:
            peers = ", ".join(str(peer) for peer in sorted(peer for peer, _ in rs.reads))
            lines.append(f"  rank {rs.rank}: own {_fmt(rs.own)} -> chunk {rs.rank}; waits for ranks {peers} to finish "
                         f"reading; holds {_chunked(rs.output, world)}")
    lines.append("")
    lines.extend(_result_lines(collective, coll, [rs.output for rs in ranks], inputs))
    if world > 1:
        steps = ring_steps(coll, world)
        copied = {(path, in_place): all_gather_copied_bytes(world, n, path, in_place)
                  for path in ("direct", "ring") for in_place in (False, True)}
        lines += [f"cost: 2 handshakes (post, done) against the ring's P-1 = {steps} step{'s' * (steps > 1)}; "
                  "elements each rank copies (learning.model.all_gather_copied_bytes, equal chunks):",
                  f"  direct {copied['direct', False]:.4g} ((P-1)/P n read + n/P own chunk; in place "
                  f"{copied['direct', True]:.4g}), through the slots {copied['ring', False]:.4g} ((2P-1)/P n; "
                  f"in place {copied['ring', True]:.4g})"]
    return lines


def _zero_copy_lines(collective: str, coll: Collective, world: int, n: int, inputs) -> List[str]:
    """A collective over symmetric memory (schedule.simulate_zero_copy): post, the fold and
    the copies, the rounds; the result; and the bytes it moves against the slots'."""
    ranks = simulate_zero_copy(coll, inputs)
    lines = ["symmetric memory: every rank's tensor lies in memory every peer has mapped (ringcoll.empty), so each",
             "  rank reads its peers' tensors where they lie; no byte goes through a slot"]
    if world == 1:
        lines += ["P = 1: no peers, nothing to read; the input is the result"]
    else:
        lines += ["", "1. post: each rank writes where its tensor lies (arena, offset) in its own header, before the",
                  "  call check; every rank reads every post, so all agree to read in place (any ordinary tensor:",
                  "  every rank goes through the slots instead)"]
        if coll != Collective.ALL_GATHER:
            lines += ["", "2. fold: rank k reduces chunk k of every rank's tensor, in the order the ring reduces it",
                      "  (rank k+1 first, rank k last): the ring's bits"]
            for rs in ranks:
                for c, values, result in rs.folded:
                    lines.append(f"  rank {rs.rank}: chunk {c} = " + " + ".join(f"rank {r} {_fmt(v)}" for r, v in values)
                                 + f" = {_fmt(result)}")
        if coll == Collective.ALL_REDUCE:
            lines += ["", "round 1: each rank raises its round counter and waits for every peer's: every chunk is reduced"]
        if coll != Collective.REDUCE_SCATTER:
            what = "each peer's input, then its own" if coll == Collective.ALL_GATHER else "chunk j from rank j, who reduced it"
            lines += ["", f"{2 if coll == Collective.ALL_GATHER else 3}. copy: rank k copies {what}, from k+1 on"]
            for rs in ranks:
                lines.append(f"  rank {rs.rank}: " + ", ".join(f"rank {r} {_fmt(v)} -> chunk {c}" for r, c, v in rs.copied))
        lines += ["", f"last round (round {ranks[0].rounds}): every rank has finished reading every peer's tensor; only",
                  "  then does a call return, so a tensor may be written as soon as its call returns"]
    lines.append("")
    lines.extend(_result_lines(collective, coll, [rs.output for rs in ranks], inputs))
    if world > 1:
        traffic = symmetric_traffic(collective, world, in_place=True)
        lines.append(f"cost: {ranks[0].rounds} round{'s' * (ranks[0].rounds > 1)} of flags; each rank reads and writes "
                     f"{traffic * n:.4g} elements ({traffic:.4g} n: learning.model.symmetric_traffic), nothing staged")
    return lines


#: What a trace says where it went wrong (the CLI exits 1 on either): a rank's result differs
#: from the reference; the checker refuses the plan (a call would refuse it too)
MISMATCH, REFUSED = "MISMATCH on rank(s)", "checker: REFUSED"


def _result_lines(collective: str, coll: Optional[Collective], outputs, inputs) -> List[str]:
    expected = reference(collective, inputs)
    rule = {
        "all_reduce": "elementwise sum over ranks",
        "reduce_scatter": "chunk k of the elementwise sum over ranks",
        "all_gather": "concatenation of the ranks' inputs",
        "broadcast": "the root's input",
        "reduce": "elementwise sum over ranks, on the root; every other rank keeps its input",
    }[collective]
    returns = {"reduce_scatter": "rank k returns chunk k", "reduce": "the root returns the sum, the others their input"}
    lines = ["result (" + returns.get(collective, "every rank returns the whole message") + "):"]
    for k, values in enumerate(outputs):
        lines.append(f"  rank {k}: {_fmt(values)}")
    ok = [list(got) == list(want) for got, want in zip(outputs, expected)]
    if coll == Collective.REDUCE_SCATTER:
        shown = " ".join(_fmt(x) for x in expected)
    else:
        shown = _fmt(expected[0]) if expected else "[]"
    verdict = "OK, every rank matches" if all(ok) else \
        f"{MISMATCH} " + ", ".join(str(k) for k, good in enumerate(ok) if not good)
    lines.append(f"check: reference ({rule}) = {shown}: {verdict}")
    return lines


# ---------------------------------------------------------------------------------------
# picture

_REDUCE_COLOUR = "#c0392b"  # chunk arrived and was added to the rank's own copy
_COPY_COLOUR = "#1f5fa8"    # chunk arrived and was copied
_LINE_H = 0.22       # height of one line of values, in data units (the ring's radius is >= 1)
_CHAR_W = 0.075      # width of one monospace character at 8.5 pt, in data units
_INCH_PER_UNIT = 0.96
_GAP = 0.28          # between a rank's circle and its values


def _ring_radius(world: int) -> float:
    """Big enough that the value blocks of neighbouring ranks (P lines each) do not touch."""
    return max(1.0, 0.34 * world)


def _rank_position(rank: int, world: int, radius: float) -> tuple:
    """Rank k on the circle, clockwise, rank 0 at the top left (as the ASCII ring in ring.h)."""
    angle = math.radians(90 + 180 / world - 360 * rank / world)
    return radius * math.cos(angle), radius * math.sin(angle)


def _beside(y: float, radius: float) -> bool:
    """Whether a rank's values go beside it (left or right of the ring) rather than above or
    below it (near the top and bottom of the ring, where they would hit the arrows)."""
    return abs(y / radius) < 0.75


def _value_lines(rs, world: int, n: int, final: set) -> List[str]:
    lines = []
    for c in range(world):
        values = rs.state[chunk_begin(n, world, c):chunk_end(n, world, c)]
        text = f"c{c}: " + (" ".join("." if v is None else str(v) for v in values) or "-")
        lines.append(text + (" *" if c in final else ""))
    return lines


def _panel_limits(sim: Simulation, world: int, n: int, finals: List[List[set]]) -> tuple:
    """Half-width and half-height of a panel: the ring plus every rank's value block."""
    radius = _ring_radius(world)
    chars = max(len(line) for record, final in zip(sim.steps, finals) for rs in record.ranks
                for line in _value_lines(rs, world, n, final[rs.rank]))
    block_w, block_h = chars * _CHAR_W, world * _LINE_H
    half_w, half_h = radius + 0.3, radius + 0.3
    for k in range(world):
        x, y = _rank_position(k, world, radius)
        if _beside(y, radius):
            half_w = max(half_w, abs(x) + _GAP + block_w)
            half_h = max(half_h, abs(y) + block_h / 2)
        else:
            half_w = max(half_w, abs(x) + block_w / 2)
            half_h = max(half_h, abs(y) + _GAP + block_h)
    return half_w + 0.1, half_h + 0.1


def _draw_step(ax, record: StepRecord, world: int, n: int, final: List[set], limits: tuple) -> None:
    half_w, half_h = limits
    ax.set_xlim(-half_w, half_w)
    ax.set_ylim(-half_h, half_h)
    ax.set_aspect("equal")
    ax.axis("off")
    radius = _ring_radius(world)
    ax.add_patch(_circle(radius))
    for rs in record.ranks:
        x, y = _rank_position(rs.rank, world, radius)
        ax.text(x, y, f"r{rs.rank}", ha="center", va="center", fontsize=11, fontweight="bold",
                bbox=dict(boxstyle="circle,pad=0.3", fc="white", ec="black"), zorder=3)
        _draw_arrow(ax, rs, world, radius)
        _draw_values(ax, rs, world, n, final[rs.rank], radius)


def _circle(radius: float):
    from matplotlib.patches import Circle

    return Circle((0, 0), radius, fill=False, ls=":", ec="#bbbbbb", zorder=0)


def _draw_arrow(ax, rs, world: int, radius: float) -> None:
    """The arrow from rank k to k+1, labelled with the chunk it carries; the colour says
    what the receiver does with it (red '+': adds it to its own copy, blue: copies it)."""
    src = _rank_position(rs.rank, world, radius)
    dst = _rank_position(right_neighbour(rs.rank, world), world, radius)
    colour = _REDUCE_COLOUR if rs.reduced else _COPY_COLOUR
    bend = -0.4 if world == 2 else -0.25
    ax.annotate("", xy=dst, xytext=src, zorder=2,
                arrowprops=dict(arrowstyle="-|>", color=colour, lw=1.8, shrinkA=15, shrinkB=15,
                                connectionstyle=f"arc3,rad={bend}"))
    if world == 2:  # one arc above the centre (0 -> 1), one below (1 -> 0)
        lx, ly = 0.0, (0.45 if rs.rank == 0 else -0.45) * radius
    else:  # inside the ring, by the middle of the chord, away from the value blocks
        mx, my = (src[0] + dst[0]) / 2, (src[1] + dst[1]) / 2
        lx, ly = mx, my
    action = "+" if rs.reduced else "copy"
    ax.text(lx, ly, f"c{rs.sent} {action}", ha="center", va="center", fontsize=9, color=colour,
            fontweight="bold", bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none"), zorder=4)


def _draw_values(ax, rs, world: int, n: int, final: set, radius: float) -> None:
    """Rank k's working copy, one chunk per line, outside the circle: beside the rank when
    it sits on the left or right of the ring, above or below it at the top and bottom. The
    chunk just received is coloured; '*' marks chunks that hold their final value."""
    x, y = _rank_position(rs.rank, world, radius)
    if _beside(y, radius):
        tx, ha = x + math.copysign(_GAP, x), ("left" if x > 0 else "right")
        top = y + (world - 1) * _LINE_H / 2
    else:
        tx, ha = x, "center"
        top = y + _GAP + (world - 0.5) * _LINE_H if y > 0 else y - _GAP - _LINE_H / 2
    for c, text in enumerate(_value_lines(rs, world, n, final)):
        colour, weight = "black", "normal"
        if c == rs.received:
            colour = _REDUCE_COLOUR if rs.reduced else _COPY_COLOUR
            weight = "bold"
        ax.text(tx, top - c * _LINE_H, text, ha=ha, va="center", fontsize=8.5, family="monospace",
                color=colour, fontweight=weight, zorder=5)


def draw(collective: str, world: int, n: int, path: Optional[str] = None,
         inputs: Optional[Sequence[Sequence[int]]] = None):
    """Draw the trace: one panel per ring step (a row per phase for all-reduce). Saves a
    PNG to ``path`` when given and returns the figure; ``len(fig.axes)`` is the number of
    ring steps (``fig.ringcoll_panels`` too)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    coll = _collective(collective)
    if world < 2:
        raise ValueError("draw: needs world >= 2 (one rank has no ring steps to draw)")
    given = inputs is not None
    inputs = [list(x) for x in (inputs if given else default_inputs(collective, world, n))]
    sim = simulate(coll, inputs)
    per_row = world - 1
    rows = 2 if coll == Collective.ALL_REDUCE else 1
    finals = _final_chunks(coll, world, sim)
    limits = _panel_limits(sim, world, n, finals)
    # Fixed geometry in inches: every panel is the ring at the same scale, a title above it.
    title_h = 0.35
    panel_w, panel_h = 2 * limits[0] * _INCH_PER_UNIT, 2 * limits[1] * _INCH_PER_UNIT
    caption = _figure_caption(collective, world, n, given, width_chars=int(panel_w * per_row * 12.5))
    caption_h = 0.19 * (caption.count("\n") + 1) + 0.15
    fig_w, fig_h = panel_w * per_row, (panel_h + title_h) * rows + caption_h
    fig = plt.figure(figsize=(fig_w, fig_h))
    for record, final in zip(sim.steps, finals):
        row, col = divmod(record.step, per_row)
        bottom = (rows - 1 - row) * (panel_h + title_h)
        ax = fig.add_axes((col * panel_w / fig_w, bottom / fig_h, panel_w / fig_w, panel_h / fig_h))
        _draw_step(ax, record, world, n, final, limits)
        ax.set_title(f"step {record.step}: {record.phase} {col}", fontsize=11)
    fig.suptitle(caption, fontsize=10.5, y=1 - 0.08 / fig_h, va="top")
    fig.ringcoll_panels = len(sim.steps)
    if path is not None:
        fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def _figure_caption(collective: str, world: int, n: int, given: bool, width_chars: int) -> str:
    import textwrap

    chunks = ", ".join(f"c{c} = [{chunk_begin(n, world, c)},{chunk_end(n, world, c)})" for c in range(world))
    parts = [f"ring {collective}, P = {world}, n = {n}; chunks {chunks}",
             "inputs: as given" if given else describe_inputs(collective).replace("**", "^"),
             "arrow k -> k+1: the chunk sent; red '+': the receiver adds it to its own copy, blue 'copy': "
             "the receiver stores it; coloured line: chunk just received; * = final"]
    return "\n".join(line for part in parts for line in textwrap.wrap(part, max(40, width_chars)))
