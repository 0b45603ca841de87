"""Where the one-shot path stops paying: the ring and the one-shot path timed in turn, in
the same processes, block by block, so that a busy moment of a shared machine hits both.

    python bench/small_crossover.py --nproc 2 --dtype float32 [-b 1K -e 512K] [--blocks 15]

P ranks (ringcoll.harness.launcher.spawn) hold two Communicators over the same group:
small_bytes=0 (always the ring) and small_bytes=2**62 (the one-shot path wherever the
message fits one slot; the buffer is the default 4 MiB). For every collective and size
each rank first checks both results against the values it computes itself (the inputs of
ringcoll-bench: small integers, exact in every summation order), then runs --blocks
rounds of: a barrier, --calls out-of-place calls on the ring, a barrier, --calls on the
one-shot path. A block's time is the slowest rank's mean per call. The table gives, per
size, the median and the 10th percentile over blocks of each, and one-shot / ring.
`ringcoll-bench --algorithm ring|oneshot` times the two paths in separate runs instead.
The recorded run is bench/results/2026-12-01-cpu-small-message-crossover.txt.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

ALWAYS_ONE_SHOT = 1 << 62


def _percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def rank_main(rank, world, args):
    import torch
    import torch.distributed as dist

    import ringcoll
    from ringcoll._types import DTYPES
    from ringcoll.harness.bench import COLLECTIVES, TorchBackend, _buffers, expected_result, message_counts, Config

    config = Config(min_bytes=args.min_bytes, max_bytes=args.max_bytes, factor=2, dtype=args.dtype)
    dtype = DTYPES[args.dtype]
    rows = []
    with ringcoll.Communicator(small_bytes=0) as ring, ringcoll.Communicator(small_bytes=ALWAYS_ONE_SHOT) as one:
        backends = {"ring": TorchBackend(ring), "oneshot": TorchBackend(one)}
        for name in args.collectives.split(","):
            coll = COLLECTIVES[name]
            for count in message_counts(config, world):
                expected = expected_result(coll, rank, world, count, dtype, "sum")
                calls, times = {}, {"ring": [], "oneshot": []}
                for label, backend in backends.items():
                    inp, out, result = _buffers(coll, count, world, rank, dtype, "sum", in_place=False)
                    calls[label] = (lambda b=backend, i=inp, o=out: b.run(name, i, o, "sum", False, rank, world))
                    before = one.transport.one_shot_calls
                    calls[label]()
                    if not torch.equal(result, expected):
                        raise AssertionError(f"{label} {name} count={count}: wrong result on rank {rank}")
                    if (one.transport.one_shot_calls - before) != (label == "oneshot"):
                        raise AssertionError(f"{label} {name} count={count}: took the other path")
                for _ in range(args.blocks):
                    for label in ("ring", "oneshot"):
                        ring.barrier()
                        for _ in range(3):
                            calls[label]()
                        start = time.perf_counter()
                        for _ in range(args.calls):
                            calls[label]()
                        t = torch.tensor([(time.perf_counter() - start) / args.calls * 1e6], dtype=torch.float64)
                        dist.all_reduce(t, op=dist.ReduceOp.MAX)
                        times[label].append(float(t))
                rows.append((name, count * dtype.itemsize, times))
    return rows


def main(argv=None) -> int:
    from ringcoll.communicator import parse_bytes
    from ringcoll.harness.launcher import spawn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--collectives", default="all_reduce,reduce_scatter,all_gather")
    p.add_argument("--blocks", type=int, default=15, help="timed blocks per algorithm and size")
    p.add_argument("--calls", type=int, default=50, help="calls per block")
    p.add_argument("-b", "--minbytes", default="1K")
    p.add_argument("-e", "--maxbytes", default="512K")
    args = p.parse_args(argv)
    args.min_bytes, args.max_bytes = parse_bytes(args.minbytes), parse_bytes(args.maxbytes)
    rows = spawn(rank_main, args.nproc, args, timeout=3600)[0]
    print(f"# one-shot vs ring, P = {args.nproc}, {args.dtype}, SUM, CPU shared memory, out-of-place; us per call "
          f"(a block: {args.calls} calls, the slowest rank's mean); {args.blocks} blocks each, ring and one-shot "
          "in turn; med = median over blocks, p10 = 10th percentile (the quieter moments of a shared machine)")
    current = None
    for name, nbytes, times in rows:
        if name != current:
            current = name
            print(f"\n# {name}\n# {'size':>9} | {'ring med':>8} {'1shot med':>9} {'ratio':>5} | {'ring p10':>8} "
                  f"{'1shot p10':>9} {'ratio':>5}")
        r, o = times["ring"], times["oneshot"]
        rm, om, rp, op = statistics.median(r), statistics.median(o), _percentile(r, 0.1), _percentile(o, 0.1)
        print(f"  {nbytes:>9} | {rm:8.1f} {om:9.1f} {om / rm:5.2f} | {rp:8.1f} {op:9.1f} {op / rp:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
