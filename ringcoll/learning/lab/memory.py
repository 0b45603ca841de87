"""``ringcoll lab memory``: the memory ledger against real DDP and ZeRO-1/2 runs.

``ringcoll memory --measure`` counts one process. This experiment trains on P ranks and
counts, on every rank after a few Adam steps, the bytes of the tensors that make up the
model states, beside ``ringcoll.learning.memory.ledger`` for the same N, P and stage:

    ddp     torch DDP (gradient_as_bucket_view: the gradients are DDP's buckets) + Adam
    zero1   ringcoll.training.zero.ShardedOptimizer(stage=1): optimizer state / P
    zero2   stage 2: gradients / P as well

in fp32 (the ledger's 4N / 4N / 8N) and, for ZeRO, in bf16 with fp32 master shards (the
ZeRO paper's 2N / 2N / 12N, the ledger's ``mixed+master``: bf16 weights and gradients, fp32
master + Adam m and v; the seed counts 2N / 2N / 8N, without the master). Gradients
are counted after the step: stage 1 keeps the full ``p.grad`` (the shard's ``.grad`` lives
only inside ``step()``); stage 2 keeps the shards, and the count adds the full-size buckets
that were alive at once during backward (``peak_flat_grad_buckets``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import common

NAME = "memory"
SYSTEMS = (("ddp", "fp32"), ("zero1", "fp32"), ("zero2", "fp32"), ("zero1", "bf16"), ("zero2", "bf16"))
LEDGER_PRECISION = {"fp32": "fp32", "bf16": "mixed+master"}


@dataclass(frozen=True)
class Config:
    worlds: Tuple[int, ...] = (2, 4)
    hidden: Tuple[int, ...] = (512, 512, 512)
    steps: int = 3
    bucket_mb: float = 0.25
    progress: bool = True


QUICK = Config(worlds=(2,), hidden=(64, 64), steps=2, bucket_mb=0.01)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _train(model, opt, rank: int, world: int, steps: int, dtype, before_last_step=None) -> None:
    stream = common.batches(0, rank, world, 16)
    for step in range(steps):
        x, y = next(stream)
        torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y).backward()
        if step == steps - 1 and before_last_step is not None:
            before_last_step()
        opt.step()
        if step < steps - 1:
            opt.zero_grad()


def _measure(cfg: Config, rank: int, world: int, system: str, precision: str) -> Dict:
    from torch.nn.parallel import DistributedDataParallel

    from ringcoll.training.zero import ShardedOptimizer

    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model = common.make_model(cfg.hidden, seed=0).to(dtype)
    n = sum(p.numel() for p in model.parameters())
    if system == "ddp":
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=cfg.bucket_mb)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        _train(ddp, opt, rank, world, cfg.steps, dtype)
        state = [v for st in opt.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
        counters = [v for st in opt.state.values() for k, v in st.items() if k == "step"]
        got = {"weights": _bytes(model.parameters()), "gradients": _bytes(p.grad for p in model.parameters()),
               "optimizer_state": _bytes(state), "step_counters": _bytes(counters)}
        stage = 0
    else:
        stage = int(system[-1])
        opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, stage=stage,
                               bucket_bytes=int(cfg.bucket_mb * 2**20), lr=1e-3)
        held: Dict = {}

        def gradients_held() -> None:  # at their fullest: before step(), which consumes stage 2's shards
            if stage == 2:
                opt.reduce_gradients()
            held.update(opt.memory_report())

        _train(model, opt, rank, world, cfg.steps, dtype, before_last_step=gradients_held)
        rep = opt.memory_report()
        counters = 4 * len(opt.buckets)  # Adam's float32 step, one per bucket
        padding = sum(b.padded - b.numel for b in opt.buckets)
        got = {"weights": rep["weights"],
               # stage 1: the full p.grad; stage 2: the shards plus the full-size buckets alive at once
               "gradients": held["param_grads"] + held["shard_grads"] + rep["peak_flat_grad_buckets"],
               "optimizer_state": rep["master_weights"] + rep["optimizer_state"] - counters,
               "step_counters": counters, "padding_elements": padding, "buckets": len(opt.buckets),
               "gradient_shards": held["shard_grads"], "gradient_buckets_in_flight": rep["peak_flat_grad_buckets"],
               "bucket_bytes": int(cfg.bucket_mb * 2**20), "max_buckets_in_flight": opt.max_buckets_in_flight}
    from ringcoll.learning.memory import ledger

    led = ledger(n, world, stage, precision=LEDGER_PRECISION[precision])
    return {"system": system, "precision": precision, "world": world, "rank": rank, "params": n,
            "measured": got, "ledger": {"weights": led.weights, "gradients": led.gradients,
                                        "optimizer_state": led.optimizer_state}}


def _job(rank: int, world: int, cfg: Config) -> Optional[List[Dict]]:
    common.one_thread()
    bar = common.progress(len(SYSTEMS), f"memory P={world}", enabled=rank == 0 and cfg.progress)
    mine = []
    for system, precision in SYSTEMS:
        mine.append(_measure(cfg, rank, world, system, precision))
        bar.update()
    bar.close()
    everyone: List = [None] * world
    dist.all_gather_object(everyone, mine)
    return [m for per_rank in everyone for m in per_rank] if rank == 0 else None


TERMS = ("weights", "gradients", "optimizer_state")


def format_table(rows: Sequence[Dict]) -> str:
    out = []
    for r in rows:
        if r["rank"]:
            continue  # every rank's figures are in the JSON; rank 0's are printed
        m, led = r["measured"], r["ledger"]
        cells = [f"{m[t] / 1e6:.3f} / {led[t] / 1e6:.3f}" for t in TERMS]
        total_m, total_l = sum(m[t] for t in TERMS), sum(led[t] for t in TERMS)
        out.append([f"{r['system']} {r['precision']}", r["world"], *cells,
                    f"{total_m / 1e6:.3f} / {total_l / 1e6:.3f}", f"{total_m / total_l:.3f}"])
    head = ["system", "P", "weights MB", "gradients MB", "optimizer state MB", "total MB", "measured / ledger"]
    return "measured / ledger per rank, rank 0 (MB = 1e6 bytes)\n" + common.table(head, out)


def findings(rows: Sequence[Dict]) -> List[str]:
    lines = []
    for r in rows:
        if r["rank"]:
            continue
        m = r["measured"]
        for t in TERMS:
            ratio = m[t] / r["ledger"][t]
            if abs(ratio - 1) <= 0.05:
                continue
            line = f"{r['system']} {r['precision']} P = {r['world']}: {t} {ratio:.2f} x the ledger"
            if t == "gradients" and r["system"] == "zero2":
                shard_dtype = "fp32, the master's dtype" if r["precision"] == "bf16" else "fp32"
                line += (f": the shards {m['gradient_shards'] / 1e6:.3f} MB ({shard_dtype}; ledger "
                         f"{r['ledger']['gradients'] / 1e6:.3f}) plus {m['gradient_buckets_in_flight'] / 1e6:.3f} MB "
                         f"of full-size buckets alive at once during backward (at most max_buckets_in_flight + 1 = "
                         f"{m['max_buckets_in_flight'] + 1} buckets of about {m['bucket_bytes'] / 1e6:.3f} MB, or one "
                         f"parameter where it is larger), which the ledger leaves out")
            lines.append(line)
    return lines or ["every term within 5% of the ledger"]


def plot(rows: Sequence[Dict], out_dir: str) -> str:
    fig, (ax,) = common.new_figure(1, width=8)
    shown = [r for r in rows if not r["rank"]]
    labels = [f"{r['system']}\n{r['precision']} P={r['world']}" for r in shown]
    bottom = [0.0] * len(shown)
    for t in TERMS:
        values = [r["measured"][t] / 1e6 for r in shown]
        ax.bar(range(len(shown)), values, 0.6, bottom=bottom, label=f"{t} (measured)")
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.plot(range(len(shown)), [sum(r["ledger"][t] for t in TERMS) / 1e6 for r in shown], "k_", ms=30,
            mew=2, label="ledger total")
    ax.set_xticks(range(len(shown)), labels, fontsize=7)
    ax.set(ylabel="MB per rank")
    ax.legend(fontsize=7)
    return common.save_figure(fig, out_dir, NAME)


def run(cfg: Config, out_dir: str = "lab-results", timeout: float = 1200.0) -> Dict:
    if min(cfg.worlds) < 2:
        raise ValueError(f"lab memory: every world size must be at least 2, got {list(cfg.worlds)}")
    rows: List[Dict] = []
    for world in cfg.worlds:
        rows += common.launch(_job, world, cfg, timeout, backend="ringcoll")
    print(f"MLP 64-{'-'.join(map(str, cfg.hidden))}-10 ({rows[0]['params']:,} parameters), Adam, "
          f"{cfg.steps} steps, buckets of {cfg.bucket_mb:g} MiB")
    print(format_table(rows), end="")
    lines = findings(rows)
    for line in lines:
        print(f"* {line}")
    record = {"experiment": NAME, "config": dataclasses.asdict(cfg), "rows": rows, "findings": lines}
    record["json"] = common.write_record(out_dir, NAME, record)
    record["plot"] = plot(rows, out_dir)
    print(f"wrote {record['json']} and {record['plot']}")
    return record
