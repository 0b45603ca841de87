"""Train a small model with DistributedDataParallel over the ringcoll backend (CPU).

    torchrun --nproc_per_node 2 examples/train_ddp.py
    torchrun --nproc_per_node 2 examples/train_ddp.py --hook      # gloo group + ringcoll.ddp_hook

Without --hook, the default process group is ringcoll's (``init_process_group("ringcoll")``):
DDP's gradient all-reduces run on ringcoll's shared-memory ring, and what ringcoll does not
implement (DDP's initial parameter broadcast) on the backend's internal gloo group. With
--hook, the process group is gloo and only the gradient buckets go through ringcoll, via
DDP's communication-hook API. Either way the script is an ordinary DDP script: the one
ringcoll-specific line is ``import ringcoll``.

The task: fit y = sin(3 x0) + x1 * x2 with a small MLP on synthetic data, each rank on its
own shard (DistributedSampler). Rank 0 prints the loss; at the end every rank's parameters
are compared, bit for bit, and the script exits non-zero if any differ.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ringcoll  # registers the "ringcoll" backend with torch.distributed

# torch 2.13 renamed the tensor form (the old name warns); older torch has only the old one.
all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def make_data(n: int = 4096) -> TensorDataset:
    g = torch.Generator().manual_seed(0)  # the same dataset on every rank
    x = torch.rand(n, 8, generator=g) * 2 - 1
    y = torch.sin(3 * x[:, :1]) + x[:, 1:2] * x[:, 2:3]
    return TensorDataset(x, y)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hook", action="store_true",
                        help="gloo process group + ringcoll.ddp_hook instead of the ringcoll backend")
    args = parser.parse_args()

    dist.init_process_group("gloo" if args.hook else "ringcoll")  # env:// from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # DDP broadcasts rank 0's initial weights anyway
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    model = DDP(model, bucket_cap_mb=0.01)  # small buckets: several all-reduces per step, overlapped
    if args.hook:
        model.register_comm_hook(ringcoll.ddp.RingcollHookState(), ringcoll.ddp_hook)

    data = make_data()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr / 10)

    if rank == 0:
        how = "gloo + ringcoll.ddp_hook" if args.hook else f"backend {dist.get_backend()!r}"
        print(f"DDP on {world} ranks, {how}; {len(data)} samples, {len(loader)} steps/epoch/rank")
    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, dtype=torch.float64)  # sum of losses, number of batches
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item(), 1.0], dtype=torch.float64)
        dist.all_reduce(total)  # the mean loss over all ranks' batches of this epoch
        if rank == 0:
            print(f"epoch {epoch}: loss {total[0].item() / total[1].item():.5f}")

    # Every rank must hold bitwise the same parameters.
    flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
    everyone = torch.empty(world * flat.numel(), dtype=flat.dtype)
    all_gather_into_tensor(everyone, flat)
    same = all(torch.equal(chunk, flat) for chunk in everyone.view(world, -1))
    if rank == 0:
        print(f"{time.perf_counter() - start:.1f} s; parameters identical on all {world} ranks: {same}")
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
