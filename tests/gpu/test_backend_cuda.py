"""init_process_group("ringcoll") with CUDA tensors, on a real GPU: the backend routes them to
the CUDA ring of their device; DDP, the DDP hook and ZeRO run on it unmodified. P ranks
share one GPU (CUDA IPC), so NCCL (which refuses several ranks on one GPU before 2.30) is
not the reference: the inputs are chosen so that the exact result is known.

The exact training step: a bias-free Linear layer starting at zero, loss = sum(model(x) * y)
with small integers x, y, so each rank's gradient is the integer matrix y^T x; the average
over ranks is a multiple of 1/P, exact in float32, and one SGD step with lr = 1 leaves
weight = -mean over ranks of y_r^T x_r, bit for bit. The CPU routing decisions are tested
without a GPU in tests/pure/test_backend_routing.py.
"""

import pytest
import torch

from ringcoll import _C
from gpu_spawn import spawn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not getattr(_C, "built_with_cuda", False), reason="built without the CUDA backend"),
]

# Several ranks on one GPU: NCCL (before 2.30) refuses that, so the fall-back for CUDA
# tensors is gloo here.
ENV = {"RINGCOLL_CUDA_FALLBACK": "gloo", "RINGCOLL_TIMEOUT": "60"}
IN_FEATURES, OUT_FEATURES, BATCH = 8, 4, 3


def _batch(rank):
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(-3, 4, (BATCH, IN_FEATURES), generator=g).float()
    y = torch.randint(-3, 4, (BATCH, OUT_FEATURES), generator=g).float()
    return x, y


def _expected_weight(world):
    grads = [(lambda x, y: y.t() @ x)(*_batch(r)) for r in range(world)]
    return -(torch.stack(grads).double().sum(0) / world).float()


def _one_step(model, opt, rank, device):
    x, y = (t.to(device) for t in _batch(rank))
    (model(x) * y).sum().backward()
    opt.step()


def _zero_model(device):
    model = torch.nn.Linear(IN_FEATURES, OUT_FEATURES, bias=False).to(device)
    with torch.no_grad():
        model.weight.zero_()
    return model


def _collectives_on_cuda(rank, world):
    import torch.distributed as dist

    from ringcoll.training import backend

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    # Built first: building it exchanges IPC handles through the group (an all_gather and a
    # barrier, forwarded to gloo), which are not the calls counted below.
    comm = dist.group.WORLD.communicator(dev)
    before = dict(backend.call_counts)
    failures = []
    def run(call, async_op):
        work = call(async_op)
        if work is not None:
            work.wait()  # makes the current stream wait for the ring; .cpu() below syncs on it

    for async_op in (False, True):
        t = torch.full((1000,), float(rank + 1), device=dev)
        run(lambda a: dist.all_reduce(t, async_op=a), async_op)
        if not torch.equal(t.cpu(), torch.full((1000,), float(world * (world + 1) // 2))):
            failures.append(f"all_reduce async={async_op}")
        full = torch.arange(world * 5, dtype=torch.int32, device=dev) + rank
        out = torch.empty(5, dtype=torch.int32, device=dev)
        run(lambda a: dist.reduce_scatter_tensor(out, full, async_op=a), async_op)
        want = (torch.arange(world * 5, dtype=torch.int64) * world + sum(range(world))).view(world, 5)[rank]
        if not torch.equal(out.cpu().long(), want):
            failures.append(f"reduce_scatter_tensor async={async_op}")
        gathered = torch.empty(world * 3, dtype=torch.bfloat16, device=dev)
        mine = torch.full((3,), float(rank), dtype=torch.bfloat16, device=dev)
        run(lambda a: dist.all_gather_into_tensor(gathered, mine, async_op=a), async_op)
        if not torch.equal(gathered.cpu(), torch.arange(world).repeat_interleave(3).to(torch.bfloat16)):
            failures.append(f"all_gather_into_tensor async={async_op}")
    b = torch.full((4,), float(rank), device=dev)
    dist.broadcast(b, src=world - 1)  # forwarded: gloo takes CUDA tensors for broadcast
    if not torch.equal(b.cpu(), torch.full((4,), float(world - 1))):
        failures.append("broadcast")
    delta = {k: v - before.get(k, 0) for k, v in backend.call_counts.items() if v != before.get(k, 0)}
    return failures, delta, type(comm.transport).__name__


def test_collectives_on_cuda_tensors_run_on_the_cuda_ring():
    for failures, delta, transport in spawn(_collectives_on_cuda, 2, backend="ringcoll", env=ENV, timeout=240):
        assert failures == []
        assert transport == "CudaTransport"
        assert delta == {"ringcoll:all_reduce": 2, "ringcoll:reduce_scatter_tensor": 2,
                         "ringcoll:all_gather_into_tensor": 2, "gloo:broadcast": 1}, delta


def _train_one_step(rank, world, how):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ringcoll
    from ringcoll.training import backend
    from ringcoll.training.zero import ShardedOptimizer

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    before = sum(v for k, v in backend.call_counts.items() if k.startswith("ringcoll:"))
    model = _zero_model(dev)
    if how == "zero":
        opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=1.0)
        _one_step(model, opt, rank, dev)
        weight = model.weight
    else:
        ddp = DDP(model, device_ids=[0])
        if how == "hook":
            ddp.register_comm_hook(ringcoll.training.ddp.RingcollHookState(device="cuda"), ringcoll.ddp_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
        _one_step(ddp, opt, rank, dev)
        weight = ddp.module.weight
    on_ring = sum(v for k, v in backend.call_counts.items() if k.startswith("ringcoll:")) - before
    return torch.equal(weight.detach().cpu(), _expected_weight(world)), on_ring, dist.get_backend()


@pytest.mark.parametrize("how, backend", [("ddp", "ringcoll"), ("zero", "ringcoll"), ("hook", "gloo")])
def test_training_on_cuda_is_exact(how, backend):
    for exact, on_ring, used in spawn(_train_one_step, 2, how, backend=backend, env=ENV, timeout=240):
        assert used == backend
        assert exact, f"{how}: the weight after one step is not -mean(y^T x)"
        if backend == "ringcoll":
            assert on_ring >= 1  # the gradients went round the CUDA ring


def _zero_symmetric_on_cuda(rank, world):
    """ZeRO stages 1 and 2 with symmetric=True (buckets in CUDA symmetric memory, read in place
    by auto's direct plans) and without: the same weights, bit for bit, after three Adam steps."""
    import ringcoll
    from ringcoll.training.zero import ShardedOptimizer

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    out = []
    for stage in (1, 2):
        weights = []
        for symmetric in (False, True):  # symmetric last: its arenas change auto from here on
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(96, 200), torch.nn.Tanh(), torch.nn.Linear(200, 96)).to(dev)
            opt = ShardedOptimizer(net.parameters(), torch.optim.Adam, stage=stage, bucket_bytes=1 << 17, lr=1e-2,
                                   symmetric=symmetric)
            for step in range(3):
                x = torch.randn(16, 96, generator=torch.Generator().manual_seed(100 * rank + step)).to(dev)
                net(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            comm = ringcoll.get_communicator(device=dev)
            weights.append(([p.detach().cpu() for p in net.parameters()], all(comm.is_symmetric(b.flat)
                                                                              for b in opt.buckets) == symmetric))
        (plain, plain_ok), (sym, sym_ok) = weights
        out.append(plain_ok and sym_ok and all(torch.equal(a, b) for a, b in zip(plain, sym)))
    return out


def test_zero_with_symmetric_buckets_on_cuda_is_bitwise_the_same():
    assert spawn(_zero_symmetric_on_cuda, 2, backend="ringcoll", env=ENV, timeout=240) == [[True, True]] * 2


@pytest.mark.parametrize("script", ["train_ddp.py", "train_zero.py"])
def test_training_examples_run_on_cuda(script):
    """examples/<script> --device cuda, unmodified otherwise: 2 ranks on the GPU(s)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, **ENV}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           os.path.join(root, "examples", script), "--device", "cuda", "--epochs", "1"],
                          capture_output=True, text=True, timeout=240, env=env, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "parameters identical on all 2 ranks: True" in proc.stdout, proc.stdout


def _hierarchical_on_cuda(rank, world):
    from ringcoll.training.hierarchical import HierarchicalCommunicator

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    with HierarchicalCommunicator(node_id=rank // 2, device=dev, timeout=60) as h:  # NCCL between "nodes"
        t = torch.full((1001,), float(rank + 1), device=dev)
        h.all_reduce(t)
        out = torch.empty(7, dtype=torch.int32, device=dev)
        h.reduce_scatter_tensor(out, torch.arange(7 * world, dtype=torch.int32, device=dev) + rank)
        gathered = torch.empty(3 * world, device=dev)
        h.all_gather_into_tensor(gathered, torch.full((3,), float(rank), device=dev))
        torch.cuda.synchronize()
        want_rs = (torch.arange(7 * world) * world + sum(range(world))).view(world, 7)[rank]
        return (torch.equal(t.cpu(), torch.full((1001,), float(world * (world + 1) // 2))),
                torch.equal(out.cpu().long(), want_rs),
                torch.equal(gathered.cpu(), torch.arange(world).repeat_interleave(3).float()))


def test_hierarchical_on_cuda_with_nccl_between_nodes():
    """2 "nodes" x 2 ranks: the CUDA ring inside each, NCCL across (on one GPU, NCCL needs
    2.30+ and NCCL_MULTI_RANK_GPU_ENABLE=1 for several ranks there)."""
    if torch.cuda.device_count() < 2 and torch.cuda.nccl.version() < (2, 30, 0):
        pytest.skip(f"NCCL {torch.cuda.nccl.version()} refuses several ranks on one GPU (needs 2.30+)")
    results = spawn(_hierarchical_on_cuda, 4, timeout=240, env={**ENV, "NCCL_MULTI_RANK_GPU_ENABLE": "1"})
    assert results == [(True, True, True)] * 4


def test_benchmark_sweep_on_cuda(capsys):
    """ringcoll-bench --device cuda: the CPU benchmark's harness, checks and columns, with the
    copy ceiling (and NCCL where it runs) beside the CUDA ring."""
    import json
    import tempfile

    from ringcoll.harness import bench

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        status = bench.main(["--device", "cuda", "--nproc", "2", "-b", "4K", "-e", "256K", "-f", "8", "-w", "1",
                             "-n", "3", "--trials", "1", "--min-ms", "1", "--no-progress", "--json", f.name])
        printed = capsys.readouterr().out
        assert status == 0, printed
        rows = json.load(open(f.name))["rows"]
    assert "CUDA IPC, run mode: 2 processes on" in printed and "MPS" in printed, printed
    assert "x copy" in printed
    ours = [r for r in rows if r["backend"] == "ringcoll"]
    assert {r["collective"] for r in ours} == {"all_reduce", "reduce_scatter", "all_gather"}
    assert all(r["out_wrong"] == 0 and r["in_wrong"] == 0 for r in ours)
    assert {r["backend"] for r in rows} >= {"ringcoll", "copy"}


def test_benchmark_symmetric_on_cuda(capsys):
    """ringcoll-bench --device cuda --symmetric: ringcoll's tensors in CUDA symmetric memory
    (auto's direct plans read them in place) beside the same calls on ordinary tensors,
    every result checked."""
    import json
    import tempfile

    from ringcoll.harness import bench

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        status = bench.main(["--device", "cuda", "--nproc", "2", "--symmetric", "-b", "4K", "-e", "4M", "-f", "32",
                             "-w", "1", "-n", "3", "--trials", "1", "--min-ms", "1", "--no-progress", "--no-nccl",
                             "--json", f.name])
        printed = capsys.readouterr().out
        assert status == 0, printed
        rows = json.load(open(f.name))["rows"]
    assert "ringcoll's tensors in symmetric memory" in printed, printed
    for backend in ("ringcoll", "plain"):
        mine = [r for r in rows if r["backend"] == backend]
        assert {r["collective"] for r in mine} == {"all_reduce", "reduce_scatter", "all_gather"}, backend
        assert all(r["out_wrong"] == 0 and r["in_wrong"] == 0 for r in mine), backend
