"""ringcoll-bench: the checked benchmark, in the manner of nccl-tests.

    ringcoll-bench                      # CPU shared memory, 2 ranks, 1 KiB .. 64 MiB
    ringcoll-bench -b 8 -e 1M -f 4 --nproc 3 --dtype float16 --op max

For every collective and size it first checks the result (out-of-place and in-place)
against values computed independently on every rank, then times ringcoll and, in the
same run, the same call through torch.distributed (gloo). Columns:

    size   bytes of the whole message (all-reduce: the tensor; reduce-scatter: the input;
           all-gather: the output), as nccl-tests counts them
    time   microseconds per call, the slowest rank's average over -n iterations
    algbw  size / time
    busbw  algbw x 2(P-1)/P (all-reduce) or x (P-1)/P (reduce-scatter, all-gather): the
           bytes each rank actually puts on the ring, so it is comparable across P
    #wrong elements that differ from the expected result (must be 0)

Exits with status 1 if any result is wrong.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ringcoll.communicator import parse_bytes

# --- the collectives, each defined once around the shared harness -------------------------


@dataclasses.dataclass(frozen=True)
class CollectiveDef:
    name: str
    bus_factor: Callable[[int], float]  # busbw = algbw * bus_factor(P)
    reduces: bool
    # elements of (input, output) for a message of `count` elements and P ranks
    shapes: Callable[[int, int], tuple[int, int]]


def _all_reduce_shapes(count, world):
    return count, count


def _reduce_scatter_shapes(count, world):
    return count, count // world


def _all_gather_shapes(count, world):
    return count // world, count


COLLECTIVES = {
    "all_reduce": CollectiveDef("all_reduce", lambda p: 2 * (p - 1) / p, True, _all_reduce_shapes),
    "reduce_scatter": CollectiveDef("reduce_scatter", lambda p: (p - 1) / p, True, _reduce_scatter_shapes),
    "all_gather": CollectiveDef("all_gather", lambda p: (p - 1) / p, False, _all_gather_shapes),
}

DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64,
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


# --- one rank ------------------------------------------------------------------------------


@dataclasses.dataclass
class Config:
    min_bytes: int = 1024
    max_bytes: int = 64 << 20
    factor: int = 2
    warmup: int = 5
    iters: int = 20
    dtype: str = "float32"
    op: str = "sum"
    collectives: tuple = ("all_reduce", "reduce_scatter", "all_gather")
    reference: bool = True
    buffer_bytes: Optional[int] = None


def sizes(config: Config, world: int, elem: int) -> list[int]:
    """Message sizes in elements, multiples of P so every rank has an equal share."""
    out, size = [], config.min_bytes
    while size <= config.max_bytes:
        count = max(world, size // elem // world * world)
        if not out or count != out[-1]:
            out.append(count)
        size *= config.factor
    return out


def _make_call(api, coll: CollectiveDef, inp, out, op, in_place: bool, world: int, rank: int):
    """(call, result_tensor) for ringcoll (api = a Communicator) or gloo (api = None)."""
    if coll.name == "all_reduce":
        if api is None:  # torch.distributed has only the in-place form
            return (lambda: dist.all_reduce(inp, op=op)), inp
        if in_place:
            return (lambda: api.all_reduce(inp, op=op)), inp
        return (lambda: api.all_reduce(inp, op=op, output=out)), out
    if coll.name == "reduce_scatter":
        dst = inp.view(world, -1)[rank] if in_place else out
        fn = api.reduce_scatter_tensor if api is not None else dist.reduce_scatter_tensor
        return (lambda: fn(dst, inp, op=op)), dst
    src = out.view(world, -1)[rank] if in_place else inp
    fn = api.all_gather_into_tensor if api is not None else dist.all_gather_into_tensor
    return (lambda: fn(out, src)), out


def _timed(call, warmup: int, iters: int) -> float:
    """Seconds per call: the slowest rank's average (all ranks start together)."""
    for _ in range(warmup):
        call()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _count_wrong(result: torch.Tensor, expected: torch.Tensor) -> int:
    return int((result != expected).sum())


def run_rank(rank: int, world: int, config: Config) -> list[dict]:
    import ringcoll

    dtype = DTYPES[config.dtype]
    op_ours = {"sum": ringcoll.ReduceOp.SUM, "prod": ringcoll.ReduceOp.PRODUCT, "min": ringcoll.ReduceOp.MIN,
               "max": ringcoll.ReduceOp.MAX, "avg": ringcoll.ReduceOp.AVG}[config.op]
    op_gloo = getattr(dist.ReduceOp, op_ours.name)
    rows = []
    with ringcoll.Communicator(buffer_bytes=config.buffer_bytes) as comm:
        elem = torch.empty(0, dtype=dtype).element_size()
        for name in config.collectives:
            coll = COLLECTIVES[name]
            for count in sizes(config, world, elem):
                row = {"collective": name, "bytes": count * elem, "count": count, "type": config.dtype,
                       "redop": config.op if coll.reduces else "none", "world": world}
                expected = expected_result(coll, rank, world, count, dtype, config.op)
                in_numel, out_numel = coll.shapes(count, world)
                for placement in ("out", "in"):
                    in_place = placement == "in"
                    # Check first: fresh inputs, one call, compare; then time on the same buffers.
                    if coll.name == "all_gather" and in_place:
                        out = torch.zeros(out_numel, dtype=dtype)
                        out.view(world, -1)[rank].copy_(rank_input(rank, in_numel, dtype, config.op))
                        inp = None
                    else:
                        inp = rank_input(rank, in_numel, dtype, config.op)
                        out = torch.zeros(out_numel, dtype=dtype)
                    call, result = _make_call(comm, coll, inp, out, op_ours, in_place, world, rank)
                    call()
                    wrong = torch.tensor([_count_wrong(result, expected)])
                    dist.all_reduce(wrong)
                    row[f"{placement}_wrong"] = int(wrong)
                    row[f"{placement}_time_us"] = _timed(call, config.warmup, config.iters) * 1e6
                if config.reference:
                    gin = rank_input(rank, in_numel, dtype, config.op)
                    gout = torch.zeros(out_numel, dtype=dtype)
                    try:
                        call, _ = _make_call(None, coll, gin, gout, op_gloo, False, world, rank)
                        row["gloo_time_us"] = _timed(call, config.warmup, config.iters) * 1e6
                    except (RuntimeError, ValueError) as e:  # an op/dtype gloo lacks
                        row["gloo_time_us"] = None
                        row["gloo_error"] = str(e).splitlines()[0]
                rows.append(row)
    return rows


# --- reporting -----------------------------------------------------------------------------


def _bw(row, key, world):
    t = row.get(key)
    if not t:
        return None, None
    algbw = row["bytes"] / (t * 1e-6) / 1e9
    return algbw, algbw * COLLECTIVES[row["collective"]].bus_factor(world)


def format_table(rows: list[dict], world: int) -> str:
    lines = []
    header = (f"{'size':>12} {'count':>12} {'type':>8} {'redop':>6} | "
              f"{'time(us)':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6} | "
              f"{'time(us)':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6} | {'gloo(us)':>10} {'busbw':>7} {'x gloo':>7}")
    current = None
    for row in rows:
        if row["collective"] != current:
            current = row["collective"]
            lines += ["", f"# {current}, {world} ranks, CPU shared memory (busbw in GB/s)",
                      f"# {'':>46} | {'out-of-place':^35} | {'in-place':^35} | {'reference':^27}", header]
        _, out_bus = _bw(row, "out_time_us", world)
        _, in_bus = _bw(row, "in_time_us", world)
        out_alg, _ = _bw(row, "out_time_us", world)
        in_alg, _ = _bw(row, "in_time_us", world)
        _, gloo_bus = _bw(row, "gloo_time_us", world)
        ratio = f"{out_bus / gloo_bus:7.2f}" if gloo_bus else f"{'n/a':>7}"
        gloo_t = f"{row['gloo_time_us']:10.1f}" if row.get("gloo_time_us") else f"{'n/a':>10}"
        gloo_b = f"{gloo_bus:7.2f}" if gloo_bus else f"{'n/a':>7}"
        lines.append(
            f"{row['bytes']:>12} {row['count']:>12} {row['type']:>8} {row['redop']:>6} | "
            f"{row['out_time_us']:10.1f} {out_alg:7.2f} {out_bus:7.2f} {row['out_wrong']:>6} | "
            f"{row['in_time_us']:10.1f} {in_alg:7.2f} {in_bus:7.2f} {row['in_wrong']:>6} | "
            f"{gloo_t} {gloo_b} {ratio}")
    buses = [_bw(r, "out_time_us", world)[1] for r in rows]
    wrong = sum(r["out_wrong"] + r["in_wrong"] for r in rows)
    lines += ["", f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}",
              f"# Avg bus bandwidth    : {sum(buses) / max(len(buses), 1):.3f} GB/s", ""]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ringcoll-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("-b", "--minbytes", default="1K", help="smallest message (default 1K)")
    p.add_argument("-e", "--maxbytes", default="64M", help="largest message (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier between rows (default 2)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--op", choices=OPS, default="sum")
    p.add_argument("--device", choices=["cpu"], default="cpu")
    p.add_argument("--collectives", default="all_reduce,reduce_scatter,all_gather")
    p.add_argument("--no-reference", action="store_true", help="skip the gloo columns")
    p.add_argument("--buffer-bytes", default=None, help="registered buffer per rank (default 4M)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from ringcoll.testing import spawn

    args = parse_args(argv)
    if args.op == "avg" and not DTYPES[args.dtype].is_floating_point:
        print(f"ringcoll-bench: --op avg needs a floating dtype, not {args.dtype}", file=sys.stderr)
        return 2
    config = Config(min_bytes=parse_bytes(args.minbytes), max_bytes=parse_bytes(args.maxbytes), factor=args.stepfactor,
                    warmup=args.warmup_iters, iters=args.iters, dtype=args.dtype, op=args.op,
                    collectives=tuple(args.collectives.split(",")), reference=not args.no_reference,
                    buffer_bytes=parse_bytes(args.buffer_bytes) if args.buffer_bytes else None)
    rows = spawn(run_rank, args.nproc, config, timeout=3600)[0]
    print(format_table(rows, args.nproc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": args.nproc, "device": args.device, "rows": rows}, f, indent=1)
    wrong = sum(r["out_wrong"] + r["in_wrong"] for r in rows)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
