"""How gradients reach the shards: the reduce-scatter half of ZeRO.

:class:`_Gradients`, a part of ShardedOptimizer, gives every shard parameter its ``.grad``,
this rank's shard of the gradient averaged over ranks (op AVG):

* stage 1, in ``step()`` (:meth:`_reduce_full_grads`): each bucket's ``p.grad`` are copied
  into a fresh flat buffer and reduce-scattered, at most two buckets at a time;
* stage 2, during backward: a post-accumulate-grad hook per parameter (:meth:`_on_grad`)
  copies the gradient into its bucket's flat buffer and drops ``p.grad``; the bucket's last
  gradient launches its reduce-scatter asynchronously (:meth:`_launch`), and finished ones
  are folded into the shard gradient (:meth:`_finish`) as later hooks run.

``zero_grad()`` is here too: it also drops the stage 2 buckets still filling or in flight.
"""

from __future__ import annotations

import weakref
from typing import List

import torch

from ringcoll import api
from ringcoll._types import ReduceOp

from .buckets import _Bucket, _tensor_bytes

_MAX_STAGE1_IN_FLIGHT = 2  # stage 1: flat gradient buckets allocated at once in step()


class _Gradients:
    """The gradient path of ShardedOptimizer (uses its ``stage``, ``group``, ``_buckets``)."""

    max_buckets_in_flight = 2

    def _init_gradients(self) -> None:
        self._grads_reduced = False
        self._flat_grad_bytes = 0  # full-size gradient buckets alive right now (stage 2)
        self.peak_flat_grad_bytes = 0  # ... and the most there ever were at once
        self._pending: List[_Bucket] = []  # stage 2: reduce-scatters in flight, launch order
        self._hooks: list = []
        if self.stage == 2:
            self._register_hooks()

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
        flat = b.new_flat_grad()
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
        work = api.reduce_scatter_tensor(received, b.grad_flat, op=ReduceOp.AVG, group=self.group,
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

    # --- both stages ------------------------------------------------------------------------

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
            for b in self._buckets:  # a bucket no gradient reached on any rank: zeros too, as in stage 1
                if b.master.grad is None:  # (left None, the optimizer skipped it: no decay, no momentum)
                    b.master.grad = torch.zeros_like(b.master)
        self._grads_reduced = True

    def _reduce_full_grads(self) -> None:
        in_flight: List[tuple] = []

        def finish_oldest():
            b, work, received, _flat = in_flight.pop(0)
            work.wait()
            b.master.grad = None
            self._accumulate_shard_grad(b, received)

        for b in self._buckets:
            flat = b.new_flat_grad()  # each bucket its own: at most two are in flight
            for i, p in enumerate(b.params):
                if p.grad is not None:
                    b.param_view(flat, i).copy_(p.grad)
            received = torch.empty(b.shard_numel, dtype=b.dtype, device=b.device)
            work = api.reduce_scatter_tensor(received, flat, op=ReduceOp.AVG, group=self.group, async_op=True)
            in_flight.append((b, work, received, flat))
            if len(in_flight) >= _MAX_STAGE1_IN_FLIGHT:
                finish_oldest()
        while in_flight:
            finish_oldest()

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
