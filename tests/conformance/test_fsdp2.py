"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on the ringcoll backend, bitwise equal to gloo.

Part of the conformance tier (see ``test_torch_suite.py``). FSDP2 runs on CPU in torch 2.13:
its parameters are DTensors sharded over a CPU DeviceMesh, each forward all-gathers them
(``all_gather_into_tensor``; ``all_gather_single`` in c10d) and each backward reduce-scatters
the gradients (``reduce_scatter_tensor``), the two collectives ringcoll runs on its ring.

One spawn per world size: the default group is ringcoll, and a ``dist.new_group(backend=
"gloo")`` beside it is the reference. The same model is trained twice on every rank, once
sharded over a DeviceMesh of each group, from the same start on the same data, and every
parameter (gathered with ``full_tensor()``) must be bitwise equal.

Two set-ups:

* ``exact``: float64; weights and inputs small integers; loss ``sum()``; lr 2**-6 and,
  after each step, the weights rounded to multiples of 2**-6 in [-8, 8]; FSDP's gradient
  divide factor 1 (so its reduce-scatter is a plain SUM). Then every gradient is a multiple
  of 2**-12 below 2**14 in magnitude (each layer adds the 6 fraction bits of its weights),
  so adding the ranks' gradients is exact in any order: equality does not depend on
  ringcoll adding in gloo's order, and a wrong chunk, a missed rank or a stale buffer
  changes the result. (Without the rounding the fraction bits grow every step, and a
  squared loss grows the magnitudes: at world 3 either made some sums inexact within 3
  steps, checked with ``fractions.Fraction`` over every summation order.)
* ``default``: float32, random data, FSDP's defaults (its reduce-scatter is ReduceOp.AVG),
  at world 2, where a + b == b + a exactly, so the results must again agree bit for bit.

By hand: ``pytest -q tests/conformance/test_fsdp2.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ringcoll.harness.launcher import spawn

SPAWN_TIMEOUT = 150.0
ENV = {"RINGCOLL_TIMEOUT": "60"}


def _model(dtype, exact: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 6),
                                torch.nn.ReLU(), torch.nn.Linear(6, 3)).to(dtype)
    if exact:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randint(-2, 3, p.shape, dtype=dtype))
    return model


def _train(mesh, dtype, exact: bool, rank: int, steps: int = 3) -> list:
    """Train an FSDP2-sharded copy of _model over ``mesh``; its full parameters afterwards."""
    from torch.distributed.fsdp import fully_shard

    model = _model(dtype, exact)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if exact:
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(1.0)  # reduce-scatter with SUM, no division
    opt = torch.optim.SGD(model.parameters(), lr=2.0 ** -6 if exact else 0.05)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    for _ in range(steps):
        if exact:
            x = torch.randint(-2, 3, (4, 8), generator=generator).to(dtype)
        else:
            x = torch.randn(4, 8, generator=generator, dtype=dtype)
        (model(x).sum() if exact else model(x).square().sum()).backward()
        opt.step()
        opt.zero_grad()
        if exact:
            with torch.no_grad():  # back onto the 2**-6 grid (pointwise, on each rank's shard)
                for p in model.parameters():
                    p.copy_((p * 64).round().clamp(-512, 512) / 64)
    return [p.full_tensor().clone() for p in model.parameters()]


def _fsdp_rank(rank: int, ws: int, setups: list) -> dict:
    from torch.distributed.device_mesh import DeviceMesh

    from ringcoll.training import backend

    gloo = dist.new_group(backend="gloo")
    meshes = {"gloo": DeviceMesh.from_group(gloo, "cpu"),
              "ringcoll": DeviceMesh.from_group(dist.group.WORLD, "cpu")}
    out = {"default_group": type(dist.group.WORLD).__name__}
    for name, dtype, exact in setups:
        params = {}
        for which, mesh in meshes.items():
            before = dict(backend.call_counts)
            params[which] = _train(mesh, getattr(torch, dtype), exact, rank)
            out[f"{name}/{which}/counts"] = {k: v - before.get(k, 0) for k, v in backend.call_counts.items()
                                             if v != before.get(k, 0)}
        out[name] = params
    return out


SETUPS = {2: [("exact", "float64", True), ("default", "float32", False)], 3: [("exact", "float64", True)]}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"world{ws}")
def fsdp_run(request):
    ws = request.param
    return ws, spawn(_fsdp_rank, ws, SETUPS[ws], backend="ringcoll", timeout=SPAWN_TIMEOUT, env=ENV)


def test_fsdp2_parameters_bitwise_equal_to_gloo(fsdp_run):
    ws, ranks = fsdp_run
    for name, dtype, exact in SETUPS[ws]:
        start = list(_model(getattr(torch, dtype), exact).parameters())
        for rank, seen in enumerate(ranks):
            gloo, ours = seen[name]["gloo"], seen[name]["ringcoll"]
            assert len(gloo) == len(ours) == len(start) == 6
            for i, (g, r) in enumerate(zip(gloo, ours)):
                assert torch.equal(g, r), f"{name}, rank {rank}, parameter {i}: max diff {(g - r).abs().max()}"
                assert torch.equal(r, ranks[0][name]["ringcoll"][i]), f"{name}: ranks 0 and {rank} differ"
        # the steps did change the parameters (a run that did nothing would be "equal" too)
        assert not any(torch.equal(p, q) for p, q in zip(start, ranks[0][name]["ringcoll"]))


def test_fsdp2_collectives_ran_on_the_ring(fsdp_run):
    ws, ranks = fsdp_run
    assert ranks[0]["default_group"] == "RingcollProcessGroup"
    for name, _, _ in SETUPS[ws]:
        ours, reference = ranks[0][f"{name}/ringcoll/counts"], ranks[0][f"{name}/gloo/counts"]
        assert ours.get("ringcoll:all_gather_into_tensor", 0) > 0, ours
        assert ours.get("ringcoll:reduce_scatter_tensor", 0) > 0, ours
        assert not any(k.startswith("ringcoll:") for k in reference), reference  # gloo's mesh: never the ring
