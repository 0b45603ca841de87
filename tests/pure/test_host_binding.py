"""HostComm.run: the one binding call the CPU transport makes per collective, fed the whole
CollectiveCall record (transports/base.py). One rank: every collective is a copy, so this
needs no peers."""

from __future__ import annotations

import pytest
import torch

from ringcoll import _C
from ringcoll._types import DTYPE_CODES
from ringcoll.transports.base import CollectiveCall

F32 = DTYPE_CODES[torch.float32]


@pytest.fixture
def comm():
    c = _C.HostComm(0, 1, [_C.random_segment_name()], 64 * 1024, 5.0)
    yield c
    c.close()


@pytest.mark.parametrize("collective, op", [("all_reduce", 0), ("reduce_scatter", 0), ("all_gather", None)])
def test_run_takes_the_whole_call_record(comm, collective, op):
    src, dst = torch.arange(7, dtype=torch.float32), torch.zeros(7)
    comm.run(*CollectiveCall(collective, src.data_ptr(), dst.data_ptr(), 7, F32, op))
    assert torch.equal(dst, src)


@pytest.mark.parametrize("collective, op, message", [("all_scatter", 0, "unknown collective all_scatter"),
                                                     ("all_reduce", None, "all_reduce: a reduction needs an op")])
def test_run_refuses_what_is_not_a_collective_before_writing(comm, collective, op, message):
    src, dst = torch.ones(3), torch.zeros(3)
    with pytest.raises(ValueError, match=message):
        comm.run(collective, src.data_ptr(), dst.data_ptr(), 3, F32, op)
    assert torch.equal(dst, torch.zeros(3))


def test_a_wait_reports_a_publication_made_just_before_the_peer_aborted():
    """A peer's abort is stored after everything it published, so a wait that sees the abort
    reads its flag once more before giving up (flags.h, wait_flag_at_least): otherwise a
    peer's last announcement (say, of a mismatched call) would be lost to a race and the
    waiter would report the abort instead of what the peer said."""
    assert _C.wait_for_a_publication_before_an_abort() == "ready"


def test_more_ranks_than_a_plan_addresses_is_refused_before_any_segment_exists():
    """The CPU transport runs every collective on the plan engine (the ring too), whose
    publications name their readers by the bits of one word: a communicator of more ranks is
    refused when it is made, naming the limit, and leaves nothing in /dev/shm."""
    import os

    world = _C.max_plan_world + 1
    names = [_C.random_segment_name() for _ in range(world)]
    with pytest.raises(ValueError, match=f"at most {_C.max_plan_world} ranks on one host, not {world}"):
        _C.HostComm(0, world, names, 64 * 1024 * world, 5.0)
    assert not any(os.path.exists("/dev/shm" + name) for name in names)
    c = _C.HostComm(0, 1, [names[0]], 64 * 1024, 5.0)  # the limit is the world's, not the machine's
    c.close()
