"""CPU tier: asking for the CUDA transport gives it where a GPU is, and a clear error where not."""

from ringcoll.harness.launcher import spawn


def _cuda_communicator_or_clear_error(rank, world):
    import ringcoll

    try:
        comm = ringcoll.Communicator(device="cuda")
    except ringcoll.RingcollError as e:
        return "error", str(e)
    kind = type(comm.transport).__name__
    comm.close()
    return "built", kind


def test_cuda_device_gives_the_cuda_transport_or_a_clear_error():
    # Runs everywhere: without a GPU the CUDA request must fail clearly, not crash.
    import torch

    for outcome, detail in spawn(_cuda_communicator_or_clear_error, 2):
        if torch.cuda.is_available():
            assert (outcome, detail) == ("built", "CudaTransport")
        else:
            assert outcome == "error" and detail.startswith("Communicator: CUDA tensors were requested"), detail


def test_array_producers_are_viewed_not_copied():
    # CudaCommunicator's collectives take CuPy arrays by viewing them as tensors
    # (ringcoll.views.tensor_view): a copy would silently lose every write to the output.
    # numpy stands in for CuPy here (DLPack on the CPU); the GPU tier runs CuPy itself.
    import numpy as np
    import torch

    from ringcoll.views import tensor_view as _tensor_view

    array = np.arange(5, dtype=np.float32)
    view = _tensor_view(array)
    view += 10
    assert isinstance(view, torch.Tensor) and array.tolist() == [10.0, 11.0, 12.0, 13.0, 14.0]
    tensor = torch.ones(2)
    assert _tensor_view(tensor) is tensor and _tensor_view(None) is None
    assert _tensor_view("not an array") == "not an array"  # left for the collective's validation to name


def _backend_cuda_route(rank, world):
    import torch
    import torch.distributed as dist

    import ringcoll

    pg = dist.group.WORLD
    try:
        comm = pg.communicator("cuda")
        outcome = ("built", type(comm.transport).__name__, ringcoll.get_communicator(pg, "cuda") is comm)
    except ringcoll.RingcollError as e:
        outcome = ("error", str(e), None)
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)  # the CPU ring is unaffected either way
    return outcome, t.tolist()


def test_backend_routes_cuda_tensors_to_the_cuda_ring_of_their_device():
    # The backend's communicator for a CUDA device is the CUDA transport (one per device,
    # shared with ringcoll.get_communicator); without a GPU, the same clear error as above.
    import torch

    for outcome, cpu_sum in spawn(_backend_cuda_route, 2, backend="ringcoll"):
        assert cpu_sum == [1.0, 1.0, 1.0]
        if torch.cuda.is_available():
            assert outcome == ("built", "CudaTransport", True)
        else:
            assert outcome[0] == "error" and outcome[1].startswith("Communicator: CUDA tensors were requested"), outcome
