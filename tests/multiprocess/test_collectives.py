"""Tier 2: every collective x op x dtype x awkward size x world size 1..5, against gloo.

Each test is one ``spawn`` (one per world size, plus validation and configuration): the
whole matrix runs inside the rank function, which collects mismatches as strings and
returns them, so a failure report names every bad case at once and a run costs a handful
of process launches, not thousands.

References. gloo runs on the same inputs. To keep gloo's per-call latency (milliseconds
when 5 ranks share 2 cores) off the bill, the cases of one (collective, dtype, op) are laid
side by side and gloo reduces or gathers them in ONE call (the collectives are
elementwise per chunk, so each case's slice of the result is gloo's answer for that case).
AVG's reference is gloo's exact SUM divided by the world size in the same dtype, i.e. what
``torch`` computes for ``sum / P``.

Exactness. Integer inputs are random over the whole range (sums and products wrap, as in
torch). Float inputs for SUM/AVG are small multiples of a power of two, so that every
partial sum in any order is exact in every dtype; PRODUCT uses {0, +-1/2, +-1, +-2};
MIN/MAX use arbitrary values (and infinities). Those compare bit for bit. Generic random
floats are compared with a tight elementwise error bound (one case per dtype). All ranks'
results of all-reduce / all-gather are checked to be bitwise identical to each other.

Memory. Outputs (and inputs) are views one element into a sentinel-filled buffer, so they
are misaligned and any write past either end shows; out-of-place inputs must come back
unchanged, and in-place reduce-scatter must leave the other ranks' chunks alone.

Sizes: 0, 1, P-1, P+1 (every dtype x op x form, 4 KiB and 4 MiB buffers); the slice
boundaries of the 4 KiB buffer (every dtype x op); a prime near 10^5 through the 4 KiB
buffer; messages over the default 4 MiB buffer (all_reduce) or over 4 MiB / P per rank.

Algorithms. The 4 KiB-buffer communicator runs the ring at every size (small_bytes=0,
direct_bytes=0);
the default one takes the one-shot path below RINGCOLL_SMALL_BYTES (64 KiB), so the
small sizes above run both. run_one_shot_cases then checks that path on its own: every
dtype x op x form at 1 element, odd counts, exactly at the threshold and one element over
(the ring), mixed on one communicator so one-shot and ring calls alternate on the same
slots, and with the call check off under skewed ranks; it counts that the one-shot path
was taken exactly where ringcoll.learning.schedule.one_shot_fits says. The default
communicator's all-gathers from 16 KiB (RINGCOLL_DIRECT_BYTES) up to 32 MiB read their peers directly,
before the one-shot path;
run_direct_read_cases checks that path on its own, every dtype x form from one element up
(direct_bytes=1), past the streaming threshold (its own chunk streamed), alternating with
the other two algorithms,
async and (run_skewed_unchecked_cases) skewed with the call check off; counted against
direct_read_fits likewise. test_symmetric.py's matrix (tensors in symmetric memory, read in
place) runs in the same processes.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import os
import time
import zlib

import pytest
import torch
import torch.distributed as dist

import ringcoll
from ringcoll._types import torch_tensor_forms
from ringcoll.harness.launcher import spawn
from ringcoll.learning.schedule import Collective, direct_read_fits, one_shot_fits

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int8, torch.uint8, torch.int32, torch.int64]
FLOATING = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG"]
BITS = {torch.float32: torch.int32, torch.float64: torch.int64,
        torch.float16: torch.int16, torch.bfloat16: torch.int16}
SMALL_BUFFER = 4096  # slices of a few dozen elements: slicing runs on almost every call
DEFAULT_BUFFER = 4 << 20
PRIME = 100003  # all_reduce size near 10^5
PRIME_CHUNK = 20011  # per-rank count for reduce-scatter / all-gather near 10^5 / 5
COMM_TIMEOUT = 60.0  # a hang surfaces as RingcollTimeoutError well inside the spawn timeout
SPAWN_TIMEOUT = 240.0
MAX_REPORTED = 40
# The matrix runs must not see a RINGCOLL_* setting from the environment of the test run.
CLEAN_ENV = {"RINGCOLL_TIMEOUT": None, "RINGCOLL_BUFFER_BYTES": None, "RINGCOLL_SMALL_BYTES": None,
             "RINGCOLL_DIRECT_BYTES": None, "RINGCOLL_DIRECT_MAX_BYTES": None, "RINGCOLL_SLOT_STORES": None,
             "RINGCOLL_SLOW_HOP_NS": None}
# The slots written with streaming stores (host_strip.h, SlotStores in host_comm.h) for the
# odd worlds' matrices: the even ones keep ordinary stores, so both kinds meet every case.
STREAMED_SLOTS_ENV = {**CLEAN_ENV, "RINGCOLL_SLOT_STORES": "stream"}

_gloo_all_gather, _gloo_reduce_scatter = torch_tensor_forms()


# --- helpers (run inside the ranks) ---------------------------------------------------------

def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _seed(*parts) -> int:
    return zlib.crc32("|".join(str(p) for p in parts).encode())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.dtype]) if t.dtype in BITS else t


def _random_ints(dtype, n, g) -> torch.Tensor:
    info = torch.iinfo(dtype)
    high = info.max if dtype == torch.int64 else info.max + 1
    return torch.randint(info.min, high, (n,), generator=g, dtype=dtype)


# SUM/AVG inputs k * 2^-s with |k| <= K: every partial sum of up to 5 ranks is exact.
_SUMMABLE = {torch.float16: (48, 2), torch.bfloat16: (12, 2), torch.float32: (1 << 16, 8),
             torch.float64: (1 << 40, 20)}
_PRODUCT_VALUES = torch.tensor([1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 1.0, -1.0,
                                2.0, 0.5, -1.0, 1.0, -2.0, 0.5, 1.0, 0.0])


def make_input(kind: str, dtype, n: int, seed: int) -> torch.Tensor:
    """Deterministic input; kind: 'sum' (SUM/AVG), 'prod', 'minmax', 'bits' (copies)."""
    g = torch.Generator().manual_seed(seed)
    floating = dtype in BITS
    if kind == "bits":
        return _random_ints(BITS.get(dtype, dtype), n, g).view(dtype)
    if not floating:
        x = _random_ints(dtype, n, g)
        if kind == "sum" and n >= 2:  # wrap for certain on every world size > 1
            x[0], x[1] = torch.iinfo(dtype).max, torch.iinfo(dtype).min
        if kind == "prod" and n >= 2:  # half small factors, so not every product wraps to 0
            lo = 0 if dtype == torch.uint8 else -3
            x[1::2] = torch.randint(lo, 4, (n // 2,), generator=g, dtype=dtype)
        return x
    if kind == "sum":
        k, shift = _SUMMABLE[dtype]
        ints = torch.randint(-k, k + 1, (n,), generator=g, dtype=torch.int64)
        return (ints.to(torch.float64) * 2.0 ** -shift).to(dtype)
    if kind == "prod":
        return _PRODUCT_VALUES[torch.randint(0, len(_PRODUCT_VALUES), (n,), generator=g)].to(dtype)
    if kind == "minmax":
        x = (torch.randn(n, generator=g, dtype=torch.float64) * 100).to(dtype)
        if n >= 4:
            idx = torch.randint(0, n, (2,), generator=g)
            x[idx[0]], x[idx[1]] = float("inf"), float("-inf")
        return x
    raise AssertionError(kind)


def _kind(op_name: str) -> str:
    return {"SUM": "sum", "AVG": "sum", "PRODUCT": "prod", "MIN": "minmax", "MAX": "minmax"}[op_name]


def _ops(op_name: str):
    """The same op spelled both ways: (ringcoll.ReduceOp.X, dist.ReduceOp.X)."""
    return ringcoll.ReduceOp[op_name], getattr(dist.ReduceOp, op_name)


def _sentinel(n: int, dtype, shape=None) -> torch.Tensor:
    t = torch.full((n,), float("nan") if dtype in BITS else 91, dtype=dtype)
    return t.view(shape) if shape is not None else t


def _list_shape(c: int):
    return (2, c // 2) if c >= 2 and c % 2 == 0 else (c,)


GUARD = 3


def _guarded(n: int, dtype, like=None):
    """(view, base): n elements starting one element into a sentinel-filled buffer (so the
    view is misaligned), with guard elements on both sides that a collective must not touch."""
    base = _sentinel(1 + n + GUARD, dtype)
    view = base[1:1 + n]
    if like is not None:
        view.copy_(like)
    return view, base


def _guards_intact(chk, label, base, n):
    guards = torch.cat([base[:1], base[1 + n:]])
    chk.equal(label + " (memory next to the output must stay untouched)", guards, _sentinel(guards.numel(), base.dtype))


def slice_edge_sizes(world, dtype, buffer_bytes):
    """Sizes at the slicing boundaries of a communicator with this buffer. Mirrors the host
    driver's slot size (buffer / (2 banks x P), cache-line aligned); should that change, these
    are still valid sizes, only less pointed. Returns (all_reduce sizes, per-rank counts)."""
    slot = buffer_bytes // (2 * world) // 64 * 64
    s = max(1, slot // torch.empty(0, dtype=dtype).element_size())  # elements per slice
    return [world * s, 2 * world * s - 1, 2 * world * s + 1], [2 * s, 2 * s + 1]


class Checker:
    """Collects mismatches (as strings) and digests of results that must agree across ranks."""

    def __init__(self, rank: int):
        self.rank = rank
        self.failures: list[str] = []
        self.digests: list[tuple[str, str]] = []
        self.checked = 0

    def fail(self, label: str, text: str) -> None:
        self.failures.append(f"rank {self.rank}: {label}: {text}")

    def equal(self, label: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        """Bit-for-bit equality (so -0.0 != 0.0 and NaN payloads count)."""
        self.checked += 1
        got, expected = got.reshape(-1), expected.reshape(-1)
        if got.dtype != expected.dtype or got.numel() != expected.numel():
            self.fail(label, f"got {got.dtype}[{got.numel()}], expected {expected.dtype}[{expected.numel()}]")
            return
        diff = _bits(got) != _bits(expected)
        if bool(diff.any()):
            bad = diff.nonzero().reshape(-1)
            i = int(bad[0])
            self.fail(label, f"{bad.numel()} of {got.numel()} elements differ; first at {i}: "
                             f"got {got[i].item()!r}, expected {expected[i].item()!r}")

    def within(self, label: str, got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor,
               reference: torch.Tensor) -> None:
        """|got - exact| <= bound elementwise (exact in float64), and close to gloo's answer."""
        self.checked += 1
        err = (got.double() - exact).abs()
        bad = (err > bound) | ~torch.isfinite(got.double())
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            self.fail(label, f"{int(bad.sum())} elements outside the error bound; first at {i}: got "
                             f"{got[i].item()!r}, exact {exact[i].item()!r}, bound {bound[i].item():.3g}")
        try:
            torch.testing.assert_close(got, reference, rtol=0, atol=2 * float(bound.max()) if bound.numel() else 0)
        except AssertionError as e:
            self.fail(label + " vs gloo", str(e).replace("\n", " "))

    def record(self, label: str, t: torch.Tensor) -> None:
        """Remember t's bits; finish() checks every rank recorded the same."""
        data = _bits(t.contiguous()).reshape(-1).numpy().tobytes()
        self.digests.append((label, hashlib.sha1(data).hexdigest()))

    def finish(self, group=None) -> list[str]:
        world = dist.get_world_size(group)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, self.digests, group=group)
        mine = dict(self.digests)
        for other_rank, theirs in enumerate(everyone):
            if [label for label, _ in theirs] != [label for label, _ in self.digests]:
                self.fail("cross-rank", f"rank {other_rank} ran a different sequence of cases")
                continue
            for label, digest in theirs:
                if digest != mine[label]:
                    self.fail(label, f"result differs bitwise from rank {other_rank}'s")
        if self.checked == 0:
            self.fail("checker", "no case was checked")
        return self.failures[:MAX_REPORTED] + (
            [f"rank {self.rank}: ... and {len(self.failures) - MAX_REPORTED} more"]
            if len(self.failures) > MAX_REPORTED else [])


# --- batched gloo references ---------------------------------------------------------------

def all_reduce_overwritten_on_return(comm, x, out, call, rank, world, **kwargs):
    """Call `call` of an out-of-place all-reduce of x into out, whose peers may read both
    where they lie (a direct plan's input, its shared output), each rank starting later than
    the last (so the first leaves first if nothing holds it) and overwriting both the instant
    its call returns: a peer still reading either takes -1. Returns how many elements of the
    result are wrong (test_cuda_plans.py, test_direct_read.py)."""
    x.fill_(float(100 * call + rank))
    time.sleep(0.002 * rank)
    comm.all_reduce(x, output=out, **kwargs)
    result = out.clone()
    out.fill_(-1.0)
    x.fill_(-1.0)
    return int((result != float(100 * call * world + sum(range(world)))).sum())


def gloo_all_reduce(xs, op_name, world, group=None):
    """gloo's all_reduce of every x, in one call over their concatenation."""
    if not xs:
        return []
    flat = torch.cat([x.reshape(-1) for x in xs])
    if flat.numel():
        dist.all_reduce(flat, op=dist.ReduceOp.SUM if op_name == "AVG" else getattr(dist.ReduceOp, op_name),
                        group=group)
    if op_name == "AVG":
        flat = flat / world  # torch's sum / P, in the same dtype
    return list(flat.split([x.numel() for x in xs]))


def gloo_reduce_scatter(xs, counts, op_name, world, group=None):
    """gloo's reduce_scatter_tensor of every x (x has world * c elements), in one call: the
    inputs sit side by side as a (world, sum c) matrix, so chunk r holds every case's chunk r."""
    if not xs:
        return []
    dtype = xs[0].dtype
    matrix = torch.cat([x.view(world, c) for x, c in zip(xs, counts)], dim=1).contiguous()
    out = torch.empty(sum(counts), dtype=dtype)
    if out.numel():
        _gloo_reduce_scatter(out, matrix.view(-1),
                             op=dist.ReduceOp.SUM if op_name == "AVG" else getattr(dist.ReduceOp, op_name),
                             group=group)
    if op_name == "AVG":
        out = out / world
    return list(out.split(list(counts)))


def gloo_all_gather(xs, world, group=None):
    """gloo's all_gather_into_tensor of every x, in one call."""
    if not xs:
        return []
    flat = torch.cat([x.reshape(-1) for x in xs])
    out = torch.empty(world, flat.numel(), dtype=flat.dtype)
    if flat.numel():
        _gloo_all_gather(out.view(-1), flat, group=group)
    refs, offset = [], 0
    for x in xs:
        refs.append(out[:, offset:offset + x.numel()].reshape(-1))
        offset += x.numel()
    return refs


def run_rooted_cases(chk, rank, world, broadcast_comms, reduce_comms, dtype, op_name, sizes, tag, group=None):
    """broadcast on every communicator in broadcast_comms and reduce on every one in
    reduce_comms, of every root and each size, against gloo's broadcast and reduce of the
    same inputs. A reduce leaves every rank's tensor but the root's as it was (gloo leaves
    partial sums there)."""
    kind = _kind(op_name)
    inputs = [make_input(kind, dtype, n, _seed(tag, "rooted", dtype, op_name, n, rank)) for n in sizes]
    flat = torch.cat(inputs)
    for root in range(world):
        broadcast_ref, reduce_ref = flat.clone(), flat.clone()
        if flat.numel():
            dist.broadcast(broadcast_ref, src=dist.get_global_rank(group, root) if group else root, group=group)
            dist.reduce(reduce_ref, dst=dist.get_global_rank(group, root) if group else root, group=group,
                        op=dist.ReduceOp.SUM if op_name == "AVG" else getattr(dist.ReduceOp, op_name))
        if op_name == "AVG":
            reduce_ref = reduce_ref / world
        broadcast_refs, reduce_refs = broadcast_ref.split(sizes), reduce_ref.split(sizes)
        for comm_name, comm in broadcast_comms:
            for n, x, b_ref in zip(sizes, inputs, broadcast_refs):
                label = f"{comm_name} broadcast {_name(dtype)} n={n} from {root}"
                t, base = _guarded(n, dtype, x)
                comm.broadcast(t, root)
                chk.equal(label, t, b_ref)
                _guards_intact(chk, label, base, n)
        for ci, (comm_name, comm) in enumerate(reduce_comms):
            op = _ops(op_name)[(ci + root) % 2]  # ringcoll's and torch's ReduceOp, in turn
            for n, x, r_ref in zip(sizes, inputs, reduce_refs):
                t, base = _guarded(n, dtype, x)
                comm.reduce(t, root, op=op)
                label = f"{comm_name} reduce {_name(dtype)} {op_name} n={n} to {root}"
                chk.equal(label if rank == root else label + " (a rank not the root keeps its tensor)", t,
                          r_ref if rank == root else x)
                _guards_intact(chk, label, base, n)


# --- the matrix ----------------------------------------------------------------------------

REDUCE_FORMS = ("out_of_place", "in_place", "list", "list_alias")
GATHER_FORMS = ("out_of_place", "in_place", "list", "list_alias")


def run_reduce_cases(chk, rank, world, comms, dtype, op_name, ar_sizes, rs_counts, forms, tag, group=None):
    """all_reduce (sizes ar_sizes) and reduce-scatter (per-rank counts rs_counts, in `forms`)
    of one dtype and op, on every communicator in comms, against gloo."""
    kind = _kind(op_name)
    ar_inputs = [make_input(kind, dtype, n, _seed(tag, "ar", dtype, op_name, n, rank)) for n in ar_sizes]
    rs_inputs = [make_input(kind, dtype, world * c, _seed(tag, "rs", dtype, op_name, c, rank)) for c in rs_counts]
    ar_refs = gloo_all_reduce(ar_inputs, op_name, world, group)
    rs_refs = gloo_reduce_scatter(rs_inputs, rs_counts, op_name, world, group)
    ours, theirs = _ops(op_name)
    for ci, (comm_name, comm) in enumerate(comms):
        op_a, op_b = (ours, theirs) if ci % 2 == 0 else (theirs, ours)
        for n, x, ref in zip(ar_sizes, ar_inputs, ar_refs):
            label = f"{comm_name} all_reduce {_name(dtype)} {op_name} n={n}"
            t, base = _guarded(n, dtype, x)
            if comm.all_reduce(t, op=op_a) is not None:
                chk.fail(label, "a synchronous call returned something other than None")
            chk.equal(label, t, ref)
            _guards_intact(chk, label, base, n)
            chk.record(label, t)
        for c, x, ref in zip(rs_counts, rs_inputs, rs_refs):
            label = f"{comm_name} reduce_scatter_tensor {_name(dtype)} {op_name} count={c}"
            if "out_of_place" in forms:
                inp, _ = _guarded(world * c, dtype, x)
                out, base = _guarded(c, dtype)
                comm.reduce_scatter_tensor(out, inp, op=op_b)
                chk.equal(label, out, ref)
                _guards_intact(chk, label, base, c)
                chk.equal(label + " (input must stay unchanged)", inp, x)
            if "in_place" in forms:
                buf, base = _guarded(world * c, dtype, x)
                out = buf[rank * c:(rank + 1) * c]
                comm.reduce_scatter_tensor(out, buf, op=op_a)
                chk.equal(label + " in place", out, ref)
                _guards_intact(chk, label + " in place", base, world * c)
                chk.equal(label + " in place (other chunks must stay unchanged)",
                          torch.cat([buf[:rank * c], buf[(rank + 1) * c:]]),
                          torch.cat([x[:rank * c], x[(rank + 1) * c:]]))
            shape = _list_shape(c)
            if "list" in forms:
                label = f"{comm_name} reduce_scatter(list) {_name(dtype)} {op_name} count={c}"
                inputs = [x[r * c:(r + 1) * c].clone().view(shape) for r in range(world)]
                out = _sentinel(c, dtype)
                comm.reduce_scatter(out, inputs, op=op_b)
                chk.equal(label, out, ref)
            if "list_alias" in forms:  # output is input_list[rank] itself
                label = (f"{comm_name} reduce_scatter(list, output is input_list[rank]) "
                         f"{_name(dtype)} {op_name} count={c}")
                inputs = [x[r * c:(r + 1) * c].clone().view(shape) for r in range(world)]
                comm.reduce_scatter(inputs[rank], inputs, op=op_a)
                chk.equal(label, inputs[rank], ref)


def run_gather_cases(chk, rank, world, comms, dtype, counts, forms, tag, group=None):
    """all-gather of arbitrary bit patterns (NaN payloads included), per-rank counts `counts`."""
    inputs = [make_input("bits", dtype, c, _seed(tag, "ag", dtype, c, rank)) for c in counts]
    refs = gloo_all_gather(inputs, world, group)
    for comm_name, comm in comms:
        for c, x, ref in zip(counts, inputs, refs):
            label = f"{comm_name} all_gather_into_tensor {_name(dtype)} count={c}"
            shape = _list_shape(c)
            if "out_of_place" in forms:
                inp, _ = _guarded(c, dtype, x)
                out, base = _guarded(world * c, dtype)
                comm.all_gather_into_tensor(out, inp)
                chk.equal(label, out, ref)
                _guards_intact(chk, label, base, world * c)
                chk.equal(label + " (input must stay unchanged)", inp, x)
                chk.record(label, out)
            if "in_place" in forms:
                buf, base = _guarded(world * c, dtype)
                buf[rank * c:(rank + 1) * c] = x
                comm.all_gather_into_tensor(buf, buf[rank * c:(rank + 1) * c])
                chk.equal(label + " in place", buf, ref)
                _guards_intact(chk, label + " in place", base, world * c)
                chk.record(label + " in place", buf)
            if "list" in forms:
                label = f"{comm_name} all_gather(list) {_name(dtype)} count={c}"
                outs = [_sentinel(c, dtype, shape) for _ in range(world)]
                comm.all_gather(outs, x.clone())
                chk.equal(label, torch.cat([o.reshape(-1) for o in outs]), ref)
            if "list_alias" in forms:  # tensor is tensor_list[rank] itself
                label = f"{comm_name} all_gather(list, tensor is tensor_list[rank]) {_name(dtype)} count={c}"
                outs = [_sentinel(c, dtype, shape) for _ in range(world)]
                outs[rank].copy_(x.view(shape))
                comm.all_gather(outs, outs[rank])
                chk.equal(label, torch.cat([o.reshape(-1) for o in outs]), ref)


def run_random_float_cases(chk, rank, world, comm_name, comm):
    """Generic random floats: all_reduce SUM (n = PRIME) and reduce_scatter_tensor AVG, per
    floating dtype, within a tight elementwise bound of the exact (float64) answer."""
    for dtype in FLOATING:
        eps = torch.finfo(dtype).eps
        tiny = torch.finfo(dtype).tiny
        g = torch.Generator().manual_seed(_seed("random", dtype, rank))
        x = torch.randn(PRIME, generator=g, dtype=torch.float64).to(dtype)
        everyone = gloo_all_gather([x], world)[0].view(world, -1).double()
        exact, magnitude = everyone.sum(0), everyone.abs().sum(0)
        ref = gloo_all_reduce([x], "SUM", world)[0]
        t = x.clone()
        comm.all_reduce(t)
        label = f"{comm_name} all_reduce random {_name(dtype)} SUM n={PRIME}"
        # world - 1 roundings of partial sums, plus the final one (each <= eps/2 relative).
        chk.within(label, t, exact, world * eps * magnitude + tiny, ref)
        chk.record(label, t)

        c = 4099
        x = torch.randn(world * c, generator=g, dtype=torch.float64).to(dtype)
        everyone = gloo_all_gather([x], world)[0].view(world, -1).double()[:, rank * c:(rank + 1) * c]
        exact, magnitude = everyone.sum(0) / world, everyone.abs().sum(0) / world
        ref = gloo_reduce_scatter([x], [c], "AVG", world)[0]
        out = _sentinel(c, dtype)
        comm.reduce_scatter_tensor(out, x.clone(), op=ringcoll.ReduceOp.AVG)
        label = f"{comm_name} reduce_scatter_tensor random {_name(dtype)} AVG count={c}"
        chk.within(label, out, exact, world * eps * magnitude + 2 * eps * exact.abs() + tiny, ref)


def run_async_cases(chk, rank, world, small, big):
    """Several async calls queued on two communicators, a sync call behind them, then waits."""
    xs = [make_input("sum", torch.float32, n, _seed("async ar", n, rank)) for n in (world + 1, 1000, 0, 70001)]
    rs_in = make_input("minmax", torch.int32, world * 7, _seed("async rs", rank))
    ag_in = make_input("bits", torch.float16, 513, _seed("async ag", rank))
    rsl_in = make_input("prod", torch.bfloat16, world * 6, _seed("async rsl", rank))
    sync_in = make_input("sum", torch.int64, 3 * world + 2, _seed("async sync", rank))

    works, labels = [], []
    ts = [x.clone() for x in xs]
    for t in ts[:3]:
        works.append(small.all_reduce(t, op=ringcoll.ReduceOp.SUM, async_op=True))
        labels.append(f"async all_reduce n={t.numel()}")
    works.append(big.all_reduce(ts[3], op=dist.ReduceOp.SUM, async_op=True))  # another ring, meanwhile
    labels.append("async all_reduce (second communicator)")
    rs_out = _sentinel(7, torch.int32)
    works.append(small.reduce_scatter_tensor(rs_out, rs_in.clone(), op=dist.ReduceOp.MAX, async_op=True))
    labels.append("async reduce_scatter_tensor")
    ag_out = _sentinel(world * 513, torch.float16)
    works.append(small.all_gather_into_tensor(ag_out, ag_in.clone(), async_op=True))
    labels.append("async all_gather_into_tensor")
    agl_out = [_sentinel(513, torch.float16) for _ in range(world)]
    works.append(small.all_gather(agl_out, ag_in.clone(), async_op=True))
    labels.append("async all_gather(list)")
    rsl_out = _sentinel(6, torch.bfloat16)
    works.append(small.reduce_scatter(rsl_out, [rsl_in[r * 6:(r + 1) * 6].clone() for r in range(world)],
                                      op=ringcoll.ReduceOp.PRODUCT, async_op=True))
    labels.append("async reduce_scatter(list)")
    works.append(small.barrier(async_op=True))
    labels.append("async barrier")
    sync_t = sync_in.clone()
    small.all_reduce(sync_t)  # runs after everything queued before it

    future = works[0].get_future()
    for label, work in reversed(list(zip(labels, works))):
        if not isinstance(work, ringcoll.Work):
            chk.fail(label, f"async_op=True returned {type(work).__name__}, not a Work")
            continue
        if work.wait() is not True:
            chk.fail(label, "wait() did not return True")
        if not work.is_completed() or not work.is_success() or work.exception() is not None:
            chk.fail(label, "not completed successfully after wait()")
    if future.wait()[0] is not ts[0]:
        chk.fail("async get_future", "the future does not hold the output tensor")

    for t, ref in zip(ts, gloo_all_reduce(xs, "SUM", world)):
        chk.equal(f"async all_reduce n={t.numel()}", t, ref)
    chk.equal("async reduce_scatter_tensor", rs_out, gloo_reduce_scatter([rs_in], [7], "MAX", world)[0])
    ag_ref = gloo_all_gather([ag_in], world)[0]
    chk.equal("async all_gather_into_tensor", ag_out, ag_ref)
    chk.equal("async all_gather(list)", torch.cat(agl_out), ag_ref)
    chk.equal("async reduce_scatter(list)", rsl_out, gloo_reduce_scatter([rsl_in], [6], "PRODUCT", world)[0])
    chk.equal("sync all_reduce behind async work", sync_t, gloo_all_reduce([sync_in], "SUM", world)[0])

    # A Work dropped at once: the queued call holds its tensors itself, as gloo's Work does
    # (it held their addresses only: the temporaries were freed before the worker ran it, which
    # then read and wrote freed memory, SIGSEGV), and lets go of them once it has run.
    import gc
    import threading
    import weakref

    go = threading.Event()
    blocker = small.transport._calls.submit(lambda: go.wait(COMM_TIMEOUT), True, "blocker")  # holds the worker
    out = torch.empty(1 << 16)
    alive = weakref.ref(out)
    small.all_reduce(torch.ones(1 << 16), output=out, async_op=True)  # its Work dropped, queued behind
    del out
    gc.collect()
    if alive() is None:
        chk.fail("dropped Work", "the call's output was freed while the call waited in the queue")
    go.set()
    blocker.wait(None)
    small.all_reduce(torch.ones(4))  # after the dropped call has run
    gc.collect()
    if alive() is not None:
        chk.fail("dropped Work", "the call's output is still held after the call ran")


def _module_level_round(chk, rank, world, group, tag):
    """Each module-level drop-in once on `group` (None = default group) against gloo there."""
    n, c = 2 * world + 1, world + 1
    shape = _list_shape(c)
    kw = {} if group is None else {"group": group}
    x = make_input("minmax", torch.float32, n, _seed(tag, "ar", rank))
    t = x.clone()
    ringcoll.all_reduce(t, op=dist.ReduceOp.MAX, **kw)
    chk.equal(f"{tag} ringcoll.all_reduce MAX", t, gloo_all_reduce([x], "MAX", world, group)[0])
    chk.record(f"{tag} ringcoll.all_reduce MAX", t)

    x = make_input("sum", torch.int8, world * c, _seed(tag, "rs", rank))
    ref = gloo_reduce_scatter([x], [c], "SUM", world, group)[0]
    out = _sentinel(c, torch.int8)
    ringcoll.reduce_scatter_tensor(out, x.clone(), op=ringcoll.ReduceOp.SUM, **kw)
    chk.equal(f"{tag} ringcoll.reduce_scatter_tensor", out, ref)
    out = _sentinel(c, torch.int8)
    ringcoll.reduce_scatter_single(out, x.clone(), **kw)
    chk.equal(f"{tag} ringcoll.reduce_scatter_single", out, ref)
    out = _sentinel(c, torch.int8)
    ringcoll.reduce_scatter(out, [x[r * c:(r + 1) * c].clone().view(shape) for r in range(world)], **kw)
    chk.equal(f"{tag} ringcoll.reduce_scatter", out, ref)

    x = make_input("bits", torch.bfloat16, c, _seed(tag, "ag", rank))
    ref = gloo_all_gather([x], world, group)[0]
    out = _sentinel(world * c, torch.bfloat16)
    ringcoll.all_gather_into_tensor(out, x.clone(), **kw)
    chk.equal(f"{tag} ringcoll.all_gather_into_tensor", out, ref)
    out = _sentinel(world * c, torch.bfloat16)
    ringcoll.all_gather_single(out, x.clone(), **kw)
    chk.equal(f"{tag} ringcoll.all_gather_single", out, ref)
    outs = [_sentinel(c, torch.bfloat16, shape) for _ in range(world)]
    ringcoll.all_gather(outs, x.clone(), **kw)
    chk.equal(f"{tag} ringcoll.all_gather", torch.cat([o.reshape(-1) for o in outs]), ref)

    x = make_input("prod", torch.float64, n, _seed(tag, "async", rank))
    t = x.clone()
    work = ringcoll.all_reduce(t, op=ringcoll.ReduceOp.PRODUCT, async_op=True, **kw)
    ringcoll.barrier(**kw)
    work.wait()
    chk.equal(f"{tag} ringcoll.all_reduce PRODUCT async", t, gloo_all_reduce([x], "PRODUCT", world, group)[0])
    ringcoll.barrier(async_op=True, **kw).wait()


def run_module_level_cases(chk, rank, world):
    _module_level_round(chk, rank, world, None, "default group")
    comm = ringcoll.get_communicator()
    if comm.timeout != 300.0 or comm.buffer_bytes != DEFAULT_BUFFER:
        chk.fail("get_communicator", f"defaults are timeout={comm.timeout}, buffer_bytes={comm.buffer_bytes}")
    if ringcoll.get_communicator(None, "cpu") is not comm:
        chk.fail("get_communicator", "not cached per (group, device)")

    # A subgroup that leaves out rank 1, so group ranks differ from global ranks.
    members = [r for r in range(world) if r != 1] if world >= 3 else [world - 1]
    sub = dist.new_group(members)
    if rank in members:
        sub_world = len(members)
        sub_chk = Checker(rank)
        _module_level_round(sub_chk, rank, sub_world, sub, f"subgroup {members}")
        # An explicit Communicator on the subgroup, small buffer, all forms.
        with ringcoll.Communicator(group=sub, buffer_bytes=SMALL_BUFFER, timeout=COMM_TIMEOUT) as comm:
            if (comm.rank, comm.world_size) != (dist.get_rank(sub), sub_world):
                sub_chk.fail("subgroup Communicator", f"rank/world {comm.rank}/{comm.world_size}")
            sub_rank = dist.get_rank(sub)
            comms = [("subgroup buf4K", comm)]
            for dtype, op_name in [(torch.float32, "AVG"), (torch.uint8, "SUM"), (torch.int64, "MIN")]:
                run_reduce_cases(sub_chk, sub_rank, sub_world, comms, dtype, op_name, [1, 1009], [sub_world + 1, 701],
                                 REDUCE_FORMS, "subgroup", sub)
            run_gather_cases(sub_chk, sub_rank, sub_world, comms, torch.float64, [1, 701], GATHER_FORMS, "subgroup",
                             sub)
        chk.failures += sub_chk.finish(sub)  # also: results identical across the subgroup
        chk.checked += sub_chk.checked
    else:  # as torch.distributed: a collective on a group this rank is not in warns and does nothing
        import warnings

        t, out = torch.full((4,), float(rank)), torch.zeros(4 * len(members))
        for name, call in (("all_reduce", lambda: ringcoll.all_reduce(t, group=sub)),
                           ("all_gather_into_tensor", lambda: ringcoll.all_gather_into_tensor(out, t, group=sub)),
                           ("broadcast", lambda: ringcoll.broadcast(t, group_src=0, group=sub)),
                           ("barrier", lambda: ringcoll.barrier(group=sub))):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = call()
            said = [str(w.message) for w in caught]
            if result is not None or said != [f"Running {name} on global rank {rank} which does not belong to the "
                                              "given group."] or t.tolist() != [float(rank)] * 4 or out.any():
                chk.fail("non-member", f"{name}: returned {result!r}, warned {said}, left {t.tolist()}")
        chk.checked += 4
    ringcoll.destroy_communicators()


ONE_SHOT_PER_RANK = 4096  # run_one_shot_cases' threshold is P x this many bytes


def _reads_directly(comm, coll, ring_count, elem) -> bool:
    """Whether this call reads its peers directly on `comm` (which goes before the one-shot
    path, unless the ranks outnumber the cores: HostComm::uses_direct_read)."""
    return (direct_read_fits(coll, ring_count, elem, comm.transport.direct_reads, comm.direct_bytes,
                             comm.direct_max_bytes)
            and not (comm.transport.oversubscribed and _fits_one_shot(comm, coll, ring_count, elem)))


def _fits_one_shot(comm, coll, ring_count, elem) -> bool:
    return one_shot_fits(coll, ring_count, elem, comm.world_size, comm.small_bytes, comm.transport.slot_bytes)


def _takes_one_shot(comm, coll, ring_count, elem) -> bool:
    return _fits_one_shot(comm, coll, ring_count, elem) and not _reads_directly(comm, coll, ring_count, elem)


def _one_shot_expected(comm, coll, ring_counts, elem, repeats=1) -> int:
    """How many of these calls (each `repeats` times) take the one-shot path on `comm`."""
    return repeats * sum(_takes_one_shot(comm, coll, n, elem) for n in ring_counts)


def run_one_shot_cases(chk, rank, world):
    """The one-shot path against gloo: every dtype x op x form, at 1 element, odd counts,
    the threshold exactly and one element over it (the ring), in an order that alternates
    the two algorithms on one communicator; the async queue; then skewed ranks with the
    call check off. Counts that the path was taken exactly where one_shot_fits says."""
    threshold = world * ONE_SHOT_PER_RANK
    # No direct reads: they would take the larger all-gathers off the one-shot path. Native,
    # whose paths these are (auto may pick a plan where its table says: tuning.py).
    with ringcoll.Communicator(buffer_bytes=1 << 20, small_bytes=threshold, direct_bytes=0, algorithm="native",
                               timeout=COMM_TIMEOUT) as comm:
        comms = [("oneshot", comm)]
        for dtype in DTYPES:
            elem = torch.empty(0, dtype=dtype).element_size()
            at, per_rank_at = threshold // elem, ONE_SHOT_PER_RANK // elem
            ar_sizes = [1, at + 1, 3, at, world * 7 + 1]  # one-shot and ring in turn
            counts = [1, per_rank_at + 1, 3, per_rank_at]
            # The list forms pack into the same flat call: two dtypes suffice for them.
            forms = REDUCE_FORMS if dtype in (torch.float32, torch.int8) else ("out_of_place", "in_place")
            for op_name in OPS:
                if op_name == "AVG" and dtype not in FLOATING:
                    continue
                before = comm.transport.one_shot_calls
                run_reduce_cases(chk, rank, world, comms, dtype, op_name, ar_sizes, counts, forms, "oneshot")
                taken = comm.transport.one_shot_calls - before
                expected = (_one_shot_expected(comm, Collective.ALL_REDUCE, ar_sizes, elem)
                            + _one_shot_expected(comm, Collective.REDUCE_SCATTER, [world * c for c in counts], elem,
                                                 len(forms)))
                chk.checked += 1
                if taken != expected or (world > 1 and taken == 0):
                    chk.fail(f"oneshot {_name(dtype)} {op_name}", f"{taken} calls took the one-shot path, "
                                                                  f"expected {expected}")
            before = comm.transport.one_shot_calls
            run_gather_cases(chk, rank, world, comms, dtype, counts, GATHER_FORMS, "oneshot")
            taken = comm.transport.one_shot_calls - before
            expected = _one_shot_expected(comm, Collective.ALL_GATHER, [world * c * elem for c in counts], 1,
                                          len(GATHER_FORMS))
            chk.checked += 1
            if taken != expected:
                chk.fail(f"oneshot all_gather {_name(dtype)}", f"{taken} one-shot calls, expected {expected}")
        with ringcoll.Communicator(timeout=COMM_TIMEOUT) as other:
            run_async_cases(chk, rank, world, comm, other)
        run_one_shot_bits_cases(chk, rank, world, comm)
        run_skewed_unchecked_cases(chk, rank, world)


def run_one_shot_bits_cases(chk, rank, world, one_shot):
    """The one-shot path gives the ring's bits: random floats (whose sum shows the order it
    was taken in, from P = 3 on) reduced on `one_shot` and on a ring-only communicator."""
    with ringcoll.Communicator(buffer_bytes=1 << 20, small_bytes=0, timeout=COMM_TIMEOUT) as ring:
        for dtype in FLOATING:
            for op_name in ("SUM", "PRODUCT", "AVG"):
                op = getattr(dist.ReduceOp, op_name)
                for count in (world * 5 + 2, 1):
                    g = torch.Generator().manual_seed(1000 * rank + count)
                    x = (torch.rand(world * count, generator=g, dtype=torch.float64) + 0.5).to(dtype)
                    label = f"one-shot bits {_name(dtype)} {op_name} {world * count}"
                    for collective in ("all_reduce", "reduce_scatter_tensor"):
                        results = []
                        for comm in (one_shot, ring):
                            out = torch.empty(world * count if collective == "all_reduce" else count, dtype=dtype)
                            if collective == "all_reduce":
                                out.copy_(x)
                                comm.all_reduce(out, op=op)
                            else:
                                comm.reduce_scatter_tensor(out, x, op=op)
                            results.append(out)
                        chk.equal(f"{label} {collective}", results[0], results[1])


def _direct_expected(comm, message_bytes, repeats=1) -> int:
    """How many all-gathers of these message sizes (each `repeats` times) read peers directly on `comm`."""
    return repeats * sum(_reads_directly(comm, Collective.ALL_GATHER, n, 1) for n in message_bytes)


def _communicator_with_direct_max(max_bytes: int, **settings):
    """A Communicator built with RINGCOLL_DIRECT_MAX_BYTES = max_bytes (an environment setting
    only, read at construction); the environment is as before afterwards."""
    import os

    os.environ["RINGCOLL_DIRECT_MAX_BYTES"] = str(max_bytes)
    try:
        return ringcoll.Communicator(timeout=COMM_TIMEOUT, **settings)
    finally:
        del os.environ["RINGCOLL_DIRECT_MAX_BYTES"]


def run_direct_read_cases(chk, rank, world):
    """The direct-read all-gather against gloo: every dtype x form at 1, P-1, P+1 and a
    prime count per rank (direct_bytes=1, small_bytes=0, no upper bound: every non-empty
    all-gather reads its peers directly); a message past the streaming threshold (the own chunk
    streamed); one communicator where one-shot, ring and direct calls alternate; the async
    queue. Counts that the path was taken exactly where direct_read_fits says."""
    # Without the upper bound: every case reads directly, whatever the default bound.
    with _communicator_with_direct_max(1 << 62, small_bytes=0, direct_bytes=1, algorithm="native") as comm:
        chk.checked += 1
        if world > 1 and not comm.transport.direct_reads:
            chk.fail("direct reads", "not available on this machine, so untested: "
                                     + comm.transport.direct_reads_unavailable)
        comms = [("direct", comm)]
        for dtype in DTYPES:
            elem = torch.empty(0, dtype=dtype).element_size()
            counts = sorted({1, max(world - 1, 1), world + 1, PRIME_CHUNK})
            before = comm.transport.direct_calls
            run_gather_cases(chk, rank, world, comms, dtype, counts, GATHER_FORMS, "direct")
            taken = comm.transport.direct_calls - before
            expected = _direct_expected(comm, [world * c * elem for c in counts], len(GATHER_FORMS))
            chk.checked += 1
            if taken != expected or (world > 1 and taken == 0):
                chk.fail(f"direct all_gather {_name(dtype)}", f"{taken} direct calls, expected {expected}")
        # Past the streaming threshold (RINGCOLL_STREAMING_BYTES): the own chunk takes streaming stores
        own_streamed = ringcoll._C.streaming_threshold_bytes() // (4 * world) + 3
        run_gather_cases(chk, rank, world, comms, torch.float32, [own_streamed], ("out_of_place", "in_place"), "stream")
        run_async_cases(chk, rank, world, comm, comm)

    # In turn: the one-shot path below P x 1 KiB, direct reads (which go before it, unless the
    # ranks outnumber the cores: then from P x 1.5 KiB, past the one-shot) from there to
    # RINGCOLL_DIRECT_MAX_BYTES = P x 4 KiB, the ring above (past small_bytes too).
    with _communicator_with_direct_max(world * ONE_SHOT_PER_RANK, buffer_bytes=1 << 16, algorithm="native",
                                       small_bytes=world * 1536, direct_bytes=world * 1024) as comm:
        counts = [1, 2048, ONE_SHOT_PER_RANK + 904, 2, 1024, 3]  # int8: bytes per rank
        one_shot, direct = comm.transport.one_shot_calls, comm.transport.direct_calls
        run_gather_cases(chk, rank, world, [("mixed", comm)], torch.int8, counts, ("out_of_place", "in_place"),
                         "mixed")
        messages = [world * c for c in counts]
        want = (_one_shot_expected(comm, Collective.ALL_GATHER, messages, 1, 2), _direct_expected(comm, messages, 2))
        got = (comm.transport.one_shot_calls - one_shot, comm.transport.direct_calls - direct)
        chk.checked += 1
        rings = 2 * len(counts) - sum(got)
        if got != want or (world > 1 and (0 in got or rings == 0)):
            chk.fail("mixed all_gather", f"(one-shot, direct) calls {got}, expected {want}, {rings} on the ring")
        chk.checked += 1
        if world > 1 and comm.transport.oversubscribed != (world > os.cpu_count()):
            chk.fail("mixed all_gather", f"oversubscribed is {comm.transport.oversubscribed} with {world} ranks "
                                         f"on {os.cpu_count()} cores")


def run_skewed_unchecked_cases(chk, rank, world, calls=150):
    """With the call check off nothing but the data flags orders the ranks: a random mix of
    one-shot and ring calls and of plans (the same sequence on every rank) with a random rank
    held back before each, so a fast rank runs ahead onto slots a slow one may still be
    reading: within a call, from one plan call to the next, and across a change of layout or
    path (the drains). Each result is checked against sums every rank computes itself
    (integers: exact)."""
    import random
    import time

    from ringcoll import plans

    plan = random.Random(_seed("skew", world))
    with ringcoll.Communicator(buffer_bytes=1 << 16, small_bytes=1 << 12, direct_bytes=1 << 14, check=False,
                               algorithm="native", timeout=COMM_TIMEOUT) as comm:
        before, direct_before = comm.transport.one_shot_calls, comm.transport.direct_calls
        expected_one_shot = expected_direct = 0
        for i in range(calls):
            coll = plan.choice(["all_reduce", "reduce_scatter", "all_gather"])
            count = plan.choice([1, 5, 200, 1023, 1024 // world, 1500, 5000])
            # the default path twice as often as each plan; runs of one plan keep its layout
            runnable = [name for name in plans.BUILTIN if coll in plans.BUILTIN_COLLECTIVES[name]
                        and (comm.transport.direct_reads or not plans.reads_in_place(name, coll, world))]
            algorithm = plan.choice([None, None, *runnable]) if i % 4 == 0 else algorithm
            if algorithm not in runnable:
                algorithm = None
            held, pause = plan.randrange(2 * world), plan.random() * 2e-3  # drawn alike on every rank
            if held == rank:
                time.sleep(pause)
            inputs = [torch.randint(-1000, 1000, (count * (world if coll == "reduce_scatter" else 1),),
                                    generator=torch.Generator().manual_seed(_seed("skew", i, r)), dtype=torch.int32)
                      for r in range(world)]
            mine = inputs[rank].clone()
            if coll == "all_reduce":
                comm.all_reduce(mine, algorithm=algorithm)
                got, want = mine, sum(inputs)
            elif coll == "reduce_scatter":
                got = _sentinel(count, torch.int32)
                comm.reduce_scatter_tensor(got, mine, algorithm=algorithm)
                want = sum(inputs)[rank * count:(rank + 1) * count]
            else:
                got = _sentinel(world * count, torch.int32)
                comm.all_gather_into_tensor(got, mine, algorithm=algorithm)
                want = torch.cat(inputs)
            ring_count = count * (1 if coll == "all_reduce" else world)
            if algorithm is None:
                expected_one_shot += _takes_one_shot(comm, Collective[coll.upper()], ring_count, 4)
                expected_direct += _reads_directly(comm, Collective[coll.upper()], ring_count, 4)
            chk.equal(f"skewed unchecked call {i}: {coll} count={count} algorithm={algorithm}", got,
                      want.to(torch.int32))
        chk.checked += 1
        if comm.transport.one_shot_calls - before != expected_one_shot or (world > 1 and expected_one_shot == 0):
            chk.fail("skewed unchecked", f"{comm.transport.one_shot_calls - before} one-shot calls, "
                                         f"expected {expected_one_shot}")
        chk.checked += 1
        if comm.transport.direct_calls - direct_before != expected_direct or (world > 1 and expected_direct == 0):
            chk.fail("skewed unchecked", f"{comm.transport.direct_calls - direct_before} direct calls, "
                                         f"expected {expected_direct}")


def _matrix_rank(rank, world):
    chk = Checker(rank)
    with ringcoll.Communicator(buffer_bytes=SMALL_BUFFER, timeout=COMM_TIMEOUT, small_bytes=0,
                               direct_bytes=0) as small, \
            ringcoll.Communicator(timeout=COMM_TIMEOUT) as big:
        if big.buffer_bytes != DEFAULT_BUFFER or small.buffer_bytes != SMALL_BUFFER:
            chk.fail("Communicator", f"buffer_bytes {small.buffer_bytes}, {big.buffer_bytes}")
        both = [("buf4K", small), ("buf4M", big)]

        # Awkward small sizes: every dtype x op x form, on both buffer sizes.
        sizes = sorted({0, 1, world - 1, world + 1})
        for dtype in DTYPES:
            for op_name in OPS:
                if op_name == "AVG" and dtype not in FLOATING:
                    continue
                run_reduce_cases(chk, rank, world, both, dtype, op_name, sizes, sizes, REDUCE_FORMS, "small")
            run_gather_cases(chk, rank, world, both, dtype, sizes, GATHER_FORMS, "small")

        # Sizes on the slice boundaries of the 4 KiB buffer: every dtype x op.
        for dtype in DTYPES:
            ar_sizes, counts = slice_edge_sizes(world, dtype, SMALL_BUFFER)
            for op_name in OPS:
                if op_name == "AVG" and dtype not in FLOATING:
                    continue
                run_reduce_cases(chk, rank, world, [("buf4K", small)], dtype, op_name, ar_sizes, counts,
                                 ("out_of_place", "in_place"), "edge")
            run_gather_cases(chk, rank, world, [("buf4K", small)], dtype, counts, ("out_of_place", "in_place"), "edge")

        # A prime near 10^5 through the 4 KiB buffer (hundreds of slices): every dtype with
        # SUM, every op with float32 / int32, AVG (the op with a final division) with every
        # floating dtype.
        small_only = [("buf4K", small)]
        for dtype in DTYPES:
            for op_name in OPS:
                if (op_name == "SUM" or (op_name == "AVG" and dtype in FLOATING)
                        or (dtype in (torch.float32, torch.int32) and op_name != "AVG")):
                    run_reduce_cases(chk, rank, world, small_only, dtype, op_name, [PRIME], [PRIME_CHUNK],
                                     ("out_of_place", "in_place", "list"), "prime")
            run_gather_cases(chk, rank, world, small_only, dtype, [PRIME_CHUNK], ("out_of_place", "in_place", "list"),
                             "prime")

        # Larger than the default 4 MiB buffer: all_reduce messages over 4 MiB, and
        # reduce-scatter / all-gather with per-rank chunks over 4 MiB / P.
        big_only = [("buf4M", big)]

        def over(dtype, total_bytes):
            return total_bytes // torch.empty(0, dtype=dtype).element_size() + 7

        for dtype, op_name in [(torch.float32, "SUM"), (torch.int8, "PRODUCT"), (torch.float16, "MIN"),
                               (torch.int64, "SUM")]:  # every element size
            run_reduce_cases(chk, rank, world, big_only, dtype, op_name, [over(dtype, DEFAULT_BUFFER)], [], (), "big")
        for dtype, op_name, forms in [(torch.bfloat16, "SUM", ("out_of_place",)), (torch.int32, "MAX", ("in_place",))]:
            run_reduce_cases(chk, rank, world, big_only, dtype, op_name, [], [over(dtype, DEFAULT_BUFFER // world)],
                             forms, "big")
        for dtype, forms in [(torch.float64, ("out_of_place",)), (torch.uint8, ("in_place",))]:
            run_gather_cases(chk, rank, world, big_only, dtype, [over(dtype, DEFAULT_BUFFER // world)], forms, "big")

        run_random_float_cases(chk, rank, world, "buf4K", small)
        run_async_cases(chk, rank, world, small, big)
        small.barrier()
        big.barrier()
    run_one_shot_cases(chk, rank, world)
    run_direct_read_cases(chk, rank, world)
    run_module_level_cases(chk, rank, world)
    import test_symmetric  # symmetric memory's matrix, in these processes (it imports this module)
    test_symmetric.run_symmetric_cases(chk, rank, world)
    return chk.finish()


def _report(results) -> None:
    failures = [f for per_rank in results for f in per_rank]
    if failures:
        pytest.fail(f"{len(failures)} failures, first ones:\n" + "\n".join(failures[:60]), pytrace=False)


# P = 5 is left to the fuzzer (test_fuzz.py draws every collective and dtype at P = 1..5 and
# asserts that P = 5 is reached): here it repeated P = 3's odd-world cases for ~25 s of CI.
@pytest.mark.parametrize("world", [1, 2, 3, 4], ids=lambda w: f"P{w}")
def test_collectives_match_gloo(world):
    _report(spawn(_matrix_rank, world, timeout=SPAWN_TIMEOUT, env=STREAMED_SLOTS_ENV if world % 2 else CLEAN_ENV))


# --- outputs written with streaming stores ------------------------------------------------

def _streamed_rank(rank, world):
    """With RINGCOLL_STREAMING_BYTES=1 every ring output takes the streaming-store paths of
    host_strip.h (staged in the slot, or in a scratch block where there is no slot), except
    where the output is the input or a chunk of it (all-reduce and reduce-scatter in place):
    those take ordinary stores (streams_output); the direct-read all-gather's own chunk too,
    and every output of the plan engine (native's ring, rhd, the direct plan's all-gather).
    Every form, against gloo, through a 4 KiB buffer so the message is sliced, at sizes that
    leave part of a 4 KiB block."""
    from ringcoll import _C

    chk = Checker(rank)
    chk.checked += 1
    if _C.streaming_threshold_bytes() != 1:
        chk.fail("RINGCOLL_STREAMING_BYTES", f"threshold {_C.streaming_threshold_bytes()}, not the 1 set")
    comms = []
    for slots in ("cache", "stream"):  # the slots too, in the second (RINGCOLL_SLOT_STORES, read at creation)
        os.environ["RINGCOLL_SLOT_STORES"] = slots
        comms.append((f"streamed, slots {slots}", ringcoll.Communicator(buffer_bytes=SMALL_BUFFER, small_bytes=0,
                                                                        direct_bytes=0, algorithm="native",
                                                                        timeout=COMM_TIMEOUT)))
        chk.checked += 1
        if comms[-1][1].transport.slot_stores["streaming"] != (slots == "stream"):
            chk.fail("RINGCOLL_SLOT_STORES", f"{slots}: {comms[-1][1].transport.slot_stores}")
    # The direct-read all-gather streams its own chunk past the threshold too.
    direct = ringcoll.Communicator(buffer_bytes=SMALL_BUFFER, small_bytes=0, direct_bytes=1, algorithm="native",
                                   timeout=COMM_TIMEOUT)
    comms.append(("streamed, direct reads", direct))
    for name in ("ring", "rhd"):  # the plan engine's outputs, through the slots and the work space
        comms.append((f"streamed, plan {name}", ringcoll.Communicator(buffer_bytes=SMALL_BUFFER, algorithm=name,
                                                                     timeout=COMM_TIMEOUT)))
    direct_plan = ("streamed, plan direct", ringcoll.Communicator(algorithm="direct", timeout=COMM_TIMEOUT))
    for dtype, op_name in [(torch.float32, "SUM"), (torch.bfloat16, "SUM"), (torch.int8, "MAX"),
                           (torch.float64, "AVG")]:
        elem = torch.empty(0, dtype=dtype).element_size()
        counts = [world + 1, 3 * 4096 // elem + 5]
        run_reduce_cases(chk, rank, world, comms, dtype, op_name, counts, counts, ("out_of_place", "in_place"),
                         "streamed")
        for name, comm in comms:
            for n in counts:  # all_reduce out of place (run_reduce_cases runs it in place)
                x = make_input(_kind(op_name), dtype, n, _seed("streamed", dtype, op_name, n, rank))
                ref = gloo_all_reduce([x], op_name, world)[0]
                out, base = _guarded(n, dtype)
                comm.all_reduce(x, op=_ops(op_name)[0], output=out)
                label = f"{name} all_reduce(output=) {_name(dtype)} {op_name} n={n}"
                chk.equal(label, out, ref)
                _guards_intact(chk, label, base, n)
        direct_before = direct.transport.direct_calls
        run_gather_cases(chk, rank, world, comms + [direct_plan], dtype, counts, ("out_of_place", "in_place"),
                         "streamed")
        chk.checked += 1
        if direct.transport.direct_calls == direct_before:
            chk.fail(f"streamed direct reads {_name(dtype)}", "no all-gather read its peers directly")
    for _, comm in comms + [direct_plan]:
        comm.close()
    return chk.finish()


def test_streamed_outputs_match_gloo():
    _report(spawn(_streamed_rank, 3, timeout=SPAWN_TIMEOUT, env={**CLEAN_ENV, "RINGCOLL_STREAMING_BYTES": "1"}))


# --- the slots' stores chosen by the neighbour-hop probe ---------------------------------------

def _slot_stores_rank(rank, world):
    """RINGCOLL_SLOT_STORES=auto (the default): a token passed round the ring measures the hop
    between neighbours on the first ring or plan call of at least hop_probe_min_bytes and on
    every hop_probe_every-th after; smaller calls and other paths neither probe nor count
    (host_comm.cpp, "The slots' stores"). With RINGCOLL_SLOW_HOP_NS set, its threshold alone
    decides (the store probe: _store_probe_cases): 0 makes every hop slow, so
    a probe that measured one (hop < hop_off_core_ns) must switch to streaming stores; a huge
    one, none. Results exact throughout; a bad setting is a clear error."""
    from ringcoll import _C

    chk = Checker(rank)
    big = _C.hop_probe_min_bytes // 4
    for slow_ns, name in [("0", "every hop slow"), (str(10 ** 12), "no hop slow")]:
        os.environ["RINGCOLL_SLOW_HOP_NS"] = slow_ns
        with ringcoll.Communicator(timeout=COMM_TIMEOUT, direct_bytes=0) as comm:
            streams = [False]  # what the probes so far should have chosen

            def stores(expected_probes, label):
                s = comm.transport.slot_stores
                chk.checked += 1
                if s["probing"] != ((os.cpu_count() or 1) >= world):  # a core each: probed (host_wait_policy)
                    chk.fail(f"{name}: {label}", f"probing {s['probing']} with {os.cpu_count()} cores")
                expected_probes *= s["probing"]
                if expected_probes and s["hop_ns"] < _C.hop_off_core_ns:  # else a peer off its core: choice kept
                    streams[0] = slow_ns == "0"
                if s["probes"] != expected_probes or s["streaming"] != streams[0] or (expected_probes and not s["hop_ns"]):
                    chk.fail(f"{name}: {label}", f"{s}, expected {expected_probes} probes, streaming {streams[0]}")

            stores(0, "before any call")
            small = make_input("int", torch.int32, 1000, _seed("hop-small", rank))
            comm.all_reduce(small.clone())
            stores(0, "after a small call")
            for i in range(_C.hop_probe_every):  # the first probes; the other 63 only count
                x = make_input("int", torch.int32, big, _seed("hop", i, rank))
                ref = gloo_all_reduce([x], "SUM", world)[0]
                comm.all_reduce(x, algorithm="rhd" if i == 1 else "auto")  # a plan call counts too
                chk.equal(f"{name}: large all_reduce {i}", x, ref)
                comm.all_reduce(small.clone())
            stores(1, f"after {_C.hop_probe_every} large calls")
            comm.all_reduce(torch.ones(big, dtype=torch.int32))
            stores(2, f"after {_C.hop_probe_every + 1} large calls")
    del os.environ["RINGCOLL_SLOW_HOP_NS"]
    _store_probe_cases(chk, rank, world, big)
    os.environ["RINGCOLL_SLOT_STORES"] = "fast"
    try:
        ringcoll.Communicator(timeout=COMM_TIMEOUT).close()
        chk.fail("RINGCOLL_SLOT_STORES=fast", "no error")
    except ValueError as e:
        chk.checked += 1
        if "RINGCOLL_SLOT_STORES must be auto, cache or stream, not 'fast'" not in str(e):
            chk.fail("RINGCOLL_SLOT_STORES=fast", f"unclear error: {e}")
    return chk.finish()


def _store_probe_cases(chk, rank, world, big):
    """Without RINGCOLL_SLOW_HOP_NS the first two hop probes, every store_probe_every-th, and
    one whose hop on rank 0 is unlike the last store probe's are followed by a store probe: a
    block written with each kind of store and read by the neighbour, timed; its verdict
    decides for hops within same_hop_factor of its own, the threshold elsewhere. Its block lies past the slots, so the first probe, in a
    one-shot call whose early sends are already in the slots, leaves them whole (when the block
    lay in the slots, that call's result was wrong). Results exact throughout."""
    from ringcoll import _C

    def expect(comm, probes, label, fresh=False):
        """`probes` store probes so far; `fresh`: one ran in the last call, so its verdict is
        the hop's own (unless a peer was off its core: then none is taken)."""
        s = comm.transport.slot_stores
        chk.checked += 1
        probes *= s["probing"]
        hop, at = s["hop_ns"], s["store_probe_hop_ns"]
        near = at and at / _C.same_hop_factor <= hop <= at * _C.same_hop_factor
        streaming = s["store_probe_streams"] if near else hop >= _C.default_slow_hop_ns
        measured = probes and hop < _C.hop_off_core_ns
        if s["store_probes"] != probes or (measured and (s["streaming"] != streaming or (fresh and at != hop))):
            chk.fail(f"store probe: {label}", f"{s}, expected {probes} store probes")

    def large_all_reduce(comm, i, algorithm, check=True):
        x = make_input("int", torch.int32, big, _seed("store-probe", i, rank))
        ref = gloo_all_reduce([x], "SUM", world)[0] if check else None
        comm.all_reduce(x, algorithm=algorithm)
        if check:
            chk.equal(f"store probe: large {algorithm} all_reduce {i}", x, ref)

    with ringcoll.Communicator(timeout=COMM_TIMEOUT, direct_bytes=0) as comm:
        large_all_reduce(comm, 0, "oneshot")  # one slice, sent early: the probes with the sends in the slots
        expect(comm, 1, "after a one-shot call (its early sends in the slots)", fresh=True)
        large_all_reduce(comm, 1, "ring")
        expect(comm, 1, "after the next large call")
        for i in range(2, 2 * _C.hop_probe_every + 1):  # hop probes 2 (a store probe) and 3 (one if the cores moved)
            before = comm.transport.slot_stores["store_probe_hop_ns"]
            large_all_reduce(comm, i, "ring", check=i in (_C.hop_probe_every, 2 * _C.hop_probe_every))
            if i == _C.hop_probe_every:
                expect(comm, 2, f"after {i + 1} large calls", fresh=True)
        # Rank 0 decides for every rank whether hop probe 3 is followed by one: where its hop is
        # unlike the one the last store probe was made at (a peer off its core tells nothing)
        hop = comm.transport.slot_stores["hop_ns"]
        moved = hop < _C.hop_off_core_ns and not (before and before / _C.same_hop_factor <= hop
                                                   <= before * _C.same_hop_factor)
        probes = comm.transport.slot_stores["store_probes"]
        every = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(every, torch.tensor([probes]))
        chk.checked += 1
        if len({int(n) for n in every}) != 1 or (rank == 0 and probes != (2 + moved) * (os.cpu_count() >= world)):
            chk.fail("store probe: hop probe 3", f"store probes per rank {[int(n) for n in every]}; rank 0's hop "
                                                 f"{hop} ns against {before} ns at the last store probe")
        expect(comm, probes, f"after {2 * _C.hop_probe_every + 1} large calls", fresh=probes == 3)


def test_slot_stores_follow_the_neighbour_hop_probe():
    _report(spawn(_slot_stores_rank, 2, timeout=SPAWN_TIMEOUT, env=CLEAN_ENV))


# --- all_reduce_coalesced: one flat ring call for several tensors ------------------------

def _check_multi_tensor_call(failures, label, call, make_outputs, sizes, expected):
    """call(outputs, async_op) sync then async (waiting on its Work); every output tensor
    must equal its expected one bit for bit. A failure names the case and the size."""
    for async_op in (False, True):
        outs = make_outputs()
        work = call(outs, async_op)
        if work is not None:
            work.wait()
        for n, got, want in zip(sizes, outs, expected):
            if not torch.equal(_bits(got), _bits(want.to(got.dtype))):
                failures.append(f"{label} n={n} async={async_op}: {got[:4].tolist()} != {want[:4].tolist()}")


def _coalesced_rank(rank, world):
    """Every dtype x op: all_reduce_coalesced of tensors of awkward sizes (through a 4 KiB
    buffer, so the flat message is sliced) equals gloo's all_reduce of each; sync and async;
    mixed dtypes and an empty list refused before anything is written."""
    failures = []
    with ringcoll.Communicator(buffer_bytes=4096) as comm:
        for dtype in DTYPES:
            for op_name in OPS:
                if op_name == "AVG" and dtype not in BITS:
                    continue
                sizes = (1, 0, world + 1, 3001)
                xs = [make_input(_kind(op_name), dtype, n, _seed("coalesced", dtype, op_name, rank, n)) for n in sizes]
                _check_multi_tensor_call(
                    failures, f"rank {rank}: all_reduce_coalesced {dtype} {op_name}",
                    lambda ours, a, op_name=op_name: comm.all_reduce_coalesced(ours, op=_ops(op_name)[a], async_op=a),
                    lambda xs=xs: [x.clone() for x in xs], sizes, gloo_all_reduce(xs, op_name, world))
        a, b = torch.ones(3), torch.ones(3, dtype=torch.float64)
        for label, tensors, exc in (("mixed dtypes", [a, b], TypeError), ("empty list", [], TypeError)):
            try:
                comm.all_reduce_coalesced(tensors)
                failures.append(f"rank {rank}: all_reduce_coalesced {label}: did not raise")
            except exc as e:
                if not str(e).startswith("all_reduce_coalesced:"):
                    failures.append(f"rank {rank}: all_reduce_coalesced {label}: message {e}")
        if not torch.equal(a, torch.ones(3)):
            failures.append(f"rank {rank}: all_reduce_coalesced wrote to a before refusing")
    return failures


@pytest.mark.parametrize("world", [1, 3])
def test_all_reduce_coalesced_matches_gloo(world):
    _report(spawn(_coalesced_rank, world, timeout=SPAWN_TIMEOUT, env=CLEAN_ENV))


def _coalesced_tensor_forms_rank(rank, world):
    """reduce_scatter_tensor_coalesced (every dtype x op) and all_gather_into_tensor_coalesced
    (every dtype) of pairs of awkward sizes, as one flat call each through a 4 KiB buffer,
    equal gloo's per-pair answers; sync and async; a bad pair refused, naming it, before
    anything is written."""
    failures = []
    counts = (1, 0, world + 1, 701)
    with ringcoll.Communicator(buffer_bytes=4096) as comm:
        for dtype in DTYPES:
            for op_name in OPS:
                if op_name == "AVG" and dtype not in BITS:
                    continue
                xs = [make_input(_kind(op_name), dtype, c * world, _seed("rs-coalesced", dtype, op_name, rank, c))
                      for c in counts]
                _check_multi_tensor_call(
                    failures, f"rank {rank}: reduce_scatter_tensor_coalesced {dtype} {op_name}",
                    lambda outs, a, xs=xs, op_name=op_name: comm.reduce_scatter_tensor_coalesced(
                        outs, xs, op=_ops(op_name)[a], async_op=a),
                    lambda dtype=dtype: [torch.full((c,), 7, dtype=dtype) for c in counts], counts,
                    gloo_reduce_scatter(xs, counts, op_name, world))
            xs = [make_input("bits", dtype, c, _seed("ag-coalesced", dtype, rank, c)) for c in counts]
            _check_multi_tensor_call(
                failures, f"rank {rank}: all_gather_into_tensor_coalesced {dtype}",
                lambda outs, a, xs=xs: comm.all_gather_into_tensor_coalesced(outs, xs, async_op=a),
                lambda dtype=dtype: [torch.full((c * world,), 7, dtype=dtype) for c in counts], counts,
                gloo_all_gather(xs, world))
        out, good = torch.zeros(2), torch.ones(2 * world)
        bad_cases = (
            ("reduce_scatter_tensor_coalesced", ValueError, "pair 1: output has 2 elements",
             lambda: comm.reduce_scatter_tensor_coalesced([out, out.clone()], [good, torch.ones(2 * world + 1)])),
            ("reduce_scatter_tensor_coalesced", ValueError, "2 outputs for 1 inputs",
             lambda: comm.reduce_scatter_tensor_coalesced([out, out.clone()], [good])),
            ("all_gather_into_tensor_coalesced", TypeError, "inputs[1] has dtype torch.float64",
             lambda: comm.all_gather_into_tensor_coalesced([good, good.clone()], [out, out.double()])),
        )
        for op_name, exc, words, call in bad_cases:
            try:
                call()
                failures.append(f"rank {rank}: {op_name} ({words}): did not raise")
            except exc as e:
                if not (str(e).startswith(f"{op_name}:") and words in str(e)):
                    failures.append(f"rank {rank}: {op_name}: message {e}")
        if not (torch.equal(out, torch.zeros(2)) and torch.equal(good, torch.ones(2 * world))):
            failures.append(f"rank {rank}: a refused coalesced call wrote to its tensors")
    return failures


@pytest.mark.parametrize("world", [1, 3])
def test_coalesced_tensor_forms_match_gloo(world):
    _report(spawn(_coalesced_tensor_forms_rank, world, timeout=SPAWN_TIMEOUT, env=CLEAN_ENV))


# --- validation ----------------------------------------------------------------------------

def _expect_error(chk, label, exc_type, op_name, call, untouched=()):
    """call() raises exc_type with a message starting with '<op_name>:', leaving every tensor
    in `untouched` (its bits) unchanged."""
    before = [t.clone() for t in untouched]
    chk.checked += 1
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the type is what we check
        if type(e) is not exc_type:
            chk.fail(label, f"raised {type(e).__name__} ({e}), expected {exc_type.__name__}")
        elif not str(e).startswith(f"{op_name}:"):
            chk.fail(label, f"message does not start with '{op_name}:': {e}")
    else:
        chk.fail(label, f"did not raise (expected {exc_type.__name__})")
    for i, (t, b) in enumerate(zip(untouched, before)):
        if not torch.equal(_bits(t), _bits(b)):
            chk.fail(label, f"tensor {i} was modified although the call was refused")


def _validation_cases(rank, world, api):
    """(label, exception type, op name, call, untouched tensors). `api` is a Communicator or
    the ringcoll module (module-level drop-ins). Every call's arguments are bound here."""
    n = 6
    f32, f64, i32 = torch.float32, torch.float64, torch.int32
    AVG, BAND, BOR, BXOR = ringcoll.ReduceOp.AVG, dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR
    other = (rank + 1) % world
    cases = []

    def s(m, dtype=f32):
        return _sentinel(m, dtype)

    def meta(m):
        return torch.empty(m, device="meta")

    def noncontig(m):
        return torch.zeros(m, 2)[:, 1]

    def outs(k=world, dtype=f32, m=n):
        return [s(m, dtype) for _ in range(k)]

    def add(label, exc, name, args, untouched=(), **kwargs):
        cases.append((label, exc, name, functools.partial(getattr(api, name), *args, **kwargs), tuple(untouched)))

    # all_reduce(tensor)
    op = "all_reduce"
    u = noncontig(n)
    add(f"{op} non-contiguous", ValueError, op, [u], [u])
    for dtype in (torch.bool, torch.complex64):
        u = torch.ones(n, dtype=dtype)
        add(f"{op} {_name(dtype)}", TypeError, op, [u], [u])
    for dtype in (torch.int8, torch.uint8, i32, torch.int64):
        u = s(n, dtype)
        add(f"{op} AVG {_name(dtype)}", ValueError, op, [u], [u], op=AVG)
    u = s(n, i32)
    add(f"{op} dist.ReduceOp.AVG int32", ValueError, op, [u], [u], op=dist.ReduceOp.AVG)
    add(f"{op} meta tensor", ValueError, op, [meta(n)])
    for bad in (BAND, BOR, BXOR):
        u = s(n)
        add(f"{op} op {bad}", ValueError, op, [u], [u], op=bad)
    add(f"{op} not a tensor", TypeError, op, [[1.0, 2.0]])

    # reduce_scatter_tensor(output, input)
    op = "reduce_scatter_tensor"
    o, i = noncontig(n), s(world * n)
    add(f"{op} non-contiguous output", ValueError, op, [o, i], [o, i])
    o, i = s(n), noncontig(world * n)
    add(f"{op} non-contiguous input", ValueError, op, [o, i], [o, i])
    for dtype in (torch.bool, torch.complex64):
        o, i = torch.zeros(n, dtype=dtype), torch.ones(world * n, dtype=dtype)
        add(f"{op} {_name(dtype)}", TypeError, op, [o, i], [o, i])
    o, i = s(n, i32), s(world * n, i32)
    add(f"{op} AVG int32", ValueError, op, [o, i], [o, i], op=AVG)
    for m in (n + 1, n - 1, world * n + 1):
        o, i = s(m), s(world * n)
        add(f"{op} output of {m} for input of {world * n}", ValueError, op, [o, i], [o, i])
    o, i = s(n, f64), s(world * n)
    add(f"{op} float64 output, float32 input", TypeError, op, [o, i], [o, i])
    o = s(n)
    add(f"{op} meta input", ValueError, op, [o, meta(world * n)], [o])
    i = s(world * n)
    add(f"{op} meta output", ValueError, op, [meta(n), i], [i])
    buf = s(world * n + 1)
    add(f"{op} output overlaps input off its chunk", ValueError, op,
        [buf[rank * n + 1:rank * n + 1 + n], buf[:world * n]], [buf])
    if world > 1:
        buf = s(world * n)
        add(f"{op} output is another rank's chunk of input", ValueError, op,
            [buf[other * n:(other + 1) * n], buf], [buf])
    o, i = s(n), s(world * n)
    add(f"{op} op BAND", ValueError, op, [o, i], [o, i], op=BAND)

    # all_gather_into_tensor(output, input)
    op = "all_gather_into_tensor"
    o, i = noncontig(world * n), s(n)
    add(f"{op} non-contiguous output", ValueError, op, [o, i], [o, i])
    o, i = s(world * n), noncontig(n)
    add(f"{op} non-contiguous input", ValueError, op, [o, i], [o, i])
    for dtype in (torch.bool, torch.complex64):
        o, i = torch.zeros(world * n, dtype=dtype), torch.ones(n, dtype=dtype)
        add(f"{op} {_name(dtype)}", TypeError, op, [o, i], [o, i])
    for m in (world * n + 1, world * n - 1, n + 1):
        o, i = s(m), s(n)
        add(f"{op} output of {m} for input of {n}", ValueError, op, [o, i], [o, i])
    o, i = s(world * n, i32), s(n)
    add(f"{op} int32 output, float32 input", TypeError, op, [o, i], [o, i])
    o = s(world * n)
    add(f"{op} meta input", ValueError, op, [o, meta(n)], [o])
    i = s(n)
    add(f"{op} meta output", ValueError, op, [meta(world * n), i], [i])
    buf = s(world * n + 1)
    add(f"{op} input overlaps output off its chunk", ValueError, op,
        [buf[:world * n], buf[rank * n + 1:rank * n + 1 + n]], [buf])
    if world > 1:
        buf = s(world * n)
        add(f"{op} input is another rank's chunk of output", ValueError, op,
            [buf, buf[other * n:(other + 1) * n]], [buf])

    # all_gather(tensor_list, tensor)
    op = "all_gather"
    for k in (world - 1, world + 1):
        lst = outs(k)
        add(f"{op} list of {k}", ValueError, op, [lst, s(n)], lst)
    lst = outs()
    add(f"{op} tensor_list not a list", TypeError, op, [torch.stack(lst), s(n)], lst)
    lst = outs()
    lst[-1] = s(n + 1)
    add(f"{op} entry of wrong size", ValueError, op, [lst, s(n)], lst)
    lst = outs()
    lst[0] = s(n, f64)
    add(f"{op} entry of another dtype", TypeError, op, [lst, s(n)], lst)
    lst = outs()
    lst[-1] = noncontig(n)
    add(f"{op} non-contiguous entry", ValueError, op, [lst, s(n)], lst)
    lst = outs()
    add(f"{op} non-contiguous tensor", ValueError, op, [lst, noncontig(n)], lst)
    lst = outs(dtype=torch.bool)
    add(f"{op} bool", TypeError, op, [lst, torch.ones(n, dtype=torch.bool)], lst)
    lst = outs()
    lst[0] = meta(n)
    add(f"{op} meta entry", ValueError, op, [lst, s(n)], lst[1:])
    lst = outs()
    add(f"{op} meta tensor", ValueError, op, [lst, meta(n)], lst)

    # reduce_scatter(output, input_list)
    op = "reduce_scatter"
    for k in (world - 1, world + 1):
        o = s(n)
        add(f"{op} list of {k}", ValueError, op, [o, outs(k)], [o])
    o, lst = s(n), outs()
    add(f"{op} input_list not a list", TypeError, op, [o, torch.stack(lst)], [o])
    o, lst = s(n), outs()
    lst[0] = s(n, f64)
    add(f"{op} entry of another dtype", TypeError, op, [o, lst], [o])
    o, lst = s(n), outs()
    lst[-1] = s(n - 1)
    add(f"{op} entry of wrong size", ValueError, op, [o, lst], [o])
    o, lst = s(n), outs()
    lst[-1] = noncontig(n)
    add(f"{op} non-contiguous entry", ValueError, op, [o, lst], [o])
    o = noncontig(n)
    add(f"{op} non-contiguous output", ValueError, op, [o, outs()], [o])
    o = s(n, i32)
    add(f"{op} AVG int32", ValueError, op, [o, outs(dtype=i32)], [o], op=AVG)
    o = s(n)
    add(f"{op} op BXOR", ValueError, op, [o, outs()], [o], op=BXOR)
    o = torch.zeros(n, dtype=torch.complex64)
    add(f"{op} complex64", TypeError, op, [o, [torch.ones(n, dtype=torch.complex64) for _ in range(world)]], [o])
    o, lst = s(n), outs()
    lst[-1] = meta(n)
    add(f"{op} meta entry", ValueError, op, [o, lst], [o])
    o = s(n)
    add(f"{op} float64 output, float32 list", TypeError, op, [s(n, f64), outs()], [o])
    return cases


def _validation_rank(rank, world):
    chk = Checker(rank)
    with ringcoll.Communicator(buffer_bytes=SMALL_BUFFER, timeout=COMM_TIMEOUT) as comm:
        for label, exc, op_name, call, untouched in _validation_cases(rank, world, comm):
            _expect_error(chk, label, exc, op_name, call, untouched)
        # async_op=True validates before queueing: the error comes from the call itself.
        u = torch.ones(3, dtype=torch.bool)
        _expect_error(chk, "all_reduce async bool", TypeError, "all_reduce",
                      functools.partial(comm.all_reduce, u, async_op=True), [u])
        o, i = _sentinel(2, torch.float32), _sentinel(3 * world, torch.float32)
        _expect_error(chk, "reduce_scatter_tensor async wrong size", ValueError, "reduce_scatter_tensor",
                      functools.partial(comm.reduce_scatter_tensor, o, i, async_op=True), [o, i])
        if comm.broken:
            chk.fail("validation", "a refused call marked the communicator broken")

        # The ranks are still in step and the communicator works: both spellings of each op.
        for op_name in OPS:
            x = make_input(_kind(op_name), torch.float32, 2 * world + 3, _seed("valid", op_name, rank))
            ref = gloo_all_reduce([x], op_name, world)[0]
            for spelling in _ops(op_name) + (dist.ReduceOp(getattr(dist.ReduceOp, op_name)),):
                t = x.clone()
                comm.all_reduce(t, op=spelling)
                chk.equal(f"all_reduce op={spelling!r}", t, ref)
        x = make_input("sum", torch.int32, world * 5, _seed("valid default op", rank))
        out = _sentinel(5, torch.int32)
        comm.reduce_scatter_tensor(out, x)
        chk.equal("reduce_scatter_tensor default op is SUM", out, gloo_reduce_scatter([x], [5], "SUM", world)[0])
    return chk.finish()


def _module_validation_rank(rank, world):
    chk = Checker(rank)
    ringcoll.all_reduce(torch.zeros(1))  # builds the default communicator
    for label, exc, op_name, call, untouched in _validation_cases(rank, world, ringcoll):
        _expect_error(chk, "ringcoll." + label, exc, op_name, call, untouched)
    x = make_input("sum", torch.float64, 9, _seed("module valid", rank))
    t = x.clone()
    ringcoll.all_reduce(t, op=dist.ReduceOp.SUM)
    chk.equal("ringcoll.all_reduce after refused calls", t, gloo_all_reduce([x], "SUM", world)[0])
    ringcoll.destroy_communicators()
    return chk.finish()


def test_validation_errors_communicator():
    _report(spawn(_validation_rank, 2, timeout=SPAWN_TIMEOUT, env=CLEAN_ENV))


def test_validation_errors_module_level():
    _report(spawn(_module_validation_rank, 2, timeout=SPAWN_TIMEOUT, env=CLEAN_ENV))


# --- lifetime and settings -----------------------------------------------------------------

def _settings_rank(rank, world):
    chk = Checker(rank)
    chk.checked += 1
    # Environment (set by spawn): RINGCOLL_TIMEOUT=7.5, RINGCOLL_BUFFER_BYTES=64K.
    with ringcoll.Communicator() as comm:
        if not isinstance(comm, ringcoll.Communicator):
            chk.fail("context manager", f"__enter__ returned {type(comm).__name__}")
        if comm.timeout != 7.5 or comm.buffer_bytes != 64 << 10:
            chk.fail("env", f"RINGCOLL_TIMEOUT / RINGCOLL_BUFFER_BYTES not honoured: "
                            f"timeout={comm.timeout}, buffer_bytes={comm.buffer_bytes}")
        x = make_input("sum", torch.float32, 40009, _seed("env", rank))  # 160 KB through 64 KiB
        t = x.clone()
        comm.all_reduce(t)
        chk.equal("all_reduce through a RINGCOLL_BUFFER_BYTES buffer", t, gloo_all_reduce([x], "SUM", world)[0])
    if ringcoll.get_communicator().timeout != 7.5 or ringcoll.get_communicator().buffer_bytes != 64 << 10:
        chk.fail("env", "module-level communicator ignores RINGCOLL_TIMEOUT / RINGCOLL_BUFFER_BYTES")
    ringcoll.destroy_communicators()

    # Arguments win over the environment.
    for kwargs, expected in [({"timeout": 3, "buffer_bytes": 8192}, (3.0, 8192)),
                             ({"timeout": datetime.timedelta(seconds=2.5)}, (2.5, 64 << 10))]:
        with ringcoll.Communicator(**kwargs) as comm:
            if (comm.timeout, comm.buffer_bytes) != expected:
                chk.fail(f"Communicator({kwargs})", f"timeout={comm.timeout}, buffer_bytes={comm.buffer_bytes}")
            x = make_input("prod", torch.float16, 5003, _seed("args", rank))
            t = x.clone()
            comm.all_reduce(t, op=ringcoll.ReduceOp.PRODUCT)
            chk.equal(f"all_reduce on Communicator({kwargs})", t, gloo_all_reduce([x], "PRODUCT", world)[0])
    for kwargs in ({"timeout": 0}, {"timeout": -1.0}, {"buffer_bytes": 64}):
        try:
            ringcoll.Communicator(**kwargs).close()
            chk.fail(f"Communicator({kwargs})", "accepted")
        except ValueError as e:
            if not str(e).startswith("Communicator:"):
                chk.fail(f"Communicator({kwargs})", f"message: {e}")

    # close(), then every method raises RingcollError naming the op; close() is idempotent.
    comm = ringcoll.Communicator(buffer_bytes=SMALL_BUFFER)
    comm.all_reduce(torch.ones(3))
    comm.close()
    comm.close()
    with ringcoll.Communicator() as comm2:
        pass
    closed_calls = {
        "all_reduce": lambda c, a: c.all_reduce(torch.ones(3), async_op=a),
        "reduce_scatter_tensor": lambda c, a: c.reduce_scatter_tensor(torch.ones(1), torch.ones(world), async_op=a),
        "all_gather_into_tensor": lambda c, a: c.all_gather_into_tensor(torch.ones(world), torch.ones(1), async_op=a),
        "all_gather": lambda c, a: c.all_gather([torch.ones(1) for _ in range(world)], torch.ones(1), async_op=a),
        "reduce_scatter": lambda c, a: c.reduce_scatter(torch.ones(1), [torch.ones(1) for _ in range(world)],
                                                        async_op=a),
        "barrier": lambda c, a: c.barrier(async_op=a),
    }
    for which, closed in (("close()", comm), ("with", comm2)):
        for op_name, call in closed_calls.items():
            for async_op in (False, True):
                label = f"{op_name} after {which}{' (async_op=True)' if async_op else ''}"
                chk.checked += 1
                try:
                    call(closed, async_op)
                    chk.fail(label, "did not raise")
                except ringcoll.RingcollError as e:
                    if not str(e).startswith(f"{op_name}:"):
                        chk.fail(label, f"message does not start with '{op_name}:': {e}")
                except Exception as e:  # noqa: BLE001
                    chk.fail(label, f"raised {type(e).__name__}, expected RingcollError: {e}")
    if not issubclass(ringcoll.RingcollError, RuntimeError):
        chk.fail("RingcollError", "is not a RuntimeError")
    return chk.finish()


def test_settings_lifetime_and_environment():
    env = {"RINGCOLL_TIMEOUT": "7.5", "RINGCOLL_BUFFER_BYTES": "64K"}
    _report(spawn(_settings_rank, 2, timeout=SPAWN_TIMEOUT, env=env))


def _all_reduce_output_aliasing(rank, world):
    import ringcoll

    with ringcoll.Communicator() as comm:
        t = torch.full((5,), float(rank + 1))
        comm.all_reduce(t, output=t)  # the same tensor: in place, on every rank
        out = torch.empty(5)
        src = torch.full((5,), 2.0)
        comm.all_reduce(src, output=out)  # out-of-place leaves the input alone
        errors = []
        try:
            comm.all_reduce(t[:4], output=t[1:])
        except ValueError as e:
            errors.append(str(e))
        return t.tolist(), out.tolist(), src.tolist(), errors


def test_all_reduce_output_may_alias_only_exactly():
    world = 3
    for t, out, src, errors in spawn(_all_reduce_output_aliasing, world):
        assert t == [6.0] * 5 and out == [6.0] * 5 and src == [2.0] * 5
        assert len(errors) == 1 and errors[0].startswith("all_reduce: output and input overlap")
