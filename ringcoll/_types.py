"""dtype, reduction-op and collective codes shared with the C++ core
(csrc/include/ringcoll/reduce.h, collectives.h).

The extension knows no torch: it takes a dtype code and an op code. This module is the
one place that turns torch dtypes and ``torch.distributed.ReduceOp`` values into them, and
that refuses what ringcoll does not support, with a message naming the op. The dtypes and
the collectives themselves are listed once, in C++, and read from there
(``_C.dtype_table``, ``_C.collective_table``).
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
#: the code of reduce.h's DType enum -> its name
DTYPE_NAMES: dict[int, str] = {code: name for name, code, _size, _floating in _C.dtype_table}
#: the code of reduce.h's DType enum -> its element's bytes
DTYPE_SIZES: dict[int, int] = {code: size for _name, code, size, _floating in _C.dtype_table}
FLOATING_DTYPES = frozenset(getattr(torch, name) for name, _code, _size, floating in _C.dtype_table if floating)

#: collectives.h's name -> code ("all_reduce": 0, ..., "barrier", "broadcast", "reduce")
COLLECTIVE_CODES: dict[str, int] = {row[0]: row[1] for row in _C.collective_table}
#: the collectives with a message, in code order (all of them but barrier)
DATA_COLLECTIVES: tuple = tuple(name for name, _code, _reduces, moves, _rooted in _C.collective_table if moves)
#: those that combine the ranks' contributions with an op
REDUCING_COLLECTIVES: frozenset = frozenset(name for name, _code, reduces, _moves, _rooted in _C.collective_table
                                            if reduces)
#: those with a root (broadcast's source, reduce's destination), which only plans run
ROOTED_COLLECTIVES: frozenset = frozenset(name for name, _code, _reduces, _moves, rooted in _C.collective_table
                                          if rooted)
#: the data collectives every rank ends with a share of, in code order: the ring's three,
#: which every transport runs natively (ring.h)
RING_COLLECTIVES: tuple = tuple(name for name in DATA_COLLECTIVES if name not in ROOTED_COLLECTIVES)


#: torch.distributed.ReduceOp's values -> ours (torch imports torch.distributed with itself;
#: a build without it has none).
_TORCH_OPS: dict = ({getattr(torch.distributed.ReduceOp, ours.name): ours for ours in ReduceOp
                     if hasattr(torch.distributed.ReduceOp, ours.name)} if torch.distributed.is_available() else {})


def reduce_op(op_name: str, op) -> ReduceOp:
    """ringcoll.ReduceOp from a ringcoll.ReduceOp or a torch.distributed.ReduceOp value."""
    if isinstance(op, ReduceOp):
        return op
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


#: The one CPU device object communicators hold: the checks know it by identity (a tensor on
#: it is `t.is_cpu`, one attribute read instead of building and comparing a device).
CPU = torch.device("cpu")


def _configure_tensor_checks() -> None:
    """Hand the extension's argument checks (csrc/bindings/tensor_checks.h) what they know by
    identity: torch.Tensor, the CPU device, every dtype's code, and the ReduceOp objects a
    call names (ringcoll's and torch.distributed's). Any other op object goes to reduce_op,
    which resolves it or raises. Where torch.Tensor carries DLPack's C exchange table (DLPack
    1.3; torch 2.13 has it), the checks read a plain tensor's facts through it in one C call
    (csrc/bindings/dlpack_exchange.h), learning DLPack's name of each dtype from an empty
    sample of it."""
    ops = [(ours, int(ours)) for ours in ReduceOp] + [(theirs, int(ours)) for theirs, ours in _TORCH_OPS.items()]
    samples = [(torch.empty(0, dtype=dtype), code) for dtype, code in DTYPE_CODES.items()]
    _C.configure_tensor_checks(torch.Tensor, CPU, reduce_op, list(DTYPE_CODES.items()), ops,
                               parameter_type=torch.nn.Parameter,
                               dlpack_api=getattr(torch.Tensor, "__dlpack_c_exchange_api__", None),
                               dtype_samples=samples)


_configure_tensor_checks()

#: dtype_code(op_name, dtype): reduce.h's code of a torch dtype; TypeError naming the op if
#: ringcoll does not support it.
dtype_code = _C.dtype_code
#: op_code(op_name, op, dtype_code): reduce.h's code of `op` (a ringcoll or torch.distributed
#: ReduceOp) for a tensor of that dtype; ValueError naming the op for an unknown op, or AVG
#: on an integer dtype.
op_code = _C.op_code


def torch_tensor_forms():
    """torch.distributed's tensor-form gather and scatter, under this torch's names:
    ``(all_gather_single, reduce_scatter_single)``. torch 2.13 renamed them (the old
    ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` now warn on every call); older
    torch has only the old names. Whatever ringcoll calls on gloo goes through these."""
    import torch.distributed as dist

    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor,
            getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)
