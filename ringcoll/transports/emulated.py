"""The CUDA transport's kernels on the CPU, as a transport: CI's stand-in for the in-process
CUDA mode (there is no GPU in CI).

The ranks are threads of one process (ringcoll.run_in_process), as in the in-process CUDA
mode; their "GPU allocations" are host memory laid out as on the GPU, and each call runs
device_ring.h's thread blocks as std::threads (``_C.emulation.Ring``, csrc/emulation/) over
the caller's CPU tensors: the same launch plan, flags, mismatch check, errors and collective
close as ``_C.CudaComm``. So a Communicator over it takes the benchmark's exact checks
(ringcoll/harness/exact.py) through the whole Python path, kernels included. What it does
not have is what only a GPU has: streams (calls complete before they return), IPC, the
memory model and the compiled PTX. For tests (tests/multiprocess/test_in_process.py); a
Communicator gets it by overriding ``Communicator.transport_class``.
"""

from __future__ import annotations

import builtins
import warnings
from typing import Callable, Optional, Sequence

from ringcoll import _C, errors
from ringcoll.bootstrap import InProcessRank
from ringcoll.errors import RingcollError
from ringcoll.transports.base import CollectiveCall, Settings
from ringcoll.transports.cuda import kernel_variant, one_word_barrier
from ringcoll.transports.host import CallQueue

_COLLECTIVE_CODES = {"all_reduce": 0, "reduce_scatter": 1, "all_gather": 2}  # ring.h's Collective
EMULATED_SMS = 8  # the emulated device's SM count: bounds a fused launch's grid
THREADS_PER_BLOCK = 4  # each a std::thread; the kernels' loops stride by it as by blockDim


class EmulatedCudaTransport:
    """Rank ``settings.rank`` of one ``_C.emulation.Ring`` that rank 0 builds and the
    bootstrap hands round (threads of one process share it)."""

    slot_alignment = _C.cuda_slot_alignment
    takes_arrays = False
    plain_calls = None  # every call goes through the Python path, as on CUDA

    @staticmethod
    def resolve_device(device):
        if device.type != "cpu":
            raise ValueError(f"Communicator: the emulated CUDA transport runs on CPU tensors, not {device}")
        return device

    def __init__(self, settings: Settings, exchange: Callable[..., list]):
        if not isinstance(settings.bootstrap, InProcessRank):
            raise RingcollError("Communicator: the emulated CUDA transport needs the ranks as threads of one "
                                "process (ringcoll.run_in_process)")
        self.rank = settings.rank
        name, variant = kernel_variant()
        ring = None
        if settings.rank == 0:
            ring = _C.emulation.Ring(settings.world_size, settings.buffer_bytes, settings.timeout, variant,
                                     threads_per_block=THREADS_PER_BLOCK, check_calls=settings.check,
                                     max_blocks=EMULATED_SMS)
        self._ring = exchange(ring, RINGCOLL_CUDA_KERNEL=name)[0]
        self._calls = CallQueue()
        self.broken_reason = ""
        self._barrier_word, self._barrier_call = one_word_barrier("cpu")  # CUDA's barrier, on the CPU

    @property
    def broken(self) -> bool:
        return bool(self.broken_reason)

    def _run(self, collective: int, call: Optional[CollectiveCall]) -> str:
        """This rank's part of one call on the shared ring; raises what CudaComm would."""
        if self.broken_reason and call is not None:  # a broken ring still closes
            raise RingcollError(f"{call.collective}: communicator is broken by an earlier error ({self.broken_reason})")
        if call is None:
            emulated = (self.rank, collective, 0, 0, 0, 0, 0)
        else:
            emulated = (self.rank, collective, call.dtype, call.op or 0, call.src, call.dst, call.user_count)
        [(kind, message)] = self._ring.run([emulated])
        if kind:
            error = getattr(errors, kind, None) or getattr(builtins, kind, RingcollError)
            if issubclass(error, RingcollError):
                self.broken_reason = message
            raise error(f"{call.collective if call else 'close'}: {message}")
        return message

    def submit(self, call: CollectiveCall, outputs: list, keep_alive: Sequence, async_op: bool,
               then: Optional[Callable[[], None]] = None, name: Optional[str] = None):
        def run() -> None:
            self._run(_COLLECTIVE_CODES[call.collective], call)
            if then is not None:
                then()

        return self._calls.submit(run, async_op, name or call.collective)

    def barrier(self, async_op: bool):
        return self.submit(self._barrier_call, [], (), async_op)

    def synchronize(self) -> None:
        self._calls.synchronize()

    def launch_on_stream(self, call: CollectiveCall, stream) -> None:
        raise ValueError(f"{call.collective}: the emulated CUDA transport has no streams")

    def close(self, wait_for_peers: bool = True) -> None:
        """The collective close of cuda_comm.cu, as the emulator runs it (every peer's
        `finished` word awaited); a kept allocation is warned about, as on a GPU."""
        if not wait_for_peers:  # a finalizer must not wait for the others: keep the memory
            return
        kept = []
        self._calls.close(lambda: kept.append(self._run(_C.emulation.Ring.CLOSE, None)))
        if kept and kept[0]:
            warnings.warn(f"ringcoll: rank {self.rank} keeps its emulated buffer: {kept[0]}", RuntimeWarning,
                          stacklevel=4)
