"""DDP over ringcoll, two ways, against DDP over gloo (multi-process, CPU).

One spawn per world size (2 and 3) runs, from the same seed on the same data, a few SGD
steps of the same small MLP four times:

    "ringcoll"     DDP on the default group, init_process_group(backend="ringcoll"):
                   DDP's own all-reduce of each bucket goes through ringcoll.training.backend
    "gloo"         DDP on a gloo group of the same ranks (the reference)
    "hook"         DDP on the gloo group + ringcoll.ddp_hook, state RingcollHookState():
                   the default group's (ringcoll backend's) communicator
    "hook_gloo"    DDP on the gloo group + ringcoll.ddp_hook, state = the gloo group (as
                   torch's allreduce_hook takes it): ringcoll.api's communicator,
                   bootstrapped over a plain gloo group
    "powerSGD"     torch's own PowerSGD hook on the ringcoll backend (its Future callbacks
                   issue all-reduces and wait for them), against "powerSGD_gloo"

Small buckets (several per step) keep bucketing and the async path honest. Every run must
end with the same parameters as "gloo" within float tolerance (summation order differs),
bitwise identical across ranks, and with the ringcoll path provably taken.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

import ringcoll
from ringcoll.harness.launcher import spawn

STEPS = 4
BUCKET_CAP_MB = 0.002  # ~500 floats per bucket: the MLP below makes several buckets
SPAWN_TIMEOUT = 120.0
ENV = {"RINGCOLL_TIMEOUT": "60"}


def _model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 24),
                               torch.nn.Tanh(), torch.nn.Linear(24, 3))


def _power_sgd(process_group):
    """torch's PowerSGD hook and its state: after two plain steps, each bucket's Future chain
    issues two more all-reduces from inside its `then` callbacks and waits for them (which
    deadlocked on ringcoll's worker thread before those calls ran in line)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    state = powerSGD_hook.PowerSGDState(process_group=process_group, matrix_approximation_rank=1,
                                        start_powerSGD_iter=2, min_compression_rate=0.5)
    return powerSGD_hook.powerSGD_hook, state


def _train(rank: int, process_group, hook=None, state=None, bucket_cap_mb=BUCKET_CAP_MB) -> tuple[list, list]:
    model = torch.nn.parallel.DistributedDataParallel(_model(), process_group=process_group,
                                                      bucket_cap_mb=bucket_cap_mb)
    if hook == "powerSGD":
        hook, state = _power_sgd(process_group)
    if hook is not None:
        model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)  # different data on every rank
        x = torch.randn(8, 12, generator=g)
        y = torch.randn(8, 3, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [p.detach().clone() for p in model.module.parameters()], losses


def _rank_fn(rank: int, world_size: int) -> dict:
    from ringcoll.training import backend

    assert isinstance(dist.group.WORLD, backend.RingcollProcessGroup)
    gloo = dist.new_group(backend="gloo")
    results, counts = {}, {}

    before = dict(backend.call_counts)
    results["ringcoll"] = _train(rank, None)
    counts["ringcoll"] = {k: v - before.get(k, 0) for k, v in backend.call_counts.items()}

    results["gloo"] = _train(rank, gloo)

    # ringcoll.ddp_hook itself is registered (DDP checks its annotations), once with a
    # RingcollHookState (which counts the buckets), once with the gloo group as state.
    state = ringcoll.training.ddp.RingcollHookState()
    before = dict(backend.call_counts)
    results["hook"] = _train(rank, gloo, ringcoll.ddp_hook, state)
    counts["hook"] = {k: v - before.get(k, 0) for k, v in backend.call_counts.items()}
    counts["hook_calls"] = state.calls
    counts["hook_shares_backend_communicator"] = state.communicator is dist.group.WORLD.communicator()

    results["hook_gloo"] = _train(rank, gloo, ringcoll.ddp_hook, gloo)
    # torch's PowerSGD hook on the ringcoll backend, against the same on gloo, with one bucket:
    # with several, gloo hangs (the calls its callbacks issue race the next bucket's for
    # gloo's queue, in another order on each rank); ringcoll runs them in line, in the same
    # order on every rank, so "powerSGD_buckets" (several) must train and agree across ranks.
    results["powerSGD"] = _train(rank, None, "powerSGD", bucket_cap_mb=25)
    results["powerSGD_gloo"] = _train(rank, gloo, "powerSGD", bucket_cap_mb=25)
    results["powerSGD_buckets"] = _train(rank, None, "powerSGD")

    # Every rank's parameters, gathered (over gloo) for the cross-rank check in the parent.
    gathered = {}
    for name, (params, _) in results.items():
        flat = torch.cat([p.reshape(-1) for p in params])
        everyone = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(everyone, flat, group=gloo)
        gathered[name] = everyone
    # The "hook_gloo" communicator lives in ringcoll.api's cache: close it before the
    # process group goes away, as a training script should.
    ringcoll.destroy_communicators()
    return {"results": results, "counts": counts, "gathered": gathered}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"world{p}")
def runs(request):
    return spawn(_rank_fn, request.param, timeout=SPAWN_TIMEOUT, backend="ringcoll", env=ENV)


@pytest.mark.parametrize("name,reference", [("ringcoll", "gloo"), ("hook", "gloo"), ("hook_gloo", "gloo"),
                                            ("powerSGD", "powerSGD_gloo")])
def test_same_parameters_as_gloo(runs, name, reference):
    for rank, out in enumerate(runs):
        params, losses = out["results"][name]
        ref_params, ref_losses = out["results"][reference]
        for i, (p, q) in enumerate(zip(params, ref_params)):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {name} param {i}: {m}")
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("name", ["ringcoll", "hook", "hook_gloo", "gloo", "powerSGD", "powerSGD_buckets"])
def test_parameters_identical_across_ranks(runs, name):
    everyone = runs[0]["gathered"][name]
    for r, flat in enumerate(everyone):
        assert torch.equal(flat, everyone[0]), f"{name}: rank {r} parameters differ from rank 0"


def test_training_moves_the_parameters(runs):
    params, _ = runs[0]["results"]["ringcoll"]
    initial = list(_model().parameters())
    assert any(not torch.equal(p, q.detach()) for p, q in zip(params, initial))


def test_ddp_on_the_backend_runs_its_all_reduces_on_ringcoll(runs):
    for out in runs:
        counts = out["counts"]["ringcoll"]
        # one bucket in the first step (DDP buckets by first_bucket_cap_mb until it rebuilds),
        # several later: every one an all-reduce on the ring, none handed to gloo
        assert counts.get("ringcoll:all_reduce", 0) > STEPS, counts
        assert counts.get("gloo:all_reduce", 0) == 0, counts


def test_hook_is_called_per_bucket_and_bypasses_the_backend(runs):
    for out in runs:
        counts = out["counts"]
        assert counts["hook_calls"] > STEPS
        assert counts["hook_shares_backend_communicator"] is True
        # the hook talks to the communicator directly, not through the process group
        assert counts["hook"].get("ringcoll:all_reduce", 0) == 0, counts["hook"]


def test_hook_annotations_are_the_ones_ddp_accepts():
    # DistributedDataParallel._check_comm_hook compares these objects (not strings)
    sig = inspect.signature(ringcoll.ddp_hook)
    assert sig.parameters["bucket"].annotation is dist.GradBucket
    assert sig.return_annotation == torch.futures.Future[torch.Tensor]


def test_hook_state_argument_checked():
    with pytest.raises(TypeError, match="ddp_hook: state"):
        ringcoll.ddp_hook("not a state", None)


@pytest.mark.parametrize("options", [(), ("--hook",)], ids=["backend", "hook"])
def test_example_under_torchrun(options):
    """examples/train_ddp.py as the README runs it: over the ringcoll backend, and with
    ringcoll.ddp_hook on a gloo group (each run also checks that its teardown frees the group)."""
    from example_runner import run_example

    stdout = run_example("train_ddp.py", *options)
    assert ("gloo + ringcoll.ddp_hook" if options else "backend 'ringcoll'") in stdout, stdout
