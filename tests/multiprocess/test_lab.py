"""``ringcoll lab overlap`` and ``ringcoll lab memory`` (ringcoll/learning/lab/), their quick
sizes run through the command line, checked for what holds whatever the machine's speed:
every rank ends with the same weights; ZeRO-2 trains bitwise the same with and without
overlap (only the waits move); the JSON holds every figure the tables print; the memory
terms equal the ledger exactly where nothing is padded or in flight, and where something
is, by exactly that. The straggler experiment: test_lab_straggler.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ringcoll.learning.lab import memory, overlap


def _lab(name, out):
    proc = subprocess.run([sys.executable, "-m", "ringcoll.learning.lab", name, "--quick", "--out", str(out),
                           "--no-progress"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(out, f"{name}.json")) as f:
        saved = json.load(f)
    assert os.path.getsize(os.path.join(out, f"{name}.png")) > 1000
    return proc.stdout, saved


@pytest.fixture(scope="module")
def overlap_run(tmp_path_factory):
    return _lab("overlap", tmp_path_factory.mktemp("overlap"))


@pytest.fixture(scope="module")
def memory_run(tmp_path_factory):
    return _lab("memory", tmp_path_factory.mktemp("memory"))


def test_overlap_replicas_agree_and_zero_overlap_changes_nothing(overlap_run):
    _, saved = overlap_run
    for res in saved["results"]:
        assert all(r["replicas_identical"] for r in res["rows"])
        for fraction in overlap.QUICK.bucket_fractions:
            zero = {r["mode"]: r["digest"] for r in res["rows"]
                    if r["system"] == "zero2" and r["bucket_fraction"] == fraction}
            assert set(zero) == set(overlap.MODES["zero2"])
            assert len(set(zero.values())) == 1, zero


def test_overlap_json_holds_every_printed_figure(overlap_run):
    out, saved = overlap_run
    for res in saved["results"]:
        assert overlap.format_table(overlap.QUICK, res) in out
        for r in res["rows"]:
            assert r["comm_share_pct"] == pytest.approx(100 * (r["step_s"] - res["compute_s"]) / r["step_s"])
    for line in saved["findings"]:
        assert f"* {line}" in out


def test_memory_matches_ledger_term_by_term(memory_run):
    out, saved = memory_run
    assert memory.format_table(saved["rows"]) in out
    worlds = {r["world"] for r in saved["rows"]}
    assert worlds == set(memory.QUICK.worlds)
    for r in saved["rows"]:
        m, led, n, p = r["measured"], r["ledger"], r["params"], r["world"]
        if r["system"] == "ddp":
            assert (m["weights"], m["gradients"], m["optimizer_state"]) == (4 * n, 4 * n, 8 * n)
            continue
        pad = m["padding_elements"]
        size = 4 if r["precision"] == "fp32" else 2
        assert m["weights"] == led["weights"] + size * pad
        # optimizer state: fp32 (master, for bf16) + Adam m and v, over this rank's shards
        shard = (n + pad) // p
        assert m["optimizer_state"] == (8 if r["precision"] == "fp32" else 12) * shard
        if r["system"] == "zero1":
            assert m["gradients"] == size * n == led["gradients"]  # the full p.grad (the shard's is dropped in step)
        else:
            assert m["gradient_shards"] == 4 * shard  # kept in fp32 (the master's dtype)
            assert 0 < m["gradient_buckets_in_flight"]
            assert m["gradients"] == m["gradient_shards"] + m["gradient_buckets_in_flight"]
