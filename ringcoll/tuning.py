"""How ``algorithm="auto"`` chooses: a cost model per algorithm, read from a recorded table.

The candidates are ``"native"``, the CPU transport's own path (the ring's plan, with the
one-shot and direct plans where its thresholds say), and every built-in plan that
has the collective (``ringcoll.algorithms(collective)``). For each world size and
collective the table holds every candidate's measured time at a ladder of message sizes
n_0 < n_1 < ... (the benchmark's out-of-place times), and, under ``"<collective> in
place"``, its in-place times: an in-place call chooses by those where the table has them
(DDP's and ZeRO's calls are in place, and the two forms' fastest differ: at P = 2 and
1 MiB the direct all-reduce took 123 us out of place and 161 in place, where native took
153 and 126; bench/results/2026-12-07-cpu-shared-output.txt). Between two neighbouring
sizes a candidate costs the line through its two points,

    t(n) = alpha + n / beta        (alpha: what a call costs before it moves a byte;
                                    beta: the bytes per second it then moves)

below n_0 its time at n_0; past the last size its time there, grown in proportion to the
bytes (the bandwidth term is all that is left, so the last size's choice holds: the last
band's lines, extended, would cross wherever their noise puts them).

One line per band, not one per algorithm: a message's cost is not one line from 1 KiB to
16 MiB (paths change with the size, messages outgrow the caches). One line fitted through
all of rd's P = 2 all-reduce times prices it at 28.5 us at 128 KiB, where it took 20.2,
and would hide the 1.3-1.4x by which it beats native there. A plan must be priced at
least ``PLAN_MARGIN`` (5%) below native to be chosen: a recorded table is noisy, and two
candidates within a few percent of each other would otherwise trade sizes on that noise.
``auto`` runs, at each size, the candidate whose line is lowest (ties to native, then the
table's order); ``bands`` gives where that changes, once per communicator, so a call only
looks its size up. (The teaching model, ``learning.model.algorithm_time``, prices a plan
from its rounds and bytes alone; it predicts where crossovers lie, this table says where
they were measured.)

Where the table comes from (read when a communicator is built, each file once per process):

- ``RINGCOLL_TUNING=path``: a JSON file ``ringcoll-bench --algorithm native,ring,...
  --record-tuning path`` wrote (each run adds its times, replacing those of the same
  world size, collective, algorithm and message size);
- otherwise the table shipped in the package (``tuning_cpu.json``), recorded on this
  project's 2-core VM at P = 2 and 4 (its ``recorded`` field says how).

A table holds for the machine it was recorded on (``machine``: the CPU's model and the
cores, ``this_machine``): the crossovers move with the cores, the caches and the memory
(the 2026-12-03 table, recorded on an AMD EPYC, sent P = 2 all-reduces of 64 KiB to rhd on an
Intel Xeon, where they took 1.7x native's time). On any other machine auto runs native,
the transport's own thresholds, and says so (``Communicator.tuning_note``, the benchmark's
auto line) until ``ringcoll-bench --record-tuning`` records a table there. A table with no
``machine`` (written before it was recorded) holds anywhere.

A world size or collective the table does not hold runs native, as does every call on
CUDA (the ring kernels). Every rank must choose alike, so a communicator's ranks agree on
the table's digest at construction (ValueError naming both otherwise); a call's descriptor
carries the algorithm chosen, so ranks that still differ raise MismatchError, not a hang.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ringcoll._types import DATA_COLLECTIVES

NATIVE = "native"
IN_PLACE = " in place"  # a table key "<collective> in place": that collective's in-place times
PLAN_MARGIN = 0.05  # a plan is chosen only where it is priced this much below native
# A band narrower than this fraction of the size it starts at goes to the band before it: the
# table's sizes double, so two lines that cross twice within a fraction of one step (P = 2
# all-reduce, recorded 2026-12-06: rd from 4079 to 4143 bytes) say nothing the points measured.
MIN_BAND = 1 / 8
DEFAULT_TABLE = Path(__file__).with_name("tuning_cpu.json")
TUNING_ENV = "RINGCOLL_TUNING"


@functools.lru_cache(maxsize=None)
def this_machine() -> str:
    """What a table is recorded for and holds on: the CPU's model (Linux's /proc/cpuinfo,
    with its family and model numbers, which a VM's generic name hides) and the cores."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
            if not line.strip():
                break  # the first processor's block is enough
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return f"{name} x {os.cpu_count()} cores"


@dataclass(frozen=True)
class Table:
    source: str  # the file it was read from
    recorded: dict  # {world: how it was measured (date, torch, command)}
    times_us: dict  # {world: {collective: {algorithm: {bytes: microseconds}}}}
    machine: str = ""  # this_machine() where it was recorded ("": not said; holds anywhere)

    def holds_here(self) -> bool:
        """Whether this machine is the one the table was recorded on (module docstring)."""
        return not self.machine or self.machine == this_machine()

    @functools.cached_property
    def digest(self) -> str:
        """The times' fingerprint: communicators compare it across ranks."""
        canonical = json.dumps(self.times_us, sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def bands(self, collective: str, world: int, exclude: Sequence[str] = (), in_place: bool = False) -> list:
        """``[(from_bytes, algorithm), ...]``, the first from 0: which candidate ``auto`` runs
        from each size on (native where the table has nothing for this world and collective),
        leaving out the algorithms in ``exclude`` (those this communicator cannot run);
        ``in_place``: for in-place calls, by the in-place times where the table has them."""
        by_collective = self.times_us.get(world, {})
        times = by_collective.get(collective + IN_PLACE if in_place and collective + IN_PLACE in by_collective
                                  else collective, {})
        return Bands(lower_envelope({name: t for name, t in times.items() if name not in exclude}))


class Bands(list):
    """Table.bands' answer, ``[(from_bytes, algorithm), ...]``, with the bands' starts kept
    apart for choose's search (building that list on every call cost 0.5 us of a call)."""

    def __init__(self, bands):
        super().__init__(bands)
        self.starts = [start for start, _ in self]


def choose(bands: Sequence[tuple], nbytes: float) -> str:
    """The algorithm ``bands`` (Table.bands, or any list of (from_bytes, algorithm)) gives a
    message of ``nbytes``."""
    if len(bands) == 1:  # one band for every size (no table, or one winner): per call, so no search
        return bands[0][1]
    starts = bands.starts if isinstance(bands, Bands) else [start for start, _ in bands]
    return bands[bisect.bisect_right(starts, nbytes) - 1][1]


def lower_envelope(times: dict) -> list:
    """Where the fastest of ``times`` ({algorithm: {bytes: us}}) changes as the message
    grows, each algorithm priced by its band lines (module docstring): ``[(from_bytes,
    algorithm), ...]``, the first from 0. Only the sizes every algorithm was timed at count."""
    names = sorted(times, key=lambda name: name != NATIVE)  # native first: it wins ties
    sizes = sorted(set.intersection(*(set(t) for t in times.values()))) if times else []
    if not sizes:
        return [(0, NATIVE)]

    def line(name: str, band: int) -> tuple:
        """(time at 0, us per byte) of `name` in `band` (between sizes[band] and the next),
        a plan's raised by the margin."""
        weight = 1.0 if name == NATIVE else 1.0 + PLAN_MARGIN
        if len(sizes) == 1:
            return times[name][sizes[0]] * weight, 0.0
        lo, hi = sizes[band], sizes[band + 1]
        per_byte = (times[name][hi] - times[name][lo]) / (hi - lo)
        return (times[name][lo] - per_byte * lo) * weight, per_byte * weight

    def band_of(n: float) -> int:
        return min(max(bisect.bisect_left(sizes, n) - 1, 0), max(len(sizes) - 2, 0))

    def cost(name: str, n: float) -> float:
        if n > sizes[-1]:
            return cost(name, sizes[-1]) * n / sizes[-1]
        at_zero, per_byte = line(name, band_of(n))
        return at_zero + per_byte * max(n, sizes[0])  # below the first size: its time there

    def fastest(n: float) -> str:
        return min(names, key=lambda name: cost(name, n))

    # Within a band the fastest changes only where two lines cross: cut there, and at
    # every recorded size.
    cuts = {0.0, *map(float, sizes)}
    for band in range(max(len(sizes) - 1, 1)):
        lines = {name: line(name, band) for name in names}
        cuts.update(crossings(lines, sizes[band], sizes[min(band + 1, len(sizes) - 1)]))
    return without_slivers([(math.ceil(start), name) for start, name in fastest_between(cuts, fastest)])


def without_slivers(bands: list) -> list:
    """``bands`` with every band narrower than MIN_BAND of its start given to the band before
    it (the first, from 0, stays), runs of one name merged."""
    kept: list = []
    for i, (start, name) in enumerate(bands):
        end = bands[i + 1][0] if i + 1 < len(bands) else math.inf
        if kept and end - start < MIN_BAND * start:
            continue
        if not kept or kept[-1][1] != name:
            kept.append((start, name))
    return kept


def crossings(lines: dict, lo: float = 0.0, hi: float = math.inf) -> set:
    """The sizes in (lo, hi) where two of ``lines`` ({name: (time at 0, time per byte)}) cross."""
    return {(b0 - a0) / (a1 - b1) for a0, a1 in lines.values() for b0, b1 in lines.values()
            if a1 > b1 and lo < (b0 - a0) / (a1 - b1) < hi}


def fastest_between(cuts, fastest) -> list:
    """``[(from, name), ...]``: ``fastest(n)`` taken in the middle of each piece between the
    sorted ``cuts`` (0 among them; past the last, at twice it), runs of one name merged. The
    lower envelope of lines only changes at a cut where two cross (``crossings``)."""
    edges = sorted(cuts)
    out: list = []
    for i, start in enumerate(edges):
        end = edges[i + 1] if i + 1 < len(edges) else start * 2 + 1.0
        best = fastest((start + end) / 2)
        if not out or out[-1][1] != best:
            out.append((start, best))
    return out


def candidates(collective: str) -> list:
    """What auto weighs for ``collective``: native and the built-in plans that have it."""
    from ringcoll import plans

    return [NATIVE, *(name for name in plans.builtin_algorithms(collective) if name in plans.BUILTIN)]


def _read(path: str) -> Table:
    try:
        data = json.loads(Path(path).read_text())
        times = {int(world): {collective: {name: {int(n): float(t) for n, t in points.items()}
                                          for name, points in by_name.items()}
                              for collective, by_name in by_collective.items()}
                 for world, by_collective in data["times_us"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{TUNING_ENV}: cannot read a tuning table from {path!r} ({type(e).__name__}: {e}); "
                         "ringcoll-bench --record-tuning writes one") from None
    for world, by_collective in times.items():
        for key, by_name in by_collective.items():
            collective = key.removesuffix(IN_PLACE)
            if collective not in DATA_COLLECTIVES:
                raise ValueError(f"{TUNING_ENV}: the table {path!r} names {key!r}, not a collective (or one "
                                 f"with '{IN_PLACE.strip()}' after it)")
            weighed = candidates(collective)
            strangers = sorted(set(by_name) - set(weighed))
            if strangers:
                raise ValueError(f"{TUNING_ENV}: the table {path!r} prices {', '.join(strangers)} for {collective} "
                                 f"at P = {world}: auto weighs only {', '.join(weighed)}")
    return Table(str(path), {int(w): str(how) for w, how in data.get("recorded", {}).items()}, times,
                 str(data.get("machine", "")))


@functools.lru_cache(maxsize=None)
def _load(path: str) -> Table:
    return _read(path)


def load(path: Optional[str] = None) -> Table:
    """The table ``auto`` reads: ``path``, else ``RINGCOLL_TUNING``, else the shipped one
    (read once per file)."""
    return _load(str(path or os.environ.get(TUNING_ENV) or DEFAULT_TABLE))


def record(path: str, world: int, times_us: dict, recorded: str, machine: Optional[str] = None) -> Table:
    """Write ``times_us`` ({collective: {algorithm: {bytes: us}}}, native among them) into
    the table at ``path`` for ``world``, measured on ``machine`` (default: this one): each
    time replaces the one recorded for the same (collective, algorithm, size), every other
    entry stays. So a sweep can be refined by a longer run over the sizes where candidates
    are close; a fresh table starts from no file. Times of two machines never mix in one
    table (ValueError naming both)."""
    machine = machine or this_machine()
    old = _read(path) if Path(path).exists() else Table(str(path), {}, {}, machine)
    if old.machine and old.machine != machine:
        raise ValueError(f"record: the table at {path!r} was recorded on {old.machine}; this is {machine}: record "
                         "into a fresh file (a table holds for one machine)")
    merged = {c: {name: dict(points) for name, points in by_name.items()}
              for c, by_name in old.times_us.get(world, {}).items()}
    for c, by_name in times_us.items():
        for name, points in by_name.items():
            merged.setdefault(c, {}).setdefault(name, {}).update(points)
    missing = [c for c, by_name in merged.items() if NATIVE not in by_name]
    if missing:
        raise ValueError(f"record: the table needs {NATIVE!r} times for {', '.join(missing)} (auto weighs the plans "
                         "against it)")
    how = f"{old.recorded[world]}; then {recorded}" if world in old.recorded else recorded
    notes, existing = {**old.recorded, world: how}, {**old.times_us, world: merged}
    data = {"machine": machine, "recorded": {str(w): how for w, how in sorted(notes.items())},
            "times_us": {str(w): {c: {name: {str(n): round(t, 2) for n, t in sorted(points.items())}
                                      for name, points in by_name.items()}
                                  for c, by_name in by_collective.items()}
                         for w, by_collective in sorted(existing.items())}}
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    _load.cache_clear()
    return _read(path)
