"""Hierarchical collectives: ringcoll's ring inside a node, its TCP link (or NCCL) between nodes.

Ranks are grouped by node (an explicit ``node_id``, else ``RINGCOLL_NODE_ID``, else
the global rank ``// LOCAL_WORLD_SIZE``, else the ranks that can share memory: one kernel and one
/dev/shm). With N nodes of L ranks each, and ``local`` a rank's index
inside its node:

    all-reduce      1. reduce-scatter inside the node (ringcoll): local rank l now holds
                       shard l of the message, reduced over its node;
                    2. all-reduce of that shard across nodes (between the ranks of each local
                       index: ringcoll's own TCP link for CPU tensors, training/link.py;
                       NCCL's point-to-point calls for GPU tensors);
                    3. all-gather inside the node (ringcoll).
                    Each rank puts 2(L-1)/L * n bytes on the fast intra-node ring and only
                    2(N-1)/N * n/L on the slow inter-node link: the node's L links share
                    the inter-node traffic, which is why two levels beat one flat ring.
    broadcast       the root's local index carries it between the nodes (the root sends it
                    to its peer on every other node), then each node's ring broadcasts it
                    from that index.
    reduce          each node's ring reduces to the root's local index (into a copy on the
                    other nodes: only the root's tensor may change), then that index's
                    group reduces the nodes' sums to the root.
    reduce-scatter  the input's P = N*L chunks are regrouped by local index; reduce-scatter
                    inside the node leaves rank l the N chunks of the ranks that share its
                    local index, reduced over the node; a reduce-scatter across nodes gives
                    each its own chunk.
    all-gather      the reverse: all-gather across nodes, then inside the node, then the
                    chunks are put back in rank order.

AVG is SUM at both levels and one division by P at the end (gloo has no AVG, and dividing
once rounds once). Every node must have the same number of ranks.

Between the nodes a step is a direct exchange with the peers of the same local index, not a
collective of gloo's (the section "between the nodes" below): an all-reduce's shard in N
parts, each node sent the part it owns, combining it in node order (so every node has the
same bits) and sending it back, as a ring of N moves it. Where the
link is slower than the node's ring, the message goes in pieces (``pipeline_bytes``;
"auto", the default, measures whether pieces pay, once per class of message size): one
piece crosses the link while the node's ring runs the next. The pieces never change a value
(nor a bit, but a NaN's: _all_reduce_flat says why), and whole or in pieces, each node sends ``2(N-1)/N * n``
bytes over its link per all-reduce: ``n`` for two nodes, where one flat ring over both
sends ``2(P-1)/P * n`` (1.5n at P = 4).

It has the Communicator's methods, checks and call order (the list and coalesced forms
packed into one flat call by ringcoll/packing.py, ``async_op=True`` queued on one worker
thread as the shared-memory transport does; ``all_reduce(output=)`` and the prepared calls,
``prepare_*``, too), so the torch.distributed backend uses it in
the ring's place when its ranks are on several machines (training/backend.py).
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
import time
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ringcoll import _C, packing
from ringcoll._types import DTYPE_CODES, DTYPE_NAMES, ReduceOp, op_code, reduce_op
from ringcoll.communicator import (EQUAL, GATHER, SCATTER, ArgumentChecks, Communicator, PreparedTensors, Work,
                                   _resolve_check, call_details, check_root, parse_bytes, resolve_timeout,
                                   submit_profiled)
from ringcoll.errors import RingcollError, RingcollMismatchError, RingcollPeerError, RingcollTimeoutError
from ringcoll.training.link import LinkFailure, SocketLink
from ringcoll.transports.host import CallQueue, ThreadCompletion, ranks_by_domain, shared_memory_domain

#: how two shards combine between GPU nodes (AVG runs as SUM, divided once at the end);
#: between CPU nodes, by the node ring's own loop (_combine)
COMBINE = {ReduceOp.SUM: torch.add, ReduceOp.PRODUCT: torch.mul, ReduceOp.MIN: torch.minimum,
           ReduceOp.MAX: torch.maximum}

#: The pipeline, where the link is slow enough that pieces pay: one piece crosses the link
#: while the next runs through the node's ring (pipeline_bytes= or RINGCOLL_PIPELINE_BYTES:
#: "auto", the default, measures whether they pay; a size; 0 never). "auto" decides each
#: class of message size once, on the first message of the class, by timing an all-reduce of
#: the class's probe size cut each way the class compares, and keeping the fastest:
#: (largest all-reduce of the class, probe bytes, the cuts compared). A cut is 0 (whole), a
#: piece size, or EIGHTHS: the message in 8 pieces, of MIN_EIGHTH_BYTES to MAX_PIECE_BYTES
#: (so fewer below 32 MiB: 16 MiB in 4 pieces of 4 MiB took 14 ms, in 8 of 2 MiB 16, over
#: 10 Gbit/s and unshaped alike).
#: Classes and cuts, because what pays moves with the size and the link (2 x 2 namespace
#: ranks on this VM): over 10 Gbit/s an 8 MiB all-reduce took 7.9 ms whole and 19.7 in 1 MiB
#: pieces, a 64 MiB one 106 ms whole, 58 in 4 MiB pieces and 60 in 8 MiB ones (gloo 84;
#: whole, each 32 MiB swap crosses at 0.65-0.9 GB/s where the link carries 1.2: gloo's large
#: messages, not the link, which drops nothing and moves 1.2 GB/s for plain TCP); over
#: 2 Gbit/s 1 MiB pieces were best at every size (64 MiB: 281 ms, 328 in 8 MiB pieces); on
#: the unshaped veth whole and pieces were level at 64 MiB (56 and 57 ms).
PIECE_BYTES, MIN_EIGHTH_BYTES, MAX_PIECE_BYTES = 1 << 20, 4 << 20, 8 << 20
EIGHTHS = "eighths"
AUTO_CLASSES = ((8 << 20, 8 << 20, (0, PIECE_BYTES)), (None, 32 << 20, (0, PIECE_BYTES, EIGHTHS)))
PROBE_ROUNDS = 2  # each probe cut each way twice, after a round that warms the work space up

#: Calls whose first stage is the node's ring writing work space only (a reduce-scatter in the
#: node): on the CPU it runs while the call check's exchange between hosts is still crossing
#: the link, and the check is settled before anything else crosses (_settle_check). Those
#: whose first stage writes the user's tensor (reduce, broadcast) or crosses the link
#: (all-gather) settle it first. Over 10 Gbit/s (2 x 2 namespace ranks) the check's round
#: trip was 1 of a 1 MiB all-reduce's 2.3 ms.
CHECK_OVERLAPS = ("all_reduce", "all_reduce_coalesced", "reduce_scatter_tensor", "reduce_scatter",
                  "reduce_scatter_tensor_coalesced")


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 and nbytes % (1 << 20) == 0 else f"{nbytes} bytes"


#: the user's collectives, as check_call numbers them
USER_CALLS = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "reduce_scatter",
              "all_reduce_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "barrier",
              "broadcast", "reduce", "close")


class _LinkError(Exception):
    """A torch.distributed call between the nodes failed with `error` (HierarchicalCommunicator._on_link)."""

    def __init__(self, error: RuntimeError):
        super().__init__(str(error))
        self.error = error


def describe_call(user_call) -> str:
    """(collective index, dtype code, op code or -1, count, root or -1) in words: 'all_reduce
    of 1001 float32 (SUM)', 'broadcast of 8 int32 from rank 2'. Codes this version does not
    know (a peer of another version) are shown as numbers."""
    collective, dtype, op, count, root = user_call
    known = 0 <= collective < len(USER_CALLS) and (dtype < 0 or dtype in DTYPE_NAMES) and op in {-1, *map(int, ReduceOp)}
    if not known:
        return f"a call this version does not know (codes {tuple(user_call)})"
    if dtype < 0:
        return USER_CALLS[collective]
    reduction = f" ({ReduceOp(op).name})" if op >= 0 else ""
    rooted = "" if root < 0 else f" {'from' if USER_CALLS[collective] == 'broadcast' else 'to'} rank {root}"
    return f"{USER_CALLS[collective]} of {count} {DTYPE_NAMES[dtype]}{reduction}{rooted}"


def _node_of(node_id, global_rank: int) -> object:
    """This rank's node: node_id, else RINGCOLL_NODE_ID, else its global rank's block of
    torchrun's LOCAL_WORLD_SIZE (the default group's rank: a subgroup numbers its ranks
    anew), else the ranks that share memory."""
    if node_id is not None:
        return node_id
    if "RINGCOLL_NODE_ID" in os.environ:
        return os.environ["RINGCOLL_NODE_ID"]
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if local_world > 0:
        return global_rank // local_world
    return shared_memory_domain()


def uneven_nodes_message(who: str, members: dict, names: Optional[dict] = None) -> Optional[str]:
    """Why nodes of different sizes cannot run hierarchically, or None when they are even.
    `members` maps each node to its ranks; `names`, each node to what to call it (default
    "node <id>")."""
    if len({len(ranks) for ranks in members.values()}) == 1:
        return None
    names = names or {node: f"node {node}" for node in members}
    layout = "; ".join(f"{names[node]}: {len(ranks)} (ranks {', '.join(map(str, ranks))})"
                       for node, ranks in members.items())
    return (f"{who}: every node needs the same number of ranks, got {layout}. The levels are "
            "one ring per node and one group per local index, so start the same number of ranks "
            "on every machine (torchrun --nproc-per-node N on each), or use backend='gloo'")


def _group_names() -> Optional[dict]:
    """torch's name of each process group this process has, in the order they were made (the
    one place this module reads torch's bookkeeping); None where torch does not say."""
    return getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None)


def _groups_made() -> int:
    """How many process groups this process has (torch names a group its members make alone by
    this number: distributed_c10d._hash_ranks_to_str); -1 where torch does not say."""
    names = _group_names()
    return len(names) if names is not None else -1


#: Process groups of closed communicators, kept for the next communicator over the same ranks
#: (group -> (its global ranks, backend)): a process that makes and closes communicators holds
#: one pair of groups per layout in use at once, not a pair per communicator. Weakly held, so
#: dist.destroy_process_group() still ends them and their gloo threads. Kept, not destroyed:
#: torch names a group its members make alone after how many groups the process has, and a
#: destroyed group's rendezvous keys stay in the store, so the next group made after a destroy
#: takes the dead one's name and reads its old addresses (gloo: "Connection refused").
_idle_groups: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _idle_offer() -> frozenset:
    """This process's idle groups as every member of each names it: (name, global ranks, backend)."""
    names = _group_names() or {}
    return frozenset((names[group], ranks, backend) for group, (ranks, backend) in list(_idle_groups.items())
                     if group in names)


def _idle_groups_for(layout: list, offers: dict) -> Optional[list]:
    """Which idle group each group of `layout` ((global ranks, backend) pairs, the same list on
    every rank) takes, as a list of group names in layout order, or None when some group finds none that
    every one of its members offered (`offers`: global rank -> its _idle_offer()). All or none,
    as every rank sees the same offers: a rank that made one new group where another took an
    idle one would count groups differently, and torch names the next group by that count."""
    offered = {rank: set(offer) for rank, offer in offers.items()}
    taken = []
    for ranks, backend in layout:
        fits = sorted(entry for entry in set.intersection(*(offered[rank] for rank in ranks))
                      if entry[1:] == (ranks, backend))
        if not fits:
            return None
        taken.append(fits[0][0])
        for offer in offered.values():  # one group serves one level (a world of one: both are one rank)
            offer.discard(fits[0])
    return taken


def _take_idle_group(name: str, timeout: datetime.timedelta):
    """The idle group torch names `name`, no longer idle, with the taker's timeout."""
    names = _group_names()
    group = next(group for group in list(_idle_groups) if names.get(group) == name)
    del _idle_groups[group]
    dist.distributed_c10d._set_pg_timeout(timeout, group)  # this communicator's, not the last one's
    return group


def _resolve_pipeline(setting) -> Optional[int]:
    """pipeline_bytes= (else RINGCOLL_PIPELINE_BYTES, else "auto") -> piece bytes, 0 for
    whole messages, None for "auto" (which measures, class by class of message size)."""
    if setting is None:
        setting = os.environ.get("RINGCOLL_PIPELINE_BYTES", "auto")
    if isinstance(setting, str) and setting.strip().lower() == "auto":
        return None
    piece_bytes = setting if isinstance(setting, int) else parse_bytes(setting)
    if piece_bytes < 0:
        raise ValueError(f"HierarchicalCommunicator: pipeline_bytes must be \"auto\", 0 (never) or a size, "
                         f"got {setting!r}")
    return piece_bytes


class HierarchicalCommunicator(ArgumentChecks):
    """All-reduce, reduce-scatter and all-gather over nodes of ranks (module docstring).

    Construction is collective over ``group`` (default: the default group): each rank makes
    the two groups it belongs to, its node's (the intra-node ringcoll Communicator for
    ``device`` is built on it) and its local index's, in that order on every rank, or takes
    the ones a closed communicator over the same ranks left (close()). Ranks outside ``group``
    need not take part. ``inter_backend`` moves the data between the nodes: "socket" (the
    default for CPU tensors) ringcoll's own TCP link (training/link.py), whose connections
    are set up over the local index's group (gloo's); "gloo" that group's point-to-point
    calls; "nccl" (the default for CUDA tensors) an NCCL group's.
    """

    def __init__(self, group=None, node_id=None, timeout=None, buffer_bytes=None, inter_backend: Optional[str] = None,
                 check=None, device="cpu", pipeline_bytes=None):
        self.group = group if group is not None else dist.group.WORLD
        self.device = torch.device(device)
        inter_backend = self.inter_backend = (inter_backend or os.environ.get("RINGCOLL_INTER_BACKEND")
                                              or ("nccl" if self.device.type == "cuda" else "socket"))
        if inter_backend == "socket" and self.device.type != "cpu":
            raise ValueError(f"HierarchicalCommunicator: inter_backend='socket' (ringcoll's TCP link) moves CPU "
                             f"tensors; for {self.device.type} tensors use 'nccl'")
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.timeout = resolve_timeout(timeout)
        self.check = _resolve_check(check)
        self.pipeline_bytes = _resolve_pipeline(pipeline_bytes)
        self._auto_choices: dict = {}  # "auto": per class of AUTO_CLASSES, (the cut kept, what was measured)
        offers: list = [None] * self.world_size
        dist.all_gather_object(offers, (_node_of(node_id, dist.get_rank()), socket.gethostname(), self.check,
                                        self.pipeline_bytes, _groups_made(), inter_backend, _idle_offer()),
                              group=self.group)
        if len({offer[4] for offer in offers}) != 1:
            raise RuntimeError("HierarchicalCommunicator: the ranks have made different numbers of process groups ("
                               + ", ".join(f"rank {r}: {offer[4]}" for r, offer in enumerate(offers)) + "). torch "
                               "names a group its members make alone (new_group(use_local_synchronization=True), "
                               "as this communicator makes its two) after that number, so theirs would never meet "
                               "(each rank would wait for the timeout): make the same groups on every rank of this "
                               "group before it (a communicator over a subgroup, made on some ranks only, counts)")
        # Settings every rank must share: the check's calls, the pieces (the node's ring checks
        # nothing itself, so ranks cutting a message differently would not be caught), and the
        # link's backend (ranks making a gloo and an NCCL group of the same ranks would hang).
        for index, setting in ((2, "check= / RINGCOLL_CHECK"), (3, "pipeline_bytes= / RINGCOLL_PIPELINE_BYTES"),
                               (5, "inter_backend=")):
            if len({offer[index] for offer in offers}) != 1:
                raise ValueError(f"HierarchicalCommunicator: {setting} must be the same on every rank, got "
                                 + ", ".join(f"rank {r}: {'auto' if offer[index] is None else offer[index]}"
                                            for r, offer in enumerate(offers)))
        nodes = [node for node, *_ in offers]
        members = ranks_by_domain(nodes)  # nodes in order of their first rank
        order = list(members)
        # What the messages call each node: its first rank's host name, the node id beside it.
        labels = {node: f"{offers[ranks[0]][1]} (node {node})" for node, ranks in members.items()}
        uneven = uneven_nodes_message("HierarchicalCommunicator", members,
                                      {node: f"host {label}" for node, label in labels.items()})
        if uneven:
            raise ValueError(uneven)
        self.num_nodes, self.local_size = len(order), len(members[order[0]])
        self.node_index = order.index(nodes[self.rank])
        self.local_rank = members[nodes[self.rank]].index(self.rank)
        # rank_at[node index][local index] = group rank: the layout both levels index into.
        self.rank_at = [members[node] for node in order]
        self.node_names = [labels[node] for node in order]

        def global_ranks(ranks):
            return tuple(self._global_rank(r) for r in ranks)

        # Every node's group (gloo: the node's ring bootstraps on it), then every local index's
        # (the link's); this rank belongs to one of each. Idle ones where closed communicators
        # left them for every group (_idle_groups), else new ones, made with
        # use_local_synchronization: only the members make a group, so this also works inside
        # a subgroup, and the node's group comes first on every rank (no crossed waits). Both
        # get the communicator's timeout: torch's default (30 min) would let a link that went
        # down hang every rank far past it.
        self.inter_ranks = [m[self.local_rank] for m in self.rank_at]  # one rank per node: this rank's local index
        # The socket link's group is gloo's: it carries the link's addresses once, broadcast and the barrier.
        group_backend = "gloo" if inter_backend == "socket" else inter_backend
        layout = ([(global_ranks(ranks), "gloo") for ranks in self.rank_at]
                  + [(global_ranks([m[local] for m in self.rank_at]), group_backend)
                     for local in range(self.local_size)])
        idle = _idle_groups_for(layout, {self._global_rank(r): offer[6] for r, offer in enumerate(offers)})
        group_timeout = datetime.timedelta(seconds=self.timeout)

        def group_at(index: int):
            if idle:
                return _take_idle_group(idle[index], group_timeout)
            ranks, backend = layout[index]
            return dist.new_group(list(ranks), backend=backend, use_local_synchronization=True, timeout=group_timeout)

        node_group = self._node_group = group_at(self.node_index)
        self.inter_group = group_at(self.num_nodes + self.local_rank)
        self._group_keys = (layout[self.node_index], layout[self.num_nodes + self.local_rank])  # for _idle_groups
        self._link = None
        if inter_backend == "socket" and self.num_nodes > 1:
            try:
                self._link = SocketLink(self.node_index,
                                        {node: f"rank {self.inter_ranks[node]} on host {self.node_names[node]}"
                                         for node in range(self.num_nodes)}, self.timeout, self._share_on_link_group)
            except LinkFailure as e:
                raise RingcollTimeoutError(f"HierarchicalCommunicator: rank {self.rank} on host "
                                           f"{self.node_names[self.node_index]}: {e}") from e
        # The node's ring checks nothing itself: check_call below compares every user call
        # across all nodes, and the ring's calls follow from it. Each rank also keeps the link
        # busy (the kernel's TCP stack, or gloo's threads, moving bytes while the ring waits):
        # where the two outnumber the cores, the ring's waits must not spin (Communicator's
        # shares_cores).
        self.intra = Communicator(group=node_group, device=self.device, timeout=self.timeout,
                                  buffer_bytes=buffer_bytes, check=False,
                                  shares_cores=2 * self.local_size > (os.cpu_count() or 1))
        self.device = self.intra.device  # with its index
        # Each node's ranks, as an index into rank-ordered rows (_node_rows).
        self._node_ranks = [torch.tensor(ranks, device=self.device) for ranks in self.rank_at]
        self._work_space: dict = {}  # _scratch
        self._calls = CallQueue(self.timeout)
        self._broken_reason = ""
        self._pending_check: Optional[Callable[[], None]] = None  # _check_call's second half

    def close(self) -> None:
        """Collective, as making the communicator was: call it on every rank at the same
        point. It finishes the queued calls, meets every rank (as barrier() does, checked as
        a call: a rank still calling a collective there gets RingcollMismatchError, a rank
        that never comes a timeout error, both within the timeout), then releases the node's
        ring and the work space and leaves its two process groups to the next communicator
        over the same ranks (_idle_groups). Idempotent. A broken communicator, or one left by
        an exception (``with``), is released without meeting: its groups, which a peer may
        still be using, are left to dist.destroy_process_group()."""
        self._close(wait_for_peers=True)

    def _close(self, wait_for_peers: bool, offer_groups: bool = False) -> None:
        """close() where `wait_for_peers`; else released at once. Its groups go idle where the
        ranks met, or, with `offer_groups`, where no call failed: the torch backend's shutdown,
        when its process group is destroyed (every rank does so once past its own calls, and
        the next communicator takes idle groups only where every member offers them, after an
        exchange every rank reaches only once past its calls; a rank whose last call failed,
        mid-way on a group, offers nothing, so no group with a message left in it is taken)."""
        if self.group is None:
            return
        met, error = False, None
        if wait_for_peers and not self._broken_reason:
            try:
                self._submit("close", self._meet, [], async_op=False)
                met = True
            except RingcollError as e:
                error = e
        self._calls.close(self.intra.close)
        if self._link is not None:
            self._link.close()
        self._work_space.clear()
        if met or (offer_groups and not self._broken_reason):  # the next communicator may use them
            _idle_groups.update(zip((self._node_group, self.inter_group), self._group_keys))
        # Released, as Communicator._close releases its group: held, a group's gloo threads
        # would outlive dist.destroy_process_group().
        self.group = self.inter_group = self._node_group = None
        if error is not None:
            raise error

    def __enter__(self) -> "HierarchicalCommunicator":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # Left by an exception, the other ranks may never come to close: waiting for them
        # would hide the exception behind a timeout.
        self._close(wait_for_peers=exc_type is None)

    # --- helpers --------------------------------------------------------------------------

    def _level_op(self, name: str, op, dtype: int) -> tuple[ReduceOp, bool, int]:
        """The op both levels use, whether to divide by P at the end (AVG), and the user's op
        code (for check_call); `dtype`: the code the checks returned."""
        code = op_code(name, op, dtype)  # validates op x dtype, naming the call
        ours = reduce_op(name, op)
        return (ReduceOp.SUM, True, code) if ours is ReduceOp.AVG else (ours, False, code)

    @property
    def broken(self) -> bool:
        return bool(self._broken_reason)

    def _submit(self, name: str, run: Callable[[], None], outputs: list, async_op: bool,
                call: tuple = ()) -> Optional[Work]:
        """Run the validated call now, or queued in call order (a Work, as the ring's). On
        CUDA both levels enqueue on the current stream without blocking the host (the ring
        and NCCL alike), so the call runs now even when async: its Work is already done, and
        its wait() orders nothing (NCCL's makes the current stream wait): work on another
        stream that reads the result must wait for the call's stream (wait_stream).
        `call` is (dtype code, op code or -1, count[, root]): what check_call compares."""
        if self.group is None:
            raise RingcollError(f"{name}: communicator is closed")
        if self._broken_reason:
            raise RingcollError(f"{name}: communicator is broken by an earlier error ({self._broken_reason})")
        collective = USER_CALLS.index(name.removeprefix("prepare_"))  # a prepared run is its collective
        dtype, op, count, *root = call if call else (-1, -1, 0)
        user_call = (collective, dtype, op, count, root[0] if root else -1)
        run = functools.partial(self._run_checked, name, user_call, run)

        def submit() -> Optional[ThreadCompletion]:
            if self.device.type != "cuda":
                return self._calls.submit(run, async_op, name)
            self._calls.submit(run, async_op=False)
            return ThreadCompletion.finished(name) if async_op else None

        completion = submit_profiled(name, outputs, lambda: call_details(None if dtype < 0 else dtype,
                                                                        None if op < 0 else op, count), submit)
        return None if completion is None else Work(completion, outputs)

    def _run_checked(self, name: str, user_call: tuple, run: Callable[[], None]) -> None:
        """run() once every rank's call is known to be this one (check_call); an error of
        either level is raised in the user's terms: the user's collective, group ranks, and
        host names. Any error breaks the communicator, as it breaks the ring."""
        if self._broken_reason:  # broken while this call waited in the queue: nothing may cross
            raise RingcollError(f"{name}: communicator is broken by an earlier error ({self._broken_reason})")
        try:
            if self.check:
                self._check_call(name, user_call, name.removeprefix("prepare_") in CHECK_OVERLAPS)
            run()
            self._settle_check()
        except RingcollMismatchError as e:
            self._broken_reason = str(e)
            if not str(e).startswith(f"{name}:"):  # found by the socket link's header, the call check off
                raise RingcollMismatchError(f"{name}: rank {self.rank} on host {self.node_names[self.node_index]}: "
                                            f"{e}") from e
            raise
        except RingcollError as e:  # the node's ring: its ranks are numbered within the node
            self._broken_reason = f"{name}: {e}"
            # Led by the user's global rank, as the error between hosts is: which of the two
            # a rank sees first when a link fails is a race, and the message must not depend on it.
            raise type(e)(f"{name}: rank {self.rank} on host {self.node_names[self.node_index]}, on its host's ring, "
                          f"whose ranks (numbered 0..{self.local_size - 1} below) are ranks "
                          f"{self._ranks_text(self.rank_at[self.node_index])} (pids as that host sees them): {e}") from e
        except _LinkError as link_error:  # torch.distributed between the nodes (gloo, NCCL)
            e = link_error.error
            self._broken_reason = f"{name}: {e}"
            peers = ", ".join(f"rank {r} on {self.node_names[i]}" for i, r in enumerate(self.inter_ranks)
                              if r != self.rank)
            timed_out = "timed out" in str(e).lower()
            error = RingcollTimeoutError if timed_out else RingcollPeerError
            what = f"heard nothing within the {self.timeout:g} s timeout" if timed_out else "lost the link"
            raise error(f"{name}: rank {self.rank} on host {self.node_names[self.node_index]} {what} from the other "
                        f"hosts ({peers}): {type(e).__name__}: {e}") from e
        except BaseException as e:  # this rank's own failure (a bad view, out of memory): as it is
            self._broken_reason = self._broken_reason or f"{name}: {type(e).__name__}: {e}"
            raise
        finally:
            if self._pending_check is not None:  # the call ended (an interrupt) with its exchange still posted
                self._pending_check = None
                self._broken_reason = self._broken_reason or f"{name}: ended before its call check was settled"

    def _global_rank(self, rank: int) -> int:
        """The default group's number of this group's `rank` (what point-to-point calls take)."""
        return dist.get_global_rank(self.group, rank) if self.group is not dist.group.WORLD else rank

    @staticmethod
    def _ranks_text(ranks) -> str:
        return ", ".join(map(str, ranks))

    def _check_call(self, name: str, user_call: tuple, may_overlap: bool) -> None:
        """Raise RingcollMismatchError on every rank, before any data moves between the hosts
        or into the user's tensors, unless every rank of every node made this call: each node
        gathers its ranks' calls on its ring, then the nodes exchange theirs as the all-gather
        between them does (two fixed-size calls, so they cannot mismatch themselves). A check
        per node only would let two nodes that agree inside differ from each other and fail
        inside gloo. Where `may_overlap` (CHECK_OVERLAPS, on the CPU) and the node's ranks
        agree, the comparison waits for the exchange later (_settle_check), so the node's
        first stage runs meanwhile: the same call on every rank of the node, into work space."""
        mine = torch.tensor(user_call, dtype=torch.int64, device=self.device)
        node_calls = mine.new_empty(self.local_size * mine.numel())
        self.intra.all_gather_into_tensor(node_calls, mine)
        every_call = node_calls.new_empty(self.num_nodes * node_calls.numel())
        exchanged = self._start_all_gather(every_call, node_calls)
        self._pending_check = lambda: (exchanged(), self._compare_calls(name, every_call)) and None
        if not (may_overlap and self.device.type == "cpu"
                and len(set(map(tuple, node_calls.view(self.local_size, -1).tolist()))) == 1):  # the node agrees
            self._settle_check()

    def _settle_check(self) -> None:
        """Finish the call check left pending by _check_call (a no-op when none is): before
        anything crosses the link or lands in the user's tensors."""
        settle, self._pending_check = self._pending_check, None
        if settle is not None:
            settle()

    def _compare_calls(self, name: str, every_call: torch.Tensor) -> None:
        """The mismatch error of _check_call, from every rank's call (rows by node, local index)."""
        calls = every_call.view(self.num_nodes, self.local_size, -1).tolist()
        by_call: dict = {}
        for node in range(self.num_nodes):
            for local in range(self.local_size):
                by_call.setdefault(tuple(calls[node][local]), []).append(self.rank_at[node][local])
        if len(by_call) == 1:
            return
        what = "; ".join(f"{'rank' if len(ranks) == 1 else 'ranks'} {self._ranks_text(sorted(ranks))} called "
                         f"{describe_call(call)}" for call, ranks in by_call.items())
        raise RingcollMismatchError(f"{name}: the ranks made different calls at the same point across "
                                    f"{self.num_nodes} hosts ({', '.join(self.node_names)}): {what}; nothing "
                                    "crossed between the hosts or was written to a tensor")

    # --- between the nodes: one step per piece, started now, finished later ------------------
    #
    # Each step is started asynchronously and finished (waited, combined) later, so the
    # caller can run the node's ring on the next piece while this one crosses the link. Every
    # step is a direct exchange with the other nodes' ranks of this local index, each
    # addressed by its node index: the all-reduce is a direct reduce-scatter then all-gather
    # (each rank sends every other node the part that node owns, then its reduced part to
    # every node: 2(N-1)/N of the shard, as a ring would). Not gloo's collectives: their
    # order of reduction follows an element's place in the buffer, so cutting a message into
    # pieces changed bits (3 nodes, 4 KiB pieces: 63613 of 300000 floats), and they number
    # their rows in rank order, not node order. Here an element is combined in node order,
    # wherever it lies.

    def _on_link(self, call: Callable, *args, **kwargs):
        """call(*args, **kwargs), a torch.distributed call between the nodes: its RuntimeError
        (gloo's, NCCL's) becomes _LinkError, so an error is blamed on the link only when the
        link's calls raised it (_run_checked)."""
        try:
            return call(*args, **kwargs)
        except RingcollError:  # the socket link's header check: a mismatch, not the link
            raise
        except RuntimeError as e:
            raise _LinkError(e) from e

    def _exchange(self, sends: dict, receives: dict, step_bytes: int = 0) -> Callable[[], None]:
        """Start sending sends[i] to node i's rank of this local index and receiving
        receives[i] from it, for each node i in the two dicts (never this node; an empty
        tensor is left out on both sides); the returned call waits for all of them. The
        socket link takes them as they are (link.py; `step_bytes`, the size of what they are
        parts of, goes in each header, so that a mismatch shows on both sides); NCCL as one
        batch (separate calls could each wait for the other side's); gloo as separate calls,
        as its batch took twice as long (1.9 ms against 0.8 ms for 512 KiB each way, 2 x 2
        namespace ranks)."""
        self._settle_check()
        if self._link is not None:
            return functools.partial(self._on_link, self._on_link(self._link.exchange, sends, receives, step_bytes))
        ops = [(op, tensor, self._global_rank(self.inter_ranks[node]))
               for op, by_node in ((dist.isend, sends), (dist.irecv, receives))
               for node, tensor in by_node.items() if tensor.numel()]
        if not ops:  # one node, or only empty parts: nothing to move (NCCL refuses an empty batch)
            return lambda: None
        if self.inter_backend == "nccl":
            works = self._on_link(dist.batch_isend_irecv,
                                  [dist.P2POp(op, tensor, peer, self.inter_group) for op, tensor, peer in ops])
        else:
            works = [self._on_link(op, tensor, peer, group=self.inter_group) for op, tensor, peer in ops]
        return lambda: self._on_link(lambda: [work.wait() for work in works]) and None

    def _share_on_link_group(self, entry) -> list:
        """Every node's `entry` (this rank's peers' on the other nodes, and its own)."""
        everyone: list = [None] * self.num_nodes
        dist.all_gather_object(everyone, entry, group=self.inter_group)
        return everyone

    def _other_nodes(self) -> list[int]:
        return [node for node in range(self.num_nodes) if node != self.node_index]

    @staticmethod
    def _combine(level_op: ReduceOp, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        """out = a op b. On the CPU by the loop the node's ring reduces with (reduce.h), whose
        every element gets the same bits wherever it lies in the call: torch.minimum of 0
        and -0 returns b in its vector blocks and a in its tail, so how a message was cut
        into pieces changed such an element's sign (two nodes, MIN, 1031 floats in 256-byte
        pieces). A GPU's elementwise kernel treats every element alike."""
        if out.device.type == "cpu":
            _C.reduce_arrays(out.data_ptr(), a.data_ptr(), b.data_ptr(), out.numel(), DTYPE_CODES[out.dtype],
                             int(level_op))
        else:
            COMBINE[level_op](a, b, out=out)

    @classmethod
    def _combine_in_node_order(cls, rows: list, level_op: ReduceOp, out: torch.Tensor) -> None:
        """out = rows[0] op rows[1] op ... (node 0's first), the same bits on every node. `out`
        may be rows[0] or rows[1] (each element is read before it is written), not a later
        row, which the first step would overwrite before it is read. One row: copied."""
        if len(rows) == 1:
            out.copy_(rows[0])
            return
        cls._combine(level_op, rows[0], rows[1], out)
        for row in rows[2:]:
            cls._combine(level_op, out, row, out)

    def _start_all_reduce(self, shard: torch.Tensor, level_op: ReduceOp, bank: int,
                          out: Optional[torch.Tensor] = None) -> Callable[[], None]:
        """Start `out` (by default `shard` itself) = level_op over the nodes' shards of this
        local index; the returned call finishes it. A direct reduce-scatter, then all-gather:
        N parts of the shard, part i owned by node i, which receives every other node's part
        i, combines them into its part of `out` and sends that to every node, which receive
        it straight into theirs. Each node sends 2(N-1)/N of the shard, as a ring would, and
        combines only its own part: with two nodes, one swap of the whole shard and both
        combining all of it took 4.2 of a 64 MiB all-reduce's 45 ms of CPU per rank (2 x 2
        namespace ranks on this 2-core VM, where CPU, not the link, sets the pace), halves 1.8."""
        out = shard if out is None else out
        if self.num_nodes == 1:
            return lambda: None if out is shard else out.copy_(shard)
        others = self._other_nodes()
        width = -(-shard.numel() // self.num_nodes)
        parts, results = ([t[i * width:(i + 1) * width] for i in range(self.num_nodes)] for t in (shard, out))
        rows = list(self._scratch(bank, "theirs", self.num_nodes * width, shard.dtype).view(self.num_nodes, width))
        rows = [row[:parts[self.node_index].numel()] for row in rows]
        wait = self._exchange({node: parts[node] for node in others}, {node: rows[node] for node in others},
                              shard.nbytes)

        def finish() -> None:
            wait()
            mine, result = parts[self.node_index], results[self.node_index]
            if out is not shard or self.node_index < 2:  # the combine's output is no later operand
                rows[self.node_index] = mine
            else:  # it would be written before it is read
                rows[self.node_index].copy_(mine)
            self._combine_in_node_order(rows, level_op, result)
            self._exchange({node: result for node in others}, {node: results[node] for node in others},
                           shard.nbytes)()

        return finish

    def _start_reduce_scatter(self, out: torch.Tensor, by_node: torch.Tensor, level_op: ReduceOp,
                              bank: int) -> Callable[[], None]:
        """Start `out` = level_op over the nodes of their rows of `by_node` (N rows: row i
        for node i) at this node's index."""
        rows, others = by_node.view(self.num_nodes, -1), self._other_nodes()
        theirs = self._scratch(bank, "theirs", self.num_nodes * out.numel(), out.dtype).view(self.num_nodes, -1)
        wait = self._exchange({node: rows[node] for node in others}, {node: theirs[node] for node in others})
        operands = [rows[node] if node == self.node_index else theirs[node] for node in range(self.num_nodes)]
        return lambda: (wait(), self._combine_in_node_order(operands, level_op, out)) and None

    def _start_all_gather(self, by_node: torch.Tensor, mine: torch.Tensor) -> Callable[[], None]:
        """Start row i of `by_node` = node i's `mine` (this rank's local index)."""
        rows, others = by_node.view(self.num_nodes, -1), self._other_nodes()
        rows[self.node_index].copy_(mine)
        return self._exchange({node: mine for node in others}, {node: rows[node] for node in others})

    # --- the pipeline: pieces, and the work space two pieces in flight use ----------------

    def _pieces(self, numel: int, unit_bytes: int, piece_bytes: Optional[int] = None,
                link_share: float = 1.0) -> list[slice]:
        """[0, numel) cut into pipeline pieces, each about piece_bytes of the message (default:
        the communicator's choice, _piece_bytes) where each of the numel units stands for
        `unit_bytes` of it; one piece when the message is no larger or pipelining is off.
        `link_share`: the bytes the collective sends over the link per message byte, as a
        share of what an all-reduce sends (a reduce-scatter or all-gather: half)."""
        if piece_bytes is None:
            piece_bytes = self._piece_bytes(numel * unit_bytes, link_share)
        per_piece = max(1, piece_bytes // unit_bytes) if piece_bytes else max(numel, 1)
        return [slice(start, min(start + per_piece, numel)) for start in range(0, numel, per_piece)] or [slice(0, 0)]

    @staticmethod
    def _cut(cut, message_bytes: int) -> int:
        """The piece a message of `message_bytes` is cut into by `cut` (AUTO_CLASSES); 0: whole."""
        return min(max(message_bytes // 8, MIN_EIGHTH_BYTES), MAX_PIECE_BYTES) if cut == EIGHTHS else cut

    def _piece_bytes(self, message_bytes: int, link_share: float = 1.0) -> int:
        """The piece for a message of `message_bytes` (0: whole). With pipeline_bytes="auto",
        the first message of each class of AUTO_CLASSES decides the class, once, by measuring
        (_decide_pipeline): every rank reaches that call at the same point, as it makes the
        same calls. A class holds the all-reduces of its sizes and the collectives that send
        as many bytes over the link (`link_share`: a 16 MiB all-gather sends what an 8 MiB
        all-reduce does, and goes as that one goes)."""
        if self.pipeline_bytes is not None:
            return self.pipeline_bytes
        if message_bytes <= PIECE_BYTES:
            return 0
        like = message_bytes * link_share  # the all-reduce that sends as many bytes over the link
        kind = next(i for i, (largest, *_) in enumerate(AUTO_CLASSES) if largest is None or like <= largest)
        if kind not in self._auto_choices:
            self._decide_pipeline(kind)
        return self._cut(self._auto_choices[kind][0], message_bytes)

    def _decide_pipeline(self, kind: int) -> None:
        """Time all-reduces of class `kind`'s probe cut each of the class's ways, in turn, and
        keep the fastest, as the slowest rank saw each (so every rank decides alike). Pieces
        pay where the link is slower than the node's ring: the ring runs the next piece while
        one crosses. Where it is not (on this project's 2-core VM, two namespace machines
        share the cores, and moving bytes over the veth takes the same CPU as the ring), each
        piece only adds a meeting of the ranks."""
        largest, probe_bytes, cuts = AUTO_CLASSES[kind]
        probe = torch.zeros(probe_bytes // 4, dtype=torch.float32, device=self.device)
        spent = torch.zeros(len(cuts), dtype=torch.float64, device=self.device)
        for round_ in range(PROBE_ROUNDS + 1):  # the first round warms the work space up, uncounted
            for i, cut in enumerate(cuts):
                self._synchronize()
                start = time.perf_counter()
                self._all_reduce_flat(probe, ReduceOp.SUM, False, piece_bytes=self._cut(cut, probe_bytes))
                self._synchronize()
                spent[i] += (time.perf_counter() - start) if round_ else 0.0
        self._all_reduce_flat(spent, ReduceOp.MAX, False, piece_bytes=0)
        times = [t / PROBE_ROUNDS * 1e3 for t in spent.tolist()]
        best = min(range(len(cuts)), key=times.__getitem__)

        def way(cut) -> str:
            piece = self._cut(cut, probe_bytes)
            return f"in pieces of {_size(piece)}" if piece else "whole"

        sizes = f"up to {_size(largest)}" if largest is not None else f"past {_size(AUTO_CLASSES[kind - 1][0])}"
        measured = ", ".join(f"{t:.2f} ms {way(cut)}" for cut, t in zip(cuts, times))
        cut_text = "eighths, pieces of 4-8 MiB" if cuts[best] == EIGHTHS else way(cuts[best])
        self._auto_choices[kind] = (cuts[best], f"{sizes}: {cut_text} (a {_size(probe_bytes)} all-reduce took "
                                                f"{measured})")

    @property
    def pipeline_choice(self) -> str:
        """How messages are cut: the setting, or what "auto" has measured so far."""
        if self.pipeline_bytes is not None:
            return f"set: {'pieces of ' + _size(self.pipeline_bytes) if self.pipeline_bytes else 'whole'}"
        if not self._auto_choices:
            return "auto: not measured yet (no message larger than one piece so far)"
        return "auto: " + "; ".join(self._auto_choices[kind][1] for kind in sorted(self._auto_choices))

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _pipelined(self, pieces: list, first: Callable, second: Callable) -> None:
        """For each piece in turn: first(piece, bank) (it starts the step between the nodes
        and returns its finish), then the previous piece's finish and second(previous piece,
        its bank): so one piece crosses the link while the next one runs through the node's
        ring. Pieces alternate between two banks of work space (_scratch), as the ring's
        slices alternate between two banks of slots."""
        pending = None
        for index, piece in enumerate(pieces):
            bank = index % 2
            finish = first(piece, bank)
            if pending is not None:
                pending[2]()
                second(*pending[:2])
            pending = (piece, bank, finish)
        pending[2]()
        second(*pending[:2])

    def _scratch(self, bank: int, role: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """`numel` elements of work space for `role` in piece bank `bank`, kept from call to
        call (grown when a larger piece needs it): pieces bound it, not messages, unless a
        message goes whole. Fresh tensors for every piece were fresh pages, faulted in on
        every call. Calls run one at a time (the call queue), and on CUDA every use is in
        the current stream's order."""
        key = (bank, role, dtype)
        space = self._work_space.get(key)
        if space is None or space.numel() < numel:
            space = self._work_space[key] = torch.empty(numel, dtype=dtype, device=self.device)
        return space[:numel]

    # --- the three algorithms, on flat contiguous tensors ----------------------------------

    def _all_reduce_flat(self, flat: torch.Tensor, level_op: ReduceOp, divide: bool,
                         into: Optional[torch.Tensor] = None, piece_bytes: Optional[int] = None) -> None:
        """The result goes to `into` (flat and as large), by default `flat` itself.

        Each piece is reduce-scattered in the node (each local index gets its share of the
        piece, reduced over the node), all-reduced between the nodes, and all-gathered in the
        node. How the message is cut into pieces must not change a bit, and the node's ring
        reduces each chunk in an order of its own (the ring's, starting after the chunk's
        owner): so an element must go to the same local index however the message is cut.

        By shard (any node): the message, padded to L equal shards of s elements, is cut as
        the node's ring cuts it, local index l owning shard l; piece k holds the k-th part of
        every shard, copied into work space as L rows (and the result back out), unless the
        message goes whole.

        By range (nodes of at most two ranks, SUM or PRODUCT): the node reduces each element
        with one operation on two operands, and a + b is b + a (IEEE addition and
        multiplication commute, correctly rounded), so which of the two ranks does it cannot
        change a value: piece k is the message's own k-th range, the node's ring reads it and
        writes the result where it lies, and only a last piece that L does not divide goes
        through work space. One exception: where both ranks hold a NaN, of different sign or
        payload, which of the two comes out depends on the order (x86 returns the first
        operand's), so a cut may change that NaN's bits, never its being NaN. (MIN and MAX
        commute too, but for which of -0 and +0 they return: a number's bits, so they go by
        shard.) At 64 MiB over 10 Gbit/s (2 x 2 namespace ranks) the shard copies took 23 of
        90 ms."""
        into = flat if into is None else into
        n, local = flat.numel(), self.local_size
        by_range = local <= 2 and level_op in (ReduceOp.SUM, ReduceOp.PRODUCT)
        shard = -(-n // local)
        parts = self._pieces(shard, local * flat.element_size(), piece_bytes)
        if by_range:  # the same cut, counted in the message's elements
            parts = [slice(part.start * local, min(part.stop * local, n)) for part in parts]
        whole = len(parts) == 1 and shard * local == n  # the message itself is the ring's input and output

        def padded(part: slice) -> int:  # the node ring's input for this piece: L equal chunks
            return -(-(part.stop - part.start) // local) * local

        def ring_space(part: slice, bank: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
            """The node ring's input and output for this piece, L equal chunks each: the
            message and the result where they lie, else one piece of work space for both
            (and True: fill it, empty it). Local index l's chunk of the output is where its
            share is reduced, crosses the link, and is gathered from, in place."""
            if whole:
                return flat, into, False
            if by_range and padded(part) == part.stop - part.start:
                return flat[part], into[part], False
            width = padded(part) // local if by_range else part.stop - part.start
            space = self._scratch(bank, "piece", local * width, flat.dtype)
            return space, space, True

        def first(part: slice, bank: int):
            ring_in, ring_out, in_work_space = ring_space(part, bank)
            if in_work_space and by_range:
                count = part.stop - part.start
                ring_in[:count].copy_(flat[part])
                ring_in[count:].zero_()  # reduced among itself, dropped
            elif in_work_space:
                self._shard_parts(flat, shard, part, ring_in.view(local, -1), into_rows=True)
            mine = ring_out.view(local, -1)[self.local_rank]
            reduced = mine
            if self._pending_check is not None and not in_work_space:
                # The call check still crosses the link: the first stage writes work space
                # only, so a mismatch leaves the user's tensor as it was; the combine between
                # the nodes puts the share in its place.
                reduced = self._scratch(bank, "share", mine.numel(), flat.dtype)
            self.intra.reduce_scatter_tensor(reduced, ring_in, op=level_op)
            return self._start_all_reduce(reduced, level_op, bank, out=mine)

        def second(part: slice, bank: int):
            _, ring_out, in_work_space = ring_space(part, bank)
            self.intra.all_gather_into_tensor(ring_out, ring_out.view(local, -1)[self.local_rank])
            if divide:
                ring_out.div_(self.world_size)
            if in_work_space and by_range:
                into[part].copy_(ring_out[:part.stop - part.start])
            elif in_work_space:
                self._shard_parts(into, shard, part, ring_out.view(local, -1), into_rows=False)

        self._pipelined(parts, first, second)

    @staticmethod
    def _shard_parts(message: torch.Tensor, shard: int, part: slice, rows: torch.Tensor, into_rows: bool) -> None:
        """Row c of `rows` is elements `part` of shard c of `message` (shards of `shard`
        elements; past the message's end, padding): copied into the rows (zeros for the
        padding, which is reduced among itself and dropped), or back out of them."""
        n = message.numel()
        for c in range(rows.shape[0]):
            start = min(c * shard + part.start, n)
            valid = min(c * shard + part.stop, n) - start
            if into_rows:
                rows[c, :valid].copy_(message[start:start + valid])
                rows[c, valid:].zero_()
            else:
                message[start:start + valid].copy_(rows[c, :valid])

    def _node_rows(self, rows: torch.Tensor, node: int, piece: slice, bank: int) -> tuple[torch.Tensor, bool]:
        """Columns `piece` of the rows of `node`'s ranks in `rows` (P rank-ordered rows), as
        one flat tensor for the node's ring: the rows themselves where they lie together
        (a whole row each, a node's ranks numbered one after the other, as torchrun numbers
        them), else work space (and True: copy it in or out)."""
        first, width = self.rank_at[node][0], piece.stop - piece.start
        if width == rows.shape[1] and self.rank_at[node] == list(range(first, first + self.local_size)):
            return rows[first:first + self.local_size].view(-1), False
        return self._scratch(bank, "node rows", self.local_size * width, rows.dtype), True

    def _reduce_scatter_flat(self, output: torch.Tensor, input: torch.Tensor, level_op: ReduceOp,
                             divide: bool) -> None:
        """Per piece of the chunks (the same columns of every chunk): for each node i, its
        ranks' chunks reduce-scattered in this node (local index l gets the chunk of node i's
        rank l, reduced over this node), then between the nodes. An element's chunk, and so
        its order, is the same in every piece."""
        m = output.numel()
        chunks, result = input.view(self.world_size, m), output.view(-1)

        def first(piece: slice, bank: int):
            width = piece.stop - piece.start
            mine = self._scratch(bank, "mine", self.num_nodes * width, input.dtype)  # row i: for node i
            for node in range(self.num_nodes):
                rows, copied = self._node_rows(chunks, node, piece, bank)
                if copied:
                    torch.index_select(chunks[:, piece], 0, self._node_ranks[node],
                                       out=rows.view(self.local_size, width))
                self.intra.reduce_scatter_tensor(mine.view(self.num_nodes, width)[node], rows, op=level_op)
            return self._start_reduce_scatter(result[piece], mine, level_op, bank)

        def second(piece: slice, bank: int):
            if divide:
                result[piece].div_(self.world_size)

        self._pipelined(self._pieces(m, self.world_size * input.element_size(), link_share=0.5), first, second)

    def _all_gather_flat(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Per piece of the input: all-gathered between the nodes (row i: node i's rank of
        this local index), then in the node, node by node, into node i's ranks' rows.
        Gathered into one block and put back in rank order instead, 16 MiB took 23 ms, not
        15 (2 x 2 namespace ranks)."""
        m = input.numel()
        mine, out = input.reshape(-1), output.view(self.world_size, m)

        def first(piece: slice, bank: int):
            by_node = self._scratch(bank, "by_node", self.num_nodes * (piece.stop - piece.start), input.dtype)
            return self._start_all_gather(by_node, mine[piece])

        def second(piece: slice, bank: int):
            width = piece.stop - piece.start
            by_node = self._scratch(bank, "by_node", self.num_nodes * width, input.dtype)
            for node in range(self.num_nodes):
                rows, copied = self._node_rows(out, node, piece, bank)
                self.intra.all_gather_into_tensor(rows, by_node.view(self.num_nodes, width)[node])
                if copied:
                    out[:, piece].index_copy_(0, self._node_ranks[node], rows.view(self.local_size, width))

        self._pipelined(self._pieces(m, self.world_size * input.element_size(), link_share=0.5), first, second)

    # --- the collectives: the Communicator's signatures -----------------------------------

    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False, *,
                   output: Optional[torch.Tensor] = None, algorithm: Optional[str] = None):
        """In place over every rank of every node (see the module docstring); with ``output``,
        into it, ``tensor`` left unchanged (as Communicator.all_reduce)."""
        self._auto_only("all_reduce", algorithm)
        return self._submit_planned("all_reduce", self._all_reduce_run, tensor, op, output, async_op=async_op)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM,
                              async_op: bool = False, *, algorithm: Optional[str] = None):
        """``output = op over ranks of input.view(P, -1)[rank]``."""
        self._auto_only("reduce_scatter_tensor", algorithm)
        return self._submit_planned("reduce_scatter_tensor", self._reduce_scatter_run, output, input, op,
                                    async_op=async_op)

    def all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                               async_op: bool = False, *, algorithm: Optional[str] = None):
        """``output_tensor.view(P, -1)[r] = input_tensor on rank r``."""
        self._auto_only("all_gather_into_tensor", algorithm)
        return self._submit_planned("all_gather_into_tensor", self._all_gather_run, output_tensor, input_tensor,
                                    async_op=async_op)

    # Each method's checks, and what it plans: (run, outputs) for _submit, the tensors it
    # reads and writes (a prepared call's layout), and the call check_call compares
    # (dtype code, op code or -1, the count the Communicator's call names). The run takes
    # flat views made now, as the ring takes addresses and counts at submit: a tensor
    # resized while its call waits in the queue cannot change what crosses the link (a
    # count other than the one checked would make gloo abort the peer's process).

    @staticmethod
    def _auto_only(name: str, algorithm: Optional[str]) -> None:
        """The Communicator's signatures take ``algorithm=``; across machines only the
        default is offered per call so far (each machine's ring runs its communicator's
        algorithm: RINGCOLL_ALGORITHM)."""
        if algorithm not in (None, "auto"):
            raise ValueError(f"{name}: algorithm={algorithm!r} is not offered per call across machines yet (each "
                             "machine's ring runs RINGCOLL_ALGORITHM); leave it out or pass 'auto'")

    def _submit_planned(self, name: str, plan: Callable, *args, async_op: bool) -> Optional[Work]:
        """Check and plan the call (plan(name, *args): one of the *_run methods below), then submit it."""
        run, outputs, _, call = plan(name, *args)
        return self._submit(name, run, outputs, async_op, call)

    def _all_reduce_run(self, name: str, tensor, op, output):
        if output is None:
            dtype, _, count = self._check_tensor(name, "tensor", tensor)
            output = tensor
        else:
            dtype, _, count, _, _, _ = self._check_pair(name, output, tensor, EQUAL)
        level_op, divide, code = self._level_op(name, op, dtype)
        flat, into = tensor.view(-1), output.view(-1)
        return (lambda: self._all_reduce_flat(flat, level_op, divide, into)), [output], (tensor, output), \
            (dtype, code, count)

    def _reduce_scatter_run(self, name: str, output, input, op):
        dtype, _, _, _, count, _ = self._check_pair(name, output, input, SCATTER)
        level_op, divide, code = self._level_op(name, op, dtype)
        flat_out, flat_in = output.view(-1), input.view(-1)
        return (lambda: self._reduce_scatter_flat(flat_out, flat_in, level_op, divide)), [output], (input, output), \
            (dtype, code, count)

    def _all_gather_run(self, name: str, output, input):
        dtype, _, count, _, _, _ = self._check_pair(name, output, input, GATHER)
        flat_out, flat_in = output.view(-1), input.view(-1)
        return (lambda: self._all_gather_flat(flat_out, flat_in)), [output], (input, output), (dtype, -1, count)

    # --- prepared calls (as Communicator.prepare_*) ---------------------------------------

    def prepare_all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM, *, output: Optional[torch.Tensor] = None,
                           algorithm: Optional[str] = None) -> "PreparedHierarchicalCall":
        """all_reduce(tensor, op, output=output), checked now, run by calling the result."""
        name = "prepare_all_reduce"
        self._auto_only(name, algorithm)
        return PreparedHierarchicalCall(self, name, *self._all_reduce_run(name, tensor, op, output))

    def prepare_reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, *,
                                      algorithm: Optional[str] = None) -> "PreparedHierarchicalCall":
        """reduce_scatter_tensor(output, input, op), prepared (see prepare_all_reduce)."""
        name = "prepare_reduce_scatter_tensor"
        self._auto_only(name, algorithm)
        return PreparedHierarchicalCall(self, name, *self._reduce_scatter_run(name, output, input, op))

    def prepare_all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, *,
                                       algorithm: Optional[str] = None) -> "PreparedHierarchicalCall":
        """all_gather_into_tensor(output_tensor, input_tensor), prepared (see prepare_all_reduce)."""
        name = "prepare_all_gather_into_tensor"
        self._auto_only(name, algorithm)
        return PreparedHierarchicalCall(self, name, *self._all_gather_run(name, output_tensor, input_tensor))

    def all_gather(self, tensor_list: list, tensor: torch.Tensor, async_op: bool = False, *,
                   algorithm: Optional[str] = None):
        """``tensor_list[r] = tensor on rank r``."""
        self._auto_only("all_gather", algorithm)
        dtype = self._check_list("all_gather", "tensor_list", tensor_list, tensor)
        flat, source = tensor.new_empty(self.world_size * tensor.numel()), tensor.view(-1)

        def run() -> None:
            self._all_gather_flat(flat, source)
            packing.split_into(flat, tensor_list)

        return self._submit("all_gather", run, list(tensor_list), async_op, (dtype, -1, tensor.numel()))

    def reduce_scatter(self, output: torch.Tensor, input_list: list, op=ReduceOp.SUM, async_op: bool = False, *,
                       algorithm: Optional[str] = None):
        """``output = op over ranks of input_list[rank]``."""
        name = "reduce_scatter"
        self._auto_only(name, algorithm)
        dtype = self._check_list(name, "input_list", input_list, output)
        level_op, divide, code = self._level_op(name, op, dtype)
        flat = packing.concat(input_list)  # taken now: output may alias an entry
        return self._submit(name, lambda: self._reduce_scatter_flat(output, flat, level_op, divide), [output],
                            async_op, (dtype, code, output.numel()))

    def all_reduce_coalesced(self, tensors: list, op=ReduceOp.SUM, async_op: bool = False, *,
                             algorithm: Optional[str] = None):
        """Each tensor all-reduced in place, as one flat call."""
        name = "all_reduce_coalesced"
        self._auto_only(name, algorithm)
        dtype = self._check_same_dtype(name, "tensors", tensors)
        level_op, divide, code = self._level_op(name, op, dtype)
        flat = packing.concat(tensors)

        def run() -> None:
            self._all_reduce_flat(flat, level_op, divide)
            packing.split_into(flat, tensors)

        return self._submit(name, run, list(tensors), async_op, (dtype, code, flat.numel()))

    def all_gather_into_tensor_coalesced(self, outputs: list, inputs: list, async_op: bool = False, *,
                                         algorithm: Optional[str] = None):
        """all_gather_into_tensor for each (outputs[i], inputs[i]) pair, as one flat call."""
        name = "all_gather_into_tensor_coalesced"
        self._auto_only(name, algorithm)
        dtype = self._check_pairs(name, outputs, inputs, GATHER)
        flat_in = packing.concat(inputs)
        gathered = flat_in.new_empty(self.world_size * flat_in.numel())

        def run() -> None:
            self._all_gather_flat(gathered, flat_in)
            packing.gathered_rows_into(gathered, outputs, self.world_size)

        return self._submit(name, run, list(outputs), async_op, (dtype, -1, flat_in.numel()))

    def reduce_scatter_tensor_coalesced(self, outputs: list, inputs: list, op=ReduceOp.SUM,
                                        async_op: bool = False, *, algorithm: Optional[str] = None):
        """reduce_scatter_tensor for each (outputs[i], inputs[i]) pair, as one flat call."""
        name = "reduce_scatter_tensor_coalesced"
        self._auto_only(name, algorithm)
        dtype = self._check_pairs(name, outputs, inputs, SCATTER)
        level_op, divide, code = self._level_op(name, op, dtype)
        flat_in = packing.chunks_by_rank(inputs, self.world_size)
        mine = flat_in.new_empty(flat_in.numel() // self.world_size)

        def run() -> None:
            self._reduce_scatter_flat(mine, flat_in, level_op, divide)
            packing.split_into(mine, outputs)

        return self._submit(name, run, list(outputs), async_op, (dtype, code, mine.numel()))

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False, *, algorithm: Optional[str] = None):
        """In place: ``tensor = tensor on rank src`` on every rank (module docstring)."""
        name = "broadcast"
        self._auto_only(name, algorithm)
        src_node, src_local = self._place_of(name, "src", src)
        dtype, _, count = self._check_tensor(name, "tensor", tensor)
        flat = tensor.view(-1)  # taken now, as the *_run methods take theirs (they say why)

        def run() -> None:
            if self.local_rank == src_local:  # between the nodes: src sends to its peers
                if self.node_index == src_node:
                    self._exchange({node: flat for node in self._other_nodes()}, {})()
                else:
                    self._exchange({}, {src_node: flat})()
            self.intra.broadcast(flat, src_local)

        return self._submit(name, run, [tensor], async_op, (dtype, -1, count, src))

    def reduce(self, tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, async_op: bool = False, *,
               algorithm: Optional[str] = None):
        """In place on rank ``dst`` only (module docstring); every other rank's tensor is left
        as it was, as the Communicator's."""
        name = "reduce"
        self._auto_only(name, algorithm)
        dst_node, dst_local = self._place_of(name, "dst", dst)
        dtype, _, count = self._check_tensor(name, "tensor", tensor)
        level_op, divide, code = self._level_op(name, op, dtype)
        flat = tensor.view(-1)  # taken now, as the *_run methods take theirs (they say why)

        def run() -> None:
            # The node's sum lands on its rank of dst's local index: dst itself, or a copy elsewhere.
            partial = flat if self.rank == dst or self.local_rank != dst_local else flat.clone()
            self.intra.reduce(partial, dst_local, op=level_op)
            # Then the nodes' sums go to dst and combine there in node order, as the all-reduce's
            # do (gloo's reduce dropped a NaN from MIN / MAX, and adds in an order of its own).
            if self.local_rank == dst_local:
                if self.node_index != dst_node:
                    self._exchange({dst_node: partial}, {})()
                else:
                    rows = [partial.clone() if node == dst_node else torch.empty_like(partial)
                            for node in range(self.num_nodes)]
                    self._exchange({}, {node: rows[node] for node in self._other_nodes()})()
                    self._combine_in_node_order(rows, level_op, partial)
            if self.rank == dst and divide:
                flat.div_(self.world_size)

        return self._submit(name, run, [tensor], async_op, (dtype, code, count, dst))

    def _place_of(self, name: str, what: str, rank) -> tuple[int, int]:
        """Group rank `rank`'s (node index, index inside its node); ValueError naming the call if
        it is no rank."""
        check_root(name, what, rank, self.world_size)
        return next((node, ranks.index(rank)) for node, ranks in enumerate(self.rank_at) if rank in ranks)

    def barrier(self, async_op: bool = False):
        """Every rank of the node has entered (the ring), then every node (one rank of each
        node per local index, over the inter-node group): so every rank has."""
        return self._submit("barrier", self._meet, [], async_op)

    def _meet(self) -> None:
        self.intra.barrier()
        # One byte each way with every other node's peer, sent once this node has met.
        heard = {node: torch.empty(1, dtype=torch.uint8, device=self.device) for node in self._other_nodes()}
        self._exchange({node: torch.zeros(1, dtype=torch.uint8, device=self.device) for node in heard}, heard)()


class PreparedHierarchicalCall(PreparedTensors):
    """One hierarchical collective on fixed tensors, checked once (prepare_*), run by calling
    it: ``run = h.prepare_all_reduce(t); run(); run(async_op=True).wait()``. As the ring's
    PreparedCollective, each run first makes sure its tensors are where and what they were
    when prepared (ValueError naming the op, before anything moves); values may change."""

    def __init__(self, comm: HierarchicalCommunicator, name: str, run: Callable[[], None], outputs: list,
                 tensors: tuple, call: tuple):
        super().__init__(name, tensors)
        self._comm, self._run, self._outputs, self._call = comm, run, outputs, call

    def __call__(self, async_op: bool = False):
        if not self._unchanged():
            raise self._changed()
        return self._comm._submit(self._name, self._run, self._outputs, async_op, self._call)
