"""ZeRO stages 1 and 2 over ringcoll's reduce-scatter and all-gather.

    import ringcoll.zero
    opt = ringcoll.zero.ShardedOptimizer(model.parameters(), torch.optim.Adam, stage=2, lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()

Data parallelism with a plain optimizer keeps everything on every rank: the full gradient
is all-reduced, and every rank runs the same optimizer over all N parameters, holding the
same optimizer state (Adam's m and v, SGD's momentum) P times over. ZeRO (Rajbhandari et
al. 2020) splits that all-reduce into its two halves and puts the optimizer in between:

    full grads          reduce-scatter (AVG)      own shard          all-gather
    on every rank   --------------------------->  of the reduced  ------------------>  full
    [g0 g1 g2] r0                                 gradient          [w0 w1 w2] on every rank
    [g0 g1 g2] r1       rank k receives           optimizer step
    [g0 g1 g2] r2       avg over ranks of gk      on shard k only:  rank k sends its
                                                  wk -= f(gk, state_k)  updated wk

Rank k owns shard k of every bucket and runs the wrapped optimizer over its shards only,
so its optimizer state is 1/P of the unsharded state. The two collectives move the same
bytes as one ring all-reduce (which *is* a reduce-scatter followed by an all-gather), so
the memory comes for free in traffic.

Layout. The trainable parameters are flattened into buckets, per (parameter group, dtype),
in reverse registration order (gradients of the last layers arrive first in backward),
each at most ``bucket_bytes`` unless one parameter alone is larger. A bucket of n
elements is padded to a multiple of P and cut into P equal shards of ceil(n / P)
elements; the padding is zero and stays zero. The model's parameters become views into
their bucket's flat buffer (``p.data = flat[offset:offset + numel].view_as(p)``), so the
all-gather writes the updated weights straight into the model, in place, with no copy.

    bucket (padded to 3 * s):  | p3 ......... | p2 .... | p1 ...... |0 0|
    shards, s elements each:   |  rank 0   |  rank 1   |  rank 2   |
                               ^ the optimizer of rank 1 sees only this slice

Each rank keeps one *shard parameter* per bucket, the tensor the wrapped optimizer
updates. For float32 and float64 buckets it is the rank's own slice of the flat buffer
itself (an alias, no extra memory, and never stale); for float16 and bfloat16 buckets it is
a separate float32 master copy (the "fp32 master weights" of mixed precision), which is
rounded into the flat buffer before the all-gather.

Stages (``ringcoll.memory`` has the formulas; measured numbers are in docs/training.md):

* stage 1 shards the optimizer state. Gradients accumulate in ``p.grad`` as usual, full
  size on every rank; ``step()`` copies them bucket by bucket into a flat buffer and
  reduce-scatters it (op AVG, the average DDP computes), so each rank receives its shard
  of the averaged gradient as the shard parameter's ``.grad`` (for the optimizer step
  only; it is dropped after it). Per rank: weights 4N + gradients 4N + optimizer state
  K*N/P (fp32; K = 8 for Adam, 4 for SGD with momentum) =
  ``ledger(N, P, zero_stage=1, precision="fp32")`` for Adam, plus, inside ``step()``, the
  gradient shards (4N/P) and two flat buckets being reduce-scattered.
* stage 2 shards the gradients as well. A post-accumulate-grad hook on every parameter
  copies the new gradient into its bucket's flat buffer and sets ``p.grad = None`` at
  once; when the last gradient of a bucket has arrived, the bucket is reduce-scattered
  *asynchronously* (it overlaps with the rest of the backward pass) and its flat buffer is
  dropped as soon as that finishes. What stays is the gradient shard, 1/P. Per rank:
  4N + 4N/P + K*N/P = ``ledger(N, P, zero_stage=2, precision="fp32")`` for Adam, plus the
  full-size buckets in flight during backward (at most a few ``bucket_bytes``).

Padding makes every sharded term ``ceil(n_b / P)`` instead of ``n_b / P`` per bucket, i.e.
at most one element per bucket more; each bucket also has its own scalar ``step`` counter
for Adam(W), where the unsharded optimizer has one per parameter tensor.

Differences from the unsharded optimizer (all documented in docs/training.md):

* The optimizer sees one flat tensor per bucket. Elementwise optimizers (SGD, Adam,
  AdamW, Adagrad, RMSprop, ... : every torch.optim class whose update of an element
  depends only on that element's own gradient and state) give the same result as
  unsharded. Optimizers with per-tensor norms (LAMB, LARS, Adafactor) or closures that
  re-evaluate (LBFGS) would see the shard as one tensor: not supported.
* A parameter that got no gradient on this step is treated as a zero gradient (the
  unsharded optimizer skips it), which matters for weight decay and momentum only. As with
  DDP's default, every rank must produce gradients for the same parameters.
* ``step()`` must be called by every rank (it runs collectives). So must
  ``full_state_dict()`` and ``clip_grad_norm_()``.

Construction is collective too: it builds the ringcoll communicator for the group (if the
module-level API has not yet) and broadcasts rank 0's parameters over the group, as DDP
does, so every rank starts from the same weights.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, List, Optional, Type

import torch
import torch.distributed as dist

import ringcoll
from ringcoll._types import ReduceOp

__all__ = ["ShardedOptimizer", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 25 << 20  # DDP's default bucket_cap_mb = 25
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_MAX_STAGE1_IN_FLIGHT = 2  # stage 1: flat gradient buckets allocated at once in step()
STATE_DICT_FORMAT = "ringcoll.zero/1"


def _tensor_bytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _short(agreed: tuple, what: str) -> str:
    stage, cls_name, bucket_bytes, layout = agreed
    if what == "parameters":
        return f"{sum(sum(b['numels']) for b in layout):,} elements in {len(layout)} buckets " \
               f"({', '.join(str(sum(b['numels'])) for b in layout[:6])}{', ...' if len(layout) > 6 else ''})"
    return repr({"stage": stage, "optimizer_cls": cls_name, "bucket_bytes": bucket_bytes}[what])


_SCALAR_STATE_KEYS = ("step", "eta", "mu")  # torch.optim's per-tensor scalars (Adam*, ASGD, ...)


def _is_elementwise(key: str, value: Any, shape) -> bool:
    """Is this optimizer-state entry one value per element of a tensor of ``shape``?"""
    if not torch.is_tensor(value) or tuple(value.shape) != tuple(shape):
        return False
    return len(shape) > 0 or key not in _SCALAR_STATE_KEYS


class _Bucket:
    """Parameters of one (group, dtype) flattened into one padded buffer, cut into P shards."""

    def __init__(self, index: int, group_index: int, params: List[torch.nn.Parameter], world: int, rank: int):
        self.index = index
        self.group_index = group_index
        self.params = params
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)
        self.shard_numel = -(-self.numel // world)  # ceil; a bucket of n < P elements still gives every rank 1
        self.padded = self.shard_numel * world
        self.flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        self.shard = self.flat[rank * self.shard_numel:(rank + 1) * self.shard_numel]
        self.master: torch.nn.Parameter  # set by the optimizer, after the broadcast
        self.aliased = self.dtype not in _LOW_PRECISION
        # Stage 2 bookkeeping: the flat gradient being filled in this backward, which
        # parameters have arrived, and the reduce-scatter in flight (work, received shard).
        self.grad_flat: Optional[torch.Tensor] = None
        self.ready: set = set()
        self.pending: Optional[tuple] = None

    def param_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        off, n = self.offsets[i], self.numels[i]
        return flat[off:off + n].view_as(self.params[i])

    def layout(self) -> dict:
        return {"group": self.group_index, "dtype": str(self.dtype).replace("torch.", ""),
                "numels": list(self.numels), "shapes": [list(p.shape) for p in self.params],
                "shard_numel": self.shard_numel}


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 or 2 around any elementwise ``torch.optim`` optimizer.

    ``params``: parameters or parameter-group dicts, as for any torch optimizer (frozen
    parameters, ``requires_grad=False``, are left alone). ``optimizer_cls``: e.g.
    ``torch.optim.AdamW``; it is built as ``optimizer_cls(shard_groups, **optimizer_kwargs)``
    over this rank's shard parameters only (available as ``.optimizer``). ``stage``: 1
    (shard optimizer state) or 2 (also gradients). ``group``: the process group (default:
    the world); ringcoll's communicator for it moves the data. ``bucket_bytes``: the most
    bytes of parameters flattened into one bucket (one larger parameter gets its own).

    ``param_groups`` and ``state`` are the wrapped optimizer's (shard parameters), so
    ``group["lr"] = ...`` and ``torch.optim.lr_scheduler`` work as usual.

    ``max_buckets_in_flight`` (attribute, stage 2, default 2): how many bucket
    reduce-scatters may run behind the backward pass before the hook waits for the oldest.
    Full-size gradient memory during backward is then at most (this + the buckets being
    filled, usually 1) x bucket_bytes; ``peak_flat_grad_bytes`` records what it was.

    Reference computation (what every rank's parameters equal after ``step()``)::

        for p in params:                                   # g = p.grad on each rank
            p.grad = sum(g on rank r for r in range(P)) / P
        optimizer_cls(params, **optimizer_kwargs).step()
    """

    max_buckets_in_flight = 2

    def __init__(self, params: Iterable, optimizer_cls: Type[torch.optim.Optimizer], stage: int = 1,
                 group=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES, **optimizer_kwargs: Any):
        name = "ShardedOptimizer"
        if stage not in (1, 2):
            raise ValueError(f"{name}: stage must be 1 or 2, got {stage!r} (stage 3 shards the weights: not here)")
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"{name}: optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
        if int(bucket_bytes) <= 0:
            raise ValueError(f"{name}: bucket_bytes must be positive, got {bucket_bytes!r}")
        if not dist.is_initialized():
            raise RuntimeError(f"{name}: torch.distributed is not initialised; call dist.init_process_group first")
        self.stage = stage
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        if self.rank < 0:
            raise ValueError(f"{name}: this process is not a member of the given group")
        self.bucket_bytes = int(bucket_bytes)

        groups = self._normalise_groups(params)
        all_params = [p for g in groups for p in g["params"]]
        if not all_params:
            raise ValueError(f"{name}: got an empty parameter list")
        devices = {p.device for p in all_params}
        if len(devices) != 1:
            raise ValueError(f"{name}: all parameters must be on one device, got {sorted(map(str, devices))}")
        self.device = all_params[0].device
        for p in all_params:
            if not p.is_floating_point():
                raise TypeError(f"{name}: parameters must be floating point, got {p.dtype}")
        # The plain optimizer's numbering (state_dict indices): trainable params, group order.
        self._user_groups = groups
        self._param_index = {id(p): i for i, p in enumerate(all_params)}
        self._params = all_params

        # Build the communicator now, collectively, rather than inside a backward hook.
        self._comm = ringcoll.get_communicator(self.group, self.device)

        self._buckets: List[_Bucket] = []
        for gi, g in enumerate(groups):
            for chunk in self._plan_buckets(g["params"]):
                self._buckets.append(_Bucket(len(self._buckets), gi, chunk, self.world_size, self.rank))
        self._check_ranks_agree(optimizer_cls)
        self._adopt_parameters()

        shard_groups = []
        for gi, g in enumerate(groups):
            options = {k: v for k, v in g.items() if k != "params"}
            shard_groups.append({"params": [b.master for b in self._buckets if b.group_index == gi], **options})
        self.optimizer = optimizer_cls(shard_groups, **optimizer_kwargs)

        # torch.optim.Optimizer.__init__ is not called (it would register the full
        # parameters); these are the attributes its other methods and hooks expect.
        self._optimizer_step_pre_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_post_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: Dict[int, Callable] = OrderedDict()

        self._grads_reduced = False
        self._flat_grad_bytes = 0  # full-size gradient buckets alive right now (stage 2)
        self.peak_flat_grad_bytes = 0  # ... and the most there ever were at once
        self._pending: List[_Bucket] = []  # stage 2: reduce-scatters in flight, launch order
        self._hooks: list = []
        if stage == 2:
            self._register_hooks()

    # --- construction ---------------------------------------------------------------------

    @staticmethod
    def _normalise_groups(params) -> List[dict]:
        if isinstance(params, torch.Tensor):
            raise TypeError("ShardedOptimizer: params must be an iterable of Tensors or dicts, got a Tensor")
        params = list(params)
        if params and not isinstance(params[0], dict):
            params = [{"params": params}]
        groups, seen = [], set()
        for g in params:
            g = dict(g)
            ps = g["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            kept = []
            for p in ps:
                if not isinstance(p, torch.Tensor) or not p.is_leaf:
                    raise TypeError("ShardedOptimizer: can only optimise leaf tensors")
                if id(p) in seen:
                    raise ValueError("ShardedOptimizer: a parameter appears more than once")
                seen.add(id(p))
                if p.requires_grad:
                    kept.append(p)
            g["params"] = kept
            groups.append(g)
        return groups

    def _plan_buckets(self, params: List[torch.nn.Parameter]) -> List[List[torch.nn.Parameter]]:
        """Per dtype, in reverse order, greedily up to bucket_bytes each."""
        by_dtype: Dict[torch.dtype, list] = {}
        for p in reversed(params):
            by_dtype.setdefault(p.dtype, []).append(p)
        chunks = []
        for ps in by_dtype.values():
            current, size = [], 0
            for p in ps:
                nbytes = _tensor_bytes(p)
                if current and size + nbytes > self.bucket_bytes:
                    chunks.append(current)
                    current, size = [], 0
                current.append(p)
                size += nbytes
            if current:
                chunks.append(current)
        return chunks

    def _check_ranks_agree(self, optimizer_cls) -> None:
        """Every rank must build the same buckets (same model, grouping, bucket_bytes) and
        the same stage and optimizer, or the collectives would pair up wrong buffers."""
        mine = (self.stage, optimizer_cls.__name__, self.bucket_bytes, [b.layout() for b in self._buckets])
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        for r, theirs in enumerate(everyone):
            if theirs != mine:
                what = next(name for name, a, b in zip(("stage", "optimizer_cls", "bucket_bytes", "parameters"),
                                                       mine, theirs) if a != b)
                raise ValueError(f"ShardedOptimizer: ranks disagree on {what}: rank {self.rank} has "
                                 f"{_short(mine, what)}, rank {r} has {_short(theirs, what)}")

    @torch.no_grad()
    def _adopt_parameters(self) -> None:
        """Copy the parameters into their buckets, take rank 0's values, make the params views."""
        src = dist.get_global_rank(self.group, 0) if self.group is not dist.group.WORLD else 0
        for b in self._buckets:
            for i, p in enumerate(b.params):
                b.param_view(b.flat, i).copy_(p)
            if self.world_size > 1:
                dist.broadcast(b.flat, src=src, group=self.group)
            for i, p in enumerate(b.params):
                p.data = b.param_view(b.flat, i)
                p.grad = None
            master = b.shard if b.aliased else b.shard.float().clone()
            b.master = torch.nn.Parameter(master)

    # --- the optimizer facade -------------------------------------------------------------

    @property
    def param_groups(self) -> List[dict]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError("ShardedOptimizer: add_param_group is not supported; "
                                  "pass every group at construction")

    def __getstate__(self):
        raise TypeError("ShardedOptimizer cannot be pickled (it holds a communicator); use state_dict()")

    def __repr__(self) -> str:
        n = sum(b.numel for b in self._buckets)
        return (f"ShardedOptimizer(stage={self.stage}, rank={self.rank}/{self.world_size}, "
                f"{len(self._buckets)} buckets, {n:,} parameters, optimizer={self.optimizer.__class__.__name__})")

    @property
    def buckets(self) -> List[_Bucket]:
        return list(self._buckets)

    # --- stage 2: gradients go to their bucket as soon as autograd produces them ------------

    def _register_hooks(self) -> None:
        me = weakref.ref(self)
        for b in self._buckets:
            for i, p in enumerate(b.params):
                def hook(param, b=b, i=i):
                    opt = me()
                    if opt is not None:
                        opt._on_grad(b, i, param)
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def remove_hooks(self) -> None:
        """Stage 2: stop catching gradients (they stay in ``p.grad`` from then on)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _alloc_flat_grad(self, b: _Bucket) -> torch.Tensor:
        flat = torch.zeros(b.padded, dtype=b.dtype, device=b.device)
        self._flat_grad_bytes += _tensor_bytes(flat)
        self.peak_flat_grad_bytes = max(self.peak_flat_grad_bytes, self._flat_grad_bytes)
        return flat

    @torch.no_grad()
    def _on_grad(self, b: _Bucket, i: int, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:
            return
        self._reap()  # free the buckets whose reduce-scatter is done before allocating another
        if b.grad_flat is None:
            if b.pending is not None:  # this bucket's previous backward still reducing
                self._finish(b)
            b.grad_flat = self._alloc_flat_grad(b)
            b.ready = set()
        view = b.param_view(b.grad_flat, i)
        if i in b.ready:  # a second backward before the bucket was complete
            view.add_(grad)
        else:
            view.copy_(grad)
            b.ready.add(i)
        p.grad = None  # the full-size gradient of p is gone from here on
        if len(b.ready) == len(b.params):
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        received = torch.empty(b.shard_numel, dtype=b.dtype, device=b.device)
        work = ringcoll.reduce_scatter_tensor(received, b.grad_flat, op=ReduceOp.AVG, group=self.group,
                                              async_op=True)
        b.pending = (work, received, _tensor_bytes(b.grad_flat))
        b.grad_flat = None  # the Work holds it until the ring has read it
        b.ready = set()
        self._pending.append(b)
        while len(self._pending) > self.max_buckets_in_flight:  # bound the full-size buckets alive
            self._finish(self._pending[0])

    def _finish(self, b: _Bucket) -> None:
        work, received, nbytes = b.pending
        work.wait()
        b.pending = None
        self._pending.remove(b)
        self._flat_grad_bytes -= nbytes
        del work  # releases the flat gradient
        self._accumulate_shard_grad(b, received)

    def _reap(self) -> None:
        for b in [b for b in self._pending if b.pending[0].is_completed()]:
            self._finish(b)

    @staticmethod
    def _accumulate_shard_grad(b: _Bucket, received: torch.Tensor) -> None:
        if received.dtype != b.master.dtype:
            received = received.to(b.master.dtype)
        if b.master.grad is None:
            b.master.grad = received
        else:
            b.master.grad.add_(received)

    # --- reduce, step, gather ---------------------------------------------------------------

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Give every shard parameter its ``.grad``: this rank's shard of the gradient
        averaged over ranks. Collective. ``step()`` calls it; call it yourself only to look
        at or change the shard gradients first (``clip_grad_norm_`` does)."""
        if self._grads_reduced:
            return
        if self.stage == 1:
            self._reduce_full_grads()
        else:
            for b in self._buckets:  # buckets left incomplete: missing gradients count as zero
                if b.grad_flat is not None:
                    self._launch(b)
            while self._pending:
                self._finish(self._pending[0])
        self._grads_reduced = True

    def _reduce_full_grads(self) -> None:
        in_flight: List[tuple] = []

        def finish_oldest():
            b, work, received, _flat = in_flight.pop(0)
            work.wait()
            b.master.grad = None
            self._accumulate_shard_grad(b, received)

        for b in self._buckets:
            flat = torch.zeros(b.padded, dtype=b.dtype, device=b.device)
            for i, p in enumerate(b.params):
                if p.grad is not None:
                    b.param_view(flat, i).copy_(p.grad)
            received = torch.empty(b.shard_numel, dtype=b.dtype, device=b.device)
            work = ringcoll.reduce_scatter_tensor(received, flat, op=ReduceOp.AVG, group=self.group, async_op=True)
            in_flight.append((b, work, received, flat))
            if len(in_flight) >= _MAX_STAGE1_IN_FLIGHT:
                finish_oldest()
        while in_flight:
            finish_oldest()

    @torch.no_grad()
    def _gather_params(self) -> None:
        works = []
        for b in self._buckets:
            if not b.aliased:
                b.shard.copy_(b.master)
            works.append(ringcoll.all_gather_into_tensor(b.flat, b.shard, group=self.group, async_op=True))
        for w in works:
            w.wait()

    def step(self, closure: Optional[Callable[[], float]] = None):
        """Reduce-scatter the gradients, step the wrapped optimizer on this rank's shards,
        all-gather the updated shards into every rank's parameters. Collective."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        self.reduce_gradients()
        self.optimizer.step()
        if self.stage == 1:  # rebuilt from p.grad at every step: keep only the full gradients
            for b in self._buckets:
                b.master.grad = None
        self._gather_params()
        self._grads_reduced = False
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients (stage 1), the shard gradients, and (stage 2)
        any bucket still being filled. Waits for reduce-scatters in flight."""
        with torch.no_grad():
            while self._pending:
                work, _received, nbytes = self._pending[0].pending
                work.wait()
                self._flat_grad_bytes -= nbytes
                self._pending.pop(0).pending = None
            for b in self._buckets:
                if b.grad_flat is not None:
                    self._flat_grad_bytes -= _tensor_bytes(b.grad_flat)
                b.grad_flat, b.ready = None, set()
                for t in (*b.params, b.master):
                    if t.grad is not None:
                        if set_to_none:
                            t.grad = None
                        else:
                            t.grad.zero_()
        self._grads_reduced = False

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Like ``torch.nn.utils.clip_grad_norm_`` over the *averaged* gradient of all
        parameters: reduces the gradients first (see reduce_gradients), takes the norm over
        all ranks' shards (padding is zero), scales the shard gradients. Collective.
        Returns the total norm."""
        self.reduce_gradients()
        norm_type = float(norm_type)
        grads = [b.master.grad for b in self._buckets if b.master.grad is not None]
        if norm_type == math.inf:
            local = max((g.abs().max() for g in grads), default=torch.tensor(0.0)).to(torch.float64).reshape(1)
            ringcoll.all_reduce(local, op=ReduceOp.MAX, group=self.group)
            total = local[0]
        else:
            local = sum((g.double().abs().pow(norm_type).sum() for g in grads), torch.tensor(0.0, dtype=torch.float64))
            local = local.reshape(1)
            ringcoll.all_reduce(local, op=ReduceOp.SUM, group=self.group)
            total = local[0].pow(1.0 / norm_type)
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return total.float()

    @torch.no_grad()
    def sync_masters(self) -> None:
        """Copy the model's current weights into the fp32 master shards of float16/bfloat16
        buckets. Call it after changing the weights outside step() (``model.load_state_dict``,
        edits under no_grad), or the next step would start from the old masters. float32 and
        float64 buckets need nothing: their shard parameters are the weights. Not collective."""
        for b in self._buckets:
            if not b.aliased:
                b.master.copy_(b.shard)

    # --- accounting -------------------------------------------------------------------------

    def optimizer_state_bytes(self) -> int:
        """Bytes of every tensor in this rank's optimizer state."""
        return sum(_tensor_bytes(v) for st in self.optimizer.state.values() for v in st.values()
                   if torch.is_tensor(v))

    def memory_report(self) -> dict:
        """What this rank holds now, in bytes, beside ``ringcoll.memory.ledger``'s fp32
        prediction for Adam at this stage (``predicted_*``, unpadded, K = 8)."""
        from ringcoll.memory import ledger

        n = sum(b.numel for b in self._buckets)
        predicted = ledger(n, self.world_size, self.stage, precision="fp32")
        return {
            "rank": self.rank, "world_size": self.world_size, "stage": self.stage, "params": n,
            "padded_params": sum(b.padded for b in self._buckets),
            "weights": sum(_tensor_bytes(b.flat) for b in self._buckets),
            "master_weights": sum(_tensor_bytes(b.master) for b in self._buckets if not b.aliased),
            "param_grads": sum(_tensor_bytes(p.grad) for p in self._params),
            "shard_grads": sum(_tensor_bytes(b.master.grad) for b in self._buckets),
            "flat_grad_buckets": self._flat_grad_bytes,
            "peak_flat_grad_buckets": self.peak_flat_grad_bytes,
            "optimizer_state": self.optimizer_state_bytes(),
            "predicted_weights": predicted.weights,
            "predicted_gradients": predicted.gradients,
            "predicted_optimizer_state": predicted.optimizer_state,
        }

    # --- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's shard: the wrapped optimizer's own state_dict (over the shard
        parameters), the fp32 master shards of float16/bfloat16 buckets, and the layout it
        is only valid for (world size, rank, buckets). Save one file per rank; load it with
        the same model, world size, bucket_bytes and parameter groups. Not collective. For a
        checkpoint that any world size (or a plain optimizer) can load, see full_state_dict."""
        return {
            "format": STATE_DICT_FORMAT,
            "stage": self.stage,
            "world_size": self.world_size,
            "rank": self.rank,
            "layout": [b.layout() for b in self._buckets],
            "optimizer": self.optimizer.state_dict(),
            "master": [None if b.aliased else b.master.detach().clone() for b in self._buckets],
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load what state_dict() saved on the same rank of the same layout. The model's
        weights are not touched (load them with the model's own state_dict); float16 and
        bfloat16 buckets get their fp32 master shards back."""
        name = "ShardedOptimizer.load_state_dict"
        if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_DICT_FORMAT:
            raise ValueError(f"{name}: not a ShardedOptimizer.state_dict() (for a plain optimizer's "
                             "state dict use load_full_state_dict)")
        for key, mine in (("world_size", self.world_size), ("rank", self.rank)):
            if state_dict[key] != mine:
                raise ValueError(f"{name}: saved with {key} {state_dict[key]}, this optimizer has {mine}")
        layout = [b.layout() for b in self._buckets]
        if state_dict["layout"] != layout:
            raise ValueError(f"{name}: saved bucket layout differs from this one (another model, bucket_bytes "
                             "or parameter grouping?)")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        for b, master in zip(self._buckets, state_dict["master"]):
            if master is not None and not b.aliased:
                b.master.copy_(master)

    def _shard_state_keys(self, b: _Bucket, st: dict) -> List[str]:
        return [k for k, v in st.items() if _is_elementwise(k, v, b.master.shape)]

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """The unsharded optimizer's state_dict, as ``optimizer_cls(params)`` would have it
        (per-parameter state, parameters numbered in group order), on every rank: the shard
        tensors of every bucket are all-gathered and cut into parameters. Collective. Loads
        into a plain optimizer, or into a ShardedOptimizer of any world size with
        load_full_state_dict. Per-bucket scalars (Adam's step) go to every parameter of the
        bucket."""
        state: Dict[int, dict] = {}
        for b in self._buckets:
            st = self.optimizer.state.get(b.master, {})
            shard_keys = self._shard_state_keys(b, st)
            for key, value in st.items():
                if key in shard_keys:
                    full = torch.empty(b.padded, dtype=value.dtype, device=value.device)
                    ringcoll.all_gather_into_tensor(full, value.contiguous(), group=self.group)
                for i, p in enumerate(b.params):
                    entry = state.setdefault(self._param_index[id(p)], {})
                    if key in shard_keys:
                        entry[key] = b.param_view(full, i).clone()
                    else:
                        entry[key] = value.clone() if torch.is_tensor(value) else value
        groups = []
        for gi, (user, inner) in enumerate(zip(self._user_groups, self.optimizer.param_groups)):
            options = {k: v for k, v in inner.items() if k != "params"}
            groups.append({**options, "params": [self._param_index[id(p)] for p in user["params"]]})
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict) -> None:
        """Load an unsharded optimizer state_dict (a plain ``optimizer_cls`` over the same
        parameters, in the same groups, or full_state_dict() from any world size): each
        rank cuts out its shards. Not collective. Parameters without state get zeros in
        their part of a shard that has state. Hyperparameters (lr, ...) come from it too."""
        name = "ShardedOptimizer.load_full_state_dict"
        groups = state_dict["param_groups"]
        if len(groups) != len(self._user_groups) or any(
                len(g["params"]) != len(u["params"]) for g, u in zip(groups, self._user_groups)):
            raise ValueError(f"{name}: its parameter groups do not match this optimizer's")
        full_state = {int(k): v for k, v in state_dict["state"].items()}
        inner_state: Dict[int, dict] = {}
        inner_index = {id(m): j for j, m in enumerate(m for g in self.optimizer.param_groups for m in g["params"])}
        for b in self._buckets:
            entries = [full_state.get(self._param_index[id(p)]) for p in b.params]
            present = [e for e in entries if e]
            if not present:
                continue
            shard = {}
            first = b.params[entries.index(present[0])]
            for key, value in present[0].items():
                if _is_elementwise(key, value, first.shape):
                    flat = torch.zeros(b.padded, dtype=value.dtype, device=b.device)
                    for i, e in enumerate(entries):
                        if e and key in e:
                            b.param_view(flat, i).copy_(e[key])
                    lo = self.rank * b.shard_numel
                    shard[key] = flat[lo:lo + b.shard_numel].clone()
                else:
                    shard[key] = value.clone() if torch.is_tensor(value) else value
            inner_state[inner_index[id(b.master)]] = shard
        inner_groups = []
        for g, inner in zip(groups, self.optimizer.param_groups):
            options = {k: v for k, v in g.items() if k != "params"}
            inner_groups.append({**options, "params": [inner_index[id(m)] for m in inner["params"]]})
        self.optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})
