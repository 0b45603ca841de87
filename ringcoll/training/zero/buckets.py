"""The bucket layout: which parameters share a flat buffer, and each rank's shard of it.

:func:`_plan_buckets` cuts one parameter group into buckets (per dtype, reverse order, up to
``bucket_bytes``); a :class:`_Bucket` is one of them: the padded flat buffer the model's
parameters become views into, this rank's shard of it, and the shard parameter the wrapped
optimizer updates (the package doc draws the picture).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 25 << 20  # DDP's default bucket_cap_mb = 25
_LOW_PRECISION = (torch.float16, torch.bfloat16)  # these buckets get an fp32 master copy


def _tensor_bytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _plan_buckets(params: List[torch.nn.Parameter], bucket_bytes: int) -> List[List[torch.nn.Parameter]]:
    """Per dtype, in reverse order, greedily up to bucket_bytes each."""
    by_dtype: Dict[torch.dtype, list] = {}
    for p in reversed(params):
        by_dtype.setdefault(p.dtype, []).append(p)
    chunks = []
    for ps in by_dtype.values():
        current, size = [], 0
        for p in ps:
            nbytes = _tensor_bytes(p)
            if current and size + nbytes > bucket_bytes:
                chunks.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            chunks.append(current)
    return chunks


class _Bucket:
    """Parameters of one (group, dtype) flattened into one padded buffer, cut into P shards."""

    def __init__(self, index: int, group_index: int, params: List[torch.nn.Parameter], world: int, rank: int):
        self.index = index
        self.group_index = group_index
        self.params = params
        self.world_size = world
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)
        self.shard_numel = -(-self.numel // world)  # ceil; a bucket of n < P elements still gives every rank 1
        self.padded = self.shard_numel * world
        self.rank = rank
        self.flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        self.shard = self.flat[rank * self.shard_numel:(rank + 1) * self.shard_numel]
        self.grad_buffer: Optional[torch.Tensor] = None  # symmetric=True: the one flat gradient, reused
        self.master: torch.nn.Parameter  # set by adopt_parameters, after the broadcast
        self.aliased = self.dtype not in _LOW_PRECISION
        # Stage 2 bookkeeping: the flat gradient being filled in this backward, which
        # parameters have arrived, and the reduce-scatter in flight (work, received shard).
        self.grad_flat: Optional[torch.Tensor] = None
        self.ready: set = set()
        self.pending: Optional[tuple] = None
        # The all-gather of the updated shard into ``flat`` (prefetch_params: still running).
        self.gathering = None

    def move_to_symmetric_memory(self, comm) -> None:
        """Allocate the flat parameters and one flat gradient in `comm`'s symmetric memory
        (collective, before adopt_parameters), so the all-gather of the shards and the
        reduce-scatter of the gradients read the peers' buffers in place."""
        self.flat = comm.zeros(self.padded, dtype=self.dtype)
        self.shard = self.flat[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel]
        self.grad_buffer = comm.zeros(self.padded, dtype=self.dtype)

    def new_flat_grad(self) -> torch.Tensor:
        """A zeroed flat gradient: a fresh one, or with symmetric memory the bucket's own
        (the caller has waited for the reduce-scatter that last read it)."""
        if self.grad_buffer is not None:
            return self.grad_buffer.zero_()
        return torch.zeros(self.padded, dtype=self.dtype, device=self.device)

    def param_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        off, n = self.offsets[i], self.numels[i]
        return flat[off:off + n].view_as(self.params[i])

    def layout(self) -> dict:
        return {"group": self.group_index, "dtype": str(self.dtype).replace("torch.", ""),
                "numels": list(self.numels), "shapes": [list(p.shape) for p in self.params],
                "shard_numel": self.shard_numel}

    @torch.no_grad()
    def adopt_parameters(self, src: int, group) -> None:
        """Copy the parameters into the flat buffer, take global rank ``src``'s values
        (a broadcast over ``group``: collective), make the parameters views into the buffer
        and build the shard parameter ``master``."""
        for i, p in enumerate(self.params):
            self.param_view(self.flat, i).copy_(p)
        if self.world_size > 1:
            dist.broadcast(self.flat, src=src, group=group)
        for i, p in enumerate(self.params):
            p.data = self.param_view(self.flat, i)
            p.grad = None
        master = self.shard if self.aliased else self.shard.float().clone()
        self.master = torch.nn.Parameter(master)
