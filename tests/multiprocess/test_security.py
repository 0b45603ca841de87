"""Security properties of the shared-memory transport's segments.

* Names are 128 random bits from the kernel: no repeats, every hex digit of every position
  varies (no pid, rank, counter or time baked in), and a forked child does not repeat its
  parent's draws (no user-space generator state copied by fork).
* A segment is created 0600 and owned by the creating user, whatever the umask.
* Another user cannot open (read or write) or unlink a live segment.
* Names never reach logs, disk or exception messages: a normal run with torch's most verbose
  logging prints none, writes none to the job's directories, and error messages (bootstrap
  timeout, collective timeout, peer gone) carry none.

The live segment these tests look at is made the way a Communicator makes it: rank 0 of a
world of 2 is constructed (``_C.HostComm``) in a thread while rank 1 never shows up; until
the 1 s timeout, rank 0's segment exists in /dev/shm and can be inspected.
"""

from __future__ import annotations

import collections
import json
import os
import re
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from ringcoll import _C
from ringcoll.errors import RingcollTimeoutError

NAME_RE = re.compile(r"^/ringcoll-[0-9a-f]{32}-[0-9]+-[0-9]+$")  # then the maker's pid and pid namespace
ANY_NAME_RE = re.compile(r"ringcoll-[0-9a-f]{32}")
NOBODY = 65534
REPO = Path(__file__).resolve().parents[2]


def shm_path(name: str) -> str:
    return "/dev/shm/" + name.lstrip("/")


# --- names --------------------------------------------------------------------------------

def test_names_do_not_repeat_and_every_position_varies():
    draws = 20_000
    names = [_C.random_segment_name() for _ in range(draws)]
    assert all(NAME_RE.match(n) for n in names)
    assert len(set(names)) == draws
    digits = [n[len("/ringcoll-"):len("/ringcoll-") + 32] for n in names]
    # then the maker: for removing what a job killed whole left (shm_segment.h)
    assert {n[len("/ringcoll-") + 32:] for n in names} == {f"-{os.getpid()}-{os.stat('/proc/self/ns/pid').st_ino}"}
    # Each of the 32 positions takes all 16 values (a pid, rank, counter or timestamp would
    # pin some positions), and each of the 128 bits is set about half the time.
    for pos in range(32):
        counts = collections.Counter(d[pos] for d in digits)
        assert len(counts) == 16, (pos, counts)
    values = [int(d, 16) for d in digits]
    for bit in range(128):
        ones = sum((v >> bit) & 1 for v in values)
        assert abs(ones / draws - 0.5) < 0.03, (bit, ones)  # 8 sigma at n = 20,000


def test_the_random_part_of_a_name_carries_no_pid():
    """The pid follows the 128 random bits (the maker, for removing what a dead job left);
    the random part is random all the same."""
    pid_hex, pid_dec = f"{os.getpid():x}", str(os.getpid())
    names = [_C.random_segment_name()[:len("/ringcoll-") + 32] for _ in range(2000)]
    digits = len(names[0]) - len("/ringcoll-")  # 32 random hex digits
    # A name that embedded the pid would contain it every time; by chance a random name
    # contains a k-digit string at ~(33 - k) / 16^k of the time, which is not small when
    # the pid is (a fresh container's pids have 3 digits): allow 4x that, plus 20.
    for needle in (pid_hex, pid_dec):
        by_chance = len(names) * (digits - len(needle) + 1) / 16 ** len(needle)
        hits = sum(needle in n for n in names)
        assert hits < 4 * by_chance + 20, (needle, hits, by_chance)


def test_forked_child_does_not_repeat_parent_draws():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: draw and report, nothing else
        try:
            os.close(r)
            os.write(w, json.dumps([_C.random_segment_name() for _ in range(50)]).encode())
        finally:
            os._exit(0)
    os.close(w)
    parent = [_C.random_segment_name() for _ in range(50)]
    with os.fdopen(r) as f:
        child = json.loads(f.read())
    os.waitpid(pid, 0)
    assert len(child) == 50 and not set(child) & set(parent)


# --- a live segment -----------------------------------------------------------------------

class LiveSegment:
    """Rank 0 of a world of 2 under construction in a thread; rank 1 never comes. While it
    waits (``timeout`` s), rank 0's segment exists under ``self.path``."""

    def __init__(self, timeout: float = 1.0, buffer_bytes: int = 64 * 1024):
        self.names = [_C.random_segment_name(), _C.random_segment_name()]
        self.path = shm_path(self.names[0])
        self.timeout = timeout
        self.error = None
        self.thread = threading.Thread(target=self._run, args=(buffer_bytes,), daemon=True)

    def _run(self, buffer_bytes):
        try:
            _C.HostComm(0, 2, self.names, buffer_bytes, self.timeout)
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            self.error = e

    def __enter__(self):
        self.started = time.monotonic()
        self.thread.start()
        deadline = time.monotonic() + self.timeout
        while not os.path.exists(self.path):
            assert time.monotonic() < deadline, "rank 0's segment never appeared"
            time.sleep(0.001)
        return self

    def __exit__(self, *exc):
        self.thread.join(self.timeout + 10)
        assert not self.thread.is_alive()
        self.elapsed = time.monotonic() - self.started


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077], ids=oct)
def test_segment_is_created_0600_and_owned_by_us(umask):
    old = os.umask(umask)
    try:
        with LiveSegment() as seg:
            st = os.stat(seg.path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    assert stat.S_ISREG(st.st_mode)
    assert st.st_uid == os.geteuid() and st.st_gid == os.getegid()
    # Then the bootstrap times out, says so without naming the segment, and unlinks it.
    assert isinstance(seg.error, RingcollTimeoutError), repr(seg.error)
    assert "ringcoll-" not in str(seg.error) and seg.names[0][1:] not in str(seg.error)
    assert "waiting for rank 1" in str(seg.error)
    assert not os.path.exists(seg.path)


def _as_nobody(script: str) -> subprocess.CompletedProcess:
    """Run a /bin/sh script as uid/gid 65534 with no supplementary groups."""
    return subprocess.run(["/bin/sh", "-c", script], user=NOBODY, group=NOBODY, extra_groups=[],
                          capture_output=True, text=True, timeout=30)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user (nobody, uid 65534) needs root; "
                                              "this run is not root")
def test_another_user_cannot_open_or_unlink_a_live_segment():
    probe = _as_nobody("id -u")
    assert probe.stdout.strip() == str(NOBODY), probe
    # /dev/shm is world-writable and sticky: others may list it but not remove our entries.
    assert os.stat("/dev/shm").st_mode & stat.S_ISVTX
    with LiveSegment(timeout=3.0) as seg:
        results = {}
        for what, script in {
            "read": f"exec 3< {seg.path} && echo OPENED",
            "write": f"exec 3<> {seg.path} && echo OPENED",
            "append": f"exec 3>> {seg.path} && echo OPENED",
            "unlink": f"rm -f {seg.path} && test ! -e {seg.path} && echo REMOVED",
        }.items():
            results[what] = _as_nobody(script)
        still_there = os.path.exists(seg.path)
    for what, r in results.items():
        assert r.returncode != 0 and "OPENED" not in r.stdout and "REMOVED" not in r.stdout, (what, r)
        assert "Permission denied" in r.stderr or "Operation not permitted" in r.stderr, (what, r.stderr)
    assert still_there
    assert not os.path.exists(seg.path)  # gone after the bootstrap timed out


def test_the_owner_can_open_its_live_segment():
    """The positive control for the test above: the same open works for the owner."""
    with LiveSegment() as seg:
        fd = os.open(seg.path, os.O_RDWR)
        os.close(fd)


# --- names in error messages, logs and files ----------------------------------------------

def test_name_collision_error_does_not_name_the_segment_nor_remove_the_existing_entry():
    name = _C.random_segment_name()
    path = shm_path(name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)  # someone else's entry
    os.close(fd)
    try:
        with pytest.raises(RuntimeError) as info:
            _C.HostComm(0, 1, [name], 64 * 1024, 1.0)
        survived = os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    assert name[1:] not in str(info.value), str(info.value)
    assert survived, "the failed bootstrap removed an entry it had not created"


JOB = textwrap.dedent("""
    # A normal job, as a user would run it, plus one error of each runtime kind.
    import json, os, sys, time
    import torch
    import torch.distributed as dist
    from ringcoll.harness.launcher import spawn

    def rank_fn(rank, world, absent):
        import ringcoll
        import ringcoll.transports.host as rc
        real, seen = rc._C, []

        class Recording:
            def __getattr__(self, name):
                return getattr(real, name)

            def HostComm(self, r, w, names, *rest):
                seen.extend(names)
                return real.HostComm(r, w, names, *rest)

        rc._C = Recording()
        t = torch.arange(3 << 15, dtype=torch.float32)
        ringcoll.all_reduce(t)
        out = torch.empty(t.numel() * world)
        ringcoll.all_gather_into_tensor(out, t)
        ringcoll.reduce_scatter_tensor(t[: t.numel() // world].clone(), t)
        ringcoll.barrier()
        ringcoll.destroy_communicators()
        errors = []
        comm = ringcoll.Communicator(timeout=1.0)
        if rank != absent:  # the absent rank skips this call: timeouts and peer errors
            try:
                comm.all_reduce(torch.ones(1000))
            except ringcoll.RingcollError as e:
                errors.append(f"{type(e).__name__}: {e}")
        else:
            time.sleep(3.0)
            try:
                comm.all_reduce(torch.ones(1000))
            except ringcoll.RingcollError as e:
                errors.append(f"{type(e).__name__}: {e}")
        comm.close()
        print(f"rank {rank} done", flush=True)
        return seen, errors

    if __name__ == "__main__":
        results = spawn(rank_fn, 3, 2, timeout=120)
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
""")


def test_names_never_reach_logs_disk_or_error_messages(tmp_path):
    work = tmp_path / "work"
    (work / "tmp").mkdir(parents=True)
    (work / "job.py").write_text(JOB)
    result_file = tmp_path / "result.json"  # outside the scanned directory
    env = dict(os.environ, TMPDIR=str(work / "tmp"), TORCH_CPP_LOG_LEVEL="INFO",
               TORCH_DISTRIBUTED_DEBUG="DETAIL", TORCH_SHOW_CPP_STACKTRACES="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RINGCOLL_TIMEOUT", None)
    proc = subprocess.run([sys.executable, "job.py", str(result_file)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(result_file.read_text())
    names = {n.lstrip("/") for seen, _ in results for n in seen}
    assert len(names) == 2 * 3  # two communicators x three ranks, all recorded
    hexes = {n[len("ringcoll-"):] for n in names}
    output = proc.stdout + proc.stderr
    assert "rank 0 done" in output and "[c10d]" in output, "torch's verbose logging did not run"
    assert not ANY_NAME_RE.search(output), ANY_NAME_RE.search(output).group(0)
    assert not any(h in output for h in hexes)
    # Error messages: the absent rank's peers time out or see the abort, the latecomer sees
    # the abort; none names a segment.
    errors = [e for _, errs in results for e in errs]
    assert len(errors) == 3 and any("RingcollTimeoutError" in e for e in errors), errors
    for e in errors:
        assert not ANY_NAME_RE.search(e) and not any(h in e for h in hexes), e
    # Disk: nothing the job wrote (cwd, TMPDIR) holds a name; /dev/shm holds none of them.
    for path in work.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(h.encode() in data for h in hexes), path
    assert not names & set(os.listdir("/dev/shm"))
