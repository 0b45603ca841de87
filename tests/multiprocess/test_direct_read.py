"""The direct-read all-gather (csrc/host/peer_memory.h, host_comm.cpp): what happens around
the exact results, which test_collectives.py's run_direct_read_cases checks against gloo.

- where a rank may not read its peers (the kernel refuses process_vm_readv), every rank
  learns it at bootstrap, all-gathers go through the slots, and the reason names the ranks;
- a mismatched call moves nothing, as on the other paths (the post is only an address);
- with the call check off, a count mismatch is still caught (the posted byte count);
- direct_bytes and RINGCOLL_DIRECT_MAX_BYTES must agree across ranks; direct_bytes >= 0;
- what a peer reads where it lies (an all-gather's input, an all-reduce's shared output)
  may be overwritten the moment the owner's call returns.
A rank killed mid direct read is test_faults.py's test_rank_killed_mid_collective.
"""

import ctypes

import pytest
import torch

from ringcoll.harness.launcher import spawn, spawn_outcomes

from test_collectives import all_reduce_overwritten_on_return

CAP_SYS_PTRACE = 19
PR_SET_DUMPABLE = 4


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _forbid_peer_reads() -> None:
    """Make this process unreadable by its peers and unable to read them, as on a machine
    where ranks run without CAP_SYS_PTRACE and are not dumpable: drop the capability
    (CI runs as root, which has it) and mark the process not dumpable."""
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3
    assert libc.capget(ctypes.byref(header), data) == 0, ctypes.get_errno()
    data[0].effective &= ~(1 << CAP_SYS_PTRACE)
    data[0].permitted &= ~(1 << CAP_SYS_PTRACE)
    assert libc.capset(ctypes.byref(header), data) == 0, ctypes.get_errno()
    assert libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0, ctypes.get_errno()


def _gathered(world, count, dtype=torch.float32):
    return torch.cat([torch.arange(count, dtype=dtype) + 1000 * r for r in range(world)])


def _probe_denied(rank, world):
    import ringcoll

    _forbid_peer_reads()
    with ringcoll.Communicator(small_bytes=0, direct_bytes=1, timeout=30) as comm:
        results = []
        for count in (1, 1000, 300_001):  # the last past the streaming threshold at P = 3
            out = torch.full((world * count,), -1.0)
            comm.all_gather_into_tensor(out, torch.arange(count, dtype=torch.float32) + 1000 * rank)
            results.append(torch.equal(out, _gathered(world, count)))
        try:  # the direct plan reads peers where they lie too: refused, nothing moved, the communicator whole
            comm.all_gather_into_tensor(out, torch.zeros(300_001), algorithm="direct")
            refused = "no error"
        except ValueError as e:
            refused = str(e)
        results.append(torch.equal(out, _gathered(world, 300_001)))
        return (comm.transport.direct_reads, comm.transport.direct_reads_unavailable, comm.transport.direct_calls,
                results, refused)


def test_ranks_that_may_not_read_each_other_use_the_slots():
    world = 3
    for direct, why, calls, results, refused in spawn(_probe_denied, world, timeout=120):
        assert direct is False and calls == 0, (direct, calls)
        assert all(results), results
        assert refused.startswith("all_gather: this plan reads peers' memory where it lies (process_vm_readv), "
                                  "which this communicator cannot: "), refused
        # Each rank quotes the first failed probe it saw: its own or a peer's.
        assert "cannot read rank" in why and "Operation not permitted" in why, why


def _mismatch_on_direct(rank, world, odd_kind):
    import ringcoll

    with ringcoll.Communicator(small_bytes=0, direct_bytes=1, timeout=20) as comm:
        out = torch.full((world * 65,), -7.0)
        try:
            if rank == 1 and odd_kind == "count":
                comm.all_gather_into_tensor(out[:world * 64], torch.ones(64))
            elif rank == 1 and odd_kind == "collective":
                comm.all_reduce(out)
            else:
                comm.all_gather_into_tensor(out, torch.ones(65))
            return "no error", False
        except ringcoll.RingcollMismatchError as e:
            return str(e), bool((out == -7.0).all())


@pytest.mark.parametrize("odd_kind", ["count", "collective"])
def test_mismatch_on_the_direct_path_moves_nothing(odd_kind):
    for rank, (message, untouched) in enumerate(spawn(_mismatch_on_direct, 3, odd_kind, timeout=120)):
        assert "mismatched collective calls" in message and "no data was moved" in message, (rank, message)
        assert untouched, rank


def _unchecked_count_mismatch(rank, world, algorithm="native"):
    import ringcoll

    with ringcoll.Communicator(small_bytes=0, direct_bytes=1, check=False, timeout=20) as comm:
        count = 64 if rank == 1 else 65
        try:
            comm.all_gather_into_tensor(torch.empty(world * count), torch.ones(count), algorithm=algorithm)
            return "no error"
        except ringcoll.RingcollError as e:
            return type(e).__name__ + ": " + str(e)


@pytest.mark.parametrize("algorithm", ["native", "direct"])
def test_without_the_check_a_count_mismatch_is_caught_by_the_posted_bytes(algorithm):
    """Native's direct read is the direct plan: without the call check, each rank compares
    the size a peer posted with its own before it reads a byte, so neither reads past the
    other's input, and both name the two sizes."""
    messages = spawn(_unchecked_count_mismatch, 2, algorithm, timeout=120)
    for rank, message in enumerate(messages):
        mine, theirs = (260, 256) if rank == 0 else (256, 260)  # 65 and 64 floats
        assert message.startswith("RingcollMismatchError: all_gather: "), message
        assert (f"rank {1 - rank} posted {theirs} bytes of input and {2 * theirs} of output but rank {rank} posted "
                f"{mine} and {2 * mine}") in message, message


def _settings(rank, world, direct_bytes, direct_max=None):
    """A Communicator with this rank's direct_bytes (and RINGCOLL_DIRECT_MAX_BYTES, if given)."""
    import os

    import ringcoll

    if direct_max is not None:
        os.environ["RINGCOLL_DIRECT_MAX_BYTES"] = direct_max[rank]
    try:
        with ringcoll.Communicator(direct_bytes=direct_bytes[rank], timeout=20):
            return "no error"
    except ValueError as e:
        return str(e)


def test_direct_bytes_must_agree_and_be_non_negative():
    for message in spawn(_settings, 2, [1, 0], timeout=60):
        assert "RINGCOLL_DIRECT_BYTES / direct_bytes= differs between ranks: rank 0: 1, rank 1: 0" in message
    for message in spawn(_settings, 2, [None, None], ["1M", "2M"], timeout=60):
        assert "RINGCOLL_DIRECT_MAX_BYTES differs between ranks: rank 0: 1048576, rank 1: 2097152" in message
    outcome, = spawn_outcomes(_settings, 1, [-1], timeout=60)
    assert outcome.value == "Communicator: direct_bytes must be >= 0 (0: never read peers directly), got -1"


def _overwrite_at_once(rank, world):
    """Direct plans, every rank overwriting what its peers read where it lies the instant its
    call returns, the later ranks starting each call later (so the first leaves first if
    nothing holds it): the all-gather's input, the all-reduce's input and shared output."""
    import time

    import ringcoll

    count, torn = 3 << 16, []
    with ringcoll.Communicator(algorithm="direct", timeout=20) as comm:
        for i in range(8):
            x, out = torch.full((count,), float(100 * i + rank)), torch.empty(count)
            gathered = torch.empty(count * world)
            time.sleep(0.002 * rank)
            comm.all_gather_into_tensor(gathered, x)
            x.fill_(-1.0)
            want = (100.0 * i + torch.arange(world, dtype=torch.float32)).repeat_interleave(count)
            if not torch.equal(gathered, want):
                torn.append(f"all_gather call {i}: {int((gathered != want).sum())} wrong")
            wrong = all_reduce_overwritten_on_return(comm, x, out, i, rank, world)
            if wrong:
                torn.append(f"all_reduce call {i}: {wrong} wrong")
        comm.barrier()
    return torn


def test_what_peers_read_where_it_lies_may_be_overwritten_when_the_call_returns():
    """A rank's call returns only once every peer has said it is done reading its input and
    its shared output (plan.h: last_in_place_read_op counts the shared receives too)."""
    torn = sum(spawn(_overwrite_at_once, 3, timeout=120), [])
    assert not torn, "; ".join(torn[:6])
