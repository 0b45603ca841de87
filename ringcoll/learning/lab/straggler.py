"""``ringcoll lab straggler``: synchronous against asynchronous training under one slow rank.

The seed chapter (2.3) says: in a 16-card job, one card 10% slower costs synchronous
training 10% of its throughput and asynchronous training about 1%, but asynchronous
training ends about 0.5 points less accurate. This experiment trains the same model on
the same data with the same per-sample learning rate four ways, with and without a slow
rank, and measures throughput, held-out accuracy and staleness:

    sync     every step, the P ranks' gradients are averaged by ringcoll's all-reduce and
             every rank applies the same update:   w -= lr * mean_r g_r(w)
             (the replicas stay bitwise identical; a step waits for the slowest rank)
    async    a parameter server (one extra process) applies each worker's gradient as it
             arrives and sends that worker the new weights:   w -= (lr / P) * g_r(w_stale)
             built on torch.distributed send/recv over gloo, not on a ring; a gradient
             computed on weights that v other updates have since changed has staleness v
    bounded  the same server, but a worker may be at most S steps ahead of the slowest
             worker (stale synchronous parallel): the server holds its reply until then
    local    local SGD: each rank steps alone, w_r -= lr * g_r(w_r), and every H steps the
             models are averaged with ringcoll's all-reduce (H = 1 is sync, up to rounding)

Every variant processes the same number of samples (``epochs`` passes over the training
set) and moves the weights by lr times a mean gradient of P x batch samples per P x batch
samples processed; the learning rate is constant. The slow rank (the last worker), after
computing each gradient, spends ``slow_fraction`` times the time that computation took
busy-waiting (``slow_by="work"``: it keeps its core, as a slower device would; or asleep,
``"sleep"``), so it is that much slower whatever else the machine is doing.

What the model predicts: a synchronous step waits for the slowest rank, so its throughput
falls by f / (1 + f) (9.1% for f = 10%). An asynchronous server loses only the slow
worker's missing share: f / ((1 + f) P) (2.3% at P = 4, 0.57% at P = 16: the seed's ~1%).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import common

NAME = "straggler"
VARIANTS = ("sync", "async", "bounded", "local")
DESCRIPTIONS = {
    "sync": "synchronous data parallel, ringcoll all-reduce",
    "async": "asynchronous, parameter server",
    "bounded": "parameter server, at most S steps ahead",
    "local": "local SGD, models averaged every H steps",
}


@dataclass(frozen=True)
class Config:
    world: int = 4  # workers (the parameter server is one more process)
    slow_fraction: float = 0.10
    slow_by: str = "work"  # or "sleep"; see _slow_down
    seeds: int = 5
    epochs: float = 60.0
    batch: int = 64  # per worker and step
    hidden: Tuple[int, ...] = (256, 256)
    lr: float = 0.5  # for a mean gradient of world x batch samples
    staleness: int = 2  # S, for "bounded"
    local_every: int = 4  # H, for "local"
    variants: Tuple[str, ...] = VARIANTS
    trace: bool = False  # keep every update and the weights (tests; small models only)
    progress: bool = True

    @property
    def steps(self) -> int:
        """Synchronous steps: the samples of ``epochs`` passes in batches of world x batch."""
        return max(1, int(self.epochs * len(common.digits().train_y)) // (self.world * self.batch))

    @property
    def samples(self) -> int:
        return self.steps * self.world * self.batch


QUICK = Config(world=2, seeds=1, epochs=2.0, batch=16, hidden=(32,), staleness=1, local_every=2)


# --- the synchronous variants: P ranks, ringcoll ----------------------------------------------


def _slow_down(cfg: Config, is_slow: bool, started: float) -> None:
    """The slow rank takes ``slow_fraction`` more time per gradient: asleep (its core is
    free meanwhile) or busy (it keeps its core, as a slower device would)."""
    if not is_slow:
        return
    extra = cfg.slow_fraction * (time.perf_counter() - started)
    if cfg.slow_by == "sleep":
        time.sleep(extra)
    else:
        until = time.perf_counter() + extra
        while time.perf_counter() < until:
            pass


def _collective_run(rank: int, cfg: Config, seed: int, slow: bool, variant: str, group, every: int) -> Dict:
    """sync (every = 1 all-reduce of gradients) or local SGD (average the weights every H)."""
    from ringcoll import api
    from ringcoll._types import ReduceOp

    model = common.FlatModel(common.make_model(cfg.hidden, seed))
    stream = common.batches(seed, rank, cfg.world, cfg.batch)
    is_slow = slow and rank == cfg.world - 1
    log, trace = [], {}
    start = time.perf_counter()
    for step in range(cfg.steps):
        x, y = next(stream)
        computing = time.perf_counter()
        loss, grad = model.gradient(x, y)
        _slow_down(cfg, is_slow, computing)
        if variant == "sync":
            api.all_reduce(grad, op=ReduceOp.AVG, group=group)
            model.weights.sub_(grad, alpha=cfg.lr)
        else:
            model.weights.sub_(grad, alpha=cfg.lr)
            if (step + 1) % every == 0 or step == cfg.steps - 1:  # the last step always averages
                api.all_reduce(model.weights, op=ReduceOp.AVG, group=group)
        log.append(((step + 1) * cfg.world * cfg.batch, loss))
        if cfg.trace and step == 0:
            trace["after_first_step"] = model.weights.clone()
    elapsed = time.perf_counter() - start
    out = {"elapsed": elapsed, "log": log, "digest": common.digest([model.weights])}
    if rank == 0:
        data = common.digits()
        out["accuracy"] = model.accuracy(data.test_x, data.test_y)
    if cfg.trace:
        trace["final"] = model.weights.clone()
        out["trace"] = trace
    return out


# --- the parameter server: workers 0..P-1, server P, gloo send/recv --------------------------

# A worker's message: [its step count, the version of the weights it used, its loss, gradient...]
# The server's reply: [new version (STOP: no more), weights...]
_HEADER, _STOP = 3, -1.0


def _worker(rank: int, cfg: Config, seed: int, slow: bool, server: int) -> Dict:
    model = common.FlatModel(common.make_model(cfg.hidden, seed))  # version 0, as on the server
    stream = common.batches(seed, rank, cfg.world, cfg.batch)
    is_slow = slow and rank == cfg.world - 1
    message = torch.empty(_HEADER + model.numel)
    reply = torch.empty(1 + model.numel)
    version = steps = 0
    start = time.perf_counter()
    while True:
        x, y = next(stream)
        computing = time.perf_counter()
        loss, grad = model.gradient(x, y)
        _slow_down(cfg, is_slow, computing)
        message[0], message[1], message[2] = steps, version, loss
        message[_HEADER:] = grad
        dist.send(message, dst=server)
        dist.recv(reply, src=server)
        if reply[0] == _STOP:
            break
        version = int(reply[0])
        model.weights.copy_(reply[1:])
        steps += 1
    return {"elapsed": time.perf_counter() - start, "steps": steps}


def _server(cfg: Config, seed: int, bound: Optional[int]) -> Dict:
    """Apply gradients in arrival order until the sample budget is spent. With ``bound`` S,
    a worker is sent its new weights only once it is at most S steps ahead of the slowest
    (the slowest always is, so some worker can always go on)."""
    workers = cfg.world
    model = common.FlatModel(common.make_model(cfg.hidden, seed))
    budget = cfg.steps * workers  # updates of one worker's batch each
    message = torch.empty(_HEADER + model.numel)
    reply = torch.empty(1 + model.numel)
    steps = [0] * workers  # updates applied per worker
    waiting: List[int] = []  # workers whose reply is held back (bounded)
    staleness, leads, log, updates = [], [], [], []
    initial = model.weights.clone() if cfg.trace else None

    def send_weights(worker: int) -> None:
        leads.append(steps[worker] - min(steps))
        reply[0] = len(log)
        reply[1:] = model.weights
        dist.send(reply, dst=worker)

    start = time.perf_counter()
    while len(log) < budget:
        worker = dist.recv(message)  # from whichever worker is ready first
        used = int(message[1])
        grad = message[_HEADER:]
        staleness.append(len(log) - used)
        if cfg.trace:
            updates.append((worker, int(message[0]), used, grad.clone()))
        model.weights.sub_(grad, alpha=cfg.lr / workers)
        log.append((len(log) * cfg.batch + cfg.batch, float(message[2])))
        steps[worker] += 1
        waiting.append(worker)
        for w in list(waiting):
            if bound is None or steps[w] - min(steps) <= bound:
                waiting.remove(w)
                if len(log) < budget:
                    send_weights(w)
                else:
                    waiting.append(w)  # told to stop below
    elapsed = time.perf_counter() - start
    # Stop everyone: those held or just answered last get STOP now; a worker still
    # computing sends one more gradient, which is not applied (the budget is spent).
    answered = set(range(workers)) - set(waiting)
    reply[0] = _STOP
    for w in range(workers):
        if w in answered:
            dist.recv(message, src=w)
        dist.send(reply, dst=w)
    data = common.digits()
    out = {"elapsed": elapsed, "log": log, "staleness": staleness, "leads": leads, "updates_per_worker": steps,
           "accuracy": model.accuracy(data.test_x, data.test_y)}
    if cfg.trace:
        out["trace"] = {"initial": initial, "updates": updates, "final": model.weights.clone()}
    return out


# --- one job: every run of every variant, seed and slow/not, in the same P + 1 processes ------


def runs_of(cfg: Config) -> List[Tuple[int, bool, str]]:
    """Without and with the slow rank back to back, so each pair shares the machine's
    state of the moment (this VM's speed drifts by 10-20% over seconds)."""
    return [(seed, slow, v) for seed in range(cfg.seeds) for v in cfg.variants for slow in (False, True)]


def _job(rank: int, size: int, cfg: Config) -> Optional[List[Dict]]:
    common.one_thread()
    server = cfg.world
    group = dist.new_group(list(range(cfg.world)))  # the workers' ring (new_group: every rank calls it)
    _warm_up(rank, server, group)
    results = []
    bar = common.progress(len(runs_of(cfg)), "straggler", enabled=rank == 0 and cfg.progress)
    warm_up = [(0, False, v) for v in cfg.variants]  # untimed: the first runs of a process are slower
    for i, (seed, slow, variant) in enumerate(warm_up + runs_of(cfg)):
        dist.barrier()
        parts: List = [None] * size
        dist.all_gather_object(parts, _one_run(rank, cfg, seed, slow, variant, group))
        if rank == 0 and i >= len(warm_up):
            results.append(_combine(cfg, seed, slow, variant, parts))
            bar.update()
    bar.close()
    return results


def _one_run(rank: int, cfg: Config, seed: int, slow: bool, variant: str, group) -> Optional[Dict]:
    server = cfg.world
    if variant in ("sync", "local"):
        every = 1 if variant == "sync" else cfg.local_every
        return _collective_run(rank, cfg, seed, slow, variant, group, every) if rank < server else None
    if rank == server:
        return _server(cfg, seed, cfg.staleness if variant == "bounded" else None)
    return _worker(rank, cfg, seed, slow, server)


def _warm_up(rank: int, server: int, group) -> None:
    """Build the workers' ringcoll communicator and open every worker-server connection
    before anything is timed (both are set up on first use)."""
    from ringcoll import api

    ping = torch.zeros(1)
    if rank < server:
        api.all_reduce(ping, group=group)
        dist.send(ping, dst=server)
        dist.recv(ping, src=server)
    else:
        for w in range(server):
            dist.recv(ping, src=w)
            dist.send(ping, dst=w)


def _combine(cfg: Config, seed: int, slow: bool, variant: str, parts: Sequence[Dict]) -> Dict:
    workers, server = parts[:cfg.world], parts[cfg.world]
    run = {"variant": variant, "seed": seed, "slow": slow, "samples": cfg.samples}
    if variant in ("sync", "local"):
        run["elapsed"] = max(p["elapsed"] for p in workers)
        run["accuracy"] = workers[0]["accuracy"]
        run["replicas_identical"] = len({p["digest"] for p in workers}) == 1
        run["log"] = sorted(entry for p in workers for entry in p["log"])
        if cfg.trace:
            run["trace"] = [p["trace"] for p in workers]
    else:
        run["elapsed"] = server["elapsed"]
        run["accuracy"] = server["accuracy"]
        run["log"] = server["log"]
        run["staleness"] = server["staleness"]
        run["leads"] = server["leads"]
        run["updates_per_worker"] = server["updates_per_worker"]
        if cfg.trace:
            run["trace"] = server["trace"]
    run["samples_per_s"] = run["samples"] / run["elapsed"]
    return run


# --- the report --------------------------------------------------------------------------------


def sync_loss_model(f: float) -> float:
    return f / (1 + f)


def async_loss_model(f: float, world: int) -> float:
    return f / ((1 + f) * world)


def summarise(cfg: Config, runs: Sequence[Dict]) -> Dict:
    """Per variant: throughput with and without the slow rank, its loss in % (per seed, then
    mean and sd), final held-out accuracy, staleness; and the findings in the seed's terms."""
    rows = {}
    for v in cfg.variants:
        fast = {r["seed"]: r for r in runs if r["variant"] == v and not r["slow"]}
        slow = {r["seed"]: r for r in runs if r["variant"] == v and r["slow"]}
        losses = [100 * (1 - slow[s]["samples_per_s"] / fast[s]["samples_per_s"]) for s in fast]
        stale = [x for r in slow.values() for x in r.get("staleness", [])]
        leads = [x for r in slow.values() for x in r.get("leads", [])]
        rows[v] = {
            "samples_per_s": common.mean_sd([r["samples_per_s"] for r in fast.values()]),
            "samples_per_s_slow": common.mean_sd([r["samples_per_s"] for r in slow.values()]),
            "throughput_loss_pct": common.mean_sd(losses),
            "accuracy_pct": common.mean_sd([100 * r["accuracy"] for r in slow.values()]),
            "accuracy_pct_no_slow": common.mean_sd([100 * r["accuracy"] for r in fast.values()]),
            "staleness_mean": (sum(stale) / len(stale)) if stale else None,
            "staleness_max": max(stale) if stale else None,
            "staleness_histogram": sorted(Counter(stale).items()),
            "lead_max": max(leads) if leads else None,
        }
    findings = []
    f = cfg.slow_fraction
    if "sync" in rows:
        m, s = rows["sync"]["throughput_loss_pct"]
        findings.append(f"synchronous training lost {m:.1f} +- {s:.1f} % of its throughput to one rank "
                        f"{100 * f:.0f}% slower (model: every step waits for it, {100 * sync_loss_model(f):.1f}%; "
                        f"the seed says 10%)")
    if "async" in rows:
        m, s = rows["async"]["throughput_loss_pct"]
        findings.append(f"asynchronous training lost {m:.1f} +- {s:.1f} % (model: only the slow worker's share, "
                        f"{100 * async_loss_model(f, cfg.world):.1f}% at P = {cfg.world}; "
                        f"{100 * async_loss_model(f, 16):.2f}% at P = 16, the seed's ~1%)")
    if "sync" in rows and "async" in rows:
        per_seed = _accuracy_gaps(runs, "async", "sync")
        m, s = common.mean_sd(per_seed)
        findings.append(f"accuracy, asynchronous minus synchronous, both with the slow rank: {m:+.2f} +- {s:.2f} "
                        f"points over {len(per_seed)} seed(s) (the seed says about -0.5)")
    return {"rows": rows, "findings": findings}


def _accuracy_gaps(runs, a: str, b: str) -> List[float]:
    acc = {(r["variant"], r["seed"]): r["accuracy"] for r in runs if r["slow"]}
    return [100 * (acc[(a, s)] - acc[(b, s)]) for (v, s) in acc if v == a and (b, s) in acc]


def format_table(cfg: Config, summary: Dict) -> str:
    rows = []
    for v in cfg.variants:  # not the dict's order: the JSON file sorts its keys
        r = summary["rows"][v]
        stale = "-" if r["staleness_mean"] is None else f"{r['staleness_mean']:.2f} / {r['staleness_max']}"
        lead = "-" if r["lead_max"] is None else str(r["lead_max"])
        rows.append([v, f"{r['samples_per_s'][0]:.0f}", f"{r['samples_per_s_slow'][0]:.0f}",
                     common.pm(r["throughput_loss_pct"]), common.pm(r["accuracy_pct"], ".2f"), stale, lead])
    head = ["variant", "samples/s", "samples/s, slow", "throughput loss %", "test accuracy %, slow",
            "staleness mean / max", "max lead"]
    return common.table(head, rows)


def describe(cfg: Config) -> str:
    n = common.parameter_count(cfg.hidden)
    how = "sleeps" if cfg.slow_by == "sleep" else "busy-waits (keeping its core)"
    oversubscribed = " (oversubscribed: more processes than the machine's cores)" \
        if cfg.world + 1 > common.cores() else ""
    return (f"{cfg.world} workers{oversubscribed}, MLP 64-{'-'.join(map(str, cfg.hidden))}-10 ({n:,} parameters), "
            f"digits (1437 train / 360 held-out test), {cfg.epochs:g} epochs = {cfg.samples:,} samples per run, "
            f"batch {cfg.batch} per worker, lr {cfg.lr:g} per mean gradient of {cfg.world * cfg.batch} samples, "
            f"{cfg.seeds} seed(s); slow rank: worker {cfg.world - 1} {how} {100 * cfg.slow_fraction:g}% of its "
            f"compute time after each gradient; S = {cfg.staleness}, H = {cfg.local_every}")


def plot(cfg: Config, runs: Sequence[Dict], summary: Dict, out_dir: str) -> str:
    fig, (curves, bars, hist) = common.new_figure(3)
    for v in cfg.variants:
        run = next(r for r in runs if r["variant"] == v and r["slow"] and r["seed"] == 0)
        xs, ys = common.smooth(run["log"], bins=60)
        curves.plot(xs, ys, label=v)
    curves.set(xlabel="samples processed", ylabel="training loss (binned mean)", yscale="log",
               title="with the slow rank, seed 0")
    curves.legend()
    names = list(cfg.variants)
    width = 0.38
    for i, (key, label) in enumerate((("samples_per_s", "no slow rank"), ("samples_per_s_slow", "slow rank"))):
        values = [summary["rows"][v][key][0] for v in names]
        errors = [summary["rows"][v][key][1] for v in names]
        bars.bar([j + (i - 0.5) * width for j in range(len(names))], values, width, yerr=errors, label=label)
    bars.set_xticks(range(len(names)), names)
    bars.set(ylabel="samples / s", title=f"throughput, P = {cfg.world}")
    bars.legend()
    for v in ("async", "bounded"):
        if v in summary["rows"] and summary["rows"][v]["staleness_histogram"]:
            xs, counts = zip(*summary["rows"][v]["staleness_histogram"])
            hist.bar(xs, counts, alpha=0.6, label=v)
    hist.set(xlabel="staleness (updates since the weights were read)", ylabel="gradients",
             title="staleness of applied gradients, slow rank")
    hist.legend()
    return common.save_figure(fig, out_dir, NAME)


def _for_json(run: Dict) -> Dict:
    """A run as saved: the loss curve binned as plotted (not every step), no trace."""
    saved = {k: v for k, v in run.items() if k not in ("trace", "log")}
    saved["loss_curve"] = common.smooth(run["log"], bins=60)
    return saved


def run(cfg: Config, out_dir: str = "lab-results", timeout: float = 3600.0) -> Dict:
    """Run the experiment; print the table; write ``straggler.json`` and ``straggler.png``."""
    unknown = set(cfg.variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"lab straggler: unknown variant(s) {sorted(unknown)}; choose from {list(VARIANTS)}")
    if cfg.world < 2:
        raise ValueError(f"lab straggler: needs at least 2 workers, got {cfg.world}")
    if cfg.slow_by not in ("work", "sleep"):
        raise ValueError(f"lab straggler: slow_by must be 'work' or 'sleep', got {cfg.slow_by!r}")
    print(describe(cfg), flush=True)
    runs = common.launch(_job, cfg.world + 1, cfg, timeout)
    summary = summarise(cfg, runs)
    print(format_table(cfg, summary), end="")
    for line in summary["findings"]:
        print(f"* {line}")
    record = {"experiment": NAME, "description": describe(cfg), "config": dataclasses.asdict(cfg),
              "summary": summary, "runs": [_for_json(r) for r in runs]}
    record["json"] = common.write_record(out_dir, NAME, record)
    record["plot"] = plot(cfg, runs, summary, out_dir)
    print(f"wrote {record['json']} and {record['plot']}")
    record["runs_with_trace"] = runs  # in memory only (tests)
    return record
