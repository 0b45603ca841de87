"""Soak: many mixed collectives on one communicator, watching for leaks.

    python bench/soak.py --calls 100000 --world 3

runs ``--calls`` collectives on ``--world`` ranks (processes, ringcoll.harness.launcher.spawn), all on
ONE Communicator with a small buffer (64 KiB by default), in a random but reproducible mix:
all_reduce (in place and with ``output=``), reduce_scatter_tensor, all_gather_into_tensor,
the list forms all_gather / reduce_scatter, and barrier; sizes from 0 to 4x the buffer
(log-uniform, plus 0, 1, P-1 and P+1); every dtype and every op the dtype allows; about a
tenth issued with ``async_op=True`` (up to 4 in flight). Every ``--check-every``-th call
(barriers aside; async ones once waited for) is compared, bit for bit, with the plain reference
computed from every rank's input (inputs are small integers, so every reduction order gives
the same bits in every dtype).

Every ``--sample-every`` calls each rank records its resident set (VmRSS), open file
descriptors (/proc/self/fd), threads (/proc/self/status Threads), and rank 0 the
``ringcoll-*`` entries in /dev/shm. Before each RSS reading the rank collects garbage and
returns the allocator's free memory to the kernel (glibc ``malloc_trim``), which takes the
sample-to-sample noise from ~5 MiB down to ~0.3 MiB. After the warm-up (``--warmup`` calls)
nothing may grow beyond the tolerances: RSS not by more than ``--rss-tolerance-mib`` (4 MiB,
peak over the first post-warm-up sample) nor creep by more than ``--rss-trend-tolerance-mib``
(1 MiB, median of the later half of the samples over the earlier half: over 100,000 calls,
a leak of a few dozen bytes per call; a 100-byte-per-call leak fails a 30,000-call run),
descriptors and threads not at all; no new /dev/shm entry may stay for 3 samples in a row or
be left after the run (other jobs' segments exist for the milliseconds of their bootstrap).
The run fails (exit code 1, a line saying what grew or what was wrong) on any wrong result,
any error or any growth. The samples are printed as a table; rank 0 also prints each sample
as it is taken (``--quiet``: not).

``run_soak(Config(...))`` is the same thing as a function (tests/faults/test_faults.py runs a short
one); it returns a :class:`Report`. The rank function must be importable by name in the
child processes, so import this file as the module ``soak`` (put bench/ on sys.path).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import dataclasses
import datetime
import gc
import math
import os
import platform
import random
import shlex
import statistics
import sys
import time
from typing import List, Optional

KINDS = {  # name: weight
    "all_reduce": 25, "all_reduce_out": 10, "reduce_scatter_tensor": 15, "all_gather_into_tensor": 15,
    "all_gather": 10, "reduce_scatter": 10, "barrier": 15,
}
DTYPE_NAMES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"]
FLOATING = {"float32", "float64", "float16", "bfloat16"}
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG"]
MAX_ASYNC_IN_FLIGHT = 4
MAX_REPORTED = 10
SHM_PERSISTENCE = 3


@dataclasses.dataclass
class Config:
    calls: int = 100_000
    world: int = 3
    buffer_bytes: int = 64 * 1024
    check_every: int = 100
    sample_every: int = 0  # 0: calls // 20 (at least 100)
    warmup: int = -1  # -1: calls // 10, at least one sample interval
    async_fraction: float = 0.1
    seed: int = 0
    comm_timeout: float = 60.0
    spawn_timeout: float = 7200.0
    rss_tolerance_mib: float = 4.0  # peak over the first post-warm-up sample
    rss_trend_tolerance_mib: float = 1.0  # median of the later half over the earlier half
    fd_tolerance: int = 0
    thread_tolerance: int = 0
    verbose: bool = False  # rank 0 prints each sample as it is taken

    def resolved(self) -> "Config":
        c = dataclasses.replace(self)
        if c.sample_every <= 0:
            c.sample_every = max(100, c.calls // 20)
        if c.warmup < 0:
            c.warmup = max(c.calls // 10, c.sample_every)
        return c


@dataclasses.dataclass
class Sample:
    calls: int
    seconds: float
    rss_kib: List[int]  # per rank
    fds: List[int]
    threads: List[int]
    shm_entries: List[str]  # ringcoll-* names in /dev/shm (seen by rank 0)


@dataclasses.dataclass
class Report:
    config: Config
    samples: List[Sample]
    checked: int
    wrong: int
    kinds: dict
    seconds: float
    failures: List[str]

    @property
    def ok(self) -> bool:
        return not self.failures


# --- the call sequence: identical on every rank -------------------------------------------

def plan_call(rng: random.Random, world: int, buffer_bytes: int, async_fraction: float):
    """(kind, dtype name, op name, count, async). count: all_reduce elements, or the per-rank
    chunk of reduce-scatter / all-gather."""
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    dtype = rng.choice(DTYPE_NAMES)
    ops = OPS if dtype in FLOATING else OPS[:-1]
    op = rng.choice(ops) if kind not in ("all_gather_into_tensor", "all_gather", "barrier") else "SUM"
    itemsize = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1,
                "int32": 4, "int64": 8}[dtype]
    if rng.random() < 0.1:
        total = rng.choice([0, 1, world - 1, world + 1])
    else:
        most = 4 * buffer_bytes // itemsize
        total = int(math.exp(rng.uniform(0.0, math.log(most))))
    count = total if kind in ("all_reduce", "all_reduce_out") else max(total // world, 0)
    if kind in ("all_gather", "all_gather_into_tensor") and total in (0, 1):
        count = total
    return kind, dtype, op, count, rng.random() < async_fraction


def rank_input(call: int, rank: int, numel: int, dtype):
    """Small integers, different per rank and call: every order of reduction is exact."""
    import torch

    idx = torch.arange(numel, dtype=torch.int64)
    v = (idx * 7 + rank * 5 + call * 3) % 5  # 0..4
    if not (dtype.is_floating_point or dtype.is_signed):
        v = v % 3  # uint8: 0..2, products <= 8
    else:
        v = v - 2  # -2..2: |sum| <= 2P, |product| <= 2^P
    return v.to(dtype)


def reference(kind: str, op: str, inputs: list, rank: int, world: int):
    import torch

    if kind in ("all_gather", "all_gather_into_tensor"):
        return torch.cat(inputs)
    dtype = inputs[0].dtype
    stacked = torch.stack(inputs)
    if op in ("SUM", "AVG"):
        full = stacked.sum(0, dtype=dtype) if not dtype.is_floating_point else stacked.sum(0)
        if op == "AVG":
            full = full / world
    elif op == "PRODUCT":
        full = stacked.prod(0).to(dtype)
    elif op == "MIN":
        full = stacked.amin(0)
    else:
        full = stacked.amax(0)
    if kind in ("reduce_scatter", "reduce_scatter_tensor"):
        n = full.numel() // world
        return full[rank * n:(rank + 1) * n]
    return full


# --- one rank -----------------------------------------------------------------------------

def _settle_heap() -> None:
    """Collect garbage and hand the allocator's free memory back to the kernel (glibc's
    malloc_trim), so RSS shows what is held, not what the allocator happens to cache."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS is just noisier
        pass


def _proc_status() -> tuple:
    rss = threads = -1
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    fds = len(os.listdir("/proc/self/fd"))
    return rss, fds, threads


def shm_entries() -> set:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("ringcoll-")}
    except FileNotFoundError:
        return set()


def _soak_rank(rank: int, world: int, cfg: Config):
    import torch

    import ringcoll

    torch.set_num_threads(1)  # references stay on this rank's thread; P ranks share the cores
    dtypes = {name: getattr(torch, name) for name in DTYPE_NAMES}
    ops = {name: getattr(ringcoll.ReduceOp, name) for name in OPS}
    rng = random.Random(cfg.seed)
    comm = ringcoll.Communicator(timeout=cfg.comm_timeout, buffer_bytes=cfg.buffer_bytes)
    samples, wrong, checked = [], [], 0
    kinds = dict.fromkeys(KINDS, 0)
    pending = []  # (work, check) in issue order
    start = time.monotonic()

    def verify(check) -> None:
        nonlocal checked
        if check is None:
            return
        call, kind, dtype, op, count, outputs = check
        inputs = [rank_input(call, r, count * (world if kind.startswith("reduce_scatter") else 1), dtypes[dtype])
                  for r in range(world)]
        want = reference(kind, op, inputs, rank, world)
        got = torch.cat([o.reshape(-1) for o in outputs]) if outputs else torch.empty(0, dtype=dtypes[dtype])
        checked += 1
        if not torch.equal(got, want):
            bad = int((got != want).sum()) if got.shape == want.shape else -1
            what = f"{kind} {dtype}" + ("" if kind.startswith("all_gather") else f" {op}")
            wrong.append(f"rank {rank} call {call}: {what} count={count}: {bad} wrong elements")

    def drain() -> None:
        for work, check in pending:
            work.wait()
            verify(check)
        pending.clear()

    def sample(calls: int) -> None:
        drain()
        _settle_heap()
        rss, fds, threads = _proc_status()
        shm = sorted(shm_entries()) if rank == 0 else []
        samples.append((calls, time.monotonic() - start, rss, fds, threads, shm))
        if cfg.verbose and rank == 0:
            print(f"  sample: {calls:>8} calls  {time.monotonic() - start:8.1f} s  rank 0 RSS {rss / 1024:8.1f} MiB"
                  f"  fds {fds:3d}  threads {threads:3d}  /dev/shm ringcoll-* {len(shm)}", flush=True)

    sample(0)
    for call in range(cfg.calls):
        kind, dtype_name, op_name, count, is_async = plan_call(rng, world, cfg.buffer_bytes, cfg.async_fraction)
        kinds[kind] += 1
        dtype, op = dtypes[dtype_name], ops[op_name]
        want_check = (call + 1) % cfg.check_every == 0
        work, outputs = None, []
        if kind == "barrier":
            work = comm.barrier(async_op=is_async)
        elif kind in ("all_reduce", "all_reduce_out"):
            t = rank_input(call, rank, count, dtype)
            if kind == "all_reduce":
                work = comm.all_reduce(t, op=op, async_op=is_async)
                outputs = [t]
            else:
                out = torch.empty_like(t)
                work = comm.all_reduce(t, op=op, async_op=is_async, output=out)
                outputs = [out]
        elif kind == "reduce_scatter_tensor":
            out = torch.empty(count, dtype=dtype)
            work = comm.reduce_scatter_tensor(out, rank_input(call, rank, count * world, dtype), op=op,
                                              async_op=is_async)
            outputs = [out]
        elif kind == "reduce_scatter":
            t = rank_input(call, rank, count * world, dtype)
            out = torch.empty(count, dtype=dtype)
            work = comm.reduce_scatter(out, list(t.chunk(world)) if count else [t[:0]] * world, op=op,
                                       async_op=is_async)
            outputs = [out]
        elif kind == "all_gather_into_tensor":
            out = torch.empty(count * world, dtype=dtype)
            work = comm.all_gather_into_tensor(out, rank_input(call, rank, count, dtype), async_op=is_async)
            outputs = [out]
        else:  # all_gather, list form
            outs = [torch.empty(count, dtype=dtype) for _ in range(world)]
            work = comm.all_gather(outs, rank_input(call, rank, count, dtype), async_op=is_async)
            outputs = outs
        check = (call, kind, dtype_name, op_name, count, outputs) if want_check and kind != "barrier" else None
        if is_async:
            pending.append((work, check))
            if len(pending) >= MAX_ASYNC_IN_FLIGHT:
                drain()
        else:
            verify(check)
        if (call + 1) % cfg.sample_every == 0 or call + 1 == cfg.calls:
            sample(call + 1)
    drain()
    comm.close()
    return {"samples": samples, "checked": checked, "wrong": wrong, "kinds": kinds}


# --- the parent ---------------------------------------------------------------------------

def run_soak(cfg: Config) -> Report:
    from ringcoll.harness.launcher import SpawnError, spawn

    cfg = cfg.resolved()
    before = shm_entries()
    start = time.monotonic()
    failures: List[str] = []
    try:
        results = spawn(_soak_rank, cfg.world, cfg, timeout=cfg.spawn_timeout)
    except SpawnError as e:
        return Report(cfg, [], 0, 0, {}, time.monotonic() - start, [f"a rank failed: {e}"])
    seconds = time.monotonic() - start

    samples = []
    for i in range(len(results[0]["samples"])):
        per_rank = [r["samples"][i] for r in results]
        samples.append(Sample(calls=per_rank[0][0], seconds=per_rank[0][1], rss_kib=[s[2] for s in per_rank],
                              fds=[s[3] for s in per_rank], threads=[s[4] for s in per_rank],
                              shm_entries=per_rank[0][5]))
    checked = sum(r["checked"] for r in results)
    wrong_lines = [w for r in results for w in r["wrong"]]
    if wrong_lines:
        failures.append(f"{len(wrong_lines)} wrong results, e.g.: " + "; ".join(wrong_lines[:MAX_REPORTED]))
    if checked == 0:
        failures.append("no result was checked")
    failures += growth_failures(cfg, samples)
    leftover = shm_entries() - before
    deadline = time.monotonic() + 3.0  # another job's segment may exist for the ms of its bootstrap
    while leftover and time.monotonic() < deadline:
        time.sleep(0.1)
        leftover &= shm_entries()
    if leftover:
        failures.append(f"/dev/shm: {len(leftover)} new ringcoll-* entries left behind")
    return Report(cfg, samples, checked, len(wrong_lines), results[0]["kinds"], seconds, failures)


def growth_failures(cfg: Config, samples: List[Sample]) -> List[str]:
    """What grew after the warm-up beyond the tolerances (empty: nothing)."""
    after = [s for s in samples if s.calls >= cfg.warmup]
    if len(after) < 2:
        return [f"too few samples after the {cfg.warmup}-call warm-up to judge growth "
                f"({len(after)}); use more calls or a smaller --sample-every"]
    base, failures = after[0], []
    world = len(base.rss_kib)
    for r in range(world):
        peak_rss = max(s.rss_kib[r] for s in after)
        if (peak_rss - base.rss_kib[r]) / 1024 > cfg.rss_tolerance_mib:
            failures.append(f"rank {r}: RSS grew from {base.rss_kib[r] / 1024:.1f} MiB (call {base.calls}) to "
                            f"{peak_rss / 1024:.1f} MiB, more than {cfg.rss_tolerance_mib:g} MiB")
        trend = rss_trend_mib(after, r)
        if trend > cfg.rss_trend_tolerance_mib:
            failures.append(f"rank {r}: RSS creeps: the later half of the samples sits {trend:.1f} MiB above the "
                            f"earlier half (median), more than {cfg.rss_trend_tolerance_mib:g} MiB")
        for what, values in (("open file descriptors", [s.fds[r] for s in after]),
                             ("threads", [s.threads[r] for s in after])):
            tolerance = cfg.fd_tolerance if what.startswith("open") else cfg.thread_tolerance
            if max(values) > values[0] + tolerance:
                failures.append(f"rank {r}: {what} grew from {values[0]} (call {base.calls}) to {max(values)}")
    # /dev/shm: another job's segment lives for the milliseconds of its bootstrap, so an entry
    # counts as ours to explain only if it stays for SHM_PERSISTENCE samples in a row.
    at_start, streak = set(samples[0].shm_entries), collections.Counter()
    for s in after:
        current = set(s.shm_entries) - at_start
        streak = collections.Counter({name: streak[name] + 1 for name in current})
        lasting = sorted(name for name, n in streak.items() if n >= SHM_PERSISTENCE)
        if lasting:
            failures.append(f"/dev/shm: {len(lasting)} new ringcoll-* entries stayed for {SHM_PERSISTENCE} "
                            f"samples in a row (by call {s.calls})")
            break
    return failures


def rss_trend_mib(after: List[Sample], rank: int) -> float:
    """Median RSS of the later half of the samples minus that of the earlier half: a slow
    leak moves it, allocator noise (a few MiB either way, sample to sample) does not."""
    values = [s.rss_kib[rank] for s in after]
    half = len(values) // 2
    if half == 0:
        return 0.0
    return (statistics.median(values[-half:]) - statistics.median(values[:half])) / 1024


def format_report(report: Report) -> str:
    cfg = report.config
    world = cfg.world
    lines = []
    head = f"{'calls':>8} {'time s':>8} " + " ".join(f"{'RSS MiB r' + str(r):>12}" for r in range(world))
    head += " " + " ".join(f"{'fds r' + str(r):>6}" for r in range(world))
    head += " " + " ".join(f"{'thr r' + str(r):>6}" for r in range(world)) + f" {'shm':>4}"
    lines.append(head)
    for s in report.samples:
        mark = "" if s.calls >= cfg.warmup else "  (warm-up)"
        lines.append(f"{s.calls:>8} {s.seconds:>8.1f} " + " ".join(f"{v / 1024:>12.1f}" for v in s.rss_kib)
                     + " " + " ".join(f"{v:>6}" for v in s.fds) + " " + " ".join(f"{v:>6}" for v in s.threads)
                     + f" {len(s.shm_entries):>4}{mark}")
    lines.append("")
    lines.append("mix: " + ", ".join(f"{k} {v}" for k, v in report.kinds.items()))
    loop = report.samples[-1].seconds if report.samples else float("nan")
    lines.append(f"{cfg.calls} calls x {world} ranks: {loop:.1f} s of calls ({loop / max(cfg.calls, 1) * 1e6:.0f} us "
                 f"per call, checks and sampling included), {report.seconds:.1f} s with process launch; "
                 f"checked {report.checked} results (all ranks), {report.wrong} wrong")
    after = [s for s in report.samples if s.calls >= cfg.warmup]
    if len(after) >= 2:
        growth = [(max(s.rss_kib[r] for s in after) - after[0].rss_kib[r]) / 1024 for r in range(world)]
        trend = [rss_trend_mib(after, r) for r in range(world)]
        lines.append(f"after the {cfg.warmup}-call warm-up: RSS growth per rank (peak - first) "
                     + ", ".join(f"{g:+.1f}" for g in growth) + f" MiB (tolerance {cfg.rss_tolerance_mib:g}); "
                     + "later-half - earlier-half median " + ", ".join(f"{t:+.1f}" for t in trend)
                     + f" MiB (tolerance {cfg.rss_trend_tolerance_mib:g}); fds and threads may not grow "
                       f"(tolerance {cfg.fd_tolerance} / {cfg.thread_tolerance})")
    if report.ok:
        lines.append("PASS: no wrong result, no growth beyond the tolerances, nothing left in /dev/shm")
    else:
        lines += [f"FAIL: {f}" for f in report.failures]
    return "\n".join(lines)


def machine_line() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{os.cpu_count()} x {model}, {platform.system()} {platform.release()}"


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Config()
    p.add_argument("--calls", type=int, default=d.calls)
    p.add_argument("--world", type=int, default=d.world)
    p.add_argument("--buffer-bytes", type=int, default=d.buffer_bytes)
    p.add_argument("--check-every", type=int, default=d.check_every)
    p.add_argument("--sample-every", type=int, default=d.sample_every, help="0: calls // 20")
    p.add_argument("--warmup", type=int, default=d.warmup, help="-1: calls // 10")
    p.add_argument("--async-fraction", type=float, default=d.async_fraction)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--comm-timeout", type=float, default=d.comm_timeout)
    p.add_argument("--rss-tolerance-mib", type=float, default=d.rss_tolerance_mib)
    p.add_argument("--rss-trend-tolerance-mib", type=float, default=d.rss_trend_tolerance_mib)
    p.add_argument("--fd-tolerance", type=int, default=d.fd_tolerance)
    p.add_argument("--thread-tolerance", type=int, default=d.thread_tolerance)
    p.add_argument("--quiet", action="store_true", help="no progress lines while running")
    a = p.parse_args(argv)
    if a.calls < 1 or a.world < 1 or a.check_every < 1:
        p.error("--calls, --world and --check-every must be positive")
    cfg = Config(calls=a.calls, world=a.world, buffer_bytes=a.buffer_bytes, check_every=a.check_every,
                 sample_every=a.sample_every, warmup=a.warmup, async_fraction=a.async_fraction, seed=a.seed,
                 comm_timeout=a.comm_timeout, rss_tolerance_mib=a.rss_tolerance_mib,
                 rss_trend_tolerance_mib=a.rss_trend_tolerance_mib,
                 fd_tolerance=a.fd_tolerance, thread_tolerance=a.thread_tolerance, verbose=not a.quiet)
    import torch

    print(f"ringcoll soak, {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}")
    print(f"machine: {machine_line()}; torch {torch.__version__}, Python {platform.python_version()}")
    print("command: python " + " ".join(shlex.quote(x) for x in [os.path.relpath(sys.argv[0])] + sys.argv[1:]))
    r = cfg.resolved()
    print(f"config: {r.calls} calls, world {r.world}, buffer {r.buffer_bytes} B, check every {r.check_every}, "
          f"sample every {r.sample_every}, warm-up {r.warmup} calls, async {r.async_fraction:g}, seed {r.seed}")
    print(flush=True)
    report = run_soak(cfg)
    print()
    print(format_report(report), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
