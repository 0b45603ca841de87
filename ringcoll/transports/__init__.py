"""Transports: one ring, two kinds of memory. The one place a device picks its transport.

    host.HostTransport    CPU tensors: POSIX shared memory (csrc/host/)
    cuda.CudaTransport    CUDA tensors: CUDA IPC peer memory (csrc/cuda/)

base.py states the interface both implement; the Communicator holds one of them.
"""

from __future__ import annotations

import torch

from ringcoll.errors import RingcollError
from ringcoll.transports.base import CollectiveCall, Settings, new_call
from ringcoll.transports.host import HostTransport


def transport_for(device: torch.device):
    """The transport class that serves `device`."""
    if device.type == "cpu":
        return HostTransport
    if device.type == "cuda":
        from ringcoll.transports.cuda import CudaTransport  # torch.cuda only when asked for

        return CudaTransport
    raise RingcollError(f"Communicator: no ringcoll transport for device {device} in this build; "
                        "the shared-memory transport serves CPU tensors, the CUDA IPC one CUDA tensors")


__all__ = ["CollectiveCall", "Settings", "HostTransport", "transport_for"]
