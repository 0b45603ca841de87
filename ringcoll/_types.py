"""dtype and reduction-op codes shared with the C++ core (csrc/include/ringcoll/reduce.h).

The extension knows no torch: it takes a dtype code and an op code. This module is the
one place that turns torch dtypes and ``torch.distributed.ReduceOp`` values into them, and
that refuses what ringcoll does not support, with a message naming the op. The dtypes
themselves are listed once, in reduce.h, and read from there (``_C.dtype_table``).
"""

from __future__ import annotations

import enum

import torch

from ringcoll import _C


class ReduceOp(enum.IntEnum):
    """Reductions ringcoll implements. ``torch.distributed.ReduceOp`` values work too."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    AVG = 4  # SUM, then one division by the world size; floating dtypes only


#: name -> torch dtype, in reduce.h's order ("float32", ..., "int64")
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name, _code, _size, _floating in _C.dtype_table}
#: torch dtype -> the code of reduce.h's DType enum
DTYPE_CODES: dict[torch.dtype, int] = {getattr(torch, name): code for name, code, _size, _floating in _C.dtype_table}
FLOATING_DTYPES = frozenset(getattr(torch, name) for name, _code, _size, floating in _C.dtype_table if floating)
#: the same by code, for the checks after a tensor's dtype has been turned into its code
DTYPE_OF_CODE: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}
ITEM_SIZES: dict[int, int] = {code: size for _name, code, size, _floating in _C.dtype_table}  # code -> bytes
FLOATING_CODES = frozenset(DTYPE_CODES[dtype] for dtype in FLOATING_DTYPES)


def dtype_code(op_name: str, dtype: torch.dtype) -> int:
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        supported = ", ".join(str(d).replace("torch.", "") for d in DTYPE_CODES)
        raise TypeError(f"{op_name}: unsupported dtype {dtype}; ringcoll supports {supported}") from None


def _torch_ops() -> dict:
    """torch.distributed.ReduceOp's values -> ours (built on first use: torch.distributed
    need not be imported for ringcoll's own ops)."""
    import torch.distributed as dist

    return {getattr(dist.ReduceOp, ours.name): ours for ours in ReduceOp if hasattr(dist.ReduceOp, ours.name)}


_TORCH_OPS: dict = {}
# Every op object known so far by id(): ringcoll's members from the start, torch's once read.
# Each is one object for the life of the process (enum members; torch's ReduceOp.SUM etc. are
# class attributes, also kept alive by _TORCH_OPS's keys), so no other live object can have
# its id; a lookup by id skips the hash and == of both kinds, which run in Python (Enum) or
# through pybind11 (torch): a few hundred nanoseconds a call.
_OPS_BY_ID: dict = {id(ours): ours for ours in ReduceOp}


def reduce_op(op_name: str, op) -> ReduceOp:
    """ringcoll.ReduceOp from a ringcoll.ReduceOp or a torch.distributed.ReduceOp value."""
    ours = _OPS_BY_ID.get(id(op))
    if ours is not None:
        return ours
    if not _TORCH_OPS:
        _TORCH_OPS.update(_torch_ops())
        _OPS_BY_ID.update({id(theirs): ours for theirs, ours in _TORCH_OPS.items()})
    try:
        return _TORCH_OPS[op]
    except (KeyError, TypeError):  # not one of them, or a value that cannot be hashed (PREMUL_SUM's)
        pass
    for theirs, ours in _TORCH_OPS.items():  # a ReduceOp object that compares equal to one of them
        try:
            if op == theirs:
                return ours
        except TypeError:
            pass
    raise ValueError(f"{op_name}: unsupported reduction op {op!r}; ringcoll supports "
                     + ", ".join(o.name for o in ReduceOp))


def op_code(op_name: str, op, dtype: int) -> int:
    """reduce.h's code of `op` for a tensor whose dtype has code `dtype` (dtype_code's)."""
    ours = _OPS_BY_ID.get(id(op))  # every call asks this: the lookup reduce_op starts with, minus its frame
    if ours is None:
        ours = reduce_op(op_name, op)
    if ours is _AVG and dtype not in FLOATING_CODES:
        raise ValueError(f"{op_name}: ReduceOp.AVG is only defined for floating dtypes, not {DTYPE_OF_CODE[dtype]}")
    return int(ours)


_AVG = ReduceOp.AVG  # a module global: an enum member's lookup costs a call's worth of time
