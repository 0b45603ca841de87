"""The conformance tier: PyTorch's own DistributedTest suite on gloo and on ringcoll.

torch ships the tests it runs for its own backends (``DistributedTest._DistTestBase`` in
``torch/testing/_internal/distributed/distributed_test.py``). This tier runs a selection of
them (``suite_selection.py``: every test that reaches ringcoll's code, plus samples of what
the backend forwards to gloo) on CPU at world sizes 2 and 3, once with ``backend="gloo"`` and
once with ``backend="ringcoll"``, each in a subprocess running ``dist_suite.py`` (the
driver: why it forks and how the tests see the backend, in its docstring). Then:

* every test gloo passes must pass on ringcoll, unless it is in :data:`EXCEPTIONS` (tests
  of the backend's *name*, which no other backend can pass);
* every selected test must pass on gloo (a selection that silently skips tests every
  backend skips would check nothing: a new torch that skips more makes this fail);
* every exception in the selection must still fail on ringcoll (else it is stale);
* the ranks' ``call_counts`` show the ring itself ran (not only the forwarded gloo calls).

Measured on the project's 2-core machine, with other jobs running: the four suite runs
took 100-130 s one world size after the other (world 2: 41-56 s, world 3: 60-77 s, gloo and
ringcoll side by side), the FSDP2 check beside them (``test_fsdp2.py``) 22-40 s; the whole
tier 128 s at load average 2, 177 s at 13-15. Quiet, on the AMD VM of 2026-12-07: 66 s one
world size after the other, 53 s with all four started at once (``started``).

By hand, one run (a test name, or several with commas, or the whole selection)::

    PYTHONPATH=. python tests/conformance/dist_suite.py --backend ringcoll --world-size 2 \
        --tests test_all_gather -v

and this tier: ``pytest -q tests/conformance``.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from suite_selection import SELECTION  # noqa: E402

#: Tests gloo passes and ringcoll cannot, because they are about the backend's name.
EXCEPTIONS = {
    # Asserts dist.get_backend() == BACKEND. The driver shows the tests the name "gloo" (so
    # that they run as they do for gloo); ringcoll's process group truthfully says "ringcoll".
    "test_get_backend": "asserts the backend's name is 'gloo'",
    # torch's monitored_barrier raises "monitored_barrier is only implemented for GLOO
    # backend" for any group whose backend is not named gloo (NCCL too). Not in the
    # selection; listed for a by-hand run of the whole suite.
    "test_monitored_barrier_gloo": "monitored_barrier: torch refuses non-gloo backends by name",
    "test_monitored_barrier_gloo_subgroup": "monitored_barrier: torch refuses non-gloo backends by name",
}

#: A test per ring collective, and the call_counts route it must have taken on rank 0.
RING_ROUTES = {
    "test_all_reduce_sum": "ringcoll:all_reduce",
    "test_all_reduce_coalesced_sum": "ringcoll:all_reduce_coalesced",
    "test_all_gather": "ringcoll:all_gather",
    "test_barrier": "ringcoll:barrier",
    "test_DistributedDataParallelCPU": "ringcoll:all_reduce",  # DDP's buckets, from C++
}

WORLD_SIZES = [2, 3]
RUN_TIMEOUT = 300  # seconds for one (backend, world size) run; the driver times out hung tests at 90 s


def _start(backend: str, world_size: int, out_dir: str) -> tuple:
    counts = os.path.join(out_dir, f"counts-{backend}-{world_size}")
    os.makedirs(counts)
    report = os.path.join(out_dir, f"{backend}-{world_size}.json")
    log = open(os.path.join(out_dir, f"{backend}-{world_size}.log"), "w")
    env = dict(os.environ, RINGCOLL_CONF_COUNTS=counts,
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "dist_suite.py"), "--backend", backend,
                             "--world-size", str(world_size), "--report", report, "-v"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, report, log, counts


def _finish(proc, report: str, log, counts: str) -> dict:
    try:
        proc.wait(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()
    with open(log.name) as f:
        output = f.read()
    assert proc.returncode == 0 and os.path.exists(report), \
        f"the driver failed (exit {proc.returncode}):\n{output[-6000:]}"
    with open(report) as f:
        result = json.load(f)
    result["log"] = output
    result["counts"] = collections.defaultdict(collections.Counter)
    for name in os.listdir(counts):
        test, rank, _ = name.rsplit(".", 2)
        if rank == "0":
            with open(os.path.join(counts, name)) as f:
                result["counts"][test].update(json.load(f))
    return result


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """Every run, gloo's and ringcoll's at every world size, started at once: the tests
    mostly wait on sockets and the suite's 0.1 s file barrier (one world size after the
    other took 66 s of CI, side by side ~40)."""
    out_dir = str(tmp_path_factory.mktemp("conformance"))
    return {ws: {backend: _start(backend, ws, out_dir) for backend in ("gloo", "ringcoll")} for ws in WORLD_SIZES}


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda ws: f"world{ws}")
def runs(request, started):
    """{backend: the driver's report} for one world size."""
    ws = request.param
    return ws, {backend: _finish(*handles) for backend, handles in started[ws].items()}


def _failure_text(log: str, test: str) -> str:
    """unittest's ERROR/FAIL block for ``test`` (the ranks' tracebacks), from a run's log."""
    match = re.search(rf"^(ERROR|FAIL): {test} .*?(?=^=====|^-----\nRan |\Z)", log, re.S | re.M)
    return match.group(0)[-4000:] if match else "(no traceback in the log)"


def test_ringcoll_passes_every_test_gloo_passes(runs):
    ws, by_backend = runs
    gloo, ours = by_backend["gloo"]["tests"], by_backend["ringcoll"]["tests"]
    missing = [t for t in SELECTION if gloo[t]["outcome"] == "pass" and ours[t]["outcome"] != "pass"
               and t not in EXCEPTIONS]
    assert not missing, (f"world {ws}: ringcoll fails {len(missing)} test(s) gloo passes: {missing}\n\n"
                         + "\n\n".join(_failure_text(by_backend["ringcoll"]["log"], t) for t in missing))


def test_every_selected_test_passes_on_gloo(runs):
    ws, by_backend = runs
    gloo = by_backend["gloo"]["tests"]
    assert sorted(gloo) == sorted(SELECTION)
    not_passing = {t: gloo[t]["outcome"] for t in SELECTION if gloo[t]["outcome"] != "pass"}
    assert not not_passing, f"world {ws}: the selection has tests gloo does not pass: {not_passing}"


def test_exceptions_are_still_needed(runs):
    ws, by_backend = runs
    passing = [t for t in EXCEPTIONS if by_backend["ringcoll"]["tests"].get(t, {}).get("outcome") == "pass"]
    assert not passing, f"world {ws}: {passing} now pass on ringcoll: remove them from EXCEPTIONS"


def test_the_ring_ran(runs):
    ws, by_backend = runs
    counts = by_backend["ringcoll"]["counts"]
    for test, route in RING_ROUTES.items():
        assert counts[test][route] > 0, f"world {ws}: {test} never reached {route}: {dict(counts[test])}"
    assert not any(by_backend["gloo"]["counts"][t] for t in SELECTION), "the gloo runs touched ringcoll"
