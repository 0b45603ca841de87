"""What the training examples share: the task, the model, the loop and the final check.

The task: fit y = sin(3 x0) + x1 * x2 with a small MLP on synthetic data, each rank on its
own shard (DistributedSampler). The examples differ only in how gradients are combined.
"""

import gc
import os
import weakref

import torch
import torch.distributed as dist
# Imported before init_process_group on purpose: its functions take group=WORLD as a default
# argument, so the first import after init (DDP's, lazily) would hold the group until the
# process ends (see end_process_group).
import torch.distributed.nn  # noqa: F401
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

# torch 2.13 renamed the tensor form (the old name warns); older torch has only the old one.
all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def make_data(n: int = 4096) -> TensorDataset:
    g = torch.Generator().manual_seed(0)  # the same dataset on every rank
    x = torch.rand(n, 8, generator=g) * 2 - 1
    y = torch.sin(3 * x[:, :1]) + x[:, 1:2] * x[:, 2:3]
    return TensorDataset(x, y)


def pick_device(name: str) -> torch.device:
    """"cpu", or "cuda": this rank's GPU (LOCAL_RANK, shared round-robin when there are
    fewer GPUs than ranks: the CUDA ring maps peers on one GPU through CUDA IPC too)."""
    if name == "cpu":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # DDP and ShardedOptimizer broadcast rank 0's initial weights anyway
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def make_loader(data: TensorDataset, batch_size: int, rank: int, world: int):
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    return sampler, DataLoader(data, batch_size=batch_size, sampler=sampler)


def train(model, opt, sampler, loader, epochs: int, rank: int) -> None:
    """The plain loop; rank 0 prints the mean loss over all ranks' batches per epoch."""
    device = next(model.parameters()).device
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, dtype=torch.float64, device=device)  # sum of losses, number of batches
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item(), 1.0], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch}: loss {total[0].item() / total[1].item():.5f}")


def parameters_identical(params, world: int) -> bool:
    """Whether every rank holds bitwise the same parameters (collective)."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    everyone = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
    all_gather_into_tensor(everyone, flat)
    return all(torch.equal(chunk, flat) for chunk in everyone.view(world, -1))


def parameter_checksum(params) -> float:
    """The sum of |p| over every parameter, in float64: one number to compare runs by (two
    runs whose sums were added in different orders agree to rounding, not bit for bit)."""
    return sum(p.detach().double().abs().sum().item() for p in params)


def end_process_group() -> None:
    """dist.destroy_process_group, made to free the group now, while Python is alive.

    A gloo group's worker threads release each op's tensors after the op's wait() has
    returned. Were a thread still doing so while the interpreter exits, it would need the
    GIL of an interpreter being torn down, and the process aborts after a run that
    succeeded ("terminate called without an active exception", exit -6; pytorch PR 179291):
    5 runs in 99 of train_ddp.py --backend gloo on two_hosts.py here, 0 in 45 since. A
    group's threads are joined when its last reference goes, so the caller first drops what
    holds it (the DDP model, the sharded optimizer), and the group must be gone when this
    returns.
    """
    world = weakref.ref(dist.group.WORLD)
    gc.collect()  # a model's reference cycles
    dist.destroy_process_group()
    if world() is not None:
        raise RuntimeError("end_process_group: the process group outlived destroy_process_group (something still "
                           "holds it), so its worker threads would run into the interpreter's exit")
