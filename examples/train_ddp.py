"""Train a small model with DistributedDataParallel over the ringcoll backend (CPU).

    torchrun --nproc_per_node 2 examples/train_ddp.py
    torchrun --nproc_per_node 2 examples/train_ddp.py --hook      # gloo group + ringcoll.ddp_hook
    torchrun --nproc_per_node 2 examples/train_ddp.py --device cuda   # on the GPU: the CUDA ring

Without --hook, the default process group is ringcoll's (``init_process_group("ringcoll")``):
DDP's gradient all-reduces run on ringcoll's shared-memory ring, and its initial parameter
broadcast on ringcoll's plan engine (docs/training.md's table says what runs where). With
--hook, the process group is gloo and only the gradient buckets go through ringcoll, via
DDP's communication-hook API. Either way the script is an ordinary DDP script: the one
ringcoll-specific line is ``import ringcoll``.

The task: fit y = sin(3 x0) + x1 * x2 with a small MLP on synthetic data, each rank on its
own shard (DistributedSampler). Rank 0 prints the loss; at the end every rank's parameters
are compared, bit for bit, and the script exits non-zero if any differ.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ringcoll  # registers the "ringcoll" backend with torch.distributed

from common import (end_process_group, make_data, make_loader, make_model, parameter_checksum,  # examples/common.py
                    parameters_identical, pick_device, train)

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hook", action="store_true",
                        help="gloo process group + ringcoll.ddp_hook instead of the ringcoll backend")
    parser.add_argument("--backend", default="ringcoll", choices=("ringcoll", "gloo", "nccl"),
                        help="the process group's backend without --hook (gloo, nccl: the reference runs)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: the model on this rank's GPU, its gradients on ringcoll's CUDA ring")
    args = parser.parse_args()

    dist.init_process_group("gloo" if args.hook else args.backend)  # env:// from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    device = pick_device(args.device)
    model = DDP(make_model().to(device), bucket_cap_mb=0.01,  # small buckets: several all-reduces per step, overlapped
                device_ids=[device.index] if device.type == "cuda" else None)
    if args.hook:
        model.register_comm_hook(ringcoll.training.ddp.RingcollHookState(device=device), ringcoll.ddp_hook)

    data = make_data()
    sampler, loader = make_loader(data, args.batch_size, rank, world)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr / 10)

    if rank == 0:
        how = "gloo + ringcoll.ddp_hook" if args.hook else f"backend {dist.get_backend()!r}"
        print(f"DDP on {world} ranks, {how}; {len(data)} samples, {len(loader)} steps/epoch/rank")
    start = time.perf_counter()
    train(model, opt, sampler, loader, args.epochs, rank)

    same = parameters_identical(model.module.parameters(), world)
    if rank == 0:
        print(f"{time.perf_counter() - start:.1f} s; parameters identical on all {world} ranks: {same}; "
              f"checksum {parameter_checksum(model.module.parameters()):.12e}")
    ringcoll.destroy_communicators()  # --hook: the hook's communicator, cached by ringcoll
    del model, opt  # DDP's reducer holds the group; end_process_group frees it
    end_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
