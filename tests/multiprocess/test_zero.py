"""ZeRO stages 1 and 2 (ringcoll.training.zero.ShardedOptimizer) against the plain optimizer.

Reference: on every rank, a copy of the same model trained with the plain torch optimizer
on gradients averaged over ranks with gloo (``dist.all_reduce`` SUM, then / P), which is
what DDP computes. Each rank sees different data; every step accumulates two
micro-batches (so stage 2's shard gradients accumulate across backward passes), and a
StepLR scheduler halves the learning rate on the way (so ``param_groups`` must be the live
groups). The model has a float32 part with awkward sizes and a float64 parameter, and
``bucket_bytes`` is small, so there are several buckets per dtype, shards straddle
parameters and every bucket is padded.

One ``spawn`` per world size (P = 2 and 3) runs every (stage, optimizer) case and returns
measurements; the tests below only assert on them, so the file costs two process launches.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist

from ringcoll.harness.launcher import spawn

STEPS = 4
MICRO_BATCHES = 2
BUCKET_BYTES = 400  # buckets: [fc2.bias, fc2.weight, fc1.bias], [fc1.weight], [scale]
ATOL = 1e-6
SPAWN_TIMEOUT = 150.0
ENV = {"RINGCOLL_TIMEOUT": "60", "RINGCOLL_BUFFER_BYTES": None, "OMP_NUM_THREADS": "1"}

OPTIMIZERS = {
    "Adam": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 1e-3}),
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "SGD": (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9, "weight_decay": 1e-3}),
}
# optimizer.state keys per element (the rest are per-tensor scalars such as Adam's step)
ELEMENTWISE_KEYS = {"Adam": ("exp_avg", "exp_avg_sq"), "AdamW": ("exp_avg", "exp_avg_sq"),
                    "SGD": ("momentum_buffer",)}
CASES = [(stage, name) for stage in (1, 2) for name in OPTIMIZERS]


class Net(torch.nn.Module):
    """Linear(7, 13) -> tanh -> Linear(13, 5), times a float64 scale: 91 + 13 + 65 + 5
    float32 elements and 5 float64 ones, none a multiple of 2 or 3 in total."""

    def __init__(self, dtype=torch.float32, unused=False):
        super().__init__()
        self.fc1 = torch.nn.Linear(7, 13, dtype=dtype)
        self.fc2 = torch.nn.Linear(13, 5, dtype=dtype)
        self.scale = torch.nn.Parameter(1 + 0.1 * torch.randn(5, dtype=torch.float64))
        if unused:
            self.unused = torch.nn.Parameter(torch.randn(3, dtype=dtype))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale.to(x.dtype)


def _batch(rank, step, micro, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(8, 7, generator=g).to(dtype), torch.randn(8, 5, generator=g).to(dtype)


def _loss(model, rank, step, micro):
    x, y = _batch(rank, step, micro, model.fc1.weight.dtype)
    return torch.nn.functional.mse_loss(model(x).float(), y.float())


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _state_bytes(optimizer, keys=None):
    return sum(v.numel() * v.element_size() for st in optimizer.state.values() for k, v in st.items()
               if torch.is_tensor(v) and (keys is None or k in keys))


def _digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def _max_diff(a, b):
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def _run_case(rank, world, stage, name, clip=None):
    """Train the sharded and the reference model side by side; return measurements."""
    import ringcoll.training.zero

    cls, kwargs = OPTIMIZERS[name]
    torch.manual_seed(0)
    ref = Net()
    model = Net()
    model.load_state_dict(ref.state_dict())
    ref_opt = cls(ref.parameters(), **kwargs)
    opt = ringcoll.training.zero.ShardedOptimizer(model.parameters(), cls, stage=stage, bucket_bytes=BUCKET_BYTES, **kwargs)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    out = {"grads_after_backward": [], "norms": []}
    for step in range(STEPS):
        for micro in range(MICRO_BATCHES):
            _loss(ref, rank, step, micro).backward()
            _loss(model, rank, step, micro).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        out["grads_after_backward"].append(_bytes(p.grad for p in model.parameters()))
        if step == STEPS - 1:  # what the reduced gradients take, held until step() consumes them
            opt.reduce_gradients()
            out["shard_grad_bytes_reduced"] = _bytes(b.master.grad for b in opt.buckets)
        if clip is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            norm = opt.clip_grad_norm_(clip)
            out["norms"].append((float(ref_norm), float(norm)))
        ref_opt.step()
        opt.step()
        ref_sched.step()
        sched.step()
        if step < STEPS - 1:
            ref_opt.zero_grad()
            opt.zero_grad()

    # After the last step, before zero_grad: what each rank holds.
    buckets = opt.buckets
    keys = ELEMENTWISE_KEYS[name]
    out.update(
        max_diff=_max_diff(model, ref),
        digest=_digest(model),
        lr=(opt.param_groups[0]["lr"], ref_opt.param_groups[0]["lr"]),
        numels=[b.numel for b in buckets],
        dtypes=[str(b.dtype) for b in buckets],
        elsize=[b.master.element_size() for b in buckets],
        param_numel=sum(p.numel() for p in model.parameters()),
        param_bytes=_bytes(model.parameters()),
        state_bytes=opt.optimizer_state_bytes(),
        state_bytes_counted=_state_bytes(opt.optimizer),
        elementwise_state_bytes=_state_bytes(opt.optimizer, keys),
        ref_state_bytes=_state_bytes(ref_opt),
        ref_elementwise_state_bytes=_state_bytes(ref_opt, keys),
        param_grad_bytes=_bytes(p.grad for p in model.parameters()),
        shard_grad_bytes=_bytes(b.master.grad for b in buckets),
        report=opt.memory_report(),
    )
    # Checkpoints: the unsharded view matches the reference optimizer's state...
    full = opt.full_state_dict()
    ref_sd = ref_opt.state_dict()
    out["full_state_diff"] = max(
        float((full["state"][i][k] - v).abs().max()) if torch.is_tensor(v) and v.dim() else
        (0.0 if float(full["state"][i][k]) == float(v) else float("inf"))
        for i, st in ref_sd["state"].items() for k, v in st.items())
    out["full_state_groups_equal"] = (
        [g["params"] for g in full["param_groups"]] == [g["params"] for g in ref_sd["param_groups"]]
        and full["param_groups"][0]["lr"] == ref_sd["param_groups"][0]["lr"])
    # ... and the local shard state round-trips through state_dict / load_state_dict.
    local = opt.state_dict()
    opt.zero_grad()
    ref_opt.zero_grad()
    return out, local, ref_sd


def _resume_from_plain(rank, world, stage, name, ref_sd, local_sd):
    """A fresh ShardedOptimizer loads the plain optimizer's state (load_full_state_dict)
    and trains on in step with the reference; another loads the local shard state."""
    import ringcoll.training.zero

    cls, kwargs = OPTIMIZERS[name]
    torch.manual_seed(1)
    ref = Net()
    model = Net()
    model.load_state_dict(ref.state_dict())
    ref_opt = cls(ref.parameters(), **kwargs)
    ref_opt.load_state_dict(ref_sd)
    opt = ringcoll.training.zero.ShardedOptimizer(model.parameters(), cls, stage=stage, bucket_bytes=BUCKET_BYTES, **kwargs)
    opt.load_full_state_dict(ref_sd)
    for step in range(2):
        _loss(ref, rank, step, 0).backward()
        _loss(model, rank, step, 0).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    resumed = _max_diff(model, ref)

    other = ringcoll.training.zero.ShardedOptimizer(Net().parameters(), cls, stage=stage, bucket_bytes=BUCKET_BYTES, **kwargs)
    other.load_state_dict(local_sd)
    reloaded = other.state_dict()
    got = reloaded["optimizer"]["state"]
    same = all(torch.equal(got[i][k], v) if torch.is_tensor(v) else got[i][k] == v
               for i, st in local_sd["optimizer"]["state"].items() for k, v in st.items())
    return resumed, same


def _extras(rank, world):
    """bfloat16 with fp32 master shards, an unused parameter (bucket completed at step),
    clip_grad_norm_ against the reference, and refused arguments."""
    import ringcoll.training.zero

    out = {}
    torch.manual_seed(0)
    model = Net(dtype=torch.bfloat16, unused=True)
    unused_before = model.unused.detach().clone()
    opt = ringcoll.training.zero.ShardedOptimizer(model.parameters(), torch.optim.Adam, stage=2, bucket_bytes=BUCKET_BYTES,
                                         lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = _loss(model, rank, 0, 0)  # the same batch: the loss must fall
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    out["bf16_losses"] = losses
    with torch.no_grad():  # weights changed outside step(): sync_masters picks them up
        model.fc2.bias.fill_(0.5)
    opt.sync_masters()
    _loss(model, rank, 0, 0).backward()
    opt.step()
    opt.zero_grad()
    out["bf16_bias_after_sync"] = model.fc2.bias.detach().float().tolist()
    out["bf16_digest"] = _digest(model)
    out["bf16_master_dtypes"] = sorted({str(b.master.dtype) for b in opt.buckets})
    # no gradient counts as zero: Adam without weight decay leaves it where it was
    out["bf16_unused_unchanged"] = torch.equal(model.unused.detach(), unused_before)

    # Stage 2 consumes its gradients at step(): model.zero_grad() then trains as opt.zero_grad()
    # does (the shard gradients piled up across steps: 0.07 off after 5 steps); and a bucket no
    # gradient reached (the unused parameter, a group of its own) gets zeros, as in stage 1, so
    # AdamW's decay moves it as the plain optimizer moves it on a zero gradient (it was skipped).
    clears = {}
    for clear in ("opt", "model"):
        torch.manual_seed(0)
        net = Net(unused=True)
        used = [p for name, p in net.named_parameters() if name != "unused"]
        opt2 = ringcoll.training.zero.ShardedOptimizer([{"params": used}, {"params": [net.unused]}],
                                                       torch.optim.AdamW, stage=2, bucket_bytes=BUCKET_BYTES,
                                                       lr=1e-2, weight_decay=0.1)
        alone = net.unused.detach().clone().requires_grad_()
        plain = torch.optim.AdamW([alone], lr=1e-2, weight_decay=0.1)
        for step in range(3):
            _loss(net, rank, step, 0).backward()
            opt2.step()
            (opt2 if clear == "opt" else net).zero_grad()
            alone.grad = torch.zeros_like(alone)
            plain.step()
        clears[clear] = (_digest(net), torch.equal(net.unused.detach(), alone.detach()))
        opt2.remove_hooks()
    out["stage2_clears"] = clears

    # ringcoll.learning.memory's ledger for an all-fp32 model with Adam, term by term
    for stage in (1, 2):
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 31))
        opt = ringcoll.training.zero.ShardedOptimizer(mlp.parameters(), torch.optim.Adam, stage=stage,
                                             bucket_bytes=4096, lr=1e-3)
        mlp(torch.randn(4, 32)).square().mean().backward()
        opt.step()  # Adam's state exists from here
        mlp(torch.randn(4, 32)).square().mean().backward()
        if stage == 2:  # the shard gradients, held until step() consumes them
            opt.reduce_gradients()
        out[f"ledger{stage}"] = (opt.memory_report(), len(opt.buckets))

    # stage 2 keeps at most max_buckets_in_flight + 1 (filling) full-size buckets alive
    torch.manual_seed(0)
    deep = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(8)])
    opt = ringcoll.training.zero.ShardedOptimizer(deep.parameters(), torch.optim.Adam, stage=2, bucket_bytes=1088, lr=1e-3)
    deep(torch.randn(4, 16)).square().sum().backward()
    out["in_flight"] = (opt.peak_flat_grad_bytes, [b.padded * 4 for b in opt.buckets], opt.max_buckets_in_flight)
    opt.step()
    out["clip"] = {stage: _run_case(rank, world, stage, "Adam", clip=0.05)[0] for stage in (1, 2)}

    # prefetch_params: the all-gathers left running after step(), waited for by each layer's
    # forward pre-hook: bitwise the same training as waiting inside step()
    for stage in (1, 2):
        digests, deferred = [], []
        for prefetch in (False, True):
            torch.manual_seed(0)
            deep = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])
            opt = ringcoll.training.zero.ShardedOptimizer(deep.parameters(), torch.optim.Adam, stage=stage,
                                                          bucket_bytes=1088, lr=1e-2)
            if prefetch:
                opt.prefetch_params(deep)
            for step in range(3):
                x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
                deep(x).square().sum().backward()
                opt.step()
                opt.zero_grad()
                deferred.append(sum(b.gathering is not None for b in opt.buckets))
            deep(x)  # the last step's weights reach the model through the hooks
            deferred.append(sum(b.gathering is not None for b in opt.buckets))
            digests.append(_digest(deep))
        out[f"prefetch{stage}"] = (digests, deferred, len(opt.buckets))
    try:
        opt.prefetch_params(deep[0])  # owns 2 of the 12 parameters
    except ValueError as exc:
        out["prefetch_refused"] = str(exc)

    errors = []
    for kwargs in ({"stage": 3}, {"stage": 1, "bucket_bytes": 0}, {"stage": 1 + rank}):
        try:
            ringcoll.training.zero.ShardedOptimizer(Net(unused=rank == 1).parameters(), torch.optim.SGD, lr=0.1, **kwargs)
        except ValueError as exc:
            errors.append(str(exc))
    try:  # a different model on one rank: refused on every rank, before any data moves
        ringcoll.training.zero.ShardedOptimizer(Net(unused=rank == 1).parameters(), torch.optim.SGD, lr=0.1)
    except ValueError as exc:
        errors.append(str(exc))
    frozen = Net()
    for p in frozen.parameters():
        p.requires_grad_(False)
    for model, cls in ((Net(), torch.optim.LBFGS), (frozen, torch.optim.SGD)):  # refused on each rank alone
        try:
            ringcoll.training.zero.ShardedOptimizer(model.parameters(), cls, lr=0.1)
        except ValueError as exc:
            errors.append(str(exc))
    out["errors"] = errors

    # symmetric=True (last: its arenas make auto native on the default communicator from here
    # on, so both runs below take the same algorithms): the same bits as ordinary buckets,
    # with the reduce-scatters and all-gathers of buckets over the one-shot size read in place.
    comm = ringcoll.get_communicator()
    for stage in (1, 2):
        runs = []
        for symmetric in (True, False):
            torch.manual_seed(0)
            wide = torch.nn.Sequential(torch.nn.Linear(96, 200), torch.nn.Tanh(), torch.nn.Linear(200, 96))
            before = comm.transport.zero_copy_calls
            opt = ringcoll.training.zero.ShardedOptimizer(wide.parameters(), torch.optim.Adam, stage=stage,
                                                          bucket_bytes=1 << 17, lr=1e-2, symmetric=symmetric)
            for step in range(3):
                x = torch.randn(16, 96, generator=torch.Generator().manual_seed(100 * rank + step))
                wide(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            runs.append((_digest(wide), comm.transport.zero_copy_calls - before,
                         [comm.is_symmetric(b.flat) for b in opt.buckets]))
        out[f"symmetric{stage}"] = runs
    return out


def _rank_main(rank, world, extras):
    torch.set_num_threads(1)
    results = {}
    for stage, name in CASES:
        out, local, ref_sd = _run_case(rank, world, stage, name)
        if name == "Adam" or stage == 2:
            out["resumed_diff"], out["local_roundtrip"] = _resume_from_plain(rank, world, stage, name, ref_sd, local)
        results[(stage, name)] = out
    if extras:
        results["extras"] = _extras(rank, world)
    # Close the cached communicators (and their async worker threads) before returning:
    # spawn's child joins non-daemon threads before atexit runs destroy_communicators, so
    # a communicator left open after async_op=True keeps the rank from exiting.
    import ringcoll

    ringcoll.destroy_communicators()
    return results


_RESULTS: dict = {}


def _results(world):
    """One spawn per world size for the whole file; a failed spawn fails every test that
    needs it with the same error, without launching again."""
    if world not in _RESULTS:
        try:
            _RESULTS[world] = spawn(_rank_main, world, world == 2, timeout=SPAWN_TIMEOUT, env=ENV)
        except Exception as exc:  # noqa: BLE001 - re-raised below, for each test
            _RESULTS[world] = exc
    result = _RESULTS[world]
    if isinstance(result, Exception):
        raise result
    return result


WORLDS = [2, 3]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage,name", CASES)
def test_matches_plain_optimizer(world, stage, name):
    per_rank = [r[(stage, name)] for r in _results(world)]
    for rank, out in enumerate(per_rank):
        assert out["max_diff"] <= ATOL, f"rank {rank}: parameters differ from the plain optimizer by {out['max_diff']}"
        assert out["lr"][0] == out["lr"][1] == OPTIMIZERS[name][1]["lr"] * 0.25  # StepLR ran through param_groups
    assert len({out["digest"] for out in per_rank}) == 1, "ranks' parameters are not bitwise identical"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage,name", CASES)
def test_optimizer_state_is_one_pth(world, stage, name):
    for out in (r[(stage, name)] for r in _results(world)):
        shard = [-(-n // world) for n in out["numels"]]  # ceil(n / P) per bucket
        assert sum(out["numels"]) == out["param_numel"]
        keys = len(ELEMENTWISE_KEYS[name])
        expected = sum(keys * s * e for s, e in zip(shard, out["elsize"]))
        assert out["elementwise_state_bytes"] == expected
        # 1/P of the unsharded state, up to the padding: < 1 element per bucket per key
        padding = sum(keys * (s * world - n) * e for s, n, e in zip(shard, out["numels"], out["elsize"]))
        assert out["elementwise_state_bytes"] * world == out["ref_elementwise_state_bytes"] + padding
        scalars = 4 * len(shard) if name != "SGD" else 0  # one float32 step per bucket
        assert out["state_bytes"] == out["state_bytes_counted"] == expected + scalars


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2])
def test_gradient_memory(world, stage):
    for out in (r[(stage, "Adam")] for r in _results(world)):
        shard_grads = sum(-(-n // world) * e for n, e in zip(out["numels"], out["elsize"]))
        if stage == 1:  # full gradients stay until zero_grad; the shards live only inside step()
            assert out["grads_after_backward"] == [out["param_bytes"]] * STEPS
            assert out["param_grad_bytes"] == out["param_bytes"]
            assert out["shard_grad_bytes"] == 0
        else:  # no full-size gradient survives backward or step: 1/P is all there is, until step()
            assert out["shard_grad_bytes_reduced"] == shard_grads and out["shard_grad_bytes"] == 0
            assert out["grads_after_backward"] == [0] * STEPS
            assert out["param_grad_bytes"] == 0
            assert out["report"]["flat_grad_buckets"] == 0
            assert shard_grads * world < out["param_bytes"] + world * 8 * len(out["numels"])
            assert 0 < out["report"]["peak_flat_grad_buckets"] <= out["param_bytes"] + world * 8 * len(out["numels"])


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage,name", [c for c in CASES if c[1] == "Adam" or c[0] == 2])
def test_checkpoints(world, stage, name):
    for rank, out in enumerate(r[(stage, name)] for r in _results(world)):
        assert out["full_state_diff"] <= ATOL, f"rank {rank}: full_state_dict differs by {out['full_state_diff']}"
        assert out["full_state_groups_equal"]
        assert out["resumed_diff"] <= ATOL, f"rank {rank}: resumed training differs by {out['resumed_diff']}"
        assert out["local_roundtrip"]


def test_bfloat16_master_weights_and_unused_parameter():
    per_rank = [r["extras"] for r in _results(2)]
    assert len({out["bf16_digest"] for out in per_rank}) == 1
    for out in per_rank:
        assert out["bf16_master_dtypes"] == ["torch.float32", "torch.float64"]
        assert out["bf16_losses"][-1] < out["bf16_losses"][0]
        assert out["bf16_unused_unchanged"]
        clears = out["stage2_clears"]
        assert clears["model"][0] == clears["opt"][0], "model.zero_grad() trained otherwise than opt.zero_grad()"
        assert clears["opt"][1] and clears["model"][1], "a bucket no gradient reached did not decay as a zero gradient"
        assert all(abs(v - 0.5) < 0.05 for v in out["bf16_bias_after_sync"])  # one Adam step from 0.5 (lr 1e-2)


@pytest.mark.parametrize("stage", [1, 2])
def test_memory_ledger(stage):
    """All-fp32 model with Adam: measured bytes = ringcoll.learning.memory.ledger(N, P, stage, "fp32")
    term by term, up to the padding (< 1 element per bucket) and Adam's step counters."""
    for out in (r["extras"] for r in _results(2)):
        report, buckets = out[f"ledger{stage}"]
        slack = 4 * buckets  # one fp32 element per bucket
        assert report["weights"] - report["predicted_weights"] < slack and report["master_weights"] == 0
        moments = report["optimizer_state"] - 4 * buckets  # less the step counters
        assert 0 <= moments - report["predicted_optimizer_state"] < 2 * slack
        grads = report["param_grads"] + report["shard_grads"]
        if stage == 1:  # full gradients
            assert report["param_grads"] == report["predicted_gradients"] and report["shard_grads"] == 0
        else:
            assert 0 <= grads - report["predicted_gradients"] < slack


def test_stage2_bounds_buckets_in_flight():
    for out in (r["extras"] for r in _results(2)):
        peak, bucket_bytes, limit = out["in_flight"]
        assert bucket_bytes == [1088] * 8  # one Linear(16, 16) per bucket
        assert 0 < peak <= (limit + 1) * 1088 < sum(bucket_bytes)


@pytest.mark.parametrize("stage", [1, 2])
def test_clip_grad_norm(stage):
    for out in (r["extras"]["clip"][stage] for r in _results(2)):
        assert out["max_diff"] <= ATOL
        for ref_norm, norm in out["norms"]:
            assert norm == pytest.approx(ref_norm, rel=1e-5)
        assert any(ref_norm > 0.05 for ref_norm, _ in out["norms"])  # clipping did something


def test_refuses_bad_arguments_and_disagreeing_ranks():
    for rank, out in enumerate(r["extras"] for r in _results(2)):
        errors = out["errors"]
        assert len(errors) == 6, errors
        assert errors[0].startswith("ShardedOptimizer: stage must be 1 or 2")
        assert errors[1].startswith("ShardedOptimizer: bucket_bytes must be positive")
        assert errors[2].startswith("ShardedOptimizer: ranks disagree on stage: ")
        assert errors[3].startswith("ShardedOptimizer: ranks disagree on parameters: ")
        assert f"rank {rank} has" in errors[3] and f"rank {1 - rank} has" in errors[3]
        assert errors[4].startswith("ShardedOptimizer: LBFGS re-evaluates the loss"), errors[4]  # it was accepted
        assert errors[5].startswith("ShardedOptimizer: none of the "), errors[5]  # was "an empty parameter list"
        assert errors[5].endswith("parameters requires grad (all frozen): nothing to optimise"), errors[5]


def test_example_under_torchrun():
    """examples/train_zero.py as the README runs it."""
    from example_runner import run_example

    stdout = run_example("train_zero.py")
    assert stdout.count("ratio 1/2.00") == 2, stdout  # both ranks hold half of Adam's state


@pytest.mark.parametrize("stage", [1, 2])
def test_prefetch_params_defers_the_gathers_and_changes_nothing(stage):
    for r in _results(2):
        digests, deferred, buckets = r["extras"][f"prefetch{stage}"]
        assert digests[0] == digests[1], "prefetching changed the training"
        assert buckets > 2
        assert deferred[:4] == [0, 0, 0, 0]  # without: every all-gather waited for in step()
        assert deferred[4:7] == [buckets] * 3  # with: all still to be waited for after step()
        assert deferred[7] == 0  # ... and the forward waited for every one
    assert len({r["extras"][f"prefetch{stage}"][0][0] for r in _results(2)}) == 1
    assert "belong to no submodule" in _results(2)[0]["extras"]["prefetch_refused"]


@pytest.mark.parametrize("stage", [1, 2])
def test_symmetric_buckets_read_in_place_and_change_nothing(stage):
    for r in _results(2):
        (digest, zero_copy, flats), (plain_digest, plain_zero_copy, plain_flats) = r["extras"][f"symmetric{stage}"]
        assert digest == plain_digest, "symmetric memory changed the training"
        assert flats == [True, True] and plain_flats == [False, False]
        # 3 steps x 2 buckets x (reduce-scatter + all-gather), and ordinary buckets none
        assert zero_copy == 12 and plain_zero_copy == 0, (zero_copy, plain_zero_copy)
    assert len({r["extras"][f"symmetric{stage}"][0][0] for r in _results(2)}) == 1
