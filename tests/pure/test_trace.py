"""ringcoll trace: what it prints is the real schedule, and its results are the references."""

import re

import pytest

from ringcoll.learning import schedule
from ringcoll.learning.cli import main
from ringcoll.learning.trace import COLLECTIVES, MAX_ELEMENTS, default_inputs, draw, reference, trace

STEP = re.compile(r"^step (\d+) ")
TRANSFER = re.compile(r"^  rank (\d+): sends chunk (\d+) to rank (\d+), receives chunk (\d+) from rank (\d+): (.*)$")
RESULT = re.compile(r"^  rank (\d+): \[(.*)\]$")
CASES = [(coll, 4, 8) for coll in COLLECTIVES] + [
    ("all_reduce", 3, 7), ("reduce_scatter", 5, 3), ("all_gather", 4, 2),  # n < P: empty chunks
    ("all_reduce", 2, 5), ("reduce_scatter", 6, 13), ("all_gather", 3, 10), ("all_reduce", 5, 0),
]


def expected_chunks(coll: schedule.Collective, rank: int, step: int, world: int):
    """(sent, received, reduces) straight from the ring.h mirror, not from simulate()."""
    p1 = world - 1
    if coll == schedule.Collective.ALL_REDUCE and step >= p1:
        return schedule.ag_send_chunk(rank, step - p1, world), schedule.ag_recv_chunk(rank, step - p1, world), False
    if coll == schedule.Collective.ALL_GATHER:
        return schedule.ag_send_chunk(rank, step, world), schedule.ag_recv_chunk(rank, step, world), False
    return schedule.rs_send_chunk(rank, step, world), schedule.rs_recv_chunk(rank, step, world), True


def parse_transfers(text: str):
    """{(step, rank): (sent, to, received, from, rest of line)}"""
    transfers, step = {}, None
    for line in text.splitlines():
        if m := STEP.match(line):
            step = int(m.group(1))
        elif m := TRANSFER.match(line):
            rank, sent, to, received, frm = map(int, m.groups()[:5])
            transfers[(step, rank)] = (sent, to, received, frm, m.group(6))
    return transfers


def parse_results(text: str):
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("result"))
    results = {}
    for line in lines[start + 1:]:
        if not (m := RESULT.match(line)):
            break
        results[int(m.group(1))] = [int(v) for v in m.group(2).split()]
    return results


@pytest.mark.parametrize("name,world,n", CASES)
def test_printed_chunks_are_the_schedule(name, world, n):
    coll = COLLECTIVES[name]
    transfers = parse_transfers(trace(name, world, n))
    steps = schedule.ring_steps(coll, world)
    assert len(transfers) == steps * world
    for t in range(steps):
        for k in range(world):
            sent, to, received, frm, rest = transfers[(t, k)]
            want_sent, want_received, reduces = expected_chunks(coll, k, t, world)
            assert (sent, received) == (want_sent, want_received), (t, k)
            assert to == schedule.right_neighbour(k, world) and frm == schedule.left_neighbour(k, world)
            assert reduces == schedule.step_reduces(coll, t, world)
            assert ("+ own" in rest) == reduces and rest.startswith("copy") != reduces
            # What k receives is what its left neighbour sent in the same step.
            assert received == transfers[(t, frm)][0]


@pytest.mark.parametrize("name,world,n", CASES + [("all_gather", 1, 3), ("all_reduce", 1, 4)])
def test_printed_results_are_the_plain_reference(name, world, n):
    text = trace(name, world, n)
    want = reference(name, default_inputs(name, world, n))
    assert parse_results(text) == dict(enumerate(want))
    assert "OK, every rank matches" in text


def test_reference_is_the_plain_computation():
    inputs = [[1, 2, 3, 4, 5], [10, 20, 30, 40, 50]]
    assert reference("all_reduce", inputs) == [[11, 22, 33, 44, 55]] * 2
    assert reference("reduce_scatter", inputs) == [[11, 22, 33], [44, 55]]
    assert reference("all_gather", [[1, 2], [3]]) == [[1, 2, 3]] * 2


def test_trace_shows_inputs_chunk_bounds_and_reductions():
    text = trace("all_reduce", 4, 8)
    assert "rank r's element i = (i+1) * 10**r" in text
    assert "chunk 0 = [0, 2)  chunk 1 = [2, 4)  chunk 2 = [4, 6)  chunk 3 = [6, 8)" in text
    # rank 1, step 0: its left neighbour's raw chunk 3 plus its own.
    assert "rank 1: sends chunk 0 to rank 2, receives chunk 3 from rank 0: [7 8] + own [70 80] = [77 88]" in text
    uneven = trace("reduce_scatter", 3, 7)
    assert "q = n // P = 2, r = n % P = 1" in uneven and "chunk 0 = [0, 3)" in uneven


def test_given_inputs_and_bad_arguments():
    text = trace("all_reduce", 2, 3, inputs=[[1, 1, 1], [2, 2, 2]])
    assert "inputs: as given" in text and parse_results(text) == {0: [3, 3, 3], 1: [3, 3, 3]}
    with pytest.raises(ValueError, match="collective"):
        trace("all_to_all", 4, 8)
    with pytest.raises(ValueError, match="n = 4"):
        trace("all_reduce", 2, 4, inputs=[[1], [2]])
    for world in (0, 65):  # past the most ranks a plan runs on, the ring's plan is no ring (it said "deadlock")
        with pytest.raises(ValueError, match=f"trace: world must be 1 to 64 .*got {world}"):
            trace("all_reduce", world, 8)


@pytest.mark.parametrize("name,world,n,panels", [("all_reduce", 4, 8, 6), ("reduce_scatter", 4, 8, 3),
                                                 ("all_gather", 3, 2, 2)])
def test_png_has_one_panel_per_step(tmp_path, name, world, n, panels):
    path = tmp_path / "ring.png"
    fig = draw(name, world, n, path=str(path))
    assert panels == schedule.ring_steps(COLLECTIVES[name], world)
    assert len(fig.axes) == panels and fig.ringcoll_panels == panels
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert 10_000 < len(data) < 5_000_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 300 and height > 200


def test_cli_trace(tmp_path, capsys):
    assert main(["trace", "all_reduce", "--world", "4", "--n", "8"]) == 0
    out = capsys.readouterr().out
    assert "ringcoll trace: all_reduce, P = 4 ranks, n = 8 elements" in out
    assert "OK, every rank matches" in out
    png = tmp_path / "t.png"
    assert main(["trace", "reduce_scatter", "-P", "3", "-n", "4", "--png", str(png)]) == 0
    assert "2 panels" in capsys.readouterr().out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["trace", "all_reduce", "--world", "1", "--png", str(tmp_path / "p1.png")]) == 2
    assert "needs world >= 2" in capsys.readouterr().err
    # a file it cannot write: a message and status 1 (a FileNotFoundError traceback)
    assert main(["trace", "all_reduce", "-P", "2", "-n", "4", "--png", str(tmp_path / "missing" / "t.png")]) == 1
    assert "No such file or directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["trace", "all_to_all"])
    # every element is printed at every step: n = 3e6 wrote 1.5 GB before it was bounded
    for collective in ("all_reduce", "broadcast"):
        assert main(["trace", collective, "-P", "2", "-n", str(MAX_ELEMENTS + 1)]) == 2
        assert f"n must be 0 to {MAX_ELEMENTS}" in capsys.readouterr().err


# --- the one-shot path (small messages) ----------------------------------------------------

ONE_SHOT = re.compile(r"^  rank (\d+): publishes \[(.*?)\]; reads (chunk (\d+) of )?the slots of ranks ([\d, ]+): (.*)$")


@pytest.mark.parametrize("name,world,n", CASES + [("all_gather", 1, 3), ("all_reduce", 1, 4)])
def test_one_shot_trace_is_one_step_and_gives_the_reference(name, world, n):
    coll = COLLECTIVES[name]
    inputs = default_inputs(name, world, n)
    text = trace(name, world, n, algorithm="oneshot")
    assert "algorithm = one-shot" in text.splitlines()[0]
    assert parse_results(text) == dict(enumerate(reference(name, inputs)))
    assert "OK, every rank matches" in text
    rows = [m for line in text.splitlines() if (m := ONE_SHOT.match(line))]
    assert len(rows) == (world if world > 1 else 0)
    assert sum(1 for line in text.splitlines() if STEP.match(line)) == (1 if world > 1 else 0)
    for m in rows:
        rank = int(m.group(1))
        # Each rank publishes what its peers need (all-reduce: its whole input; reduce-scatter: every
        # chunk but its own; all-gather: its own chunk) and reads every rank's part, in rank order.
        mine = inputs[rank]
        if coll == schedule.Collective.REDUCE_SCATTER:
            mine = mine[:schedule.chunk_begin(n, world, rank)] + mine[schedule.chunk_end(n, world, rank):]
        assert [int(v) for v in m.group(2).split()] == mine
        assert m.group(5) == ", ".join(map(str, range(world)))
        assert (m.group(4) is not None) == (coll == schedule.Collective.REDUCE_SCATTER)
        if m.group(4) is not None:
            assert int(m.group(4)) == rank
    if world > 1:
        assert f"1 step instead of the ring's {schedule.ring_steps(coll, world)}" in text


def test_one_shot_folds_in_the_rings_order_on_every_rank():
    # A non-commutative "op" shows the order: chunk 0 (the one element) as the ring folds
    # it, from rank 1 round to rank 0, on every rank; chunk 1 from rank 2, chunk 2 from rank 0.
    ranks = schedule.simulate_one_shot(schedule.Collective.ALL_REDUCE, [["a"], ["b"], ["c"]], op=lambda x, y: x + y)
    assert [r.output for r in ranks] == [["bca"]] * 3
    ranks = schedule.simulate_one_shot(schedule.Collective.ALL_REDUCE, [list("abc"), list("def"), list("ghi")],
                                       op=lambda x, y: x + y)
    assert [r.output for r in ranks] == [["dga", "hbe", "cfi"]] * 3
    rs = schedule.simulate_one_shot(schedule.Collective.REDUCE_SCATTER, [[1, 2, 3], [10, 20, 30], [100, 200, 300]])
    assert [r.read for r in rs][1] == [[2], [20], [200]] and [r.output for r in rs] == [[111], [222], [333]]
    text = trace("all_reduce", 2, 3, algorithm="oneshot")
    assert "rank 1: publishes [10 20 30]; reads the slots of ranks 0, 1: [1 2 3] + [10 20 30] = [11 22 33]" in text


def test_one_shot_cli_and_bad_arguments(capsys):
    assert main(["trace", "all_gather", "-P", "3", "-n", "7", "--algorithm", "oneshot"]) == 0
    out = capsys.readouterr().out
    assert "algorithm = one-shot" in out and "OK, every rank matches" in out
    assert main(["trace", "all_reduce", "--algorithm", "oneshot", "--png", "x.png"]) == 2
    assert "single step" in capsys.readouterr().err
    with pytest.raises(ValueError, match="algorithm for all_reduce must be one of ring, oneshot, direct, symmetric, "
                                         "rhd, rd, tree, got 'nope'"):
        trace("all_reduce", 2, 3, algorithm="nope")
    with pytest.raises(ValueError, match="algorithm for reduce_scatter must be one of ring, oneshot, direct, "
                                         "symmetric, rhd, got 'tree'"):
        trace("reduce_scatter", 2, 3, algorithm="tree")


def test_rooted_traces_name_the_root_and_refuse_what_they_lack(capsys):
    """broadcast and reduce are traced from their plans, root rank 0; a reduce's other
    ranks keep their inputs, and an algorithm without them is refused by name."""
    from ringcoll.learning import cli

    text = trace("reduce", 3, 2)
    assert text.startswith("ringcoll trace: reduce, P = 3 ranks, n = 2 elements, root = rank 0")
    assert "  rank 0: [111 222]\n  rank 1: [10 20]\n  rank 2: [100 200]\ncheck:" in text
    with pytest.raises(ValueError, match="algorithm for broadcast must be one of ring, oneshot, tree, star, direct, got 'rhd'"):
        trace("broadcast", 2, 3, algorithm="rhd")
    assert cli.main(["trace", "broadcast", "-P", "2", "-n", "2", "--algorithm", "tree"]) == 0
    assert "check: reference (the root's input) = [1 2]: OK, every rank matches" in capsys.readouterr().out


PLAN_ROUND = re.compile(r"^round (\d+)")
PLAN_OP = re.compile(r"^  rank (\d+), op (\d+): (.*)  = (.*)$")
PLAN_EMPTY_OPS = re.compile(r"^  rank (\d+), ops (\d+)-(\d+): their chunks are empty ")


@pytest.mark.parametrize("name, coll", [("rhd", c) for c in COLLECTIVES] + [("rd", "all_reduce"),
                                                                          ("tree", "all_reduce")]
                         + [(name, c) for c in ("broadcast", "reduce") for name in ("ring", "oneshot", "tree")]
                         + [("star", "broadcast")])
@pytest.mark.parametrize("world, n", [(1, 3), (3, 7), (4, 8), (6, 13)])
def test_plan_traces_print_every_op_of_the_plan_round_by_round(name, coll, world, n):
    """A trace from a plan shows each op of every rank exactly once, as the plan states it,
    with the values the simulation made, under the round plans.rounds puts it in; the
    result is the reference's and the cost line the model's."""
    from ringcoll import plans
    from ringcoll.learning import model

    p = plans.plan(name, coll, world)
    inputs = default_inputs(coll, world, n)
    text = trace(coll, world, n, algorithm=name)
    rounds = {(st.rank, st.index): (t, st) for t, st in plans.rounds(p, inputs)}
    seen, current = set(), None
    for line in text.splitlines():
        m = PLAN_ROUND.match(line)
        if m:
            current = int(m.group(1))
        m = PLAN_OP.match(line)
        if m:
            key = (int(m.group(1)), int(m.group(2)))
            t, st = rounds[key]
            assert (current, m.group(3)) == (t, str(p.ops[key[0]][key[1]])), line
            assert m.group(4) == " | ".join("[" + " ".join(map(str, v)) + "]" for v in st.values), line
            seen.add(key)
        m = PLAN_EMPTY_OPS.match(line)
        if m:  # a run of one rank's ops over empty chunks, in this round, said once
            rank, first, last = map(int, m.groups())
            assert last > first, line
            for i in range(first, last + 1):
                t, st = rounds[(rank, i)]
                assert t == current and not any(st.values), (line, i, st.values)
                seen.add((rank, i))
    assert seen == {(r, i) for r in range(world) for i in range(len(p.ops[r]))}
    assert "OK, every rank matches" in text
    if world > 1:
        assert f"cost: {model.plan_cost(p).rounds} rounds" in text


def test_plan_trace_cli(capsys):
    assert main(["trace", "all_reduce", "-P", "4", "-n", "4", "--algorithm", "tree"]) == 0
    out = capsys.readouterr().out
    assert "rank 2, op 1: chunk 0: rank 0's publication -> output and published to rank 3  = [1111 2222 3333 4444]" \
        in out and "cost: 4 rounds (the ring's: 6); the busiest rank receives 2 n" in out
    assert main(["trace", "all_reduce", "--algorithm", "rd", "--png", "x.png"]) == 2
    assert "rd is not a ring" in capsys.readouterr().err


# --- the direct-read all-gather (large messages, CPU transport) ----------------------------

DIRECT_READS = re.compile(r"^  rank (\d+): reads (.*)$")
ONE_READ = re.compile(r"^rank (\d+) \[(.*)\] -> chunk (\d+)$")
DIRECT_OWN = re.compile(r"^  rank (\d+): own \[(.*)\] -> chunk (\d+); waits for ranks ([\d, ]+) to finish reading; ")


def parse_direct_reads(text: str):
    """{rank: [(peer, values, chunk), ...]} in the printed order."""
    reads = {}
    for line in text.splitlines():
        if m := DIRECT_READS.match(line):
            parts = [ONE_READ.match(part) for part in m.group(2).split(", ")]  # values are space-separated
            reads[int(m.group(1))] = [(int(r.group(1)), [int(v) for v in r.group(2).split()], int(r.group(3)))
                                      for r in parts]
    return reads


@pytest.mark.parametrize("world", range(1, 6))
@pytest.mark.parametrize("n", [0, 1, 3, 7, 13])  # n < P leaves chunks empty; n % P != 0 makes them unequal
def test_direct_read_trace_reads_k_plus_1_onwards_and_gives_the_reference(world, n):
    inputs = default_inputs("all_gather", world, n)
    text = trace("all_gather", world, n, algorithm="direct")
    assert "algorithm = direct read" in text.splitlines()[0]
    assert parse_results(text) == dict(enumerate(reference("all_gather", inputs)))
    assert "OK, every rank matches" in text
    reads = parse_direct_reads(text)
    assert sorted(reads) == (list(range(world)) if world > 1 else [])
    for k, row in reads.items():
        # Peer j's input, as posted, straight into chunk j; peers k+1, k+2, .. mod P.
        assert [peer for peer, _, _ in row] == [(k + i) % world for i in range(1, world)]
        assert all(values == inputs[peer] and chunk == peer for peer, values, chunk in row)
    own = [m for line in text.splitlines() if (m := DIRECT_OWN.match(line))]
    assert len(own) == (world if world > 1 else 0)
    for m in own:
        k = int(m.group(1))
        assert int(m.group(3)) == k and [int(v) for v in m.group(2).split()] == inputs[k]
        assert m.group(4) == ", ".join(str(r) for r in range(world) if r != k)  # done: every peer
    assert sum(1 for line in text.splitlines() if line.startswith("  rank ") and ": posts [" in line) == \
        (world if world > 1 else 0)
    assert ("cost: 2 handshakes (post, done)" in text) == (world > 1)


@pytest.mark.parametrize("world,costs", [
    # n = 12: direct (P-1)/P n + n/P, in place (P-1)/P n; slots (2P-1)/P n, in place 2(P-1)/P n.
    (2, "direct 12 ((P-1)/P n read + n/P own chunk; in place 6), through the slots 18 ((2P-1)/P n; in place 12)"),
    (3, "direct 12 ((P-1)/P n read + n/P own chunk; in place 8), through the slots 20 ((2P-1)/P n; in place 16)"),
    (4, "direct 12 ((P-1)/P n read + n/P own chunk; in place 9), through the slots 21 ((2P-1)/P n; in place 18)"),
])
def test_direct_read_cost_line(world, costs):
    text = trace("all_gather", world, 12, algorithm="direct")
    steps = "1 step;" if world == 2 else f"{world - 1} steps;"
    assert f"cost: 2 handshakes (post, done) against the ring's P-1 = {steps}" in text
    assert "  " + costs in text.splitlines()


def test_simulate_direct_read_is_the_reference_and_staggers_the_readers():
    inputs = [["a0", "a1"], ["b0", "b1"], ["c0"], ["d0"]]  # chunks of a 6-element message on 4 ranks
    ranks = schedule.simulate_direct_read(inputs)
    assert [rs.output for rs in ranks] == reference("all_gather", inputs)
    assert ranks[2].reads == [(3, ["d0"]), (0, ["a0", "a1"]), (1, ["b0", "b1"])]
    assert [rs.own for rs in ranks] == inputs and [rs.posted for rs in ranks] == inputs
    # At each turn the ranks read P different peers: no input is read by all at once.
    for turn in range(3):
        assert sorted(rs.reads[turn][0] for rs in ranks) == [0, 1, 2, 3]
    assert schedule.direct_read_order(0, 1) == [] and schedule.simulate_direct_read([[7, 8]])[0].output == [7, 8]
    with pytest.raises(ValueError, match="simulate_direct_read: all_gather rank 0 has 1 elements, chunk 0 of a "
                                         "3-element message has 2"):
        schedule.simulate_direct_read([[1], [2, 3]])


@pytest.mark.parametrize("name", ["all_reduce", "reduce_scatter"])
def test_the_reducing_collectives_trace_their_direct_plans(name, capsys):
    """They have no direct path of their own: their direct plans (each rank folds its chunk of
    every peer's input where it lies, the all-reduce then publishes it), run and checked."""
    out = trace(name, 3, 6, algorithm="direct")
    assert "plan 'direct'" in out and "rank 0, op 0: chunk 0: rank 1's input -> work  = [10 20]" in out, out
    assert "rank 0, op 1: chunk 0: work OP rank 2's input -> work  = [110 220]" in out, out
    assert "OK, every rank matches" in out, out
    assert ("output, shared there with ranks 1, 2" in out) == (name == "all_reduce"), out
    assert main(["trace", name, "--algorithm", "direct"]) == 0
    assert "OK, every rank matches" in capsys.readouterr().out


def test_direct_read_cli(capsys):
    assert main(["trace", "all_gather", "-P", "3", "-n", "7", "--algorithm", "direct"]) == 0
    out = capsys.readouterr().out
    assert "algorithm = direct read" in out and "OK, every rank matches" in out
    assert "  rank 1: reads rank 2 [20 21] -> chunk 2, rank 0 [0 1 2] -> chunk 0" in out
    assert main(["trace", "all_gather", "--algorithm", "direct", "--png", "x.png"]) == 2
    assert "no ring steps" in capsys.readouterr().err


# --- symmetric memory, read in place (csrc/host/host_symmetric.cpp) ---------------------------

@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_reading_symmetric_memory_in_place_folds_in_the_rings_order(world, collective):
    """With an op that records its bracketing (not associative, not commutative), every rank's
    result over symmetric memory is the ring's, element by element: the same fold order, so
    the same bits for floats."""
    from ringcoll.learning.schedule import Collective, simulate, simulate_zero_copy

    coll = Collective[collective.upper()]
    n = 2 * world + 1
    if coll == Collective.ALL_GATHER:
        inputs = [[f"r{r}e{i}" for i in range(schedule.chunk_length(n, world, r))] for r in range(world)]
    else:
        inputs = [[f"r{r}e{i}" for i in range(n)] for r in range(world)]
    bracket = lambda a, b: f"({a}+{b})"  # noqa: E731
    ring = simulate(coll, inputs, op=bracket).outputs
    assert [rs.output for rs in simulate_zero_copy(coll, inputs, op=bracket)] == ring
    text = trace(collective, world, n, algorithm="symmetric")
    assert "algorithm = symmetric memory, read in place" in text.splitlines()[0]
    assert "OK, every rank matches" in text
    if world > 1:
        rounds = 2 if coll == Collective.ALL_REDUCE else 1
        assert f"cost: {rounds} round{'s' * (rounds > 1)} of flags" in text, text


def test_a_plan_trace_gives_the_checkers_verdict_and_fails_where_the_checker_or_the_result_does(tmp_path, capsys):
    """A trace runs one set of inputs: a plan the checker refuses could still look right there
    (a final forgotten), and a wrong result was printed with exit status 0. The trace now ends
    with the checker's verdict, and the CLI exits 1 on a refusal or a mismatch."""
    plans_file = tmp_path / "mine.py"
    plans_file.write_text(
        "import ringcoll\n"
        "from ringcoll import plans\n"
        "from ringcoll.plans import INPUT, PEER, TO_OUTPUT, TO_SLOT, op\n"
        "def pairwise(world, rank, final=True, twice=False):  # a direct reduce-scatter, one round per peer\n"
        "    ops, acc = [], INPUT\n"
        "    for k in range(1, world):\n"
        "        dst, src = (rank + k) % world, (rank - k) % world\n"
        "        ops.append(op(INPUT, dst, TO_SLOT, readers=[dst]))\n"
        "        last = k == world - 1\n"
        "        ops.append(op(acc, rank, plans.TO_OUTPUT if last else plans.TO_WORK, b=PEER, frm=src,\n"
        "                      final=last and final))\n"
        "        acc = plans.WORK\n"
        "        if twice and k == 1:  # one more add of the own input: counted twice\n"
        "            ops.append(op(plans.WORK, rank, plans.TO_WORK, b=INPUT))\n"
        "    return ops\n"
        "ringcoll.register_algorithm('pairwise', pairwise, 'reduce_scatter')\n"
        "ringcoll.register_algorithm('nofinal', lambda w, r: pairwise(w, r, final=False), 'reduce_scatter')\n"
        "ringcoll.register_algorithm('twice', lambda w, r: pairwise(w, r, twice=True), 'reduce_scatter')\n")
    statuses = {}
    for name in ("pairwise", "nofinal", "twice"):
        statuses[name] = main(["trace", "reduce_scatter", "-P", "3", "-n", "6", "--plans", str(plans_file),
                               "--algorithm", name])
        out = capsys.readouterr().out
        if name == "pairwise":
            assert "OK, every rank matches\nchecker: plans.check proves the plan for every input" in out, out
        elif name == "nofinal":  # right on these inputs, refused by the checker
            assert "OK, every rank matches\nchecker: REFUSED: reduce_scatter plan 'nofinal' on 3 ranks" in out, out
            assert "is never marked final" in out, out
        else:
            assert "MISMATCH on rank(s) 0, 1, 2" in out and "checker: REFUSED" in out, out
    assert statuses == {"pairwise": 0, "nofinal": 1, "twice": 1}
