"""Where a CPU path stops paying: two Communicators that differ in one threshold, timed in
turn in the same processes, block by block, so that a busy moment of a shared machine hits
both.

    python bench/crossover.py --paths oneshot --nproc 2 --dtype float32 [-b 1K -e 512K] [--blocks 15]
    python bench/crossover.py --paths direct --nproc 2 --collectives all_gather -b 128K -e 32M

--paths oneshot: small_bytes=0 (always the ring) against small_bytes=2**62 (the one-shot
path wherever the message fits one slot), no direct reads in either. --paths direct:
direct_bytes=0 (all-gather through the slots: the one-shot path, then the ring) against
direct_bytes=1 and small_bytes=0 (every all-gather reads its peers directly, also where the
one-shot path would go first because the ranks outnumber the cores; RINGCOLL_DIRECT_MAX_BYTES
lifted, so that the table shows where both default bounds come from). The buffer is the default 4 MiB. For
every collective and size each rank first checks both results against the values it
computes itself (the inputs of ringcoll-bench: small integers, exact in every summation
order) and that each communicator took the path it should, then runs --blocks rounds of: a
barrier, --calls out-of-place calls on the first, a barrier, --calls on the second. A
block's time is the slowest rank's mean per call. The table gives, per size, the median
and the 10th percentile over blocks of each, and second / first.
`ringcoll-bench --small-bytes 0|1G` and `--direct-bytes 0|1` time the paths in separate
runs instead. The recorded runs: bench/results/2026-12-01-cpu-small-message-crossover.txt
(one-shot), bench/results/2026-12-01-cpu-direct-read.txt (direct).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ALWAYS_ONE_SHOT = 1 << 62
# --paths: (label, Communicator settings, transport counter of calls that took the path) x 2;
# the second is the path being measured, the first what it replaces.
PATHS = {  # native's paths (auto might run a plan where its table says)
    "oneshot": (("ring", {"small_bytes": 0, "direct_bytes": 0, "algorithm": "native"}),
                ("oneshot", {"small_bytes": ALWAYS_ONE_SHOT, "direct_bytes": 0, "algorithm": "native"}),
                "one_shot_calls"),
    "direct": (("slots", {"direct_bytes": 0, "algorithm": "native"}),
               ("direct", {"direct_bytes": 1, "small_bytes": 0, "algorithm": "native"}), "direct_calls"),
}
# Environment of the ranks: the direct path without its upper bound, which is what this measures.
PATH_ENV = {"direct": {"RINGCOLL_DIRECT_MAX_BYTES": str(1 << 62)}}


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
    os.environ.update(PATH_ENV.get(args.paths, {}))
    (base, base_settings), (path, path_settings), counter = PATHS[args.paths]
    with ringcoll.Communicator(**base_settings) as first, ringcoll.Communicator(**path_settings) as second:
        comms = {base: first, path: second}
        backends = {label: TorchBackend(comm) for label, comm in comms.items()}
        for name in args.collectives.split(","):
            coll = COLLECTIVES[name]
            for count in message_counts(config, world):
                expected = expected_result(coll, rank, world, count, dtype, "sum")
                calls, times = {}, {base: [], path: []}
                for label, backend in backends.items():
                    inp, out, result = _buffers(coll, count, world, rank, dtype, "sum", in_place=False, device="cpu")
                    calls[label] = (lambda b=backend, i=inp, o=out: b.run(name, i, o, "sum", False, rank, world))
                    before = getattr(second.transport, counter)
                    calls[label]()
                    if not torch.equal(result, expected):
                        raise AssertionError(f"{label} {name} count={count}: wrong result on rank {rank}")
                    if (getattr(second.transport, counter) - before) != (label == path):
                        raise AssertionError(f"{label} {name} count={count}: took the other path")
                for _ in range(args.blocks):
                    for label in (base, path):
                        first.barrier()
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
    p.add_argument("--paths", choices=list(PATHS), default="oneshot",
                   help="which threshold: oneshot (ring vs one-shot) or direct (all-gather: slots vs direct reads)")
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
    (base, _), (path, _), _ = PATHS[args.paths]
    print(f"# {path} vs {base}, P = {args.nproc}, {args.dtype}, SUM, CPU shared memory, out-of-place; us per call "
          f"(a block: {args.calls} calls, the slowest rank's mean); {args.blocks} blocks each, {base} and {path} "
          "in turn; med = median over blocks, p10 = 10th percentile (the quieter moments of a shared machine)")
    current = None
    for name, nbytes, times in rows:
        if name != current:
            current = name
            print(f"\n# {name}\n# {'size':>9} | {base + ' med':>11} {path + ' med':>11} {'ratio':>5} | "
                  f"{base + ' p10':>11} {path + ' p10':>11} {'ratio':>5}")
        b, q = times[base], times[path]
        bm, qm, bp, qp = statistics.median(b), statistics.median(q), _percentile(b, 0.1), _percentile(q, 0.1)
        print(f"  {nbytes:>9} | {bm:11.1f} {qm:11.1f} {qm / bm:5.2f} | {bp:11.1f} {qp:11.1f} {qp / bp:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
