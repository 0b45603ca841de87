"""A DDP training step's time on ringcoll's backend and on gloo, in one job: how the
collectives' speed shows in training. Run it under torchrun, on one machine or two:

    torchrun --nproc-per-node 2 bench/ddp_step.py
    sudo python examples/two_hosts.py [--link 2gbit] bench/ddp_step.py     # two namespace machines

Every rank makes two process groups over the same ranks, "ringcoll" and "gloo", and trains
one DDP replica of the same MLP (1.05M parameters: 4 layers of 512, DDP's default 25 MB
buckets, so one all-reduce of the whole gradient per step) on each, in turn, ROUNDS times
STEPS steps (environment, default 5 x 20), so a slow moment of a shared machine hits both.
A step is forward, backward (DDP all-reduces the gradients as they are ready) and an SGD
update; its time is the slowest rank's mean over a round, and the median round counts.
The two replicas start from the same weights and must end within rounding of each other
(they sum in different orders); the script exits 1 if they do not.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ringcoll  # noqa: F401  registers the "ringcoll" backend

WIDTH, LAYERS, BATCH = 512, 4, 64


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def main() -> int:
    dist.init_process_group("gloo")  # the default group: barriers and the timing's max
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {name: dist.new_group(backend=name) for name in ("ringcoll", "gloo")}
    models = {name: DDP(make_model(), process_group=group) for name, group in groups.items()}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.01) for name, m in models.items()}
    torch.manual_seed(1 + rank)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    rounds, steps = int(os.environ.get("ROUNDS", 5)), int(os.environ.get("STEPS", 20))

    def step(name: str) -> None:
        optimizers[name].zero_grad()
        if name == "compute":  # the same step without DDP's all-reduce
            with models["gloo"].no_sync():
                torch.nn.functional.mse_loss(models["gloo"](x), y).backward()
            return
        torch.nn.functional.mse_loss(models[name](x), y).backward()
        optimizers[name].step()

    optimizers["compute"] = optimizers["gloo"]
    times: dict = {name: [] for name in ("ringcoll", "gloo", "compute")}
    for name in models:
        step(name)  # DDP's first step builds its buckets
    for _ in range(rounds):
        for name in times:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step(name)
            mine = torch.tensor([(time.perf_counter() - start) / steps])
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            times[name].append(float(mine))
    params = {name: torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for name, m in models.items()}
    agree = torch.allclose(params["ringcoll"], params["gloo"], rtol=1e-5, atol=1e-6)
    if rank == 0:
        n = sum(p.numel() for p in models["gloo"].parameters())
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"DDP step, {n} parameters, {world} ranks, batch {BATCH} per rank, {rounds} x {steps} steps each: "
              f"ringcoll {ms['ringcoll']:.1f} ms, gloo {ms['gloo']:.1f} ms (x gloo {ms['gloo'] / ms['ringcoll']:.2f}); "
              f"without the all-reduce {ms['compute']:.1f} ms; weights agree to rounding: {agree}")
    del models, optimizers
    dist.destroy_process_group()
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
