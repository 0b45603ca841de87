"""ringcoll-bench: the checked benchmark, in the manner of nccl-tests.

    ringcoll-bench                       # CPU shared memory, 2 ranks, 1 KiB .. 64 MiB
    ringcoll-bench -b 8 -e 1M -f 4 --nproc 3 --dtype float16 --op max --fit --plot bw.png

For every collective and size it first checks ringcoll's result, out-of-place and
in-place, against values every rank computes on its own; then times ringcoll and, in the
same run, the references: the same collective through torch.distributed (gloo) and, when
mpi4py and mpirun are installed, Open MPI (MPI_Allreduce, MPI_Reduce_scatter_block,
MPI_Allgather). References are checked too. Columns:

    size    bytes of the whole message (all-reduce: the tensor; reduce-scatter: the input;
            all-gather: the output), as nccl-tests counts them
    time    microseconds per call: the slowest rank's mean over a timed loop, median of
            --trials loops (this machine is noisy; a loop lasts at least --min-ms)
    algbw   size / time, GB/s
    busbw   algbw x 2(P-1)/P (all-reduce) or x (P-1)/P (reduce-scatter, all-gather): the
            bytes each rank puts on the ring per second, comparable across P
    #wrong  elements that differ from the expected result (must be 0)
    x gloo  ringcoll's out-of-place busbw over the reference's (the reference's time is
            for its only form: in-place for gloo's all-reduce)

Exits with status 1 if any result, ours or a reference's, is wrong.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

import torch

from ringcoll.learning import model
from ringcoll._types import DTYPES
from ringcoll.communicator import Communicator, parse_bytes

# --- the collectives: definitions around one shared harness -------------------------------


@dataclasses.dataclass(frozen=True)
class CollectiveDef:
    name: str
    reduces: bool
    # (input elements, output elements) for a message of `count` elements on P ranks
    shapes: Callable[[int, int], tuple[int, int]]

    def bus_factor(self, world: int) -> float:
        return model.BUS_FACTOR[self.name](world)


COLLECTIVES = {
    "all_reduce": CollectiveDef("all_reduce", True, lambda count, world: (count, count)),
    "reduce_scatter": CollectiveDef("reduce_scatter", True, lambda count, world: (count, count // world)),
    "all_gather": CollectiveDef("all_gather", False, lambda count, world: (count // world, count)),
}
OPS = ("sum", "prod", "min", "max", "avg")


def rank_input(rank: int, numel: int, dtype: torch.dtype, op: str, offset: int = 0) -> torch.Tensor:
    """Rank `rank`'s input: small integers, so every summation order gives the same bits
    (values 1..5), and for products 1 or 2 (a product of P of them is exact in bfloat16)."""
    idx = torch.arange(offset, offset + numel, dtype=torch.int64)
    if op == "prod":
        return ((idx + rank) % 2 + 1).to(dtype)
    return ((idx * 7 + rank * 3) % 5 + 1).to(dtype)


def expected_result(coll: CollectiveDef, rank: int, world: int, count: int, dtype: torch.dtype,
                    op: str) -> torch.Tensor:
    """The right answer, computed on this rank from everyone's (regenerable) inputs."""
    in_numel, out_numel = coll.shapes(count, world)
    if not coll.reduces:
        return torch.cat([rank_input(r, in_numel, dtype, op) for r in range(world)])
    offset = rank * out_numel if coll.name == "reduce_scatter" else 0
    acc = rank_input(0, out_numel, dtype, op, offset).double()
    for r in range(1, world):
        x = rank_input(r, out_numel, dtype, op, offset).double()
        acc = {"sum": acc + x, "avg": acc + x, "prod": acc * x, "min": torch.minimum(acc, x),
               "max": torch.maximum(acc, x)}[op]
    if dtype.is_floating_point:
        acc = acc.to(dtype)
        return acc / world if op == "avg" else acc
    # Integer results (at most 5 x P, or 2^P) wrap modulo 2^bits, as in torch and ringcoll.
    return acc.to(torch.int64).to(dtype)


# --- backends: ringcoll, and the references ------------------------------------------------


class Backend:
    """What the harness needs from an implementation. Tensors are flat and contiguous."""

    name = "?"

    def forms(self, coll: str) -> tuple:
        """The forms it offers for `coll`: "out" (out-of-place) and/or "in" (in-place)."""
        return ("out", "in")

    def run(self, coll: str, inp, out, op: str, in_place: bool, rank: int, world: int) -> None:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def reduce_over_ranks(self, value: float, kind: str) -> float:
        raise NotImplementedError


class TorchBackend(Backend):
    """ringcoll (a Communicator) or torch.distributed itself (gloo), same call shapes."""

    def __init__(self, comm=None):
        import torch.distributed as dist

        self.dist, self.comm = dist, comm
        self.name = "ringcoll" if comm is not None else dist.get_backend()

    def forms(self, coll):
        if self.comm is not None:
            return ("out", "in")
        return ("in",) if coll == "all_reduce" else ("out",)  # torch.distributed's only forms

    def _op(self, op: str):
        name = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX", "avg": "AVG"}[op]
        return getattr(self.dist.ReduceOp, name)

    def run(self, coll, inp, out, op, in_place, rank, world):
        api = self.comm if self.comm is not None else self.dist
        if coll == "all_reduce":
            if self.comm is None:  # torch.distributed has only the in-place form
                return self.dist.all_reduce(inp, op=self._op(op))
            return self.comm.all_reduce(inp, op=self._op(op), output=None if in_place else out)
        if coll == "reduce_scatter":
            dst = inp.view(world, -1)[rank] if in_place else out
            return api.reduce_scatter_tensor(dst, inp, op=self._op(op))
        src = out.view(world, -1)[rank] if in_place else inp
        return api.all_gather_into_tensor(out, src)

    def barrier(self):
        if self.comm is not None:
            self.comm.barrier()
        else:
            self.dist.barrier()

    def reduce_over_ranks(self, value, kind):
        t = torch.tensor([value], dtype=torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX if kind == "max" else self.dist.ReduceOp.MIN)
        return float(t)


class MpiBackend(Backend):
    """Open MPI through mpi4py, on numpy views of the same tensors (run under mpirun)."""

    def forms(self, coll):
        return ("out",)

    def __init__(self):
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.name = "mpi"

    def run(self, coll, inp, out, op, in_place, rank, world):
        mpi_op = {"sum": self.MPI.SUM, "prod": self.MPI.PROD, "min": self.MPI.MIN, "max": self.MPI.MAX}[op]
        a, b = inp.numpy(), out.numpy()
        if coll == "all_reduce":
            self.comm.Allreduce(a, b, op=mpi_op)
        elif coll == "reduce_scatter":
            self.comm.Reduce_scatter_block(a, b, op=mpi_op)
        else:
            self.comm.Allgather(a, b)

    def barrier(self):
        self.comm.Barrier()

    def reduce_over_ranks(self, value, kind):
        return self.comm.allreduce(value, op=self.MPI.MAX if kind == "max" else self.MPI.MIN)


# --- the harness ---------------------------------------------------------------------------


@dataclasses.dataclass
class Config:
    min_bytes: int = 1024
    max_bytes: int = 64 << 20
    factor: int = 2
    warmup: int = 5
    iters: int = 20
    trials: int = 3
    min_seconds: float = 0.02
    dtype: str = "float32"
    op: str = "sum"
    collectives: tuple = ("all_reduce", "reduce_scatter", "all_gather")
    gloo: bool = True
    buffer_bytes: Optional[int] = None
    check_cost: bool = True
    straggler_rank: Optional[int] = None
    delay_us: float = 0.0
    progress: bool = True
    small_bytes: Optional[int] = None  # Communicator(small_bytes=): None = default, 0 = ring only


def message_counts(config: Config, world: int) -> list[int]:
    """Message sizes in elements, multiples of P so every rank has an equal share."""
    elem = torch.empty(0, dtype=DTYPES[config.dtype]).element_size()
    counts, size = [], config.min_bytes
    while size <= config.max_bytes:
        count = max(world, size // elem // world * world)
        if not counts or count != counts[-1]:
            counts.append(count)
        size *= config.factor
    return counts


def _busy_wait(seconds: float) -> None:
    """A precise delay (sleep overshoots by tens of microseconds)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(call: Callable[[], None], backend: Backend, config: Config, rank: int) -> tuple[float, float]:
    """(slowest rank's, fastest rank's) seconds per call: each the median over trials of the
    mean of a timed loop. All ranks run the same number of iterations."""
    delay = config.delay_us * 1e-6 if rank == config.straggler_rank else 0.0

    def step():
        if delay:
            _busy_wait(delay)
        call()

    for _ in range(config.warmup):
        step()
    backend.barrier()
    step()  # absorbs the barrier's exit skew
    start = time.perf_counter()
    step()
    one = backend.reduce_over_ranks(time.perf_counter() - start, "max")
    iters = max(config.iters, min(100000, math.ceil(config.min_seconds / max(one, 1e-9))))
    slowest, fastest = [], []
    for _ in range(config.trials):
        backend.barrier()
        step()
        start = time.perf_counter()
        for _ in range(iters):
            step()
        mine = (time.perf_counter() - start) / iters
        slowest.append(backend.reduce_over_ranks(mine, "max"))
        fastest.append(backend.reduce_over_ranks(mine, "min"))
    return statistics.median(slowest), statistics.median(fastest)


def _buffers(coll: CollectiveDef, count: int, world: int, rank: int, dtype, op: str, in_place: bool):
    in_numel, out_numel = coll.shapes(count, world)
    out = torch.zeros(out_numel, dtype=dtype)
    if coll.name == "all_gather" and in_place:
        out.view(world, -1)[rank].copy_(rank_input(rank, in_numel, dtype, op))
        return None, out, out
    inp = rank_input(rank, in_numel, dtype, op)
    result = inp if (in_place and coll.name == "all_reduce") else out
    if in_place and coll.name == "reduce_scatter":
        result = inp.view(world, -1)[rank]
    return inp, out, result


def _unsupported(backend: Backend, coll: CollectiveDef, op: str) -> Optional[str]:
    """Why `backend` cannot run this collective with this op, if it cannot."""
    if coll.reduces and op == "avg" and backend.name in ("gloo", "mpi"):
        return f"{backend.name} has no AVG"
    return None


def bench_one(backend: Backend, coll: CollectiveDef, count: int, rank: int, world: int, config: Config) -> dict:
    """Check, then time, one collective at one size on one backend (every rank returns it)."""
    dtype = DTYPES[config.dtype]
    row = {"collective": coll.name, "backend": backend.name, "bytes": count * torch.empty(0, dtype=dtype).element_size(),
           "count": count, "type": config.dtype, "redop": config.op if coll.reduces else "none", "world": world}
    unsupported = _unsupported(backend, coll, config.op)
    if unsupported:
        row["unsupported"] = unsupported
        return row
    expected = expected_result(coll, rank, world, count, dtype, config.op)
    for form in backend.forms(coll.name):
        in_place = form == "in"
        inp, out, result = _buffers(coll, count, world, rank, dtype, config.op, in_place)
        call = lambda: backend.run(coll.name, inp, out, config.op, in_place, rank, world)  # noqa: E731
        call()
        wrong = int((result != expected).sum())
        row[f"{form}_wrong"] = int(backend.reduce_over_ranks(float(wrong), "max"))
        slowest, fastest = measure(call, backend, config, rank)
        row[f"{form}_time_us"], row[f"{form}_fastest_us"] = slowest * 1e6, fastest * 1e6
    return row


def bench_all(backends: list, rank: int, world: int, config: Config) -> list[dict]:
    """Every collective and size, each measured on every backend in turn: interleaving
    keeps ringcoll and its references in the same moments of a noisy machine."""
    progress = None
    counts = message_counts(config, world)
    if rank == 0 and config.progress:
        from tqdm import tqdm

        progress = tqdm(total=len(config.collectives) * len(counts) * len(backends), unit="run", file=sys.stderr,
                        desc=f"ringcoll-bench P={world}", leave=False)
    rows = []
    for name in config.collectives:
        for count in counts:
            for backend in backends:
                rows.append(bench_one(backend, COLLECTIVES[name], count, rank, world, config))
                if progress is not None:
                    progress.update(1)
    if progress is not None:
        progress.close()
    return rows


def run_rank(rank: int, world: int, config: Config, with_mpi: bool = False) -> list[dict]:
    """One rank: ringcoll and its references on the same process group."""
    import torch.distributed as dist

    with Communicator(buffer_bytes=config.buffer_bytes, small_bytes=config.small_bytes) as comm:
        backends = [TorchBackend(comm)] + ([TorchBackend(None)] if config.gloo else [])
        backends += [MpiBackend()] if with_mpi else []
        rows = bench_all(backends, rank, world, config)
        if config.check_cost and comm.check:
            rows += check_cost(comm, rank, world, config)
    dist.barrier()
    return rows


def check_cost(comm, rank: int, world: int, config: Config) -> list[dict]:
    """All-reduce at the smallest and largest size with the call check (RINGCOLL_CHECK) on
    and off: what the mismatch detection costs. The two are measured trial by trial in
    turn, so a slow phase of the machine hits both."""
    rows = []
    counts = message_counts(config, world)
    one_trial = dataclasses.replace(config, trials=1)
    with Communicator(buffer_bytes=config.buffer_bytes, check=False, small_bytes=config.small_bytes) as unchecked:
        for count in sorted({counts[0], counts[-1]}):
            row = {"kind": "check_cost", "collective": "all_reduce", "count": count}
            times = {"on": [], "off": []}
            for label, c in (("on", comm), ("off", unchecked)):
                r = bench_one(TorchBackend(c), COLLECTIVES["all_reduce"], count, rank, world, one_trial)
                row["bytes"], row[f"{label}_wrong"] = r["bytes"], r["out_wrong"]
                times[label].append(r["out_time_us"])
            for _ in range(config.trials - 1):
                for label, c in (("on", comm), ("off", unchecked)):
                    inp, out, _ = _buffers(COLLECTIVES["all_reduce"], count, world, rank, DTYPES[config.dtype],
                                           config.op, in_place=False)
                    backend = TorchBackend(c)
                    slowest, _ = measure(lambda: backend.run("all_reduce", inp, out, config.op, False, rank, world),
                                         backend, one_trial, rank)
                    times[label].append(slowest * 1e6)
            row["on_time_us"], row["off_time_us"] = statistics.median(times["on"]), statistics.median(times["off"])
            rows.append(row)
    return rows


def mpi_available() -> str:
    """'' if the Open MPI reference can run here, else why not."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "not installed (pip install mpi4py, with Open MPI's mpirun)"
    return "" if shutil.which("mpirun") else "not installed (no mpirun on PATH)"


def run_under_mpirun(world: int, config: Config) -> list[dict]:
    """All ranks under mpirun, so MPI is measured between ringcoll and gloo, size by size."""
    with tempfile.TemporaryDirectory() as tmp:
        config_file, rows_file = os.path.join(tmp, "config.json"), os.path.join(tmp, "rows.json")
        with open(config_file, "w") as f:
            json.dump(dataclasses.asdict(config), f)
        with socket.socket() as s:  # a free port for the gloo rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = [shutil.which("mpirun"), "--oversubscribe", "-np", str(world), sys.executable, "-m", "ringcoll.harness.bench",
               "--mpi-worker", config_file, rows_file]
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=3600)
        if proc.returncode != 0 or not os.path.exists(rows_file):
            raise RuntimeError(f"ringcoll-bench: the mpirun launch failed (exit {proc.returncode}):\n{proc.stdout}")
        with open(rows_file) as f:
            return json.load(f)


def mpi_worker(config_file: str, rows_file: str) -> None:
    """Entry point of each rank under mpirun: a gloo process group numbered as MPI numbers."""
    import torch.distributed as dist
    from mpi4py import MPI

    with open(config_file) as f:
        config = Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.load(f).items()})
    rank, world = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = run_rank(rank, world, config, with_mpi=True)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(rows_file, "w") as f:
            json.dump(rows, f)


# --- reporting -----------------------------------------------------------------------------


def reference_form(row: dict) -> str:
    """The one form a reference was timed in."""
    return "out" if "out_time_us" in row else "in"


def busbw(row: Optional[dict], form: Optional[str] = None) -> Optional[float]:
    if row is None:
        return None
    form = form or reference_form(row)
    if not row.get(f"{form}_time_us"):
        return None
    algbw = row["bytes"] / (row[f"{form}_time_us"] * 1e-6) / 1e9
    return algbw * COLLECTIVES[row["collective"]].bus_factor(row["world"])


def fits(rows: list[dict], world: int) -> dict:
    """Fitted alpha-beta model per collective from ringcoll's out-of-place times."""
    out = {}
    for name in COLLECTIVES:
        mine = [r for r in rows if r["collective"] == name and r["backend"] == "ringcoll" and "out_time_us" in r]
        if len(mine) >= 2 and world >= 2:
            out[name] = model.fit(name, world, [r["bytes"] for r in mine], [r["out_time_us"] * 1e-6 for r in mine])
    return out


def _f(value, width, digits=2, missing="n/a"):
    return f"{value:{width}.{digits}f}" if value is not None else f"{missing:>{width}}"


def format_table(rows: list[dict], world: int, config: Config, fitted: dict, mpi_note: str,
                 costs: list[dict] = ()) -> str:
    lines = []
    refs = sorted({r["backend"] for r in rows} - {"ringcoll"})
    for name in config.collectives:
        ours = [r for r in rows if r["collective"] == name and r["backend"] == "ringcoll"]
        by_ref = {ref: {r["bytes"]: r for r in rows if r["collective"] == name and r["backend"] == ref}
                  for ref in refs}
        head = f"# {name}, {world} ranks, {config.dtype}, CPU shared memory; time in us, bandwidth in GB/s"
        if config.straggler_rank is not None:
            head += f"; rank {config.straggler_rank} delayed {config.delay_us:g} us before every call"
        if config.small_bytes is not None:
            head += f"; {ALGORITHM_NOTE.get(config.small_bytes, f'one-shot up to {config.small_bytes} bytes')}"
        lines += ["", head]
        cols = (f"{'size':>11} {'count':>10} {'type':>8} {'redop':>5} |{'time':>9} {'algbw':>6} {'busbw':>6} "
                f"{'#wrong':>6} |{'time':>9} {'algbw':>6} {'busbw':>6} {'#wrong':>6}")
        groups = f"# {'':>37} |{'ringcoll out-of-place':^31} |{'ringcoll in-place':^31}"
        for ref in refs:
            cols += f" |{'time':>9} {'busbw':>6} {'#wrong':>6} {'x ' + ref:>7}"
            groups += f" |{ref:^32}"
        if fitted.get(name):
            cols += f" |{'model':>9}"
        if config.straggler_rank is not None:
            cols += f" |{'fastest':>9}"
        lines += [groups, cols]
        for r in ours:
            out_bus, in_bus = busbw(r, "out"), busbw(r, "in")
            line = (f"{r['bytes']:>11} {r['count']:>10} {r['type']:>8} {r['redop']:>5} |"
                    f"{r['out_time_us']:9.1f} {r['bytes'] / r['out_time_us'] / 1e3:6.2f} {out_bus:6.2f} {r['out_wrong']:>6} |"
                    f"{r['in_time_us']:9.1f} {r['bytes'] / r['in_time_us'] / 1e3:6.2f} {in_bus:6.2f} {r['in_wrong']:>6}")
            for ref in refs:
                ref_row = by_ref[ref].get(r["bytes"])
                form = reference_form(ref_row) if ref_row else "out"
                ref_bus = busbw(ref_row)
                ratio = out_bus / ref_bus if ref_bus else None
                wrong = ref_row.get(f"{form}_wrong", "-") if ref_row else "-"
                line += (f" |{_f(ref_row and ref_row.get(f'{form}_time_us'), 9, 1)} {_f(ref_bus, 6)} {wrong:>6}"
                         f" {_f(ratio, 7)}")
            if fitted.get(name):
                line += f" |{fitted[name].predict(name, world, r['bytes']) * 1e6:9.1f}"
            if config.straggler_rank is not None:
                line += f" |{r['out_fastest_us']:9.1f}"
            lines.append(line)
        if fitted.get(name):
            f = fitted[name]
            lines.append(f"# model: alpha = {f.alpha * 1e6:.2f} us per ring step, beta = {f.beta / 1e9:.2f} GB/s per "
                         f"link, fitted to ringcoll's out-of-place times (ringcoll.learning.model)")
    if costs:
        lines += ["", "# call check (RINGCOLL_CHECK, mismatch detection): all_reduce out-of-place, measured in turn"]
        for c in costs:
            lines.append(f"#   {c['bytes']:>11} bytes: {c['on_time_us']:9.1f} us checked, {c['off_time_us']:9.1f} us "
                         f"unchecked ({c['on_time_us'] / c['off_time_us'] - 1:+.1%})")
    if mpi_note:
        lines.append(f"\n# Open MPI reference: {mpi_note}")
    wrong = total_wrong(rows)
    buses = [busbw(r, "out") for r in rows if r["backend"] == "ringcoll"]
    lines += ["", f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}",
              f"# Avg bus bandwidth    : {sum(buses) / max(len(buses), 1):.3f} GB/s (ringcoll, out-of-place)", ""]
    return "\n".join(lines)


def total_wrong(rows: list[dict]) -> int:
    return sum(r.get("out_wrong", 0) + r.get("in_wrong", 0) + r.get("on_wrong", 0) + r.get("off_wrong", 0)
               for r in rows)


def plot(rows: list[dict], world: int, config: Config, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(config.collectives), figsize=(5 * len(config.collectives), 4), squeeze=False)
    for ax, name in zip(axes[0], config.collectives):
        for backend in sorted({r["backend"] for r in rows}):
            mine = [r for r in rows if r["collective"] == name and r["backend"] == backend]
            for form in ("out", "in") if backend == "ringcoll" else {reference_form(r) for r in mine}:
                xs = [r["bytes"] for r in mine if f"{form}_time_us" in r]
                label = f"{backend} ({'in-place' if form == 'in' else 'out-of-place'})" if backend == "ringcoll" \
                    else backend
                ax.plot(xs, [busbw(r, form) for r in mine if f"{form}_time_us" in r], marker="o", ms=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{name}, P={world}, {config.dtype}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --algorithm: the small-message threshold each choice sets (Communicator's small_bytes=).
# "oneshot" takes the one-shot path wherever the message fits one buffer slot, the ring above.
ALGORITHMS = {"auto": None, "ring": 0, "oneshot": 1 << 62}
ALGORITHM_NOTE = {0: "algorithm: ring only", 1 << 62: "algorithm: one-shot where it fits a slot, else ring"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ringcoll-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-b", "--minbytes", default="1K", help="smallest message (default 1K)")
    p.add_argument("-e", "--maxbytes", default="64M", help="largest message (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier between rows (default 2)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations, at least (default 20)")
    p.add_argument("--trials", type=int, default=3, help="timed loops per size; the median is reported")
    p.add_argument("--min-ms", type=float, default=20.0, help="each timed loop lasts at least this long")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--op", choices=OPS, default="sum")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--collectives", default="all_reduce,reduce_scatter,all_gather")
    p.add_argument("--no-gloo", action="store_true", help="skip the gloo reference")
    p.add_argument("--no-mpi", action="store_true", help="skip the Open MPI reference")
    p.add_argument("--buffer-bytes", default=None, help="registered buffer per rank (default 4M)")
    p.add_argument("--algorithm", choices=list(ALGORITHMS), default="auto",
                   help="ring: the ring at every size; oneshot: the one-shot path wherever the message fits one "
                        "slot; auto (default): the Communicator's choice (RINGCOLL_SMALL_BYTES). Run ring and "
                        "oneshot to see the crossover")
    p.add_argument("--fit", action="store_true", help="fit the alpha-beta model; print predictions")
    p.add_argument("--no-check-cost", action="store_true",
                   help="skip measuring the call check's cost (all-reduce with RINGCOLL_CHECK on and off)")
    p.add_argument("--straggler-rank", type=int, default=None, help="delay this rank before every call")
    p.add_argument("--delay-us", type=float, default=0.0, help="the straggler's delay (microseconds)")
    p.add_argument("--json", metavar="FILE", help="also write all rows as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot busbw against size")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--mpi-worker", nargs=2, metavar=("CONFIG", "ROWS"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mpi_worker:
        mpi_worker(*args.mpi_worker)
        return 0
    from ringcoll.harness.launcher import spawn

    def refuse(message: str) -> int:
        print(f"ringcoll-bench: {message}", file=sys.stderr)
        return 2

    if args.device == "cuda":
        return refuse("the GPU sweep waits for the CUDA transport to be verified on a GPU (bench/device_check.sh "
                      "runs bench/device_bench.py there); use --device cpu")
    if args.op == "avg" and not DTYPES[args.dtype].is_floating_point:
        return refuse(f"--op avg needs a floating dtype, not {args.dtype}")
    unknown = set(args.collectives.split(",")) - set(COLLECTIVES)
    if unknown:
        return refuse(f"unknown collectives {sorted(unknown)}; choose from {sorted(COLLECTIVES)}")
    if args.straggler_rank is not None and not 0 <= args.straggler_rank < args.nproc:
        return refuse(f"--straggler-rank {args.straggler_rank} is not a rank of --nproc {args.nproc}")
    config = Config(min_bytes=parse_bytes(args.minbytes), max_bytes=parse_bytes(args.maxbytes),
                    factor=args.stepfactor, warmup=args.warmup_iters, iters=args.iters, trials=args.trials,
                    min_seconds=args.min_ms / 1e3, dtype=args.dtype, op=args.op,
                    collectives=tuple(args.collectives.split(",")), gloo=not args.no_gloo,
                    buffer_bytes=parse_bytes(args.buffer_bytes) if args.buffer_bytes else None,
                    check_cost=not args.no_check_cost, straggler_rank=args.straggler_rank, delay_us=args.delay_us, progress=not args.no_progress,
                    small_bytes=ALGORITHMS[args.algorithm])

    mpi_note = "skipped (--no-mpi)" if args.no_mpi else mpi_available()
    if mpi_note:
        rows = spawn(run_rank, args.nproc, config, timeout=3600)[0]
    else:
        rows = run_under_mpirun(args.nproc, config)
    costs = [r for r in rows if r.get("kind") == "check_cost"]
    rows = [r for r in rows if "kind" not in r]
    fitted = fits(rows, args.nproc) if args.fit else {}
    print(format_table(rows, args.nproc, config, fitted, mpi_note, costs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": args.nproc, "device": args.device, "config": dataclasses.asdict(config),
                       "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                   "torch": torch.__version__},
                       "fit": {k: dataclasses.asdict(v) for k, v in fitted.items()},
                       "mpi": mpi_note or "ran", "rows": rows, "check_cost": costs}, f, indent=1)
    if args.plot:
        plot(rows, args.nproc, config, args.plot)
    return 1 if total_wrong(rows + costs) else 0


if __name__ == "__main__":
    sys.exit(main())
