"""The benchmark's exact checks as a case matrix, for the tests of either run mode.

``wrong_cases(comm, counts)`` runs every collective x dtype x op x form (out-of-place and
in-place) at each count on one Communicator, the way ringcoll-bench calls it, and compares
each result with the values every rank computes for itself (bench.expected_result: small
integers, so every summation order gives the same bits). It returns the wrong cases, named;
empty when all are exact. Every rank of the communicator must call it at the same point
(each case is a collective). The in-process tests run it on the CPU
(tests/multiprocess/test_in_process.py) and on a GPU (tests/gpu/test_cuda.py).
"""

from __future__ import annotations

import torch

from ringcoll._types import RING_COLLECTIVES, ReduceOp
from ringcoll.bootstrap import InProcessRank
from ringcoll.harness.bench import COLLECTIVES, DTYPES, OPS, expected_result, input_op, rank_input, unwritten

_REDUCE_OPS = {"sum": ReduceOp.SUM, "prod": ReduceOp.PRODUCT, "min": ReduceOp.MIN, "max": ReduceOp.MAX,
               "avg": ReduceOp.AVG}


def run_case(comm, coll: str, count: int, dtype: torch.dtype, op: str, in_place: bool) -> torch.Tensor:
    """One call of `coll` on a message of `count` elements; this rank's result, on the CPU.
    Outputs start as a value no result takes (bench.unwritten), so an element the collective
    did not write shows (they started as 7s, which a sum at P = 2 can be)."""
    rank, world, device = comm.rank, comm.world_size, comm.device
    in_numel, out_numel = COLLECTIVES[coll].shapes(count, world)
    inp = rank_input(rank, in_numel, dtype, input_op(COLLECTIVES[coll], op)).to(device)
    fresh_output = torch.full((out_numel,), unwritten(dtype, op), dtype=dtype, device=device)
    _allocated(comm)
    if coll == "all_reduce":
        out = inp if in_place else fresh_output
        comm.all_reduce(inp, op=_REDUCE_OPS[op], output=None if in_place else out)
    elif coll == "reduce_scatter":
        out = inp.view(world, -1)[rank] if in_place else fresh_output
        comm.reduce_scatter_tensor(out, inp, op=_REDUCE_OPS[op])
    else:
        out = fresh_output
        src = out.view(world, -1)[rank] if in_place else inp
        src.copy_(inp)
        comm.all_gather_into_tensor(out, src)
    if out.is_cuda:  # the ring done before a copy to pageable memory waits for it (below)
        torch.cuda.current_stream(out.device).synchronize()
    return out.cpu()


def _allocated(comm) -> None:
    """This rank has allocated its tensors for a case. Ranks that are threads of one GPU
    process then meet on the host, before any launches the case's ring (as the benchmark
    does, bench.Backend.meet_after_allocating): there an allocation (cudaMalloc growing
    torch's cache) or a copy to or from pageable memory can wait for all the process's GPU
    work, a peer's ring among it, and that ring waits for this rank's launch. On the H200
    (2026-12-04) the P = 4 in-process exact checks stopped so at their first case, three
    ranks inside `.to(device)` while the fourth's ring waited for them. The emulated CUDA
    transport models that wait, so the CPU tests would stop the same way without the meeting."""
    device_wide_wait = getattr(comm.transport, "wait_for_the_whole_device", None)
    if device_wide_wait is not None:
        device_wide_wait("an allocation")
    if isinstance(comm.group, InProcessRank) and (comm.device.type == "cuda" or device_wide_wait is not None):
        comm.group.barrier()


def wrong_cases(comm, counts) -> list[str]:
    """Every collective x dtype x op x form at each count (multiples of the world size)."""
    wrong = []
    for coll in RING_COLLECTIVES:  # broadcast and reduce run on the CPU's plan engine only
        definition = COLLECTIVES[coll]
        for dtype_name, dtype in DTYPES.items():
            for op in OPS if definition.reduces else ("sum",):
                if op == "avg" and not dtype.is_floating_point:
                    continue
                for count in counts:
                    expected = expected_result(definition, comm.rank, comm.world_size, count, dtype, op)
                    for in_place in (False, True):
                        if not torch.equal(run_case(comm, coll, count, dtype, op, in_place), expected):
                            wrong.append(f"rank {comm.rank} {coll} {dtype_name} {op} count={count} "
                                         f"{'in-place' if in_place else 'out-of-place'} buffer={comm.buffer_bytes}")
    return wrong
