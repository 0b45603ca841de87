"""Ordinary or streaming stores for the slots, side by side while the cores move: three
Communicators that differ only in RINGCOLL_SLOT_STORES (cache, stream, auto), timed in turn
in the same processes, round after round, each round with the neighbour hop the auto one
measured last.

    python bench/slot_stores.py [--nproc 2] [--seconds 60] [--sizes 64K,256K,1M,4M,16M] [--dtype float32]

A round: for each size, each communicator runs out-of-place all-reduces for --window
seconds; the slowest rank's median call time is printed. Before timing, each result is
checked against the values every rank computes itself (ringcoll-bench's inputs: small
integers, exact in any order). On this project's VM the hop is ~60-85 ns when the two vCPUs
share a last-level cache and ~200-250 ns when the hypervisor has put them on different dies
of the EPYC; rounds of both kinds show why neither store is right for both, and that auto
follows the better one (csrc/host/host_comm.cpp, "The slots' stores"). The recorded run:
bench/results/2026-12-05-cpu-slot-stores.txt.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

STORES = ("cache", "stream", "auto")


def rank_main(rank, world, args):
    import torch
    import torch.distributed as dist

    import ringcoll
    from ringcoll._types import DTYPES
    from ringcoll.harness.bench import COLLECTIVES, _buffers, expected_result

    dtype, coll = DTYPES[args.dtype], COLLECTIVES["all_reduce"]
    comms = {}
    for stores in STORES:  # read when the communicator is made
        os.environ["RINGCOLL_SLOT_STORES"] = stores
        comms[stores] = ringcoll.Communicator()
    calls = {}
    for nbytes in args.sizes:
        count = nbytes // dtype.itemsize
        expected = expected_result(coll, rank, world, count, dtype, "sum")
        for stores, comm in comms.items():
            inp, out, result = _buffers(coll, count, world, rank, dtype, "sum", in_place=False, device="cpu")
            # native: the transport's own path, through the slots (auto may run a plan that fills none)
            calls[stores, nbytes] = lambda c=comm, i=inp, o=out: c.all_reduce(i, output=o, algorithm="native")
            calls[stores, nbytes]()
            if not torch.equal(result, expected):
                raise AssertionError(f"{stores} all_reduce of {nbytes} bytes: wrong result on rank {rank}")
    rounds, deadline = [], time.monotonic() + args.seconds
    while True:
        row = {}
        for nbytes in args.sizes:
            for stores in STORES:
                comms["cache"].barrier()
                times, stop = [], torch.zeros(1)
                began = time.perf_counter()
                while True:
                    start = time.perf_counter()
                    calls[stores, nbytes]()
                    times.append(time.perf_counter() - start)
                    if len(times) % 8 == 0:  # every rank stops after the same call
                        stop[0] = float(time.perf_counter() - began > args.window)
                        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
                        if stop.item():
                            break
                median = torch.tensor([sorted(times)[len(times) // 2] * 1e6], dtype=torch.float64)
                dist.all_reduce(median, op=dist.ReduceOp.MAX)
                row[stores, nbytes] = float(median)
        rounds.append((comms["auto"].transport.slot_stores, row))
        stop = torch.tensor([float(time.monotonic() > deadline)])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            break
    for comm in comms.values():
        comm.close()
    return rounds


def main(argv=None) -> int:
    from ringcoll.communicator import parse_bytes
    from ringcoll.harness.launcher import spawn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seconds", type=float, default=60, help="rounds start until this many seconds have passed")
    p.add_argument("--window", type=float, default=0.15, help="seconds of calls per communicator and size")
    p.add_argument("--sizes", default="64K,256K,1M,4M,16M")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    args.sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    rounds = spawn(rank_main, args.nproc, args, timeout=args.seconds + 600)[0]
    print(f"# all_reduce out of place, P = {args.nproc}, {args.dtype}, CPU shared memory: us per call (median over "
          f"{args.window} s, slowest rank) with the slots written by ordinary stores (cache), streaming stores "
          "(stream) and as the neighbour-hop probe decides (auto); hop: the auto communicator's last probe")
    head = "".join(f" | {str(n >> 10) + 'K':>5} {'cache':>7} {'stream':>6} {'auto':>6}" for n in args.sizes)
    print(f"# {'hop':>6} {'auto':>6}{head}")
    for stores, row in rounds:
        chosen = "stream" if stores["streaming"] else "cache"
        cells = "".join(f" | {'':>5} {row['cache', n]:7.0f} {row['stream', n]:6.0f} {row['auto', n]:6.0f}"
                        for n in args.sizes)
        print(f"  {stores['hop_ns']:>4}ns {chosen:>6}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
