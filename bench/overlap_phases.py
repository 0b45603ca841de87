"""Where a data-parallel step's time goes, phase by phase: forward, backward, optimizer step,
zero_grad, for the model of ``ringcoll lab overlap`` (digits MLP, 2.18 M parameters), on P
ranks of the ringcoll backend, with no communication (plain), DDP (its own overlap, or a
comm hook that waits: "ddp-none") and ZeRO-2, buckets of 25% of the model. Medians of 30
steps after 10 warm-up ones, per rank. Used for the overlap section of docs/training.md.

    python bench/overlap_phases.py [P]
"""

import statistics
import sys
import time

import torch

from ringcoll.harness.launcher import spawn
from ringcoll.learning.lab import common, overlap

VARIANTS = ("plain", "ddp", "ddp-none", "zero2")
WARM_UP, STEPS = 10, 30


# variant -> the lab's (system, overlap mode); "plain" has no communication at all
SETUPS = {"ddp": ("ddp", "overlap"), "ddp-none": ("ddp", "no overlap"), "zero2": ("zero2", "reduce-scatter")}


def _setup(name, cfg):
    if name == "plain":
        model = common.make_model(cfg.hidden, 0)
        return model, torch.optim.SGD(model.parameters(), lr=0.01)
    s = overlap.setup(cfg, *SETUPS[name], overlap.bucket_bytes(cfg, 0.25))
    return s.model, s.opt


def _phases(rank, world):
    common.one_thread()
    cfg = overlap.Config()
    out = {}
    for name in VARIANTS:
        model, opt = _setup(name, cfg)
        stream = common.batches(0, rank, world, cfg.batch)
        times = {"forward": [], "backward": [], "step": [], "zero_grad": []}
        for i in range(WARM_UP + STEPS):
            x, y = next(stream)
            t0 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            opt.zero_grad()
            t4 = time.perf_counter()
            if i >= WARM_UP:
                for key, a, b in (("forward", t0, t1), ("backward", t1, t2), ("step", t2, t3), ("zero_grad", t3, t4)):
                    times[key].append(b - a)
        out[name] = {k: statistics.median(v) for k, v in times.items()}
    return out


def main():
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    per_rank = spawn(_phases, world, backend="ringcoll", env={"OMP_NUM_THREADS": "1"}, timeout=600)
    print(f"ms per phase, median of {STEPS} steps, P = {world} on {common.cores()} cores")
    rows = [[name, rank, *(f"{1e3 * t:.2f}" for t in phases[name].values())]
            for name in VARIANTS for rank, phases in enumerate(per_rank)]
    print(common.table(["variant", "rank", "forward", "backward", "step", "zero_grad"], rows), end="")


if __name__ == "__main__":
    main()
