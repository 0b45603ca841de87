"""Every collective of the ringcoll backend against gloo over the same ranks.

    torchrun --nproc-per-node 2 -m ringcoll.harness.backend_check        # one machine
    python examples/two_hosts.py -m ringcoll.harness.backend_check      # two (simulated) machines

Each rank calls every collective the backend serves (sync and async, every op on float32
and int32, bfloat16 sums, awkward sizes, the list and coalesced forms, and broadcast, which
is forwarded) once through a "ringcoll" process group and once through a "gloo" one, on the
same inputs, and compares the results bit for bit. The inputs are small integers, so every
summation order gives the same bits. Then it makes, uses and destroys a ringcoll group three
times, which must leave no process group or thread behind. Exit status 1 if anything
differs, naming it.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

from ringcoll._types import torch_tensor_forms

all_gather_single, reduce_scatter_single = torch_tensor_forms()

OPS = ("SUM", "PRODUCT", "MIN", "MAX")
CASES = [(torch.float32, op) for op in OPS] + [(torch.int32, op) for op in OPS] + [(torch.bfloat16, "SUM")]
SIZES = (1, 7, 1000)  # one element, fewer than P per rank, more than a slot's worth at a 4 KiB buffer


def _inputs(rank: int, numel: int, dtype: torch.dtype, op: str, salt: int = 0) -> torch.Tensor:
    idx = torch.arange(numel) + salt
    if op == "PRODUCT":
        return ((idx + rank) % 2 + 1).to(dtype)  # 1s and 2s: products stay exact
    return ((idx * 3 + rank * 5) % 7 - 3).to(dtype)


def _run(fn, async_op: bool) -> None:
    work = fn(async_op)
    if async_op:
        work.wait()


def compare_with_gloo(ours, gloo) -> list:
    """Run every collective on process group `ours` and on `gloo`; the names of those whose
    results differ (empty: all equal)."""
    rank, world = dist.get_rank(ours), dist.get_world_size(ours)
    failures = []
    warnings.filterwarnings("ignore", message=".*all_reduce_coalesced.*deprecated", category=FutureWarning)

    def check(what: str, call) -> None:
        """call(group, async_op) -> the result tensors; compared between the two groups."""
        for async_op in (False, True):
            got, want = call(ours, async_op), call(gloo, async_op)
            if not all(torch.equal(g, w) for g, w in zip(got, want)):
                failures.append(f"{what}{' async' if async_op else ''}")

    for dtype, op in CASES:
        reduce_op = getattr(dist.ReduceOp, op)
        for n in SIZES:
            def all_reduce(group, a, n=n):
                t = _inputs(rank, n, dtype, op)
                _run(lambda a: dist.all_reduce(t, op=reduce_op, group=group, async_op=a), a)
                return [t]

            def reduce_scatter_tensor(group, a, n=n):
                out = torch.empty(n, dtype=dtype)
                _run(lambda a: reduce_scatter_single(out, _inputs(rank, n * world, dtype, op), op=reduce_op,
                                                          group=group, async_op=a), a)
                return [out]

            def reduce_scatter_list(group, a, n=n):
                out = torch.empty(n, dtype=dtype)
                ins = [_inputs(rank, n, dtype, op, salt=r) for r in range(world)]
                _run(lambda a: dist.reduce_scatter(out, ins, op=reduce_op, group=group, async_op=a), a)
                return [out]

            def all_reduce_coalesced(group, a, n=n):
                ts = [_inputs(rank, n, dtype, op), _inputs(rank, n + 3, dtype, op, salt=1)]
                _run(lambda a: dist.all_reduce_coalesced(ts, op=reduce_op, group=group, async_op=a), a)
                return ts

            def reduce_scatter_coalesced(group, a, n=n):
                outs = [torch.empty(n, dtype=dtype), torch.empty(n + 2, dtype=dtype)]
                ins = [_inputs(rank, o.numel() * world, dtype, op, salt=i) for i, o in enumerate(outs)]
                with dist._coalescing_manager(group=group, async_ops=a) as cm:
                    for o, i in zip(outs, ins):
                        reduce_scatter_single(o, i, op=reduce_op, group=group)
                if a:
                    cm.wait()
                return outs

            for name, call in (("all_reduce", all_reduce), ("reduce_scatter_tensor", reduce_scatter_tensor),
                               ("reduce_scatter", reduce_scatter_list), ("all_reduce_coalesced", all_reduce_coalesced),
                               ("reduce_scatter_tensor_coalesced", reduce_scatter_coalesced)):
                check(f"{name} {dtype} {op} n={n}", call)

    for dtype in dict.fromkeys(dtype for dtype, _ in CASES):
        for n in SIZES:
            def all_gather_into_tensor(group, a, n=n):
                out = torch.empty(n * world, dtype=dtype)
                _run(lambda a: all_gather_single(out, _inputs(rank, n, dtype, "SUM"), group=group,
                                                           async_op=a), a)
                return [out]

            def all_gather_list(group, a, n=n):
                outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
                _run(lambda a: dist.all_gather(outs, _inputs(rank, n, dtype, "SUM"), group=group, async_op=a), a)
                return outs

            def all_gather_coalesced(group, a, n=n):
                outs = [torch.empty(n * world, dtype=dtype), torch.empty((n + 1) * world, dtype=dtype)]
                with dist._coalescing_manager(group=group, async_ops=a) as cm:
                    for i, o in enumerate(outs):
                        all_gather_single(o, _inputs(rank, o.numel() // world, dtype, "SUM", salt=i),
                                                    group=group)
                if a:
                    cm.wait()
                return outs

            def broadcast(group, a, n=n):
                t = _inputs(rank, n, dtype, "SUM")
                _run(lambda a: dist.broadcast(t, src=dist.get_global_rank(group, world - 1), group=group,
                                              async_op=a), a)
                return [t]

            for name, call in (("all_gather_into_tensor", all_gather_into_tensor), ("all_gather", all_gather_list),
                               ("all_gather_into_tensor_coalesced", all_gather_coalesced), ("broadcast", broadcast)):
                check(f"{name} {dtype} n={n}", call)

    check("barrier", lambda group, a: _run(lambda a: dist.barrier(group=group, async_op=a), a) or [])
    return failures


def groups_made_and_destroyed_hold_nothing(cycles: int = 3) -> list:
    """A ringcoll group made, used and destroyed, three times in turn: every cycle leaves the
    process with as many process groups, threads and open files as the first did. (Over
    several machines the group's two-level communicator makes two gloo groups of its own,
    which its shutdown once left registered until the world's destroy: a pair more per
    cycle; and its link's sockets, which must close with it.)"""
    held = []
    for _ in range(cycles):
        sub = dist.new_group(backend="ringcoll")
        t = torch.ones(4)
        dist.all_reduce(t, group=sub)  # builds its communicator
        if not torch.equal(t, torch.full((4,), float(dist.get_world_size()))):
            return [f"all_reduce on a new ringcoll group gave {t.tolist()}"]
        dist.destroy_process_group(sub)
        held.append((len(dist.distributed_c10d._world.pg_map), len(os.listdir("/proc/self/task")),
                     len(os.listdir("/proc/self/fd"))))
    if any(h != held[0] for h in held[1:]):
        return [f"groups made and destroyed in turn: (process groups, threads, open files) after each {held}"]
    return []


def main() -> int:
    """Under torchrun: the default group is ringcoll's (registered by importing this
    package), the reference a gloo group."""
    dist.init_process_group("ringcoll")
    gloo = dist.new_group(backend="gloo")
    ours = dist.group.WORLD
    failures = compare_with_gloo(ours, gloo) + groups_made_and_destroyed_hold_nothing()
    hosts = len(set(ours.hosts))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, failures, group=gloo)
    if dist.get_rank() == 0:
        bad = [(r, f) for r, fs in enumerate(everyone) for f in fs]
        print(f"backend_check: {dist.get_world_size()} ranks on {hosts} machine(s), "
              f"{'hierarchical' if ours.spans_hosts else 'one ring'}: "
              + ("every collective equals gloo" if not bad else f"{len(bad)} differ from gloo"))
        for r, f in bad[:50]:
            print(f"  rank {r}: {f}")
    ok = not any(everyone)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
