"""ShardedOptimizer: construction, the torch.optim facade, and one step.

Construction (collective) plans the buckets, checks that every rank planned the same, takes
rank 0's weights and builds the wrapped optimizer over this rank's shard parameters. A
``step()`` then runs the three phases of ZeRO: reduce-scatter the gradients (gradients.py),
step the wrapped optimizer on the shards, all-gather the updated shards into every rank's
parameters (:meth:`ShardedOptimizer._gather_params`). The bucket layout is in buckets.py,
checkpoints in checkpoint.py.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, List, Optional, Type

import torch
import torch.distributed as dist

from ringcoll import api
from ringcoll._types import ReduceOp

from .buckets import DEFAULT_BUCKET_BYTES, _Bucket, _plan_buckets, _tensor_bytes
from .checkpoint import _Checkpoints
from .gradients import _Gradients

__all__ = ["ShardedOptimizer"]


def _short(agreed: tuple, what: str) -> str:
    stage, cls_name, bucket_bytes, layout = agreed
    if what == "parameters":
        return f"{sum(sum(b['numels']) for b in layout):,} elements in {len(layout)} buckets " \
               f"({', '.join(str(sum(b['numels'])) for b in layout[:6])}{', ...' if len(layout) > 6 else ''})"
    return repr({"stage": stage, "optimizer_cls": cls_name, "bucket_bytes": bucket_bytes}[what])


class ShardedOptimizer(_Checkpoints, _Gradients, torch.optim.Optimizer):
    """ZeRO stage 1 or 2 around any elementwise ``torch.optim`` optimizer.

    ``params``: parameters or parameter-group dicts, as for any torch optimizer (frozen
    parameters, ``requires_grad=False``, are left alone). ``optimizer_cls``: e.g.
    ``torch.optim.AdamW``; it is built as ``optimizer_cls(shard_groups, **optimizer_kwargs)``
    over this rank's shard parameters only (available as ``.optimizer``). ``stage``: 1
    (shard optimizer state) or 2 (also gradients). ``group``: the process group (default:
    the world); ringcoll's communicator for it moves the data. ``bucket_bytes``: the most
    bytes of parameters flattened into one bucket (one larger parameter gets its own).
    ``symmetric``: put every bucket's flat parameters and one flat gradient per bucket in
    the communicator's symmetric memory (docs/symmetric.md), so the all-gather of the shards
    and the reduce-scatter of the gradients read the peers' buffers in place instead of
    staging them; results are bitwise the same. One machine; CPU or CUDA (there auto reads them
    in place by the direct plans: docs/symmetric.md, "On CUDA"). It keeps one full-size
    gradient per bucket for good, so stage 2's bound below no longer holds.

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

    def __init__(self, params: Iterable, optimizer_cls: Type[torch.optim.Optimizer], stage: int = 1,
                 group=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES, symmetric: bool = False,
                 **optimizer_kwargs: Any):
        name = "ShardedOptimizer"
        if stage not in (1, 2):
            raise ValueError(f"{name}: stage must be 1 or 2, got {stage!r} (stage 3 shards the weights: not here)")
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"{name}: optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
        if issubclass(optimizer_cls, torch.optim.LBFGS):  # the one in torch.optim that is not elementwise
            raise ValueError(f"{name}: {optimizer_cls.__name__} re-evaluates the loss and keeps a history over all "
                             "parameters, which flat shards cannot give it; use an elementwise optimizer (SGD, Adam, "
                             "AdamW, ...: docs/training.md, ZeRO's limits)")
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

        groups, given = self._normalise_groups(params)
        all_params = [p for g in groups for p in g["params"]]
        if not all_params:
            raise ValueError(f"{name}: got an empty parameter list" if not given else
                             f"{name}: none of the {given} parameters requires grad (all frozen): nothing to optimise")
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
        self._comm = api.get_communicator(self.group, self.device)

        self._buckets: List[_Bucket] = []
        for gi, g in enumerate(groups):
            for chunk in _plan_buckets(g["params"], self.bucket_bytes):
                self._buckets.append(_Bucket(len(self._buckets), gi, chunk, self.world_size, self.rank))
        self._check_ranks_agree(optimizer_cls)
        self.symmetric = bool(symmetric)
        if self.symmetric:
            if not hasattr(self._comm, "empty"):
                raise ValueError(f"{name}: symmetric=True needs every rank of the group on one machine (its "
                                 f"communicator here: {type(self._comm).__name__} on {self.device})")
            for b in self._buckets:
                b.move_to_symmetric_memory(self._comm)
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

        self._prefetching = False  # prefetch_params: step() leaves the all-gathers running
        self._prefetch_hooks: list = []
        self._init_gradients()

    # --- construction ---------------------------------------------------------------------

    @staticmethod
    def _normalise_groups(params) -> tuple[List[dict], int]:
        """The param groups with their frozen parameters left out, and how many were given."""
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
        return groups, len(seen)

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

    def _adopt_parameters(self) -> None:
        """Take rank 0's weights into every bucket and make the parameters views into them."""
        src = dist.get_global_rank(self.group, 0) if self.group is not dist.group.WORLD else 0
        for b in self._buckets:
            b.adopt_parameters(src, self.group)

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

    # --- step: reduce (gradients.py), step the shards, gather ------------------------------

    @torch.no_grad()
    def _gather_params(self) -> None:
        """All-gather every bucket's updated shard into the weights; wait for them, or
        (after prefetch_params) leave them running, the bucket the forward needs first
        (the last: buckets are in reverse registration order) queued first."""
        order = reversed(self._buckets) if self._prefetching else self._buckets
        for b in order:
            if not b.aliased:
                b.shard.copy_(b.master)
            b.gathering = api.all_gather_into_tensor(b.flat, b.shard, group=self.group, async_op=True)
        if not self._prefetching:
            self.wait_for_params()

    def wait_for_params(self, buckets: Optional[Iterable[_Bucket]] = None) -> None:
        """Wait until the weights of ``buckets`` (default: all) hold the last step's update.
        Needed only after prefetch_params, and only for code that reads the weights outside
        the forward of the module that owns them; the optimizer's own methods call it."""
        for b in self._buckets if buckets is None else buckets:
            if b.gathering is not None:
                b.gathering.wait()
                b.gathering = None

    def prefetch_params(self, module: torch.nn.Module) -> None:
        """Overlap the all-gather of the updated weights with the next forward pass.

        From now on ``step()`` returns with the all-gathers still running, queued in the
        order the forward needs them; every submodule of ``module`` that owns parameters of
        this optimizer waits, in a forward pre-hook, for the buckets holding its own
        parameters only. So the all-gather of the next layers' bucket runs while this layer
        computes. Every parameter of the optimizer must belong to a submodule of
        ``module``; weights read outside their module's forward need ``wait_for_params()``
        first. The results are bitwise those without prefetching (the same collectives on
        the same data; only the waits move)."""
        bucket_of = {id(p): b for b in self._buckets for p in b.params}
        owned = {mod: list({bucket_of[id(p)].index: bucket_of[id(p)] for p in mod.parameters(recurse=False)
                            if id(p) in bucket_of}.values()) for mod in module.modules()}
        covered = {id(p) for mod in module.modules() for p in mod.parameters(recurse=False)}
        missing = [i for i, p in enumerate(self._params) if id(p) not in covered]
        if missing:
            raise ValueError(f"ShardedOptimizer.prefetch_params: {len(missing)} parameter(s) of the optimizer "
                             f"(indices {missing[:5]}) belong to no submodule of the given module, so no forward "
                             f"hook would wait for their weights; pass the module that owns every parameter")
        for handle in self._prefetch_hooks:  # called again (another module): its hooks replace these
            handle.remove()
        self._prefetch_hooks = []
        me = weakref.ref(self)  # the module must not keep the optimizer alive

        def wait_for(buckets):
            opt = me()
            if opt is not None:
                opt.wait_for_params(buckets)

        for mod, buckets in owned.items():
            if buckets:
                self._prefetch_hooks.append(mod.register_forward_pre_hook(
                    lambda _mod, _args, buckets=buckets: wait_for(buckets)))
        self._prefetching = True

    def step(self, closure: Optional[Callable[[], float]] = None):
        """Reduce-scatter the gradients, step the wrapped optimizer on this rank's shards,
        all-gather the updated shards into every rank's parameters. Collective."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        self.wait_for_params()  # a shard is the input of its bucket's all-gather: not written before it ends
        self.reduce_gradients()
        self.optimizer.step()
        # The shard gradients are consumed: stage 1 rebuilds them from p.grad at every step;
        # stage 2 accumulates the reduce-scatters into them, so kept they would add into the
        # next step's whenever the user cleared the model's gradients (model.zero_grad())
        # rather than ours: training drifted from the reference without a word.
        for b in self._buckets:
            b.master.grad = None
        self._gather_params()
        self._grads_reduced = False
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return loss

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
            api.all_reduce(local, op=ReduceOp.MAX, group=self.group)
            total = local[0]
        else:
            local = sum((g.double().abs().pow(norm_type).sum() for g in grads), torch.tensor(0.0, dtype=torch.float64))
            local = local.reshape(1)
            api.all_reduce(local, op=ReduceOp.SUM, group=self.group)
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
        self.wait_for_params()
        for b in self._buckets:
            if not b.aliased:
                b.master.copy_(b.shard)

    # --- accounting -------------------------------------------------------------------------

    def optimizer_state_bytes(self) -> int:
        """Bytes of every tensor in this rank's optimizer state."""
        return sum(_tensor_bytes(v) for st in self.optimizer.state.values() for v in st.values()
                   if torch.is_tensor(v))

    def memory_report(self) -> dict:
        """What this rank holds now, in bytes, beside ``ringcoll.learning.memory.ledger``'s fp32
        prediction for Adam at this stage (``predicted_*``, unpadded, K = 8)."""
        from ringcoll.learning.memory import ledger

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
