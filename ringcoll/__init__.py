"""ringcoll: ring reduce-scatter, all-gather and all-reduce written from scratch.

Drop-in replacements for the torch.distributed calls of the same names, over POSIX shared
memory for CPU tensors (and CUDA IPC peer memory for CUDA tensors where built). See
README.md and docs/.
"""

from ringcoll._types import ReduceOp
from ringcoll.api import (
    all_gather,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    barrier,
    destroy_communicators,
    get_communicator,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
)
from ringcoll.communicator import Communicator, Work
from ringcoll import backend as _backend  # registers dist.init_process_group(backend="ringcoll")
from ringcoll.ddp import ddp_hook
from ringcoll.errors import RingcollError, RingcollMismatchError, RingcollPeerError, RingcollTimeoutError

__version__ = "0.1.0"

__all__ = [
    "Communicator", "Work", "ReduceOp",
    "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "reduce_scatter", "barrier",
    "all_gather_single", "reduce_scatter_single",
    "get_communicator", "destroy_communicators", "ddp_hook",
    "RingcollError", "RingcollTimeoutError", "RingcollPeerError", "RingcollMismatchError",
]
