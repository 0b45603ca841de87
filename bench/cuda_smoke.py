"""cuda_smoke.py: a first look at the CUDA ring on a GPU, in seconds.

The first thing bench/device_check.sh runs once ringcoll is built: before the feature tests
and the benchmark, does the ring work at all, in both ways ranks can share one GPU?

    multi-process   P processes, peers' buffers mapped through CUDA IPC (the product;
                    time-sliced unless an MPS server runs)
    in-process      P threads of one process (ringcoll.run_in_process), peers' buffers
                    plain device pointers, so all P rings are co-resident

For each, and for each kernel variant (RINGCOLL_CUDA_KERNEL=fused, naive), every rank
builds a communicator (the "hello": bootstrap, IPC mapping, the first call), runs one
all-reduce, one reduce-scatter and one all-gather on integer-valued data (every summation
order gives the same bits, so results are compared exactly), two all-reduce plans and a
broadcast on the plan kernels, then times one ring hop: a
1-element all-reduce makes 2(P-1) ring steps, each one flag hand-off to the neighbour, so
its time per call over 2(P-1) bounds a hop from above (the launch and the call check are
in it too).

One line per check, PASS or FAIL with the numbers; the exit status is 0 when every check
passed, 1 when one failed, 2 when there is nothing to check (no CUDA device, or ringcoll
built without its CUDA backend). Every wait is bounded: the ring's own timeout
(--ring-timeout, 20 s) and a limit on each part's processes (--part-timeout), after which
they are killed.

    python bench/cuda_smoke.py                    # P = 2, both parts, both variants
    python bench/cuda_smoke.py --device cpu       # the same checks on the shared-memory
                                                  # ring: tests this script without a GPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time

PARTS = ("multi-process", "in-process")
VARIANTS = ("fused", "naive")


# ---------------------------------------------------------------------------------------
# What every rank runs (in a process of its own, or in a thread of one process).

def _value(rank, n, dtype, salt=0):
    """Small non-negative integers: exact in every dtype, and sums over a few ranks stay exact."""
    import torch

    return ((torch.arange(n, dtype=torch.int64) * 7 + rank * 3 + salt) % 50).to(dtype)


def _compare(got, expected) -> tuple[bool, str]:
    got = got.cpu()
    wrong = int((got != expected).sum())
    if wrong == 0:
        return True, f"exact, {expected.numel()} elements"
    first = int((got != expected).nonzero()[0])
    return False, (f"{wrong} of {expected.numel()} elements wrong, first at {first}: "
                   f"{got[first].item()} instead of {expected[first].item()}")


def _progress(rank: int, text: str) -> None:
    """Rank 0 says what it finished as it goes: if a part is killed at its time limit, the
    log still shows how far it got (the PASS/FAIL lines come once every rank returned)."""
    if rank == 0:
        print(f"      .. {os.environ.get('RINGCOLL_CUDA_KERNEL', 'fused')}: {text}", flush=True)


def _rank_checks(comm, rank: int, world: int, device: str, hop_seconds: float, hop_max_iters: int) -> list:
    """The checks of one rank on a built communicator: [(check, ok, detail, seconds, value)]."""
    import torch

    import ringcoll

    results = []

    def check(name, fn):
        started = time.perf_counter()
        try:
            ok, detail, value = fn()
        except Exception as e:  # noqa: BLE001 - a failed check is reported, not raised
            first_line = (str(e).splitlines() or [""])[0]
            ok, detail, value = False, f"{type(e).__name__}: {first_line}", None
        results.append((name, ok, detail, time.perf_counter() - started, value))
        _progress(rank, f"{name} {'done' if ok else 'FAILED'}")
        return ok

    def all_reduce():
        # A slice and a half per chunk through the communicator's buffer, whatever its size
        # (the CUDA default is 16 MiB x P: 4 MB would be a single slice), plus an odd tail.
        n = 3 * comm.buffer_bytes // 16 + 3
        t = _value(rank, n, torch.float32).to(device)
        comm.all_reduce(t)
        comm.synchronize()
        expected = sum(_value(r, n, torch.int64) for r in range(world)).to(torch.float32)
        return (*_compare(t, expected), None)

    def reduce_scatter():
        m = 250_007
        inp = _value(rank, m * world, torch.float32, salt=1).to(device)
        out = torch.full((m,), -1.0, device=device)
        comm.reduce_scatter_tensor(out, inp)
        comm.synchronize()
        total = sum(_value(r, m * world, torch.int64, salt=1) for r in range(world))
        return (*_compare(out, total[rank * m:(rank + 1) * m].to(torch.float32)), None)

    def all_gather():
        n = 100_003
        out = torch.full((n * world,), -1, dtype=torch.int32, device=device)
        comm.all_gather_into_tensor(out, _value(rank, n, torch.int32, salt=2).to(device))
        comm.synchronize()
        expected = torch.cat([_value(r, n, torch.int32, salt=2) for r in range(world)])
        return (*_compare(out, expected), None)

    def plans():
        # The plan kernels (csrc/cuda/device_plan.h), not yet run on a GPU when this was
        # written: two all-reduce plans of other shapes than the ring (halving-doubling,
        # C = P; the binomial tree, C = 1) and a broadcast from the last rank (its star, or
        # the one-shot below small_bytes), each exact.
        n = 200_003
        expected = sum(_value(r, n, torch.int64, salt=3) for r in range(world)).to(torch.float32)
        for algorithm in ("rhd", "tree"):
            t = _value(rank, n, torch.float32, salt=3).to(device)
            comm.all_reduce(t, algorithm=algorithm)
            comm.synchronize()
            ok, detail = _compare(t, expected)
            if not ok:
                return False, f"all_reduce {algorithm}: {detail}", None
        b = _value(rank, n, torch.int32, salt=4).to(device)
        comm.broadcast(b, world - 1)
        comm.synchronize()
        ok, detail = _compare(b, _value(world - 1, n, torch.int32, salt=4))
        return ok, (detail if ok else f"broadcast: {detail}"), None

    def ring_hop():
        # MAX of the ranks' numbers: stays world - 1 however many calls, so it is checked too.
        t = torch.full((1,), float(rank), device=device)

        def calls(k):
            for _ in range(k):
                comm.all_reduce(t, op=ringcoll.ReduceOp.MAX)
            comm.synchronize()

        calls(10)  # warm-up: kernels loaded, ranks in step
        started = time.perf_counter()
        calls(10)
        probe = torch.tensor([(time.perf_counter() - started) / 10], device=device)
        # Every rank must make the same number of calls: agree on the slowest rank's probe,
        # through the ring itself.
        comm.all_reduce(probe, op=ringcoll.ReduceOp.MAX)
        comm.synchronize()
        iters = int(max(20, min(hop_max_iters, hop_seconds / max(float(probe.item()), 1e-7))))
        started = time.perf_counter()
        calls(iters)
        per_call = (time.perf_counter() - started) / iters
        if t.item() != world - 1:
            return False, f"1-element all_reduce(MAX) gave {t.item()} instead of {world - 1}", None
        return True, f"{iters} calls", per_call

    for name, fn in (("all_reduce float32 n=1000003", all_reduce),
                     ("reduce_scatter float32 m=250007 per rank", reduce_scatter),
                     ("all_gather int32 n=100003 per rank", all_gather),
                     ("plans: all_reduce rhd, tree; broadcast", plans),
                     ("ring hop", ring_hop)):
        if not check(name, fn):
            break  # the communicator is broken now: later checks would only say so
    return results


def _hello_and_checks(make_comm, rank: int, world: int, device: str, hop_seconds: float,
                      hop_max_iters: int) -> list:
    """Build the communicator (timed), make a first call, run the checks, close. A
    communicator that cannot be built raises: its peers then stop waiting for it at once
    (spawn ends the other processes, run_in_process breaks its group)."""
    import torch

    started = time.perf_counter()
    comm = make_comm()
    try:
        t = torch.full((1,), float(rank + 1), device=device)
        comm.all_reduce(t)
        comm.synchronize()
    except Exception as e:  # noqa: BLE001
        first_line = (str(e).splitlines() or [""])[0]
        return [("hello", False, f"{type(e).__name__}: {first_line}", time.perf_counter() - started, None)]
    want = world * (world + 1) // 2
    built = time.perf_counter() - started
    _progress(rank, "hello done")
    ok = t.item() == want
    results = [("hello", ok, f"communicator built and first all_reduce in {built:.2f} s, "
                f"gave {t.item():g}" + ("" if ok else f" instead of {want}"), built, None)]
    if ok:
        results += _rank_checks(comm, rank, world, device, hop_seconds, hop_max_iters)
    try:
        comm.close()
    except Exception as e:  # noqa: BLE001
        results.append(("close", False, f"{type(e).__name__}: {e}", 0.0, None))
    return results


def _multi_process_rank(rank: int, world: int, device: str, variants, hop_seconds: float,
                        hop_max_iters: int, ring_timeout: float) -> dict:
    """One process of the multi-process part (ringcoll.harness.launcher.spawn runs it)."""
    import torch

    import ringcoll

    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    out = {}
    for variant in variants:
        os.environ["RINGCOLL_CUDA_KERNEL"] = variant  # read when a communicator is built
        out[variant] = _hello_and_checks(lambda: ringcoll.Communicator(device=device, timeout=ring_timeout),
                                         rank, world, device, hop_seconds, hop_max_iters)
    return out


def _in_process_rank(group, device: str, hop_seconds: float, hop_max_iters: int, ring_timeout: float) -> list:
    """One thread of the in-process part (ringcoll.run_in_process runs it)."""
    import torch

    import ringcoll

    if device.startswith("cuda"):
        torch.cuda.set_device(0)  # per thread
    return _hello_and_checks(lambda: ringcoll.Communicator(group=group, device=device, timeout=ring_timeout),
                             group.rank, group.world_size, device, hop_seconds, hop_max_iters)


def _in_process_main(_rank: int, _world: int, world: int, device: str, variants, hop_seconds: float,
                     hop_max_iters: int, ring_timeout: float) -> dict:
    """The in-process part, in a child process of its own, so that the part's time limit
    can kill it (run_in_process's threads are waited for without one)."""
    import ringcoll

    if not hasattr(ringcoll, "run_in_process"):
        raise RuntimeError("this ringcoll has no run_in_process: the in-process mode is not in this build")
    out = {}
    for variant in variants:
        # Set before the threads start: every rank must build its communicator with the same variant.
        os.environ["RINGCOLL_CUDA_KERNEL"] = variant
        try:
            out[variant] = ringcoll.run_in_process(world, _in_process_rank, device, hop_seconds, hop_max_iters,
                                                   ring_timeout, timeout=ring_timeout)
        except Exception as e:  # noqa: BLE001 - a rank's own failures are in its results
            first_line = (str(e).splitlines() or [""])[0]
            out[variant] = [[("run_in_process", False, f"{type(e).__name__}: {first_line}", 0.0, None)]]
    return out


# ---------------------------------------------------------------------------------------
# The parent: runs each part with a time limit, merges the ranks' results, prints.

def _merge(per_rank: list) -> list:
    """Per check: ok on every rank? The first failing rank's detail, else rank 0's; for a
    timing, the slowest rank's value."""
    names = []
    for results in per_rank:
        for name, *_ in results:
            if name not in names:
                names.append(name)
    merged = []
    for name in names:
        rows = [(r, next((x for x in results if x[0] == name), None)) for r, results in enumerate(per_rank)]
        missing = [r for r, x in rows if x is None]
        failing = [(r, x) for r, x in rows if x is not None and not x[1]]
        values = [x[4] for _, x in rows if x is not None and x[4] is not None]
        seconds = max(x[3] for _, x in rows if x is not None)
        if failing:
            r, x = failing[0]
            detail = f"rank {r}: {x[2]}" + (f" (also failed on ranks {[r for r, _ in failing[1:]]})"
                                            if len(failing) > 1 else "")
        elif missing:
            detail = f"not reached on rank(s) {missing}"
        else:
            detail = rows[0][1][2]
        merged.append((name, not failing and not missing, detail, seconds, max(values) if values else None))
    return merged


def _print_checks(label: str, world: int, merged: list) -> bool:
    all_ok = True
    for name, ok, detail, seconds, value in merged:
        all_ok &= ok
        if name == "ring hop" and ok:
            steps = 2 * (world - 1)
            text = (f"ring hop: {value * 1e6:.1f} us per 1-element all_reduce ({detail}, slowest rank) "
                    f"= {value * 1e6 / steps:.1f} us per ring step ({steps} steps; launch and call check included)")
        else:
            text = f"{name}: {detail}" + ("" if name == "hello" else f" ({seconds:.3f} s for the check)")
        print(f"{'PASS' if ok else 'FAIL'}  {label}  {text}", flush=True)
    return all_ok


def _run_part(part: str, args) -> bool:
    from ringcoll.harness.launcher import SpawnError, SpawnTimeout, spawn

    variants = tuple(args.variants.split(","))
    env = {"RINGCOLL_TIMEOUT": str(args.ring_timeout)}
    common = (args.device, variants, args.hop_seconds, args.hop_max_iters, args.ring_timeout)
    started = time.monotonic()
    try:
        if part == "multi-process":
            per_rank = spawn(_multi_process_rank, args.world, *common, timeout=args.part_timeout, env=env)
            by_variant = {v: [per_rank[r][v] for r in range(args.world)] for v in variants}
        else:
            by_variant = spawn(_in_process_main, 1, args.world, *common, timeout=args.part_timeout, env=env)[0]
    except (SpawnError, SpawnTimeout) as e:
        lines = str(e).splitlines()
        print(f"FAIL  {part} P={args.world}  {lines[0] if lines else type(e).__name__}", flush=True)
        for line in lines[1:25]:
            print(f"      {line}")
        return False
    all_ok = True
    for variant in variants:
        all_ok &= _print_checks(f"{part} P={args.world} {variant}", args.world, _merge(by_variant[variant]))
    print(f"      ({part}: {time.monotonic() - started:.1f} s with process start-up)", flush=True)
    return all_ok


def _nothing_to_check(device: str) -> str:
    """Why this machine cannot run the checks ('' when it can)."""
    try:
        from ringcoll import _C
    except ImportError as e:
        return f"ringcoll is not built here ({e})"
    if device == "cpu":
        return ""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device: torch sees none (torch.cuda.is_available() is False)"
    if not getattr(_C, "built_with_cuda", False):
        return "ringcoll was built without its CUDA backend (ringcoll._C.built_with_cuda is False)"
    return ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="ranks, all on GPU 0 (default 2)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help="RINGCOLL_CUDA_KERNEL values to run")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: the shared-memory ring, to test this script where there is no GPU")
    p.add_argument("--ring-timeout", type=float, default=20.0, help="the communicators' timeout (s)")
    p.add_argument("--part-timeout", type=float, default=60.0,
                   help="each part's processes are killed after this many seconds (default 60)")
    p.add_argument("--hop-seconds", type=float, default=1.0, help="how long to time the ring hop (s)")
    p.add_argument("--hop-max-iters", type=int, default=2000)
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS)) + sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown or args.world < 2:
        p.error(f"unknown parts or variants {unknown}" if unknown else "--world must be at least 2")
    device = "cuda:0" if args.device == "cuda" else "cpu"
    why_not = _nothing_to_check(args.device)
    if why_not:
        print(f"SKIP  cuda_smoke: {why_not}; nothing checked", flush=True)
        return 2
    args.device = device
    # (This process makes no CUDA context: only the ranks' processes use the GPU, which also
    # keeps a GPU in Exclusive_Process mode usable under MPS.)
    print(f"cuda_smoke: P={args.world} on {'GPU 0' if device != 'cpu' else 'the CPU'}; MPS pipe directory: "
          f"{os.environ.get('CUDA_MPS_PIPE_DIRECTORY', 'not set (default)')}; "
          f"CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', 'unset (LAZY by default)')}", flush=True)
    failed = [part for part in parts if not _run_part(part, args)]
    print(f"cuda_smoke: {'FAILED: ' + ', '.join(failed) if failed else 'every check passed'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
