"""How the list and coalesced forms become one flat call, and back (one place for both
communicators: the ring's and the hierarchical one).

A ring call moves one contiguous buffer. The forms that take several tensors are packed
into one, run once (one ring, not one per tensor: as NCCL's grouped calls), and unpacked:

    all_reduce_coalesced          [t_0, ..., t_k]      -> cat       -> all-reduce -> split back
    all_gather (list)             t                    -> all-gather into (P, n) -> row r to list[r]
    reduce_scatter (list)         [in_0, ..., in_{P-1}] -> cat     -> reduce-scatter
    all_gather_into_tensor_coalesced
                                  inputs i of n_i      -> cat (S = sum n_i) -> all-gather into
                                  (P, S) -> columns of tensor i to outputs[i].view(P, n_i)
    reduce_scatter_tensor_coalesced
                                  inputs i of P x m_i  -> (P, M = sum m_i), row r holding every
                                  input's chunk r -> reduce-scatter -> split into outputs[i]

Packing copies the inputs when the call is made, so outputs may alias inputs. Unpacking
writes the outputs as the tensor forms (and gloo) do, as memory, not as autograd in-place
ops: under inference mode, so a leaf that requires grad or an inference tensor takes it
(autograd refused the second output after the first was written).
"""

from __future__ import annotations

import torch


def concat(tensors) -> torch.Tensor:
    """The tensors, flattened, one after the other (a fresh buffer)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def split_into(flat: torch.Tensor, tensors) -> None:
    """The inverse of concat: each tensor gets its elements of `flat` back, in order."""
    offset = 0
    with torch.inference_mode():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def gathered_rows_into(gathered: torch.Tensor, outputs, world_size: int) -> None:
    """All-gather's flat result, rank by rank, into per-tensor outputs: `gathered` is
    (P, S) where each rank's row is the concat of its inputs; outputs[i] is (P, n_i)."""
    rows = gathered.view(world_size, -1)
    offset = 0
    with torch.inference_mode():
        for out in outputs:
            width = out.numel() // world_size
            out.view(world_size, width).copy_(rows[:, offset:offset + width])
            offset += width


def chunks_by_rank(inputs, world_size: int) -> torch.Tensor:
    """Reduce-scatter inputs (each P x m_i) packed so that row r holds every input's chunk
    r: reduce-scatter of the result leaves rank r the concat of its output chunks."""
    return torch.cat([t.reshape(world_size, -1) for t in inputs], dim=1).reshape(-1)
