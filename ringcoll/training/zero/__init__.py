"""ZeRO stages 1 and 2 over ringcoll's reduce-scatter and all-gather.

    import ringcoll.training.zero
    opt = ringcoll.training.zero.ShardedOptimizer(model.parameters(), torch.optim.Adam, stage=2, lr=1e-3)
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

Stages (``ringcoll.learning.memory`` has the formulas; measured numbers are in docs/training.md):

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

Reading order, one file a piece: buckets.py (the layout above: buckets, flat buffers,
shards), optimizer.py (ShardedOptimizer: construction and ``step()``), gradients.py (how the
gradients reach the shards, stage 1 and stage 2), checkpoint.py (sharded and full
state dicts).
"""

from .buckets import DEFAULT_BUCKET_BYTES
from .optimizer import ShardedOptimizer

__all__ = ["ShardedOptimizer", "DEFAULT_BUCKET_BYTES"]
