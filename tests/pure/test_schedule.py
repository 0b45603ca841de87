"""Tier 1: the ring schedule. ringcoll/learning/schedule.py against its C++ twin (ring.h and the
slicing helpers of ring_loop.h, exposed as ringcoll._C.schedule), then the properties
the ring must have, checked from first principles rather than by restating the formulas,
then simulate() against the plain reference computation."""

import functools
import operator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringcoll import _C
from ringcoll.learning import schedule as S
from ringcoll.learning.schedule import Collective

CS = _C.schedule
WORLDS = range(1, 10)
COLLS = list(Collective)


def sizes(world):
    return sorted({0, 1, 2, max(world - 1, 0), world, world + 1, 17, 100, 101, 2**40 + 3})


# ---------------------------------------------------------------------------------------
# (a) Python mirror == C++


def test_collective_codes():
    # collectives.h: kAllReduce = 0, kReduceScatter = 1, kAllGather = 2, kBarrier = 3, then the rooted ones;
    # the ring's schedule has the first three.
    assert [row[:2] for row in _C.collective_table] == [("all_reduce", 0), ("reduce_scatter", 1), ("all_gather", 2),
                                                       ("barrier", 3), ("broadcast", 4), ("reduce", 5)]
    assert [int(c) for c in Collective] == [0, 1, 2]
    assert Collective(0) is Collective.ALL_REDUCE
    assert Collective(1) is Collective.REDUCE_SCATTER
    assert Collective(2) is Collective.ALL_GATHER


def test_every_table_by_collective_covers_the_cpp_list():
    """The collectives are listed once (collectives.h, read as _C.collective_table); what
    Python keeps per collective (the ring's formulas, shapes, names) has exactly the ring's
    collectives (the data collectives without a root; the rooted ones run as plans only)."""
    from ringcoll import _types
    from ringcoll.harness import bench
    from ringcoll.learning import model, trace

    data = [name for name, _code, _reduces, moves, _rooted in _C.collective_table if moves]
    rooted = [name for name, _code, _reduces, _moves, rooted in _C.collective_table if rooted]
    ring = [name for name in data if name not in rooted]
    assert list(_types.DATA_COLLECTIVES) == data and set(_types.ROOTED_COLLECTIVES) == set(rooted) == {"broadcast",
                                                                                                     "reduce"}
    assert list(_types.RING_COLLECTIVES) == ring and [c.name.lower() for c in Collective] == ring
    for table in (model.STEPS, model.ONE_SHOT_READ_FACTOR, trace.COLLECTIVES):  # the ring's formulas and schedule
        assert list(table) == ring, table
    for table in (model.BUS_FACTOR, bench.COLLECTIVES):  # what the benchmark times
        assert list(table) == data, table
    assert {name for name, d in bench.COLLECTIVES.items() if d.reduces} == _types.REDUCING_COLLECTIVES


@pytest.mark.parametrize("world", WORLDS)
def test_neighbours_and_ring_mod_match_cpp(world):
    for rank in range(world):
        assert S.left_neighbour(rank, world) == CS.left_neighbour(rank, world)
        assert S.right_neighbour(rank, world) == CS.right_neighbour(rank, world)
    # ring_mod has no binding of its own; C++ left/right_neighbour are ring_mod(rank -+ 1),
    # and they accept any int, so they exercise it over negative and large arguments.
    for x in range(-3 * world - 2, 3 * world + 3):
        assert S.ring_mod(x, world) == CS.left_neighbour(x + 1, world)
        assert S.ring_mod(x, world) == CS.right_neighbour(x - 1, world)


@pytest.mark.parametrize("world", WORLDS)
def test_chunks_match_cpp(world):
    for n in sizes(world):
        for c in range(world + 1):
            assert S.chunk_begin(n, world, c) == CS.chunk_begin(n, world, c), (n, world, c)
        for c in range(world):
            assert S.chunk_end(n, world, c) == CS.chunk_end(n, world, c), (n, world, c)
            # chunk_length / max_chunk_length have no binding: compare with the C++ bounds.
            assert S.chunk_length(n, world, c) == CS.chunk_end(n, world, c) - CS.chunk_begin(n, world, c)
        assert S.max_chunk_length(n, world) == CS.chunk_end(n, world, 0) - CS.chunk_begin(n, world, 0)


@pytest.mark.parametrize("world", WORLDS)
def test_phase_chunks_match_cpp(world):
    # Steps beyond the phase too: the C++ functions are total, so is the mirror.
    for rank in range(world):
        for step in range(2 * world + 1):
            for name in ("rs_send_chunk", "rs_recv_chunk", "rs_contributor", "ag_send_chunk", "ag_recv_chunk"):
                assert getattr(S, name)(rank, step, world) == getattr(CS, name)(rank, step, world), (
                    name, rank, step, world)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("coll", COLLS)
def test_collective_steps_match_cpp(coll, world):
    c = int(coll)
    assert S.ring_steps(coll, world) == CS.ring_steps(c, world)
    steps = S.ring_steps(coll, world)
    for step in range(steps + 1):
        assert S.step_reduces(coll, step, world) == CS.step_reduces(c, step, world)
        assert S.step_writes_output(coll, step, world) == CS.step_writes_output(c, step, world)
        assert S.step_forwards(coll, step, world) == CS.step_forwards(c, step, world)
    for rank in range(world):
        assert S.first_send_chunk(coll, rank, world) == CS.first_send_chunk(c, rank, world)
        for step in range(steps):
            assert S.step_recv_chunk(coll, rank, step, world) == CS.step_recv_chunk(c, rank, step, world)
    # The mirror takes plain ints as well as the enum, like the C++ binding.
    assert S.ring_steps(c, world) == CS.ring_steps(c, world)


def test_slicing_matches_cpp():
    for chunk_len in list(range(0, 40)) + [2**33 + 5]:
        for slice_elems in (1, 2, 3, 7, 8, 16, 64, 2**20):
            for j in range(0, 45):
                assert S.slice_length(chunk_len, slice_elems, j) == CS.slice_length(chunk_len, slice_elems, j)
    for world in WORLDS:
        for count in sizes(world) + [3 * world + 5, 1000]:
            for slice_elems in (1, 2, 3, 7, 8, 64, 2**20):
                assert S.num_slices(count, world, slice_elems) == CS.num_slices(count, world, slice_elems)


# ---------------------------------------------------------------------------------------
# (b) properties, from first principles


def phase_steps(coll, world):
    """(step of the whole collective, phase-local step, phase) for every step."""
    out = []
    for t in range(S.ring_steps(coll, world)):
        if S.step_reduces(coll, t, world):
            out.append((t, t, "rs"))
        else:
            out.append((t, t - (world - 1) if coll == Collective.ALL_REDUCE else t, "ag"))
    return out


def sent_chunk(coll, rank, t, world):
    """What rank sends at step t: its first publication at t = 0, else what it received
    at t-1 (the ring_loop.h protocol)."""
    if t == 0:
        return S.first_send_chunk(coll, rank, world)
    assert S.step_forwards(coll, t - 1, world)
    return S.step_recv_chunk(coll, rank, t - 1, world)


@pytest.mark.parametrize("world", WORLDS)
def test_chunks_tile_the_message(world):
    for n in sizes(world) + list(range(0, 3 * world + 2)):
        bounds = [(S.chunk_begin(n, world, c), S.chunk_end(n, world, c)) for c in range(world)]
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        for (b0, e0), (b1, _) in zip(bounds, bounds[1:]):
            assert e0 == b1  # contiguous, in order, no overlap
        lengths = [e - b for b, e in bounds]
        assert all(x >= 0 for x in lengths)
        assert sum(lengths) == n
        assert max(lengths) - min(lengths) <= 1
        assert lengths == sorted(lengths, reverse=True)  # the longer chunks come first
        assert S.max_chunk_length(n, world) == max(lengths)
        assert S.chunk_begin(n, world, world) == n


@pytest.mark.parametrize("world", WORLDS)
def test_neighbours_form_one_ring(world):
    seen, rank = [], 0
    for _ in range(world):
        seen.append(rank)
        nxt = S.right_neighbour(rank, world)
        assert S.left_neighbour(nxt, world) == rank
        rank = nxt
    assert rank == 0 and sorted(seen) == list(range(world))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("coll", COLLS)
def test_receive_what_left_neighbour_sends(coll, world):
    for t, local, phase in phase_steps(coll, world):
        for k in range(world):
            left = S.left_neighbour(k, world)
            recv = S.step_recv_chunk(coll, k, t, world)
            assert recv == sent_chunk(coll, left, t, world)
            # The phase-level functions say the same.
            send_fn = S.rs_send_chunk if phase == "rs" else S.ag_send_chunk
            recv_fn = S.rs_recv_chunk if phase == "rs" else S.ag_recv_chunk
            assert recv_fn(k, local, world) == send_fn(left, local, world) == recv
            assert send_fn(k, local, world) == sent_chunk(coll, k, t, world)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("coll", COLLS)
def test_received_is_sent_next_step(coll, world):
    steps = S.ring_steps(coll, world)
    for t in range(steps):
        assert S.step_forwards(coll, t, world) == (t < steps - 1)
    for t, local, phase in phase_steps(coll, world):
        if t + 1 >= steps or (phase == "rs" and not S.step_reduces(coll, t + 1, world)):
            continue
        for k in range(world):
            send_fn = S.rs_send_chunk if phase == "rs" else S.ag_send_chunk
            recv_fn = S.rs_recv_chunk if phase == "rs" else S.ag_recv_chunk
            assert recv_fn(k, local, world) == send_fn(k, local + 1, world)
    # Across the phase boundary of all-reduce: the chunk finished at the last
    # reduce-scatter step is the first one all-gather sends.
    if coll == Collective.ALL_REDUCE and world > 1:
        for k in range(world):
            assert S.rs_recv_chunk(k, world - 2, world) == S.ag_send_chunk(k, 0, world) == k


@pytest.mark.parametrize("world", range(2, 10))
def test_reduce_scatter_ends_with_own_chunk(world):
    for coll in (Collective.REDUCE_SCATTER, Collective.ALL_REDUCE):
        last = world - 2
        for k in range(world):
            assert S.step_recv_chunk(coll, k, last, world) == k
            assert S.step_writes_output(coll, last, world)
            for t in range(last):
                assert not S.step_writes_output(coll, t, world)


@pytest.mark.parametrize("world", WORLDS)
def test_contributions_accumulate_to_all_ranks(world):
    """Track, symbolically, whose contributions each reduce-scatter partial holds: each
    hop adds the receiver's, and the partial rank k finishes holds every rank's exactly
    once."""
    coll = Collective.REDUCE_SCATTER
    outbox = {k: (S.first_send_chunk(coll, k, world), (k,)) for k in range(world)}
    finished = {}
    for t in range(S.ring_steps(coll, world)):
        nxt = {}
        for k in range(world):
            chunk, who = outbox[S.left_neighbour(k, world)]
            assert chunk == S.step_recv_chunk(coll, k, t, world)
            # what ring.h, schedule.py and ring.md state: received at step t, reduced over
            # ranks k-t-1 .. k-1 (t+1 of them)
            assert sorted(who) == sorted(S.ring_mod(k - 1 - i, world) for i in range(t + 1))
            who = who + (k,)
            assert len(set(who)) == len(who)  # never reduced twice into the same partial
            if S.step_writes_output(coll, t, world):
                finished[k] = (chunk, who)
            if S.step_forwards(coll, t, world):
                nxt[k] = (chunk, who)
        outbox = nxt
    if world > 1:
        for k in range(world):
            chunk, who = finished[k]
            assert chunk == k and sorted(who) == list(range(world))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("coll", COLLS)
def test_every_chunk_received_once_per_phase(coll, world):
    for phase in ("rs", "ag"):
        ts = [(t, local) for t, local, p in phase_steps(coll, world) if p == phase]
        if not ts:
            continue
        for k in range(world):
            got = [S.step_recv_chunk(coll, k, t, world) for t, _ in ts]
            sent = [sent_chunk(coll, k, t, world) for t, _ in ts]
            assert len(got) == world - 1 and len(sent) == world - 1  # P-1 chunks per phase
            assert len(set(got)) == world - 1
            if phase == "ag":
                # Every chunk but its own, which it already had.
                assert sorted(got) == sorted(set(range(world)) - {k})
                assert sent[0] == k
            else:
                # Every chunk but the one it only ever contributes raw (k-1).
                assert sorted(got) == sorted(set(range(world)) - {S.left_neighbour(k, world)})


@pytest.mark.parametrize("world", WORLDS)
def test_bytes_sent_per_rank(world):
    n = 12 * 7 * 5 * 8 * 9  # divisible by every world in the grid
    for coll, phases in ((Collective.REDUCE_SCATTER, 1), (Collective.ALL_GATHER, 1), (Collective.ALL_REDUCE, 2)):
        for k in range(world):
            sent = sum(S.chunk_length(n, world, sent_chunk(coll, k, t, world))
                       for t in range(S.ring_steps(coll, world)))
            assert sent * world == phases * (world - 1) * n


@pytest.mark.parametrize("world", WORLDS)
def test_slices_cover_every_chunk(world):
    for count in sizes(world)[:-1] + [3 * world + 5]:
        for slice_elems in (1, 2, 3, 5, 64):
            slices = S.num_slices(count, world, slice_elems)
            for c in range(world):
                clen = S.chunk_length(count, world, c)
                lens = [S.slice_length(clen, slice_elems, j) for j in range(slices + 2)]
                assert sum(lens) == clen
                assert all(0 <= x <= slice_elems for x in lens)
                assert lens[slices:] == [0, 0]
                # Full slices first, then at most one partial one, then empties.
                nz = [x for x in lens if x]
                assert all(x == slice_elems for x in nz[:-1])
            if count:
                # No slice is empty for every chunk: the count is the fewest that fits.
                assert S.slice_length(S.max_chunk_length(count, world), slice_elems, slices - 1) > 0
            else:
                assert slices == 0


# ---------------------------------------------------------------------------------------
# (c) simulate() against the plain reference


def rank_inputs(world, n, seed=0):
    # Distinct integers, so a lost or doubled contribution changes the result.
    return [[(seed * 7919 + r * 1000 + i * 13 + 1) * (1 if (r + i) % 2 else -1) for i in range(n)]
            for r in range(world)]


def split_chunks(full, world):
    n = len(full)
    return [full[S.chunk_begin(n, world, c):S.chunk_end(n, world, c)] for c in range(world)]


SIM_SIZES = (0, 1, 2, 3, 5, 6, 7, 13, 24)


@pytest.mark.parametrize("world", range(1, 7))
@pytest.mark.parametrize("n", SIM_SIZES)
def test_simulate_all_reduce(world, n):
    inputs = rank_inputs(world, n)
    reference = [sum(x[i] for x in inputs) for i in range(n)]
    sim = S.simulate(Collective.ALL_REDUCE, inputs)
    assert sim.outputs == [reference] * world
    assert len(sim.steps) == 2 * (world - 1)
    if sim.steps:
        assert all(r.state == reference for r in sim.steps[-1].ranks)


@pytest.mark.parametrize("world", range(1, 7))
@pytest.mark.parametrize("n", SIM_SIZES)
def test_simulate_reduce_scatter(world, n):
    inputs = rank_inputs(world, n, seed=1)
    reference = [sum(x[i] for x in inputs) for i in range(n)]
    sim = S.simulate(Collective.REDUCE_SCATTER, inputs)
    assert sim.outputs == split_chunks(reference, world)
    assert len(sim.steps) == world - 1
    if sim.steps:
        # Rank k's working copy holds the finished chunk k after the last step.
        for k, r in enumerate(sim.steps[-1].ranks):
            lo, hi = S.chunk_begin(n, world, k), S.chunk_end(n, world, k)
            assert r.received == k and r.final and r.reduced
            assert r.state[lo:hi] == reference[lo:hi]


@pytest.mark.parametrize("world", range(1, 7))
@pytest.mark.parametrize("n", SIM_SIZES)
def test_simulate_all_gather(world, n):
    full = list(range(100, 100 + n))
    inputs = split_chunks(full, world)
    sim = S.simulate(Collective.ALL_GATHER, inputs)
    assert sim.outputs == [full] * world
    assert len(sim.steps) == world - 1
    for rec in sim.steps:
        assert rec.phase == "all-gather"
        assert not any(r.reduced for r in rec.ranks)


@pytest.mark.parametrize("world", range(2, 7))
def test_simulate_records(world):
    n = 2 * world + 1
    inputs = rank_inputs(world, n, seed=2)
    sim = S.simulate(Collective.ALL_REDUCE, inputs)
    for rec in sim.steps:
        assert [r.rank for r in rec.ranks] == list(range(world))
        assert rec.phase == ("reduce-scatter" if rec.step < world - 1 else "all-gather")
        for r in rec.ranks:
            left = rec.ranks[S.left_neighbour(r.rank, world)]
            assert r.received == left.sent
            lo, hi = S.chunk_begin(n, world, left.sent), S.chunk_end(n, world, left.sent)
            assert len(left.sent_values) == hi - lo
            if r.reduced:
                assert r.state[lo:hi] == [a + b for a, b in zip(left.sent_values, inputs[r.rank][lo:hi])]
            else:
                assert r.state[lo:hi] == left.sent_values


def test_simulate_other_ops_and_errors():
    inputs = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3], [5, 8, 9, 7, 9], [3, 2, 3, 8, 4]]
    for op, fold in ((max, max), (min, min), (operator.mul, operator.mul)):
        ref = [functools.reduce(fold, col) for col in zip(*inputs)]
        assert S.simulate(Collective.ALL_REDUCE, inputs, op=op).outputs == [ref] * 4
    # Non-commutative op: the received partial comes first, own contribution second,
    # so a string "sum" records the order contributions travelled round the ring.
    sim = S.simulate(Collective.REDUCE_SCATTER, [["a"], ["b"], ["c"]], op=operator.add)
    assert sim.outputs == [["bca"], [], []]
    with pytest.raises(ValueError):
        S.simulate(Collective.ALL_REDUCE, [[1, 2], [1]])
    with pytest.raises(ValueError):
        S.simulate(Collective.ALL_GATHER, [[1], [1, 2]])  # chunk 0 must be the longer one
    with pytest.raises(ValueError):
        S.simulate(Collective.ALL_REDUCE, [])



@pytest.mark.parametrize("world", range(1, 7))
@pytest.mark.parametrize("coll", [Collective.ALL_REDUCE, Collective.REDUCE_SCATTER])
def test_one_shot_folds_in_the_rings_order(world, coll):
    """A string "sum" records the order of the contributions: the one-shot path's result is
    the ring's, element for element, and chunk c is folded in rs_contributor's order."""
    for n in (0, 1, world - 1, 2 * world + 1):
        inputs = [[f"{r}:{i} " for i in range(n)] for r in range(world)]
        ring = S.simulate(coll, inputs, op=operator.add).outputs
        assert [r.output for r in S.simulate_one_shot(coll, inputs, op=operator.add)] == ring, (world, n)
        for c in range(world):
            for i in range(S.chunk_begin(n, world, c), S.chunk_end(n, world, c)):
                order = "".join(f"{S.rs_contributor(c, j, world)}:{i} " for j in range(world))
                assert ring[c][i - S.chunk_begin(n, world, c) if coll == Collective.REDUCE_SCATTER else i] == order

@settings(max_examples=60, deadline=None)
@given(
    coll=st.sampled_from(COLLS),
    world=st.integers(1, 7),
    n=st.integers(0, 20),
    seed=st.integers(0, 10**6),
)
def test_simulate_property(coll, world, n, seed):
    import random

    rng = random.Random(seed)
    if coll == Collective.ALL_GATHER:
        full = [rng.randint(-50, 50) for _ in range(n)]
        assert S.simulate(coll, split_chunks(full, world)).outputs == [full] * world
        return
    inputs = [[rng.randint(-50, 50) for _ in range(n)] for _ in range(world)]
    reference = [sum(col) for col in zip(*inputs)] if n else []
    sim = S.simulate(coll, inputs)
    expected = [reference] * world if coll == Collective.ALL_REDUCE else split_chunks(reference, world)
    assert sim.outputs == expected
    # Every rank sends P-1 chunks per phase, and exactly (P-1)/P of the message's
    # elements per phase in total over the ring (summed over ranks: (P-1) * n).
    phases = 2 if coll == Collective.ALL_REDUCE else 1
    total = sum(len(r.sent_values) for rec in sim.steps for r in rec.ranks)
    assert total == phases * (world - 1) * n
    for k in range(world):
        assert sum(1 for rec in sim.steps for r in rec.ranks if r.rank == k) == phases * (world - 1)


# ---------------------------------------------------------------------------------------
# the one-shot path's test, mirrored from csrc/host/host_comm.h


@pytest.mark.parametrize("world", WORLDS)
def test_one_shot_fits_matches_cpp(world):
    for coll in COLLS:
        for ring_count in (0, 1, world, 255, 256, 257, 1024, 1025, 2048, 2049, 4096 * world):
            for elem in (1, 2, 4, 8):
                for small in (0, 1024, 4096, 65536):
                    for slot in (512, 1024, 2048):
                        args = (coll, ring_count, elem, world, small, slot)
                        assert S.one_shot_fits(*args) == _C.one_shot_fits(int(coll), *args[1:]), args


def test_direct_read_fits_matches_cpp():
    for coll in COLLS:
        for ring_count in (0, 1, 4095, 4096, 4097, 8192 * 5, (8 << 20) - 1, 8 << 20):
            for elem in (1, 4):
                for direct_reads in (False, True):
                    for direct, top in ((0, 8 << 20), (1, 8 << 20), (4096, 1 << 62), (16384, 16384)):
                        args = (coll, ring_count, elem, direct_reads, direct, top)
                        assert S.direct_read_fits(*args) == _C.direct_read_fits(int(coll), *args[1:]), args


def test_direct_read_fits_bounds():
    ag, ar, top = Collective.ALL_GATHER, Collective.ALL_REDUCE, 32 << 20
    assert S.direct_read_fits(ag, 4096, 1, True, 4096, top)
    assert not S.direct_read_fits(ag, 4095, 1, True, 4096, top)  # under the threshold
    assert not S.direct_read_fits(ag, 4096, 1, False, 4096, top)  # a probe failed
    assert not S.direct_read_fits(ag, 4096, 1, True, 0, top)  # turned off
    assert not S.direct_read_fits(ar, 4096, 1, True, 1, top)  # all-gather only
    assert S.direct_read_fits(ag, 4096, 1, True, 1, top) and S.one_shot_fits(ag, 4096, 1, 2, 4096, 4096)  # before it
    assert S.direct_read_fits(ag, top - 1, 1, True, 1, top)
    assert not S.direct_read_fits(ag, top, 1, True, 1, top)  # from here the slots are faster
    assert _C.host_default_direct_max_bytes == top


def test_one_shot_fits_bounds():
    ar, ag = Collective.ALL_REDUCE, Collective.ALL_GATHER
    assert S.one_shot_fits(ar, 1024, 4, 2, 4096, 4096) and not S.one_shot_fits(ar, 1025, 4, 2, 4096, 1 << 20)
    assert not S.one_shot_fits(ar, 1024, 4, 2, 1 << 20, 4095)  # the whole input must fit one slot
    assert S.one_shot_fits(ag, 2048, 4, 2, 8192, 4096)  # all-gather publishes only its 1/P
    assert not S.one_shot_fits(ar, 0, 4, 2, 4096, 4096) and not S.one_shot_fits(ar, 8, 4, 1, 4096, 4096)
    # 16-bit floats: the all-reduce stops at a sixteenth (every rank folds all P copies), the others do not
    rs, small = Collective.REDUCE_SCATTER, 64 << 10
    assert S.one_shot_fits(ar, 2048, 2, 2, small, 1 << 20) and not S.one_shot_fits(ar, 2049, 2, 2, small, 1 << 20)
    assert S.one_shot_fits(rs, 32768, 2, 2, small, 1 << 20) and S.one_shot_fits(ag, 32768, 2, 2, small, 1 << 20)
