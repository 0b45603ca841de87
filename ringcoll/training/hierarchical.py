"""Hierarchical collectives: ringcoll's ring inside a node, torch.distributed between nodes.

Ranks are grouped by node (an explicit ``node_id``, else ``RINGCOLL_NODE_ID``, else
``rank // LOCAL_WORLD_SIZE``, else the ranks that can share memory: one kernel and one
/dev/shm). With N nodes of L ranks each, and ``local`` a rank's index
inside its node:

    all-reduce      1. reduce-scatter inside the node (ringcoll): local rank l now holds
                       shard l of the message, reduced over its node;
                    2. all-reduce of that shard across nodes (torch.distributed, one group
                       per local index: gloo between CPU nodes, NCCL between GPU nodes);
                    3. all-gather inside the node (ringcoll).
                    Each rank puts 2(L-1)/L * n bytes on the fast intra-node ring and only
                    2(N-1)/N * n/L on the slow inter-node link: the node's L links share
                    the inter-node traffic, which is why two levels beat one flat ring.
    reduce-scatter  the input's P = N*L chunks are regrouped by local index; reduce-scatter
                    inside the node leaves rank l the N chunks of the ranks that share its
                    local index, reduced over the node; a reduce-scatter across nodes gives
                    each its own chunk.
    all-gather      the reverse: all-gather across nodes, then inside the node, then the
                    chunks are put back in rank order.

AVG is SUM at both levels and one division by P at the end (gloo has no AVG, and dividing
once rounds once). Every node must have the same number of ranks.

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
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ringcoll import packing
from ringcoll._types import DTYPE_NAMES, ReduceOp, op_code, reduce_op
from ringcoll.communicator import (EQUAL, GATHER, SCATTER, ArgumentChecks, Communicator, PreparedTensors, Work,
                                   _resolve_check, call_details, resolve_timeout, submit_profiled)
from ringcoll.errors import RingcollError, RingcollMismatchError, RingcollPeerError, RingcollTimeoutError
from ringcoll.transports.host import CallQueue, ThreadCompletion, ranks_by_domain, shared_memory_domain


#: the user's collectives, as check_call numbers them
USER_CALLS = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "reduce_scatter",
              "all_reduce_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "barrier")


def describe_call(user_call) -> str:
    """(collective index, dtype code, op code or -1, count) in words: 'all_reduce of 1001 float32 (SUM)'."""
    collective, dtype, op, count = user_call
    if dtype < 0:
        return USER_CALLS[collective]
    reduction = f" ({ReduceOp(op).name})" if op >= 0 else ""
    return f"{USER_CALLS[collective]} of {count} {DTYPE_NAMES[dtype]}{reduction}"


def _node_of(rank: int, node_id) -> object:
    if node_id is not None:
        return node_id
    if "RINGCOLL_NODE_ID" in os.environ:
        return os.environ["RINGCOLL_NODE_ID"]
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if local_world > 0:
        return rank // local_world
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


class HierarchicalCommunicator(ArgumentChecks):
    """All-reduce, reduce-scatter and all-gather over nodes of ranks (module docstring).

    Construction is collective over ``group`` (default: the default group): each rank makes
    the two groups it belongs to, its node's (the intra-node ringcoll Communicator for
    ``device`` is built on it) and its local index's (``inter_backend``: by default gloo for
    CPU tensors, NCCL for CUDA ones), in that order on every rank. Ranks outside ``group``
    need not take part.
    """

    def __init__(self, group=None, node_id=None, timeout=None, buffer_bytes=None, inter_backend: Optional[str] = None,
                 check=None, device="cpu"):
        self.group = group if group is not None else dist.group.WORLD
        self.device = torch.device(device)
        inter_backend = inter_backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.timeout = resolve_timeout(timeout)
        self.check = _resolve_check(check)
        offers: list = [None] * self.world_size
        dist.all_gather_object(offers, (_node_of(self.rank, node_id), socket.gethostname(), self.check),
                               group=self.group)
        if len({check for _, _, check in offers}) != 1:  # some ranks would run the check's calls, some not
            raise ValueError("HierarchicalCommunicator: check= / RINGCOLL_CHECK must be the same on every rank, got "
                             + ", ".join(f"rank {r}: {c}" for r, (_, _, c) in enumerate(offers)))
        nodes = [node for node, _, _ in offers]
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
            return [dist.get_global_rank(self.group, r) if self.group is not dist.group.WORLD else r for r in ranks]

        # use_local_synchronization: only the members make a group, so this also works inside
        # a subgroup, and the node's group comes first on every rank (no crossed waits).
        # Both groups get the communicator's timeout: torch's default (30 min) would let a
        # link that went down hang every rank far past it.
        group_timeout = datetime.timedelta(seconds=self.timeout)
        node_group = dist.new_group(global_ranks(self.rank_at[self.node_index]), backend="gloo",
                                    use_local_synchronization=True, timeout=group_timeout)
        self.inter_ranks = [m[self.local_rank] for m in self.rank_at]  # one rank per node: this rank's local index
        self.inter_group = dist.new_group(global_ranks(self.inter_ranks), backend=inter_backend,
                                          use_local_synchronization=True, timeout=group_timeout)
        # The node's ring checks nothing itself: check_call below compares every user call
        # across all nodes, and the ring's calls follow from it.
        self.intra = Communicator(group=node_group, device=self.device, timeout=self.timeout,
                                  buffer_bytes=buffer_bytes, check=False)
        self.device = self.intra.device  # with its index
        self._calls = CallQueue()
        self._broken_reason = ""

    def close(self) -> None:
        """Finish queued work, then release the intra-node ring. Idempotent."""
        self._calls.close(self.intra.close)
        self.group = self.inter_group = None  # released, as Communicator._close releases its group

    def __enter__(self) -> "HierarchicalCommunicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- helpers --------------------------------------------------------------------------

    def _level_op(self, name: str, op, dtype: int) -> tuple[ReduceOp, bool, int]:
        """The op both levels use, whether to divide by P at the end (AVG), and the user's op
        code (for check_call); `dtype`: the code the checks returned."""
        code = op_code(name, op, dtype)  # validates op x dtype, naming the call
        ours = reduce_op(name, op)
        return (ReduceOp.SUM, True, code) if ours is ReduceOp.AVG else (ours, False, code)

    def _inter_op(self, op: ReduceOp):
        return getattr(dist.ReduceOp, op.name)

    @property
    def broken(self) -> bool:
        return bool(self._broken_reason)

    def _submit(self, name: str, run: Callable[[], None], outputs: list, async_op: bool,
                call: tuple = ()) -> Optional[Work]:
        """Run the validated call now, or queued in call order (a Work, as the ring's). On
        CUDA both levels enqueue on the current stream without blocking the host (the ring
        and NCCL alike), so the call runs now even when async: its Work is already done.
        `call` is (dtype code, op code or -1, count): what check_call compares."""
        if self.group is None:
            raise RingcollError(f"{name}: communicator is closed")
        if self._broken_reason:
            raise RingcollError(f"{name}: communicator is broken by an earlier error ({self._broken_reason})")
        collective = USER_CALLS.index(name.removeprefix("prepare_"))  # a prepared run is its collective
        user_call = (collective, *call) if call else (collective, -1, -1, 0)
        run = functools.partial(self._run_checked, name, user_call, run)

        def submit() -> Optional[ThreadCompletion]:
            if self.device.type != "cuda":
                return self._calls.submit(run, async_op, name)
            self._calls.submit(run, async_op=False)
            return ThreadCompletion.finished(name) if async_op else None

        _, dtype, op, count = user_call
        completion = submit_profiled(name, outputs, lambda: call_details(None if dtype < 0 else dtype,
                                                                        None if op < 0 else op, count), submit)
        return None if completion is None else Work(completion, outputs)

    def _run_checked(self, name: str, user_call: tuple, run: Callable[[], None]) -> None:
        """run() once every rank's call is known to be this one (check_call); an error of
        either level is raised in the user's terms: the user's collective, group ranks, and
        host names. Any error breaks the communicator, as it breaks the ring."""
        try:
            if self.check:
                self._check_call(name, user_call)
            run()
        except RingcollMismatchError as e:
            self._broken_reason = str(e)
            raise
        except RingcollError as e:  # the node's ring: its ranks are numbered within the node
            self._broken_reason = f"{name}: {e}"
            # Led by the user's global rank, as the error between hosts is: which of the two
            # a rank sees first when a link fails is a race, and the message must not depend on it.
            raise type(e)(f"{name}: rank {self.rank} on host {self.node_names[self.node_index]}, on its host's ring, "
                          f"whose ranks (numbered 0..{self.local_size - 1} below) are ranks "
                          f"{self._ranks_text(self.rank_at[self.node_index])} (pids as that host sees them): {e}") from e
        except RuntimeError as e:  # torch.distributed between the nodes (gloo, NCCL)
            self._broken_reason = f"{name}: {e}"
            peers = ", ".join(f"rank {r} on {self.node_names[i]}" for i, r in enumerate(self.inter_ranks)
                              if r != self.rank)
            timed_out = "timed out" in str(e).lower()
            error = RingcollTimeoutError if timed_out else RingcollPeerError
            what = f"heard nothing within the {self.timeout:g} s timeout" if timed_out else "lost the link"
            raise error(f"{name}: rank {self.rank} on host {self.node_names[self.node_index]} {what} from the other "
                        f"hosts ({peers}): {type(e).__name__}: {e}") from e

    @staticmethod
    def _ranks_text(ranks) -> str:
        return ", ".join(map(str, ranks))

    def _check_call(self, name: str, user_call: tuple) -> None:
        """Raise RingcollMismatchError on every rank, before any data moves, unless every rank
        of every node made this call: each node gathers its ranks' calls on its ring, then the
        nodes exchange theirs (two fixed-size calls, so they cannot mismatch themselves). A
        check per node only would let two nodes that agree inside differ from each other
        and fail inside gloo."""
        mine = torch.tensor(user_call, dtype=torch.int64, device=self.device)
        node_calls = mine.new_empty(self.local_size * mine.numel())
        self.intra.all_gather_into_tensor(node_calls, mine)
        every_call = node_calls.new_empty(self.num_nodes * node_calls.numel())
        dist.all_gather_into_tensor(every_call, node_calls, group=self.inter_group)
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
                                    f"{self.num_nodes} hosts ({', '.join(self.node_names)}): {what}; nothing was "
                                    "moved")

    # --- the three algorithms, on flat contiguous tensors ----------------------------------

    def _all_reduce_flat(self, flat: torch.Tensor, level_op: ReduceOp, divide: bool,
                         into: Optional[torch.Tensor] = None) -> None:
        """The result goes to `into` (flat and as large), by default `flat` itself."""
        n, local = flat.numel(), self.local_size
        shard = -(-n // local)  # ceil: the padded message splits into L equal shards
        padded = flat.new_zeros(shard * local)
        padded[:n].copy_(flat)
        mine = padded.new_empty(shard)
        self.intra.reduce_scatter_tensor(mine, padded, op=level_op)
        dist.all_reduce(mine, op=self._inter_op(level_op), group=self.inter_group)
        self.intra.all_gather_into_tensor(padded, mine)
        (flat if into is None else into).copy_(padded[:n] / self.world_size if divide else padded[:n])

    def _reduce_scatter_flat(self, output: torch.Tensor, input: torch.Tensor, level_op: ReduceOp,
                             divide: bool) -> None:
        m = output.numel()
        chunks = input.view(self.world_size, m)
        # Regroup: local index l's block holds the chunks of ranks rank_at[0][l], rank_at[1][l], ...
        by_local = torch.stack([chunks[self.rank_at[node][l]] for l in range(self.local_size)
                                for node in range(self.num_nodes)])
        mine = by_local.new_empty(self.num_nodes * m)
        self.intra.reduce_scatter_tensor(mine, by_local.view(-1), op=level_op)
        result = output.new_empty(m)
        dist.reduce_scatter_tensor(result, mine, op=self._inter_op(level_op), group=self.inter_group)
        output.copy_((result / self.world_size if divide else result).view_as(output))

    def _all_gather_flat(self, output: torch.Tensor, input: torch.Tensor) -> None:
        m = input.numel()
        across_nodes = input.new_empty(self.num_nodes * m)
        dist.all_gather_into_tensor(across_nodes, input.reshape(-1), group=self.inter_group)
        by_local = input.new_empty(self.local_size * self.num_nodes * m)
        self.intra.all_gather_into_tensor(by_local, across_nodes)
        blocks = by_local.view(self.local_size, self.num_nodes, m)
        out = output.view(self.world_size, m)
        for node in range(self.num_nodes):
            for l in range(self.local_size):
                out[self.rank_at[node][l]].copy_(blocks[l, node])

    # --- the collectives: the Communicator's signatures -----------------------------------

    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False, *,
                   output: Optional[torch.Tensor] = None):
        """In place over every rank of every node (see the module docstring); with ``output``,
        into it, ``tensor`` left unchanged (as Communicator.all_reduce)."""
        return self._submit_planned("all_reduce", self._all_reduce_run, tensor, op, output, async_op=async_op)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM,
                              async_op: bool = False):
        """``output = op over ranks of input.view(P, -1)[rank]``."""
        return self._submit_planned("reduce_scatter_tensor", self._reduce_scatter_run, output, input, op,
                                    async_op=async_op)

    def all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                               async_op: bool = False):
        """``output_tensor.view(P, -1)[r] = input_tensor on rank r``."""
        return self._submit_planned("all_gather_into_tensor", self._all_gather_run, output_tensor, input_tensor,
                                    async_op=async_op)

    # Each method's checks, and what it plans: (run, outputs) for _submit, the tensors it
    # reads and writes (a prepared call's layout), and the call check_call compares
    # (dtype code, op code or -1, the count the Communicator's call names).

    def _submit_planned(self, name: str, plan: Callable, *args, async_op: bool) -> Optional[Work]:
        """Check and plan the call (plan(name, *args): one of the *_run methods below), then submit it."""
        run, outputs, _, call = plan(name, *args)
        return self._submit(name, run, outputs, async_op, call)

    def _all_reduce_run(self, name: str, tensor, op, output):
        if output is None:
            dtype, _, count = self._check_tensor(name, "tensor", tensor)
            output = tensor
        else:
            dtype, _, count, _, _ = self._check_pair(name, output, tensor, EQUAL)
        level_op, divide, code = self._level_op(name, op, dtype)
        return (lambda: self._all_reduce_flat(tensor.view(-1), level_op, divide, output.view(-1))), [output], \
            (tensor, output), (dtype, code, count)

    def _reduce_scatter_run(self, name: str, output, input, op):
        dtype, _, _, _, count = self._check_pair(name, output, input, SCATTER)
        level_op, divide, code = self._level_op(name, op, dtype)
        return (lambda: self._reduce_scatter_flat(output, input, level_op, divide)), [output], (input, output), \
            (dtype, code, count)

    def _all_gather_run(self, name: str, output, input):
        dtype, _, count, _, _ = self._check_pair(name, output, input, GATHER)
        return (lambda: self._all_gather_flat(output, input)), [output], (input, output), (dtype, -1, count)

    # --- prepared calls (as Communicator.prepare_*) ---------------------------------------

    def prepare_all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM, *,
                           output: Optional[torch.Tensor] = None) -> "PreparedHierarchicalCall":
        """all_reduce(tensor, op, output=output), checked now, run by calling the result."""
        name = "prepare_all_reduce"
        return PreparedHierarchicalCall(self, name, *self._all_reduce_run(name, tensor, op, output))

    def prepare_reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor,
                                      op=ReduceOp.SUM) -> "PreparedHierarchicalCall":
        """reduce_scatter_tensor(output, input, op), prepared (see prepare_all_reduce)."""
        name = "prepare_reduce_scatter_tensor"
        return PreparedHierarchicalCall(self, name, *self._reduce_scatter_run(name, output, input, op))

    def prepare_all_gather_into_tensor(self, output_tensor: torch.Tensor,
                                       input_tensor: torch.Tensor) -> "PreparedHierarchicalCall":
        """all_gather_into_tensor(output_tensor, input_tensor), prepared (see prepare_all_reduce)."""
        name = "prepare_all_gather_into_tensor"
        return PreparedHierarchicalCall(self, name, *self._all_gather_run(name, output_tensor, input_tensor))

    def all_gather(self, tensor_list: list, tensor: torch.Tensor, async_op: bool = False):
        """``tensor_list[r] = tensor on rank r``."""
        dtype = self._check_list("all_gather", "tensor_list", tensor_list, tensor)
        flat = tensor.new_empty(self.world_size * tensor.numel())

        def run() -> None:
            self._all_gather_flat(flat, tensor)
            packing.split_into(flat, tensor_list)

        return self._submit("all_gather", run, list(tensor_list), async_op, (dtype, -1, tensor.numel()))

    def reduce_scatter(self, output: torch.Tensor, input_list: list, op=ReduceOp.SUM, async_op: bool = False):
        """``output = op over ranks of input_list[rank]``."""
        name = "reduce_scatter"
        dtype = self._check_list(name, "input_list", input_list, output)
        level_op, divide, code = self._level_op(name, op, dtype)
        flat = packing.concat(input_list)  # taken now: output may alias an entry
        return self._submit(name, lambda: self._reduce_scatter_flat(output, flat, level_op, divide), [output],
                            async_op, (dtype, code, output.numel()))

    def all_reduce_coalesced(self, tensors: list, op=ReduceOp.SUM, async_op: bool = False):
        """Each tensor all-reduced in place, as one flat call."""
        name = "all_reduce_coalesced"
        dtype = self._check_same_dtype(name, "tensors", tensors)
        level_op, divide, code = self._level_op(name, op, dtype)
        flat = packing.concat(tensors)

        def run() -> None:
            self._all_reduce_flat(flat, level_op, divide)
            packing.split_into(flat, tensors)

        return self._submit(name, run, list(tensors), async_op, (dtype, code, flat.numel()))

    def all_gather_into_tensor_coalesced(self, outputs: list, inputs: list, async_op: bool = False):
        """all_gather_into_tensor for each (outputs[i], inputs[i]) pair, as one flat call."""
        name = "all_gather_into_tensor_coalesced"
        dtype = self._check_pairs(name, outputs, inputs, GATHER)
        flat_in = packing.concat(inputs)
        gathered = flat_in.new_empty(self.world_size * flat_in.numel())

        def run() -> None:
            self._all_gather_flat(gathered, flat_in)
            packing.gathered_rows_into(gathered, outputs, self.world_size)

        return self._submit(name, run, list(outputs), async_op, (dtype, -1, flat_in.numel()))

    def reduce_scatter_tensor_coalesced(self, outputs: list, inputs: list, op=ReduceOp.SUM,
                                        async_op: bool = False):
        """reduce_scatter_tensor for each (outputs[i], inputs[i]) pair, as one flat call."""
        name = "reduce_scatter_tensor_coalesced"
        dtype = self._check_pairs(name, outputs, inputs, SCATTER)
        level_op, divide, code = self._level_op(name, op, dtype)
        flat_in = packing.chunks_by_rank(inputs, self.world_size)
        mine = flat_in.new_empty(flat_in.numel() // self.world_size)

        def run() -> None:
            self._reduce_scatter_flat(mine, flat_in, level_op, divide)
            packing.split_into(mine, outputs)

        return self._submit(name, run, list(outputs), async_op, (dtype, code, mine.numel()))

    def barrier(self, async_op: bool = False):
        """Every rank of the node has entered (the ring), then every node (one rank of each
        node per local index, over the inter-node group): so every rank has."""
        def run() -> None:
            self.intra.barrier()
            dist.barrier(group=self.inter_group)

        return self._submit("barrier", run, [], async_op)


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
