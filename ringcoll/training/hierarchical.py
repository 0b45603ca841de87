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
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ringcoll._types import ReduceOp, op_code, reduce_op
from ringcoll.communicator import Communicator
from ringcoll.transports.host import shared_memory_domain


def _node_of(rank: int, node_id) -> object:
    if node_id is not None:
        return node_id
    if "RINGCOLL_NODE_ID" in os.environ:
        return os.environ["RINGCOLL_NODE_ID"]
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if local_world > 0:
        return rank // local_world
    return shared_memory_domain()


class HierarchicalCommunicator:
    """All-reduce, reduce-scatter and all-gather over nodes of ranks (module docstring).

    Construction is collective over ``group`` (default: the default group): it creates one
    intra-node ringcoll Communicator per node and one inter-node gloo group per local index.
    """

    def __init__(self, group=None, node_id=None, timeout=None, buffer_bytes=None, inter_backend: str = "gloo"):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        nodes: list = [None] * self.world_size
        dist.all_gather_object(nodes, _node_of(self.rank, node_id), group=self.group)
        order = sorted(set(nodes), key=nodes.index)  # nodes in order of their first rank
        members = {node: [r for r in range(self.world_size) if nodes[r] == node] for node in order}
        sizes = {len(m) for m in members.values()}
        if len(sizes) != 1:
            raise ValueError("HierarchicalCommunicator: every node needs the same number of ranks, got "
                             + ", ".join(f"node {n}: {len(m)}" for n, m in members.items()))
        self.num_nodes, self.local_size = len(order), sizes.pop()
        self.node_index = order.index(nodes[self.rank])
        self.local_rank = members[nodes[self.rank]].index(self.rank)
        # rank_at[node index][local index] = group rank: the layout both levels index into.
        self.rank_at = [members[node] for node in order]

        def global_ranks(ranks):
            return [dist.get_global_rank(self.group, r) if self.group is not dist.group.WORLD else r for r in ranks]

        # new_group is collective over the default group: every rank creates every group, in one order.
        intra_groups = [dist.new_group(global_ranks(m), backend="gloo") for m in self.rank_at]
        inter_groups = [dist.new_group(global_ranks([m[l] for m in self.rank_at]), backend=inter_backend)
                        for l in range(self.local_size)]
        self.intra = Communicator(group=intra_groups[self.node_index], timeout=timeout, buffer_bytes=buffer_bytes)
        self.inter_group = inter_groups[self.local_rank]

    def close(self) -> None:
        self.intra.close()

    def __enter__(self) -> "HierarchicalCommunicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- helpers --------------------------------------------------------------------------

    def _level_op(self, name: str, op, dtype) -> tuple[ReduceOp, bool]:
        """The op both levels use, and whether to divide by P at the end (AVG)."""
        op_code(name, op, dtype)  # validates op x dtype, naming the call
        ours = reduce_op(name, op)
        return (ReduceOp.SUM, True) if ours is ReduceOp.AVG else (ours, False)

    def _check_whole_and_part(self, name: str, whole_name: str, whole, part_name: str, part) -> None:
        """Both valid tensors of one dtype, `whole` holding world_size x `part`'s elements."""
        self.intra._check_tensor(name, whole_name, whole)
        self.intra._check_tensor(name, part_name, part)
        if whole.numel() != part.numel() * self.world_size or whole.dtype != part.dtype:
            raise ValueError(f"{name}: {whole_name} must have world_size ({self.world_size}) x {part_name}'s "
                             f"{part.numel()} elements, of its dtype ({part.dtype})")

    def _inter_op(self, op: ReduceOp):
        return getattr(dist.ReduceOp, op.name)

    # --- the collectives ------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM) -> None:
        """In place, over every rank of every node (see the module docstring)."""
        name = "all_reduce"
        self.intra._check_tensor(name, "tensor", tensor)
        level_op, divide = self._level_op(name, op, tensor.dtype)
        n, local = tensor.numel(), self.local_size
        shard = -(-n // local)  # ceil: the padded message splits into L equal shards
        padded = tensor.new_zeros(shard * local)
        padded[:n].copy_(tensor.reshape(-1))
        mine = padded.new_empty(shard)
        self.intra.reduce_scatter_tensor(mine, padded, op=level_op)
        dist.all_reduce(mine, op=self._inter_op(level_op), group=self.inter_group)
        self.intra.all_gather_into_tensor(padded, mine)
        result = padded[:n].view_as(tensor)
        tensor.copy_(result / self.world_size if divide else result)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM) -> None:
        """``output = op over ranks of input.view(P, -1)[rank]``."""
        name = "reduce_scatter_tensor"
        self._check_whole_and_part(name, "input", input, "output", output)
        level_op, divide = self._level_op(name, op, input.dtype)
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

    def all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor) -> None:
        """``output_tensor.view(P, -1)[r] = input_tensor on rank r``."""
        name = "all_gather_into_tensor"
        self._check_whole_and_part(name, "output_tensor", output_tensor, "input_tensor", input_tensor)
        m = input_tensor.numel()
        across_nodes = input_tensor.new_empty(self.num_nodes * m)
        dist.all_gather_into_tensor(across_nodes, input_tensor.reshape(-1).contiguous(), group=self.inter_group)
        by_local = input_tensor.new_empty(self.local_size * self.num_nodes * m)
        self.intra.all_gather_into_tensor(by_local, across_nodes)
        blocks = by_local.view(self.local_size, self.num_nodes, m)
        out = output_tensor.view(self.world_size, m)
        for node in range(self.num_nodes):
            for l in range(self.local_size):
                out[self.rank_at[node][l]].copy_(blocks[l, node])
