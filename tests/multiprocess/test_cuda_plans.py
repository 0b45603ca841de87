"""Plans on the CUDA kernels (csrc/cuda/device_plan.h), run by the emulator (ranks as
threads of one process, thread blocks as std::threads: the kernels' own code on the CPU).

Every built-in plan of every collective (broadcast and reduce at every root) gives the
very bits the CPU transport's engine gives for the same plan on the same random inputs, at
P = 1..5 and 8 (the CPU engine is held to gloo by test_plans.py); integer sums are exact.
Then what the GPU's engine adds to the CPU's: plans and the ring kernels interleaved on one
communicator, across grids and slot layouts (a slot refilled while a peer's other block
still reads it is the hazard); both kernel variants; a root that finishes its broadcast
before its peers have checked their calls (a plan's rank may, a ring's may not: the call
check must not take it for a mismatch); ranks that disagree on the algorithm; a rank that
never comes to a plan call; a plan too wide for the kernels' bookkeeping, refused by name;
and for the direct plans, which read peers' inputs where they lie: an input written the
moment its call returns, counts that differ without the call check, a peer that never
posts its input. Last, symmetric memory on the CUDA transport with the peers modelled as
other processes (the emulator's peers_in_process=False): the direct plans reading it
exactly, an ordinary input out of reach refused on every rank, the collective allocation.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import ringcoll
from ringcoll import plans
from ringcoll.transports.emulated import EmulatedCudaTransport

from test_collectives import all_reduce_overwritten_on_return

TIMEOUT = 60


class EmulatedCudaCommunicator(ringcoll.Communicator):
    @staticmethod
    def transport_class(device):
        return EmulatedCudaTransport


class ProcessesTransport(EmulatedCudaTransport):
    peers_in_process = False  # the ranks as peers in other processes: only symmetric memory is in reach


class ModelledProcessesCommunicator(ringcoll.Communicator):
    """The emulator modelling peers in other processes (EmulatedRing's peers_in_process):
    a peer's plain pointer cannot be read, a symmetric arena's part is mapped again at an
    address of each reader's own, as CUDA IPC maps it."""

    @staticmethod
    def transport_class(device):
        return ProcessesTransport


def _inputs(rank: int, count: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 101 + rank)
    if dtype.is_floating_point:
        return torch.randn(count, generator=g).to(dtype)
    return torch.randint(-50, 50, (count,), generator=g).to(dtype)


def _run(comm, collective: str, algorithm: str, rank: int, world: int, count: int, dtype, op, root: int, seed: int):
    """One call of `collective` on fresh inputs; returns its result."""
    x = _inputs(rank, count * (world if collective == "reduce_scatter" else 1), dtype, seed)
    if collective == "all_reduce":
        comm.all_reduce(x, op=op, algorithm=algorithm)
        return x
    if collective == "reduce_scatter":
        out = torch.empty(count, dtype=dtype)
        comm.reduce_scatter_tensor(out, x, op=op, algorithm=algorithm)
        return out
    if collective == "all_gather":
        out = torch.empty(count * world, dtype=dtype)
        comm.all_gather_into_tensor(out, x, algorithm=algorithm)
        return out
    if collective == "broadcast":
        comm.broadcast(x, root, algorithm=algorithm)
        return x
    comm.reduce(x, root, op=op, algorithm=algorithm)
    return x


def _cases(world: int):
    """(collective, algorithm, root) for every built-in plan; every root of the rooted ones.
    The direct plans read peers' inputs where they lie: the ranks are threads of one process
    here, so every peer's pointers are valid (device_plan.h)."""
    for algorithm in sorted(plans.BUILTIN):
        for collective in plans.BUILTIN_COLLECTIVES[algorithm]:
            roots = range(world) if collective in ("broadcast", "reduce") else [0]
            for root in roots:
                yield collective, algorithm, root


def _same_bits_as_the_cpu(group, counts):
    rank, world = group.rank, group.world_size
    differ = []
    # A buffer small enough that the larger count takes several slices of every plan
    with ringcoll.Communicator(group=group, buffer_bytes=1 << 13, timeout=TIMEOUT) as cpu, \
            EmulatedCudaCommunicator(group=group, buffer_bytes=1 << 13, timeout=TIMEOUT) as gpu:
        seed = 0
        for collective, algorithm, root in _cases(world):
            for count in counts:
                for dtype, op in ((torch.float32, ringcoll.ReduceOp.SUM), (torch.int32, ringcoll.ReduceOp.MAX)):
                    seed += 1
                    want = _run(cpu, collective, algorithm, rank, world, count, dtype, op, root, seed)
                    got = _run(gpu, collective, algorithm, rank, world, count, dtype, op, root, seed)
                    if not torch.equal(want.view(torch.uint8) if dtype.is_floating_point else want,
                                       got.view(torch.uint8) if dtype.is_floating_point else got):
                        differ.append(f"{algorithm} {collective} root {root} count {count} {dtype} rank {rank}")
        gpu.barrier()
    return differ


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8], ids=lambda w: f"P{w}")
def test_every_builtin_plan_gives_the_cpu_engines_bits(world):
    differ = sum(ringcoll.run_in_process(world, _same_bits_as_the_cpu, [world * 3, world * 701], timeout=300), [])
    assert not differ, f"{len(differ)} cases differ, e.g. " + "; ".join(differ[:5])


def _interleaved(group, variant_checks):
    """Ring kernels, plans of 1, P and 16 chunks, one grid and several, in turn on one
    communicator: each result checked against values computed here."""
    rank, world = group.rank, group.world_size
    wrong = []
    # 1 MiB: a chunk of 256 KiB slices in the ring's layout is 8 tiles, so 8 blocks (the
    # emulated device's SMs); smaller messages run one block
    with EmulatedCudaCommunicator(group=group, buffer_bytes=1 << 20, timeout=TIMEOUT) as comm:
        for i, (algorithm, count) in enumerate([("native", 1 << 16), ("rhd", 1 << 16), ("native", 12), ("tree", 1 << 15),
                                                ("ring", 1 << 16), ("oneshot", 999), ("native", 1 << 16),
                                                ("rd", 5000), ("native", 1 << 16)]):
            x = torch.full((count,), float(rank + 1)) + torch.arange(count) % 7
            comm.all_reduce(x, algorithm=algorithm)
            want = torch.full((count,), float(world * (world + 1) // 2)) + world * (torch.arange(count) % 7)
            if not torch.equal(x, want):
                wrong.append(f"call {i} ({algorithm}, {count}): {int((x != want).sum())} wrong")
            out = torch.empty(count * world)
            comm.all_gather_into_tensor(out, torch.full((count,), float(rank)), algorithm="ring" if i % 2 else "native")
            if not torch.equal(out, torch.arange(world).repeat_interleave(count).float()):
                wrong.append(f"all_gather after call {i}")
        comm.barrier()
    return wrong


@pytest.mark.parametrize("variant", ["fused", "naive"])
def test_plans_and_ring_kernels_interleave_on_one_communicator(variant, monkeypatch):
    monkeypatch.setenv("RINGCOLL_CUDA_KERNEL", variant)
    wrong = sum(ringcoll.run_in_process(3, _interleaved, None, timeout=300), [])
    assert not wrong, "; ".join(wrong[:5])


def test_a_broadcast_root_that_finishes_first_is_not_a_mismatch():
    """A star broadcast's root publishes and is done: nothing it waits for stops it from
    starting its next call, whose check publishes its next descriptor over the last one,
    while a late peer has not compared the last one yet. The root queues its calls (async)
    and rank 1 comes late (a pause, the one way to be late here); a check against the left
    neighbour alone would find the root already past the call and call it a mismatch. Each
    rank checks both neighbours, so none moves past a call before both have announced it."""
    def body(group):
        rank = group.rank
        with EmulatedCudaCommunicator(group=group, timeout=TIMEOUT) as comm:
            xs = [torch.full((64,), float(i)) if rank == 0 else torch.zeros(64) for i in range(4)]
            if rank == 1:
                time.sleep(0.3)
            works = [comm.broadcast(x, 0, async_op=rank == 0, algorithm="star") for x in xs]
            for w in works:
                if w is not None:
                    w.wait()
            comm.barrier()
            return [bool((x == i).all()) for i, x in enumerate(xs)]

    assert ringcoll.run_in_process(3, body, timeout=120) == [[True] * 4] * 3


def test_ranks_that_disagree_on_the_algorithm_raise_on_every_rank():
    """Every rank raises MismatchError with nothing moved; a rank that compared the two
    calls names both algorithms, one that heard of it from a peer's abort says so."""
    def body(group):
        with EmulatedCudaCommunicator(group=group, timeout=TIMEOUT) as comm:
            x = torch.ones(1000)
            with pytest.raises(ringcoll.RingcollMismatchError) as e:
                comm.all_reduce(x, algorithm="rhd" if group.rank == 1 else "ring")
            return str(e.value), bool((x == 1).all())

    with pytest.warns(RuntimeWarning, match="keeps its emulated buffer"):
        results = ringcoll.run_in_process(3, body, timeout=120)
    assert all(untouched for _, untouched in results), results
    assert any("algorithm rhd" in message and "algorithm ring" in message for message, _ in results), results
    assert all("algorithm rhd" in message or "mismatched calls" in message for message, _ in results), results


def _with_a_rank_away(world, away, call, check, error=ringcoll.RingcollError):
    """Every rank makes `call(comm)` once (the plan's records are then in place); then rank
    `away` stays away (open, not closed) while the others make it again. The others' error
    messages, "absent" for `away`."""
    others_done = threading.Barrier(world, timeout=60)

    def body(group):
        with EmulatedCudaCommunicator(group=group, timeout=2, check=check) as comm:
            call(comm)
            if group.rank == away:
                others_done.wait()
                return "absent"
            with pytest.raises(error) as e:
                call(comm)
            others_done.wait()
            return str(e.value)

    with pytest.warns(RuntimeWarning, match="keeps its emulated buffer"):
        return ringcoll.run_in_process(world, body, timeout=120)


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_a_rank_that_never_comes_to_a_plan_call_is_a_timeout_naming_it(check):
    """Rank 2 stays away (open, not closed) from a tree all-reduce. With the call check the
    others stop checking the call; without it, in the plan's op that waits for rank 2."""
    messages = _with_a_rank_away(3, 2, lambda comm: comm.all_reduce(torch.ones(1000), algorithm="tree"), check)
    assert messages[2] == "absent"
    # Rank 0, the binomial tree's root, waits for rank 2 (a leaf under it; P = 3)
    assert "timed out" in messages[0] and "rank 2" in messages[0], messages[0]
    where = "checking the call" if check else "plan op 2"
    assert where in messages[0], messages[0]
    assert "rank 2" in messages[1] or "rank 0" in messages[1], messages[1]


@pytest.mark.parametrize("symmetric", [False, True], ids=["in-process", "symmetric-across-processes"])
def test_a_direct_plans_input_may_be_written_the_moment_its_call_returns(symmetric):
    """The direct all-gather reads each peer's input where it lies: a rank's kernel may end
    (and its call return) only once every peer's blocks have read its input (device_plan.h,
    inputs_read). Each rank overwrites its input the instant its call returns, and rank 1
    starts each call later than rank 0 (rank 0 comes first and leaves first if nothing holds
    it); with that wait removed, rank 1 gathered rank 0's overwrite. The same for symmetric
    memory read across (modelled) processes: docs/symmetric.md's rule for reuse, on CUDA."""
    count, calls = 1 << 18, 12
    make = ModelledProcessesCommunicator if symmetric else EmulatedCudaCommunicator

    def body(group):
        rank, world = group.rank, group.world_size
        torn = []
        with make(group=group, timeout=TIMEOUT) as comm:
            piece = comm.empty(count) if symmetric else None
            for i in range(calls):
                piece = piece.fill_(float(100 * i + rank)) if symmetric else torch.full((count,), float(100 * i + rank))
                out = torch.empty(count * world)
                if rank == 1:
                    time.sleep(0.002)
                comm.all_gather_into_tensor(out, piece, algorithm="direct")
                piece.fill_(-1.0)  # at once: a peer still reading it would gather this
                want = (100.0 * i + torch.arange(world, dtype=torch.float32)).repeat_interleave(count)
                if not torch.equal(out, want):
                    torn.append(f"call {i}: {int((out != want).sum())} elements wrong")
            comm.barrier()
        return torn

    torn = sum(ringcoll.run_in_process(2, body, timeout=300), [])
    assert not torn, "; ".join(torn[:5])


@pytest.mark.parametrize("symmetric", [False, True], ids=["in-process", "symmetric-across-processes"])
def test_a_shared_output_may_be_written_the_moment_its_call_returns(symmetric):
    """The direct all-reduce shares each rank's fold where it lies (SHARE_OUTPUT): its peers
    copy their chunks out of its output, so a rank's call may return only once every peer has
    read its output too (plan.h: a shared receive counts in last_in_place_read_op). Three
    ranks, out of place, each overwriting input and output the instant its call returns,
    ranks 1 and 2 starting each call later; without that count the peers gathered the
    overwrite (a review's harness: 911 elements wrong at P = 3)."""
    count, calls, world = 3 << 16, 10, 3
    make = ModelledProcessesCommunicator if symmetric else EmulatedCudaCommunicator

    def body(group):
        rank = group.rank
        torn = []
        with make(group=group, timeout=TIMEOUT) as comm:
            x, out = (comm.empty(count), comm.empty(count)) if symmetric else (torch.empty(count), torch.empty(count))
            for i in range(calls):
                wrong = all_reduce_overwritten_on_return(comm, x, out, i, rank, world, algorithm="direct")
                if wrong:
                    torn.append(f"call {i}: {wrong} elements wrong")
            comm.barrier()
        return torn

    torn = sum(ringcoll.run_in_process(world, body, timeout=300), [])
    assert not torn, "; ".join(torn[:5])


@pytest.mark.parametrize("differs", ["count", "dtype"])
def test_a_direct_plan_whose_calls_differ_is_a_mismatch_even_unchecked(differs):
    """Without the call check nothing else compares the calls, but a rank that reads a peer's
    input where it lies compares the call the peer posted with its own, whole: no rank reads
    past a peer's input. A count that differs, or a dtype (the same count of bfloat16 is half
    the bytes: compared by count alone, rank 0 read past rank 1's input and returned). Both
    calls are named."""
    def body(group):
        with EmulatedCudaCommunicator(group=group, timeout=TIMEOUT, check=False) as comm:
            n = 8 if group.rank == 0 or differs == "dtype" else 10
            dtype = torch.bfloat16 if group.rank == 1 and differs == "dtype" else torch.float32
            out = torch.full((2 * n,), -1.0, dtype=dtype)
            with pytest.raises(ringcoll.RingcollMismatchError) as e:
                comm.all_gather_into_tensor(out, torch.ones(n, dtype=dtype), algorithm="direct")
            return str(e.value)

    with pytest.warns(RuntimeWarning, match="keeps its emulated buffer"):
        messages = ringcoll.run_in_process(2, body, timeout=120)
    named = ("count=8,", "count=10,") if differs == "count" else ("(float32,", "(bfloat16,")
    assert any(all(call in m for call in named) for m in messages), messages


def test_a_rank_that_never_posts_its_input_is_a_timeout_naming_it():
    """Rank 1 stays away (open, not closed) from a direct all-gather; unchecked, rank 0 times
    out waiting for rank 1 to post where its input lies."""
    def gather(comm):
        comm.all_gather_into_tensor(torch.empty(16), torch.ones(8), algorithm="direct")

    messages = _with_a_rank_away(2, 1, gather, check=False, error=ringcoll.RingcollTimeoutError)
    assert messages[1] == "absent"
    assert "timed out" in messages[0] and "rank 1 to post where its input lies" in messages[0], messages[0]


# --- symmetric memory on the CUDA transport (docs/symmetric.md), peers as other processes ---


def _direct_on_symmetric_memory(group, counts):
    """The direct plans with every input in symmetric memory, as peers in other processes read
    it (each through its own mapping of the owner's arena part): all-gather into an ordinary
    and into a symmetric output, reduce-scatter and all-reduce out of place and in place (the
    ring's bits),
    broadcast from every root with only the root's tensor symmetric (only the root's is
    read), for bytes and 2- and 4-byte dtypes, across slices. Returns what was wrong."""
    rank, world = group.rank, group.world_size
    wrong = []
    with ModelledProcessesCommunicator(group=group, timeout=TIMEOUT, buffer_bytes=4096 * world) as comm:
        for dtype in (torch.float32, torch.bfloat16, torch.uint8):
            for count in counts:
                piece = comm.empty(count, dtype=dtype)
                piece.copy_(_inputs(rank, count, dtype, seed=count))
                want = torch.cat([_inputs(r, count, dtype, seed=count) for r in range(world)])
                for out in (torch.full((count * world,), 7, dtype=dtype), comm.zeros(count * world, dtype=dtype)):
                    comm.all_gather_into_tensor(out, piece, algorithm="direct")
                    if not torch.equal(out, want):
                        wrong.append(f"all_gather {dtype} n={count} symmetric output={comm.is_symmetric(out)} "
                                     f"rank {rank}: {int((out != want).sum())} wrong")
                if dtype != torch.uint8:  # reduce-scatter, out of place and in place, against the ring's bits
                    x = comm.empty(count * world, dtype=dtype)
                    x.copy_(_inputs(rank, count * world, dtype, seed=count + 1))
                    ring = torch.empty(count, dtype=dtype)
                    comm.reduce_scatter_tensor(ring, x.clone(), algorithm="ring")
                    out = torch.full((count,), 7, dtype=dtype)
                    comm.reduce_scatter_tensor(out, x, algorithm="direct")
                    mine = x[rank * count:(rank + 1) * count]
                    comm.reduce_scatter_tensor(mine, x, algorithm="direct")  # in place: peers never read my chunk
                    if not (torch.equal(out, ring) and torch.equal(mine, ring)):
                        wrong.append(f"reduce_scatter {dtype} n={count} rank {rank}")
                    # all-reduce, the two-shot: out of place, then in place on the symmetric tensor
                    x.copy_(_inputs(rank, count * world, dtype, seed=count + 2))
                    ring = x.clone()
                    comm.all_reduce(ring, algorithm="ring")
                    out = torch.full((count * world,), 7, dtype=dtype)
                    comm.all_reduce(x, output=out, algorithm="direct")
                    comm.all_reduce(x, algorithm="direct")
                    if not (torch.equal(out, ring) and torch.equal(x, ring)):
                        wrong.append(f"all_reduce {dtype} n={count * world} rank {rank}")
                for root in range(world):
                    symmetric = comm.empty(count, dtype=dtype)  # collective: every rank allocates
                    t = symmetric if rank == root else torch.empty(count, dtype=dtype)
                    t.copy_(_inputs(rank, count, dtype, seed=root))
                    comm.broadcast(t, root, algorithm="direct")
                    if not torch.equal(t, _inputs(root, count, dtype, seed=root)):
                        wrong.append(f"broadcast {dtype} n={count} root {root} rank {rank}")
        comm.barrier()
    return wrong


@pytest.mark.parametrize("world", [2, 3, 5])
def test_direct_plans_read_symmetric_memory_across_processes_exactly(world):
    counts = [1, 3 * 700 + 2]  # one element; several slices of a 4 KiB-per-rank buffer
    wrong = sum(ringcoll.run_in_process(world, _direct_on_symmetric_memory, counts, timeout=300), [])
    assert not wrong, "; ".join(wrong[:5])


def test_an_ordinary_input_across_processes_is_refused_on_every_rank_before_anything_moves():
    """A plan that reads peers' inputs, where one rank's input is an ordinary tensor and its
    peers are other processes: every rank finds it out of reach from the posts (its own
    rank included), raises RingcollMismatchError naming that rank, and no output changes.
    In the in-process mode the same call reads the plain pointer (the matrices above)."""
    def body(group):
        rank, world = group.rank, group.world_size
        with ModelledProcessesCommunicator(group=group, timeout=TIMEOUT) as comm:
            symmetric = comm.empty(100).fill_(1.0)  # collective: every rank allocates, rank 2 then passes another
            piece = torch.ones(100) if rank == 2 else symmetric
            out = torch.full((100 * world,), -1.0)
            with pytest.raises(ringcoll.RingcollMismatchError) as e:
                comm.all_gather_into_tensor(out, piece, algorithm="direct")
            return str(e.value), bool((out == -1).all())

    with pytest.warns(RuntimeWarning, match="keeps its emulated buffer"):
        results = ringcoll.run_in_process(3, body, timeout=120)
    for message, untouched in results:
        assert "rank 2's input is not in symmetric memory" in message and untouched, message


def test_auto_reads_symmetric_memory_in_place_and_falls_back_where_an_input_is_not():
    """On CUDA auto over symmetric memory is the direct plan with the ring's plan as its
    fallback: where every rank's input is symmetric the kernels read in place; where one
    rank's is not (across processes nobody can reach it), every rank finds so from the posts
    and all run the ring's plan: the same bits either way, no error, no call lost. Calls of
    both kinds alternate on one communicator, each compared with the ring's."""
    def body(group):
        rank, world = group.rank, group.world_size
        wrong, ran = [], []
        with ModelledProcessesCommunicator(group=group, timeout=TIMEOUT, buffer_bytes=4096 * world) as comm:
            ring = comm.transport._ring
            sym = comm.empty(2102 * world)
            for i in range(6):
                ordinary = i % 2 == 1 and rank == world - 1  # every other call, the last rank's input is not
                x = torch.empty(2102 * world) if ordinary else sym
                x.copy_(_inputs(rank, 2102 * world, torch.float32, seed=i))
                want = x.clone()
                comm.all_reduce(want, algorithm="ring")
                before = ring.fallbacks(rank)
                got = torch.empty_like(x)
                comm.all_reduce(x, output=got)
                out = torch.empty(2102 * world * world)
                comm.all_gather_into_tensor(out, x)
                gathered = torch.empty_like(out)
                comm.all_gather_into_tensor(gathered, x, algorithm="ring")
                ran.append(ring.fallbacks(rank) - before)
                if not (torch.equal(got, want) and torch.equal(out, gathered)):
                    wrong.append(f"call {i} rank {rank}")
            comm.barrier()
        return wrong, ran

    for wrong, ran in ringcoll.run_in_process(3, body, timeout=300):
        assert not wrong, wrong
        assert ran == [0, 2, 0, 2, 0, 2], ran  # both calls fell back exactly where an input was ordinary


def test_auto_over_symmetric_memory_and_a_named_plan_are_a_mismatch():
    """The fallback travels in the descriptor: a rank running auto (direct, else the ring's
    plan) and one naming direct alone would part ways where an input is out of reach, so
    the call check stops them first, naming both."""
    def body(group):
        with ModelledProcessesCommunicator(group=group, timeout=TIMEOUT) as comm:
            x = comm.zeros(64)
            with pytest.raises(ringcoll.RingcollMismatchError) as e:
                comm.all_reduce(x, algorithm="auto" if group.rank == 0 else "direct")
            return str(e.value)

    with pytest.warns(RuntimeWarning, match="keeps its emulated buffer"):
        messages = ringcoll.run_in_process(2, body, timeout=120)
    assert any("algorithm direct where every input it reads can be, else ring" in m for m in messages), messages


def test_symmetric_allocation_on_the_cuda_transport_is_collective_and_pooled():
    """Communicator.empty on the CUDA transport (here its emulator): a request unlike a peer's
    raises on every rank naming both; small tensors share one arena, a freed block is handed
    out again, and only a request no rank has room for makes another arena."""
    def body(group):
        rank = group.rank
        with ModelledProcessesCommunicator(group=group, timeout=TIMEOUT) as comm:
            with pytest.raises(ringcoll.RingcollMismatchError) as e:
                comm.empty(10 + rank)
            a, b = comm.empty(1000), comm.empty(3, 4, dtype=torch.bfloat16)
            first = a.data_ptr()
            del a
            c = comm.empty(1000)  # a's block, free again
            arenas = comm.transport.symmetric_arenas
            big = comm.empty(40 << 20, dtype=torch.uint8)  # 40 MiB: then too little room left in the first
            bigger = comm.empty(40 << 20, dtype=torch.uint8)
            return (str(e.value), c.data_ptr() == first, arenas, comm.transport.symmetric_arenas,
                    comm.is_symmetric(b) and comm.is_symmetric(big) and not comm.is_symmetric(torch.ones(3)),
                    b.shape == (3, 4) and b.dtype == torch.bfloat16 and bigger.numel() == 40 << 20)

    for message, reused, arenas, later, symmetric, shapes in ringcoll.run_in_process(2, body, timeout=120):
        assert "empty((10,), float32, 40 bytes)" in message and "empty((11,), float32, 44 bytes)" in message, message
        assert reused and arenas == 1 and later == 2 and symmetric and shapes


class FailingStepTransport(ProcessesTransport):
    """A rank whose step of the collective allocation (`failing`: rank, step) raises, as a
    cudaMalloc out of memory or a cudaIpcOpenMemHandle that fails would on a GPU."""
    failing = (1, "make_symmetric_arena")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        rank, step = self.failing
        if self.rank == rank:
            parts = self._parts

            class Failing:
                def __getattr__(self, name):
                    if name != step:
                        return getattr(parts, name)

                    def fail(*_):
                        raise RuntimeError(f"{step} failed here on purpose")
                    return fail

            self._parts = Failing()


@pytest.mark.parametrize("step", ["make_symmetric_arena", "open_symmetric_arena"])
def test_a_failed_arena_round_raises_on_every_rank_and_makes_no_more(step, monkeypatch):
    """Rank 1 cannot make its part of a new arena (its peers waited for it in the next round
    until the bootstrap's timeout), or cannot map the others' (they had added the arena, it
    had not: every later auto call chose differently, and the next arena was numbered
    differently, read through the wrong row). Now every rank raises naming rank 1 and why,
    at once; no rank makes symmetric memory again; every rank counts no arena, so auto
    agrees, and an ordinary all-reduce after it is exact."""
    monkeypatch.setattr(FailingStepTransport, "failing", (1, step))

    class Communicator(ringcoll.Communicator):
        @staticmethod
        def transport_class(device):
            return FailingStepTransport

    def body(group):
        with Communicator(group=group, timeout=TIMEOUT) as comm:
            errors = []
            for _ in range(2):
                start = time.monotonic()
                with pytest.raises(ringcoll.RingcollError) as e:
                    comm.empty(1000)
                errors.append((str(e.value), time.monotonic() - start))
            x = torch.full((12,), float(group.rank + 1))
            comm.all_reduce(x)
            return errors, comm.transport.symmetric_arenas, x.tolist()

    for ((first, took), (again, _)), arenas, summed in ringcoll.run_in_process(3, body, timeout=60):
        assert "rank 1 could not" in first and "on purpose" in first and took < TIMEOUT / 4, (first, took)
        assert "makes no more symmetric memory since rank 1 could not" in again, again
        assert arenas == 0 and summed == [6.0] * 12


def test_a_symmetric_input_dropped_with_its_async_work_is_not_handed_out_before_the_call_ran():
    """record_stream keeps the caching allocator from reusing a tensor an async kernel still
    uses, and does nothing for symmetric memory: an async call's input dropped with its Work
    went back to the pool, and the next empty() handed the same block out while the kernel
    (held back here by a gate on the stream it follows) had yet to read it, so the peers
    gathered what was written into the new tensor. The transport now holds an async call's
    tensors until the call is done."""
    def body(group):
        rank = group.rank
        with ModelledProcessesCommunicator(group=group, timeout=TIMEOUT) as comm:
            device, gate = comm.transport.device, threading.Event()
            device.launch(comm.transport.user_stream("test"), lambda: gate.wait(TIMEOUT))
            x = comm.empty(1000)
            x.fill_(rank + 1.0)
            address = x.data_ptr()
            out = torch.empty(2000)
            work = comm.all_gather_into_tensor(out, x, async_op=True, algorithm="direct")
            del x, work
            y = comm.empty(1000)  # collective: both ranks' calls are queued behind their gates
            y.fill_(-7.0)
            reused = y.data_ptr() == address
            gate.set()
            comm.synchronize()
            return reused, out.tolist()

    for reused, out in ringcoll.run_in_process(2, body, timeout=120):
        assert not reused and out == [1.0] * 1000 + [2.0] * 1000, (reused, out[:3], out[1000:1003])


def test_a_plan_too_wide_for_the_kernels_is_refused_by_name():
    def wide(world, rank):  # P = 2: publish all 65 chunks, then add the peer's: x1 OP x0 on both ranks
        peer = 1 - rank
        add = (plans.op(plans.PEER, (0, 65), plans.TO_OUTPUT, b=plans.INPUT, frm=peer, final=True) if rank == 0 else
               plans.op(plans.INPUT, (0, 65), plans.TO_OUTPUT, b=plans.PEER, frm=peer, final=True))
        return [plans.op(plans.INPUT, (0, 65), plans.TO_SLOT, readers=[peer]), add]

    plans.register_algorithm("wide", wide)
    try:
        def body(group):
            with ringcoll.Communicator(group=group, timeout=TIMEOUT, buffer_bytes=1 << 20) as cpu:
                x = torch.ones(100)
                cpu.all_reduce(x, algorithm="wide")  # a plan the checker accepts: the CPU engine runs it
            with EmulatedCudaCommunicator(group=group, timeout=TIMEOUT, buffer_bytes=1 << 20) as comm:
                with pytest.raises(ValueError, match="65 chunks; the CUDA kernels run plans of at most 64"):
                    comm.all_reduce(torch.ones(100), algorithm="wide")
                y = torch.ones(100)
                comm.all_reduce(y)  # nothing was queued: the communicator still works
                return bool((x == 2).all() and (y == 2).all())

        assert ringcoll.run_in_process(2, body, timeout=120) == [True] * 2
    finally:
        with plans._lock:
            plans._registry.pop(("wide", "all_reduce"), None)
            for key in [k for k in plans._compiled if k[0] == "wide"]:
                del plans._compiled[key]


def _barrier_async(group):
    comm = EmulatedCudaCommunicator(group=group, timeout=TIMEOUT)
    work = comm.barrier(async_op=True)
    work.wait()
    done = work.is_completed()
    comm.close()
    return type(work).__name__, done


def test_an_async_barrier_is_a_work_on_cuda_as_on_the_cpu():
    """The CUDA barrier is synchronous (as NCCL's): with async_op it returned None, where the
    CPU's returns a Work, so barrier(async_op=True).wait() raised AttributeError there."""
    assert ringcoll.run_in_process(2, _barrier_async, timeout=TIMEOUT) == [("Work", True)] * 2


def _symmetric_auto_alone(group):
    with EmulatedCudaCommunicator(group=group, timeout=TIMEOUT) as comm:
        x = comm.empty(8).fill_(3.0)
        out = comm.empty(8)
        comm.all_reduce(x)
        comm.all_gather_into_tensor(out, x)
        part = comm.empty(8)
        comm.reduce_scatter_tensor(part, out)
        return x.tolist(), out.tolist(), part.tolist()


def test_one_rank_with_symmetric_memory_runs_auto():
    """One rank has no peer to read: auto over its symmetric memory built the direct plan with
    the ring's as fallback, which plan_with_fallback refuses where the direct plan reads
    nothing, so every auto call raised ValueError (the CPU transport ran them). Found by the
    emulated CUDA fuzzer."""
    assert ringcoll.run_in_process(1, _symmetric_auto_alone, timeout=60) == [([3.0] * 8, [3.0] * 8, [3.0] * 8)]


def _rooted_at_a_buffer_the_kernels_cut_smaller(group):
    """P = 3 and 4096 bytes: the ring's 6 slots of 640 bytes leave 3840 for a plan's, too few
    for the rooted pipelines' 16 chunks of two 128-byte slots."""
    results = []
    with EmulatedCudaCommunicator(group=group, timeout=TIMEOUT, buffer_bytes=4096, small_bytes=1024) as comm:
        for coll in ("broadcast", "reduce"):
            t = torch.full((1000,), float(group.rank + 1))
            getattr(comm, coll)(t, 1)  # native: its pipeline does not fit, so the one-shot
            results.append(t[0].item())
        t = torch.full((1000,), float(group.rank + 1))
        with pytest.raises(ValueError, match="'star' cuts the message into 16 chunks.* buffer_bytes is 4096, which "
                                             "leaves 3840 for them"):
            comm.broadcast(t, 1, algorithm="star")
        results.append(t[0].item())  # untouched
        comm.all_reduce(t)  # and the communicator still works
    return results


def test_a_plan_the_kernels_have_no_slots_for_is_never_launched():
    """Communicator._plan checked a plan against the whole buffer, but the CUDA kernels cut a
    plan's slots from the ring's 2P slots, which hold less where the buffer does not divide
    into them: native broadcast and reduce then launched a pipeline the kernels refused, on
    every rank. Now native takes the one-shot there, as it does where the buffer is smaller
    still, and a named plan is refused before anything moves. Found by the emulated CUDA fuzzer."""
    results = ringcoll.run_in_process(3, _rooted_at_a_buffer_the_kernels_cut_smaller, timeout=60)
    # the broadcast from rank 1 everywhere; the reduce's sum on rank 1 alone; the refused call wrote nothing
    assert results == [[2.0, 6.0 if rank == 1 else rank + 1.0, rank + 1.0] for rank in range(3)], results
