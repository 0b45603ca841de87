"""Train a small model with ZeRO stage 2 (ringcoll.zero.ShardedOptimizer) on CPU.

    torchrun --nproc_per_node 2 examples/train_zero.py
    torchrun --nproc_per_node 2 examples/train_zero.py --stage 1

The model, data and hyperparameters are those of examples/train_ddp.py (fit
y = sin(3 x0) + x1 * x2 with a small MLP, each rank on its own shard of the data), but
instead of DDP the optimizer is sharded: each rank runs Adam over 1/P of every bucket
of parameters. Gradients are reduce-scattered on ringcoll's ring as soon as a bucket is
complete during backward (stage 2: each rank keeps only its shard of the gradient), and
the updated shards are all-gathered back into every rank's parameters after each step.

The process group is plain gloo (torchrun's env:// rendezvous); ringcoll builds its
shared-memory ring over it. Rank 0 prints the loss per epoch, then what each rank holds
(optimizer state and gradients beside the unsharded optimizer and ringcoll.memory's
formula), and the script checks at the end that every rank's parameters are bitwise
identical (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ringcoll.zero
from ringcoll.memory import ledger

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
    parser.add_argument("--lr", type=float, default=0.005)
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2))
    parser.add_argument("--bucket-bytes", type=int, default=8192,
                        help="small, so that the model makes several buckets (default of the class: 25 MiB)")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # env:// from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # the ranks share the machine's cores
    torch.manual_seed(0)  # ShardedOptimizer broadcasts rank 0's initial weights anyway
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    params = list(model.parameters())
    opt = ringcoll.zero.ShardedOptimizer(params, torch.optim.Adam, stage=args.stage,
                                         bucket_bytes=args.bucket_bytes, lr=args.lr)

    data = make_data()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)

    n = sum(p.numel() for p in params)
    if rank == 0:
        sizes = ", ".join(f"{b.numel:,}" for b in opt.buckets)
        print(f"ZeRO-{args.stage} on {world} ranks (gloo group, ringcoll ring), Adam; {n:,} parameters in "
              f"{len(opt.buckets)} buckets ({sizes}); {len(data)} samples, {len(loader)} steps/epoch/rank")
    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, dtype=torch.float64)  # sum of losses, number of batches
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()  # stage 2: buckets are reduce-scattered from inside backward
            opt.step()  # Adam on this rank's shards, then all-gather into every rank's model
            total += torch.tensor([loss.item(), 1.0], dtype=torch.float64)
        dist.all_reduce(total)  # the mean loss over all ranks' batches of this epoch
        if rank == 0:
            print(f"epoch {epoch}: loss {total[0].item() / total[1].item():.5f}")
    elapsed = time.perf_counter() - start

    # What each rank holds after the last step (before zero_grad).
    report = opt.memory_report()
    unsharded_state = 2 * 4 * n + 4 * len(params)  # torch.optim.Adam: exp_avg, exp_avg_sq, step per tensor
    predicted = ledger(n, world, args.stage, precision="fp32")
    line = (f"  rank {rank}: optimizer state {report['optimizer_state']:,} B "
            f"(unsharded Adam {unsharded_state:,} B, ratio 1/{unsharded_state / report['optimizer_state']:.2f}; "
            f"ledger 8N/P = {predicted.optimizer_state:,.0f} B); gradients kept: "
            f"{report['param_grads'] + report['shard_grads']:,} B (full {4 * n:,} B; ledger "
            f"{predicted.gradients:,.0f} B)"
            + (f"; full-size gradient buckets alive at once in backward, at most {report['peak_flat_grad_buckets']:,} B"
               if args.stage == 2 else ""))
    lines = [None] * world
    dist.all_gather_object(lines, line)
    if rank == 0:
        print("per rank, after the last step:")
        print("\n".join(lines))

    # Every rank must hold bitwise the same parameters.
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    everyone = torch.empty(world * flat.numel(), dtype=flat.dtype)
    all_gather_into_tensor(everyone, flat)
    same = all(torch.equal(chunk, flat) for chunk in everyone.view(world, -1))
    if rank == 0:
        print(f"{elapsed:.1f} s; parameters identical on all {world} ranks: {same}")
    ringcoll.destroy_communicators()
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
