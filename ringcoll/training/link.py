"""ringcoll's own link between machines: plain TCP, one connection from each rank to the
rank of its local index on every other machine (the hierarchical communicator's second
level, ``inter_backend="socket"``, the default for CPU tensors).

Why not gloo's point-to-point calls, which this level used before: on this project's 2-core
VM (2 machines x 2 ranks in network namespaces, the link shaped to 10 Gbit/s each way), a
gloo isend/irecv swap of 80 bytes took 0.5-1.4 ms and one of 512 KiB 1.5-1.7 ms, where the
same swaps on a plain TCP socket took 25-45 us and 0.87 ms (the link's rate, with both
pairs of ranks crossing it). Each gloo message is announced and acknowledged before it
moves, and handed between threads on both sides; a socket is written and read by the
caller. NCCL has its own socket transport for the same reason.

The protocol, per connection, in call order:

    message = header (this connection's message number, the payload's bytes, the step's
              bytes) + payload

Both sides know what they exchange (the call check has compared every rank's call first),
so the header only proves it: a rank that expected other bytes raises RingcollMismatchError
instead of reading garbage (possible only with the check off). The step's bytes are those of
what the payload is a part of (the shard an all-reduce step reduces, say), so that each side
sees a mismatch even where its own payload happens to match: a shard of 1001 elements cut in
two parts of 501 and 500, and one of 1000 in two of 500.

Progress: an exchange starts by pushing its sends as far as the kernel takes them (the
kernel moves them on while the node's ring works on the next piece); the rest, and every
receive, moves when the exchange is waited for: each connection in both directions at once
(poll), so two ranks that send each other more than the socket buffers hold cannot wait on
each other. Every wait is bounded by the communicator's timeout; a peer that dies closes
its sockets (its kernel does), which its partners see at once.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import os
import select
import socket
import struct
import time
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..errors import RingcollMismatchError

HEADER = struct.Struct("<QQQ")  # message number, payload bytes, the step's bytes
HELLO = struct.Struct("<16sQ")  # the acceptor's token (proves the job), the connector's node index
SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
GONE = "its communicator was closed after an error, or its process ended"
HELLO_SECONDS = 5.0  # how long an accepted connection may take to say its hello
POLL_SLICE_SECONDS = 0.1  # the longest a wait sleeps before it looks whether the link was closed


class LinkFailure(RuntimeError):
    """The link failed: a peer closed its connection, or the timeout passed ("timed out" in
    the message). A RuntimeError as gloo's are, so the communicator reports both alike."""


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` (as GLOO_SOCKET_IFNAME names one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as e:
            raise ValueError(f"ringcoll's link: network interface {name!r} has no IPv4 address ({e})") from e
    return socket.inet_ntoa(packed[20:24])


def _store_host() -> Optional[str]:
    """The host the default group's TCPStore listens on, or MASTER_ADDR."""
    if not dist.is_initialized():
        return os.environ.get("MASTER_ADDR")
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return getattr(store, "host", None) or os.environ.get("MASTER_ADDR")


def local_address() -> str:
    """The address this rank's peers on other machines reach it at, chosen as gloo chooses:
    RINGCOLL_SOCKET_IFNAME's (or GLOO_SOCKET_IFNAME's) interface; else the address this
    machine sends from towards the rendezvous store's host (no packet is sent: a UDP socket
    is only routed); else the host name's; else the loopback address (one machine)."""
    name = os.environ.get("RINGCOLL_SOCKET_IFNAME") or os.environ.get("GLOO_SOCKET_IFNAME")
    if name:
        return interface_address(name.split(",")[0])
    host = _store_host()
    if host:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((host, 9))
                return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, written and read in place (a contiguous CPU tensor)."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError(f"ringcoll's link moves contiguous CPU tensors, got {tensor.device} "
                         f"{'' if tensor.is_contiguous() else 'non-contiguous '}{tuple(tensor.shape)}")
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


class _Message:
    """One message on one connection: its header and payload, and how far it has got."""
    __slots__ = ("number", "header", "payload", "moved", "step_bytes")

    def __init__(self, number: int, payload: memoryview, header: bytes, step_bytes: int):
        self.number, self.payload, self.moved, self.step_bytes = number, payload, 0, step_bytes
        self.header = bytearray(header)

    @property
    def size(self) -> int:
        return HEADER.size + len(self.payload)

    @property
    def done(self) -> bool:
        return self.moved == self.size

    def unmoved(self) -> list:
        """What is still to move, in order: the header's rest and the payload, or the payload's rest."""
        if self.moved < HEADER.size:
            return [memoryview(self.header)[self.moved:], self.payload]
        return [self.payload[self.moved - HEADER.size:]]


class _Connection:
    """One TCP connection to the peer of this rank's local index on another machine (`peer`:
    how messages name it), with the messages waiting to be sent and received on it, each in
    order."""

    def __init__(self, sock: socket.socket, peer: str):
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a header is never held back
        self.sock, self.peer = sock, peer
        self.sends: collections.deque = collections.deque()
        self.receives: collections.deque = collections.deque()
        self.sent = self.received = 0  # messages numbered so far, each way

    def send(self, payload: memoryview, step_bytes: int) -> _Message:
        message = _Message(self.sent, payload, HEADER.pack(self.sent, len(payload), step_bytes), step_bytes)
        self.sent += 1
        self.sends.append(message)
        return message

    def receive(self, payload: memoryview, step_bytes: int) -> _Message:
        message = _Message(self.received, payload, bytes(HEADER.size), step_bytes)
        self.received += 1
        self.receives.append(message)
        return message

    def push(self) -> None:
        """Send what the kernel takes now."""
        while self.sends:
            message = self.sends[0]
            try:
                message.moved += self.sock.sendmsg(message.unmoved())
            except BlockingIOError:
                return
            except OSError as e:
                raise LinkFailure(f"the connection to {self.peer} failed while sending ({GONE}): {e}") from e
            if not message.done:
                return  # the kernel's buffer is full
            self.sends.popleft()

    def pull(self) -> None:
        """Receive what has arrived, checking each header before its payload."""
        while self.receives:
            message = self.receives[0]
            moved = message.moved
            try:
                got = self.sock.recv_into(message.unmoved()[0])  # the header whole before the payload
            except BlockingIOError:
                return
            except OSError as e:
                raise LinkFailure(f"the connection to {self.peer} failed while receiving ({GONE}): {e}") from e
            if got == 0:
                raise LinkFailure(f"{self.peer} closed the connection ({GONE}) with "
                                  f"{message.size - moved} bytes of message {message.number} still to come")
            message.moved += got
            if moved < HEADER.size <= message.moved:
                number, size, step_bytes = HEADER.unpack(message.header)
                if (number, size, step_bytes) != (message.number, len(message.payload), message.step_bytes):
                    raise RingcollMismatchError(
                        f"between the machines, {self.peer} sent {_what(size, number, step_bytes)} where this rank "
                        f"expected {_what(len(message.payload), message.number, message.step_bytes)}: the ranks made "
                        "different calls (the call check, RINGCOLL_CHECK, is off)")
            if message.done:
                self.receives.popleft()
            elif moved >= HEADER.size:
                return  # part of a payload: the rest comes later (and the sends must not wait for it)
            # else the header was read: on to its payload, which often came with it (a poll less
            # per message: a 64 KiB exchange between the namespace machines took 153-158 us, 169-196
            # when the next poll read the payload)


def _what(size: int, number: int, step_bytes: int) -> str:
    return f"{size} bytes as message {number}" + (f" (of a {step_bytes}-byte step)" if step_bytes else "")


class SocketLink:
    """This rank's connections to its peers on the other machines, one per machine
    (`peer_names`: machine index -> how messages name that peer). exchange() is the one
    operation: the hierarchical communicator's steps between the machines are all exchanges
    with some of the other machines.

    `share(entry)` gives every machine's entry, this one's among them, in any order: the
    communicator passes an all_gather_object over the group of exactly these peers (each
    entry is a machine index, an address, a port and a token)."""

    def __init__(self, node_index: int, peer_names: dict, timeout: float, share: Callable[[tuple], list]):
        self.timeout = timeout
        self._failure = ""
        self._connections: dict = {}
        _live_links.add(self)
        address = local_address()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((address, 0))
            listener.listen(len(peer_names))
            token = os.urandom(16)
            everyone = share((node_index, address, listener.getsockname()[1], token))
            self._connections = self._connect(listener, node_index, {e[0]: e[1:] for e in everyone}, token,
                                              peer_names)
        finally:
            listener.close()

    def _connect(self, listener: socket.socket, node_index: int, where: dict, token: bytes,
                 peer_names: dict) -> dict:
        """Connect to every machine before this one, then accept every machine after it (the
        kernel completes a connection to a listener before accept() takes it, so no rank
        waits for another's accept); each connection opens with a hello: the acceptor's token,
        which only the job's ranks know, and the connector's machine."""
        deadline = time.monotonic() + self.timeout
        connections = {}
        try:
            for node in sorted(n for n in where if n < node_index):
                host, port, their_token = where[node]
                sock = self._dial(host, port, deadline, peer_names[node])
                sock.sendall(HELLO.pack(their_token, node_index))
                connections[node] = _Connection(sock, peer_names[node])
            while len(connections) < len(where) - 1:
                listener.settimeout(max(deadline - time.monotonic(), 0.001))
                try:
                    sock, _ = listener.accept()
                except socket.timeout:
                    waiting = ", ".join(peer_names[n] for n in where if n > node_index and n not in connections)
                    raise LinkFailure(f"timed out after {self.timeout:g} s waiting for {waiting} to connect") from None
                # A peer sends its hello as it connects: a stranger that says nothing is given up
                # after HELLO_SECONDS, so it cannot hold the real peers back until the timeout.
                sock.settimeout(min(max(deadline - time.monotonic(), 0.001), HELLO_SECONDS))
                try:
                    hello = _read_exactly(sock, HELLO.size)
                except OSError:
                    sock.close()
                    continue
                their_token, node = HELLO.unpack(hello)
                if their_token != token or node not in where or node <= node_index or node in connections:
                    sock.close()  # not one of this job's ranks: ignored
                    continue
                connections[node] = _Connection(sock, peer_names[node])
        except BaseException:
            for connection in connections.values():
                connection.sock.close()
            raise
        return connections

    @staticmethod
    def _dial(host: str, port: int, deadline: float, peer: str) -> socket.socket:
        while True:
            try:
                return socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.001))
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise LinkFailure(f"timed out connecting to {peer} at {host}:{port} ({e}): if that is not an "
                                      "address the machines reach each other at, name the interface that is in "
                                      "RINGCOLL_SOCKET_IFNAME (or GLOO_SOCKET_IFNAME)") from e
                time.sleep(0.01)  # refused or unreachable for now: the peer's machine may still be coming up

    def exchange(self, sends: dict, receives: dict, step_bytes: int = 0) -> Callable[[], None]:
        """Start sending sends[node] to that machine's peer and receiving receives[node] from
        it (tensors; empty ones are left out on both sides); the returned call waits until all
        of them have moved. `step_bytes`: what they are parts of (the header's third field)."""
        messages: list = []

        def start() -> None:
            for node, tensor in sends.items():
                if tensor.numel():
                    messages.append(self._connections[node].send(_bytes_of(tensor), step_bytes))
            for node, tensor in receives.items():
                if tensor.numel():
                    messages.append(self._connections[node].receive(_bytes_of(tensor), step_bytes))
            for node in sends:
                self._connections[node].push()

        self._guarded(start)
        return lambda: self._guarded(lambda: self._wait_for(messages))

    def _guarded(self, step: Callable[[], object]) -> None:
        """step(); a failure fails the link for good (its streams may be cut mid-message)."""
        if self._failure:
            raise LinkFailure(f"the link failed earlier: {self._failure}")
        try:
            step()
        except (LinkFailure, RingcollMismatchError) as e:
            self._failure = str(e)
            raise

    def _wait_for(self, messages: list) -> None:
        """Move every connection's messages, both ways, until `messages` have all moved."""
        deadline = time.monotonic() + self.timeout
        by_fd = {c.sock.fileno(): c for c in self._connections.values()}
        poller = select.poll()
        while not all(message.done for message in messages):
            busy = {fd: c for fd, c in by_fd.items() if c.sends or c.receives}  # by number: close() may come
            for fd, c in busy.items():
                poller.register(fd, (select.POLLOUT if c.sends else 0) | (select.POLLIN if c.receives else 0))
            left = deadline - time.monotonic()
            # In slices: a close() from another thread does not wake a poll on its sockets.
            ready = poller.poll(min(left, POLL_SLICE_SECONDS) * 1000) if left > 0 else []
            for fd in busy:
                poller.unregister(fd)
            if not self._connections:  # close() empties it before it closes a socket
                raise LinkFailure("the link was closed by this rank while in use")
            if not ready and time.monotonic() >= deadline:
                pending = ", ".join(f"{c.peer}: {len(c.sends)} to send, {len(c.receives)} to receive"
                                    for c in busy.values())
                raise LinkFailure(f"timed out after {self.timeout:g} s with messages still to move ({pending})")
            for fd, events in ready:
                connection = by_fd[fd]
                if events & select.POLLIN:
                    connection.pull()
                if events & select.POLLOUT:
                    connection.push()
                if events & (select.POLLHUP | select.POLLERR):  # the peer is gone: what came before it still counts
                    connection.pull()
                    connection.push()
                    if connection.sends or connection.receives:
                        raise LinkFailure(f"{connection.peer} closed the connection ({GONE})")

    def close(self, why: str = "closed") -> None:
        connections, self._connections = self._connections, {}
        self._failure = self._failure or why
        for connection in connections.values():
            connection.sock.close()  # close(), never shutdown(): a forked child's close must not end the parent's


#: Every open link, so that a child of fork() lets go of its parent's (below).
_live_links: "weakref.WeakSet[SocketLink]" = weakref.WeakSet()


def _let_go_of_links_in_child() -> None:
    """In a child of fork() (a DataLoader worker, say): the parent's connections are copies
    of its file descriptors, useless here, and held they would keep each connection open
    after the parent died, so its peers would wait for the timeout instead of hearing at
    once. Closing a copy leaves the parent's connection as it is."""
    for link in list(_live_links):
        link.close("made in the parent process: a child of fork() cannot use it")


os.register_at_fork(after_in_child=_let_go_of_links_in_child)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(errno.ECONNRESET, "closed before its hello")
        data += chunk
    return data
