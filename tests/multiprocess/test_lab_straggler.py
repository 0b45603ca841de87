"""``ringcoll lab straggler`` (ringcoll/learning/lab/straggler.py), its quick size, checked for
what must hold whatever the machine's speed (no speed is asserted):

* sync: the replicas end bitwise identical, and the first step equals a single-process
  large-batch step (the mean of the P micro-batch gradients, P = 2: exact in any order);
* local SGD with H = 1 ends where sync ends (equal up to rounding: it averages weights
  w - lr g_r, sync averages the gradients);
* the parameter server: every applied gradient is, bitwise, the gradient of that worker's
  next batch at the weights of the version it says it used (so the recorded staleness is
  the true one), and the final weights are those gradients applied in the recorded order;
* bounded staleness: no worker was released more than S steps ahead of the slowest, and
  so no gradient is staler than (P - 1)(2S + 1) updates;
* accuracy is measured on the held-out split; the JSON holds every figure the table prints.

One job of P + 1 = 3 processes runs every variant, with and without the slow rank.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from ringcoll.learning.lab import common, straggler

CFG = dataclasses.replace(straggler.QUICK, local_every=1, trace=True, progress=False)


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    return straggler.run(CFG, out_dir=str(tmp_path_factory.mktemp("lab")), timeout=240)


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks compute
    yield
    torch.set_num_threads(before)


def _runs(record, variant):
    return [r for r in record["runs_with_trace"] if r["variant"] == variant]


def _model(seed):
    return common.FlatModel(common.make_model(CFG.hidden, seed))


def test_sync_replicas_identical_and_first_step_is_large_batch_step(record, one_thread):
    for run in _runs(record, "sync"):
        assert run["replicas_identical"], run["slow"]
        finals = [t["final"] for t in run["trace"]]
        assert all(torch.equal(finals[0], f) for f in finals)
        model = _model(run["seed"])
        w0 = model.weights.clone()
        grads, xs, ys = [], [], []
        for r in range(CFG.world):
            x, y = next(common.batches(run["seed"], r, CFG.world, CFG.batch))
            grads.append(model.gradient(x, y)[1])
            xs.append(x)
            ys.append(y)
        expected = w0 - CFG.lr * ((grads[0] + grads[1]) / CFG.world)
        for t in run["trace"]:
            assert torch.equal(t["after_first_step"], expected)
        # ... which is the step on the gradient of the 2B-sample mean loss (up to rounding)
        big = model.gradient(torch.cat(xs), torch.cat(ys))[1]
        torch.testing.assert_close(expected, w0 - CFG.lr * big)


def test_local_sgd_every_step_equals_sync(record):
    sync = {r["slow"]: r["trace"][0]["final"] for r in _runs(record, "sync")}
    for run in _runs(record, "local"):
        assert run["replicas_identical"]
        torch.testing.assert_close(run["trace"][0]["final"], sync[run["slow"]], rtol=1e-5, atol=1e-6)
        assert not torch.equal(run["trace"][0]["final"], torch.zeros(1))


def _replay(run, one_thread_fixture=None):
    """Recompute every applied gradient from the recorded versions; return the weights."""
    trace = run["trace"]
    model = _model(run["seed"])
    assert torch.equal(model.weights, trace["initial"])
    versions = [model.weights.clone()]
    streams = [common.batches(run["seed"], w, CFG.world, CFG.batch) for w in range(CFG.world)]
    seen = [0] * CFG.world
    for worker, step, used, grad in trace["updates"]:
        assert step == seen[worker]  # each worker's gradients arrive in its own order
        seen[worker] += 1
        x, y = next(streams[worker])
        model.weights.copy_(versions[used])
        assert torch.equal(model.gradient(x, y)[1], grad), (worker, step, used)
        versions.append(versions[-1] - (CFG.lr / CFG.world) * grad)
    return versions[-1], [len(versions) - 1 - used for (_, _, used, _) in trace["updates"]]


def test_parameter_server_is_sequential_application_of_recorded_gradients(record, one_thread):
    for variant in ("async", "bounded"):
        for run in _runs(record, variant):
            final, _ = _replay(run)
            assert torch.equal(final, run["trace"]["final"])
            assert len(run["trace"]["updates"]) == CFG.steps * CFG.world == sum(run["updates_per_worker"])
            # staleness = updates applied between the read and the write
            assert run["staleness"] == [len(run["staleness"][:i]) - used
                                        for i, (_, _, used, _) in enumerate(run["trace"]["updates"])]


def test_bounded_staleness_respects_s(record):
    s = CFG.staleness
    for run in _runs(record, "bounded"):
        assert max(run["leads"]) <= s
        assert max(run["staleness"]) <= (CFG.world - 1) * (2 * s + 1)
    # the unbounded server is not held back, so with the slow rank it runs ahead
    assert max(max(r["leads"]) for r in _runs(record, "async")) >= 0


def test_accuracy_is_measured_on_held_out_split(record):
    data = common.digits()
    assert len(data.test_y) == 360 and len(data.train_y) == 1437
    train = {tuple(x.tolist()) for x in data.train_x}
    assert sum(tuple(x.tolist()) in train for x in data.test_x) < 10  # a few duplicate images exist
    for run in record["runs_with_trace"]:
        final = run["trace"][0]["final"] if isinstance(run["trace"], list) else run["trace"]["final"]
        model = _model(0)
        model.weights.copy_(final)
        assert run["accuracy"] == model.accuracy(data.test_x, data.test_y)


def test_json_holds_every_printed_figure(record, capsys):
    with open(record["json"]) as f:
        saved = json.load(f)
    table = straggler.format_table(CFG, saved["summary"])
    assert table == straggler.format_table(CFG, record["summary"])
    assert set(saved["summary"]["rows"]) == set(CFG.variants)
    for run in saved["runs"]:
        assert run["samples_per_s"] == pytest.approx(run["samples"] / run["elapsed"])
    assert saved["summary"]["findings"] == record["summary"]["findings"]
    assert record["plot"].endswith("straggler.png")
