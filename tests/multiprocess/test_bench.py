"""The benchmark: checks before it times, reports wrong results with a failing exit code,
and prints nccl-tests' columns. Speed itself is never asserted here."""

import json

import pytest
import torch

from ringcoll.harness import bench


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
            else:
                full = {"sum": inputs.sum(0), "avg": inputs.sum(0) / world, "prod": inputs.prod(0),
                        "min": inputs.min(0).values, "max": inputs.max(0).values}[op]
            for rank in range(world):
                want = full.view(world, -1)[rank] if name == "reduce_scatter" else full
                got = bench.expected_result(coll, rank, world, count, torch.float64, op)
                assert torch.equal(got, want), (name, op, rank)


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
        row = bench.bench_one(CorruptingBackend(), bench.COLLECTIVES[name], 16, 0, 1, config)
        assert row["out_wrong"] == 1 and row["in_wrong"] == 1, row
        assert bench.total_wrong([row]) == 2


@pytest.mark.parametrize("nproc", [2, 3])
def test_benchmark_runs_checked_end_to_end(tmp_path, capsys, nproc):
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
    assert {r["collective"] for r in ours} == set(bench.COLLECTIVES)
    assert len(ours) == 3 * 3 and all(r["out_wrong"] == 0 and r["in_wrong"] == 0 for r in ours)
    assert {r["backend"] for r in data["rows"]} == {"ringcoll", "gloo"}
    assert set(data["fit"]) == set(bench.COLLECTIVES)


def test_straggler_shows_ring_runs_at_slowest_pace(capsys):
    # Rank 1 sleeps 2 ms before each call: every rank's time per call (even the fastest
    # rank's) includes that wait, because no rank can finish before the straggler sends.
    # Only a rank preempted between its last untimed call and starting its clock can miss
    # part of one delay (the straggler has begun the next one): 40 calls amortise that.
    delay_us = 2000
    status = bench.main(["-b", "4K", "-e", "4K", "-w", "1", "-n", "40", "--trials", "1", "--min-ms", "1",
                         "--collectives", "all_reduce", "--no-gloo", "--no-mpi", "--no-progress",
                         "--straggler-rank", "1", "--delay-us", str(delay_us)])
    printed = capsys.readouterr().out
    assert status == 0
    row = [line for line in printed.splitlines() if line.strip().startswith("4096")][0]
    fastest = float(row.split("|")[-1])
    assert fastest >= delay_us * (1 - 1 / 40) * 0.98, row
    assert "rank 1 delayed 2000 us" in printed


def test_algorithm_option_times_the_one_shot_path_checked(capsys):
    status = bench.main(["-b", "1K", "-e", "4K", "-f", "4", "-w", "1", "-n", "2", "--trials", "1", "--min-ms", "1",
                         "--no-gloo", "--no-mpi", "--no-progress", "--no-check-cost", "--algorithm", "oneshot"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert printed.count("algorithm: one-shot where it fits a slot, else ring") == 3, printed
    assert "Out of bounds values : 0 OK" in printed
    assert bench.ALGORITHMS["ring"] == 0 and bench.ALGORITHMS["auto"] is None


def test_refuses_bad_arguments(capsys):
    assert bench.main(["--op", "avg", "--dtype", "int32", "--no-mpi"]) == 2
    assert bench.main(["--straggler-rank", "5", "--nproc", "2", "--no-mpi"]) == 2
    assert bench.main(["--collectives", "all_to_all", "--no-mpi"]) == 2
    assert "ringcoll-bench:" in capsys.readouterr().err
