"""The alpha-beta cost model of ring collectives, and what it means for data-parallel scaling.

A message of n bytes on P ranks, one link per rank at bandwidth beta (bytes/s) and a
per-step latency alpha (s). The ring cuts the message into P chunks of n/P bytes; every
step each rank sends one chunk to its right neighbour while receiving one from its left,
all links busy at once:

    reduce-scatter   P-1 steps     T = (P-1) alpha + (P-1)/P * n / beta
    all-gather       P-1 steps     T = (P-1) alpha + (P-1)/P * n / beta
    all-reduce       2(P-1) steps  T = 2(P-1) alpha + 2(P-1)/P * n / beta
                     (= reduce-scatter + all-gather, exactly: same steps, same bytes)

So each rank sends 2(P-1)/P * n bytes in an all-reduce: less than 2n for every P, and not
"2 x P x n". Splitting an all-reduce into reduce-scatter + all-gather saves nothing; it
lets the two halves be scheduled apart (ZeRO updates the shard in between).

nccl-tests' busbw = algbw * 2(P-1)/P (all-reduce) or (P-1)/P (the others), with
algbw = n / T: exactly the bytes per second each rank's link carries, so in the
bandwidth-bound limit busbw -> beta whatever P is. That is why it is the number to compare.

alpha and beta are fitted from measurements (``fit``), by least squares over the sizes.

The one-shot path for small messages (the CPU transport below RINGCOLL_SMALL_BYTES): one
step, in which every rank publishes its input once and reads every peer's copy:

    all-reduce       1 step   T = alpha + (P-1) * n / beta       (P-1 reads of n)
    reduce-scatter   1 step   T = alpha + (P-1)/P * n / beta     (chunk k of P-1 copies)
    all-gather       1 step   T = alpha + (P-1)/P * n / beta

It trades steps for bytes: for all-reduce it wins while 2(P-1) alpha + 2(P-1)/P n/beta >
alpha + (P-1) n/beta, i.e. below n* = (2P-3) P / ((P-1)(P-2)) * alpha * beta
(``one_shot_crossover``). At P = 2 both read n bytes, so in this model the one-shot always
wins; reduce-scatter and all-gather read the same bytes as the ring at every P, so the model
has them win always too. What bounds them in practice is what the model leaves out: the
copy into the slot (n bytes for all-reduce and reduce-scatter, which the ring spreads over
its steps) and that a slot must hold it, and the combines: the one-shot all-reduce makes
(P-1) n of them per rank, the ring (P-1)/P n, which for float16 / bfloat16 (about three
times float32's cost per byte) moves the crossover down to a few KiB (the transport's
one_shot_limit). docs/communication.md has the measured crossovers.

Every algorithm, priced from its plan (ringcoll/plans.py). An algorithm is a plan: who
publishes which chunks to whom, who combines what. Two numbers read off the plan price it
(``plan_cost``): the rounds, the longest chain of messages each of which waits for the one
before (the latency term), and the most bytes any one rank receives, per byte of the
message (the bandwidth term). That bandwidth term is the busiest rank's, as when the
message runs in slices that overlap (the engine's two banks: one slice's later rounds run
while the next slice's first ones do), which is how ringcoll runs a plan on a large
message. Unpipelined, a store-and-forward algorithm pays its rounds' bytes one after
another instead: a binomial tree's all-reduce 2 log2(P) * n, not log2(P) * n (the
textbook 2 log2(P) (alpha + n / beta)); for the ring, rhd and rd the two readings agree:

    T = rounds * alpha + received * n / beta                  (``algorithm_time``)

    all-reduce            rounds           received per byte    (P a power of two)
      ring                2(P-1)           2(P-1)/P
      oneshot             1                P-1
      rhd (Rabenseifner)  2 log2 P         2(P-1)/P
      rd                  log2 P           log2 P
      tree (binomial)     2 log2 P         log2 P (the root, once per child)

rhd is the ring's bytes in 2 log2 P rounds instead of 2(P-1): were alpha and beta all,
it would never lose to the ring. rd and tree trade bytes for rounds as one-shot does. At
a P that is not a power of two the recursive ones pair ranks, adding a hand-over and a
hand-back (up to 2 rounds and 2n bytes), enough for the ring to win large messages
again. ``crossovers`` gives the sizes where the fastest algorithm changes; ``fit_plans``
fits one alpha and beta to measurements of several algorithms at once, so one pair has
to predict them all. Left out, as for the ring: the
combines (the one-shot and the tree make more of them), and the copy into the slot.

Copies per byte: the all-gather between processes (the CPU transport). Nothing crosses a
link there; what costs is the copies, each a pass of the bytes through memory. For a
message of n bytes (the output) on P ranks, each rank copies (``all_gather_copies``;
ring_loop.h's ``ring_step`` with host_strip.h's ``copy_strip(dst, dst2, src)``, and
plan.h's ``direct_plan``, which native runs):

    through the slots (the ring)                        out of place   in place
      before step 0:  own chunk -> own slot (dst)       n/P            n/P
                      own chunk -> output (dst2)        n/P            0 (dst2 == src)
      steps 0..P-2:   left slot -> output (dst2)        (P-1)/P n      (P-1)/P n
      steps 0..P-3:   left slot -> own slot (dst),      (P-2)/P n      (P-2)/P n
                      to forward it (step_forwards)
      total                                             (2P-1)/P n     2(P-1)/P n
    direct read
      each peer's input -> its chunk of the output      (P-1)/P n      (P-1)/P n
      own chunk -> output                               n/P            0 (dst2 == src)
      total                                             n              (P-1)/P n

At P = 2 the ring copies 1.5 n out of place and n in place, the direct read n and 0.5 n;
as P grows the ring tends to 2n, the direct read to n: it halves the copies. With one rank
neither runs: ``run_call`` (call.h) copies the input to the output, n bytes out of place,
nothing in place, which is also what both totals give at P = 1. ``all_gather_copy_time``
adds the handshakes, ``handshakes * alpha + copied / beta_copy``: the ring's P-1 steps,
the direct read's 2 (post, done), none for one rank. Left out: the ring makes its P-1
steps once per slice (a message larger than a slot), and which stores write the output
(streaming ones past a threshold, not modelled).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

from ringcoll.tuning import crossings, fastest_between

STEPS = {"all_reduce": lambda p: 2 * (p - 1), "reduce_scatter": lambda p: p - 1, "all_gather": lambda p: p - 1}
BUS_FACTOR = {"all_reduce": lambda p: 2 * (p - 1) / p, "reduce_scatter": lambda p: (p - 1) / p,
              "all_gather": lambda p: (p - 1) / p,
              # nccl-tests' factor for the rooted ones: each link carries the message once
              "broadcast": lambda p: 1.0, "reduce": lambda p: 1.0}


def bytes_sent_per_rank(collective: str, world: int, nbytes: float) -> float:
    """Bytes each rank sends (and receives) in the ring: the busbw numerator."""
    return BUS_FACTOR[collective](world) * nbytes


def ring_time(collective: str, world: int, nbytes: float, alpha: float, beta: float) -> float:
    """Predicted seconds for one ring collective of `nbytes` (see module docstring)."""
    if world == 1:
        return 0.0
    return STEPS[collective](world) * alpha + bytes_sent_per_rank(collective, world, nbytes) / beta


def link_bytes_per_host(collective: str, hosts: int, world: int, two_level: bool = True) -> float:
    """Bytes each of `hosts` machines sends over its link per call, as a fraction of the
    message n. Two levels (ringcoll/training/hierarchical.py): the node's L ranks each carry
    1/L of the message between the machines, in rings of H (one rank per machine), so a
    machine sends the bus factor of H: 2(H-1)/H n for an all-reduce, (H-1)/H n for the
    others. One flat ring of P = H L ranks numbered machine by machine crosses each
    machine's boundary once, with one rank's traffic: the bus factor of P, 2(P-1)/P n and
    (P-1)/P n. At H = 2, P = 4: n against 1.5n, and 0.5n against 0.75n: 1.5x fewer bytes."""
    if hosts <= 1:
        return 0.0
    return BUS_FACTOR[collective](hosts if two_level else world)


# The one-shot path: bytes each rank reads from its peers' slots.
ONE_SHOT_READ_FACTOR = {"all_reduce": lambda p: p - 1, "reduce_scatter": lambda p: (p - 1) / p,
                        "all_gather": lambda p: (p - 1) / p}


def one_shot_time(collective: str, world: int, nbytes: float, alpha: float, beta: float) -> float:
    """Predicted seconds for the one-shot path: one step, then (P-1) n (all-reduce) or
    (P-1)/P n (the others) bytes read from the peers (see module docstring)."""
    if world == 1:
        return 0.0
    return alpha + ONE_SHOT_READ_FACTOR[collective](world) * nbytes / beta


def one_shot_crossover(collective: str, world: int, alpha: float, beta: float) -> float:
    """The message size (bytes) where the one-shot path and the ring take the same time in
    the model; below it the one-shot wins. Infinite where the one-shot reads no more than
    the ring (every collective at P = 2; reduce-scatter and all-gather at every P), and
    where beta is infinite; 0 for P = 1 (nothing to win)."""
    if world == 1:
        return 0.0
    saved_steps = STEPS[collective](world) - 1
    extra_bytes_per_byte = ONE_SHOT_READ_FACTOR[collective](world) - BUS_FACTOR[collective](world)
    if extra_bytes_per_byte <= 1e-12 or math.isinf(beta):
        return math.inf
    return saved_steps * alpha * beta / extra_bytes_per_byte


# --- every algorithm, priced from its plan (see the module docstring) ---------------------


@dataclasses.dataclass(frozen=True)
class PlanCost:
    rounds: int  # messages on the longest chain of sends that wait for each other
    received: float  # most bytes any rank receives, per byte of the message


def plan_cost(p) -> PlanCost:
    """The rounds and the bytes of a plan (a ringcoll.plans.Plan), read off its ops as the
    checker runs them (plans.rounds: an op that receives ends one round after the op that
    published what it reads; one that reads a peer's input where it lies, one round after
    the start, when the input's place was posted); the bytes a rank receives are its
    receives' and such reads' chunks over the plan's chunk count (all-gather: of the
    output). A plan that reads peers' inputs ends with one more round: every rank tells
    every other it has finished reading, and none returns before all have."""
    from ringcoll import plans

    timeline = plans.rounds(p)
    if not timeline:
        return PlanCost(0, 0.0)
    received = [0] * p.world
    reads_inputs = False
    for _, st in timeline:
        if plans.PEER in (st.op.a, st.op.b) or plans.PEER_INPUT in (st.op.a, st.op.b):
            received[st.rank] += st.op.count
        reads_inputs = reads_inputs or plans.PEER_INPUT in (st.op.a, st.op.b)
    return PlanCost(max(t for t, _ in timeline) + int(reads_inputs), max(received) / p.chunks)


def _plan_cost(name: str, collective: str, world: int) -> PlanCost:
    from ringcoll import plans

    return plan_cost(plans.plan(name, collective, world))


def algorithm_time(name: str, collective: str, world: int, nbytes: float, alpha: float, beta: float) -> float:
    """Predicted seconds for algorithm ``name`` (a built-in or registered plan):
    rounds * alpha + received * nbytes / beta, both read off its plan."""
    cost = _plan_cost(name, collective, world)
    return cost.rounds * alpha + cost.received * nbytes / beta


def crossovers(collective: str, world: int, alpha: float, beta: float, names: Sequence[str]) -> list:
    """Where the fastest of ``names`` changes as the message grows, in the model:
    ``[(from_bytes, name), ...]``, the first from 0. Each algorithm's time is a line in n;
    the fastest is their lower envelope, which changes only where two lines cross."""
    costs = {name: _plan_cost(name, collective, world) for name in names}

    def time(name, n):
        return costs[name].rounds * alpha + costs[name].received * n / beta

    def fastest(n):  # ties go to the earlier name
        return min(names, key=lambda name: (time(name, n), names.index(name)))

    lines = {name: (costs[name].rounds * alpha, costs[name].received / beta) for name in names}
    return fastest_between({0.0, *crossings(lines)}, fastest)


def fit_plans(collective: str, world: int, measured: Sequence[tuple[str, float, float]]) -> Fit:
    """One alpha and beta for several algorithms at once, from ``(name, bytes, seconds)``:
    least squares as ``fit``, each algorithm's rounds and bytes read off its plan."""
    if world < 2:
        raise ValueError("fit_plans: needs world >= 2 (one rank sends nothing)")
    xs = []
    for name, nbytes, t in measured:
        if t <= 0:
            raise ValueError("fit_plans: times must be positive")
        cost = _plan_cost(name, collective, world)
        xs.append((cost.rounds / t, cost.received * nbytes / t))
    return _fit_columns(xs)


def symmetric_traffic(collective: str, world: int, in_place: bool) -> float:
    """Bytes each rank reads plus writes, per byte of the message, when a collective reads
    symmetric memory in place (docs/symmetric.md; the message: all-reduce's tensor,
    reduce-scatter's input, all-gather's output). The memory bus carries at least this, so
    with a copy's measured bandwidth (2 bytes moved per byte copied) it gives the floor.

    all-reduce      fold chunk k of P inputs (reads n, writes n/P), then copy P-1 reduced
                    chunks (reads and writes (P-1)/P n): (3P-1)/P, in place or not
    reduce-scatter  the fold alone: (P+1)/P
    all-gather      P-1 peers' chunks read and written, and the own one out of place: 2,
                    in place 2(P-1)/P
    """
    if world < 1:
        raise ValueError("symmetric_traffic: world must be >= 1")
    if world == 1:
        return 0.0 if in_place else 2.0  # one rank: the call copies its input, or nothing
    if collective == "all_reduce":
        return (3 * world - 1) / world
    if collective == "reduce_scatter":
        return (world + 1) / world
    if collective == "all_gather":
        return 2 * (world - 1) / world if in_place else 2.0
    raise ValueError(f"symmetric_traffic: no model for {collective!r}")


# The all-gather's copies on the CPU transport (see the module docstring).
ALL_GATHER_PATHS = ("ring", "direct")


def _check_all_gather_path(who: str, world: int, path: str) -> None:
    if path not in ALL_GATHER_PATHS:
        raise ValueError(f"{who}: path must be one of {', '.join(ALL_GATHER_PATHS)}, got {path!r}")
    if world < 1:
        raise ValueError(f"{who}: world must be >= 1")


def all_gather_copies(world: int, nbytes: float, path: str, in_place: bool) -> list[tuple[str, float]]:
    """What each rank copies in an all-gather of an ``nbytes`` output, term by term, as
    ``(what, bytes)``: the table of the module docstring, so each term can be checked
    against the code that makes the copy."""
    _check_all_gather_path("all_gather_copies", world, path)
    if world == 1:
        return [("input -> output (run_call, no peers)", 0.0 if in_place else float(nbytes))]
    chunk = nbytes / world
    own_to_output = [] if in_place else [("own chunk -> output", chunk)]
    if path == "direct":
        return [("each peer's input -> output (read)", (world - 1) * chunk)] + own_to_output
    return ([("own chunk -> own slot", chunk)] + own_to_output
            + [("each received chunk, left slot -> output", (world - 1) * chunk),
               ("received chunks forwarded, left slot -> own slot", (world - 2) * chunk)])


def all_gather_copied_bytes(world: int, nbytes: float, path: str, in_place: bool) -> float:
    """Bytes each rank copies in an all-gather of an ``nbytes`` output: out of place
    (2P-1)/P n through the slots, n read directly; in place 2(P-1)/P n and (P-1)/P n."""
    return sum(bytes_ for _, bytes_ in all_gather_copies(world, nbytes, path, in_place))


def all_gather_handshakes(world: int, path: str) -> int:
    """Waits on a peer's flag that a rank's all-gather takes: the ring's P-1 steps (per
    slice), the direct read's two (every post, every peer done); none for one rank."""
    _check_all_gather_path("all_gather_handshakes", world, path)
    if world == 1:
        return 0
    return STEPS["all_gather"](world) if path == "ring" else 2


def all_gather_copy_time(world: int, nbytes: float, path: str, in_place: bool, alpha: float,
                         beta_copy: float) -> float:
    """Predicted seconds for an all-gather on the CPU transport: ``alpha`` per handshake
    plus the copied bytes at ``beta_copy`` bytes/s (one rank's memory copy bandwidth)."""
    return (all_gather_handshakes(world, path) * alpha
            + all_gather_copied_bytes(world, nbytes, path, in_place) / beta_copy)


@dataclasses.dataclass(frozen=True)
class Fit:
    alpha: float  # seconds per ring step
    beta: float   # bytes per second per link

    def predict(self, collective: str, world: int, nbytes: float) -> float:
        return ring_time(collective, world, nbytes, self.alpha, self.beta)


def fit(collective: str, world: int, sizes: Sequence[float], times: Sequence[float]) -> Fit:
    """Least-squares alpha, beta from measured (bytes, seconds) of one collective.

    The model is linear in (alpha, 1/beta): t = steps * alpha + sent_bytes * (1/beta).
    Residuals are relative (each equation divided by its measured time): sizes span five
    orders of magnitude, and plain residuals would let the largest messages decide alone,
    leaving alpha at whatever fits 64 MiB. Both terms are kept non-negative: if the
    unconstrained fit makes one negative, that term is dropped and the other refitted.
    """
    if world < 2:
        raise ValueError("fit: needs world >= 2 (one rank sends nothing)")
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError("fit: need at least two (size, time) pairs of equal length")
    if any(t <= 0 for t in times):
        raise ValueError("fit: times must be positive")
    steps = float(STEPS[collective](world))
    return _fit_columns([(steps / t, bytes_sent_per_rank(collective, world, n) / t) for n, t in zip(sizes, times)])


def _fit_columns(xs: Sequence[tuple[float, float]]) -> Fit:
    """alpha, beta from rows (steps / t, bytes / t) = 1, both kept non-negative."""
    if len(xs) < 2:
        raise ValueError("fit: need at least two (size, time) pairs of equal length")
    ones = [1.0] * len(xs)
    a, inv_b = _least_squares_2(xs, ones)
    if a < 0:  # bandwidth only
        a, inv_b = 0.0, _least_squares_1([x[1] for x in xs], ones)
    elif inv_b <= 0:  # latency only: bandwidth effectively infinite
        a, inv_b = _least_squares_1([x[0] for x in xs], ones), 0.0
    return Fit(alpha=a, beta=float("inf") if inv_b == 0 else 1.0 / inv_b)


def _least_squares_1(x: Sequence[float], y: Sequence[float]) -> float:
    sxx = sum(v * v for v in x)
    return max(0.0, sum(u * v for u, v in zip(x, y)) / sxx) if sxx else 0.0


def _least_squares_2(xs: Sequence[tuple[float, float]], y: Sequence[float]) -> tuple[float, float]:
    """Solve min ||X c - y|| for two columns via the normal equations."""
    s11 = sum(a * a for a, _ in xs)
    s12 = sum(a * b for a, b in xs)
    s22 = sum(b * b for _, b in xs)
    t1 = sum(a * v for (a, _), v in zip(xs, y))
    t2 = sum(b * v for (_, b), v in zip(xs, y))
    det = s11 * s22 - s12 * s12
    if det == 0:
        return 0.0, _least_squares_1([b for _, b in xs], y)
    return (t1 * s22 - t2 * s12) / det, (s11 * t2 - s12 * t1) / det


# --- data-parallel scaling -----------------------------------------------------------------


def amdahl_speedup(serial_fraction: float, workers: int) -> float:
    """Amdahl's law: the speedup of P workers when a fraction s of the work cannot be split."""
    return 1.0 / (serial_fraction + (1.0 - serial_fraction) / workers)


def data_parallel_step_time(compute_seconds: float, grad_bytes: float, world: int, fit: Fit,
                            overlap: bool = False) -> float:
    """One synchronous data-parallel step (weak scaling: every rank computes its own batch
    in `compute_seconds`, then gradients are all-reduced).

    Without overlap the all-reduce follows the backward pass: compute + comm. With perfect
    overlap (DDP's buckets, all-reduced while backward goes on) the step takes the longer of
    the two; real overlap lies in between, since the last bucket is only ready at the end.
    """
    comm = fit.predict("all_reduce", world, grad_bytes)
    return max(compute_seconds, comm) if overlap else compute_seconds + comm


def data_parallel_speedup(compute_seconds: float, grad_bytes: float, world: int, fit: Fit,
                          overlap: bool = False) -> float:
    """Throughput of `world` ranks over one rank's (which needs no communication)."""
    return world * compute_seconds / data_parallel_step_time(compute_seconds, grad_bytes, world, fit, overlap)


def scaling_table(compute_seconds: float, grad_bytes: float, worlds: Iterable[int], fit: Fit) -> list[dict]:
    """Speedup and efficiency with and without overlap for each world size."""
    rows = []
    for p in worlds:
        plain = data_parallel_speedup(compute_seconds, grad_bytes, p, fit, overlap=False)
        overlapped = data_parallel_speedup(compute_seconds, grad_bytes, p, fit, overlap=True)
        rows.append({"world": p, "comm_s": fit.predict("all_reduce", p, grad_bytes),
                     "speedup": plain, "efficiency": plain / p,
                     "speedup_overlap": overlapped, "efficiency_overlap": overlapped / p})
    return rows


def main(argv=None) -> None:
    """python -m ringcoll.learning.model: the scaling table for a step of compute and a gradient."""
    import argparse

    from ringcoll.learning.options import number

    def worlds_list(text: str) -> list:
        return [number(int)(w) for w in text.split(",")]

    p = argparse.ArgumentParser(prog="python -m ringcoll.learning.model", description=main.__doc__)
    p.add_argument("--compute-ms", type=number(float), required=True, help="one rank's forward+backward time")
    p.add_argument("--grad-mb", type=number(float, least=0, above=None), required=True,
                   help="gradient bytes all-reduced per step (MB)")
    p.add_argument("--alpha-us", type=number(float, least=0, above=None), required=True,
                   help="latency per ring step (ringcoll-bench --fit)")
    p.add_argument("--beta-gbs", type=number(float), required=True, help="bandwidth per link, GB/s (ringcoll-bench --fit)")
    p.add_argument("--worlds", type=worlds_list, default="1,2,4,8,16,32,64", help="ranks, e.g. 1,2,4")
    args = p.parse_args(argv)
    fit_ = Fit(alpha=args.alpha_us * 1e-6, beta=args.beta_gbs * 1e9)
    worlds = args.worlds
    print(f"{'P':>5} {'all-reduce ms':>14} {'speedup':>8} {'eff':>6} | {'overlapped':>10} {'eff':>6}")
    for row in scaling_table(args.compute_ms * 1e-3, args.grad_mb * 1e6, worlds, fit_):
        print(f"{row['world']:>5} {row['comm_s'] * 1e3:14.3f} {row['speedup']:8.2f} {row['efficiency']:6.1%} | "
              f"{row['speedup_overlap']:10.2f} {row['efficiency_overlap']:6.1%}")


if __name__ == "__main__":
    main()
