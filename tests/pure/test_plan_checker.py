"""Tier 1: algorithms as plans (csrc/include/ringcoll/plan.h, ringcoll/plans.py). The built-in
plans against the schedule they stand for and against the plain reference; the checker,
one plan per rule it enforces; the registry. The engine runs them in
tests/multiprocess/test_plans.py."""

import itertools
import operator

import pytest

from ringcoll import _C, plans
from ringcoll._types import COLLECTIVE_CODES
from ringcoll.learning import schedule as S
from ringcoll.plans import INPUT, OUTPUT, PEER, TO_OUTPUT, TO_SLOT, TO_WORK, WORK, Operand, PlanError, op

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")
BUILTIN = [name for name in plans.BUILTIN]


def inputs_for(coll, world, n):
    """Distinct integers (a lost or doubled contribution shows); all-gather: one chunk each."""
    per_rank = n if coll != "all_gather" else max(1, n // world)
    return [[(r + 1) * 1000 + i for i in range(per_rank)] for r in range(world)]


def reference(coll, inputs):
    """Every rank's output; the rooted collectives (root 0) in place, so a rank the result
    does not reach keeps its input."""
    world = len(inputs)
    if coll == "all_gather":
        full = [x for chunk in inputs for x in chunk]
        return [full] * world
    if coll == "broadcast":
        return [inputs[0]] * world
    total = [sum(col) for col in zip(*inputs)]
    if coll == "all_reduce":
        return [total] * world
    if coll == "reduce":
        return [total, *inputs[1:]]
    return [total[S.chunk_begin(len(total), world, r):S.chunk_end(len(total), world, r)] for r in range(world)]


@pytest.mark.parametrize("name, coll", [(name, coll) for name in BUILTIN for coll in COLLECTIVES
                                         if coll in plans.BUILTIN_COLLECTIVES[name]])
def test_builtin_plans_are_proved_and_compute_the_reference(name, coll):
    for world in range(1, 9):
        p = plans.plan(name, coll, world)
        plans.check(p)
        for root in range(world if coll in ("broadcast", "reduce") else 1):  # relabelled, it still pairs up
            compiled = _C.compile_plan(name, world, p.chunks, p.ops, plans.BUILTIN[name], root)
            assert compiled.root == root and compiled.id == plans.BUILTIN[name]
        for n in (world, 2 * world + 1, 5 * world) if coll != "all_gather" else (world, 3 * world):
            ins = inputs_for(coll, world, n)
            outs, _ = plans.simulate(p, ins)
            assert outs == reference(coll, ins), (name, coll, world, n)


def test_which_algorithm_has_which_collective():
    """The algorithms' table (collectives.h): what each has, as its generator can make it."""
    assert plans.BUILTIN_COLLECTIVES == {
        "ring": COLLECTIVES, "oneshot": COLLECTIVES, "rhd": ("all_reduce", "reduce_scatter", "all_gather"),
        "rd": ("all_reduce",), "tree": ("all_reduce", "broadcast", "reduce"), "star": ("broadcast",),
        "direct": ("all_reduce", "reduce_scatter", "all_gather", "broadcast")}


@pytest.mark.parametrize("name", ["rhd", "rd", "tree", "star"])
def test_algorithms_refuse_the_collectives_they_lack_by_name(name):
    for coll in set(COLLECTIVES) - set(plans.BUILTIN_COLLECTIVES[name]):
        choices = ", ".join(a for a in ["auto", "native", *BUILTIN] if a in ("auto", "native")
                            or coll in plans.BUILTIN_COLLECTIVES[a])
        with pytest.raises(ValueError, match=f"algorithm '{name}' has no {coll} .*; for {coll} choose from "
                                             f"{choices}$"):
            plans.plan(name, coll, 4)
        with pytest.raises(ValueError, match=f"{name} has no {coll}"):  # the generator itself, for C++ callers
            _C.builtin_plan(plans.BUILTIN[name], COLLECTIVE_CODES[coll], 4)
        assert name not in plans.algorithms(coll) and name in plans.algorithms(plans.BUILTIN_COLLECTIVES[name][0])


def _rounds(p):
    return max(t for t, _ in plans.rounds(p))


def _log2(world):
    return world.bit_length() - 1


@pytest.mark.parametrize("name, rounds", [
    ("ring", lambda P: 2 * (P - 1)), ("oneshot", lambda P: 1), ("rhd", lambda P: 2 * _log2(P)),
    ("rd", _log2), ("tree", lambda P: 2 * max(bin(r).count("1") for r in range(P)))])  # the tree's depth, up and down
def test_each_algorithm_takes_the_steps_its_description_says(name, rounds):
    """The step counts that make each algorithm worth having: log2 P rounds for the
    recursive ones and the tree, P-1 (per phase) for the ring, one for one-shot."""
    for world in (2, 4, 8):
        assert _rounds(plans.plan(name, "all_reduce", world)) == rounds(world), (name, world)
    for world in (3, 5, 6, 7):
        taken = _rounds(plans.plan(name, "all_reduce", world))
        if name in ("rhd", "rd"):  # the largest power of two's rounds, and a hand-over or a hand-back
            assert rounds(2 ** _log2(world)) < taken <= rounds(2 ** _log2(world)) + 2, (name, world, taken)
        else:
            assert taken == rounds(world), (name, world)


@pytest.mark.parametrize("coll", ["broadcast", "reduce"])
def test_rooted_plans_take_the_steps_their_description_says(coll):
    """Latency in messages: the chain P-1 (its chunks follow one another down it, round by
    round), the binomial tree its depth (rank r is popcount(r) levels down), the one-shot and
    the star one (every rank reads the root)."""
    for world in range(2, 9):
        depth = max(bin(r).count("1") for r in range(world))
        names = ("ring", "tree", "oneshot", "star") if coll == "broadcast" else ("ring", "tree", "oneshot")
        taken = {name: _rounds(plans.plan(name, coll, world)) for name in names}
        assert taken == {name: {"ring": world - 1, "tree": depth}.get(name, 1) for name in names}, (coll, world)


@pytest.mark.parametrize("world", range(2, 8))
def test_chain_and_one_shot_reduce_fold_in_one_order(world):
    """Native reduce runs the one-shot up to small_bytes and the chain above: both fold
    ((x[P-1] OP x[P-2]) ...) OP x[0], so the size where the path changes changes no bit."""
    inputs = [[f"{r}:{i} " for i in range(2 * world + 1)] for r in range(world)]
    chain, one_shot = (plans.simulate(plans.plan(name, "reduce", world), inputs, combine=operator.add)[0][0]
                       for name in ("ring", "oneshot"))
    assert chain == one_shot == ["".join(inputs[r][i] for r in range(world - 1, -1, -1)) for i in range(2 * world + 1)]


@pytest.mark.parametrize("world", range(2, 9))
@pytest.mark.parametrize("coll", [S.Collective.ALL_REDUCE, S.Collective.REDUCE_SCATTER, S.Collective.ALL_GATHER])
def test_ring_plan_is_ring_h(coll, world):
    """The ring's plan is ring.h's schedule, op for op: the first send, then per step the
    chunk received from the left, reduced or copied, written out, passed on."""
    p = plans.plan("ring", coll.name.lower(), world)
    for k in range(world):
        first, *steps = p.ops[k]
        assert (first.first, first.a, first.readers) == (S.first_send_chunk(coll, k, world), INPUT,
                                                          1 << S.right_neighbour(k, world))
        assert len(steps) == S.ring_steps(coll, world)
        for s, o in enumerate(steps):
            assert o.first == S.step_recv_chunk(coll, k, s, world) and o.frm == S.left_neighbour(k, world)
            assert (o.b == INPUT) == S.step_reduces(coll, s, world)
            assert bool(o.to & TO_OUTPUT) == S.step_writes_output(coll, s, world)
            assert bool(o.to & TO_SLOT) == S.step_forwards(coll, s, world)


@pytest.mark.parametrize("name", ["ring", "oneshot"])
@pytest.mark.parametrize("world", range(2, 8))
def test_ring_and_one_shot_combine_in_the_rings_order(name, world):
    """A string "sum" records the order: both plans fold chunk c from rank c+1 round to
    rank c (rs_contributor), the ring's bits, as the default path does."""
    n = 2 * world + 1
    inputs = [[f"{r}:{i} " for i in range(n)] for r in range(world)]
    outs, _ = plans.simulate(plans.plan(name, "all_reduce", world), inputs, combine=operator.add)
    ring = S.simulate(S.Collective.ALL_REDUCE, inputs, op=operator.add).outputs
    assert outs == ring


# --- the checker: one wrong plan per rule --------------------------------------------------------

def ring(world, rank):
    """A correct all-reduce, to break one op at a time (the built-in ring's ops)."""
    return list(plans.plan("ring", "all_reduce", world).ops[rank])


def user_plan(fn, coll="all_reduce", world=3):
    plans.register_algorithm("test-plan", fn, coll)
    try:
        return plans.plan("test-plan", coll, world)
    finally:
        plans._registry.pop(("test-plan", coll), None)


def refused(fn, coll="all_reduce", world=3):
    with pytest.raises(PlanError) as e:
        plans.check(user_plan(fn, coll, world))
    return str(e.value)


def changed(rank, index, **fields):
    """The ring with op `index` of rank `rank` changed."""
    def fn(world, r):
        ops = ring(world, r)
        if r == rank:
            ops[index] = ops[index]._replace(**fields)
        return ops
    return fn


def test_the_ring_itself_passes():
    plans.check(user_plan(ring))


@pytest.mark.parametrize("fn, words", [
    (changed(0, 1, first=-1), "chunks outside 0..2"),
    (changed(0, 1, a=Operand.NONE), "has no first operand"),
    (changed(0, 1, to=TO_OUTPUT | TO_WORK | TO_SLOT), "one or two of output, work and slot"),
    (changed(0, 1, b=PEER), "reads two peers' values (a publication or an input) in one op"),
    (changed(0, 1, frm=0), "receives from rank 0, which is not a peer"),
    (changed(0, 0, readers=1), "publishes to no peer, or to itself"),
    (changed(0, 4, readers=2), "names readers but publishes nothing"),
    (changed(1, 1, first=0), "receives chunks 0..0 from rank 0, whose publication it reads holds 2..2"),
    (changed(0, 1, a=WORK, b=INPUT), "reads work chunk 1 before anything wrote it"),
    (changed(0, 0, a=OUTPUT), "reads output chunk 2 before anything wrote it"),
    (changed(0, 1, to=TO_WORK, readers=0), "receives chunks 1..1 from rank 0, whose publication it reads holds 0..0"),
    (changed(0, 2, final=False), "output chunk 0 is never marked final"),
    (changed(0, 1, final=True), "marks final a value of 2 contributions, not all 3"),
    (changed(0, 2, b=Operand.NONE), "lacks rank 0's contribution"),
    # fields that name nothing: a bare ValueError ("7 is not a valid Operand") or TypeError,
    # raised while printing the op, and an unknown operand was read as the output
    (changed(1, 1, a=7), "rank 1, op 1 (PlanOp(a=7, "),
    (changed(1, 1, b=6), "an operand (a=1, b=6) is none of ringcoll.plans.Operand's"),
    (changed(1, 1, frm=None), "its field frm is None, not a whole number"),
])
def test_each_rule_refuses_a_plan_that_breaks_it(fn, words):
    assert words in refused(fn)


def _direct_gather(world, r):
    """The direct plan's all-gather, written in Python: every peer's input read where it lies."""
    return [op(plans.PEER_INPUT, k, TO_OUTPUT, frm=k, final=True) for k in range(world) if k != r] + \
        [op(INPUT, r, TO_OUTPUT, final=True)]


def test_reads_of_peers_inputs_where_they_lie_are_checked():
    """PEER_INPUT: right where the input is one nothing overwrites (all-gather: the owner's
    chunk; broadcast: the root's; reduce-scatter: chunks but the owner's own), refused where
    the input may be the output (in place), which its owner overwrites while peers read; each
    read stands for its owner's chunk."""
    plans.check(user_plan(_direct_gather, "all_gather", 3))
    plans.check(plans.plan("direct", "reduce_scatter", 4))
    assert "reads chunk 1 of rank 1's input where it lies, which in place is that rank's output" in refused(
        lambda world, r: [op(plans.PEER_INPUT, 1 - r, TO_OUTPUT, b=INPUT, frm=1 - r, final=True)],
        "reduce_scatter", world=2)
    assert "reads chunks other than rank 1's own from its input" in refused(
        lambda world, r: [o._replace(first=(o.frm + 1) % world) if o.a == plans.PEER_INPUT else o
                          for o in _direct_gather(world, r)], "all_gather")
    # All-reduce: a read where it lies must happen before the owner writes that chunk (in place,
    # its output) in every order: the direct plan's two-shot proves it through its publications;
    # reading the whole peer input and writing the whole output races, whichever runs first
    for world in range(2, 9):
        plans.check(plans.plan("direct", "all_reduce", world))
    assert "which rank 0 may already have overwritten with its output chunk (in place)" in refused(
        lambda world, r: [op(plans.PEER_INPUT, (0, 2), TO_OUTPUT, b=INPUT, frm=1 - r, final=True)],
        "all_reduce", world=2)

    def writes_before_hearing(world, r):  # the two-shot, but rank 1 copies rank 0's chunk 1 first
        ops = list(plans.plan("direct", "all_reduce", world).ops[r])
        return [op(INPUT, 0, TO_OUTPUT)] + ops if r == 1 else ops
    assert "writes output chunk 0, which in place is the input chunk rank 0 reads where it lies, before hearing" in \
        refused(writes_before_hearing, "all_reduce", world=2)
    assert "a reduce's input is the root's output (in place)" in refused(
        lambda world, r: [op(plans.PEER_INPUT, 0, TO_OUTPUT, b=INPUT, frm=0, final=True)] if r else [], "reduce")
    assert "reads rank 2's input, but only the root (rank 0) has one" in refused(
        lambda world, r: [op(plans.PEER_INPUT, 0, TO_OUTPUT, frm=2 if r == 1 else 0, final=True)] if r else [],
        "broadcast")
    # The reads stand for the owners' inputs: a rank that skips a peer lacks its chunk
    assert "rank 0 never writes output chunk 1" in refused(
        lambda world, r: [o for o in _direct_gather(world, r) if not (r == 0 and o.frm == 1)], "all_gather")


def test_shared_outputs_are_checked():
    """SHARE_OUTPUT: an op that writes the output alone publishes it where it lies (its readers
    copy it out of that output). Right in the direct all-reduce and in the example that
    reduces on one rank and shares; refused with other places, and where the rank writes a
    shared chunk again (a reader may come to it after the write). The plan is proved through
    slots too (a CUDA peer that cannot reach the output reads it from one), and the C++
    compiler refuses what the checker does."""
    from pathlib import Path

    plans.load_plans(str(Path(__file__).resolve().parents[2] / "examples" / "reduce_and_share.py"))
    try:
        for world in range(2, 7):
            for name in ("share", "direct"):
                p = plans.plan(name, "all_reduce", world)
                plans.check(p)
                ins = inputs_for("all_reduce", world, 2 * world + 1)
                assert plans.simulate(p, ins)[0] == reference("all_reduce", ins)
            assert all(o.to == TO_OUTPUT | plans.SHARE_OUTPUT for o in p.ops[0] if o.to & plans.SHARE_OUTPUT)
            assert "output, shared there with rank" in str(p.ops[0][-world])  # direct: the fold, then P-1 copies
    finally:
        plans._registry.pop(("share", "all_reduce"), None)  # other tests list the algorithms

    def share(world, r, to=TO_OUTPUT | plans.SHARE_OUTPUT):  # each rank's sum of both inputs, shared
        return [op(INPUT, 1 - r, TO_SLOT, readers=[1 - r]), op(PEER, r, to, b=INPUT, frm=1 - r, readers=[1 - r],
                                                            final=True),
                op(PEER, 1 - r, TO_OUTPUT, frm=1 - r)]
    plans.check(user_plan(share, world=2))
    shares = "shares its output chunks where they lie"
    for to, words, cpp_words in [(plans.SHARE_OUTPUT, "must write to one or two of output, work and slot",
                                  "one or two of output, work, slot"),
                                 (TO_OUTPUT | TO_SLOT | plans.SHARE_OUTPUT, shares, shares),
                                 (TO_OUTPUT | TO_WORK | plans.SHARE_OUTPUT, shares, shares)]:
        fn = lambda world, r, to=to: share(world, r, to)  # noqa: E731
        assert words in refused(fn, world=2)
        with pytest.raises(ValueError, match=cpp_words):
            _C.compile_plan("shared", 2, 2, [fn(2, r) for r in range(2)], 1000, 0, False)

    def writes_again(world, r):
        return share(world, r) + [op(OUTPUT, r, TO_OUTPUT)]
    assert "writes output chunk 0 again after sharing it with rank(s) 1, which read it where it lies" in \
        refused(writes_again, world=2)


def test_deadlocks_are_refused():
    def both_receive_first(world, r):  # each waits for the other's publication
        return [op(PEER, 0, TO_OUTPUT, b=INPUT, frm=1 - r, final=True), op(INPUT, 0, TO_SLOT, readers=[1 - r])]
    assert "deadlock (slice 1): every rank waits; this one for a publication of rank 1 that never comes" in \
        refused(both_receive_first, world=2)

    def slot_cycle(world, r):
        """Rank 0 refills its chunk-0 slot for rank 1 once rank 2 has read it, but rank 2
        first waits for rank 1, which waits for that refill."""
        return [[op(INPUT, 0, TO_SLOT, readers=[2]), op(INPUT, 0, TO_SLOT, readers=[1])],
                [op(PEER, 0, TO_WORK, frm=0), op(WORK, 0, TO_SLOT, readers=[2])],
                [op(PEER, 0, TO_WORK, frm=1), op(PEER, 0, TO_OUTPUT, frm=0)]][r]
    assert "this one to refill its slot of chunk 0, whose last publication rank 2 never reads" in refused(slot_cycle)


def test_a_publication_nobody_receives_is_refused_naming_it():
    """Its slot is never free again: the next slice that publishes that chunk waits forever,
    and every rank behind it. The error names the extra publication, not a rank left waiting
    (which it named before: a correct op of another rank, for a four-rank plan)."""
    for world, sender, reader in ((3, 0, 1), (4, 3, 0)):
        def fn(w, r):
            ops = ring(w, r)
            return ops + [op(OUTPUT, 0, TO_SLOT, readers=[reader])] if r == sender else ops
        extra = len(ring(world, sender))  # the index of the op added
        message = refused(fn, world=world)
        assert f"rank {sender}, op {extra} (" in message, message
        assert f"publishes chunks 0..0 to rank {reader}, which never receives it" in message, message


def test_a_contribution_twice_and_another_chunk_are_refused():
    def doubled(world, r):  # the value rank 0 passes on holds its input twice
        ops = ring(world, r)
        if r == 0:
            ops[1] = ops[1]._replace(to=TO_WORK, readers=0)
            ops.insert(2, op(WORK, 1, TO_SLOT, b=INPUT, readers=[1]))
        return ops
    assert "marks final a value of 4 contributions, not all 3" in refused(doubled)

    def gathered_to_zero(world, r):  # rank 0 adds rank 1's and its own twice; rank 2's never comes
        if r == 1:
            return [op(INPUT, 0, TO_SLOT, readers=[0])]
        if r == 2:
            return []
        return [op(PEER, 0, TO_WORK, b=INPUT, frm=1), op(WORK, 0, TO_OUTPUT, b=INPUT, final=True)]
    assert "rank 0's output chunk 0 holds rank 0's contribution more than once" in refused(gathered_to_zero)

    def other_chunk(world, r):
        ops = ring(world, r)
        if r == 0:
            ops[0] = op(INPUT, 2, TO_WORK)
            ops.insert(1, op(WORK, 1, TO_SLOT, b=INPUT, readers=[1]))  # chunk 1's slot fed from chunk 2's work
        return ops
    words = refused(other_chunk)
    assert "before anything wrote it" in words or "other chunks" in words


def test_ranks_that_combine_in_different_orders_are_refused():
    """Recursive doubling where each rank adds the partner's value after its own: both
    hold every contribution once, but a + b on one rank and b + a on the other."""
    def careless(world, rank):
        partner = rank ^ 1
        return [op(INPUT, (0, 1), TO_SLOT, readers=[partner]),
                op(INPUT, (0, 1), TO_OUTPUT, b=PEER, frm=partner, final=True)]
    assert "combine chunk 0 in different orders" in refused(careless, world=2)


def test_an_unsafe_read_in_place_is_refused():
    """Rank 0 writes its output chunk, then reads its input chunk again: in place they are
    one memory."""
    def fn(world, r):
        ops = ring(world, r)
        if r == 0:
            ops.append(op(INPUT, 0, TO_WORK))
        return ops
    assert "reads input chunk 0 after writing output chunk 0: wrong when the output is the input" in refused(fn)


def test_an_all_gather_that_changes_its_own_chunk_is_refused_in_place():
    """In place an all-gather's input is its own output chunk: copying the input onto itself
    is harmless (the built-in plans do it), writing anything else there is not, for the rank's
    own later reads and for peers reading that input where it lies. Both plans below end with
    the right output out of place, and gave wrong bits in place before the checker saw it."""
    def doubles_then_sends(world, r):  # its own chunk = input + input, then publishes "the input"
        return [op(INPUT, r, TO_OUTPUT, b=INPUT), op(INPUT, r, TO_OUTPUT | TO_SLOT, readers=others(world, r))] + \
            [op(PEER, q, TO_OUTPUT, frm=q) for q in others(world, r)]
    for world in (2, 3):
        assert "reads input chunk" in refused(doubles_then_sends, "all_gather", world=world)

    def scribbles_while_read(world, r):  # saved to work space, scribbled over, restored: peers read it meanwhile
        return [op(INPUT, r, TO_WORK), op(INPUT, r, TO_OUTPUT, b=INPUT)] + \
            [op(plans.PEER_INPUT, q, TO_OUTPUT, frm=q) for q in others(world, r)] + [op(WORK, r, TO_OUTPUT)]
    message = refused(scribbles_while_read, "all_gather", world=2)
    assert "where it lies" in message and "in place" in message, message  # the write or the read, whichever comes second
    plans.check(user_plan(_direct_gather, "all_gather", 3))  # the own chunk copied onto itself: fine


def others(world, r):
    return [q for q in range(world) if q != r]


def test_collective_shapes_are_enforced():
    def gather_reads_other_input(world, r):
        return [op(INPUT, (r + 1) % world, TO_OUTPUT)]
    assert "an all-gather's input is one chunk" in refused(gather_reads_other_input, "all_gather")

    def scatter_writes_other_output(world, r):
        return [op(INPUT, (r + 1) % world, TO_OUTPUT)]
    assert "a reduce-scatter's output is one chunk" in refused(scatter_writes_other_output, "reduce_scatter")

    def gather_wrong_chunk(world, r):
        ops = [op(INPUT, r, TO_OUTPUT | TO_SLOT, readers=[p for p in range(world) if p != r])]
        ops += [op(PEER, p, TO_OUTPUT, frm=p) for p in range(world) if p != r]
        if r == 1:
            ops[1] = ops[1]._replace(to=TO_WORK)
            ops.append(op(INPUT, r, TO_OUTPUT)._replace(first=r))
        return ops
    words = refused(gather_wrong_chunk, "all_gather")
    assert "never writes output chunk 0" in words

    def gather_past_the_last_chunk(world, r):  # counted as a chunk more, and the op went unnamed
        ops = [op(INPUT, r, TO_OUTPUT | TO_SLOT, readers=[p for p in range(world) if p != r])]
        ops += [op(PEER, p, TO_OUTPUT, frm=p) for p in range(world) if p != r]
        return ops + [op(INPUT, world, TO_OUTPUT)] if r == 2 else ops
    assert "rank 2, op 3 (chunk 3: input -> output): chunks outside 0..2" in refused(gather_past_the_last_chunk,
                                                                                      "all_gather")


def test_rooted_collectives_keep_to_the_root():
    """Written for root 0: a broadcast's other ranks have no input (their tensor is the
    output) and nothing to combine; a reduce's other ranks keep their tensors."""
    def broadcast(world, r):
        return [op(INPUT, 0, TO_SLOT, readers=range(1, world))] if r == 0 else [op(PEER, 0, TO_OUTPUT, frm=0)]
    plans.check(user_plan(broadcast, "broadcast"))

    def others_read_input(world, r):
        return broadcast(world, r) + ([op(INPUT, 0, TO_WORK)] if r == 2 else [])
    assert "reads its input, but only the root (rank 0) has one" in refused(others_read_input, "broadcast")

    def combines(world, r):
        return [o._replace(b=WORK) if r == 1 else o for o in broadcast(world, r)]
    assert "rank 1, op 0 (chunk 0: rank 0's publication OP work -> output): combines two values: a broadcast only " \
           "copies" in refused(combines, "broadcast")

    def wrong_root(world, r):  # rank 1 broadcasts to rank 2 as well: rank 2 takes rank 1's copy, not the root's
        if r == 1:
            return [op(PEER, 0, TO_OUTPUT | TO_SLOT, frm=0, readers=[2])]
        return [op(INPUT, 0, TO_SLOT, readers=[1])] if r == 0 else [op(PEER, 0, TO_WORK, frm=1)]
    assert "rank 2 never writes output chunk 0" in refused(wrong_root, "broadcast")

    def reduce(world, r):
        if r == 0:
            return [op(PEER, 0, TO_WORK, frm=2), op(WORK, 0, TO_WORK, b=PEER, frm=1),
                    op(WORK, 0, TO_OUTPUT, b=INPUT, final=True)]
        return [op(INPUT, 0, TO_SLOT, readers=[0])]
    plans.check(user_plan(reduce, "reduce"))

    def via_output(world, r):  # the root's one tensor is its input until written: OUTPUT reads it (was refused)
        if r == 0:
            return [op(PEER, 0, TO_WORK, frm=2, b=OUTPUT), op(WORK, 0, TO_OUTPUT, b=PEER, frm=1, final=True)]
        return [op(INPUT, 0, TO_SLOT, readers=[0])]
    plans.check(user_plan(via_output, "reduce"))

    def others_read_output(world, r):  # a broadcast's other ranks' tensors hold nothing yet
        return [op(OUTPUT, 0, TO_WORK)] + broadcast(world, r) if r == 1 else broadcast(world, r)
    assert "rank 1, op 0 (chunk 0: output -> work): reads output chunk 0 before anything wrote it" in \
        refused(others_read_output, "broadcast")

    def others_write_output(world, r):
        return reduce(world, r) + ([op(INPUT, 0, TO_OUTPUT)] if r == 1 else [])
    assert "only the root (rank 0) gets the result" in refused(others_write_output, "reduce")

    def lacks_one(world, r):  # rank 1's publication never read, and the result not marked final (that is refused first)
        if r == 1:
            return []
        return [o._replace(final=False) for o in reduce(world, r) if o.frm != 1] if r == 0 else reduce(world, r)
    assert "rank 0's output chunk 0 lacks rank 1's contribution" in refused(lacks_one, "reduce")


def test_one_rank_runs_no_plan():
    p = user_plan(lambda world, rank: [op(INPUT, 0, TO_SLOT, readers=[rank])], world=1)
    assert p.ops == ((),)
    plans.check(p)


# --- the registry --------------------------------------------------------------------------------

def test_names_and_refusals():
    assert plans.builtin_algorithms()[:3] == ["auto", "native", "ring"] and "oneshot" in plans.algorithms()
    for bad in ("auto", "native", "ring", "", None):
        with pytest.raises(ValueError, match="is not a name a plan may take"):
            plans.register_algorithm(bad, ring)
    with pytest.raises(ValueError, match="collective must be one of all_reduce, reduce_scatter, all_gather, "
                                         "broadcast, reduce, got 'barrier'"):
        plans.register_algorithm("x", ring, "barrier")
    with pytest.raises(ValueError, match="unknown algorithm 'nope' for all_reduce; choose from auto, native, ring, "
                                         "oneshot") as refused:
        plans.plan("nope", "all_reduce", 2)
    assert "star" not in str(refused.value)  # a broadcast's and reduce's only: not offered for all_reduce
    with pytest.raises(TypeError, match="register_algorithm: plan_fn must be a function .* got int"):
        plans.register_algorithm("x", 42)
    # What the user's function gives, wrong: named with the plan and the call, on every rank
    for wrong, says in ((lambda world, rank: None, "TypeError: 'NoneType' object is not iterable"),
                        (lambda world, rank: [1, 2], "TypeError"),
                        (lambda world, rank: 1 / 0, "ZeroDivisionError: division by zero")):
        plans.register_algorithm("wrong", wrong)
        try:
            with pytest.raises(plans.PlanError, match=r"all_reduce plan 'wrong': plan_fn\(2, 0\) must return that "
                                                      r"rank's ops, .* it gave " + says):
                plans.plan("wrong", "all_reduce", 2)
        finally:
            plans._registry.pop(("wrong", "all_reduce"), None)  # other tests list the algorithms


def test_a_user_plan_is_checked_and_compiled_once_and_gets_its_own_id():
    calls = []

    def fn(world, rank):
        calls.append(rank)
        return ring(world, rank)

    plans.register_algorithm("counted", fn)
    try:
        first = plans.compiled("counted", "all_reduce", 3)
        assert plans.compiled("counted", "all_reduce", 3) is first and calls == [0, 1, 2]
        assert first[1].id >= 1000 and first[1].id != plans.BUILTIN["ring"]
        assert list(first[1].publications) == [4, 4, 4]  # per rank: the first send, then every step but the last
    finally:
        plans._registry.pop(("counted", "all_reduce"), None)
        plans._compiled.clear()


def test_every_op_prints_as_words():
    words = [str(o) for o in plans.plan("ring", "all_reduce", 3).ops[0]]
    assert words[0] == "chunk 2: input -> published to rank 1"
    assert words[2] == "chunk 0: rank 2's publication OP input -> output and published to rank 1 (final)"


def test_simulate_records_every_op_in_the_order_ranks_ran_it():
    p = plans.plan("ring", "all_reduce", 3)
    _, steps = plans.simulate(p, [[1, 2, 3], [10, 20, 30], [100, 200, 300]])
    assert sorted((s.rank, s.index) for s in steps) == sorted(itertools.chain.from_iterable(
        [(r, i) for i in range(len(p.ops[r]))] for r in range(3)))
    first = next(s for s in steps if (s.rank, s.index) == (1, 1))  # rank 1 adds its chunk 2 to rank 0's
    assert first.values == [[3 + 30]]


def test_the_docs_example_is_proved_traced_and_priced(capsys):
    """examples/bidirectional_ring.py (docs/algorithms.md): registered by running the file,
    proved at P = 1..8, the reference's sums, traced from the CLI, and priced: the ring's
    rounds and bytes (two half-size rings side by side)."""
    from pathlib import Path

    from ringcoll.learning import model
    from ringcoll.learning.cli import main

    example = str(Path(__file__).resolve().parents[2] / "examples" / "bidirectional_ring.py")
    saved = dict(plans._registry)
    try:
        plans.load_plans(example)
        assert "bidir" in plans.algorithms("all_reduce") and "bidir" not in plans.algorithms("reduce_scatter")
        for world in range(1, 9):
            p = plans.plan("bidir", "all_reduce", world)
            plans.check(p)
            ins = inputs_for("all_reduce", world, 4 * world + 3)
            assert plans.simulate(p, ins)[0] == reference("all_reduce", ins)
            if world > 1:
                assert model.plan_cost(p) == model.plan_cost(plans.plan("ring", "all_reduce", world))
        assert main(["trace", "all_reduce", "-P", "3", "-n", "12", "--plans", example, "--algorithm", "bidir"]) == 0
        assert "OK, every rank matches" in capsys.readouterr().out
    finally:
        plans._registry.clear()
        plans._registry.update(saved)
        plans._compiled.clear()
    with pytest.raises(ValueError, match="plans file 'nope.py' does not exist"):
        plans.load_plans("nope.py")


def test_only_the_one_shot_sends_before_the_call_check():
    """Plan.sends_early: the oneshot plan's leading sends (ops that only publish the input,
    nothing to an output) run before the call check; every other built-in's go after it.
    compile_plan counts them per rank: all of a rank's publications for the one-shot of the
    three collectives, the non-roots' for a reduce, the root's for a broadcast."""
    for name in BUILTIN:
        for coll in plans.BUILTIN_COLLECTIVES[name]:
            for world in (2, 3, 5):
                p, compiled = plans.compiled(name, coll, world)
                assert p.sends_early == (name == "oneshot"), (name, coll)
                early = list(compiled.early_sends)
                if name != "oneshot":
                    assert early == [0] * world, (name, coll, early)
                    continue
                for rank, ops in enumerate(p.ops):
                    leading = early[rank]
                    assert all(o.a == plans.INPUT and o.b == plans.Operand.NONE and o.to == plans.TO_SLOT
                               for o in ops[:leading]), (coll, rank)
                    assert leading == len(ops) or ops[leading].to != plans.TO_SLOT or ops[leading].a != plans.INPUT
                expected = {"all_reduce": [world] * world, "reduce_scatter": [world - 1] * world,
                            "all_gather": [1] * world, "reduce": [0] + [1] * (world - 1),
                            "broadcast": [1] + [0] * (world - 1)}[coll]
                assert early == expected, (coll, world, early)


@pytest.mark.parametrize("name", ["auto", "native"])
def test_auto_and_native_are_named_as_no_plans_of_their_own(name):
    """The model and the trace price or run a plan; asked for auto or native they said
    'unknown algorithm ... choose from auto, native, ...', listing the name refused."""
    from ringcoll.learning import model

    with pytest.raises(ValueError, match=f"'{name}' is not a plan of its own: .* the plans for all_reduce: ring, "):
        plans.plan(name, "all_reduce", 4)
    with pytest.raises(ValueError, match="is not a plan of its own"):
        model.crossovers("all_reduce", 4, 2e-6, 8e9, [name, "ring"])
