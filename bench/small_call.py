"""What a small plain call costs in Python: the torch.distributed-shaped tensor forms at 4 KiB
float32 on the CPU host transport, beside the prepared form and the bare binding call.

    OMP_NUM_THREADS=1 python bench/small_call.py        # P=1: one rank in this process
    OMP_NUM_THREADS=1 python bench/small_call.py 2      # P=2: two processes (torch multiprocessing)
    OMP_NUM_THREADS=1 MPI4PY_MPIABI=openmpi mpirun.openmpi --allow-run-as-root -np 2 \
        python bench/small_call.py mpi                  # P=2 under mpirun, Open MPI's calls beside

Each case runs REPS blocks of CALLS calls (environment; default 40 x 1000), in turn with the
others, so that a busy moment of a shared machine hits all of them; a case's number is its
fastest block's mean per call (short blocks: on a loaded machine most long ones get
descheduled), with the median beside it. At P=2 a barrier starts each block on both ranks and
rank 0 prints. "_C run" is HostComm.run on the same tensor: the floor the Python layers sit on.
"ring ops as a user plan" is the built-in ring's ops registered as a researcher's plan, timed
beside the built-in "ring plan": what a plan pays for not being built in (nothing, since
2026-12-06; 0.4-1.5 us before).
Under mpirun the cases also hold mpi4py's Allreduce, Reduce_scatter_block and Allgather on
numpy views of the same tensors, out of place and in place (MPI_IN_PLACE), timed in turn with
ringcoll's in the same processes. COUNT (environment, default 1024) is each rank's input in
float32 elements: 512 gives the benchmark's 4 KiB all-gather and reduce-scatter.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Optional

import torch

import ringcoll

COUNT = int(os.environ.get("COUNT", "1024"))  # elements per rank's input: 4 KiB of float32
CALLS = int(os.environ.get("CALLS", "1000"))
REPS = int(os.environ.get("REPS", "40"))


def _ring_as_a_users_plan(world: int, rank: int) -> list:
    """The built-in ring's own ops, registered as a user's plan: timed beside the built-in, a
    difference is what a researcher's plan pays for not being built in."""
    from ringcoll import plans

    return list(plans.plan("ring", "all_reduce", world).ops[rank])


def cases(comm, group) -> dict:
    world = comm.world_size
    ringcoll.register_algorithm("ring (user)", _ring_as_a_users_plan)
    t, out = torch.ones(COUNT), torch.empty(COUNT)
    whole, shard = torch.ones(COUNT * world), torch.empty(COUNT)
    piece, gathered = torch.ones(COUNT), torch.empty(COUNT * world)
    own = gathered.view(world, -1)[comm.rank]  # in place: this rank's chunk of the output
    binding = comm.transport._comm
    return {
        "all_reduce in place": lambda: comm.all_reduce(t),
        "ringcoll.all_reduce (module)": lambda: ringcoll.all_reduce(t, group=group),
        "all_reduce out of place": lambda: comm.all_reduce(t, output=out),
        "all_reduce out of place, native": lambda: comm.all_reduce(t, output=out, algorithm="native"),
        "all_reduce out of place, ring plan": lambda: comm.all_reduce(t, output=out, algorithm="ring"),
        "all_reduce, ring ops as a user plan": lambda: comm.all_reduce(t, output=out, algorithm="ring (user)"),
        "all_gather_into_tensor": lambda: comm.all_gather_into_tensor(gathered, piece),
        "all_gather_into_tensor in place": lambda: comm.all_gather_into_tensor(gathered, own),
        "all_gather_into_tensor, native": lambda: comm.all_gather_into_tensor(gathered, piece, algorithm="native"),
        "all_gather_into_tensor, ring plan": lambda: comm.all_gather_into_tensor(gathered, piece, algorithm="ring"),
        "reduce_scatter_tensor": lambda: comm.reduce_scatter_tensor(shard, whole),
        "reduce_scatter_tensor, native": lambda: comm.reduce_scatter_tensor(shard, whole, algorithm="native"),
        "reduce_scatter_tensor, ring plan": lambda: comm.reduce_scatter_tensor(shard, whole, algorithm="ring"),
        "broadcast from rank 0": lambda: comm.broadcast(t, 0),
        "broadcast, native named": lambda: comm.broadcast(t, 0, algorithm="native"),
        "reduce to rank 0": lambda: comm.reduce(t, 0),
        "prepared all_reduce": comm.prepare_all_reduce(t),
        "_C run (floor)": lambda: binding.run("all_reduce", t.data_ptr(), t.data_ptr(), COUNT, 0, 0),
        "_C run all_gather in place": lambda: binding.run("all_gather", own.data_ptr(), gathered.data_ptr(),
                                                          COUNT, 0, None),
    }


def mpi_cases(mpi) -> dict:
    """Open MPI's three calls on the same sizes (float32 numpy views), as ringcoll-bench times them."""
    world = mpi.COMM_WORLD.size
    t, out = torch.ones(COUNT).numpy(), torch.empty(COUNT).numpy()
    whole, shard = torch.ones(COUNT * world).numpy(), torch.empty(COUNT).numpy()
    gathered = torch.empty(COUNT * world).numpy()
    world_comm = mpi.COMM_WORLD
    return {
        "mpi Allreduce out of place": lambda: world_comm.Allreduce(t, out, op=mpi.SUM),
        "mpi Reduce_scatter_block": lambda: world_comm.Reduce_scatter_block(whole, shard, op=mpi.SUM),
        "mpi Allgather": lambda: world_comm.Allgather(t, gathered),
        "mpi Allreduce in place": lambda: world_comm.Allreduce(mpi.IN_PLACE, t, op=mpi.SUM),
        "mpi Reduce_scatter_block in place": lambda: world_comm.Reduce_scatter_block(mpi.IN_PLACE, whole, op=mpi.SUM),
        "mpi Allgather in place": lambda: world_comm.Allgather(mpi.IN_PLACE, gathered),
    }


def measure(comm, group, barrier, extra: Optional[dict] = None) -> dict:
    calls = {**cases(comm, group), **(extra or {})}
    for fn in calls.values():
        for _ in range(200):
            fn()
    blocks: dict = {name: [] for name in calls}
    for _ in range(REPS):
        for name, fn in calls.items():
            barrier()
            start = time.perf_counter()
            for _ in range(CALLS):
                fn()
            blocks[name].append((time.perf_counter() - start) / CALLS * 1e6)
    return {name: (min(b), statistics.median(b)) for name, b in blocks.items()}


def report(results: dict, world: int) -> None:
    print(f"P={world} load={os.getloadavg()}")
    for name, (fastest, median) in results.items():
        print(f"  {name:36s} min {fastest:6.2f} us  median {median:6.2f} us")


def one_rank() -> None:
    def fn(group):
        try:
            return measure(ringcoll.get_communicator(group), group, lambda: None)
        finally:
            ringcoll.destroy_communicators()

    report(ringcoll.run_in_process(1, fn)[0], 1)


def measure_ranked(rank: int, world: int, address: str, barrier=None, extra: Optional[dict] = None) -> None:
    """One of `world` processes: a gloo group at `address`, the cases (and `extra`) timed
    with `barrier` (default the group's) starting each block; rank 0 prints."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
    results = measure(ringcoll.get_communicator(), None, barrier or dist.barrier, extra)
    if rank == 0:
        report(results, world)
    ringcoll.destroy_communicators()
    dist.destroy_process_group()


def rank_main(rank: int, world: int) -> None:
    measure_ranked(rank, world, "tcp://127.0.0.1:29533")


def mpi_main() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    address = world.bcast(f"tcp://127.0.0.1:{29533 + os.getpid() % 1000}" if world.rank == 0 else None)
    measure_ranked(world.rank, world.size, address, world.Barrier, mpi_cases(MPI))


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1:] == ["mpi"]:
        mpi_main()
    elif sys.argv[1:] == ["2"]:
        import torch.multiprocessing as mp

        mp.spawn(rank_main, args=(2,), nprocs=2)
    else:
        one_rank()
