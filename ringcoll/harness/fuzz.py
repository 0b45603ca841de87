"""Hypothesis fuzzer: ringcoll against gloo and a plain reference, on a pool of 5 ranks.

    python -m ringcoll.harness.fuzz --examples 10000 [--seed S] [--case-timeout 60]

Each example is one collective call (in one of the forms below), drawn by hypothesis
(:func:`cases`): world size 1-5, the collective (all_reduce, reduce_scatter_tensor,
all_gather_into_tensor, the list forms all_gather / reduce_scatter, and broadcast / reduce
from a drawn root: the root's result checked, every other rank's tensor checked
unchanged), dtype, op, element count (0 up to a few times the registered buffer, with the
slice boundaries drawn on purpose), in place or not, async or not, the group (the
"default" group of the first w ranks, or a subgroup of any w of the 5), the API (a
``Communicator`` with a drawn small ``buffer_bytes``, the module-level drop-ins, a
``HierarchicalCommunicator``: see below, or torch.distributed's own functions on a group of
the ringcoll backend, ``dist.new_group(backend="ringcoll")``: c10d's dispatch, Work and
coalescing manager in the path), the algorithm (auto, native, or a built-in plan the
collective has: every plan must give the exact reference, whatever its order of combining;
the backend's calls take the communicator's default, auto), misaligned views, special
values, tensors in symmetric memory (``ringcoll.empty``, read in place) or ordinary ones,
and the data seed.

The "hierarchical" API (ringcoll/training/hierarchical.py) runs over the case's group, its
ranks given node ids by a drawn layout (:func:`even_layouts`: 1 node, one per rank, or any
node count that divides the world, interleaved in any order, a,b,a,c,c,b; nodes of
different sizes are refused by design, which tests/multiprocess/test_fuzz.py checks apart),
its intra-node ring's ``buffer_bytes`` drawn as the Communicator's, and its pieces
(``pipeline_bytes``: whole, or half or a fifth of the buffer, so that larger messages
cross in several pieces; given as the argument or as RINGCOLL_PIPELINE_BYTES). It draws
every collective and form its class has (read off its methods), "auto" only (the one
algorithm it offers per call), never symmetric memory (it has no ``empty``), and is checked
as the others are. Its all-reduce combines in node order, not gloo's: the exact inputs
below make every order give the same bits.

Each example also draws its form (``FORMS``; hypothesis shrinks it towards "plain"), only
where the API has it (:func:`form_applies`), each part checked as a plain call is:

* "plain": the one call;
* "repeated": the same call twice on the same tensors, the second on fresh input (another
  seed) written into them after the first was waited for and checked: a result left over
  from the first call (a stale slot, a bank reused too early) fails the second's check.
  With async_op, ``in_flight`` may start both before waiting for either, then on two sets of
  tensors (rewriting an input while its call runs would be the caller's race);
* "prepared" (Communicator, every ``prepare_*`` it has): prepared once, run twice as above;
* "coalesced" (Communicator, every ``*_coalesced`` it has; the module-level API has none;
  on the backend, the calls c10d's ``_coalescing_manager`` turns into one backend call:
  all_reduce, all_gather_into_tensor, reduce_scatter_tensor): 1-3 tensors of their own drawn
  sizes (0 elements included) in one call, each checked against its own plain reference and
  a separate gloo call (:func:`parts`).

What the draw ranges over where transports differ (worlds, groups, APIs, buffers, slot
alignment, kernel variants, the slots a plan is cut from) is a :class:`Space`: the CPU's here;
ringcoll/harness/fuzz_cuda.py runs the same cases and checks on the emulated CUDA transport.

Design (process starts cost ~2 s each on a 2-core machine, so nothing is spawned per
example):

* :class:`FuzzPool` starts ONE pool of 5 worker processes ("spawn"), each with an
  initialised gloo process group of world 5. The parent sends every case to all 5
  workers over a pipe; ranks outside the case's group answer "skip". Groups are made
  with ``dist.new_group`` the first time a case needs them, on all 5 workers in the same
  (case) order, since new_group is collective over the default group; communicators are
  cached in the workers per (group, buffer_bytes), hierarchical ones also per (node layout,
  pieces), the LIVE_COMMUNICATORS used last kept open. Before a HierarchicalCommunicator
  is built, every worker pads its count of process groups to the largest any worker had
  after the last case, which each reply carries and the next case passes on
  (_Worker._pad_groups says why).
* A worker builds every group rank's input from the case's seed (so it can compute the
  plain reference alone, without gathering), runs gloo on the same call (the list
  reduce_scatter: gloo's tensor form, much faster), for every part of the case (before
  ringcoll, so a ringcoll failure cannot leave gloo out of step), then ringcoll, and
  checks its own result of each part: bit for bit against the plain reference (NaN-aware
  for reductions: NaN where the reference has NaN, every other element's bits equal) and
  against gloo; memory next to the output untouched; out-of-place inputs (and the other
  chunks of an in-place reduce-scatter) unchanged; sync calls return None, async ones a
  Work whose wait() is True. It returns failure text (each line prefixed by its part:
  "call 2 of 2: ", "tensor 1 of 3: ") and a digest of its results; the parent checks that
  every rank's all_reduce / all_gather / broadcast results are bitwise identical.
* The parent waits for each case at most ``case_timeout`` seconds; a case that runs over
  (a hang), a worker that dies, or a case in which any rank raised tears the pool down
  (SIGTERM, then SIGKILL, all reaped; workers also carry PR_SET_PDEATHSIG: the process
  launcher's helpers) and the next case starts a fresh pool, so hypothesis shrinks such
  failures on a clean ring every time.
  (A wrong value alone keeps the pool: every rank finished the call, so the ring is in step,
  and a restart costs ~10 s.) ``close()`` (also at exit) leaves no process behind.

Exact references. Inputs are built so that every summation order gives the same bits:
SUM/AVG floats are k * 2^-s with |k| small enough that every partial sum of up to 5 ranks
is exact even in float16 / bfloat16; PRODUCT floats come from {0, +-1/2, +-1, +-2} (at most 5
factors: nothing overflows or rounds); MIN/MAX floats are arbitrary (ties frequent, no
-0.0, whose MIN against +0.0 depends on the order); integers are random over the whole
range (sums and products wrap, deterministically). With ``specials`` drawn, floats also
get infinities and NaN (inf - inf, 0 * inf and NaN are order-independent up to the NaN's
bits, which the NaN-aware comparison allows), integers their extremes. all_gather inputs
are arbitrary bit patterns (NaN payloads included) and must arrive bit for bit.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import hashlib
import multiprocessing
import os
import platform
import sys
import time
import traceback
import zlib
from multiprocessing.connection import wait as _wait
from typing import Callable, Optional, Sequence

from ringcoll import _types, api, plans
from ringcoll.communicator import Communicator, Work
from ringcoll.harness.launcher import _close, _free_port, _set_pdeathsig, _terminate
from ringcoll.training.hierarchical import HierarchicalCommunicator, _group_names
from ringcoll.transports.base import Transport

POOL_SIZE = 5
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "reduce_scatter",
               "broadcast", "reduce")
REDUCING = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "reduce")
ROOTED = ("broadcast", "reduce")  # in place, from (or to) the case's root
# How a case makes its call (module doc): "prepared" and "coalesced" only where the API's
# class has that form of the collective (read off its methods, so a new one is drawn).
FORMS = ("plain", "repeated", "prepared", "coalesced")
# The APIs that are a communicator object (the module-level drop-ins, "module", are not)
CLASSES = {"comm": Communicator, "hierarchical": HierarchicalCommunicator}
# The APIs called as torch.distributed's functions are: ringcoll's drop-ins ("module") and
# torch.distributed itself on a group of the ringcoll backend ("backend"): roots as group ranks
# (group_src, group_dst), all_reduce in place only, no prepared calls.
TORCH_SHAPED = ("module", "backend")
# The backend's coalesced calls: what c10d's _coalescing_manager hands a backend as one call
# (allreduce_coalesced, allgather_into_tensor_coalesced, reduce_scatter_tensor_coalesced)
BACKEND_COALESCED = ("all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor")


def _prepared_of(cls) -> tuple:
    return tuple(sorted(n[len("prepare_"):] for n in dir(cls) if n.startswith("prepare_")))


def _coalesced_of(cls) -> tuple:
    return tuple(sorted(n[:-len("_coalesced")] for n in dir(cls) if n.endswith("_coalesced")))


PREPARED, COALESCED = _prepared_of(Communicator), _coalesced_of(Communicator)
MAX_COALESCED = 3  # tensors in one coalesced call
# Cases name their dtype (readable in a failure report); every dtype ringcoll supports.
DTYPES = tuple(_types.DTYPES)
FLOATING = tuple(name for name, dtype in _types.DTYPES.items() if dtype in _types.FLOATING_DTYPES)
ITEMSIZE = {name: dtype.itemsize for name, dtype in _types.DTYPES.items()}
OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG")
# Registered buffer per rank for Communicator cases: small, so that slicing runs on most
# calls. 704 is just above the 5-rank minimum (2 banks x 5 ranks x 64 B); 704 and 1000 do
# not divide into 2 x P cache-line slots, so the slots leave an unused tail.
BUFFER_CHOICES = (704, 1000, 1024, 2048, 4096, 8192)
LIVE_COMMUNICATORS = 12  # per worker at most (_Worker._keep_few_communicators)
# A HierarchicalCommunicator's pieces (pipeline_bytes): whole, or the buffer over these, so
# that messages of up to MAX_BUFFERS_PER_MESSAGE buffers cross in 2 to 20 pieces (5: piece
# sizes that are no multiple of the element or the slot)
PIPELINE_DIVISORS = (2, 5)
MODULE_BUFFER = 2048  # RINGCOLL_BUFFER_BYTES in the workers: the module-level drop-ins' buffer
MAX_BUFFERS_PER_MESSAGE = 4  # messages up to this many times the buffer
COMM_TIMEOUT = 20.0  # a ring wait that outlasts this raises in the worker
CASE_TIMEOUT = 60.0  # the parent gives up on a case (and kills the pool) after this
START_TIMEOUT = 180.0  # pool start: 5 interpreters + torch + gloo rendezvous on 2 cores
GUARD = 3  # sentinel elements after each output (and `offset` before it)

# SUM/AVG inputs k * 2^-s with |k| <= K: every partial sum of up to 5 ranks is exact.
SUMMABLE = {"float16": (48, 2), "bfloat16": (12, 2), "float32": (1 << 16, 8), "float64": (1 << 40, 20)}
PRODUCT_VALUES = (1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 1.0, -1.0, 2.0, 0.5, -1.0, 1.0, -2.0, 0.5, 1.0, 0.0)
BITS = {"float32": "int32", "float64": "int64", "float16": "int16", "bfloat16": "int16"}


# ============================================================================ cases (parent)

@dataclasses.dataclass(frozen=True)
class Space:
    """What :func:`cases` draws from where transports differ: the CPU's (this module's pool
    of processes) by default; the emulated CUDA transport's is ringcoll/harness/fuzz_cuda.py's."""

    pool_size: int = POOL_SIZE  # worlds 1..pool_size
    groups: tuple = ("default", "subgroup")
    apis: tuple = ("comm", "module", "hierarchical", "backend")
    buffers: tuple = BUFFER_CHOICES  # a Communicator's buffer_bytes
    slot_alignment: int = 64  # bytes; the transport's slot_alignment
    variants: tuple = ()  # RINGCOLL_CUDA_KERNEL values, drawn as "variant" where given
    plan_slot_area: Callable[[int, int], int] = Transport.plan_slot_area  # the transport's

    def plan_fits(self, buffer_bytes: int, world: int, chunks: int) -> bool:
        """Whether a plan of `chunks` chunks runs in this buffer: two banks of one slot per
        chunk, from what the transport cuts plans' slots from (a smaller buffer is refused
        by name on every rank, so it is not drawn)."""
        return self.plan_slot_area(buffer_bytes, world) >= 2 * chunks * self.slot_alignment


CPU = Space()


def slice_elements(buffer_bytes: int, world: int, dtype: str, alignment: int = 64) -> int:
    """Elements of one slice (one slot of the ring: buffer / (2 banks x P), rounded down to
    the transport's slot alignment). Used only to draw sizes near slice boundaries; if the
    driver changes, the sizes stay valid, only less pointed."""
    slot = buffer_bytes // (2 * world) // alignment * alignment
    return max(1, slot // ITEMSIZE[dtype])


def _count_strategy(st, collective, world, dtype, buffer_bytes, alignment=64):
    """Element count: all_reduce's total n, or the per-rank count of the others. Four
    branches, so that empty and tiny messages, slice boundaries and messages larger than
    the registered buffer each come up often."""
    s = slice_elements(buffer_bytes, world, dtype, alignment)
    limit = MAX_BUFFERS_PER_MESSAGE * buffer_bytes // ITEMSIZE[dtype]  # elements of the whole message
    over = buffer_bytes // ITEMSIZE[dtype] + 1  # the message no longer fits the buffer
    if collective in ("all_reduce", *ROOTED):
        unit = world * s  # one slice per chunk
    else:
        limit, over, unit = limit // world, over // world + 1, s
    edges = sorted({max(0, k * unit + d) for k in (1, 2, 3) for d in (-1, 0, 1) if k * unit + d <= limit})
    return st.one_of(st.integers(0, 2 * world + 2), st.sampled_from(edges), st.integers(over, limit),
                     st.integers(1, limit))


def form_applies(form: str, collective: str, which_api: str) -> bool:
    """Whether `form` of `collective` exists in `which_api`: the module-level drop-ins have
    neither prepared nor coalesced calls, the communicators only for some collectives, and
    torch.distributed on the backend coalesces three (BACKEND_COALESCED) and prepares none."""
    if form in ("plain", "repeated"):
        return True
    if which_api == "backend":
        return form == "coalesced" and collective in BACKEND_COALESCED
    cls = CLASSES.get(which_api)
    return cls is not None and collective in (_prepared_of(cls) if form == "prepared" else _coalesced_of(cls))


def even_layouts(st, world: int):
    """A HierarchicalCommunicator's node layout over `world` group ranks: each rank's node id
    ("a", "b", ...), every node the same size (the only layouts it accepts), the nodes in any
    interleaving (a, b, a, c, c, b): 1 node, `world` nodes, or any count that divides it."""
    counts = [n for n in range(1, world + 1) if world % n == 0]
    return st.sampled_from(counts).flatmap(
        lambda n: st.permutations([chr(ord("a") + i) for i in range(n) for _ in range(world // n)]).map(tuple))


def cases(space: Space = CPU):
    """The hypothesis strategy: one collective call (a small dict, see the module doc), drawn
    from `space`."""
    from hypothesis import strategies as st

    @st.composite
    def case(draw):
        world = draw(st.sampled_from(range(1, space.pool_size + 1)))  # (integers() would draw 1 half the time)
        group = draw(st.sampled_from(space.groups))
        if group == "default":
            ranks = tuple(range(world))
        else:
            ranks = tuple(sorted(draw(st.permutations(range(space.pool_size)))[:world]))
        collective = draw(st.sampled_from(COLLECTIVES))
        dtype = draw(st.sampled_from(DTYPES))
        op = None
        if collective in REDUCING:
            op = draw(st.sampled_from(OPS if dtype in FLOATING else OPS[:4]))
        base = {"reduce_scatter_tensor": "reduce_scatter", "all_gather_into_tensor": "all_gather"}.get(
            collective, collective)
        which_api = draw(st.sampled_from(space.apis))
        # (across nodes only "auto" is offered per call; the backend's calls have no algorithm=)
        algorithm = "auto" if which_api in ("hierarchical", "backend") else \
            draw(st.sampled_from(["auto", "native", *(a for a in plans.BUILTIN if base in plans.BUILTIN_COLLECTIVES[a])]))
        form = draw(st.sampled_from([f for f in FORMS if form_applies(f, collective, which_api)]))
        # A plan of C chunks needs two banks of C slots (the rooted ones' pipelines cut 16)
        chunks = plans.plan(algorithm, base, world).chunks if algorithm in plans.BUILTIN else 1
        buffer_bytes = draw(st.sampled_from([b for b in space.buffers if space.plan_fits(b, world, chunks)])) \
            if which_api not in TORCH_SHAPED else MODULE_BUFFER
        counts = _count_strategy(st, collective, world, dtype, buffer_bytes, space.slot_alignment)
        count = draw(counts)
        more_counts = ()  # a coalesced call's further tensors, each its own size
        if form == "coalesced":
            more_counts = tuple(draw(st.lists(counts, max_size=MAX_COALESCED - 1)))
        in_place = draw(st.booleans())
        if (collective == "all_reduce" and (which_api in TORCH_SHAPED or form == "coalesced")) or collective in ROOTED:
            # the out-of-place all_reduce(output=) is a Communicator extra that all_reduce_coalesced
            # lacks; rooted: one tensor
            in_place = True
        async_op = draw(st.booleans())
        # in_flight (repeated async calls only): both started before either is waited for, on two
        # sets of tensors (rewriting an input while its call is in flight is the caller's race)
        in_flight = draw(st.booleans()) if form == "repeated" and async_op else False
        drawn = {
            "collective": collective, "form": form, "dtype": dtype, "op": op, "world": world, "group": group,
            "ranks": ranks, "count": count, "more_counts": more_counts, "in_place": in_place,
            "async_op": async_op, "in_flight": in_flight,
            "algorithm": algorithm, "root": draw(st.integers(0, world - 1)),  # broadcast's and reduce's
            "api": which_api, "buffer_bytes": buffer_bytes,
            "offset": draw(st.integers(0, 1)),  # 1: every tensor starts one element into its buffer
            "specials": draw(st.booleans()),  # inf / NaN (floats), extremes (integers)
            # op spelled dist.ReduceOp.X instead of ringcoll.ReduceOp.X (torch.distributed takes only its own)
            "torch_op": draw(st.booleans()) if which_api != "backend" else True,
            # every tensor of the call from ringcoll.empty (read in place); the hierarchical API has no empty()
            "symmetric": draw(st.booleans()) if which_api != "hierarchical" else False,
            "seed": draw(st.integers(0, 2 ** 31 - 1)),
        }
        if which_api == "hierarchical":  # its nodes and pieces (the CUDA space has no such API)
            drawn["nodes"] = draw(even_layouts(st, world))
            drawn["pipeline_bytes"] = draw(st.sampled_from([0, *(buffer_bytes // d for d in PIPELINE_DIVISORS)]))
            drawn["pipeline_env"] = draw(st.booleans())  # given as RINGCOLL_PIPELINE_BYTES, not pipeline_bytes=
        if space.variants:  # drawn last, so the CPU's draws stay as they were
            drawn["variant"] = draw(st.sampled_from(space.variants))
        return drawn

    return case()


def example_case(**overrides) -> dict:
    """One case as :func:`cases` draws it, written out (for tests that run a chosen case):
    a 1000-element float32 sum all-reduce on ranks 0, 2, 4, out of place, one element into
    its buffers; `overrides` change any field."""
    return {"collective": "all_reduce", "form": "plain", "dtype": "float32", "op": "SUM", "world": 3,
            "group": "subgroup", "ranks": (0, 2, 4), "count": 1000, "more_counts": (), "in_place": False,
            "async_op": False, "in_flight": False, "api": "comm", "buffer_bytes": 1024, "offset": 1,
            "specials": False, "torch_op": False, "symmetric": False, "algorithm": "auto", "root": 0, "seed": 7,
            **overrides}


def describe(case: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in case.items())


# ============================================================================ worker side

def _seed_of(*parts) -> int:
    return zlib.crc32("|".join(str(p) for p in parts).encode())


def input_kind(case: dict) -> str:
    if case["collective"] not in REDUCING:
        return "bits"
    return {"SUM": "sum", "AVG": "sum", "PRODUCT": "prod", "MIN": "minmax", "MAX": "minmax"}[case["op"]]


def input_numel(case: dict, world: int) -> int:
    """Elements of each rank's input."""
    c = case["count"]
    return {"all_reduce": c, "reduce_scatter_tensor": world * c, "reduce_scatter": world * c}.get(
        case["collective"], c)


def make_input(case: dict, group_rank: int, world: int):
    """Group rank `group_rank`'s input: a function of the case alone, so every worker can
    build every rank's input and compute the reference without communicating."""
    import torch

    dtype = getattr(torch, case["dtype"])
    n = input_numel(case, world)
    kind = input_kind(case)
    g = torch.Generator().manual_seed(_seed_of(case["seed"], group_rank))
    floating = case["dtype"] in FLOATING

    def random_ints(int_dtype, m):
        info = torch.iinfo(int_dtype)
        high = info.max if int_dtype == torch.int64 else info.max + 1
        return torch.randint(info.min, high, (m,), generator=g, dtype=int_dtype)

    if kind == "bits":
        return random_ints(getattr(torch, BITS.get(case["dtype"], case["dtype"])), n).view(dtype)
    if not floating:
        x = random_ints(dtype, n)
        if kind == "prod" and n >= 2:  # half small factors, so not every product wraps to 0
            lo = 0 if dtype == torch.uint8 else -3
            x[1::2] = torch.randint(lo, 4, (n // 2,), generator=g, dtype=dtype)
        if case["specials"] and n:
            info = torch.iinfo(dtype)
            idx = torch.randint(0, n, (min(n, 4),), generator=g)
            for j, i in enumerate(idx.tolist()):
                x[i] = info.max if j % 2 == 0 else info.min
        return x
    if kind == "sum":
        k, shift = SUMMABLE[case["dtype"]]
        ints = torch.randint(-k, k + 1, (n,), generator=g, dtype=torch.int64)
        x = (ints.to(torch.float64) * 2.0 ** -shift).to(dtype)
        specials = (float("inf"), float("-inf"), float("nan"))
    elif kind == "prod":
        values = torch.tensor(PRODUCT_VALUES, dtype=torch.float64)
        x = values[torch.randint(0, len(values), (n,), generator=g)].to(dtype)
        specials = (float("inf"), float("-inf"), float("nan"))
    else:  # minmax: arbitrary values, half of them small integers so ties are frequent
        x = (torch.randn(n, generator=g, dtype=torch.float64) * 100).to(dtype)
        if n >= 2:
            x[1::2] = torch.randint(-4, 5, (n // 2,), generator=g).to(dtype)
        x = x + 0.0  # -0.0 -> +0.0: MIN(-0.0, +0.0) depends on the order of the operands
        specials = (float("inf"), float("-inf"), float("nan"))
    if case["specials"] and n:
        idx = torch.randint(0, n, (min(n, 3),), generator=g)
        which = torch.randint(0, len(specials), (idx.numel(),), generator=g)
        for i, w in zip(idx.tolist(), which.tolist()):
            x[i] = specials[w]
    return x


def plain_reduce(xs: list, op: str):
    """op over the ranks' tensors, one elementwise step per rank in the tensors' dtype
    (integers wrap, MIN/MAX propagate NaN); AVG is SUM then one division by P."""
    import torch

    acc = xs[0].clone()
    for x in xs[1:]:
        if op in ("SUM", "AVG"):
            acc = acc + x
        elif op == "PRODUCT":
            acc = acc * x
        elif op == "MIN":
            acc = torch.minimum(acc, x)
        else:
            acc = torch.maximum(acc, x)
    if op == "AVG":
        acc = acc / len(xs)
    return acc


def plain_reference(case: dict, xs: list, group_rank: int):
    """What this rank's output must hold, flat: computed from every rank's input."""
    import torch

    c, coll = case["count"], case["collective"]
    if coll == "broadcast":
        return xs[case["root"]]
    if coll == "reduce":  # the root's result; every other rank's tensor is left as it was
        return plain_reduce(xs, case["op"]) if group_rank == case["root"] else xs[group_rank]
    if coll == "all_reduce":
        return plain_reduce(xs, case["op"])
    if coll in ("reduce_scatter_tensor", "reduce_scatter"):
        return plain_reduce(xs, case["op"])[group_rank * c:(group_rank + 1) * c]
    return torch.cat(xs) if xs else xs


def _bits(t):
    import torch

    name = str(t.dtype).replace("torch.", "")
    return t.view(getattr(torch, BITS[name])) if name in BITS else t


def compare(label: str, got, expected, nan_aware: bool) -> list:
    """[] when got equals expected bit for bit (NaN-aware: NaN exactly where expected has
    NaN, any NaN bits), else one line naming the first difference."""
    import torch

    got, expected = got.reshape(-1), expected.reshape(-1)
    if got.dtype != expected.dtype or got.numel() != expected.numel():
        return [f"{label}: got {got.dtype}[{got.numel()}], expected {expected.dtype}[{expected.numel()}]"]
    diff = _bits(got) != _bits(expected)
    if nan_aware and got.is_floating_point():
        both_nan = torch.isnan(got) & torch.isnan(expected)
        diff &= ~both_nan
    if not bool(diff.any()):
        return []
    bad = diff.nonzero().reshape(-1)
    i = int(bad[0])
    return [f"{label}: {bad.numel()} of {got.numel()} elements differ; first at {i}: got {got[i].item()!r} "
            f"(bits {int(_bits(got)[i])}), expected {expected[i].item()!r} (bits {int(_bits(expected)[i])})"]


def _sentinel(n: int, dtype):
    """n elements of the byte pattern 0x5A (finite, not NaN, in every dtype)."""
    import torch

    size = torch.empty(0, dtype=dtype).element_size()
    return torch.full((n * size,), 0x5A, dtype=torch.uint8).view(dtype)


def _list_shape(c: int):
    return (2, c // 2) if c >= 2 and c % 2 == 0 else (c,)


def parts(case: dict) -> list:
    """The case's calls as rounds (made one after the other, or in flight together), each a
    list of (label, case) per tensor: one tensor's case for a plain call; two rounds for a
    repeated or prepared one, the second on fresh data (another seed); for a coalesced call,
    one round of its tensors, each its own count and seed. The label prefixes a failure."""
    if case["form"] == "coalesced":
        counts = (case["count"], *case["more_counts"])
        return [[(f"tensor {i + 1} of {len(counts)}: ",
                  {**case, "count": c, "seed": _seed_of(case["seed"], "tensor", i)}) for i, c in enumerate(counts)]]
    if case["form"] in ("repeated", "prepared"):
        return [[("call 1 of 2: ", case)], [("call 2 of 2: ", {**case, "seed": _seed_of(case["seed"], "again")})]]
    return [[("", case)]]


class _Bound(collections.namedtuple("_Bound", "name args kwargs load result unchanged")):
    """One call's tensors (_Worker.bind): ``name(*args, **kwargs)`` is the call (op, async_op
    and algorithm aside); ``load(x)`` writes an input x into them as a caller would;
    ``result()`` is the result, flat or not; ``unchanged(x)`` the (label, tensor or getter,
    expected) that must still hold x's values after the call."""


def _returned(ret, async_op: bool, which_api: str = "comm") -> list:
    """Failures of what a call returned: None when synchronous, else a Work whose wait()
    is True and that is then completed and successful (torch's Work on the backend; for a
    coalesced call there, c10d's coalescing manager, holding one such Work)."""
    import torch.distributed as dist

    if not async_op:
        return [] if ret is None else [f"a synchronous call returned {type(ret).__name__}, not None"]
    if which_api == "backend" and isinstance(ret, dist.distributed_c10d._CoalescingManager):
        if len(ret.works) != 1:
            return [f"the coalescing manager holds {len(ret.works)} works, not the backend's one"]
        ret = ret.works[0]
    work_type = dist.Work if which_api == "backend" else Work
    if not isinstance(ret, work_type):
        return [f"async_op=True returned {type(ret).__name__}, not a {work_type.__name__}"]
    if ret.wait() is not True:
        return ["Work.wait() did not return True"]
    if not (ret.is_completed() and ret.is_success()):
        return ["Work not completed successfully after wait()"]
    return []


PAD_BACKEND = "fuzzpad"  # _Worker._pad_groups' groups: a name in torch's list, no transport


def _name_only_group(store, rank: int, size: int, timeout):
    """PAD_BACKEND's process group: never called, so nothing but torch's base class."""
    import torch.distributed as dist

    return dist.ProcessGroup(rank, size)


class _Worker:
    """State of one pool worker: its groups and communicators, and the case runner."""

    def __init__(self, rank: int, size: int):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.size = rank, size
        self.groups: dict = {}  # (group kind, ranks) -> gloo process group (None: the default group)
        self.backend_groups: dict = {}  # (group kind, ranks) -> process group of the ringcoll backend
        self.comms: dict = {}  # communicator_key(case) -> Communicator or HierarchicalCommunicator
        # Every communicator's key by last use, over EVERY case (skipped ones too), so all
        # workers agree which to close: each may hold arenas of symmetric memory, whose pages
        # are allocated when made (64 MiB each), and 36 groups x 7 buffers of them on 5
        # workers ran a 4000-example run out of memory (the OOM killer).
        self.last_used: collections.OrderedDict = collections.OrderedDict()
        self.groups_made = 0  # dist.new_group calls: the same on every worker, member or not

    def _new_group(self, ranks, **kw):
        """dist.new_group: collective over the default group, so every worker makes it, in case order."""
        self.groups_made += 1
        return self.dist.new_group(ranks=list(ranks), **kw)

    def group(self, case):
        """The case's gloo group (the reference's; and the ring's but for the "backend" API)."""
        key = (case["group"], tuple(case["ranks"]))
        if key not in self.groups:
            if case["group"] == "default" and len(case["ranks"]) == self.size:
                self.groups[key] = None  # the default group itself
            else:
                self.groups[key] = self._new_group(case["ranks"])
        return self.groups[key]

    def backend_group(self, case):
        """The case's group on the ringcoll backend (the "backend" API's; the default group
        is gloo, so even a world of all 5 gets one), made on first use and kept, with its
        ring, for the pool's life: there are 2^5 - 1 at most, and destroying one would lower
        torch's count of groups, by which it names use_local_synchronization groups (the
        hierarchical API's), so that a later one took a name still in use."""
        key = (case["group"], tuple(case["ranks"]))
        if key not in self.backend_groups:
            self.backend_groups[key] = self._new_group(case["ranks"], backend="ringcoll")
        return self.backend_groups[key]

    @staticmethod
    def communicator_key(case: dict) -> tuple:
        """What a case's communicator is cached by: the API and group, and what it was built
        with (the module-level API's is the drop-ins' own, one per group)."""
        key = (case["api"], case["group"], tuple(case["ranks"]))
        if case["api"] in TORCH_SHAPED:  # one communicator per group, on its own buffer
            return key
        key += (case["buffer_bytes"],)
        if case["api"] == "hierarchical":
            key += (case["nodes"], case["pipeline_bytes"], case["pipeline_env"])
        return key

    @staticmethod
    def group_count() -> int:
        """The process groups this worker knows (torch's count: groups it is a member of), as
        the hierarchical communicator reads it."""
        return len(_group_names())

    def _pad_groups(self, count: int) -> None:
        """Bring this worker's count of process groups up to `count`, with groups of itself alone.

        A HierarchicalCommunicator makes its groups with use_local_synchronization, which
        torch 2.13 names by a hash of the ranks AND the number of groups the process knows, so
        members that made different numbers of groups before (the pool's subgroups, earlier
        communicators of some ranks only) would never meet: it refuses to start where the
        counts differ (the user's fix: make the same groups everywhere). So before one is
        built every worker (member or not) pads to the same count: the largest any worker had
        after the last case, plus the groups this case has made (a member of each has one more).
        Exactly that, not a bound: a bound that grew by the communicator's two groups at every
        build (though most take groups a closed one left idle) made 400 gloo groups per worker
        in 2500 examples (1264 threads in one), and examples ~6 times slower. And of a backend
        that only takes a name (PAD_BACKEND): a gloo group of one rank has three threads."""
        if PAD_BACKEND not in self.dist.Backend.backend_list:
            self.dist.Backend.register_backend(PAD_BACKEND, _name_only_group, devices=["cpu"])
        while self.group_count() < count:
            self.dist.new_group([self.rank], use_local_synchronization=True, backend=PAD_BACKEND)

    def communicator(self, case, group, grank):
        key = self.communicator_key(case)
        if key not in self.comms:
            if case["api"] == "comm":
                self.comms[key] = Communicator(group=group, buffer_bytes=case["buffer_bytes"], timeout=COMM_TIMEOUT)
            else:  # this rank's node from the case's layout; the pieces by argument or by environment
                pipeline = case["pipeline_bytes"]
                saved = os.environ.get("RINGCOLL_PIPELINE_BYTES")
                if case["pipeline_env"]:
                    os.environ["RINGCOLL_PIPELINE_BYTES"] = str(pipeline)
                try:
                    self.comms[key] = HierarchicalCommunicator(
                        group=group, node_id=case["nodes"][grank], timeout=COMM_TIMEOUT,
                        buffer_bytes=case["buffer_bytes"], pipeline_bytes=None if case["pipeline_env"] else pipeline)
                finally:
                    if case["pipeline_env"]:
                        os.environ.pop("RINGCOLL_PIPELINE_BYTES")
                        if saved is not None:
                            os.environ["RINGCOLL_PIPELINE_BYTES"] = saved
        return self.comms[key]

    def _keep_few_communicators(self, case: dict, group) -> None:
        """Note this case's communicator as the latest used; close the least recently used
        past LIVE_COMMUNICATORS (every worker closes the same one at the same case: a
        hierarchical one's close meets its members, and they make their next one together)."""
        key = self.communicator_key(case)
        self.last_used[key] = group
        self.last_used.move_to_end(key)
        while len(self.last_used) > LIVE_COMMUNICATORS:
            old_key, old_group = self.last_used.popitem(last=False)
            if old_key[0] == "module":
                comm = api._communicators.pop((old_group if old_group is not None else self.dist.group.WORLD,
                                               "cpu"), None)
            else:
                comm = self.comms.pop(old_key, None)
            if comm is not None:
                comm.close()

    def handle(self, case: dict, groups_known: int = 0):
        """Run `case` (or answer "skip"); `groups_known`: the most process groups any worker
        knew after the last case (the pool's; _pad_groups)."""
        if case.get("collective") == "_sleep":  # self-test of the parent's timeout
            time.sleep(case["seconds"])
            return ("ok", [], None)
        made_before = self.groups_made
        group = self.group(case)
        if case.get("api") == "backend":
            self.backend_group(case)  # made by every worker, in case order; kept
        else:
            if case.get("api") == "hierarchical" and self.communicator_key(case) not in self.last_used:
                self._pad_groups(groups_known + self.groups_made - made_before)  # its members build it now
            self._keep_few_communicators(case, group)
        ranks = list(case["ranks"])
        if self.rank not in ranks:
            return ("skip", [], None)
        try:
            return self.run(case, group, ranks.index(self.rank), len(ranks))
        except BaseException as exc:  # noqa: BLE001 - reported as text; the parent restarts the pool
            return ("error", [f"rank {self.rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"], None)

    # --- the reference: gloo on the same call -------------------------------------------

    def gloo(self, case, x, group, world):
        """gloo's answer to the same call (out of place), flat; None when gloo is not asked."""
        torch, dist = self.torch, self.dist
        coll, c, op = case["collective"], case["count"], case["op"]
        if c == 0:
            return None
        dop = getattr(dist.ReduceOp, op) if op else None
        if coll == "all_reduce":
            t = x.clone()
            dist.all_reduce(t, op=dop, group=group)
            return t
        if coll == "broadcast":
            t = x.clone()
            dist.broadcast(t, group=group, group_src=case["root"])
            return t
        if coll == "reduce":  # gloo defines the root's result only
            t = x.clone()
            dist.reduce(t, op=dop, group=group, group_dst=case["root"])
            return t if dist.get_rank(group) == case["root"] else None
        if coll in ("reduce_scatter_tensor", "reduce_scatter"):
            # (gloo's list form computes the same as its tensor form, some 5 times slower: 50 ms
            # a call against 10, 5 ranks on 2 cores; the tensor form answers both.)
            out = torch.empty(c, dtype=x.dtype)
            _types.torch_tensor_forms()[1](out, x.clone(), op=dop, group=group)
            return out
        if coll == "all_gather_into_tensor":
            out = torch.empty(world * c, dtype=x.dtype)
            _types.torch_tensor_forms()[0](out, x.clone(), group=group)
            return out
        outs = [torch.empty(c, dtype=x.dtype) for _ in range(world)]
        dist.all_gather(outs, x.clone(), group=group)
        return torch.cat(outs)

    # --- ringcoll --------------------------------------------------------------------------

    def expect(self, case, group, grank, world):
        """This rank's input for `case` and what its result must be: the plain reference, and
        gloo's answer (None where gloo is not asked, or where it cannot be compared)."""
        xs = [make_input(case, r, world) for r in range(world)]
        gloo_ref = self.gloo(case, xs[grank], group, world)
        if case["op"] in ("MIN", "MAX") and any(bool(t.isnan().any()) for t in xs):
            gloo_ref = None  # gloo's MIN/MAX do not propagate NaN: its answer depends on where the NaN is
        return xs[grank], plain_reference(case, xs, grank), gloo_ref

    def bind(self, case, guarded, grank, world) -> "_Bound":
        """The tensors of one call of `case` (made with `guarded`), bound as a _Bound."""
        torch = self.torch
        coll, c, in_place = case["collective"], case["count"], case["in_place"]
        mine = slice(grank * c, (grank + 1) * c)  # this rank's chunk of a world x c tensor
        nothing = lambda x: []  # noqa: E731 - an in-place call has no separate input to keep
        if coll in ROOTED:  # one tensor, in place, root given as a rank of the group
            t = guarded(c)
            if case["api"] not in TORCH_SHAPED:  # a communicator's: root as an argument
                return _Bound(coll, (t, case["root"]), {}, t.copy_, lambda: t, nothing)
            root = {"broadcast": "group_src", "reduce": "group_dst"}[coll]
            return _Bound(coll, (t,), {root: case["root"]}, t.copy_, lambda: t, nothing)
        if coll == "all_reduce":
            t = guarded(c, "tensor" if in_place else "input")
            if in_place:
                return _Bound(coll, (t,), {}, t.copy_, lambda: t, nothing)
            out = guarded(c)
            return _Bound(coll, (t,), {"output": out}, t.copy_, lambda: out, lambda x: [("input", t, x)])
        if coll == "reduce_scatter_tensor":
            if in_place:  # output is this rank's chunk of input; the other chunks must stay as they were
                buf = guarded(world * c)
                others = lambda: torch.cat([buf[:mine.start], buf[mine.stop:]])  # noqa: E731
                return _Bound(coll, (buf[mine], buf), {}, buf.copy_, lambda: buf[mine],
                              lambda x: [("other ranks' chunks of the in-place input", others,
                                          torch.cat([x[:mine.start], x[mine.stop:]]))])
            inp, out = guarded(world * c, "input"), guarded(c)
            return _Bound(coll, (out, inp), {}, inp.copy_, lambda: out, lambda x: [("input", inp, x)])
        if coll == "all_gather_into_tensor":
            out = guarded(world * c)
            if in_place:  # input is this rank's chunk of output
                return _Bound(coll, (out, out[mine]), {}, out[mine].copy_, lambda: out, nothing)
            inp = guarded(c, "input")
            return _Bound(coll, (out, inp), {}, inp.copy_, lambda: out, lambda x: [("input", inp, x)])
        shape = _list_shape(c)
        if coll == "all_gather":
            outs = [guarded(c, f"tensor_list[{r}]").view(shape) for r in range(world)]
            result = lambda: torch.cat([o.reshape(-1) for o in outs])  # noqa: E731
            if in_place:  # tensor is tensor_list[rank] itself
                return _Bound(coll, (outs, outs[grank]), {}, outs[grank].view(-1).copy_, result, nothing)
            inp = guarded(c, "tensor").view(shape)
            return _Bound(coll, (outs, inp), {}, inp.view(-1).copy_, result, lambda x: [("tensor", inp, x)])
        # reduce_scatter (list form)
        inputs = [guarded(c, f"input_list[{r}]").view(shape) for r in range(world)]
        out = inputs[grank] if in_place else guarded(c).view(shape)  # in place: output is input_list[rank]
        kept = [r for r in range(world) if not (in_place and r == grank)]

        def load(x):
            for r, t in enumerate(inputs):
                t.view(-1).copy_(x[r * c:(r + 1) * c])

        return _Bound(coll, (out, inputs), {}, load, lambda: out,
                      lambda x: [(f"input_list[{r}]", inputs[r], x[r * c:(r + 1) * c]) for r in kept])

    def run(self, case, group, grank, world):
        torch = self.torch
        dtype = getattr(torch, case["dtype"])
        coll, form, a = case["collective"], case["form"], case["async_op"]
        rounds = parts(case)
        # Every part's inputs and references first, gloo's included: gloo stays in step
        expected = [[self.expect(sub, group, grank, world) for _, sub in round_] for round_ in rounds]

        comm = None
        # The ring's group: the case's gloo group, or (the "backend" API) its group of the ringcoll backend
        ring_group = self.backend_group(case) if case["api"] == "backend" else group
        if case["api"] == "backend":  # torch.distributed itself

            def call(name, *args, **kw):
                return getattr(self.dist, name)(*args, group=ring_group, **kw)
        elif case["api"] == "module":
            def call(name, *args, **kw):  # the module-level drop-ins
                return getattr(api, name)(*args, group=group, algorithm=case["algorithm"], **kw)
        else:
            comm = self.communicator(case, group, grank)

            def call(name, *args, **kw):
                return getattr(comm, name)(*args, algorithm=case["algorithm"], **kw)

        op_kw = {}
        if case["op"] is not None:
            op_kw["op"] = getattr(self.dist.ReduceOp, case["op"]) if case["torch_op"] else _types.ReduceOp[case["op"]]
        off = case["offset"]
        bases = []  # (label, base tensor, first, last element the call may write)

        def guarded(n, label="output"):
            base = _sentinel(off + n + GUARD, dtype)
            if case.get("symmetric"):  # the same bits in symmetric memory (a collective allocation)
                base = (comm.empty(base.numel(), dtype=dtype) if case["api"] == "comm" else
                        api.empty(base.numel(), dtype=dtype, group=ring_group)).copy_(base)
            bases.append((label, base, off, off + n))
            return base[off:off + n]

        # The tensors: one set, used by every round (rewritten in between), except that calls
        # in flight together each get their own
        tensor_sets = [[self.bind(sub, guarded, grank, world) for _, sub in round_]
                       for round_ in (rounds if case["in_flight"] else rounds[:1])]
        bound = tensor_sets if case["in_flight"] else tensor_sets * len(rounds)  # each round's
        if form == "prepared":  # checked once here, run once per round
            (b,) = tensor_sets[0]
            prepared = call(f"prepare_{b.name}", *b.args, **b.kwargs, **op_kw)

        def start(calls):
            if form == "prepared":
                return prepared(async_op=a)
            if form == "coalesced" and case["api"] == "backend":  # c10d's coalescing: one backend call
                with self.dist._coalescing_manager(group=ring_group, async_ops=a) as manager:
                    for b in calls:
                        call(b.name, *b.args, **b.kwargs, **op_kw)
                return manager if a else None
            if form == "coalesced":  # the calls' tensors as lists: (tensors) or (outputs, inputs)
                return call(f"{coll}_coalesced", *[list(ts) for ts in zip(*(b.args for b in calls))],
                            async_op=a, **op_kw)
            (b,) = calls
            return call(b.name, *b.args, async_op=a, **b.kwargs, **op_kw)

        failures = []
        digest = hashlib.sha1()
        last = rounds[-1][-1][0]  # the last part's label

        def check(label, b, x, ref, gloo_ref):
            got = b.result()
            if case.get("corrupt_rank") == self.rank and label == last and got.numel():
                got = got.clone()  # self-test: the checks must notice (in the last part checked)
                _bits(got).view(-1)[0] ^= 1
            found = compare(f"{label}result vs plain reference", got, ref, coll in REDUCING)
            if gloo_ref is not None:
                found += compare(f"{label}result vs gloo", got, gloo_ref, coll in REDUCING)
            for what, t, before in b.unchanged(x):
                found += compare(f"{label}{what} must stay unchanged", t() if callable(t) else t, before, False)
            digest.update(_bits(got.contiguous()).reshape(-1).numpy().tobytes())
            return found

        # Calls in flight together are all started before any is waited for; otherwise each
        # round is run, waited for and checked before the next rewrites its tensors
        waves = [range(len(rounds))] if case["in_flight"] else [[r] for r in range(len(rounds))]
        for wave in waves:
            for r in wave:
                for b, (x, _, _) in zip(bound[r], expected[r]):
                    b.load(x)
            for ret in [start(bound[r]) for r in wave]:
                failures += _returned(ret, a, case["api"])
            for r in wave:
                for (label, _), b, want in zip(rounds[r], bound[r], expected[r]):
                    failures += check(label, b, *want)
        for label, base, lo, hi in bases:
            guards = torch.cat([base[:lo], base[hi:]])
            failures += compare(f"memory next to {label} must stay untouched", guards,
                                _sentinel(guards.numel(), dtype), False)
        # every rank holds the same result, but for the scatters and reduce
        same = coll not in ("reduce_scatter_tensor", "reduce_scatter", "reduce")
        return ("fail" if failures else "ok", [f"rank {self.rank} (group rank {grank}): {f}" for f in failures],
                digest.hexdigest() if same else None)


def _worker_main(rank, size, port, conn):
    """A pool worker: init gloo (world `size`), then answer cases until told to stop."""
    _set_pdeathsig()  # SIGKILL this worker when the parent dies: no run leaves orphans
    try:
        import warnings

        warnings.filterwarnings("ignore")  # torch's deprecation notes for the gloo reference calls
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=CASE_TIMEOUT * 2))
        worker = _Worker(rank, size)
        conn.send((("ready", rank), worker.group_count()))  # every reply: (reply, the groups it knows)
    except BaseException as exc:  # noqa: BLE001
        try:
            conn.send((("error", [f"rank {rank} failed to start: {exc}\n{traceback.format_exc()}"], None), 0))
        finally:
            os._exit(1)
    while True:
        try:
            message = conn.recv()  # (case, the pool's groups_known), or None: stop
        except (EOFError, OSError):
            break
        if message is None:
            break
        reply = worker.handle(*message)
        conn.send((reply, worker.group_count()))
    try:
        for comm in worker.comms.values():
            comm.close()
        api.destroy_communicators()
    except BaseException:  # noqa: BLE001
        pass
    try:
        conn.close()
    except OSError:
        pass
    os._exit(0)  # skip interpreter and process-group teardown: nothing left to flush


# The worker process runs this via the builtin exec, not _worker_main as its target:
# unpickling that target would import ringcoll (and torch) before `_env` is in place, as in
# the launcher's bootstrap. (Under ``python -m ringcoll.harness.fuzz``, "spawn" imports the
# main module, this one, first anyway; the worker's torch.set_num_threads(1) still holds.)
_BOOT = """
import os
os.environ.update(_env)
from ringcoll.harness.fuzz import _worker_main
_worker_main(*_args)
"""


# ============================================================================ the pool (parent)

class PoolError(RuntimeError):
    """A case timed out, a worker died or the pool could not start (the pool is torn down)."""


class FuzzPool:
    """POOL_SIZE worker processes with a gloo group of that world; see the module doc.

    ``run(case)`` sends the case to every worker and returns their replies, in rank order:
    ``(status, failure lines, digest)`` with status "ok", "fail", "error" or "skip".
    Raises :class:`PoolError` (after killing the pool) on a timeout or a dead worker.
    Starts lazily; use as a context manager or call ``close()``.
    """

    def __init__(self, size: int = POOL_SIZE, case_timeout: float = CASE_TIMEOUT,
                 start_timeout: float = START_TIMEOUT):
        self.size = size
        self.case_timeout = case_timeout
        self.start_timeout = start_timeout
        self.procs: list = []
        self.conns: list = []
        self.starts = 0  # pools started (1 + restarts after failures)
        self.start_seconds = 0.0
        self.groups_known = 0  # the most process groups a worker knew after the last case (_pad_groups)

    @property
    def running(self) -> bool:
        return bool(self.procs)

    def start(self) -> None:
        if self.running:
            return
        t0 = time.monotonic()
        self.groups_known = 0
        ctx = multiprocessing.get_context("spawn")
        port = _free_port()
        env = {"RINGCOLL_BUFFER_BYTES": str(MODULE_BUFFER), "RINGCOLL_TIMEOUT": str(COMM_TIMEOUT),
               "OMP_NUM_THREADS": "1"}
        try:
            for rank in range(self.size):
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                boot = {"_env": env, "_args": (rank, self.size, port, child_conn)}
                proc = ctx.Process(target=exec, args=(_BOOT, boot), name=f"ringcoll-fuzz-rank{rank}", daemon=True)
                proc.start()
                child_conn.close()
                self.procs.append(proc)
                self.conns.append(parent_conn)
            replies = self._collect(self.start_timeout, "starting the pool")
        except BaseException:
            self.close(graceful=False)
            raise
        bad = [r for r in replies if r[0] != "ready"]
        if bad:
            self.close(graceful=False)
            raise PoolError("pool did not start:\n" + "\n".join(line for r in bad for line in r[1]))
        self.starts += 1
        self.start_seconds += time.monotonic() - t0

    def _collect(self, timeout: float, what: str) -> list:
        replies: list = [None] * self.size
        deadline = time.monotonic() + timeout
        waiting = set(range(self.size))
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close(graceful=False)
                raise PoolError(f"timeout after {timeout:g} s {what}: rank(s) {sorted(waiting)} did not answer "
                                "(pool killed)")
            objs = {}
            for r in waiting:
                objs[self.conns[r]] = r
                objs[self.procs[r].sentinel] = r
            for o in _wait(list(objs), timeout=left):
                r = objs[o]
                if r not in waiting:
                    continue
                try:
                    if self.conns[r].poll(0):
                        replies[r], groups = self.conns[r].recv()
                        self.groups_known = max(self.groups_known, groups)
                        waiting.discard(r)
                        continue
                except (EOFError, OSError):
                    pass
                if not self.procs[r].is_alive() or o is self.conns[r]:
                    code = self.procs[r].exitcode
                    self.close(graceful=False)
                    raise PoolError(f"rank {r} died {what} (exit code {code}; pool killed)")
        return replies

    def run(self, case: dict) -> list:
        self.start()
        for conn in self.conns:
            conn.send((case, self.groups_known))
        return self._collect(self.case_timeout, f"running case {{{describe(case)}}}")

    def close(self, graceful: bool = True) -> None:
        """Stop every worker (ask when `graceful`, then SIGTERM, then SIGKILL) and reap them.
        Idempotent."""
        if graceful:
            for conn in self.conns:
                try:
                    conn.send(None)
                except Exception:
                    pass
            end = time.monotonic() + 5.0
            for p in self.procs:
                p.join(max(0.0, end - time.monotonic()))
        _terminate(self.procs)
        for conn in self.conns:
            _close(conn)
        self.procs, self.conns = [], []

    def __enter__(self) -> "FuzzPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def check_replies(case: dict, replies: list) -> list:
    """Failure lines for one case's replies (empty: the case passed)."""
    problems = []
    members = set(case["ranks"])
    digests = {}
    for rank, (status, lines, digest) in enumerate(replies):
        if rank not in members:
            if status != "skip":
                problems.append(f"rank {rank} is not in the group but answered {status!r}")
            continue
        if status in ("fail", "error"):
            problems += lines
        elif status != "ok":
            problems.append(f"rank {rank} answered {status!r}")
        if digest is not None:
            digests[rank] = digest
    if len(set(digests.values())) > 1:
        problems.append("results differ bitwise between ranks: "
                        + ", ".join(f"rank {r}: {d[:12]}" for r, d in sorted(digests.items())))
    return problems


class Stats:
    """What a fuzz run exercised, and its failures."""

    DRAWN = ("collective", "form", "dtype", "op", "world", "group", "api", "algorithm", "buffer_bytes", "in_place",
             "async_op", "in_flight", "specials", "symmetric", "variant")  # the case's fields counted as drawn

    def unreached(self) -> dict:
        """What the draw has not reached yet of what every run must: each collective, dtype,
        world size and form of its space ({field: the values missing})."""
        every = {"collective": set(COLLECTIVES), "dtype": set(DTYPES), "form": set(FORMS),
                 "world": set(range(1, self.space.pool_size + 1))}
        return {k: want - set(self.by[k]) for k, want in every.items() if want - set(self.by[k])}

    def __init__(self, space: Space = CPU):
        self.space = space
        fixed = {"group": len(space.groups) == 1, "api": len(space.apis) == 1, "variant": not space.variants}
        self.drawn = tuple(k for k in self.DRAWN if not fixed.get(k))  # those `space` varies
        self.examples = 0
        hierarchical = ("nodes", "pieces") if "hierarchical" in space.apis else ()  # its cases' layouts and cuts
        forms_by_api = ("api form",) if "api" in self.drawn else ()  # "backend coalesced": c10d's coalescing
        self.by = {k: collections.Counter() for k in (*self.drawn, "size", *hierarchical, *forms_by_api)}
        self.failures: list = []
        self.seconds = 0.0

    def add(self, case: dict) -> None:
        self.examples += 1
        for k in self.drawn:
            self.by[k][case.get(k, False)] += 1
        if "api form" in self.by:
            self.by["api form"][f"{case['api']} {case['form']}"] += 1
        world, c = case["world"], case["count"] + sum(case["more_counts"])  # a coalesced call: one packed message
        chunk = -(-c // world) if case["collective"] == "all_reduce" else c  # elements per ring chunk
        slices = -(-chunk // slice_elements(case["buffer_bytes"], world, case["dtype"], self.space.slot_alignment))
        message = (c if case["collective"] == "all_reduce" else world * c) * ITEMSIZE[case["dtype"]]
        if c == 0:
            size = "0 elements"
        else:
            size = "1 slice" if slices == 1 else ("2-3 slices" if slices <= 3 else ">= 4 slices")
            if message > case["buffer_bytes"]:
                self.by["size"]["message > buffer"] += 1
        self.by["size"][size] += 1
        if "nodes" in case:
            nodes = len(set(case["nodes"]))
            self.by["nodes"][f"{nodes}x{len(case['nodes']) // nodes}"] += 1  # nodes x ranks each
            piece = case["pipeline_bytes"]
            self.by["pieces"]["whole" if not piece else ("1 piece" if message <= piece else "several")] += 1

    def summary(self) -> str:
        lines = [f"examples run: {self.examples}"]
        for k, counter in self.by.items():
            items = sorted(counter.items(), key=lambda kv: str(kv[0]))
            lines.append(f"  by {k}: " + ", ".join(f"{v}={n}" for v, n in items))
        return "\n".join(lines)


def run_case(pool: FuzzPool, case: dict, stats: Stats | None = None) -> None:
    """Run one case on the pool; AssertionError naming the case and every problem if it fails
    (after a timeout, a death or an exception in a rank, the pool is restarted before the
    next case, so that case starts on a clean ring)."""
    if stats is not None:
        stats.add(case)
    try:
        replies = pool.run(case)
    except PoolError as exc:
        message = f"case {{{describe(case)}}}: {exc}"
        if stats is not None:
            stats.failures.append(message)
        raise AssertionError(message) from None
    problems = check_replies(case, replies)
    if problems:
        if any(status == "error" for status, _, _ in replies):
            pool.close(graceful=False)  # a ring that raised is broken (and its peers may be out of step)
        message = f"case {{{describe(case)}}}:\n  " + "\n  ".join(problems)
        if stats is not None:
            stats.failures.append(message)
        raise AssertionError(message)


def fuzz(pool: FuzzPool, max_examples: int, seed: int | None = None, derandomize: bool = False,
         stats: Stats | None = None, space: Space = CPU) -> Stats:
    """Run hypothesis over :func:`cases` of `space` on `pool` (a FuzzPool, or anything with
    its ``run`` and ``close``). Raises what hypothesis raises for a failure (the shrunk
    case's AssertionError). The database is off: runs are reproduced from the seed
    (``seed``, or ``derandomize`` for a fixed one), not from stored examples."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed

    stats = stats if stats is not None else Stats(space)

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=derandomize,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(cases(space))
    def test(case):
        run_case(pool, case, stats)

    if seed is not None:
        test = hypothesis_seed(seed)(test)
    t0 = time.monotonic()
    try:
        test()
    finally:
        stats.seconds = time.monotonic() - t0
    return stats


# ============================================================================ CLI

def cli_arguments(argv, doc: str, examples: int, seed: int, timeout_means: str) -> argparse.Namespace:
    """The fuzzers' common options (this module's CLI and fuzz_cuda's)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=examples, help=f"hypothesis max_examples (default {examples})")
    parser.add_argument("--seed", type=int, default=seed, help=f"hypothesis seed (default {seed})")
    parser.add_argument("--case-timeout", type=float, default=CASE_TIMEOUT,
                        help=f"seconds one case may take before {timeout_means} (default {CASE_TIMEOUT:g})")
    return parser.parse_args(argv)


def machine_line(extra: str = "") -> str:
    import torch

    return (f"date {datetime.datetime.now().isoformat(timespec='seconds')}, host {platform.node()}, "
            f"{os.cpu_count()} CPUs, python {platform.python_version()}, torch {torch.__version__}{extra}")


def report(stats: "Stats", wall: float, error: Optional[BaseException], pool_lines: Sequence[str]) -> None:
    """A fuzz run's record: what was drawn, the pool's lines, the failures, the time."""
    print(stats.summary())
    for line in pool_lines:
        print(line)
    print(f"failures: {len(stats.failures)}")
    for f in stats.failures[:20]:
        print("  " + f.replace("\n", "\n  "))
    if error is not None:
        print(f"hypothesis reported: {type(error).__name__}: {error}")
    print(f"time: {wall:.1f} s total, {stats.seconds:.1f} s in hypothesis, "
          f"{1000 * stats.seconds / max(1, stats.examples):.1f} ms per example")


def main(argv=None) -> int:
    args = cli_arguments(argv, __doc__, 10000, 20261129, "the pool is killed")
    print(f"ringcoll fuzz: {args.examples} examples, seed {args.seed}, pool of {POOL_SIZE} ranks (gloo), "
          f"buffers {BUFFER_CHOICES} (module API: {MODULE_BUFFER}), case timeout {args.case_timeout:g} s")
    print(machine_line())
    stats = Stats()
    error = None
    t0 = time.monotonic()
    with FuzzPool(case_timeout=args.case_timeout) as pool:
        try:
            fuzz(pool, args.examples, seed=args.seed, stats=stats)
        except Exception as exc:  # noqa: BLE001 - reported below
            error = exc
        starts, start_seconds = pool.starts, pool.start_seconds
    report(stats, time.monotonic() - t0, error, [f"pool starts: {starts} ({start_seconds:.1f} s)"])
    return 1 if (error is not None or stats.failures) else 0


if __name__ == "__main__":
    sys.exit(main())
