"""Multi-process launcher for tests and benchmarks.

:func:`spawn` runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh
processes, each with an initialised ``torch.distributed`` process group, and
returns the per-rank return values in rank order.  The processes are forked from
a fork server that imported torch once (multiprocessing "forkserver" context),
which saves each rank the ~2.5 s of CPU a torch import costs; where the
environment asks for something torch reads as it loads, they are started as new
interpreters instead ("spawn" context; see ``_context``).  It is built so that a
broken collective cannot wedge or litter a test run:

* every rank's exception comes back as text (type name, ``str(exc)`` and the
  full formatted traceback) and is re-raised in the parent as
  :class:`SpawnError`, naming the rank; a rank that dies without raising
  (``os._exit``, a signal, a segfault) is reported with its exit code/signal;
* a total ``timeout`` bounds the whole call; ranks still running then are
  killed and :class:`SpawnTimeout` names them;
* children are always terminated (SIGTERM, then SIGKILL) and reaped, on
  errors, timeouts and ``KeyboardInterrupt`` alike, and on Linux they carry
  ``PR_SET_PDEATHSIG=SIGKILL`` so they die with the parent.

:func:`spawn_outcomes` is the non-raising variant: it returns one
:class:`Outcome` per rank so a test can assert on mixed results (rank 0 raised
X, rank 1 was killed, ...).

Usage::

    import torch
    import torch.distributed as dist
    from ringcoll.harness.launcher import spawn

    def _sum_ranks(rank, world_size, scale):      # top level: must pickle
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        return t.item() * scale

    def test_all_reduce():
        assert spawn(_sum_ranks, 3, 2.0, timeout=60) == [6.0, 6.0, 6.0]

Notes:

* ``fn``, ``args`` and return values travel by (plain) pickle; ``fn`` must be
  a top-level function of an importable module, and a script that calls
  :func:`spawn` needs the usual ``if __name__ == "__main__":`` guard.
* Each child starts from the caller's environment as it is at the call, sets
  ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` (a free port picked by the parent),
  ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``, then the
  ``env`` entries (a value of ``None`` unsets the variable), before it imports
  ringcoll or ``fn``'s module, so variables they read at import time take
  effect.  An ``env`` entry torch may read as it loads (anything but ringcoll's,
  torch.distributed's, CUDA's and ``OMP_NUM_THREADS``, see ``_context``) makes the
  call start new interpreters, where it takes effect too;
  ``RINGCOLL_SPAWN_FRESH=1`` always does.  (Exceptions:
  variables the C runtime reads at exec, e.g. ``LD_PRELOAD``, and whatever a
  script's ``__main__`` imports, since the main script is imported first.)
* ``init_timeout`` (default: ``timeout``) is the process-group timeout, which
  also bounds each collective.  With :func:`spawn_outcomes`, ranks blocked in a
  collective on a rank that raised wait for that timeout (or the total one).
* A rank that finished (returned or, under :func:`spawn`, raised) keeps its
  process group alive until every rank has finished, so rank 0's TCPStore
  cannot disappear under slower ranks.  Under :func:`spawn`, once a rank has
  failed the others get a short grace to report their own failures and are
  then terminated.
* Children end with ``os._exit`` after destroying the process group, joining
  non-daemon threads, running ``atexit`` handlers and flushing stdio: full
  interpreter teardown with torch loaded costs ~0.5 s per process.  Files the
  rank opened and never closed are therefore not flushed -- close them.
* Call :func:`spawn` from a thread that outlives the call (it blocks anyway):
  ``PR_SET_PDEATHSIG`` fires when the *thread* that started the children exits.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import pickle
import random
import signal
import socket
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait as _wait
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

__all__ = ["spawn", "spawn_outcomes", "Outcome", "SpawnError", "SpawnTimeout"]

# exc_type markers for outcomes that are not exceptions raised by fn.
PROCESS_DIED = "ProcessDied"  # exited / was signalled without reporting (or exited non-zero after returning)
TIMED_OUT = "SpawnTimeout"  # still running at the total timeout; killed
TERMINATED = "Terminated"  # spawn(): killed because another rank failed

_TERM_GRACE = 3.0  # SIGTERM -> SIGKILL
_FAIL_GRACE = 1.0  # spawn(): how long other ranks may still report after the first failure
_MIN_EXIT_GRACE = 5.0  # ranks that reported get at least this long to exit after release
_PORT_ATTEMPTS = 3  # relaunches when rank 0 cannot bind the chosen MASTER_PORT
# fn+args bigger than this go through a temp file: Process.start() writes its
# arguments into a pipe the child drains only once Python is up, so a big
# inline payload would serialise the starts.
_INLINE_PAYLOAD = 32 * 1024


class Outcome(NamedTuple):
    """What one rank did.  ``ok`` is True iff it returned (``value``) and exited cleanly.

    ``exc_type`` is the exception's class name, or :data:`PROCESS_DIED`,
    :data:`TIMED_OUT` (``"SpawnTimeout"``) or :data:`TERMINATED`; ``exitcode``
    is the process exit code (negative: killed by that signal).
    """

    rank: int
    ok: bool
    value: Any
    exc_type: Optional[str]
    message: Optional[str]
    traceback: Optional[str]
    exitcode: Optional[int]


class SpawnError(RuntimeError):
    """One or more ranks raised or died.

    ``failures``: list of ``(rank, exc_type_name, traceback_text)``, rank-ordered;
    ``outcomes``: the :class:`Outcome` of every rank.
    """

    def __init__(self, message: str, failures=(), outcomes=()):
        super().__init__(message)
        self.failures: List[Tuple[int, str, str]] = list(failures)
        self.outcomes: List[Outcome] = list(outcomes)


class SpawnTimeout(SpawnError, TimeoutError):
    """The total timeout passed; ``ranks`` were still running and have been killed."""

    def __init__(self, message: str, ranks=(), outcomes=(), timeout: float = 0.0):
        super().__init__(message, (), outcomes)
        self.ranks: List[int] = list(ranks)
        self.timeout = timeout


# --------------------------------------------------------------------------- child


def _set_pdeathsig() -> None:
    """Best effort: SIGKILL this process when its parent dies (Linux only). The parent is
    the caller of spawn, or the fork server it started (which exits with the caller)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        if libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0),
                      ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
            return
    except Exception:
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _safe_str(obj: Any) -> str:
    try:
        return str(obj)
    except BaseException:
        return f"<unprintable {type(obj).__name__}>"


# The child's Process target is the builtin ``exec`` running this bootstrap,
# not _child_main itself: unpickling a target from ringcoll.harness.launcher would import
# the ringcoll package (and torch) before ``env`` is in place.  This way the
# variables are set before anything of ours or the caller's is imported, and a
# failing ``import ringcoll`` is still reported with its traceback.
#
# A rank forked by the fork server first lets go of the server. multiprocessing hands every
# process the server forks the write end of the pipe whose closing tells the server that its
# last client is gone; a rank holding it would keep the server alive while the server keeps
# the rank alive (the rank dies with its parent, the server), so killing the caller would
# leave both running. A rank that starts processes itself gets a server of its own.
_BOOTSTRAP = """
import os
if _whole_env is not None:  # forked from the fork server: the caller's environment as it is now
    os.environ.clear()
    os.environ.update(_whole_env)
    from multiprocessing import forkserver as _fs
    if _fs._forkserver._forkserver_alive_fd is not None:
        os.close(_fs._forkserver._forkserver_alive_fd)
    _fs._forkserver._forkserver_alive_fd = _fs._forkserver._forkserver_address = None
    _fs._forkserver._forkserver_pid = None
for _k, _v in _env.items():
    if _v is None:
        os.environ.pop(_k, None)
    else:
        os.environ[_k] = _v
if _whole_env is not None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
    import torch
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # OpenMP read it before the fork
try:
    from ringcoll.harness.launcher import _child_main
except BaseException as _exc:
    import pickle, traceback
    _conn.send_bytes(pickle.dumps(("err", "setup", type(_exc).__name__, str(_exc),
                                   traceback.format_exc())))
    raise SystemExit(1)
_child_main(*_args, conn=_conn)
"""


def _child_main(rank, world_size, backend, pg_timeout_s, payload, hold_on_error, *, conn):
    _set_pdeathsig()
    _dump_stacks_on_request()
    dist = None
    phase = "setup"
    try:
        if isinstance(payload, str):  # large payloads come through a file
            with open(payload, "rb") as f:
                payload = f.read()
        fn, args = pickle.loads(payload)
        phase = "init"
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group(backend, init_method="env://", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=pg_timeout_s))
        phase = "fn"
        value = fn(rank, world_size, *args)
        phase = "result"
        try:
            data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:
            report = ("err", phase, type(exc).__name__,
                      f"rank {rank}: could not pickle the return value "
                      f"({type(value).__name__}): {_safe_str(exc)}", traceback.format_exc())
        else:
            report = ("ok", phase, data)
    except BaseException as exc:  # noqa: BLE001 - everything goes to the parent as text
        report = ("err", phase, type(exc).__name__, _safe_str(exc), traceback.format_exc())

    ok = report[0] == "ok"
    try:
        conn.send_bytes(pickle.dumps(report))
    except BaseException:
        pass  # the parent is gone or has stopped listening
    if ok or hold_on_error:
        try:  # wait until the parent releases us by closing its end
            while True:
                conn.recv_bytes()
        except BaseException:
            pass
    exitcode = 0 if ok else 1
    if dist is not None:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except BaseException:
            traceback.print_exc()
            exitcode = exitcode or 1
    try:
        conn.close()
    except BaseException:
        pass
    _fast_exit(exitcode)


_STACK_SIGNAL = signal.SIGUSR1
_STACK_FILE_ENV = "RINGCOLL_SPAWN_STACK_FILE"


def _dump_stacks_on_request() -> None:
    """On SIGUSR1 write every thread's Python stack to the file the parent named, so a rank
    that hangs past the timeout is reported with where it hung; and on a fatal signal
    (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) too, so a rank that crashes is reported with
    where it crashed (a native crash leaves no Python exception to report)."""
    path = os.environ.get(_STACK_FILE_ENV)
    if path:
        import faulthandler

        stacks = open(path, "w")  # noqa: SIM115 - kept open: the handlers write to it
        faulthandler.register(_STACK_SIGNAL, file=stacks, all_threads=True)
        faulthandler.enable(file=stacks, all_threads=True)


def _collect_stacks(ranks) -> None:
    """Ask each rank about to be killed for its stacks and keep what arrives within half a second."""
    asked = []
    for r in ranks:
        try:
            os.kill(r.proc.pid, _STACK_SIGNAL)
            asked.append(r)
        except (OSError, TypeError):
            pass
    if asked:
        time.sleep(0.5)
    for r in asked:
        _read_stacks(r)


def _read_stacks(r) -> None:
    try:
        with open(r.stack_file) as f:
            r.stacks = f.read().strip() or None
    except OSError:
        pass


def _fast_exit(exitcode: int) -> None:
    """Exit like the interpreter would, minus module teardown.

    A normal interpreter shutdown with torch loaded takes ~0.5 s (more under
    load); per spawn in a test suite that adds up.  We keep the parts that have
    observable effects: wait for non-daemon threads, run atexit handlers (which
    include multiprocessing's finalizers), flush stdio -- then ``os._exit``.
    """
    import atexit
    import threading

    try:
        # What the interpreter itself does first at exit: run threading's exit hooks (they
        # stop idle executor workers, e.g. a communicator's async thread), then join every
        # non-daemon thread. A plain join loop would wait forever on an idle executor.
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        else:
            me = threading.current_thread()
            for t in threading.enumerate():
                if t is not me and not t.daemon and t.is_alive():
                    t.join()
    except BaseException:
        pass
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if run_exitfuncs is None:
        sys.exit(exitcode)
    try:
        run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(exitcode)


# -------------------------------------------------------------------------- parent


def _ephemeral_ports() -> Tuple[int, int]:
    """The ports the kernel gives outgoing connections (ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(word) for word in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _free_port() -> int:
    """A port free now, for a rank to listen on later. Not one the kernel would pick
    (bind to port 0): that range is also where every outgoing connection takes its local
    port, so between this check and the rank's bind one took it (a fault test's recovery
    store, chosen before a kill and bound seconds after it, failed with EADDRINUSE in a CI
    run). Below the range only an explicit bind can take it."""
    low, _ = _ephemeral_ports()
    below = range(max(1024, low - 12000), low)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        for port in random.sample(below, min(200, len(below))):
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
        s.bind(("127.0.0.1", 0))  # every port tried was taken: the kernel's pick, as before
        return s.getsockname()[1]


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (exit code {code})"
    return f"exit code {code}"


class _Rank:
    __slots__ = ("rank", "proc", "conn", "report", "dead", "seq", "kill_reason", "conn_eof", "stack_file",
                 "stacks")

    def __init__(self, rank, proc, conn, stack_file):
        self.rank = rank
        self.proc = proc
        self.conn = conn
        self.stack_file = stack_file  # where the child's faulthandler writes its threads' stacks
        self.stacks = None  # what it wrote when we killed it (timed out, or another rank failed) or it crashed
        self.report = None  # decoded report tuple
        self.dead = False  # exited before reporting
        self.seq = None  # arrival order of the report / death
        self.kill_reason = None  # TIMED_OUT / TERMINATED when we killed it before it reported
        self.conn_eof = False  # the child closed its end without reporting

    @property
    def pending(self):
        return self.report is None and not self.dead


def _terminate(procs, grace: float = _TERM_GRACE) -> None:
    """SIGTERM every live process, SIGKILL what is left after ``grace``, reap all."""
    alive = []
    for p in procs:
        try:
            if p.is_alive():
                p.terminate()
                alive.append(p)
        except Exception:
            pass
    end = time.monotonic() + grace
    for p in alive:
        try:
            p.join(max(0.0, end - time.monotonic()))
        except Exception:
            pass
    for p in alive:
        try:
            if p.exitcode is None:
                p.kill()
        except Exception:
            pass
    for p in alive:
        try:
            p.join(10.0)
        except Exception:
            pass


def _close(conn) -> None:
    try:
        conn.close()
    except Exception:
        pass


def _read_report(r: _Rank) -> str:
    """Read r's report if one is waiting: returns "report", "eof" or "empty"."""
    try:
        if not r.conn.poll(0):
            return "empty"
        data = r.conn.recv_bytes()
    except (EOFError, OSError):
        return "eof"
    try:
        r.report = pickle.loads(data)
    except Exception as exc:  # should not happen: the outer report is builtins only
        r.report = ("err", "report", type(exc).__name__, f"undecodable report: {exc}",
                    traceback.format_exc())
    return "report"


def _outcome(r: _Rank, timeout: float) -> Outcome:
    code = r.proc.exitcode
    if r.report is not None:
        if r.report[0] == "ok":
            try:
                value = pickle.loads(r.report[2])
            except Exception as exc:
                return Outcome(r.rank, False, None, type(exc).__name__,
                               f"rank {r.rank}: could not unpickle the return value in the "
                               f"parent: {_safe_str(exc)}", traceback.format_exc(), code)
            if r.kill_reason is not None:
                return Outcome(r.rank, False, value, TIMED_OUT,
                               f"rank {r.rank} returned but did not exit in time; killed",
                               None, code)
            if code != 0:
                return Outcome(r.rank, False, value, PROCESS_DIED,
                               f"rank {r.rank} returned but then exited abnormally "
                               f"({_describe_exit(code)})", None, code)
            return Outcome(r.rank, True, value, None, None, None, code)
        _, _phase, exc_type, message, tb = r.report
        return Outcome(r.rank, False, None, exc_type, message, tb, code)
    if r.kill_reason == TIMED_OUT:
        return Outcome(r.rank, False, None, TIMED_OUT,
                       f"rank {r.rank} was still running after the {timeout:g} s timeout; "
                       f"killed ({_describe_exit(code)})", r.stacks, code)
    if r.kill_reason == TERMINATED:
        return Outcome(r.rank, False, None, TERMINATED,
                       f"rank {r.rank} was still running after another rank failed; "
                       f"terminated ({_describe_exit(code)})", r.stacks, code)
    return Outcome(r.rank, False, None, PROCESS_DIED,
                   f"rank {r.rank} died without returning or raising "
                   f"({_describe_exit(code)})",
                   f"its Python stacks when it died:\n{r.stacks}" if r.stacks else None, code)


def _addr_in_use(r: _Rank) -> bool:
    rep = r.report
    if rep is None or rep[0] != "err" or rep[1] != "init":
        return False
    text = f"{rep[3]}\n{rep[4]}"
    return "EADDRINUSE" in text or "ddress already in use" in text


# Starting a rank costs a Python and a torch import (~2.5 s of CPU), which on a small
# machine is most of what a short test spends. So ranks are forked from a fork server that
# imported torch once ("forkserver" context, torch preloaded): each still a fresh process,
# with the caller's environment of the moment set before ringcoll (never preloaded) or the
# caller's function is imported. Variables read when torch itself loads cannot take effect
# in a forked rank, so a call whose `env` sets anything but the variables below (ringcoll's,
# and those torch.distributed, gloo, NCCL and CUDA read when they start) starts fresh
# interpreters instead ("spawn"), as does RINGCOLL_SPAWN_FRESH=1. OMP_NUM_THREADS, read by
# OpenMP as torch loads, a forked rank applies itself (torch.set_num_threads). What the
# calling process changes in its own environment after its first spawn reaches the ranks,
# but not torch's loading (libraries such as scikit-learn set OpenMP variables at import).
_PRELOAD = ["torch", "torch.distributed"]
_READ_AFTER_IMPORT = ("RINGCOLL_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GLOO_",
                      "NCCL_", "TORCH_NCCL_", "CUDA_", "OMP_NUM_THREADS")
_preloading = False  # the fork server's preload is set (once, before it starts)


def _context(env: Dict[str, Optional[str]]):
    """(the multiprocessing context for this launch, the environment forked ranks start from)."""
    global _preloading
    if (os.environ.get("RINGCOLL_SPAWN_FRESH") == "1" or not sys.platform.startswith("linux")
            or any(not k.startswith(_READ_AFTER_IMPORT) for k in env)):
        return multiprocessing.get_context("spawn"), None
    context = multiprocessing.get_context("forkserver")
    if not _preloading:
        context.set_forkserver_preload(_PRELOAD)
        _preloading = True
    return context, dict(os.environ)


def _run_once(fn_payload, world_size, timeout, deadline, backend, env, pg_timeout_s, fail_fast):
    """One launch.  Returns (ranks, order, retry_port)."""
    ctx, whole_env = _context(env)
    port = _free_port()
    ranks: List[_Rank] = []
    order: List[int] = []
    retry_port = False
    stack_dir = tempfile.TemporaryDirectory(prefix="ringcoll-spawn-")
    try:
        # Start every rank before waiting on any: each start costs a Python +
        # torch import, which the children then do in parallel.
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            child_env = {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size),
            }
            stack_file = os.path.join(stack_dir.name, f"rank{rank}.txt")
            child_env[_STACK_FILE_ENV] = stack_file
            child_env.update(env)
            boot_globals = {
                "__name__": "__ringcoll_spawn__",
                "_env": child_env,
                "_whole_env": whole_env,
                "_conn": child_conn,
                "_args": (rank, world_size, backend, pg_timeout_s, fn_payload, fail_fast),
            }
            proc = ctx.Process(target=exec, args=(_BOOTSTRAP, boot_globals),
                               name=f"ringcoll-rank{rank}")
            try:
                proc.start()
            finally:
                _close(child_conn)
            ranks.append(_Rank(rank, proc, parent_conn, stack_file))

        first_failure_at = None
        while True:
            pending = [r for r in ranks if r.pending]
            if not pending:
                break
            now = time.monotonic()
            if now >= deadline:
                for r in pending:
                    r.kill_reason = TIMED_OUT
                _collect_stacks(pending)
                break
            until = deadline
            if fail_fast and first_failure_at is not None:
                if now >= first_failure_at + _FAIL_GRACE:
                    for r in pending:
                        r.kill_reason = TERMINATED
                    _collect_stacks(pending)  # where they were while the failed rank waited for them
                    break
                until = min(until, first_failure_at + _FAIL_GRACE)
            by_obj = {}
            for r in pending:
                if not r.conn_eof:
                    by_obj[r.conn] = r
                by_obj[r.proc.sentinel] = r
            ready = _wait(list(by_obj), timeout=max(0.0, until - now))
            for o in ready:
                r = by_obj[o]
                if not r.pending:
                    continue
                if isinstance(o, int):  # sentinel: the process has exited
                    if _read_report(r) != "report":
                        r.proc.join(1.0)
                        r.dead = True
                elif _read_report(r) == "eof":
                    r.conn_eof = True  # closed without reporting; its sentinel will say more
                if not r.pending:
                    r.seq = len(order)
                    order.append(r.rank)
                    if (r.dead or r.report[0] != "ok") and first_failure_at is None:
                        first_failure_at = time.monotonic()
                    if _addr_in_use(r):
                        retry_port = True
            if retry_port:
                for r in ranks:
                    if r.pending:
                        r.kill_reason = TERMINATED
                break

        # Kill ranks that never reported, then release the ones that did (they
        # are parked in recv() with their process group still alive) and give
        # them a moment to tear down and exit.
        _terminate([r.proc for r in ranks if r.kill_reason is not None])
        for r in ranks:
            _close(r.conn)
        any_failure = any(r.dead or r.kill_reason or (r.report and r.report[0] != "ok")
                          for r in ranks)
        now = time.monotonic()
        exit_deadline = now + _MIN_EXIT_GRACE if any_failure else max(deadline, now + _MIN_EXIT_GRACE)
        exiting = [r for r in ranks if r.proc.exitcode is None]
        while exiting:
            left = exit_deadline - time.monotonic()
            if left <= 0:
                break
            _wait([r.proc.sentinel for r in exiting], timeout=left)
            exiting = [r for r in exiting if r.proc.is_alive()]
        for r in exiting:
            if r.report is not None and r.report[0] == "ok":
                r.kill_reason = TIMED_OUT  # returned, but hung in teardown
        _terminate([r.proc for r in exiting])
        for r in ranks:  # a rank a signal killed: what its faulthandler wrote (before the folder goes)
            if r.dead and r.kill_reason is None and (r.proc.exitcode or 0) < 0:
                _read_stacks(r)
        return ranks, order, retry_port
    finally:
        # Also reached on KeyboardInterrupt or any error in here: no child survives.
        _terminate([r.proc for r in ranks])
        for r in ranks:
            _close(r.conn)
        stack_dir.cleanup()


def _run(fn, world_size, args, timeout, backend, env, init_timeout, fail_fast):
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    env = {str(k): (None if v is None else str(v)) for k, v in (env or {}).items()}
    pg_timeout_s = float(init_timeout if init_timeout is not None else timeout)
    # Pickle in the parent: an unpicklable fn/arg fails here, before any process starts.
    payload = pickle.dumps((fn, tuple(args)), protocol=pickle.HIGHEST_PROTOCOL)
    deadline = time.monotonic() + float(timeout)
    payload_file = None
    try:
        if len(payload) > _INLINE_PAYLOAD:
            fd, payload_file = tempfile.mkstemp(prefix="ringcoll-spawn-", suffix=".pkl")
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            payload = payload_file
        for attempt in range(_PORT_ATTEMPTS):
            ranks, order, retry_port = _run_once(payload, world_size, timeout, deadline,
                                                 backend, env, pg_timeout_s, fail_fast)
            if not retry_port or attempt == _PORT_ATTEMPTS - 1 or time.monotonic() >= deadline:
                break
    finally:
        if payload_file is not None:
            try:
                os.unlink(payload_file)
            except OSError:
                pass
    outcomes = [_outcome(r, timeout) for r in ranks]
    return outcomes, order


def spawn_outcomes(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                   backend: str = "gloo", env: Optional[Dict[str, Optional[str]]] = None,
                   init_timeout: Optional[float] = None) -> List[Outcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; never raises for rank failures.

    Waits until every rank has returned, raised or died (or ``timeout`` seconds
    in total have passed) and returns one :class:`Outcome` per rank, in rank
    order.  Ranks still running at the timeout are killed and reported with
    ``ok=False, exc_type="SpawnTimeout"``.  A rank that raised exits right
    away (so peers blocked on it in gloo collectives usually fail fast with a
    connection error rather than waiting for the process-group timeout).
    """
    outcomes, _ = _run(fn, world_size, args, timeout, backend, env, init_timeout, fail_fast=False)
    return outcomes


def _format_failures(failures: List[Outcome], first: Outcome, outcomes: List[Outcome]) -> str:
    head = (f"{first.exc_type} in rank {first.rank}"
            + (f": {first.message}" if first.message else ""))
    lines = [head]
    if len(failures) > 1:
        lines.append(f"{len(failures)} of {len(outcomes)} ranks failed: "
                     + ", ".join(f"rank {o.rank} ({o.exc_type})" for o in failures))
    for o in failures:
        lines.append("")
        lines.append(f"--- rank {o.rank}: {o.exc_type}"
                     + (f" ({_describe_exit(o.exitcode)})" if o.exc_type == PROCESS_DIED else "")
                     + " ---")
        lines.append((o.traceback or o.message or "").rstrip("\n"))
    others = [o for o in outcomes if o.exc_type in (TERMINATED, TIMED_OUT)]
    if others:
        lines.append("")
        lines.append("still running and killed: "
                     + ", ".join(f"rank {o.rank}" for o in others))
        lines.extend(f"rank {o.rank}:{_stacks_text(o)}" for o in others if o.traceback)
    return "\n".join(lines)


def _stacks_text(o: Outcome, limit: int = 6000) -> str:
    if not o.traceback:
        return ""
    text = o.traceback if len(o.traceback) <= limit else "...\n" + o.traceback[-limit:]
    return "\n    its threads when the timeout struck:\n" + "".join(f"      {line}\n" for line in text.splitlines())


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
          backend: str = "gloo", env: Optional[Dict[str, Optional[str]]] = None,
          init_timeout: Optional[float] = None) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return the values in rank order.

    Raises :class:`SpawnError` if any rank raised or died (message: the first
    failure's type and rank, then every failing rank's traceback, rank-ordered)
    and :class:`SpawnTimeout` if ranks were still running after ``timeout``
    seconds in total.  No child process survives the call.
    """
    outcomes, order = _run(fn, world_size, args, timeout, backend, env, init_timeout,
                           fail_fast=True)
    failures = [o for o in outcomes if not o.ok and o.exc_type not in (TIMED_OUT, TERMINATED)]
    if failures:
        by_rank = {o.rank: o for o in failures}
        first_rank = next((rk for rk in order if rk in by_rank), failures[0].rank)
        msg = _format_failures(failures, by_rank[first_rank], outcomes)
        raise SpawnError(msg, [(o.rank, o.exc_type, o.traceback or o.message or "")
                               for o in failures], outcomes)
    timed_out = [o for o in outcomes if not o.ok]
    if timed_out:
        ranks = [o.rank for o in timed_out]
        done = [o.rank for o in outcomes if o.ok]
        raise SpawnTimeout(
            f"timeout after {timeout:g} s: rank(s) {ranks} still running (killed)"
            + (f"; rank(s) {done} had returned" if done else "")
            + "".join(f"\n  {o.message}" + _stacks_text(o) for o in timed_out),
            ranks, outcomes, timeout)
    return [o.value for o in outcomes]
