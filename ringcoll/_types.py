"""dtype and reduction-op codes shared with the C++ core (csrc/include/ringcoll/reduce.h).

The extension knows no torch: it takes a dtype code and an op code. This module is the
one place that turns torch dtypes and ``torch.distributed.ReduceOp`` values into them, and
that refuses what ringcoll does not support, with a message naming the op.
"""

from __future__ import annotations

import enum

import torch


class ReduceOp(enum.IntEnum):
    """Reductions ringcoll implements. ``torch.distributed.ReduceOp`` values work too."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    AVG = 4  # SUM, then one division by the world size; floating dtypes only


# Codes of reduce.h's DType enum.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float64: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int8: 4,
    torch.uint8: 5,
    torch.int32: 6,
    torch.int64: 7,
}
FLOATING_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})


def dtype_code(op_name: str, dtype: torch.dtype) -> int:
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        supported = ", ".join(str(d).replace("torch.", "") for d in DTYPE_CODES)
        raise TypeError(f"{op_name}: unsupported dtype {dtype}; ringcoll supports {supported}") from None


def reduce_op(op_name: str, op) -> ReduceOp:
    """ringcoll.ReduceOp from a ringcoll.ReduceOp or a torch.distributed.ReduceOp value."""
    if isinstance(op, ReduceOp):
        return op
    import torch.distributed as dist

    for ours in ReduceOp:
        theirs = getattr(dist.ReduceOp, ours.name, None)
        try:
            if theirs is not None and op == theirs:
                return ours
        except TypeError:
            pass
    raise ValueError(f"{op_name}: unsupported reduction op {op!r}; ringcoll supports "
                     + ", ".join(o.name for o in ReduceOp))


def op_code(op_name: str, op, dtype: torch.dtype) -> int:
    ours = reduce_op(op_name, op)
    if ours is ReduceOp.AVG and dtype not in FLOATING_DTYPES:
        raise ValueError(f"{op_name}: ReduceOp.AVG is only defined for floating dtypes, not {dtype}")
    return int(ours)
