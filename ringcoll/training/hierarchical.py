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

import concurrent.futures
import os
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ringcoll import packing
from ringcoll._types import ReduceOp, op_code, reduce_op
from ringcoll.communicator import EQUAL, GATHER, SCATTER, ArgumentChecks, Communicator, PreparedTensors, Work
from ringcoll.transports.host import CallQueue, ThreadCompletion, ranks_by_domain, shared_memory_domain


def _node_of(rank: int, node_id) -> object:
    if node_id is not None:
        return node_id
    if "RINGCOLL_NODE_ID" in os.environ:
        return os.environ["RINGCOLL_NODE_ID"]
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if local_world > 0:
        return rank // local_world
    return shared_memory_domain()


def uneven_nodes_message(who: str, members: dict) -> Optional[str]:
    """Why nodes of different sizes cannot run hierarchically, or None when they are even.
    `members` maps each node to its ranks."""
    if len({len(ranks) for ranks in members.values()}) == 1:
        return None
    layout = "; ".join(f"node {node}: {len(ranks)} (ranks {', '.join(map(str, ranks))})"
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
        nodes: list = [None] * self.world_size
        dist.all_gather_object(nodes, _node_of(self.rank, node_id), group=self.group)
        members = ranks_by_domain(nodes)  # nodes in order of their first rank
        order = list(members)
        uneven = uneven_nodes_message("HierarchicalCommunicator", members)
        if uneven:
            raise ValueError(uneven)
        self.num_nodes, self.local_size = len(order), len(members[order[0]])
        self.node_index = order.index(nodes[self.rank])
        self.local_rank = members[nodes[self.rank]].index(self.rank)
        # rank_at[node index][local index] = group rank: the layout both levels index into.
        self.rank_at = [members[node] for node in order]

        def global_ranks(ranks):
            return [dist.get_global_rank(self.group, r) if self.group is not dist.group.WORLD else r for r in ranks]

        # use_local_synchronization: only the members make a group, so this also works inside
        # a subgroup, and the node's group comes first on every rank (no crossed waits).
        node_group = dist.new_group(global_ranks(self.rank_at[self.node_index]), backend="gloo",
                                    use_local_synchronization=True)
        self.inter_group = dist.new_group(global_ranks([m[self.local_rank] for m in self.rank_at]),
                                          backend=inter_backend, use_local_synchronization=True)
        self.intra = Communicator(group=node_group, device=self.device, timeout=timeout, buffer_bytes=buffer_bytes,
                                  check=check)
        self.device = self.intra.device  # with its index
        self._calls = CallQueue()

    def close(self) -> None:
        """Finish queued work, then release the intra-node ring. Idempotent."""
        self._calls.close(self.intra.close)

    def __enter__(self) -> "HierarchicalCommunicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- helpers --------------------------------------------------------------------------

    def _level_op(self, name: str, op, dtype: int) -> tuple[ReduceOp, bool]:
        """The op both levels use, and whether to divide by P at the end (AVG); `dtype`: the
        code the checks returned."""
        op_code(name, op, dtype)  # validates op x dtype, naming the call
        ours = reduce_op(name, op)
        return (ReduceOp.SUM, True) if ours is ReduceOp.AVG else (ours, False)

    def _inter_op(self, op: ReduceOp):
        return getattr(dist.ReduceOp, op.name)

    def _submit(self, run: Callable[[], None], outputs: list, async_op: bool) -> Optional[Work]:
        """Run the validated call now, or queued in call order (a Work, as the ring's). On
        CUDA both levels enqueue on the current stream without blocking the host (the ring
        and NCCL alike), so the call runs now even when async: its Work is already done."""
        if self.device.type == "cuda":
            self._calls.submit(run, async_op=False)
            if not async_op:
                return None
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(None)
            return Work(ThreadCompletion(done), outputs)
        completion = self._calls.submit(run, async_op)
        return None if completion is None else Work(completion, outputs)

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
        return self._submit_planned(self._all_reduce_run("all_reduce", tensor, op, output), async_op)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM,
                              async_op: bool = False):
        """``output = op over ranks of input.view(P, -1)[rank]``."""
        return self._submit_planned(self._reduce_scatter_run("reduce_scatter_tensor", output, input, op), async_op)

    def all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                               async_op: bool = False):
        """``output_tensor.view(P, -1)[r] = input_tensor on rank r``."""
        return self._submit_planned(self._all_gather_run("all_gather_into_tensor", output_tensor, input_tensor),
                                    async_op)

    # Each method's checks, and what it plans: (run, outputs) for _submit, then the tensors
    # it reads and writes (a prepared call's layout).

    def _submit_planned(self, planned: tuple, async_op: bool) -> Optional[Work]:
        run, outputs, _ = planned
        return self._submit(run, outputs, async_op)

    def _all_reduce_run(self, name: str, tensor, op, output):
        if output is None:
            dtype = self._check_tensor(name, "tensor", tensor)[0]
            output = tensor
        else:
            dtype = self._check_pair(name, output, tensor, EQUAL)[0]
        level_op, divide = self._level_op(name, op, dtype)
        return (lambda: self._all_reduce_flat(tensor.view(-1), level_op, divide, output.view(-1))), [output], \
            (tensor, output)

    def _reduce_scatter_run(self, name: str, output, input, op):
        dtype = self._check_pair(name, output, input, SCATTER)[0]
        level_op, divide = self._level_op(name, op, dtype)
        return (lambda: self._reduce_scatter_flat(output, input, level_op, divide)), [output], (input, output)

    def _all_gather_run(self, name: str, output, input):
        self._check_pair(name, output, input, GATHER)
        return (lambda: self._all_gather_flat(output, input)), [output], (input, output)

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
        self._check_list("all_gather", "tensor_list", tensor_list, tensor)
        flat = tensor.new_empty(self.world_size * tensor.numel())

        def run() -> None:
            self._all_gather_flat(flat, tensor)
            packing.split_into(flat, tensor_list)

        return self._submit(run, list(tensor_list), async_op)

    def reduce_scatter(self, output: torch.Tensor, input_list: list, op=ReduceOp.SUM, async_op: bool = False):
        """``output = op over ranks of input_list[rank]``."""
        name = "reduce_scatter"
        dtype = self._check_list(name, "input_list", input_list, output)
        level_op, divide = self._level_op(name, op, dtype)
        flat = packing.concat(input_list)  # taken now: output may alias an entry
        return self._submit(lambda: self._reduce_scatter_flat(output, flat, level_op, divide), [output], async_op)

    def all_reduce_coalesced(self, tensors: list, op=ReduceOp.SUM, async_op: bool = False):
        """Each tensor all-reduced in place, as one flat call."""
        name = "all_reduce_coalesced"
        dtype = self._check_same_dtype(name, "tensors", tensors)
        level_op, divide = self._level_op(name, op, dtype)
        flat = packing.concat(tensors)

        def run() -> None:
            self._all_reduce_flat(flat, level_op, divide)
            packing.split_into(flat, tensors)

        return self._submit(run, list(tensors), async_op)

    def all_gather_into_tensor_coalesced(self, outputs: list, inputs: list, async_op: bool = False):
        """all_gather_into_tensor for each (outputs[i], inputs[i]) pair, as one flat call."""
        self._check_pairs("all_gather_into_tensor_coalesced", outputs, inputs, GATHER)
        flat_in = packing.concat(inputs)
        gathered = flat_in.new_empty(self.world_size * flat_in.numel())

        def run() -> None:
            self._all_gather_flat(gathered, flat_in)
            packing.gathered_rows_into(gathered, outputs, self.world_size)

        return self._submit(run, list(outputs), async_op)

    def reduce_scatter_tensor_coalesced(self, outputs: list, inputs: list, op=ReduceOp.SUM,
                                        async_op: bool = False):
        """reduce_scatter_tensor for each (outputs[i], inputs[i]) pair, as one flat call."""
        name = "reduce_scatter_tensor_coalesced"
        dtype = self._check_pairs(name, outputs, inputs, SCATTER)
        level_op, divide = self._level_op(name, op, dtype)
        flat_in = packing.chunks_by_rank(inputs, self.world_size)
        mine = flat_in.new_empty(flat_in.numel() // self.world_size)

        def run() -> None:
            self._reduce_scatter_flat(mine, flat_in, level_op, divide)
            packing.split_into(mine, outputs)

        return self._submit(run, list(outputs), async_op)

    def barrier(self, async_op: bool = False):
        """Every rank of the node has entered (the ring), then every node (one rank of each
        node per local index, over the inter-node group): so every rank has."""
        def run() -> None:
            self.intra.barrier()
            dist.barrier(group=self.inter_group)

        return self._submit(run, [], async_op)


class PreparedHierarchicalCall(PreparedTensors):
    """One hierarchical collective on fixed tensors, checked once (prepare_*), run by calling
    it: ``run = h.prepare_all_reduce(t); run(); run(async_op=True).wait()``. As the ring's
    PreparedCollective, each run first makes sure its tensors are where and what they were
    when prepared (ValueError naming the op, before anything moves); values may change."""

    def __init__(self, comm: HierarchicalCommunicator, name: str, run: Callable[[], None], outputs: list,
                 tensors: tuple):
        super().__init__(name, tensors)
        self._comm, self._run, self._outputs = comm, run, outputs

    def __call__(self, async_op: bool = False):
        if not self._unchanged():
            raise self._changed()
        return self._comm._submit(self._run, self._outputs, async_op)
