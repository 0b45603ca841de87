"""PyTorch's own distributed test suite, run on one backend: the driver of the conformance tier.

The torch wheel ships ``torch/testing/_internal/distributed/distributed_test.py``: the class
``DistributedTest._DistTestBase``, the tests PyTorch runs on gloo, NCCL and MPI. PyTorch's
driver for it (``test/distributed/test_distributed_spawn.py``, in PyTorch's repository, not
in the wheel) mixes it into ``TestDistBackend`` (a ``MultiProcessTestCase``: one process per
rank, each calls ``init_process_group(backend=BACKEND)`` on a ``file://`` store) and starts
the ranks with ``spawn``. This driver does the same, with three differences:

* The ranks are started with ``fork``: a spawned rank imports torch and the test module
  again (seconds per rank per test); a forked one starts at once. CPU only, so fork is safe.

* The tests see the backend as "gloo"; only ``init_process_group`` is given the backend
  under test. ``distributed_test`` reads its global ``BACKEND`` at import time for its skip
  decorators (``@require_backend_is_available({"gloo"})``, ``BACKEND != "gloo"``, ``BACKEND
  not in DistTestCases.backend_feature["ddp"]``, ...): an unknown name such as "ringcoll"
  would skip about a hundred CPU tests, all the DDP ones among them. Some test bodies read
  it again at run time to choose their set-up (``_test_accumulate_gradients_no_sync``: ``if
  BACKEND == "mpi" or BACKEND == "gloo"``, else nothing is built). So the module is imported
  with ``BACKEND=gloo``; the global is set to the backend under test in the parent, which
  each forked rank inherits for ``TestDistBackend._run``'s ``init_process_group``; and each
  rank sets it back to "gloo" once its process group exists, before the test body runs.
  The *same* tests then run on both backends, the same way, on different process groups:
  ringcoll is a CPU backend that claims to do what gloo does, so every test gloo passes is
  one it must pass. What this cannot hide: tests that assert the backend's *name*
  (``test_get_backend``) or that torch itself restricts to gloo by name
  (``monitored_barrier``); ``test_torch_suite.py`` lists them.

* Results go to a JSON file (test name -> "pass" / "fail" / "skip", plus seconds), which
  ``test_torch_suite.py`` compares between gloo and ringcoll.

By hand, from the repository root (ringcoll built or installed)::

    python tests/conformance/dist_suite.py --backend ringcoll --world-size 3 \
        --tests test_all_reduce_sum,test_barrier --report /tmp/ringcoll.json -v

``--tests`` takes names of ``_DistTestBase`` methods (comma-separated), or ``all`` for the
whole suite (285 tests, 80-115 s); without it the driver runs the tier's selection
(``suite_selection.py``). A failing test prints its ranks' tracebacks, as PyTorch's do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def _prepare_environment(world_size: int) -> None:
    """What distributed_test.py and common_distributed.py read at import time."""
    os.environ["BACKEND"] = "gloo"  # the skip decorators are evaluated as for gloo (see above)
    os.environ["WORLD_SIZE"] = str(world_size)
    # TestDistBackend.setUp makes a fresh TEMP_DIR (barrier files, the init file) per test
    # and points this variable at it; until then it only has to name a folder that exists.
    os.environ.setdefault("TEMP_DIR", tempfile.gettempdir())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # A hung test fails after this many seconds instead of common_distributed's 300.
    os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "90")
    os.environ.setdefault("RINGCOLL_TIMEOUT", "60")


def make_test_class(backend: str):
    """The TestCase class: PyTorch's TestDistBackendWithSpawn, forking, for ``backend``."""
    import torch

    import ringcoll  # noqa: F401  registers the "ringcoll" backend with torch.distributed
    from torch.testing._internal.distributed import distributed_test

    distributed_test.BACKEND = backend  # inherited by the forked ranks: init_process_group's backend

    base = distributed_test.DistributedTest._DistTestBase

    class TestDistBackendWithFork(distributed_test.TestDistBackend, base):
        def setUp(self):
            super().setUp()
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

        def run_test(self, test_name, parent_pipe):
            """In a rank, after init_process_group(BACKEND) and before the test body."""
            distributed_test.BACKEND = "gloo"  # the body's own name checks: as for gloo (module doc)
            super().run_test(test_name, parent_pipe)  # exits the process unless the test passed
            _save_call_counts(test_name, self.rank)

    TestDistBackendWithFork.__name__ = TestDistBackendWithFork.__qualname__ = f"TestDistBackendWithFork_{backend}"
    return TestDistBackendWithFork


def _save_call_counts(test_name: str, rank: int) -> None:
    """Rank ``rank``'s ringcoll.training.backend.call_counts after a passing test, to
    $RINGCOLL_CONF_COUNTS/<test>.<rank>.json: proof that the ring, not only gloo, ran."""
    folder = os.environ.get("RINGCOLL_CONF_COUNTS")
    if folder:
        from ringcoll.training.backend import call_counts

        with open(os.path.join(folder, f"{test_name}.{rank}.json"), "w") as f:
            json.dump(dict(call_counts), f)


class _Recorder(unittest.TextTestResult):
    """unittest's text result, also keeping test name -> (outcome, seconds)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes: dict = {}
        self._started = 0.0

    def startTest(self, test):
        self._started = time.monotonic()
        super().startTest(test)

    def _record(self, test, outcome):
        name = test.id().rsplit(".", 1)[-1]
        self.outcomes[name] = {"outcome": outcome, "seconds": round(time.monotonic() - self._started, 2)}

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test, "pass")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "fail")

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "fail")

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skip")

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._record(test, "pass")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._record(test, "fail")


def run(backend: str, world_size: int, tests: list, verbosity: int = 1) -> dict:
    """Run ``tests`` (method names) on ``backend`` at ``world_size``; name -> outcome record."""
    _prepare_environment(world_size)
    cls = make_test_class(backend)
    if tests == ["all"]:
        tests = sorted(name for name in dir(cls) if name.startswith("test_"))
    suite = unittest.TestSuite(cls(name) for name in tests)
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=verbosity, resultclass=_Recorder)
    result = runner.run(suite)
    return result.outcomes


def main(argv=None) -> int:
    sys.path.insert(0, HERE)
    from suite_selection import SELECTION

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", required=True, help='"gloo" or "ringcoll"')
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--tests", help="comma-separated _DistTestBase method names (default: the selection)")
    parser.add_argument("--report", help="write name -> outcome as JSON here")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    tests = args.tests.split(",") if args.tests else list(SELECTION)
    started = time.monotonic()
    outcomes = run(args.backend, args.world_size, tests, verbosity=2 if args.verbose else 1)
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"backend": args.backend, "world_size": args.world_size,
                       "seconds": round(time.monotonic() - started, 1), "tests": outcomes}, f, indent=1)
    # Exit 0 whatever the outcomes: the comparison with gloo, not this run, decides.
    return 0 if len(outcomes) == len(tests) or tests == ["all"] else 1


if __name__ == "__main__":
    sys.exit(main())
