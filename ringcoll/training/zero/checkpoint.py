"""Checkpoints of a ShardedOptimizer, in two forms.

:class:`_Checkpoints`, a part of ShardedOptimizer:

* ``state_dict()`` / ``load_state_dict()``: this rank's shard as it is (the wrapped
  optimizer's own state over the shard parameters, plus the fp32 masters), valid only for
  the same layout, world size and rank. One file per rank; not collective.
* ``full_state_dict()`` / ``load_full_state_dict()``: the unsharded optimizer's state_dict,
  per parameter. Saving all-gathers the shard tensors and cuts them into parameters
  (collective); loading cuts each rank's shard out again, so the checkpoint moves between
  world sizes and to and from a plain ``optimizer_cls``.

Which state entries are sharded: those with one value per element (:func:`_is_elementwise`,
e.g. Adam's ``exp_avg``); per-tensor scalars (Adam's ``step``) are one per bucket, copied to
every parameter of the bucket when saving.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from ringcoll import api

from .buckets import _Bucket

STATE_DICT_FORMAT = "ringcoll.zero/1"  # the checkpoint format's name: kept when the module moved
_SCALAR_STATE_KEYS = ("step", "eta", "mu")  # torch.optim's per-tensor scalars (Adam*, ASGD, ...)


def _is_elementwise(key: str, value: Any, shape) -> bool:
    """Is this optimizer-state entry one value per element of a tensor of ``shape``?"""
    if not torch.is_tensor(value) or tuple(value.shape) != tuple(shape):
        return False
    return len(shape) > 0 or key not in _SCALAR_STATE_KEYS


class _Checkpoints:
    """The checkpoint methods of ShardedOptimizer (they use its ``optimizer``, ``_buckets``,
    ``_user_groups`` and ``_param_index``: the plain optimizer's parameter numbering)."""

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
        self.wait_for_params()  # prefetch_params: the shards are read by the all-gathers
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
        self.wait_for_params()  # prefetch_params: the shards are read by the all-gathers
        state: Dict[int, dict] = {}
        for b in self._buckets:
            st = self.optimizer.state.get(b.master, {})
            shard_keys = self._shard_state_keys(b, st)
            for key, value in st.items():
                if key in shard_keys:
                    full = torch.empty(b.padded, dtype=value.dtype, device=value.device)
                    api.all_gather_into_tensor(full, value.contiguous(), group=self.group)
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
        self.wait_for_params()  # prefetch_params: the shards are read by the all-gathers
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
