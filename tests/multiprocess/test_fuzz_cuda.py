"""Tier 2, fuzzed, the CUDA half: hypothesis draws collective calls (world 1-5, every
collective, dtype, op, size up to a few small buffers, in place, async, the algorithm: the
ring kernels or a plan on the plan kernels, the kernel variant, symmetric memory; plain,
repeated, prepared or coalesced) and runs each on the emulated CUDA transport (the kernels'
own code on CPU threads), ranks as threads of this process, against a plain reference.

This is the quick profile (derandomized, no example database); the long one is
``python -m ringcoll.harness.fuzz_cuda --examples 5000`` (bench/results/*-fuzz-emulated-cuda.txt).
The machinery lives in ringcoll/harness/fuzz_cuda.py (its pool) and fuzz.py (cases, inputs,
checks); their module docs say how cases are built and checked.
"""

from __future__ import annotations

import pytest

from ringcoll import plans
from ringcoll.harness import fuzz, fuzz_cuda

pytest.importorskip("hypothesis")

QUICK_EXAMPLES = 1000  # ~10 ms each on 2 cores


@pytest.fixture(scope="module")
def pool():
    with fuzz_cuda.EmulatedPool() as p:
        yield p
    assert not p.running and p.close_errors == []


def _case(**overrides) -> dict:
    """fuzz.example_case on this pool: the default group of its world, a buffer of slots that
    do not divide it, the naive kernels."""
    return fuzz.example_case(**{"group": "default", "ranks": (0, 1, 2), "buffer_bytes": 1500, "variant": "naive",
                                **overrides})


def test_fuzz_quick(pool):
    stats = fuzz_cuda.fuzz_emulated(pool, QUICK_EXAMPLES, derandomize=True)
    assert stats.failures == []
    assert stats.examples >= QUICK_EXAMPLES
    # The draw reaches every collective, dtype, world size, form, kernel variant and algorithm
    # (auto, native: the ring kernels, and every built-in plan: the plan kernels)
    assert stats.unreached() == {}
    assert set(stats.by["variant"]) == {"fused", "naive"}
    assert set(stats.by["algorithm"]) == {"auto", "native", *plans.BUILTIN}, stats.by["algorithm"]
    assert stats.by["in_flight"][True] > 0 and stats.by["async_op"][True] > 0
    assert stats.by["symmetric"][True] > 0 and stats.by["symmetric"][False] > 0
    assert stats.by["size"]["0 elements"] > 0 and stats.by["size"][">= 4 slices"] > 0
    assert stats.by["size"]["message > buffer"] > 0
    assert "group" not in stats.by and "api" not in stats.by  # fixed here: one group, the Communicator


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather_into_tensor", "broadcast"])
def test_wrong_value_is_caught(pool, collective):
    """The checks are live: one rank's result with one bit flipped fails against the plain
    reference and the other ranks' bits, and the pool is kept (every rank finished the call)."""
    case = _case(collective=collective, op="SUM" if collective == "all_reduce" else None,
                 in_place=collective == "broadcast", corrupt_rank=2)
    replies = pool.run(case)
    assert [r[0] for r in replies] == ["ok", "ok", "fail"], replies
    text = "\n".join(fuzz.check_replies(case, replies))
    assert "rank 2 (group rank 2): result vs plain reference" in text, text
    assert "results differ bitwise between ranks" in text
    with pytest.raises(AssertionError, match="corrupt_rank=2"):
        fuzz.run_case(pool, case)
    assert pool.running
    assert fuzz.check_replies(_case(), pool.run(_case())) == []


@pytest.mark.parametrize("form, collective, extra", [
    ("repeated", "all_reduce", {"async_op": True, "in_flight": True}),
    ("prepared", "reduce_scatter_tensor", {"symmetric": True}),
    ("coalesced", "all_gather_into_tensor", {"more_counts": (0, 40)}),
])
def test_wrong_value_in_a_later_part_is_caught(pool, form, collective, extra):
    """A repeated or prepared call's second run, and a coalesced call's last tensor, are
    checked as a plain call is: one bit flipped there fails, named by its part."""
    case = _case(form=form, collective=collective, op=None if collective == "all_gather_into_tensor" else "SUM",
                 corrupt_rank=1, **extra)
    assert fuzz.check_replies({**case, "corrupt_rank": None}, pool.run({**case, "corrupt_rank": None})) == []
    replies = pool.run(case)
    assert [r[0] for r in replies] == ["ok", "fail", "ok"], replies
    last = "call 2 of 2: " if form != "coalesced" else "tensor 3 of 3: "
    text = "\n".join(fuzz.check_replies(case, replies))
    assert f"rank 1 (group rank 1): {last}result vs plain reference" in text, text


def test_a_rank_error_tears_every_world_down(pool):
    """A case in which ranks raise fails naming the case and the error; every world is torn
    down (their threads gone), and the next case runs on fresh ones."""
    pool.run(_case(world=2, ranks=(0, 1)))
    worlds = list(pool.worlds.values())
    with pytest.raises(AssertionError, match="(?s)algorithm=.no-such-plan.*ValueError: all_reduce: unknown algorithm"):
        fuzz.run_case(pool, _case(algorithm="no-such-plan"))
    assert not pool.running
    assert all(not w.host.is_alive() for w in worlds)
    assert fuzz.check_replies(_case(), pool.run(_case())) == []


def test_a_hung_case_fails_naming_it(pool):
    """A case that outlasts the case timeout raises PoolError naming it, instead of hanging
    the run; every world is torn down and the next case starts fresh ones."""
    saved, pool.case_timeout = pool.case_timeout, 0.5
    try:
        with pytest.raises(fuzz.PoolError, match=r"timeout after 0.5 s running case .*_sleep.*rank\(s\) \[0, 1, 2\]"):
            pool.run({"collective": "_sleep", "seconds": 2, "world": 3, "ranks": (0, 1, 2)})
    finally:
        pool.case_timeout = saved
    assert not pool.running
    assert fuzz.check_replies(_case(), pool.run(_case())) == []
