"""Do ringcoll's C++ errors reach Python on this machine? Each case raises one error the
smallest way, in a process of its own, and the probe reports what came back: the expected
exception, another one, or a death by signal. Where a case dies and cuda-gdb (or gdb) is on
PATH, that case is run once more under it for a native backtrace.

Why: on the first GPU run (H200, 2026-12-04, bench/results/2026-12-04-h200-device-check.txt)
every test that expected an error from the CUDA transport (a timeout, a mismatch, bad input,
a close past its timeout, disagreeing flag scopes) died of SIGSEGV instead, while every
collective was exact. The cases below split the path an error takes, so the first case that
dies says where to look:

    cuda_check        a CudaComm argument check: thrown in cuda_comm.cu (nvcc's host code)
                      before any CUDA call; the same case runs on a CPU-only build too
    cuda_check_live   the same check once this process has a CUDA context
    launch_check      a check in CudaComm::launch (a communicator of one rank, a bad op)
    host_timeout      a timeout of the CPU transport (host_comm.cpp, g++), two ranks in one process
    kernel_timeout    a timeout found by the ring kernel and raised by CudaComm::synchronize
                      (the error record, error_message, the exception), two ranks in one process

    python bench/cuda_error_probe.py [--cases a,b] [--timeout S] [--no-debugger]
Exit status: 0 when every case raised what it should, 1 otherwise.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

def _cuda_check(live: bool):
    import torch

    from ringcoll import _C

    if live:
        torch.ones(1, device="cuda").sum().item()  # a context, before the check
    try:
        _C.CudaComm(0, 1000, 0, 1 << 20, 5.0)  # more ranks than the transport takes
    except ValueError as e:
        return "ValueError", str(e)


def _launch_check():
    import ringcoll

    def body(group):
        import torch

        with ringcoll.Communicator(group=group, device="cuda:0", timeout=5) as comm:
            native = comm.transport.comm
            t = torch.ones(8, device="cuda:0")
            stream = torch.cuda.current_stream().cuda_stream
            try:  # an unknown dtype code, refused by CudaComm::launch
                native.all_reduce(t.data_ptr(), t.data_ptr(), 8, 99, 0, stream, True)
            except ValueError as e:
                return "ValueError", str(e)

    return ringcoll.run_in_process(1, body, timeout=30)[0]


def _timeout_in_process(device: str):
    import ringcoll

    def body(group):
        import torch

        with ringcoll.Communicator(group=group, device=device, timeout=1) as comm:
            x = torch.ones(8, device=device)
            if group.rank == 1:
                group.barrier()  # no call: rank 0 times out waiting for it
                return None
            outcome = None
            try:
                comm.all_reduce(x)
                comm.synchronize()
            except ringcoll.RingcollTimeoutError as e:
                outcome = ("RingcollTimeoutError", str(e))
            group.barrier()
            return outcome

    return ringcoll.run_in_process(2, body, timeout=30)[0]


#: each case: (the exception it must raise, whether it needs a GPU, how it raises it)
CASES = {
    "cuda_check": ("ValueError", False, lambda: _cuda_check(live=False)),
    "cuda_check_live": ("ValueError", True, lambda: _cuda_check(live=True)),
    "launch_check": ("ValueError", True, _launch_check),
    "host_timeout": ("RingcollTimeoutError", False, lambda: _timeout_in_process("cpu")),
    "kernel_timeout": ("RingcollTimeoutError", True, lambda: _timeout_in_process("cuda:0")),
}


def _child(name: str) -> int:
    outcome = CASES[name][2]()
    print(f"OUTCOME {outcome[0] if outcome else 'no error'}: {outcome[1] if outcome else ''}", flush=True)
    return 0


def _debugger():
    for name in ("cuda-gdb", "gdb"):
        path = shutil.which(name)
        if path:
            return path
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--timeout", type=float, default=40.0, help="seconds per case (and per debugger run)")
    parser.add_argument("--no-debugger", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args.child)

    import torch

    gpu = torch.cuda.is_available()
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    failed = 0
    names = args.cases.split(",")
    unknown = [name for name in names if name not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)} (cases: {', '.join(CASES)})")
    for name in names:
        expected, needs_gpu, _ = CASES[name]
        if needs_gpu and not gpu:
            print(f"SKIP  {name}: no GPU")
            continue
        start = time.monotonic()
        cmd = [sys.executable, __file__, "--child", name]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        except subprocess.TimeoutExpired:
            print(f"FAIL  {name}: no answer within {args.timeout:.0f} s")
            failed += 1
            continue
        took = time.monotonic() - start
        outcome = next((line for line in done.stdout.splitlines() if line.startswith("OUTCOME ")), "")
        if done.returncode < 0:
            print(f"FAIL  {name}: killed by {signal.Signals(-done.returncode).name} after {took:.1f} s; "
                  f"its stderr ends:\n" + "\n".join("      " + line for line in done.stderr.splitlines()[-25:]))
            failed += 1
            debugger = None if args.no_debugger else _debugger()
            if debugger:
                print(f"      .. once more under {os.path.basename(debugger)}, for the native stack:")
                try:
                    gdb = subprocess.run([debugger, "-q", "-batch", "-ex", "set pagination off", "-ex", "run",
                                          "-ex", "bt 30", "--args"] + cmd, capture_output=True, text=True,
                                         timeout=args.timeout, env=env)
                    stack = [line for line in gdb.stdout.splitlines() if line.startswith("#") or "signal" in line]
                    print("\n".join("      " + line for line in stack[-35:]) or "      (no stack printed)")
                except subprocess.TimeoutExpired:
                    print(f"      (the debugger did not finish within {args.timeout:.0f} s)")
        elif outcome.startswith(f"OUTCOME {expected}:"):
            print(f"PASS  {name}: {outcome[len('OUTCOME '):][:300]} ({took:.1f} s)")
        else:
            print(f"FAIL  {name}: exit {done.returncode}, {outcome or 'no outcome'}; stderr ends:\n"
                  + "\n".join("      " + line for line in done.stderr.splitlines()[-15:]))
            failed += 1
    print("cuda_error_probe: " + ("every case raised what it should" if not failed else f"{failed} case(s) failed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
