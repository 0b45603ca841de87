"""The ranks of one simulated machine, for the fault cases of test_two_hosts.py.

    python two_host_job.py host H SCENARIO DIR    start this machine's ranks (run inside its
                                                  namespace: ringcoll/harness/hosts.py)
    python two_host_job.py rank SCENARIO DIR      one rank (RANK, WORLD_SIZE, ... in the environment)

Not torchrun: when one of its workers dies, torchrun kills the others on that machine at
once, so it would hide whether they raise by themselves. Here each machine's ranks are
plain processes; the host writes DIR/exit-<rank> for each (its exit code; negative: killed
by that signal, "hung": still running at the end), and each rank appends what it saw to
DIR/results-<rank> (a JSON line per phase). DIR is on the file system both machines share.

Scenarios (2 machines x LOCAL ranks, the "ringcoll" backend, RINGCOLL_TIMEOUT seconds):

    faults   mismatch: both ranks of machine 0 all_reduce 1001 elements, machine 1's 1000;
             then, on a fresh HierarchicalCommunicator, only the last rank calls 1001 (every
             rank must raise RingcollMismatchError naming both calls, global ranks, hosts);
             then DDP training on a fresh ringcoll group until the last rank SIGKILLs itself
             (every survivor must raise within the timeout, then exit 1, no signal)
    link     all-reduces until an error; after a few, each rank writes DIR/ready-<rank> and
             the test takes the link between the machines down for good
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

LOCAL = 2  # ranks per machine
KILL_AT_STEP = 3
LINK_READY_STEP = 3
RUN_SECONDS = 60.0  # a rank that never sees an error stops here and says so


DIRECTORY = ""  # set by main


def _result(rank: int, phase: str, **what) -> None:
    with open(os.path.join(DIRECTORY, f"results-{rank}"), "a") as f:
        f.write(json.dumps({"phase": phase, **what}) + "\n")


def _expect_error(rank: int, phase: str, fn, untouched=lambda: None) -> None:
    """Run fn, which must raise; record what it raised and untouched() (did the call leave
    its tensor as it was?)."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 -- what reaches the user is what is checked
        _result(rank, phase, kind=type(exc).__name__, message=str(exc), elapsed=time.monotonic() - start,
                untouched=untouched())
        return
    _result(rank, phase, kind="no error", message="", elapsed=time.monotonic() - start)


def _faults(rank: int, world: int) -> int:
    import torch
    import torch.distributed as dist

    from ringcoll.training.hierarchical import HierarchicalCommunicator

    host = rank // LOCAL
    # Each machine's ranks agree among themselves here, so each runs its ring's first stage
    # while the check crosses the link (CHECK_OVERLAPS): still nothing lands in the tensor.
    x = torch.ones(1001 if host == 0 else 1000)
    _expect_error(rank, "mismatch_by_host", lambda: dist.all_reduce(x), lambda: bool((x == 1).all()))
    lone = HierarchicalCommunicator(group=dist.new_group(backend="gloo"))  # the default group's ring is broken now
    y = torch.ones(1001 if rank == world - 1 else 1000)
    _expect_error(rank, "mismatch_one_rank", lambda: lone.all_reduce(y), lambda: bool((y == 1).all()))
    lone.close()

    group = dist.new_group(backend="ringcoll")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)), process_group=group, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))

    def train():
        for step in range(1000):
            if step == KILL_AT_STEP and rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            loss = model(data).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    dist.barrier(group=dist.new_group(backend="gloo"))
    _expect_error(rank, "kill", train)
    return 1


def _link(rank: int, world: int, directory: str) -> int:
    import torch
    import torch.distributed as dist

    t = torch.ones(1 << 18)

    def all_reduce_until_error():
        deadline = time.monotonic() + RUN_SECONDS
        step = 0
        while time.monotonic() < deadline:
            dist.all_reduce(t)
            step += 1
            if step == LINK_READY_STEP:
                open(os.path.join(directory, f"ready-{rank}"), "w").close()

    _expect_error(rank, "link_down", all_reduce_until_error)
    return 1


def rank_main(scenario: str, directory: str) -> int:
    import datetime

    import torch.distributed as dist

    import ringcoll  # noqa: F401 -- registers the backend

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=float(os.environ["RINGCOLL_TIMEOUT"]))
    dist.init_process_group("ringcoll", timeout=timeout)
    status = _faults(rank, world) if scenario == "faults" else _link(rank, world, directory)
    sys.stdout.flush()
    os._exit(status)  # the groups' teardown over a dead peer or link is torch's, not under test


def host_main(host: int, scenario: str, directory: str) -> int:
    procs = []
    for local in range(LOCAL):
        env = {**os.environ, "RANK": str(host * LOCAL + local), "LOCAL_RANK": str(local),
               "WORLD_SIZE": str(2 * LOCAL), "LOCAL_WORLD_SIZE": str(LOCAL)}
        procs.append(subprocess.Popen([sys.executable, __file__, "rank", scenario, directory], env=env))
    deadline = time.monotonic() + RUN_SECONDS + 30
    for local, proc in enumerate(procs):
        try:
            code = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "hung"
        with open(os.path.join(directory, f"exit-{host * LOCAL + local}"), "w") as f:
            f.write(str(code))
    return 0


if __name__ == "__main__":
    DIRECTORY = sys.argv[-1]
    if sys.argv[1] == "host":
        sys.exit(host_main(int(sys.argv[2]), sys.argv[3], sys.argv[4]))
    sys.exit(rank_main(sys.argv[2], sys.argv[3]))
