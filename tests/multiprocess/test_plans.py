"""Algorithms as plans on the CPU transport's plan engine (csrc/host/host_plan.cpp), against
gloo on the same inputs: every built-in plan, every collective, at P = 1..8 (the full dtype x
op matrix at P = 3 and 4, where test_collectives' inputs sum exactly in any order, a
selection elsewhere); algorithms interleaved on one communicator (slots refilled across
plans with other layouts are the hazard); a plan written in Python end to end; a wrong
one refused; ranks that disagree on the algorithm."""

from pathlib import Path

import pytest
import torch

import ringcoll
from ringcoll import plans
from ringcoll._types import DATA_COLLECTIVES, torch_tensor_forms
from ringcoll.harness.launcher import spawn
from ringcoll.plans import INPUT, TO_OUTPUT, op

import test_collectives as M

all_gather_single, reduce_scatter_single = torch_tensor_forms()

BUILTIN = list(plans.BUILTIN)
FULL = [(dtype, op_name) for dtype in M.DTYPES for op_name in M.OPS if op_name != "AVG" or dtype in M.FLOATING]
# Past five ranks the 16-bit floats' test inputs no longer sum exactly in every order.
SELECTION = [(torch.float32, "SUM"), (torch.float64, "AVG"), (torch.int32, "MAX"), (torch.int8, "PRODUCT"),
             (torch.int64, "MIN")]


# docs/algorithms.md's example; running it registers "bidir" (only in the ranks: the pytest process's registry
# stays as other tests expect it)
EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "bidirectional_ring.py")
SHARE_EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "reduce_and_share.py")  # SHARE_OUTPUT


def _copy_of(builtin):
    """A built-in plan's own all-reduce ops, as a plan written in Python (plan_fn)."""
    return lambda world_size, r: list(plans.plan(builtin, "all_reduce", world_size).ops[r])


def _matrix_rank(rank, world):
    chk = M.Checker(rank)
    plans.load_plans(EXAMPLE)
    plans.load_plans(SHARE_EXAMPLE)
    comms = [(name, ringcoll.Communicator(algorithm=name, buffer_bytes=M.SMALL_BUFFER, timeout=M.COMM_TIMEOUT))
             for name in [*BUILTIN, "bidir", "share"]]
    reduce_comms = [(n, c) for n, c in comms if n in plans.algorithms("all_reduce")]  # not star
    scatter_gather_comms = [(n, c) for n, c in comms if n in plans.algorithms("reduce_scatter")]  # not rd, tree, bidir,
    # share
    gather_comms = [(n, c) for n, c in comms if n in plans.algorithms("all_gather")]  # and direct
    cases = FULL if world in (3, 4) else SELECTION
    for dtype, op_name in cases:
        elem = torch.empty(0, dtype=dtype).element_size()
        big = 3 * M.SMALL_BUFFER // elem + 5  # several slices of the 2 x C slots
        M.run_reduce_cases(chk, rank, world, reduce_comms, dtype, op_name, [1, world + 1, big], [], (), "plans")
        M.run_reduce_cases(chk, rank, world, scatter_gather_comms, dtype, op_name, [], [1, 3, big // world + 1],
                           ("out_of_place", "in_place"), "plans-rs")
    for dtype in (torch.float32, torch.uint8, torch.bfloat16):
        M.run_gather_cases(chk, rank, world, gather_comms, dtype, [1, 3, 2000], ("out_of_place", "in_place"), "plans")
    # broadcast and reduce: every algorithm that has them, native and auto (one-shot, then star or chain by
    # size), every root; a broadcast moves bytes, so one op per dtype is enough
    by_size = [(name, ringcoll.Communicator(algorithm=name, buffer_bytes=M.SMALL_BUFFER, timeout=M.COMM_TIMEOUT,
                                            small_bytes=64)) for name in ("native", "auto")]
    broadcast_comms, reduce_comms = ([(n, c) for n, c in comms if n in plans.algorithms(coll)] + by_size
                                     for coll in ("broadcast", "reduce"))
    seen = set()
    for dtype, op_name in cases:
        elem = torch.empty(0, dtype=dtype).element_size()
        M.run_rooted_cases(chk, rank, world, [] if dtype in seen else broadcast_comms, reduce_comms, dtype, op_name,
                           [1, world + 1, 3 * M.SMALL_BUFFER // elem + 5], "plans-rooted")
        seen.add(dtype)
    if world in (2, 3):
        # The direct plans read a peer's input a bounce piece at a time (kBounceBytes in
        # host_comm.h, 256 KiB): chunks of several pieces and a tail, from a buffer whose slots
        # (the all-reduce's slices) hold several pieces too; at P = 2 the reduce-scatter's
        # slice is the whole chunk
        with ringcoll.Communicator(algorithm="direct", buffer_bytes=16 << 20, timeout=M.COMM_TIMEOUT) as direct:
            for dtype in (torch.float32, torch.bfloat16):
                chunk = (2400 << 10) // torch.empty(0, dtype=dtype).element_size() + 7
                M.run_reduce_cases(chk, rank, world, [("direct, chunks of bounce pieces", direct)], dtype, "SUM",
                                   [world * chunk], [chunk], ("out_of_place", "in_place"), "plans-bounce")
    _interleaved(chk, rank, world)
    for _, comm in comms + by_size:
        comm.close()
    return chk.finish()


def _interleaved(chk, rank, world):
    """One communicator, the algorithm changing call by call, sizes that fill every slot."""
    import torch.distributed as dist

    with ringcoll.Communicator(buffer_bytes=M.SMALL_BUFFER, timeout=M.COMM_TIMEOUT) as comm:
        for i, algorithm in enumerate(["ring", "auto", "oneshot", "bidir", "rhd", "tree", "rd", "oneshot", "auto",
                                       "rhd", "bidir", "tree", "ring", "rd", "direct", "share"] * 2):
            n = [3, 5000, 17, 1024, 1][i % 5] * world
            x = M.make_input("int", torch.int32, n, M._seed("interleaved", i, rank))
            ref = x.clone()
            dist.all_reduce(ref)
            comm.all_reduce(x, algorithm=algorithm)
            chk.equal(f"interleaved call {i} ({algorithm}, n={n})", x, ref)
            if algorithm in plans.algorithms("reduce_scatter"):
                out = torch.empty(n // world, dtype=torch.int32)
                comm.reduce_scatter_tensor(out, x.clone(), algorithm=algorithm)
                chk.equal(f"interleaved call {i} reduce_scatter ({algorithm})", out, ref.view(world, -1)[rank] * world)
            if i % 3 == 0:  # direct reads (no slot) between plans that fill the slots: each rank's chunk
                out = torch.empty(n, dtype=torch.int32)  # of the all-reduced ref, gathered, is ref again
                comm.all_gather_into_tensor(out, ref.view(world, -1)[rank].clone(), algorithm="direct")
                chk.equal(f"interleaved call {i} all_gather (direct)", out, ref)
            if i % 2:  # the star's slots, read by every rank, between the others' plans
                y = M.make_input("int", torch.int32, n, M._seed("interleaved-broadcast", i, rank))
                ref = y.clone()
                dist.broadcast(ref, src=i % world)
                comm.broadcast(y, i % world, algorithm="star")
                chk.equal(f"interleaved call {i} broadcast (star) from {i % world}", y, ref)


@pytest.mark.parametrize("world", range(1, 9), ids=lambda w: f"P{w}")
def test_every_plan_matches_gloo(world):  # the odd worlds with the slots written by streaming stores
    M._report(spawn(_matrix_rank, world, timeout=M.SPAWN_TIMEOUT, env=M.STREAMED_SLOTS_ENV if world % 2 else M.CLEAN_ENV))


def _early_sends_back_to_back(rank, world):
    """Small calls whose sends go before the call check, back to back with nothing between
    them that waits for every rank: native's one-shot (all three collectives), the oneshot
    plan's broadcast and reduce, and now and then a ring call, on one communicator. A call
    of one slice takes the bank its predecessor did not, and its early sends wait only for
    the readers of the call before last in that bank (plan.h's Plan::sends_early): a rank
    running a call ahead must never refill a slot a slower peer still reads. The expected
    values are computed here from every rank's seeded input, so no reference call (gloo's
    would be a barrier) hides a race. Every third all-reduce runs the oneshot plan's ops
    registered from Python with sends_early: a user's plan sends early too."""
    chk = M.Checker(rank)
    ringcoll.register_algorithm("mine_early", _copy_of("oneshot"), sends_early=True)

    def inputs(i, n):
        return [M.make_input("int", torch.int32, n, M._seed("early", i, r)) for r in range(world)]

    with ringcoll.Communicator(timeout=M.COMM_TIMEOUT) as comm:
        before = comm.transport.one_shot_calls
        for i in range(240):
            n = (1 + i % 7) * world * 4
            xs = inputs(i, n)
            total = torch.stack(xs).sum(0, dtype=torch.int32)
            kind, root = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"][i % 5], i % world
            algorithm = "ring" if i % 11 == 0 else ("oneshot" if kind in ("broadcast", "reduce") else "native")
            if kind == "all_reduce" and i % 3 == 1:
                algorithm = "mine_early"
            x = xs[rank].clone()
            if kind == "all_reduce":
                early_calls = comm.transport.one_slice_early_calls
                comm.all_reduce(x, algorithm=algorithm)
                chk.equal(f"call {i} all_reduce ({algorithm}, n={n})", x, total)
                if algorithm == "mine_early" and world > 1 and comm.transport.one_slice_early_calls != early_calls + 1:
                    chk.fail(f"call {i}", "the plan registered with sends_early did not send early")
            elif kind == "reduce_scatter":
                out = torch.empty(n // world, dtype=torch.int32)
                comm.reduce_scatter_tensor(out, x, algorithm=algorithm)
                chk.equal(f"call {i} reduce_scatter ({algorithm}, n={n})", out, total.view(world, -1)[rank])
            elif kind == "all_gather":
                piece = x[:n // world].clone()
                out = torch.empty(n, dtype=torch.int32)
                comm.all_gather_into_tensor(out, piece, algorithm=algorithm)
                chk.equal(f"call {i} all_gather ({algorithm}, n={n})", out,
                          torch.cat([y[:n // world] for y in xs]))
            elif kind == "broadcast":
                comm.broadcast(x, root, algorithm=algorithm)
                chk.equal(f"call {i} broadcast from {root} ({algorithm}, n={n})", x, xs[root])
            else:
                comm.reduce(x, root, algorithm=algorithm)
                chk.equal(f"call {i} reduce to {root} ({algorithm}, n={n})", x, total if rank == root else xs[rank])
        if world > 1 and comm.transport.one_shot_calls - before < 100:
            chk.fail("early sends", f"only {comm.transport.one_shot_calls - before} calls took native's one-shot")
    # Early-send calls of different chunk counts, each filling its slots to the bank's end: a
    # oneshot broadcast (one chunk: the whole half) and native's one-shot all-reduce (P
    # chunks). Bank 1 was laid out as P slots from P * slot(P) bytes, below the broadcast's
    # half for P = 3 (the slots round down), so a rank a call ahead wrote the all-reduce's
    # early sends into the last 64-128 bytes a peer still read of the broadcast (a review
    # found ~100 of 300 wrong at P = 3); a bank now starts at the same place for every plan.
    buffer = 1 << 17
    with ringcoll.Communicator(buffer_bytes=buffer, direct_bytes=0, timeout=M.COMM_TIMEOUT) as comm:
        whole_half = buffer // 2 // ringcoll._C.host_slot_alignment * ringcoll._C.host_slot_alignment
        for i in range(200):
            t = torch.full((whole_half,), i % 251 + 1 if rank == 0 else 0, dtype=torch.uint8)
            comm.broadcast(t, 0, algorithm="oneshot")
            chk.equal(f"full-slot broadcast {i}", t, torch.full_like(t, i % 251 + 1))
            a = torch.full((world * 16,), 7 + rank, dtype=torch.int32)
            comm.all_reduce(a)
            chk.equal(f"all_reduce {i} after it", a, torch.full_like(a, sum(7 + r for r in range(world))))
    return chk.finish()


@pytest.mark.parametrize("world", [2, 3])
def test_early_sends_back_to_back_never_refill_a_slot_a_peer_still_reads(world):
    M._report(spawn(_early_sends_back_to_back, world, timeout=M.SPAWN_TIMEOUT))


def _smallest_buffer_rank(rank, world):
    """At the smallest buffer_bytes a communicator accepts (two banks of one slot per rank),
    every algorithm of every collective either runs, matching gloo, or (a plan of more chunks
    than the buffer has slots for) raises a ValueError naming the op and buffer_bytes before
    anything is written; native and auto always run (a broadcast or reduce falls back to the
    one-shot, whose single chunk always fits)."""
    import torch.distributed as dist

    plans.load_plans(EXAMPLE)  # bidir: 2P chunks
    chk, refused = M.Checker(rank), []
    smallest = ringcoll._C.min_buffer_bytes(world, ringcoll._C.host_slot_alignment)
    with ringcoll.Communicator(buffer_bytes=smallest, small_bytes=64, timeout=M.COMM_TIMEOUT) as comm:
        n = 100 * world  # 400 bytes: above small_bytes, many slices
        for coll in DATA_COLLECTIVES:
            for algorithm in plans.algorithms(coll):
                x = M.make_input("int", torch.int32, n, M._seed("smallest", coll, rank))
                out = torch.full((n * world if coll == "all_gather" else n // world if coll == "reduce_scatter"
                                  else n,), -7, dtype=torch.int32)
                ref = out.clone()
                if coll == "all_reduce":
                    dist.all_reduce(ref := x.clone())
                    call = lambda: comm.all_reduce(x, output=out, algorithm=algorithm)  # noqa: E731
                elif coll == "reduce_scatter":
                    reduce_scatter_single(ref, x.clone())
                    call = lambda: comm.reduce_scatter_tensor(out, x, algorithm=algorithm)  # noqa: E731
                elif coll == "all_gather":
                    all_gather_single(ref, x)
                    call = lambda: comm.all_gather_into_tensor(out, x, algorithm=algorithm)  # noqa: E731
                else:  # in place, root 1 % P
                    out.copy_(x)
                    ref = x.clone()
                    getattr(dist, coll)(ref, 1 % world)
                    if coll == "reduce" and rank != 1 % world:
                        ref = x.clone()  # a rank not the root keeps its tensor
                    call = lambda: getattr(comm, coll)(out, 1 % world, algorithm=algorithm)  # noqa: E731
                before = out.clone()
                try:
                    call()
                except ValueError as e:
                    if not (str(e).startswith(f"{coll}: algorithm {algorithm!r} cuts the message into")
                            and f"this communicator's buffer_bytes is {smallest}: raise it" in str(e)
                            and algorithm not in ("native", "auto")):
                        chk.fail(f"{coll} {algorithm}", f"refused with {e}")
                    chk.equal(f"{coll} {algorithm} refused: output untouched", out, before)
                    refused.append((coll, algorithm))
                    continue
                chk.equal(f"{coll} {algorithm} at buffer_bytes={smallest}", out, ref)
    return chk.finish(), refused


@pytest.mark.parametrize("world", [2, 3])
def test_every_algorithm_runs_or_is_refused_by_name_at_the_smallest_buffer(world):
    results = spawn(_smallest_buffer_rank, world, timeout=M.SPAWN_TIMEOUT, env=M.CLEAN_ENV)
    M._report([r[0] for r in results])
    refused = results[0][1]
    # the plans of more chunks than ranks: the rooted chain and star (16) and the bidirectional ring (2P)
    assert set(refused) == {("broadcast", "ring"), ("reduce", "ring"), ("broadcast", "star"),
                            ("all_reduce", "bidir")}, refused
    assert all(r[1] == refused for r in results)


def _disagreements(rank, world):
    messages = []
    with ringcoll.Communicator(timeout=10) as comm:
        try:
            comm.all_reduce(torch.ones(8), algorithm=["ring", "oneshot", "ring"][rank])
            messages.append("no error")
        except ringcoll.RingcollMismatchError as e:
            messages.append(str(e))
    # the same ops, sending early on rank 0 only: the banks its calls take would differ
    ringcoll.register_algorithm("mine", _copy_of("oneshot"), sends_early=rank == 0)
    with ringcoll.Communicator(timeout=10) as comm:
        try:
            comm.all_reduce(torch.ones(8), algorithm="mine")
            messages.append("no error")
        except ringcoll.RingcollMismatchError as e:
            messages.append(str(e))
    try:
        ringcoll.Communicator(algorithm=["ring", "auto", "ring"][rank])
        messages.append("no error")
    except ValueError as e:
        messages.append(str(e))

    bidirectional_ring = plans.load_plans(EXAMPLE)["bidirectional_ring"]

    def wrong(world_size, r):  # at the end every rank adds its input to its input once more
        return [*bidirectional_ring(world_size, r), op(INPUT, 0, TO_OUTPUT, b=INPUT, final=True)]

    ringcoll.register_algorithm("wrong", wrong)
    t = torch.full((6,), float(rank))
    with ringcoll.Communicator() as comm:
        try:
            comm.all_reduce(t, algorithm="wrong")
            messages.append("no error")
        except ringcoll.PlanError as e:
            messages.append(str(e))
        try:
            comm.all_reduce(t, algorithm="nope")
        except ValueError as e:
            messages.append(str(e))
        comm.all_reduce(t, algorithm="oneshot")  # the communicator still works: nothing moved before
    return messages, t.tolist()


def test_disagreements_and_wrong_plans_fail_on_every_rank_before_anything_moves():
    for rank, (messages, t) in enumerate(spawn(_disagreements, 3, timeout=120)):
        assert messages[0].startswith("all_reduce: mismatched collective calls") and \
            "all_reduce(float32, SUM, count=8, algorithm ring)" in messages[0] and \
            "all_reduce(float32, SUM, count=8, algorithm oneshot)" in messages[0] and \
            messages[0].endswith("no data was moved"), messages[0]
        early, late = (plans.plan_id(plans.Plan("mine", "all_reduce", 3, plans.plan("oneshot", "all_reduce", 3).ops,
                                                sends_early)) for sends_early in (True, False))
        # named as registered on this rank; the peer's, registered differently under that name, by its id; and
        # no hint about auto, which never chooses a plan written in Python
        mine, theirs = (early, late) if rank == 0 else (late, early)
        assert messages[1].startswith("all_reduce: mismatched collective calls") and \
            f"plan 'mine' written in Python (id {mine})" in messages[1] and \
            f"plan {theirs} written in Python, not one registered here" in messages[1] and \
            "algorithm=\"auto\"" not in messages[1], messages[1]
        messages.pop(1)
        assert "RINGCOLL_ALGORITHM / algorithm= differs between ranks: rank 0: ring, rank 1: auto" in messages[1]
        assert messages[2].startswith("all_reduce plan 'wrong' on 3 ranks: rank ") and messages[2].endswith(
            "op 10 (chunk 0: input OP input -> output (final)): reads input chunk 0 after writing output chunk 0: "
            "wrong when the output is the input (in place)"), messages[2]
        assert messages[3].startswith("all_reduce: unknown algorithm 'nope' for all_reduce; choose from auto, "
                                      "native, ring"), messages[3]
        assert t == [3.0] * 6, t  # 0 + 1 + 2: the refused calls moved nothing


def _registered_again(rank, world):
    x = torch.randn(3000, generator=torch.Generator().manual_seed(7 + rank))
    with ringcoll.Communicator(timeout=M.COMM_TIMEOUT) as comm:
        expected = {}
        for builtin in ("ring", "rhd"):
            expected[builtin] = x.clone()
            comm.all_reduce(expected[builtin], algorithm=builtin)
        ringcoll.register_algorithm("mine", _copy_of("ring"))
        first = x.clone()
        comm.all_reduce(first, algorithm="mine")
        held = comm._plain_choices["all_reduce"].get("mine")
        ringcoll.register_algorithm("mine", _copy_of("rhd"))  # every rank, at the same point
        second = x.clone()
        comm.all_reduce(second, algorithm="mine")
    return (torch.equal(first, expected["ring"]), type(held).__name__, torch.equal(second, expected["rhd"]),
            torch.equal(expected["ring"], expected["rhd"]))


def test_a_user_plan_is_kept_like_a_builtin_until_its_name_is_registered_again():
    """A user's plan, once built, is named to the binding by the index the transport holds it
    under, as a built-in plan is (before, each call looked it up again in Python: 0.4-1.5 us
    more than the same ops as a built-in, which skewed every comparison of the two at small
    sizes); registering the name again makes the next call run the new plan (random floats at
    P = 3, where the ring and rhd round differently)."""
    for same_as_ring, held, same_as_rhd, ring_is_rhd in spawn(_registered_again, 3, timeout=120):
        assert not ring_is_rhd  # the two plans are told apart by their bits
        assert same_as_ring and held == "int" and same_as_rhd, (same_as_ring, held, same_as_rhd)


# auto's choice from a table (ringcoll/tuning.py). In the band [1024, 8192] native costs
# 10 + 90 (n - 1024) / 7168 us and rd (with the 5% margin) 21: rd from 1901 bytes; past 8192
# native is flat at 100 and rd reaches it at 12595 bytes. reduce_scatter: rhd, the same times;
# broadcast: tree (a rooted collective's native is its hand-written policy: the one-shot here).
BANDED = {"native": {1024: 10.0, 8192: 100.0, 65536: 100.0}, "plan": {1024: 20.0, 8192: 20.0, 65536: 1000.0}}
IN_BAND, BELOW, ABOVE = 1000, 100, 5000  # float32 elements: 4000, 400 and 20000 bytes


def _table(tmp_path, name, plan_times, machine=None):
    from ringcoll import tuning

    times = {"all_reduce": {"native": BANDED["native"], "rd": plan_times},
             "reduce_scatter": {"native": BANDED["native"], "rhd": plan_times},
             "broadcast": {"native": BANDED["native"], "tree": plan_times}}
    return tuning.record(str(tmp_path / name), 2, times, "test", machine).source


def _auto_by_table(rank, world, table, other_table):
    import os

    import torch.distributed as dist

    os.environ["RINGCOLL_TUNING"] = table
    results, messages = {}, []
    with ringcoll.Communicator(timeout=10) as comm:
        for count in (BELOW, IN_BAND, ABOVE):
            x = torch.randn(count, generator=torch.Generator().manual_seed(rank * 7 + count))
            ref, out = x.clone(), torch.empty(count // world)
            dist.all_reduce(ref)
            comm.reduce_scatter_tensor(out, x)
            comm.all_reduce(x)
            results[count] = (torch.equal(x, ref), torch.equal(out, ref.view(world, -1)[rank]))
        # auto's choice travels in the descriptor: rank 1 naming it agrees with rank 0's auto
        for count, named in ((IN_BAND, "rd"), (BELOW, "native"), (ABOVE, "native"), (IN_BAND, "rhd"),
                             (IN_BAND, "native")):
            try:
                algorithm = "auto" if rank == 0 else named
                if named == "rhd":
                    comm.reduce_scatter_tensor(torch.empty(count // world), torch.ones(count), algorithm=algorithm)
                else:
                    comm.all_reduce(torch.ones(count), algorithm=algorithm)
                messages.append("no error")
            except ringcoll.RingcollMismatchError as e:
                messages.append(str(e))
    rooted = []  # the same for a broadcast (from rank 1: the plans relabelled), on a fresh communicator
    with ringcoll.Communicator(timeout=10) as comm:  # (a mismatch breaks one)
        for count, named in ((IN_BAND, "tree"), (BELOW, "native"), (IN_BAND, "native")):
            t = torch.full((count,), float(rank))
            try:
                comm.broadcast(t, src=1, algorithm="auto" if rank == 0 else named)
                rooted.append("no error" if torch.equal(t, torch.ones(count)) else "wrong values")
            except ringcoll.RingcollMismatchError as e:
                rooted.append(str(e))
    os.environ["RINGCOLL_TUNING"] = other_table if rank == 1 else table
    try:
        ringcoll.Communicator(timeout=10)
        messages.append("no error")
    except ValueError as e:
        messages.append(str(e))
    os.environ["RINGCOLL_TUNING"] = table + ".absent" if rank == 0 else table
    try:
        ringcoll.Communicator(timeout=10)
        messages.append("no error")
    except ValueError as e:
        messages.append(str(e))
    return results, messages, rooted


def test_auto_runs_what_the_table_prices_lowest_and_every_rank_agrees(tmp_path):
    table = _table(tmp_path, "banded.json", BANDED["plan"])
    other = _table(tmp_path, "other.json", {size: t * 2 for size, t in BANDED["plan"].items()})
    for rank, (results, messages, rooted) in enumerate(spawn(_auto_by_table, 2, table, other, timeout=120)):
        assert all(all(ok) for ok in results.values()), results  # every size against gloo, bitwise (P = 2)
        assert messages[:4] == ["no error"] * 4, messages
        assert "algorithm rd" in messages[4] and "mismatched collective calls" in messages[4], messages[4]
        assert "RINGCOLL_TUNING (auto's table, its digest) differs between ranks" in messages[5], messages[5]
        assert ("RINGCOLL_TUNING (auto's table, its digest) differs between ranks: rank 0: unreadable "
                "(RINGCOLL_TUNING: cannot read a tuning table from" in messages[6]), messages[6]
        assert rooted[:2] == ["no error"] * 2, rooted  # tree in the band, native (the one-shot) below it
        assert "mismatched collective calls" in rooted[2] and "tree" in rooted[2], rooted[2]


def _auto_elsewhere(rank, world, table):
    """A table recorded on another machine: auto runs native (the band that would run rd
    included), and the communicator says why. Rank 1 names what rank 0's auto should run."""
    import os

    os.environ["RINGCOLL_TUNING"] = table
    messages = []
    with ringcoll.Communicator(timeout=10) as comm:
        messages.append(comm.tuning_note)
        for named in ("native", "rd"):
            try:
                comm.all_reduce(torch.ones(IN_BAND), algorithm="auto" if rank == 0 else named)
                messages.append("no error")
            except ringcoll.RingcollMismatchError as e:
                messages.append(str(e))
    return messages


def test_a_table_recorded_on_another_machine_leaves_auto_native(tmp_path):
    table = _table(tmp_path, "elsewhere.json", BANDED["plan"], machine="Some Other CPU x 64 cores")
    for note, native, rd in spawn(_auto_elsewhere, 2, table, timeout=120):
        assert "was recorded on Some Other CPU x 64 cores; this machine is " in note and "runs native" in note, note
        assert native == "no error", native
        assert "mismatched collective calls" in rd and "algorithm rd" in rd, rd


def _auto_between_plan_bands(rank, world, table):
    """A plain call runs auto's choice in the binding, with no way back into Python: native in
    a native band (between two plan bands too), the band's plan, held by the communicator,
    in a plan's band. Rank 1 names what rank 0's auto should run: the call check says whether
    they agree; rank 0 counts the calls that went back to Python for a plan."""
    import os

    os.environ["RINGCOLL_TUNING"] = table
    messages, detours = [], []
    with ringcoll.Communicator(timeout=10) as comm:
        looked_up = comm._plain_plan
        comm._plain_plan = lambda *args, **kwargs: detours.append(args[2]) or looked_up(*args, **kwargs)
        # bytes 1 KiB (native), 4 KiB (rd), 16 KiB (native), 64 KiB (rd); the wrong name last (it breaks the communicator)
        for count, named in ((256, "native"), (1024, "rd"), (4096, "native"), (16384, "rd"), (4096, "rd")):
            t = torch.ones(count)
            try:
                comm.all_reduce(t, algorithm="auto" if rank == 0 else named)
                messages.append("no error" if bool((t == world).all()) else "wrong values")
            except ringcoll.RingcollMismatchError as e:
                messages.append(str(e))
    return messages, [name for name in detours if name == "auto"]


def test_auto_runs_its_choice_in_the_binding_between_two_plan_bands(tmp_path):
    from ringcoll import tuning

    native, rd = {1024: 10.0, 4096: 10.0, 16384: 10.0, 65536: 10.0}, {1024: 20.0, 4096: 5.0, 16384: 20.0, 65536: 5.0}
    assert tuning.lower_envelope({"native": native, "rd": rd}) == [(0, "native"), (3170, "rd"), (7802, "native"),
                                                                   (50713, "rd")]
    table = tuning.record(str(tmp_path / "two_bands.json"), 2, {"all_reduce": {"native": native, "rd": rd}},
                          "test").source
    for rank, (messages, detours) in enumerate(spawn(_auto_between_plan_bands, 2, table, timeout=120)):
        assert messages[:4] == ["no error"] * 4, messages
        assert "mismatched collective calls" in messages[4] and "algorithm rd" in messages[4], messages[4]
        assert detours == [], detours  # auto's plan calls never went back to Python


def _auto_by_form(rank, world, table):
    """The table prices rd (all-reduce) and rhd (reduce-scatter) lowest out of place and native
    lowest in place: each call runs its form's choice, in the binding (a plain call) and in
    Python (async). Rank 1 names what rank 0's auto should run; the last pair disagrees on
    purpose (the check can fail)."""
    import os

    os.environ["RINGCOLL_TUNING"] = table
    n = 1000
    calls = {  # name -> (call with algorithm a, what auto should run out of place / in place)
        "all_reduce in place": (lambda c, a: c.all_reduce(torch.ones(n), algorithm=a), "native"),
        "all_reduce out of place": (lambda c, a: c.all_reduce(torch.ones(n), output=torch.empty(n), algorithm=a), "rd"),
        "all_reduce in place, async": (lambda c, a: c.all_reduce(torch.ones(n), async_op=True, algorithm=a).wait(),
                                       "native"),
        "all_reduce out of place, async": (
            lambda c, a: c.all_reduce(torch.ones(n), output=torch.empty(n), async_op=True, algorithm=a).wait(), "rd"),
        "reduce_scatter in place": (
            lambda c, a: (lambda x: c.reduce_scatter_tensor(x.view(world, -1)[rank], x, algorithm=a))(torch.ones(n)),
            "native"),
        "reduce_scatter out of place": (
            lambda c, a: c.reduce_scatter_tensor(torch.empty(n // world), torch.ones(n), algorithm=a), "rhd"),
        "all_reduce in place, named rd": (lambda c, a: c.all_reduce(torch.ones(n), algorithm=a), "rd"),
    }
    # Auto on both ranks, in place on rank 0 only: the two choose differently, and the error says why
    calls["all_reduce, forms differ"] = (
        lambda c, a: c.all_reduce(torch.ones(n), output=None if rank == 0 else torch.empty(n)), "auto")
    messages = {}
    for label, (call, named) in calls.items():
        with ringcoll.Communicator(timeout=10) as comm:  # a mismatch breaks one
            try:
                call(comm, "auto" if rank == 0 else named)
                messages[label] = "no error"
            except ringcoll.RingcollMismatchError as e:
                messages[label] = str(e)
    return messages


def test_auto_chooses_an_in_place_call_by_the_in_place_times(tmp_path):
    from ringcoll import tuning

    size = IN_BAND * 4
    faster, slower = {size: 5.0}, {size: 10.0}
    table = tuning.record(str(tmp_path / "forms.json"), 2, {
        "all_reduce": {"native": slower, "rd": faster}, "all_reduce in place": {"native": faster, "rd": slower},
        "reduce_scatter": {"native": slower, "rhd": faster},
        "reduce_scatter in place": {"native": faster, "rhd": slower}}, "test").source
    for messages in spawn(_auto_by_form, 2, table, timeout=120):
        wrong, forms = messages.pop("all_reduce in place, named rd"), messages.pop("all_reduce, forms differ")
        assert all(m == "no error" for m in messages.values()), messages
        assert "mismatched collective calls" in wrong and "algorithm rd" in wrong, wrong
        assert "auto chooses by the call's form too" in forms and "algorithm rd" in forms, forms


def _auto_and_direct_reads(rank, world, table):
    """A table in which the direct plan is the cheapest all-gather in a band: auto runs it
    where the ranks can read each other, and native where they cannot (direct reads off),
    rather than a plan the transport would refuse. Rank 1 names what rank 0's auto should
    run: the call check says whether they agree."""
    import os

    os.environ["RINGCOLL_TUNING"] = table
    outcomes = []
    for direct_bytes in (None, 0):  # the default (probed: readable here), and off
        with ringcoll.Communicator(timeout=10, direct_bytes=direct_bytes) as comm:
            expected = "direct" if comm.transport.direct_reads else "native"
            out = torch.empty(IN_BAND * world)
            try:
                comm.all_gather_into_tensor(out, torch.full((IN_BAND,), float(rank)),
                                            algorithm="auto" if rank == 0 else expected)
                right = torch.equal(out, torch.arange(world).repeat_interleave(IN_BAND).float())
                outcomes.append((expected, "no error" if right else "wrong values"))
            except ringcoll.RingcollError as e:
                outcomes.append((expected, str(e)))
    return outcomes


def test_auto_leaves_out_plans_the_transport_cannot_run(tmp_path):
    from ringcoll import tuning

    table = tuning.record(str(tmp_path / "direct.json"), 2,
                          {"all_gather": {"native": BANDED["native"], "direct": BANDED["plan"]}}, "test").source
    for outcomes in spawn(_auto_and_direct_reads, 2, table, timeout=120):
        assert outcomes == [("direct", "no error"), ("native", "no error")], outcomes
