"""Ranks that cannot share memory (two "hosts"): a clear error at once, not a timeout.

Two hosts are simulated on this machine: ranks of the second host enter a mount namespace
of their own (unshare CLONE_NEWNS) and mount one directory over /dev/shm, so their shared
memory is not the first host's, as on two machines. Needs root (CI runs as root); where the
namespace cannot be made the test fails saying so, it does not skip.
"""

from __future__ import annotations

import ctypes
import os
import time

import torch
import torch.distributed as dist

from ringcoll.harness.launcher import spawn

CLONE_NEWNS = 0x00020000
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
ENV = {"RINGCOLL_TIMEOUT": "60"}  # a wait for a segment that never appears would take this long


def _enter_second_host(shm_dir: str) -> None:
    """This process's /dev/shm becomes `shm_dir`, in a mount namespace of its own."""
    libc = ctypes.CDLL(None, use_errno=True)
    steps = [("unshare", lambda: libc.unshare(CLONE_NEWNS)),
             ("make / private", lambda: libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)),
             ("bind /dev/shm", lambda: libc.mount(shm_dir.encode(), b"/dev/shm", None, MS_BIND, None))]
    for what, step in steps:
        if step() != 0:
            raise OSError(ctypes.get_errno(), f"cannot simulate a second host ({what}; needs root): "
                          + os.strerror(ctypes.get_errno()))


def _two_hosts(rank, world, shm_dir):
    import ringcoll
    from ringcoll.training.hierarchical import HierarchicalCommunicator
    from ringcoll.transports.host import shared_memory_domain

    if rank >= world // 2:
        _enter_second_host(shm_dir)
    out = {"domain": shared_memory_domain()}
    started = time.monotonic()
    try:
        ringcoll.Communicator()
        out["direct"] = ("no error", "")
    except ringcoll.RingcollError as e:
        out["direct"] = (type(e).__name__, str(e))
    out["direct_seconds"] = time.monotonic() - started
    # What the error suggests: the ring inside each host, gloo between them, against gloo
    # over all ranks. (The launcher sets LOCAL_WORLD_SIZE, so the node is named here.)
    x = torch.arange(10, dtype=torch.float64) * (rank + 1)
    with HierarchicalCommunicator(node_id=shared_memory_domain(), buffer_bytes=4096) as h:
        ours = x.clone()
        h.all_reduce(ours)
        out["hierarchical_nodes"] = h.num_nodes
    ref = x.clone()
    dist.all_reduce(ref)
    out["hierarchical_equal"] = torch.equal(ours, ref)
    return out


def test_ranks_on_two_hosts_get_a_clear_error_at_once(tmp_path):
    shm_dir = tmp_path / "second-host-shm"
    shm_dir.mkdir()
    results = spawn(_two_hosts, 4, str(shm_dir), timeout=120, env=ENV)
    domains = [r["domain"] for r in results]
    assert domains[0] == domains[1] != domains[2] == domains[3], domains
    for rank, r in enumerate(results):
        kind, message = r["direct"]
        assert kind == "RingcollError", (rank, kind, message)
        assert "ranks 0, 1 on" in message and "ranks 2, 3 on" in message, message
        assert "HierarchicalCommunicator" in message, message
        assert r["direct_seconds"] < 10, r["direct_seconds"]  # not the 60 s timeout
        assert r["hierarchical_nodes"] == 2 and r["hierarchical_equal"], r
    assert not list(shm_dir.iterdir())  # nothing created, nothing left


def _backend_over(rank, world, shm_dir, second_host):
    """A "ringcoll" group made after this rank took its place (host 1 if rank in second_host)."""
    if rank in second_host:
        _enter_second_host(shm_dir)
    started = time.monotonic()
    try:
        dist.new_group(backend="ringcoll")
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        return type(e).__name__, str(e), time.monotonic() - started
    return "no error", "", time.monotonic() - started


def test_backend_over_uneven_hosts_is_refused_at_init_saying_what_to_do(tmp_path):
    shm_dir = tmp_path / "second-host-shm"
    shm_dir.mkdir()
    for kind, message, seconds in spawn(_backend_over, 4, str(shm_dir), (3,), timeout=120, env=ENV):
        assert kind == "RingcollError", (kind, message)
        assert "every node needs the same number of ranks" in message and "ranks 0, 1, 2" in message, message
        assert "--nproc-per-node" in message, message
        assert seconds < 10, seconds


def test_hierarchical_node_defaults_to_the_shared_memory_domain(monkeypatch):
    from ringcoll.training.hierarchical import _node_of
    from ringcoll.transports.host import shared_memory_domain

    monkeypatch.delenv("RINGCOLL_NODE_ID", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _node_of(None, 3) == shared_memory_domain()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _node_of(None, 3) == 1
    assert _node_of("given", 3) == "given"


def _on_a_small_dev_shm(rank, world, shm_dir):
    """Both ranks on one /dev/shm of 4 MiB (a tmpfs, as a container's is): the transport's
    own segment of 64 MiB, then a symmetric tensor of 16 MiB after a transport that fits."""
    import ringcoll

    _enter_second_host(shm_dir)  # every rank: the small tmpfs is this "host's" /dev/shm
    outcomes = []
    for attempt in ("buffer", "symmetric"):
        try:
            if attempt == "buffer":
                ringcoll.Communicator(buffer_bytes=64 << 20).close()
            else:
                with ringcoll.Communicator(buffer_bytes=64 << 10) as comm:
                    comm.empty((4 << 20,), dtype=torch.float32).fill_(1.0)
            outcomes.append(("no error", ""))
        except ringcoll.RingcollError as e:
            outcomes.append((type(e).__name__, str(e)))
    return outcomes


def test_a_dev_shm_too_small_is_a_clear_error_not_sigbus(tmp_path):
    """Segments were only sized (ftruncate): pages the tmpfs could not supply killed both
    ranks with SIGBUS at the first write, with no Python error. Now they are allocated when
    made (posix_fallocate): RingcollError saying how much room /dev/shm has, nothing left."""
    import subprocess

    shm_dir = tmp_path / "small-shm"
    shm_dir.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "ringcoll-small-shm", str(shm_dir)], check=True)
    try:
        results = spawn(_on_a_small_dev_shm, 2, str(shm_dir), timeout=120, env=ENV)
        left = list(shm_dir.iterdir())
    finally:
        subprocess.run(["umount", str(shm_dir)], check=True)
    for outcomes in results:
        assert [kind for kind, _ in outcomes] == ["RingcollError"] * 2, outcomes
        for _, message in outcomes:
            assert "No space left on device (/dev/shm has" in message and "of 4 MiB free" in message, message
    assert not left, left  # nothing left behind


def _one_rank_cannot_make_its_arena(rank, world):
    """Rank 1 may not make a file over 32 MiB (RLIMIT_FSIZE, as a quota would), so its part of
    a symmetric arena (64 MiB) fails to be made; rank 0's is made, and it waits for rank 1's."""
    import resource
    import signal

    import ringcoll

    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the limit then fails the call (EFBIG) instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 20, resource.RLIM_INFINITY))
    started = time.monotonic()
    try:
        with ringcoll.Communicator(buffer_bytes=64 << 10) as comm:
            comm.empty((1 << 20,), dtype=torch.float32)
        return "no error", "", time.monotonic() - started
    except ringcoll.RingcollError as e:
        return type(e).__name__, str(e), time.monotonic() - started


def test_a_rank_that_cannot_make_its_arena_stops_its_peer_at_once():
    """The rank whose segment cannot be made raises; its peer is told at once (the failing
    rank breaks and sets `aborted`), not after its 60 s timeout: the error had not gone
    through fail(), so the peer waited for a segment that never came (a review found it)."""
    (kind0, message0, seconds0), (kind1, message1, seconds1) = spawn(_one_rank_cannot_make_its_arena, 2,
                                                                      timeout=120, env=ENV)
    assert kind1 == "RingcollError" and "File too large" in message1, (kind1, message1)
    assert kind0 == "RingcollPeerError" and "rank 1" in message0, (kind0, message0)
    assert seconds0 < 15 and seconds1 < 15, (seconds0, seconds1)  # not the 60 s timeout
