"""Where the one-shot path stops paying: ringcoll-bench --algorithm ring and --algorithm
oneshot, run in turn several times, and the median time per size of each.

    python bench/small_crossover.py --nproc 2 --dtype float32 --rounds 3 [-b 1K -e 1M]

Each round runs the two algorithms back to back (ring first, then one-shot), so a slow
phase of a shared machine hits both; the table gives, per collective and size, the median
over rounds of ringcoll-bench's out-of-place time (itself the slowest rank's, median of
--trials loops), in-place beside it, and one-shot / ring. The recorded run is
bench/results/2026-12-01-cpu-small-message-crossover.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run(args, algorithm: str, path: str) -> dict:
    cmd = [sys.executable, "-m", "ringcoll.harness.bench", "-b", args.minbytes, "-e", args.maxbytes, "--nproc",
           str(args.nproc), "--dtype", args.dtype, "--collectives", args.collectives, "--no-gloo", "--no-mpi",
           "--no-check-cost", "--no-progress", "--trials", str(args.trials), "--min-ms", str(args.min_ms),
           "--algorithm", algorithm, "--json", path]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--collectives", default="all_reduce,reduce_scatter,all_gather")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--min-ms", type=float, default=10.0)
    p.add_argument("-b", "--minbytes", default="1K")
    p.add_argument("-e", "--maxbytes", default="1M")
    args = p.parse_args(argv)
    times: dict = {}  # (algorithm, collective, bytes, form) -> [us per round]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for algorithm in ("ring", "oneshot"):
                doc = run(args, algorithm, os.path.join(tmp, f"{algorithm}-{r}.json"))
                for row in doc["rows"]:
                    if row.get("out_wrong") or row.get("in_wrong"):
                        raise SystemExit(f"wrong results: {row}")
                    for form in ("out", "in"):
                        times.setdefault((algorithm, row["collective"], row["bytes"], form), []).append(
                            row[f"{form}_time_us"])
    print(f"# one-shot vs ring, P = {args.nproc}, {args.dtype}, CPU shared memory: median over {args.rounds} rounds "
          f"of ringcoll-bench's time (us; each the slowest rank's, median of {args.trials} loops)")
    for coll in args.collectives.split(","):
        print(f"\n# {coll}\n# {'size':>9} | {'ring out':>9} {'1shot out':>9} {'ratio':>6} | {'ring in':>9} "
              f"{'1shot in':>9} {'ratio':>6} | 1shot out-of-place per round")
        for size in sorted({k[2] for k in times if k[1] == coll}):
            med = {(a, f): statistics.median(times[(a, coll, size, f)]) for a in ("ring", "oneshot")
                   for f in ("out", "in")}
            rounds = " ".join(f"{t:.1f}" for t in times[("oneshot", coll, size, "out")])
            print(f"  {size:>9} | {med['ring', 'out']:9.1f} {med['oneshot', 'out']:9.1f} "
                  f"{med['oneshot', 'out'] / med['ring', 'out']:6.2f} | {med['ring', 'in']:9.1f} "
                  f"{med['oneshot', 'in']:9.1f} {med['oneshot', 'in'] / med['ring', 'in']:6.2f} | {rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
