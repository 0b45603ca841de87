"""A rank killed (SIGKILL) in the middle of training: every survivor raises, none crashes.

Each way of training on ringcoll is run on P ranks of one machine; after a few steps one
rank kills itself, and every other rank must get an exception out of its training step
(a RuntimeError; ringcoll's own error, or one quoting it, where the failure reaches it
through a torch Future) within the communicator's timeout, naming the collective, then
return normally: no signal (DDP on the backend died with SIGSEGV inside loss.backward()
before the Future of a failed collective failed as C++ sees a failure), no hang, nothing
left in /dev/shm. Across two machines: tests/multiprocess/test_two_hosts.py.

    ddp           DDP on the "ringcoll" backend (its reducer's all-reduces; async Works)
    ddp_hook      DDP on a gloo group + ringcoll.ddp_hook (Futures of ringcoll Works)
    fsdp2         FSDP2 (fully_shard) on the backend: all-gathers and reduce-scatters
    zero          ringcoll.zero.ShardedOptimizer, stage 2 (reduce-scatter, then all-gather)
    sync          a hand-written loop of synchronous ringcoll.all_reduce calls
    async         the same with async_op=True and Work.wait()
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from ringcoll.harness.launcher import spawn_outcomes
from test_faults import no_leftover_segments  # noqa: F401 -- the fixture: nothing left in /dev/shm

TIMEOUT = 10.0  # RINGCOLL_TIMEOUT and the process group's: survivors notice a death far sooner
KILL_AT_STEP = 3
MAX_STEPS = 200  # a survivor that never fails is reported, not waited for
MODES = ("ddp", "ddp_hook", "fsdp2", "zero", "sync", "async")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def _step_fn(mode: str, rank: int):
    """One training step of `mode` (built collectively, as each rank starts training)."""
    import ringcoll

    data = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    if mode in ("sync", "async"):
        grads = torch.ones(1 << 14)

        def hand_written():
            work = ringcoll.all_reduce(grads, async_op=mode == "async")
            if work is not None:
                work.wait()
        return hand_written
    model = _model()
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    elif mode == "ddp_hook":
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=dist.new_group(backend="gloo"),
                                                          bucket_cap_mb=0.01)
        model.register_comm_hook(ringcoll.training.ddp.RingcollHookState(), ringcoll.ddp_hook)
    elif mode == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if mode == "zero":
        from ringcoll.training.zero import ShardedOptimizer

        opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=0.01, bucket_bytes=4096)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train_step():
        loss = model(data).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return train_step


def _train_until_a_peer_dies(rank, world, victim, mode):
    step = _step_fn(mode, rank)
    step()  # bootstraps the communicator: every later call is ordinary training
    dist.barrier(group=dist.new_group(backend="gloo"))
    killed_at = None
    for i in range(MAX_STEPS):
        if i == KILL_AT_STEP:
            killed_at = time.monotonic()
            if rank == victim:
                os.kill(os.getpid(), signal.SIGKILL)
        try:
            step()
        except Exception as exc:  # noqa: BLE001 -- what reaches the user is what is checked
            return type(exc).__name__, isinstance(exc, RuntimeError), str(exc), time.monotonic() - killed_at
    return "no error", False, "", 0.0


@pytest.mark.usefixtures("no_leftover_segments")
@pytest.mark.parametrize("mode", MODES)
def test_survivors_of_a_killed_rank_raise(mode):
    world, victim = (3, 1) if mode == "ddp" else (2, 1)  # DDP on the backend at P = 3: two survivors
    env = {"RINGCOLL_TIMEOUT": str(TIMEOUT)}
    outcomes = spawn_outcomes(_train_until_a_peer_dies, world, victim, mode, timeout=60, backend="ringcoll",
                              env=env, init_timeout=TIMEOUT)
    assert outcomes[victim].exitcode == -signal.SIGKILL, outcomes[victim]
    for o in outcomes:
        if o.rank == victim:
            continue
        assert o.ok, f"rank {o.rank} ({mode}) died or hung: exit {o.exitcode}\n{o.traceback}"
        kind, is_runtime_error, message, elapsed = o.value
        assert is_runtime_error, (o.rank, kind, message)
        # ringcoll's error names the collective and the peer; through a Future it is quoted
        assert "Ringcoll" in kind or "Ringcoll" in message, (o.rank, kind, message)
        assert any(op in message for op in ("all_reduce", "all_gather", "reduce_scatter")), message
        assert f"rank {victim}" in message or "has exited" in message or "broken" in message, message
        assert elapsed < TIMEOUT, (o.rank, elapsed, message)
