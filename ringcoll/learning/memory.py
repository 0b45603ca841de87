"""``ringcoll memory``: what training an N-parameter model with Adam costs each GPU.

Units: bytes, printed in decimal gigabytes, **1 GB = 1e9 bytes** (so 7e9 fp16 weights are
14 GB, as in the worked examples below), not GiB.

Model states (per parameter)
============================

Adam keeps two moments per parameter, m and v. With mixed precision there are two
conventions in common use, and numbers quoted without saying which are not comparable:

====================  =========  =========  ==================  ===============
convention            weights    gradients  optimizer state     bytes / param
====================  =========  =========  ==================  ===============
``mixed``             fp16: 2    fp16: 2    m, v fp32: 4 + 4    12  ("12N")
``mixed+master``      fp16: 2    fp16: 2    fp32 master copy 4  16  ("16N")
                                            + m, v fp32: 4 + 4
``fp32``              fp32: 4    fp32: 4    m, v fp32: 4 + 4    16
====================  =========  =========  ==================  ===============

``mixed`` is the accounting of the seed chapter (2N + 2N + 8N = 12N). Real mixed-precision
Adam (Micikevicius et al. 2018; the ZeRO paper, Rajbhandari et al. 2020, "K = 12") also
keeps an fp32 master copy of the weights, which the optimizer updates and then rounds to
fp16: 2N + 2N + 12N = 16N. ``fp32`` is plain single precision, what ``--measure`` runs on
a CPU. The master copy is counted as optimizer state, as ZeRO does, so ZeRO-1 shards it.

Worked examples (tests/pure/test_memory.py checks them exactly)::

    N = 7e9,  mixed:         14 + 14 + 56 = 84 GB       (2N + 2N + 8N)
    N = 7e9,  mixed+master:  14 + 14 + 84 = 112 GB      (16 bytes per parameter)
    N = 7e9,  mixed, ZeRO-1 over P = 8:  14 + 14 + 56/8 = 35 GB
    N = 70e9, mixed:         12 * 70e9 = 840 GB

ZeRO over P data-parallel ranks
===============================

Stage 0 (plain data parallelism) replicates everything. Each stage shards one more term,
i.e. divides it by P:

    stage 1: optimizer state / P
    stage 2: optimizer state / P, gradients / P
    stage 3: optimizer state / P, gradients / P, weights / P

Activations are not sharded by ZeRO: every rank holds those of its own micro-batch.

Activations
===========

For a GPT-style transformer layer (attention + 4h MLP with GeLU, dropout, two layer
norms), fp16 activations, 1-byte dropout masks, no tensor or sequence parallelism,
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
eq. (1), give the bytes stored for the backward pass **per layer**::

    s * b * h * (34 + 5 * a * s / h)

s = sequence length, b = micro-batch size, h = hidden size, a = attention heads. The
34 s b h are the linear-size terms (attention 11, MLP 19, layer norms 4); 5 a s^2 b are
the attention scores, softmax and its dropout mask, which grow with s squared. Kernels
that never store the s x s scores (FlashAttention) drop that term
(``attention_scores=False``). Embeddings, the final norm and the logits are not counted.

With full activation checkpointing only each layer's input is kept, ``2 s b h`` bytes per
layer; during the backward pass one layer at a time is recomputed, so the peak adds one
layer's full ``s b h (34 + 5 a s / h)`` on top (:func:`checkpointing_recompute_bytes`).

Times L layers, both are linear in b, and in s apart from the attention-score term.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Union

__all__ = [
    "GB",
    "Precision",
    "PRECISIONS",
    "TransformerShape",
    "Ledger",
    "layer_activation_bytes",
    "activation_bytes",
    "checkpointing_recompute_bytes",
    "ledger",
    "measure",
    "format_ledgers",
    "format_measurement",
]

GB = 1e9  # decimal gigabyte: the worked examples (7e9 fp16 weights = 14 GB) use it


@dataclasses.dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model-state term (see the table in the module doc)."""

    name: str
    weight_bytes: int
    grad_bytes: int
    master_bytes: int  # fp32 master copy of the weights (0: none)
    moment_bytes: int  # Adam's m and v together
    description: str

    @property
    def optimizer_bytes(self) -> int:
        return self.master_bytes + self.moment_bytes

    @property
    def bytes_per_param(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


MIXED = Precision("mixed", 2, 2, 0, 8,
                  "mixed precision without an fp32 master copy (the often-quoted 12N): fp16 weights 2 B, "
                  "fp16 gradients 2 B, Adam m and v in fp32 4 + 4 B")
MIXED_MASTER = Precision("mixed+master", 2, 2, 4, 8,
                         "mixed precision with an fp32 master copy (16N; the ZeRO paper's K = 12): fp16 "
                         "weights 2 B, fp16 gradients 2 B, fp32 master weights 4 B + Adam m and v 4 + 4 B")
FP32 = Precision("fp32", 4, 4, 0, 8,
                 "plain fp32 (16N): fp32 weights 4 B, fp32 gradients 4 B, Adam m and v in fp32 4 + 4 B")
PRECISIONS: Dict[str, Precision] = {p.name: p for p in (MIXED, MIXED_MASTER, FP32)}


def _precision(precision: Union[str, Precision]) -> Precision:
    if isinstance(precision, Precision):
        return precision
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise ValueError(f"memory: precision must be one of {', '.join(PRECISIONS)}, got {precision!r}") from None


# ---------------------------------------------------------------------------------------
# activations


@dataclasses.dataclass(frozen=True)
class TransformerShape:
    """What the activation estimate needs: micro-batch b, sequence length s, hidden size h,
    layers L, attention heads a."""

    batch: int
    seq: int
    hidden: int
    layers: int
    heads: int


def layer_activation_bytes(shape: TransformerShape, attention_scores: bool = True) -> float:
    """One layer, no checkpointing: s*b*h*(34 + 5*a*s/h) bytes (Korthikanti et al. 2022,
    eq. 1; fp16 activations, 1-byte dropout masks). Without stored attention scores
    (FlashAttention-style kernels) only s*b*h*34."""
    s, b, h, a = shape.seq, shape.batch, shape.hidden, shape.heads
    linear_terms = 34 * s * b * h
    score_terms = 5 * a * s * s * b if attention_scores else 0
    return float(linear_terms + score_terms)


def activation_bytes(shape: TransformerShape, checkpointing: bool = False, attention_scores: bool = True) -> float:
    """All L layers: L * s*b*h*(34 + 5*a*s/h) bytes, or L * 2*s*b*h with full activation
    checkpointing (only each layer's fp16 input is kept)."""
    if checkpointing:
        return float(shape.layers * 2 * shape.seq * shape.batch * shape.hidden)
    return shape.layers * layer_activation_bytes(shape, attention_scores)


def checkpointing_recompute_bytes(shape: TransformerShape, attention_scores: bool = True) -> float:
    """With checkpointing, the backward pass recomputes one layer at a time: its full
    activations are live on top of the stored layer inputs at the peak."""
    return layer_activation_bytes(shape, attention_scores)


# ---------------------------------------------------------------------------------------
# the ledger


@dataclasses.dataclass(frozen=True)
class Ledger:
    """Bytes per GPU; ``total`` = weights + gradients + optimizer state + activations."""

    params: int
    world: int
    zero_stage: int
    precision: Precision
    weights: float
    gradients: float
    optimizer_state: float
    activations: float = 0.0

    @property
    def model_states(self) -> float:
        return self.weights + self.gradients + self.optimizer_state

    @property
    def total(self) -> float:
        return self.model_states + self.activations


def _shard(nbytes: int, world: int, sharded: bool) -> float:
    """A term divided over the ranks when its ZeRO stage shards it, else replicated."""
    return nbytes / world if sharded else float(nbytes)


def ledger(params: float, world: int = 1, zero_stage: int = 0, precision: Union[str, Precision] = "mixed",
           shape: Optional[TransformerShape] = None, checkpointing: bool = False,
           attention_scores: bool = True) -> Ledger:
    """Per-GPU bytes of training ``params`` parameters with Adam on ``world`` data-parallel
    ranks under ZeRO stage ``zero_stage`` (0-3), in the given precision convention
    (``"mixed"`` 12 B/param, ``"mixed+master"`` 16, ``"fp32"`` 16). With a ``shape`` the
    activations are added (:func:`activation_bytes`). E.g. ``ledger(7e9).total / GB == 84``.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"memory: zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if world < 1:
        raise ValueError(f"memory: world must be >= 1, got {world}")
    prec = _precision(precision)
    n = int(round(params))
    return Ledger(
        params=n,
        world=world,
        zero_stage=zero_stage,
        precision=prec,
        weights=_shard(prec.weight_bytes * n, world, zero_stage >= 3),
        gradients=_shard(prec.grad_bytes * n, world, zero_stage >= 2),
        optimizer_state=_shard(prec.optimizer_bytes * n, world, zero_stage >= 1),
        activations=activation_bytes(shape, checkpointing, attention_scores) if shape else 0.0,
    )


# ---------------------------------------------------------------------------------------
# printing


def _wrap(text: str, width: int = 100, indent: str = "  ") -> list:
    """Wrap at ", " only, so that "2 B" and "m and v" never break across lines."""
    phrases = text.split(", ")
    lines = [phrases[0]]
    for phrase in phrases[1:]:
        if len(lines[-1]) + 2 + len(phrase) <= width:
            lines[-1] += ", " + phrase
        else:
            lines[-1] += ","
            lines.append(indent + phrase)
    return lines


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:9.2f}"


def _coefficient(bytes_per_param: int) -> str:
    return f"{bytes_per_param}N"


def format_ledgers(params: float, world: int, shape: Optional[TransformerShape] = None,
                   attention_scores: bool = True, precisions=("mixed", "mixed+master")) -> str:
    """The tables ``ringcoll memory`` prints: per convention, every term for ZeRO 0-3."""
    out = [f"Per-GPU memory of training N = {int(round(params)):,} parameters with Adam on P = {world} "
           "data-parallel ranks",
           "(GB = 1e9 bytes; ZeRO-1 shards the optimizer state over P, ZeRO-2 also the gradients, "
           "ZeRO-3 also the weights)"]
    for name in precisions:
        prec = _precision(name)
        rows = [ledger(params, world, stage, prec, shape, False, attention_scores) for stage in range(4)]
        heading = f"{prec.name}: {prec.description} = {prec.bytes_per_param} B per parameter"
        out += [""] + _wrap(heading) + [
                f"  {'':<26}{'':>6}" + "".join(f"{'ZeRO-' + str(s):>9}" for s in range(4))]
        optimizer_label = "optimizer (master, m, v)" if prec.master_bytes else "optimizer (m, v)"
        for label, coeff, attr in (("weights", prec.weight_bytes, "weights"),
                                   ("gradients", prec.grad_bytes, "gradients"),
                                   (optimizer_label, prec.optimizer_bytes, "optimizer_state")):
            out.append(f"  {label:<26}{_coefficient(coeff):>6}" + "".join(_gb(getattr(r, attr)) for r in rows))
        out.append(f"  {'model states':<26}{_coefficient(prec.bytes_per_param):>6}"
                   + "".join(_gb(r.model_states) for r in rows))
        if shape is not None:
            with_ckpt = [ledger(params, world, s, prec, shape, True, attention_scores) for s in range(4)]
            out.append(f"  {'+ activations (all stored)':<32}" + "".join(_gb(r.total) for r in rows))
            out.append(f"  {'+ activations, checkpointed':<32}" + "".join(_gb(r.total) for r in with_ckpt))
            recompute = checkpointing_recompute_bytes(shape, attention_scores)  # one layer again, in backward
            out.append(f"  {'  at the recompute peak':<32}" + "".join(_gb(r.total + recompute) for r in with_ckpt))
    if shape is not None:
        out += [""] + _activation_lines(shape, attention_scores)
    return "\n".join(out) + "\n"


def _activation_lines(shape: TransformerShape, attention_scores: bool) -> list:
    s, b, h, L, a = shape.seq, shape.batch, shape.hidden, shape.layers, shape.heads
    formula = "s*b*h*(34 + 5*a*s/h)" if attention_scores else "34*s*b*h (attention scores not stored)"
    return [
        f"Activations per GPU (not sharded by ZeRO), s = {s}, b = {b}, h = {h}, L = {L}, a = {a}:",
        f"  Korthikanti et al. 2022 eq. 1, fp16, per layer {formula}",
        f"  one layer:                          {_gb(layer_activation_bytes(shape, attention_scores))} GB",
        f"  no checkpointing, L layers:         {_gb(activation_bytes(shape, False, attention_scores))} GB",
        f"  full checkpointing, L * 2*s*b*h:    {_gb(activation_bytes(shape, True))} GB"
        f"   (+{_gb(checkpointing_recompute_bytes(shape, attention_scores)).strip()} GB while one layer "
        "is recomputed in backward)",
    ]


# ---------------------------------------------------------------------------------------
# measuring a real model


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def _small_model(width: int, depth: int):
    """``depth`` blocks of Linear(width, 4*width) -> GELU -> Linear(4*width, width)."""
    import torch

    blocks = []
    for _ in range(depth):
        blocks += [torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)]
    return torch.nn.Sequential(*blocks)


def check_measure_device(device: Optional[str]) -> None:
    """ValueError unless `measure` can run on `device` (None: its default)."""
    if device is None:
        return
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"memory: --device must be cpu or cuda[:index], got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"memory: --device {device}: this torch sees no CUDA device")


def measure(width: int = 256, depth: int = 3, batch: int = 32, device: Optional[str] = None) -> dict:
    """Build a small fp32 MLP, run one forward/backward and one Adam step, and count what
    it holds: parameter bytes, ``.grad`` bytes and ``optimizer.state`` bytes (Adam's
    ``exp_avg`` and ``exp_avg_sq``, plus its 4-byte ``step`` counter per parameter tensor,
    which the per-parameter formula leaves out). Predicted with the ``fp32`` convention,
    because that is what the model is. On CUDA the allocator's view is added:
    ``torch.cuda.memory_allocated`` after each phase and ``max_memory_allocated``.
    """
    import torch

    check_measure_device(device)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    allocated = {}

    def note(phase: str) -> None:
        if cuda:
            torch.cuda.synchronize(device)
            allocated[phase] = torch.cuda.memory_allocated(device)

    torch.manual_seed(0)
    note("empty")
    model = _small_model(width, depth).to(device)
    note("model")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width, device=device)
    loss = model(x).square().mean()
    loss.backward()
    del loss
    note("backward")
    optimizer.step()
    note("step")

    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    moments = step_counters = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                if key in ("exp_avg", "exp_avg_sq"):
                    moments += _tensor_bytes(value)
                else:
                    step_counters += _tensor_bytes(value)
    predicted = ledger(n, precision=FP32)
    result = {
        "device": device,
        "model": f"{depth} x [Linear({width}, {4 * width}), GELU, Linear({4 * width}, {width})]",
        "params": n,
        "param_tensors": len(params),
        "measured": {"weights": sum(_tensor_bytes(p) for p in params),
                     "gradients": sum(_tensor_bytes(p.grad) for p in params if p.grad is not None),
                     "optimizer_state": moments,
                     "step_counters": step_counters},
        "predicted": {"weights": predicted.weights, "gradients": predicted.gradients,
                      "optimizer_state": predicted.optimizer_state},
    }
    if cuda:
        result["cuda"] = {"allocated": allocated, "max_allocated": torch.cuda.max_memory_allocated(device)}
    return result


def format_measurement(m: dict) -> str:
    """``ringcoll memory --measure``: measured beside predicted, term by term."""
    out = [f"--measure: {m['model']}, N = {m['params']:,} parameters in {m['param_tensors']} tensors,",
           f"  one forward/backward + one Adam step on {m['device']}",
           f"  the model is fp32, so it is predicted with the fp32 convention: "
           f"{FP32.weight_bytes} + {FP32.grad_bytes} + {FP32.optimizer_bytes} = {FP32.bytes_per_param} B per parameter",
           "  measured = bytes of the tensors themselves: parameters, their .grad, optimizer.state",
           f"  {'':<28}{'formula':>8}{'predicted B':>16}{'measured B':>16}{'ratio':>8}"]
    rows = (("weights", "weights", FP32.weight_bytes), ("gradients", "gradients", FP32.grad_bytes),
            ("Adam m, v (exp_avg, _sq)", "optimizer_state", FP32.optimizer_bytes))
    for label, key, coeff in rows:
        predicted, measured = m["predicted"][key], m["measured"][key]
        ratio = measured / predicted if predicted else float("nan")
        out.append(f"  {label:<28}{_coefficient(coeff):>8}{predicted:16,.0f}{measured:16,}{ratio:8.4f}")
    out.append(f"  {'Adam step counters':<28}{'':>8}{'(not in 16N)':>16}{m['measured']['step_counters']:16,}"
               f"   one scalar per parameter tensor")
    if "cuda" in m:
        a = m["cuda"]["allocated"]
        out.append("  CUDA allocator (torch.cuda.memory_allocated, bytes): "
                   f"model {a['model'] - a['empty']:,}; + backward {a['backward'] - a['model']:,}; "
                   f"+ Adam step {a['step'] - a['backward']:,}; peak (max_memory_allocated) "
                   f"{m['cuda']['max_allocated'] - a['empty']:,} (includes activations and workspaces)")
    else:
        out.append("  (no GPU here: counted from tensors on the CPU; on a GPU the allocator's numbers are added)")
    return "\n".join(out) + "\n"
