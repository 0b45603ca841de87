"""ringcoll: ring reduce-scatter, all-gather and all-reduce written from scratch (and
broadcast and reduce, as plans).

Drop-in replacements for the torch.distributed calls of the same names, over POSIX shared
memory for CPU tensors and CUDA IPC peer memory for CUDA tensors. The package, by role
(docs/where-things-are.md has the map)::

    api.py, communicator.py   the library: drop-in calls, the Communicator, Work, run_in_process
    plans.py                  algorithms as plans: the built-in ones, plans written in Python, the checker
    bootstrap.py              how ranks meet: a process group, or the threads of one process
    views.py, errors.py,      arrays seen as tensors; error types; dtype and op codes
    _types.py
    transports/               host (shared memory) and cuda (CUDA IPC), one interface
    training/                 torch.distributed backend, DDP hook, ZeRO, hierarchical
    learning/                 the schedule mirror, trace, memory ledger, cost model, CLI
    harness/                  process launcher, benchmark, fuzzer
"""

from ringcoll import _moved
from ringcoll._types import ReduceOp
from ringcoll.api import (
    all_gather,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    barrier,
    broadcast,
    destroy_communicators,
    empty,
    get_communicator,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    run_in_process,
    zeros,
)
from ringcoll.communicator import Communicator, CudaCommunicator, Work
from ringcoll.plans import PlanError, algorithms, register_algorithm
from ringcoll.errors import RingcollError, RingcollMismatchError, RingcollPeerError, RingcollTimeoutError
from ringcoll.training import backend as _backend  # registers dist.init_process_group(backend="ringcoll")
from ringcoll.training.ddp import ddp_hook

_moved.install()  # the old flat module names (ringcoll.zero, ringcoll.testing, ...) still import

__version__ = "0.1.0"

__all__ = [
    "Communicator", "CudaCommunicator", "Work", "ReduceOp",
    "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "reduce_scatter", "barrier",
    "broadcast", "reduce",
    "all_gather_single", "reduce_scatter_single",
    "get_communicator", "destroy_communicators", "ddp_hook", "run_in_process", "empty", "zeros",
    "algorithms", "register_algorithm", "PlanError",
    "RingcollError", "RingcollTimeoutError", "RingcollPeerError", "RingcollMismatchError",
]
