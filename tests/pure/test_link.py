"""ringcoll's TCP link between machines (ringcoll/training/link.py), two or three "machines"
as threads of this process over the loopback interface: exact bytes, messages larger than
the sockets' buffers both ways at once, several exchanges in flight, the header's check,
a stranger's connection, a peer that goes away and one that goes silent. The link under the
hierarchical communicator, across processes and namespace machines:
tests/multiprocess/test_hierarchical.py and test_two_hosts.py."""

import os
import socket
import threading
import time

import pytest
import torch

from ringcoll.errors import RingcollMismatchError
from ringcoll.training import link as link_module
from ringcoll.training.link import HELLO, LinkFailure, SocketLink


@pytest.fixture(autouse=True)
def _loopback(monkeypatch):
    monkeypatch.setenv("RINGCOLL_SOCKET_IFNAME", "lo")


def _links(machines: int, timeout: float = 10.0, before_connect=None) -> list:
    """One SocketLink per machine, made in threads that share their entries as the
    communicator's all_gather_object would. `before_connect(entries)` runs once every entry
    is known and before any machine connects."""
    entries, links, errors = [], [None] * machines, []
    everyone_shared = threading.Barrier(machines, action=(lambda: before_connect(entries)) if before_connect else None)

    def share(entry):
        entries.append(entry)
        everyone_shared.wait(timeout)
        return list(entries)

    def make(node):
        try:
            links[node] = SocketLink(node, {n: f"machine {n}" for n in range(machines)}, timeout, share)
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=make, args=(n,)) for n in range(machines)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    assert errors == [] and all(links), errors
    return links


def _in_threads(*calls):
    """Run the calls at once, one thread each; what each returned or raised."""
    results = [None] * len(calls)

    def run(i):
        try:
            results[i] = calls[i]()
        except Exception as e:  # noqa: BLE001 -- the result
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def _close(links):
    for link in links:
        link.close()


def test_large_messages_cross_both_ways_at_once_and_in_order():
    """Two machines each send the other 16 MiB (far more than a socket buffers) while
    receiving, and three exchanges are in flight before the first is waited for: every byte
    arrives where it was sent, in order. Waiting for the last drives the earlier ones."""
    links = _links(2)
    sizes = (16 << 20, 1, 3 << 20)

    def machine(node):
        sends = [torch.randint(-1000, 1000, (n // 4 + 1,), generator=torch.Generator().manual_seed(node * 10 + i),
                               dtype=torch.int32) for i, n in enumerate(sizes)]
        received = [torch.empty_like(s) for s in sends]
        waits = [links[node].exchange({1 - node: s}, {1 - node: r}) for s, r in zip(sends, received)]
        waits[-1]()
        waits[0]()  # already moved
        return sends, received

    (sent0, got0), (sent1, got1) = _in_threads(lambda: machine(0), lambda: machine(1))
    for a, b in zip(sent0, got1):
        assert torch.equal(a, b)
    for a, b in zip(sent1, got0):
        assert torch.equal(a, b)
    _close(links)


def test_three_machines_each_address_the_others_by_index():
    links = _links(3)

    def machine(node):
        others = [n for n in range(3) if n != node]
        got = {n: torch.empty(5, dtype=torch.float64) for n in others}
        links[node].exchange({n: torch.full((5,), float(10 * node + n), dtype=torch.float64) for n in others},
                             got)()
        return {n: t[0].item() for n, t in got.items()}

    seen = _in_threads(*(lambda node=node: machine(node) for node in range(3)))
    assert seen == [{1: 10.0, 2: 20.0}, {0: 1.0, 2: 21.0}, {0: 2.0, 1: 12.0}]
    _close(links)


def test_a_message_of_other_bytes_is_a_mismatch_not_garbage():
    """With the call check off, ranks that made different calls send different bytes: the
    header shows it before a byte lands in the tensor, and the link is failed for good."""
    links = _links(2)
    into0, into1 = torch.zeros(1001), torch.zeros(1000)  # as a swap of each rank's own count
    results = _in_threads(lambda: links[0].exchange({1: torch.ones(1001)}, {1: into0})(),
                          lambda: links[1].exchange({0: torch.ones(1000)}, {0: into1})())
    for node, (result, theirs, mine) in enumerate(zip(results, (4000, 4004), (4004, 4000))):
        assert isinstance(result, RingcollMismatchError), result
        assert f"machine {1 - node} sent {theirs} bytes as message 0 where this rank expected {mine} bytes as " \
               "message 0" in str(result), result
        assert "the call check, RINGCOLL_CHECK, is off" in str(result)
    assert not into0.any() and not into1.any()
    with pytest.raises(LinkFailure, match="the link failed earlier: .*expected"):
        links[0].exchange({1: torch.ones(1)}, {1: torch.zeros(1)})
    _close(links)


def test_equal_parts_of_unequal_steps_are_a_mismatch_on_both_sides():
    """A shard of 1001 floats cut in two parts of 501 and 500 and one of 1000 in two of 500:
    node 0 sends node 1 the 500 it expects, so the payload's bytes alone would fail only
    node 0 and leave node 1 waiting for its next message until the timeout. The step's bytes
    in the header fail both at once."""
    links = _links(2, timeout=30)
    into0, into1 = torch.zeros(501), torch.zeros(500)
    start = time.monotonic()
    results = _in_threads(lambda: links[0].exchange({1: torch.ones(500)}, {1: into0}, step_bytes=4004)(),
                          lambda: links[1].exchange({0: torch.ones(500)}, {0: into1}, step_bytes=4000)())
    assert time.monotonic() - start < 5
    assert isinstance(results[1], RingcollMismatchError), results[1]
    assert "machine 0 sent 2000 bytes as message 0 (of a 4004-byte step) where this rank expected 2000 bytes as " \
           "message 0 (of a 4000-byte step)" in str(results[1]), results[1]
    assert isinstance(results[0], RingcollMismatchError), results[0]
    assert not into0.any() and not into1.any()
    _close(links)


def test_a_peer_that_closes_is_heard_at_once():
    links = _links(2, timeout=30)
    links[1].close()
    start = time.monotonic()
    with pytest.raises(LinkFailure, match="machine 1 .*its communicator was closed after an error, or its process "
                                          "ended"):
        links[0].exchange({1: torch.ones(4)}, {1: torch.empty(4)})()
    assert time.monotonic() - start < 5
    _close(links)


def test_a_silent_peer_is_a_timeout_naming_what_is_left():
    links = _links(2, timeout=0.5)
    start = time.monotonic()
    with pytest.raises(LinkFailure, match=r"timed out after 0.5 s with messages still to move \(machine 1: 0 to "
                                          r"send, 1 to receive\)"):
        links[0].exchange({1: torch.ones(4)}, {1: torch.empty(4)})()
    assert 0.5 <= time.monotonic() - start < 3
    _close(links)


def test_a_strangers_connection_is_ignored(monkeypatch):
    """A connection that does not open with the listener's token (a port scan, another job),
    or says nothing, is closed, and the real peer still connects, well within the timeout."""
    strangers = []

    def knock(entries):
        node0 = next(e for e in entries if e[0] == 0)
        for hello in (b"GET / HTTP/1.0\r\n\r\n" + bytes(HELLO.size), HELLO.pack(os.urandom(16), 1), b""):
            s = socket.create_connection((node0[1], node0[2]))
            s.sendall(hello)  # the last says nothing at all: given up after HELLO_SECONDS
            strangers.append(s)

    monkeypatch.setattr(link_module, "HELLO_SECONDS", 0.5)
    start = time.monotonic()
    links = _links(2, timeout=20, before_connect=knock)
    assert time.monotonic() - start < 10
    got = _in_threads(lambda: links[0].exchange({1: torch.ones(3)}, {1: torch.zeros(3)})(),
                      lambda: links[1].exchange({0: torch.ones(3)}, {0: torch.zeros(3)})())
    assert got == [None, None]
    for s in strangers:
        s.settimeout(5)
        try:  # closed by machine 0: an end of file, or a reset where the hello was left unread
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass
        s.close()
    _close(links)


def test_the_address_follows_the_interface_named(monkeypatch):
    assert link_module.local_address() == "127.0.0.1"  # RINGCOLL_SOCKET_IFNAME=lo (_loopback)
    monkeypatch.setenv("RINGCOLL_SOCKET_IFNAME", "nosuch0")
    with pytest.raises(ValueError, match="network interface 'nosuch0' has no IPv4 address"):
        link_module.local_address()
    monkeypatch.delenv("RINGCOLL_SOCKET_IFNAME")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # as gloo is told
    assert link_module.local_address() == "127.0.0.1"


def test_a_peer_never_listening_is_a_timeout_that_says_which_address_to_set():
    with socket.socket() as s:  # a port that was free a moment ago: refused, then still refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(LinkFailure, match=f"timed out connecting to machine 0 at 127.0.0.1:{port} .*name the "
                                          "interface that is in RINGCOLL_SOCKET_IFNAME"):
        SocketLink._dial("127.0.0.1", port, time.monotonic() + 0.3, "machine 0")
    assert time.monotonic() - start < 3


def test_a_forked_child_does_not_keep_its_parents_connections_open():
    """A child of fork() (a DataLoader worker) lets go of the link's sockets, so when the
    parent's side closes (its process dies), the peer still hears it at once, not at the
    timeout, while the child lives on."""
    links = _links(2, timeout=20)
    child = os.fork()
    if child == 0:  # the child of machine 1's process (here both machines' links are in it)
        time.sleep(30)
        os._exit(0)
    try:
        links[1].close()  # the parent's side goes; the child still runs
        start = time.monotonic()
        with pytest.raises(LinkFailure, match="machine 1 .*its communicator was closed after an error, or its "
                                              "process ended"):
            links[0].exchange({1: torch.ones(4)}, {1: torch.empty(4)})()
        assert time.monotonic() - start < 5
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
    _close(links)


def test_a_link_closed_while_a_wait_is_on_ends_that_wait():
    """close() from another thread (a communicator closed while its worker waits): the wait
    ends with an error naming it, not a spin until the timeout."""
    links = _links(2, timeout=20)
    wait = links[0].exchange({1: torch.ones(4)}, {1: torch.empty(4)})
    closer = threading.Timer(0.3, links[0].close)
    closer.start()
    start = time.monotonic()
    with pytest.raises(LinkFailure, match="closed by this rank while in use"):
        wait()
    assert time.monotonic() - start < 5
    _close(links)
