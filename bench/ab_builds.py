"""Two builds of ringcoll side by side: does a change to an engine cost anything?

    git worktree add /tmp/old <commit> && (cd /tmp/old && python setup.py build_ext --inplace)
    OMP_NUM_THREADS=1 python bench/ab_builds.py --old /tmp/old [--ring] [--nproc 2] [--dtype float32]

Two groups of P rank processes live at once, one importing ringcoll from --old, the other
the ringcoll this interpreter imports. They take turns block by block (the idle group sleeps
on an Event, so it takes no core): each block runs one collective at one size for a fixed
number of calls, so a busy moment of a shared machine hits both builds alike, which two
benchmark runs one after the other cannot promise. Per collective and size it prints each
build's fastest block and median block (us per call, rank 0's clock) and new / old for
both. Every result is checked against the exact expected value (inputs: rank + 1) before
timing. --ring sets small_bytes=0 and direct_bytes=0, so native is the ring at every size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def _calls(comm, torch, world, rank, counts, dtype):
    """Per (collective, bytes): a call, and a check of its result (inputs rank + 1, op SUM)."""
    total = world * (world + 1) // 2
    calls = {}
    for n in counts:  # the message in elements: P equal chunks
        size = n * dtype.itemsize
        t, out = torch.full((n,), rank + 1, dtype=dtype), torch.empty(n, dtype=dtype)
        whole, shard = torch.full((n,), rank + 1, dtype=dtype), torch.empty(n // world, dtype=dtype)
        piece, gathered = torch.full((n // world,), rank + 1, dtype=dtype), torch.empty(n, dtype=dtype)
        owners = torch.arange(1, world + 1, dtype=dtype).repeat_interleave(n // world)
        calls[("all_reduce", size)] = (lambda t=t, out=out: comm.all_reduce(t, output=out),
                                       lambda out=out: bool((out == total).all()))
        calls[("reduce_scatter", size)] = (lambda w=whole, s=shard: comm.reduce_scatter_tensor(s, w),
                                           lambda s=shard: bool((s == total).all()))
        calls[("all_gather", size)] = (lambda p=piece, g=gathered: comm.all_gather_into_tensor(g, p),
                                       lambda g=gathered, o=owners: bool(torch.equal(g, o)))
    return calls


def rank_main(build, old_path, rank, args, port, my_turn, their_turn, results):
    if build == "old":
        sys.path.insert(0, old_path)
    import torch
    import torch.distributed as dist

    import ringcoll

    here = os.path.abspath(ringcoll.__file__)
    if (build == "old") != here.startswith(os.path.abspath(old_path) + os.sep):
        raise RuntimeError(f"the {build} group imported ringcoll from {here}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc)
    settings = {"small_bytes": 0, "direct_bytes": 0} if args.ring else {}
    comm = ringcoll.Communicator(**settings)
    calls = _calls(comm, torch, args.nproc, rank, args.counts, getattr(torch, args.dtype))
    for (coll, size), (call, correct) in calls.items():
        call()
        if not correct():
            raise AssertionError(f"{build} build, {coll} of {size} bytes: wrong result on rank {rank}")
        for _ in range(args.warmup):
            call()
    blocks = {key: [] for key in calls}
    for _ in range(args.rounds):
        for key, (call, _) in calls.items():
            my_turn.wait()
            dist.barrier()
            reps = max(args.min_calls, args.calls * 65536 // max(key[1], 65536))  # fewer for large messages
            start = time.perf_counter()
            for _ in range(reps):
                call()
            blocks[key].append((time.perf_counter() - start) / reps * 1e6)
            dist.barrier()
            if rank == 0:  # hand the machine to the other build
                my_turn.clear()
                their_turn.set()
    if rank == 0:
        results.put((build, blocks))
    comm.close()
    dist.destroy_process_group()


def main(argv=None) -> int:
    import multiprocessing as mp
    import queue

    import torch

    from ringcoll.communicator import parse_bytes
    from ringcoll.harness.bench import Config, message_counts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="a directory whose ringcoll/ (with its built _C) is the old build")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("-b", "--minbytes", default="4K")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("-f", "--factor", type=int, default=4)
    p.add_argument("--rounds", type=int, default=12, help="blocks per build, collective and size")
    p.add_argument("--calls", type=int, default=200, help="calls per block up to 64 KiB (fewer above, in proportion)")
    p.add_argument("--min-calls", type=int, default=20)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--ring", action="store_true",
                   help="native is the ring at every size (no one-shot, no direct reads)")
    args = p.parse_args(argv)
    args.counts = message_counts(Config(min_bytes=parse_bytes(args.minbytes), max_bytes=parse_bytes(args.maxbytes),
                                        factor=args.factor, dtype=args.dtype), args.nproc)
    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    sizes = [n * itemsize for n in args.counts]
    if not os.path.isdir(os.path.join(args.old, "ringcoll")):
        p.error(f"--old {args.old}: no ringcoll package there")
    import ringcoll  # the new build: the one this interpreter imports (each rank checks its own again)

    new_home = os.path.dirname(os.path.abspath(ringcoll.__file__))
    if os.path.abspath(os.path.join(args.old, "ringcoll")) == new_home:
        p.error(f"--old {args.old}: its ringcoll is the one this interpreter imports ({new_home}): both groups "
                "would run the new build")

    ctx = mp.get_context("spawn")
    old_turn, new_turn, results = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(build, args.old, rank, args, port, mine, theirs, results))
             for build, port, mine, theirs in (("old", 29571, old_turn, new_turn), ("new", 29572, new_turn, old_turn))
             for rank in range(args.nproc)]
    for proc in procs:
        proc.start()
    old_turn.set()
    got = {}
    while len(got) < 2:
        if any(proc.exitcode not in (None, 0) for proc in procs):
            for proc in procs:
                proc.kill()
            print("a rank failed (its traceback is above)", file=sys.stderr)
            return 1
        try:
            build, blocks = results.get(timeout=1.0)
            got[build] = blocks
        except queue.Empty:  # look at the ranks again
            continue
    for proc in procs:
        proc.join()
    print(f"# P = {args.nproc}, {args.dtype}, out of place, native{' (the ring at every size)' if args.ring else ''}; "
          f"{args.rounds} blocks per build, in turn; us per call (rank 0): fastest block, median block; new / old")
    print(f"{'collective':15s} {'bytes':>9s} | {'old min':>9s} {'new min':>9s} {'ratio':>6s} | "
          f"{'old med':>9s} {'new med':>9s} {'ratio':>6s}")
    for coll in COLLECTIVES:
        for size in sizes:
            old, new = got["old"][(coll, size)], got["new"][(coll, size)]
            print(f"{coll:15s} {size:9d} | {min(old):9.2f} {min(new):9.2f} {min(new) / min(old):6.3f} | "
                  f"{statistics.median(old):9.2f} {statistics.median(new):9.2f} "
                  f"{statistics.median(new) / statistics.median(old):6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
