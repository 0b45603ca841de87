"""Short CUDA benchmark for bench/device_check.sh: ringcoll's three collectives at P ranks
on one GPU (processes sharing it through CUDA IPC), 1 KiB .. max_bytes in steps of 4x,
nccl-tests columns, with a device-to-device copy of the same bytes as the ceiling, and
NCCL's collectives beside ours where NCCL can run (one GPU per rank, or NCCL >= 2.30 with
NCCL_MULTI_RANK_GPU_ENABLE=1; older NCCL refuses several ranks on one GPU, and the header
then says so). Results are checked before timing (#wrong). Rank 0 prints each row as it is
measured; with RINGCOLL_BENCH_BUDGET=S (seconds) the run stops going to larger sizes once
S seconds have passed, so a cut-short run still reports what it measured.
Usage: python bench/device_bench.py P [max_bytes]
"""

import os
import sys
import time

import torch

from ringcoll.harness.launcher import spawn

COLUMNS = (f"{'size':>12} {'count':>10} {'type':>6} {'redop':>5} {'collective':>15} {'time(us)':>10} "
           f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'#wrong':>7}")


def _print_row(nbytes, n, redop, name, us, algbw, busbw, wrong):
    print(f"{nbytes:>12} {n:>10} {'float':>6} {redop:>5} {name:>15} {us:>10.1f} {algbw:>12.2f} {busbw:>12.2f} {wrong:>7}",
          flush=True)


def _bench(rank, world, max_bytes, iters_small, iters_large, deadline):
    import torch.distributed as dist

    from ringcoll import CudaCommunicator

    per_rank_gpu = torch.cuda.device_count() >= world
    index = rank if per_rank_gpu else 0
    torch.cuda.set_device(index)
    dev = torch.device("cuda", index)
    nccl = dist.new_group(backend="nccl") if nccl_usable(world) else None
    rows = 0
    with CudaCommunicator(device=dev, timeout=60) as comm:
        size = 1024
        while size <= max_bytes:
            # Every rank must stop at the same size: rank 0's clock decides.
            out_of_time = torch.tensor([float(rank == 0 and time.time() > deadline)])
            dist.all_reduce(out_of_time)
            if out_of_time.item():
                if rank == 0:
                    print(f"# time budget spent: sizes from {size} bytes on not measured", flush=True)
                break
            n = size // 4
            n -= n % world
            if n == 0:
                size *= 4
                continue
            x = torch.full((n,), float(rank + 1), device=dev)
            out = torch.empty(n, device=dev)
            rs = torch.empty(n // world, device=dev)
            ag_in = torch.full((n // world,), float(rank), device=dev)
            # check first
            comm.all_reduce(x, output=out)
            comm.reduce_scatter_tensor(rs, x)
            comm.all_gather_into_tensor(out, ag_in)
            comm.synchronize()
            wrong = {
                "all_reduce": 0, "reduce_scatter": int((rs != world * (world + 1) / 2).sum()),
                "all_gather": int((out != torch.arange(world, device=dev).repeat_interleave(n // world)).sum()),
            }
            comm.all_reduce(x, output=out)
            comm.synchronize()
            wrong["all_reduce"] = int((out != world * (world + 1) / 2).sum())
            iters = iters_small if size < (16 << 20) else iters_large
            calls = {
                "all_reduce": lambda: comm.all_reduce(x, output=out),
                "reduce_scatter": lambda: comm.reduce_scatter_tensor(rs, x),
                "all_gather": lambda: comm.all_gather_into_tensor(out, ag_in),
                "d2d_copy": lambda: out.copy_(x),
            }
            if nccl is not None:
                calls.update({
                    "nccl_all_reduce": lambda: dist.all_reduce(out, group=nccl),
                    "nccl_reduce_scatter": lambda: dist.reduce_scatter_tensor(rs, x, group=nccl),
                    "nccl_all_gather": lambda: dist.all_gather_into_tensor(out, ag_in, group=nccl),
                })
            for name, call in calls.items():
                dist.barrier()
                call()
                comm.synchronize()
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)
                stop = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    call()
                stop.record()
                comm.synchronize()
                stop.synchronize()
                us = start.elapsed_time(stop) * 1000 / iters
                nbytes = n * 4
                algbw = nbytes / us / 1e3  # GB/s
                base = name.removeprefix("nccl_")
                factor = {"all_reduce": 2 * (world - 1) / world, "reduce_scatter": (world - 1) / world,
                          "all_gather": (world - 1) / world, "d2d_copy": 1.0}[base]
                if rank == 0:
                    _print_row(nbytes, n, "none" if base == "all_gather" else "sum", name, us, algbw,
                               algbw * factor, wrong.get(name, 0))
                rows += 1
            size *= 4
    return rows


def nccl_usable(world) -> bool:
    return torch.cuda.device_count() >= world or torch.cuda.nccl.version() >= (2, 30, 0)


def main():
    world = int(sys.argv[1])
    max_bytes = int(sys.argv[2]) if len(sys.argv) > 2 else 256 << 20
    budget = float(os.environ.get("RINGCOLL_BENCH_BUDGET", "100"))
    if not torch.cuda.is_available():
        sys.exit("device_bench: torch sees no CUDA device (torch.cuda.is_available() is False)")
    t0 = time.time()
    print(f"# ringcoll CUDA, P={world} processes on one GPU, kernel={os.environ.get('RINGCOLL_CUDA_KERNEL', 'fused')}"
          f", MPS={'on' if os.environ.get('CUDA_MPS_PIPE_DIRECTORY') else 'off'}, float32, up to {max_bytes} bytes"
          f", budget {budget:.0f} s")
    if not nccl_usable(world):
        print(f"# NCCL {torch.cuda.nccl.version()} cannot run {world} ranks on one GPU (needs 2.30+): no NCCL rows")
    print(COLUMNS, flush=True)
    # Sizes stop at 60% of the budget: the size under way when it runs out must still finish.
    spawn(_bench, world, max_bytes, 20, 5, t0 + 0.6 * budget, timeout=budget + 5,
          env={"NCCL_MULTI_RANK_GPU_ENABLE": "1"})
    print(f"# {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
