"""``ringcoll lab overlap``: how much of a step is communication, and how much overlap hides.

The seed chapter (2.2, 2.4) says communication takes 15-25% of an iteration (10-18% with
ZeRO-2), and that overlapping ZeRO's all-gather with the next forward and raising the
bucket from 25 to 50 MB moved a 64-card job from 45% to 72% of linear speedup. This
experiment measures, on P CPU ranks, one model trained with

    ddp      torch's DistributedDataParallel on the "ringcoll" backend: each bucket's
             all-reduce starts during backward (overlap), or, with a comm hook that waits
             for each all-reduce before backward goes on, does not (no overlap);
    zero2    ringcoll.training.zero.ShardedOptimizer(stage=2): no overlap (each bucket's
             reduce-scatter waited for at once), reduce-scatter overlapped with backward,
             or that plus the parameter all-gather overlapped with the next forward
             (prefetch_params: the all-gather of bucket k+1 runs while layer k computes);

for bucket sizes of 1, 4, 25 and 50% of the model (the seed's 1, 4, 25, 50 MB scaled to a
100 MB model). Everything is measured in the same processes, one after another:

    T_compute   forward + backward + SGD step with no communication at all (the gradient
                tensors kept from step to step, as DDP keeps its buckets)
    T_comm      the step's collectives alone, back to back (the same bucket sizes)
    T_step      one training step as configured
    communication's share, had nothing overlapped = T_comm / T_step
    what the step adds to compute = (T_step - T_compute) / T_step (the collectives, and also
        the copies into buckets, the wrappers' bookkeeping and contention for the cores)
    hidden by overlap = (T_compute + T_comm - T_step) / T_comm (negative: the step added
        more than the collectives alone cost)

and beside it the alpha-beta prediction (ringcoll.learning.model, alpha and beta fitted to
all-reduces timed in the same run): no overlap T_compute + T_comm_model, perfect overlap
max(T_compute, T_comm_model).

Overlap needs two things at once: the cores computing backward and something moving the
bytes. On a CPU the "something" is a core too: ringcoll's copies run on the communicator's
worker thread, which competes with the compute for this machine's two cores. A GPU has
copy engines (or NVLink SMs) beside its compute, which is the case the seed describes.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import common

NAME = "overlap"
MODES = {"ddp": ("no overlap", "overlap"), "zero2": ("no overlap", "reduce-scatter", "reduce-scatter + all-gather")}
SEED_MODEL_BYTES = 100e6  # the seed's bucket sizes (1, 4, 25, 50 MB) are for a model of this size


@dataclass(frozen=True)
class Config:
    worlds: Tuple[int, ...] = (2, 4)
    hidden: Tuple[int, ...] = (1024, 1024, 1024)
    batch: int = 32  # per rank
    bucket_fractions: Tuple[float, ...] = (0.01, 0.04, 0.25, 0.50)
    steps: int = 20  # timed steps per configuration and round (after warm-up ones)
    warm_up: int = 3
    rounds: int = 3  # each configuration's time is its median over rounds
    systems: Tuple[str, ...] = ("ddp", "zero2")
    progress: bool = True


QUICK = Config(worlds=(2,), hidden=(256, 256), bucket_fractions=(0.04, 0.5), steps=3, warm_up=1, rounds=1)


def _model(cfg: Config) -> torch.nn.Module:
    return common.make_model(cfg.hidden, seed=0)


def model_bytes(cfg: Config) -> int:
    return 4 * common.parameter_count(cfg.hidden)


def bucket_bytes(cfg: Config, fraction: float) -> int:
    return max(4096, int(fraction * model_bytes(cfg)))


def bucket_sizes(total: int, cap: int) -> List[int]:
    """How a gradient of ``total`` bytes is cut into buckets of at most ``cap`` (approx.:
    the real cut follows parameter boundaries)."""
    full, rest = divmod(total, cap)
    return [cap] * full + ([rest] if rest else [])


# --- what each rank runs -------------------------------------------------------------------------


def _blocking_allreduce_hook(state, bucket):
    """DDP without overlap: the bucket's all-reduce is waited for before backward goes on
    (no annotations: DDP compares them with its own types as objects)."""
    tensor = bucket.buffer()
    dist.all_reduce(tensor)
    tensor.div_(dist.get_world_size())
    fut = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def _time_steps(cfg: Config, model: torch.nn.Module, opt, stream, after=None) -> float:
    """The mean time of ``steps`` consecutive steps, after ``warm_up`` untimed ones.
    Consecutive, not one by one, because prefetching moves the wait for a step's all-gather into the next
    step's forward."""
    for i in range(cfg.warm_up + cfg.steps):
        if i == cfg.warm_up:
            dist.barrier()
            start = time.perf_counter()
        x, y = next(stream)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    if after is not None:
        after()
    return (time.perf_counter() - start) / cfg.steps


class _KeepGrads(torch.optim.SGD):
    """SGD whose zero_grad keeps the gradient tensors (as DDP's bucket views do): a backward
    that must allocate, and so fault in, 8.7 MB of fresh gradients each step costs up to
    3 ms more on this machine, which is not communication."""

    def zero_grad(self, set_to_none: bool = False) -> None:
        super().zero_grad(set_to_none=False)


def _compute_only(cfg: Config, rank: int, world: int) -> float:
    model = _model(cfg)
    opt = _KeepGrads(model.parameters(), lr=0.01)
    return _time_steps(cfg, model, opt, common.batches(0, rank, world, cfg.batch))


class Setup(NamedTuple):
    model: torch.nn.Module  # what the forward calls (the DDP wrapper, for ddp)
    opt: torch.optim.Optimizer
    after: Optional[Callable[[], None]]  # what the last timed step still waits for
    params: List[torch.Tensor]  # the weights, for the replicas' digest


def setup(cfg: Config, system: str, mode: str, cap: int) -> Setup:
    """The model and optimizer of one configuration (collective: DDP and ZeRO both
    broadcast rank 0's weights)."""
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(_model(cfg), bucket_cap_mb=cap / 2**20, gradient_as_bucket_view=True)
        if mode == "no overlap":
            model.register_comm_hook(None, _blocking_allreduce_hook)
        params = list(model.module.parameters())
        return Setup(model, torch.optim.SGD(params, lr=0.01), None, params)
    from ringcoll.training.zero import ShardedOptimizer

    model = _model(cfg)
    opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=2, bucket_bytes=cap, lr=0.01)
    if mode == "no overlap":
        opt.max_buckets_in_flight = 0  # each reduce-scatter waited for as soon as it starts
    if mode == "reduce-scatter + all-gather":
        opt.prefetch_params(model)
    return Setup(model, opt, opt.wait_for_params, list(model.parameters()))


def _configuration(cfg: Config, rank: int, world: int, system: str, mode: str, cap: int) -> Tuple[float, str]:
    """One configuration's time per step, and the digest of the weights it ends with."""
    s = setup(cfg, system, mode, cap)
    t = _time_steps(cfg, s.model, s.opt, common.batches(0, rank, world, cfg.batch), after=s.after)
    return t, common.digest(s.params)


def _comm_alone(cfg: Config, system: str, cap: int, world: int, reps: int = 5) -> float:
    """The step's collectives with no compute: all-reduce (ddp) or reduce-scatter then
    all-gather (zero2) of every bucket, one after another; the median of ``reps``."""
    from ringcoll import api

    sizes = bucket_sizes(model_bytes(cfg), cap)
    tensors = [torch.zeros(-(-n // (4 * world)) * world) for n in sizes]
    shards = [torch.zeros(t.numel() // world) for t in tensors]
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        start = time.perf_counter()
        for t, s in zip(tensors, shards):
            if system == "ddp":
                dist.all_reduce(t)
            else:
                api.reduce_scatter_tensor(s, t)
                api.all_gather_into_tensor(t, s)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _fit_all_reduce(world: int) -> Tuple[float, float, List[Tuple[int, float]]]:
    """alpha, beta of ringcoll's all-reduce on this machine now (ringcoll.learning.model.fit)."""
    from ringcoll.learning import model

    points = []
    for nbytes in (16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20):
        t = torch.zeros(nbytes // 4)
        reps = []
        for _ in range(6):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            reps.append(time.perf_counter() - start)
        points.append((nbytes, statistics.median(reps[1:])))
    f = model.fit("all_reduce", world, [n for n, _ in points], [t for _, t in points])
    return f.alpha, f.beta, points


def _job(rank: int, world: int, cfg: Config) -> Optional[Dict]:
    common.one_thread()
    common.digits()  # load before anything is timed
    configs = [(s, fr, m) for s in cfg.systems for fr in cfg.bucket_fractions for m in MODES[s]]
    bar = common.progress(cfg.rounds * (len(configs) + 1), f"overlap P={world}", enabled=rank == 0 and cfg.progress)
    alpha, beta, points = _fit_all_reduce(world)
    # Rounds: every configuration once per round, the median over rounds kept, so a slow
    # second of this VM lands on one sample of each configuration, not on all of one.
    compute, steps, comms, digests = [], [[] for _ in configs], [[] for _ in configs], [None] * len(configs)
    for _ in range(cfg.rounds):
        compute.append(_compute_only(cfg, rank, world))
        bar.update()
        for i, (system, fraction, mode) in enumerate(configs):
            cap = bucket_bytes(cfg, fraction)
            step, digests[i] = _configuration(cfg, rank, world, system, mode, cap)
            steps[i].append(step)
            comms[i].append(_comm_alone(cfg, system, cap, world))
            bar.update()
    bar.close()
    rows = [{"system": system, "bucket_fraction": fraction, "bucket_bytes": bucket_bytes(cfg, fraction), "mode": mode,
             "step_s": statistics.median(steps[i]), "comm_s": statistics.median(comms[i]), "digest": digests[i]}
            for i, (system, fraction, mode) in enumerate(configs)]
    everyone: List = [None] * world
    dist.all_gather_object(everyone, {"compute_s": statistics.median(compute), "rows": rows})
    if rank:
        return None
    return _combine(cfg, world, alpha, beta, points, everyone)


def _combine(cfg: Config, world: int, alpha: float, beta: float, points, everyone: Sequence[Dict]) -> Dict:
    """Per configuration, the slowest rank's times (a synchronous step is the slowest's)."""
    from ringcoll.learning.model import Fit

    fit = Fit(alpha=alpha, beta=beta)
    compute = max(r["compute_s"] for r in everyone)
    rows = []
    for i, row in enumerate(everyone[0]["rows"]):
        step = max(r["rows"][i]["step_s"] for r in everyone)
        comm = max(r["rows"][i]["comm_s"] for r in everyone)
        predicted_comm = sum(fit.predict("all_reduce", world, n) for n in bucket_sizes(model_bytes(cfg),
                                                                                       row["bucket_bytes"]))
        exposed = step - compute
        rows.append({**row, "step_s": step, "comm_s": comm,
                     "compute_s": compute, "exposed_s": exposed, "comm_share_pct": 100 * exposed / step,
                     "hidden_pct": 100 * (compute + comm - step) / comm,
                     "model_no_overlap_s": compute + predicted_comm, "model_perfect_s": max(compute, predicted_comm),
                     "replicas_identical": len({r["rows"][i]["digest"] for r in everyone}) == 1})
    return {"world": world, "compute_s": compute, "alpha_s": alpha, "beta_bytes_per_s": beta,
            "fit_points": points, "rows": rows}


# --- the report ------------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f}"


def format_table(cfg: Config, result: Dict) -> str:
    head = ["system", "bucket", "overlap", "step ms", "comm alone ms", "comm alone / step %",
            "step over compute %", "hidden %", "model: none / perfect ms"]
    rows = [[r["system"], f"{100 * r['bucket_fraction']:g}% ({r['bucket_bytes'] / 1e6:.2f} MB)", r["mode"],
             _ms(r["step_s"]), _ms(r["comm_s"]), f"{100 * r['comm_s'] / r['step_s']:.1f}",
             f"{r['comm_share_pct']:.1f}", f"{r['hidden_pct']:.0f}",
             f"{_ms(r['model_no_overlap_s'])} / {_ms(r['model_perfect_s'])}"] for r in result["rows"]]
    title = (f"P = {result['world']}: compute alone {_ms(result['compute_s'])} ms per step; fitted all-reduce "
             f"alpha {1e6 * result['alpha_s']:.1f} us, beta {result['beta_bytes_per_s'] / 1e9:.2f} GB/s\n")
    return title + common.table(head, rows)


def findings(cfg: Config, results: Sequence[Dict]) -> List[str]:
    out = []
    for res in results:
        for system in cfg.systems:
            rows = [r for r in res["rows"] if r["system"] == system]
            alone = [100 * r["comm_s"] / r["step_s"] for r in rows if r["mode"] == "no overlap"]
            over = [r["comm_share_pct"] for r in rows if r["mode"] == "no overlap"]
            best = min(rows, key=lambda r: r["step_s"])
            out.append(f"P = {res['world']}, {system}: the collectives alone take {min(alone):.0f}-{max(alone):.0f}% "
                       f"of a step without overlap (the seed: 15-25%, 10-18% with ZeRO-2), while the step exceeds "
                       f"compute alone by {min(over):.0f}-{max(over):.0f}% of itself (the collectives plus bucket "
                       f"copies, bookkeeping and contention for the cores); the fastest configuration is "
                       f"{best['mode']}, bucket {100 * best['bucket_fraction']:g}%, "
                       f"{best['step_s'] / res['compute_s']:.2f} x compute alone")
    out.append("the 2-core machine: compute and ringcoll's copies share the same cores, so overlap can hide "
               "communication only while a core is idle; with a copy engine beside the compute (a GPU), the "
               "model's perfect-overlap column is the bound")
    return out


def plot(cfg: Config, results: Sequence[Dict], out_dir: str) -> str:
    fig, axes = common.new_figure(len(results))
    for ax, res in zip(axes, results):
        for system in cfg.systems:
            for mode in MODES[system]:
                rows = [r for r in res["rows"] if r["system"] == system and r["mode"] == mode]
                ax.plot([100 * r["bucket_fraction"] for r in rows], [1e3 * r["step_s"] for r in rows], "o-",
                        label=f"{system}, {mode}")
        ax.axhline(1e3 * res["compute_s"], color="k", ls=":", label="compute alone")
        ax.set(xscale="log", xlabel="bucket, % of the model", ylabel="ms per step", title=f"P = {res['world']}")
        ax.legend(fontsize=7)
    return common.save_figure(fig, out_dir, NAME)


def run(cfg: Config, out_dir: str = "lab-results", timeout: float = 3600.0) -> Dict:
    """Run the experiment for each world size; print the tables; write overlap.json/.png."""
    unknown = set(cfg.systems) - set(MODES)
    if unknown:
        raise ValueError(f"lab overlap: unknown system(s) {sorted(unknown)}; choose from {list(MODES)}")
    if min(cfg.worlds) < 2:
        raise ValueError(f"lab overlap: every world size must be at least 2, got {list(cfg.worlds)}")
    n = model_bytes(cfg) // 4
    print(f"MLP 64-{'-'.join(map(str, cfg.hidden))}-10 ({n:,} parameters, {4 * n / 1e6:.1f} MB of fp32 gradients), "
          f"batch {cfg.batch} per rank, SGD; {cfg.steps} timed steps per configuration, median of {cfg.rounds} "
          f"rounds; "
          f"P = {', '.join(map(str, cfg.worlds))} on {common.cores()} cores", flush=True)
    results = []
    for world in cfg.worlds:
        res = common.launch(_job, world, cfg, timeout, backend="ringcoll")
        results.append(res)
        if world > common.cores():
            print(f"(P = {world} is oversubscribed: more ranks than cores)")
        print(format_table(cfg, res), end="")
    lines = findings(cfg, results)
    for line in lines:
        print(f"* {line}")
    record = {"experiment": NAME, "config": dataclasses.asdict(cfg), "model_bytes": model_bytes(cfg),
              "results": results, "findings": lines}
    record["json"] = common.write_record(out_dir, NAME, record)
    record["plot"] = plot(cfg, results, out_dir)
    print(f"wrote {record['json']} and {record['plot']}")
    return record
