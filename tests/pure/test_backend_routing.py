"""Where the torch.distributed backend sends a call, decided without a GPU.

CUDA tensors cannot be made on a CPU-only machine, so a tensor subclass that reports a CUDA
device stands in for them: the routing reads only ``device``, ``dtype``,
``is_contiguous()`` and ``is_cuda`` (training/backend.py: ``routing_device`` and
``RingcollProcessGroup._fallback``). The GPU tier runs the same routes on real tensors.
"""

from __future__ import annotations

import types

import pytest
import torch

from ringcoll.training import backend


class OnGpu(torch.Tensor):
    """A CPU tensor that says it is on cuda:<index> (the routing is all that reads it)."""

    index = 0

    @property
    def device(self):
        return torch.device("cuda", self.index)

    @property
    def is_cuda(self):
        return True


class OnGpu1(OnGpu):
    index = 1


def on_gpu(n=4, dtype=torch.float32, cls=OnGpu):
    return torch.zeros(n, dtype=dtype).as_subclass(cls)


def test_cpu_tensors_go_to_the_shared_memory_ring():
    assert backend.routing_device([torch.ones(3), torch.zeros(6)]) == torch.device("cpu")


def test_cuda_tensors_go_to_their_gpus_ring():
    assert backend.routing_device([on_gpu(), on_gpu(8)]) == torch.device("cuda", 0)
    assert backend.routing_device([on_gpu(cls=OnGpu1)]) == torch.device("cuda", 1)


@pytest.mark.parametrize("tensors, why", [
    (lambda: [], "no tensors"),
    (lambda: [torch.ones(3), on_gpu()], "two devices"),
    (lambda: [on_gpu(), on_gpu(cls=OnGpu1)], "two GPUs"),
    (lambda: [torch.ones(3), torch.ones(3, dtype=torch.float64)], "two dtypes"),
    (lambda: [torch.ones(4, 4).t()], "not contiguous"),
    (lambda: [torch.ones(3, dtype=torch.complex64)], "a dtype ringcoll lacks"),
    (lambda: [torch.empty(3, device="meta")], "a device no transport serves"),
])
def test_what_the_rings_do_not_serve_goes_to_the_fallback(tensors, why):
    assert backend.routing_device(tensors()) is None, why


def _group(cuda_fallback):
    """What _fallback reads of a RingcollProcessGroup (not building a communicator: each call counted)."""
    return types.SimpleNamespace(fallback="gloo-group", cuda_fallback=cuda_fallback, _bootstrapping=False,
                                 _sequence=0)


def test_fallback_is_nccl_for_cuda_tensors_where_nccl_runs(monkeypatch):
    monkeypatch.setattr(backend, "call_counts", backend.collections.Counter())
    pg = _group(cuda_fallback="nccl-group")
    # broadcast's c10d forms: ([t], opts), (t, root=0): tensors anywhere in args or kwargs
    assert backend.RingcollProcessGroup._fallback(pg, "broadcast", (([on_gpu()], None), {})) == "nccl-group"
    assert backend.RingcollProcessGroup._fallback(pg, "broadcast", ((), {"tensor": on_gpu()})) == "nccl-group"
    assert backend.RingcollProcessGroup._fallback(pg, "broadcast", (([torch.ones(2)], None), {})) == "gloo-group"
    assert backend.call_counts == {"nccl:broadcast": 2, "gloo:broadcast": 1}
    assert pg._sequence == 3  # each call issued on the group, whichever backend takes it


def test_fallback_is_gloo_without_nccl(monkeypatch):
    monkeypatch.setattr(backend, "call_counts", backend.collections.Counter())
    pg = _group(cuda_fallback=None)  # no GPU, no NCCL, or RINGCOLL_CUDA_FALLBACK=gloo
    assert backend.RingcollProcessGroup._fallback(pg, "send", (([on_gpu()], 1, 0), {})) == "gloo-group"
    assert backend.call_counts == {"gloo:send": 1}


def test_cuda_fallback_setting_is_checked(monkeypatch):
    monkeypatch.setenv("RINGCOLL_CUDA_FALLBACK", "mpi")
    with pytest.raises(ValueError, match="RINGCOLL_CUDA_FALLBACK='mpi'; expected one of nccl, gloo"):
        backend._nccl_if_usable(None, 0, 1, None)
    monkeypatch.setenv("RINGCOLL_CUDA_FALLBACK", "gloo")
    assert backend._nccl_if_usable(None, 0, 1, None) is None


def test_communicators_are_keyed_by_device_with_its_index():
    assert backend._communicator_device("cpu") == torch.device("cpu")
    assert backend._communicator_device(torch.device("cuda", 3)) == torch.device("cuda", 3)


def test_ops_ringcoll_serves_are_those_the_communicator_accepts():
    """The backend sends a call to ringcoll only with an op the communicator's own check
    (op_code) accepts for that dtype; anything else goes to the fall-back."""
    import torch.distributed as dist

    import ringcoll
    from ringcoll.training.backend import _ringcoll_op

    assert _ringcoll_op(dist.ReduceOp.SUM, torch.bfloat16) is ringcoll.ReduceOp.SUM
    assert _ringcoll_op(dist.ReduceOp.AVG, torch.float32) is ringcoll.ReduceOp.AVG
    assert _ringcoll_op(dist.ReduceOp.AVG, torch.int32) is None  # AVG of integers: gloo's
    assert _ringcoll_op(dist.ReduceOp.BAND, torch.int32) is None
    assert _ringcoll_op(dist.ReduceOp.SUM, torch.complex64) is None


def test_op_types_read_as_unknown_where_this_torch_has_no_such_op_type():
    """torch 2.11 has no OpType.REDUCE_SCATTER_TENSOR_COALESCED: importing ringcoll failed
    there (the first GPU run, 2026-12-04). A name the enum lacks reads as UNKNOWN; this
    torch's own names read as themselves."""
    class Older:  # an OpType enum missing one name, as torch 2.11's
        UNKNOWN = 99
        ALLREDUCE, ALLREDUCE_COALESCED, _REDUCE_SCATTER_BASE, REDUCE_SCATTER = 0, 1, 2, 3
        ALLGATHER, ALLGATHER_COALESCED, BARRIER, BROADCAST, REDUCE = 4, 5, 6, 7, 8

    older = backend.op_types(Older)
    assert older["reduce_scatter_tensor_coalesced"] == 99
    assert older["all_reduce"] == 0 and older["broadcast"] == 7
    op_type = torch._C._distributed_c10d.OpType
    assert backend.OP_TYPES == {name: int(getattr(op_type, op)) for name, op in backend.OP_TYPE_NAMES.items()}
