"""Tests for ringcoll.harness.launcher (the multi-process launcher), with real processes.

Every spawn costs a Python + torch import per rank (~1-3 s on a small
machine), so spawns are shared through module-scoped fixtures where several
assertions can use one run.
"""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

import ringcoll.harness.launcher as rt
from ringcoll.harness.launcher import Outcome, SpawnError, SpawnTimeout, spawn, spawn_outcomes

# Evaluated when a child unpickles a function from this module, i.e. after the
# launcher has applied `env`: proves env entries are in place before fn's
# module is imported.
_PROBE_AT_IMPORT = os.environ.get("RINGCOLL_TESTING_PROBE")


# ---------------------------------------------------------------- child functions


def _basic(rank, world_size, tag):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    gathered = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([float(rank * 10)]))
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                         "MASTER_ADDR", "MASTER_PORT", "RINGCOLL_TESTING_PROBE",
                                         "RINGCOLL_TESTING_UNSET")}
    return {
        "rank": rank,
        "world_size": world_size,
        "tag": tag,
        "dist_rank": dist.get_rank(),
        "dist_world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "all_reduce": t.item(),
        "all_gather": [g.item() for g in gathered],
        "env": env,
        "probe_at_import": _PROBE_AT_IMPORT,
        "pid": os.getpid(),
    }


def _explode_here(rank):
    raise ValueError(f"kaboom from rank {rank}")


def _fail_ranks_1_and_2(rank, world_size, marker):
    if rank == 1:
        open(marker, "w").close()
        _explode_here(rank)  # first failure
    if rank == 2:
        # second failure: clearly after rank 1's, well inside spawn's 1 s grace
        deadline = time.monotonic() + 30
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        raise KeyError("second failure")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 blocks here forever: rank 1 never joins
    return "unreachable"


def _exit_rank1(rank, world_size):
    if rank == 1:
        sys.stdout.flush()
        os._exit(3)
    return rank


class _CustomError(Exception):
    pass


def _mixed(rank, world_size):
    import torch.distributed as dist

    # Every rank past its process group's start first: a rank killed while a peer was still
    # connecting to it made that peer's init fail (gloo: "Connection closed by peer", seen once
    # in CI), not the rank's own function raise, as this test means.
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    if rank == 2:
        return lambda: None  # cannot be pickled back to the parent
    raise _CustomError(f"custom failure in rank {rank}")


def _write_pid(pidfile):
    with open(pidfile, "a") as f:
        f.write(f"{os.getpid()}\n")


def _write_pid_and_sleep(rank, world_size, pidfile, sleepers):
    _write_pid(pidfile)
    if rank in sleepers:
        time.sleep(3600)
    return rank


# ------------------------------------------------------------------------ helpers


def _read_pids(pidfile):
    try:
        with open(pidfile) as f:
            return [int(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _alive(pid):
    """True if pid exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _wait_for(pred, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


# -------------------------------------------------------------------- happy path


@pytest.fixture(scope="module")
def basic_results():
    return spawn(_basic, 3, "tag-xyz", timeout=90,
                 env={"RINGCOLL_TESTING_PROBE": "hello", "RINGCOLL_TESTING_UNSET": None})


def test_return_values_in_rank_order(basic_results):
    assert [r["rank"] for r in basic_results] == [0, 1, 2]
    assert all(r["world_size"] == 3 and r["tag"] == "tag-xyz" for r in basic_results)
    assert len({r["pid"] for r in basic_results}) == 3
    assert os.getpid() not in {r["pid"] for r in basic_results}


def test_process_group_is_initialised(basic_results):
    for rank, r in enumerate(basic_results):
        assert r["dist_rank"] == rank
        assert r["dist_world_size"] == 3
        assert r["backend"] == "gloo"
        assert r["all_reduce"] == 6.0  # 1 + 2 + 3
        assert r["all_gather"] == [0.0, 10.0, 20.0]


def test_env_is_visible_in_child(basic_results):
    ports = {r["env"]["MASTER_PORT"] for r in basic_results}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for rank, r in enumerate(basic_results):
        assert r["env"]["RINGCOLL_TESTING_PROBE"] == "hello"
        assert r["probe_at_import"] == "hello"  # set before fn's module was imported
        assert r["env"]["RINGCOLL_TESTING_UNSET"] is None
        assert r["env"]["RANK"] == r["env"]["LOCAL_RANK"] == str(rank)
        assert r["env"]["WORLD_SIZE"] == r["env"]["LOCAL_WORLD_SIZE"] == "3"
        assert r["env"]["MASTER_ADDR"] == "127.0.0.1"
    assert "RINGCOLL_TESTING_PROBE" not in os.environ  # the parent is untouched


def _how_started(rank, world_size):
    return {"parent": os.getppid(), "threads": torch.get_num_threads(),
            "probe": os.environ.get("RINGCOLL_TESTING_LATER"), "omp": os.environ.get("OMP_NUM_THREADS")}


def test_ranks_fork_from_the_server_unless_torch_must_see_the_environment(monkeypatch):
    """By default the ranks are forked by the fork server that preloaded torch (their
    parent is not this process), and see this process's environment as it is at the call,
    not as it was when the server started; OMP_NUM_THREADS, which OpenMP read before the
    fork, still sets torch's threads. An env entry torch may read as it loads starts new
    interpreters instead, so it takes effect there; so does RINGCOLL_SPAWN_FRESH=1."""
    spawn(_how_started, 2, timeout=60)  # the server runs from here on
    monkeypatch.setenv("RINGCOLL_TESTING_LATER", "set after the server started")
    forked = spawn(_how_started, 2, timeout=60, env={"OMP_NUM_THREADS": "1"})
    assert all(r["parent"] != os.getpid() and r["threads"] == 1 and r["omp"] == "1" for r in forked), forked
    assert all(r["probe"] == "set after the server started" for r in forked)
    fresh = spawn(_how_started, 2, timeout=60, env={"TORCH_SHOW_CPP_STACKTRACES": "1"})
    assert all(r["parent"] == os.getpid() and r["probe"] == "set after the server started" for r in fresh), fresh
    monkeypatch.setenv("RINGCOLL_SPAWN_FRESH", "1")
    assert all(r["parent"] == os.getpid() for r in spawn(_how_started, 2, timeout=60))


def test_free_ports_are_outside_the_range_outgoing_connections_take():
    """A port the launcher (and the fault tests' recovery store) picks must stay free until a
    rank binds it: one from the kernel's ephemeral range can meanwhile become the local port
    of any outgoing connection (a CI run's recovery store failed with EADDRINUSE so)."""
    low, high = rt._ephemeral_ports()
    for _ in range(50):
        port = rt._free_port()
        assert not low <= port <= high, (port, low, high)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when handed out


def test_busy_master_port_is_retried(monkeypatch):
    # The parent's free port can be taken before rank 0 binds it; the launch is
    # then redone on a fresh port.  Force that with a port we hold ourselves.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        busy_port = busy.getsockname()[1]
        ports = iter([busy_port])
        real = rt._free_port
        monkeypatch.setattr(rt, "_free_port", lambda: next(ports, None) or real())
        results = spawn(_basic, 2, "retry", timeout=90)
    assert [r["all_reduce"] for r in results] == [3.0, 3.0]
    assert results[0]["env"]["MASTER_PORT"] != str(busy_port)


def test_import_failure_in_child_is_reported(monkeypatch):
    # e.g. a syntax error in ringcoll itself: the rank reports it with a traceback
    broken = rt._BOOTSTRAP.replace("from ringcoll.harness.launcher import", "from ringcoll.no_such_mod import")
    assert broken != rt._BOOTSTRAP
    monkeypatch.setattr(rt, "_BOOTSTRAP", broken)
    with pytest.raises(SpawnError) as ei:
        spawn(_basic, 1, "x", timeout=60)
    assert ei.value.failures[0][:2] == (0, "ModuleNotFoundError")
    assert "ringcoll.no_such_mod" in str(ei.value)


def test_bad_arguments_fail_before_starting_processes():
    with pytest.raises(ValueError):
        spawn(_basic, 0)
    with pytest.raises(ValueError):
        spawn(_basic, 1, "x", timeout=0)
    with pytest.raises(Exception) as ei:  # a lambda cannot be pickled for the child
        spawn(lambda rank, world_size: rank, 1)
    assert not isinstance(ei.value, SpawnError)


# ---------------------------------------------------------------------- failures


@pytest.fixture(scope="module")
def failure_error(tmp_path_factory):
    marker = str(tmp_path_factory.mktemp("failures") / "rank1-failed")
    start = time.monotonic()
    with pytest.raises(SpawnError) as ei:
        spawn(_fail_ranks_1_and_2, 3, marker, timeout=60)
    return ei.value, time.monotonic() - start


def test_exception_in_rank1_names_rank_and_traceback(failure_error):
    err, _ = failure_error
    msg = str(err)
    assert isinstance(err, RuntimeError) and not isinstance(err, SpawnTimeout)
    assert msg.startswith("ValueError in rank 1")  # the first failure leads
    assert "rank 1" in msg
    assert "kaboom from rank 1" in msg
    # the child's full traceback, down to the frame that raised
    assert "Traceback (most recent call last)" in msg
    assert "_fail_ranks_1_and_2" in msg and "in _explode_here" in msg
    assert 'raise ValueError(f"kaboom from rank {rank}")' in msg


def test_several_failures_are_all_reported_rank_ordered(failure_error):
    err, elapsed = failure_error
    msg = str(err)
    assert [(rank, typ) for rank, typ, _ in err.failures] == [(1, "ValueError"), (2, "KeyError")]
    assert "in _explode_here" in err.failures[0][2]
    assert "second failure" in err.failures[1][2]
    assert msg.index("--- rank 1: ValueError") < msg.index("--- rank 2: KeyError")
    # rank 0 was stuck in all_reduce: terminated, not a failure of its own
    assert err.outcomes[0].exc_type == "Terminated" and err.outcomes[0].exitcode is not None
    assert elapsed < 45


def test_os_exit_is_reported_with_exit_code():
    with pytest.raises(SpawnError) as ei:
        spawn(_exit_rank1, 2, timeout=60)
    err = ei.value
    assert [(rank, typ) for rank, typ, _ in err.failures] == [(1, "ProcessDied")]
    assert "rank 1" in str(err) and "exit code 3" in str(err)
    assert err.outcomes[1].exitcode == 3
    assert err.outcomes[0].ok and err.outcomes[0].value == 0


def _crash_in_native_code(rank, world_size):
    if rank == 1:
        import ctypes

        ctypes.string_at(0)  # a read of address 0: SIGSEGV, no Python exception
    return rank


def test_a_rank_killed_by_a_signal_is_reported_with_its_python_stack():
    """A native crash leaves no exception to report: the rank's faulthandler writes where it
    was (the first GPU run lost this: ranks 'died by SIGSEGV' and nothing more)."""
    with pytest.raises(SpawnError) as ei:
        spawn(_crash_in_native_code, 2, timeout=60)
    died = ei.value.outcomes[1]
    assert died.exc_type == "ProcessDied" and died.exitcode == -signal.SIGSEGV
    assert died.traceback.startswith("its Python stacks when it died:"), died.traceback
    assert "Segmentation fault" in died.traceback and "_crash_in_native_code" in died.traceback
    assert "_crash_in_native_code" in str(ei.value)  # the SpawnError's message shows it


def test_spawn_outcomes_reports_each_rank():
    outs = spawn_outcomes(_mixed, 3, timeout=60)
    assert [o.rank for o in outs] == [0, 1, 2]
    assert all(isinstance(o, Outcome) and not o.ok for o in outs)
    raised = outs[0]
    assert raised.exc_type == "_CustomError"
    assert raised.message == "custom failure in rank 0"
    assert "in _mixed" in raised.traceback and raised.traceback.startswith("Traceback")
    assert raised.exitcode == 1
    killed = outs[1]
    assert killed.exc_type == "ProcessDied"
    assert killed.exitcode == -signal.SIGKILL
    assert "SIGKILL" in killed.message and killed.traceback is None
    unpicklable = outs[2]
    assert unpicklable.value is None and unpicklable.exc_type
    assert "could not pickle the return value" in unpicklable.message
    assert unpicklable.traceback


# ----------------------------------------------------- timeouts and cleanliness


def test_timeout_kills_stragglers(tmp_path):
    pidfile = tmp_path / "pids"
    start = time.monotonic()
    with pytest.raises(SpawnTimeout) as ei:
        spawn(_write_pid_and_sleep, 2, str(pidfile), (1,), timeout=8)
    elapsed = time.monotonic() - start
    err = ei.value
    assert isinstance(err, TimeoutError) and isinstance(err, SpawnError)
    assert elapsed < 8 + 5
    assert err.ranks == [1]
    assert "rank(s) [1]" in str(err)
    assert err.outcomes[0].ok and err.outcomes[0].value == 0
    assert err.outcomes[1].exc_type == "SpawnTimeout"
    # Where the hung rank was, from its own stack, so a hang can be debugged from the report.
    assert "its threads when the timeout struck" in str(err)
    assert "in _write_pid_and_sleep" in str(err) and "in _write_pid_and_sleep" in err.outcomes[1].traceback
    pids = _read_pids(pidfile)
    assert len(pids) == 2
    assert not any(_alive(pid) for pid in pids)


def test_keyboard_interrupt_kills_children(tmp_path):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("needs the main thread for signal delivery")
    pidfile = tmp_path / "pids"
    stop = threading.Event()
    main_ident = threading.main_thread().ident

    def interrupter():
        end = time.monotonic() + 40
        while not stop.is_set() and time.monotonic() < end and len(_read_pids(pidfile)) < 2:
            time.sleep(0.05)
        if not stop.is_set():
            signal.pthread_kill(main_ident, signal.SIGUSR1)

    def on_usr1(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGUSR1, on_usr1)
    th = threading.Thread(target=interrupter, daemon=True)
    try:
        th.start()
        with pytest.raises(KeyboardInterrupt):
            spawn(_write_pid_and_sleep, 2, str(pidfile), (0, 1), timeout=60)
    finally:
        stop.set()
        th.join()
        signal.signal(signal.SIGUSR1, old)
    pids = _read_pids(pidfile)
    assert len(pids) == 2
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_children_die_with_the_parent(tmp_path):
    pidfile = tmp_path / "pids"
    here = os.path.dirname(os.path.abspath(__file__))
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{here!r}, {os.path.dirname(os.path.dirname(here))!r}]
        from ringcoll.harness.launcher import spawn
        import {__name__.rsplit('.', 1)[-1]} as t
        spawn(t._write_pid_and_sleep, 2, {str(pidfile)!r}, (0, 1), timeout=120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        assert _wait_for(lambda: len(_read_pids(pidfile)) == 2, 60), "children never started"
    finally:
        parent.kill()
        parent.wait()
    pids = _read_pids(pidfile)
    assert _wait_for(lambda: not any(_alive(pid) for pid in pids), 10), "children outlived parent"


def _async_on_cached_communicator(rank, world_size):
    import torch

    import ringcoll

    ringcoll.all_reduce(torch.ones(3), async_op=True).wait()  # leaves an idle worker thread
    return rank


def test_rank_with_idle_async_worker_exits_promptly():
    # The communicator's async worker is a non-daemon executor thread; the child's exit
    # must stop it the way the interpreter does, not wait on it forever.
    start = time.monotonic()
    assert spawn(_async_on_cached_communicator, 2, timeout=60) == [0, 1]
    assert time.monotonic() - start < 45
