"""CPU tier: asking for the CUDA transport gives it where a GPU is, and a clear error where not."""

from ringcoll.testing import spawn


def _cuda_communicator_or_clear_error(rank, world):
    import ringcoll

    try:
        comm = ringcoll.Communicator(device="cuda")
    except ringcoll.RingcollError as e:
        return "error", str(e)
    kind = type(comm).__name__
    comm.close()
    return "built", kind


def test_cuda_device_gives_the_cuda_transport_or_a_clear_error():
    # Runs everywhere: without a GPU the CUDA request must fail clearly, not crash.
    import torch

    for outcome, detail in spawn(_cuda_communicator_or_clear_error, 2):
        if torch.cuda.is_available():
            assert (outcome, detail) == ("built", "CudaCommunicator")
        else:
            assert outcome == "error" and detail.startswith("Communicator: CUDA tensors were requested"), detail
