"""Train a small model with ZeRO stage 2 (ringcoll.training.zero.ShardedOptimizer) on CPU.

    torchrun --nproc_per_node 2 examples/train_zero.py
    torchrun --nproc_per_node 2 examples/train_zero.py --stage 1

The model, data and hyperparameters are those of examples/train_ddp.py (fit
y = sin(3 x0) + x1 * x2 with a small MLP, each rank on its own shard of the data), but
instead of DDP the optimizer is sharded: each rank runs Adam over 1/P of every bucket
of parameters. Gradients are reduce-scattered on ringcoll's ring as soon as a bucket is
complete during backward (stage 2: each rank keeps only its shard of the gradient), and
the updated shards are all-gathered back into every rank's parameters after each step.

The process group is ringcoll's (``init_process_group("ringcoll")``, torchrun's env://
rendezvous), so the optimizer's reduce-scatters and all-gathers run on the backend's ring;
over several machines (``torchrun --nnodes 2``; examples/two_hosts.py simulates two) the
backend makes them hierarchical by itself: the ring inside each machine, gloo between them.
With ``--backend gloo`` the process group is plain gloo and ringcoll builds its own
shared-memory ring over it (one machine only). Rank 0 prints the loss per epoch, then what each rank holds
(optimizer state and gradients beside the unsharded optimizer and ringcoll.learning.memory's
formula), and the script checks at the end that every rank's parameters are bitwise
identical (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import ringcoll.training.zero
from ringcoll.learning.memory import ledger

from common import (end_process_group, make_data, make_loader, make_model, parameter_checksum,  # examples/common.py
                    parameters_identical, pick_device, train)

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.005)
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2))
    parser.add_argument("--bucket-bytes", type=int, default=8192,
                        help="small, so that the model makes several buckets (default of the class: 25 MiB)")
    parser.add_argument("--backend", default="ringcoll", choices=("ringcoll", "gloo"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: the model on this rank's GPU, the shards on ringcoll's CUDA ring")
    args = parser.parse_args()

    dist.init_process_group(args.backend)  # env:// from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # the ranks share the machine's cores
    model = make_model().to(pick_device(args.device))
    params = list(model.parameters())
    opt = ringcoll.training.zero.ShardedOptimizer(params, torch.optim.Adam, stage=args.stage,
                                         bucket_bytes=args.bucket_bytes, lr=args.lr)

    data = make_data()
    sampler, loader = make_loader(data, args.batch_size, rank, world)

    n = sum(p.numel() for p in params)
    if rank == 0:
        sizes = ", ".join(f"{b.numel:,}" for b in opt.buckets)
        print(f"ZeRO-{args.stage} on {world} ranks ({args.backend} group, ringcoll ring), Adam; {n:,} parameters in "
              f"{len(opt.buckets)} buckets ({sizes}); {len(data)} samples, {len(loader)} steps/epoch/rank")
    start = time.perf_counter()
    # Stage 2: buckets are reduce-scattered from inside backward; step() runs Adam on this
    # rank's shards, then all-gathers them into every rank's model.
    train(model, opt, sampler, loader, args.epochs, rank)
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
    same = parameters_identical(params, world)
    if rank == 0:
        print(f"{elapsed:.1f} s; parameters identical on all {world} ranks: {same}; "
              f"checksum {parameter_checksum(params):.12e}")
    ringcoll.destroy_communicators()
    del model, params, opt  # they hold the group; end_process_group frees it
    end_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
