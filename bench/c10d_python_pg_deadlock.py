"""Reproduces, without ringcoll, the deadlock that made ringcoll's backend forward the
collectives it leaves to gloo itself (ringcoll/training/backend.py, docs/training.md).

A Python subclass of c10d's ProcessGroup that registers a ProcessGroupGloo as its CPU
backend and overrides nothing; two ranks call broadcast_object_list and broadcast in a
loop. With torch 2.13 on a 2-core machine it hung within 1,500 rounds in 4 runs out of 4;
with plain gloo ("gloo" argument) 3 runs out of 3 finished. Usage:

    python bench/c10d_python_pg_deadlock.py [pypg|gloo] [rounds]

Why (read from gdb backtraces of a hung rank and torch's PyProcessGroup.hpp): the Python
call ``group.broadcast(...)`` reaches the pybind11 trampoline's ``broadcast``, which takes
the GIL to look for a Python override (``WORK_OVERRIDE``) and, finding none, calls the
C++ base ``ProcessGroup::broadcast`` *still holding the GIL*. That dispatches to
``ProcessGroupGloo::enqueue``, which waits for gloo's work-queue mutex. Meanwhile a gloo
worker thread, holding that mutex, is destroying the previous finished work, whose tensors
were created in Python: dropping their last reference needs the GIL. GIL, then queue
mutex on one thread; queue mutex, then GIL on the other: a lock-order inversion. Plain
gloo's bindings release the GIL before enqueueing, so they never hold both.

The same holds for every method the trampoline handles this way when a subclass does not
override it (torch 2.13: allgather, allreduce, allreduce_coalesced, barrier, broadcast,
reduce_scatter, send, recv, and the coalesced/all-to-all forms, which fall back to their
older names). ringcoll's backend overrides or forwards all of them, calling the gloo
object's own bindings, which release the GIL.
"""

import datetime
import faulthandler
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class PythonProcessGroup(dist.ProcessGroup):
    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self.gloo)

    def getBackendName(self):
        return "pypg"


def worker(rank, world, rounds, port, backend):
    dist.Backend.register_backend("pypg", PythonProcessGroup, devices=["cpu"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    faulthandler.dump_traceback_later(30, exit=True)  # a hang: print where, and exit 1
    for i in range(rounds):
        obj = [{"round": i}] if rank == 0 else [None]
        dist.broadcast_object_list(obj, src=0)
        dist.broadcast(torch.full((4,), float(rank)), src=0)
        assert obj[0] == {"round": i}
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()
    print(f"rank {rank}, {backend}: {rounds} rounds, no deadlock", flush=True)


if __name__ == "__main__":
    backend = sys.argv[1] if len(sys.argv) > 1 else "pypg"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1500
    mp.spawn(worker, args=(2, rounds, 29577, backend), nprocs=2)
