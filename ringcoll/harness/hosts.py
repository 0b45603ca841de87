"""Two simulated machines on this one (needs root and iproute2): what examples/two_hosts.py,
``ringcoll-bench --hosts 2`` and the two-host tests run on.

Each "machine" is a network namespace of its own (``ip netns``; the two are joined by a
veth pair, 10.231.N.1 and 10.231.N.2, so the traffic between them crosses a network
interface), in a mount and IPC namespace of its own with a private tmpfs on /dev/shm (so
its ranks cannot map the other machine's shared memory, as on two real machines), with a
host name of its own. The file system is shared (a job's files can be read by both).

A real cluster's link between machines is slower than memory inside one; the veth moves
data at memory speed. ``shape(rate)`` limits each end's sending rate with a token bucket
(``tc qdisc ... tbf``), so the two levels of a hierarchical collective meet the ratio
they are built for. A delay needs the kernel's netem qdisc (CONFIG_NET_SCH_NETEM); where
the kernel has none, ``shape`` says so rather than run unshaped.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from typing import Optional

HOSTS = 2


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


RATE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(text: str) -> float:
    """'10gbit', '2.5Gbit', '800mbit' -> bits per second (tc's units, decimal)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", text.strip().lower())
    if not match:
        raise ValueError(f"link rate {text!r}: give it as tc does, e.g. 10gbit, 2.5gbit, 800mbit")
    return float(match.group(1)) * RATE_UNITS[match.group(2)]


def parse_delay(text: str) -> float:
    """'30us', '0.5ms' -> seconds."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(us|ms)", text.strip().lower())
    if not match:
        raise ValueError(f"link delay {text!r}: give it as tc does, e.g. 30us, 0.5ms")
    return float(match.group(1)) * (1e-6 if match.group(2) == "us" else 1e-3)


def parse_link(text: str) -> tuple[float, float]:
    """'10gbit' or '10gbit,30us' -> (bits per second, delay in seconds)."""
    rate, _, delay = text.partition(",")
    return parse_rate(rate), parse_delay(delay) if delay else 0.0


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


class TwoHosts:
    """Two network namespaces joined by a veth pair (context manager: removed on exit)."""

    def __init__(self, tag: int):
        self.subnet = tag % 250 + 1
        self.namespaces = [f"ringcoll-host{i}-{tag}" for i in range(HOSTS)]
        self.interfaces = [f"rc{tag % 100000}h{i}" for i in range(HOSTS)]  # at most 15 characters
        self.addresses = [f"10.231.{self.subnet}.{i + 1}" for i in range(HOSTS)]
        self.link = "unshaped (veth: memory speed)"

    def __enter__(self) -> "TwoHosts":
        # SIGTERM (a CI timeout, `kill`) would end the process without running __exit__ and
        # leave the namespaces behind: raised as SystemExit instead, so they are removed.
        self._previous_sigterm = None
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            for ns in self.namespaces:
                _ip("netns", "add", ns)
            _ip("link", "add", self.interfaces[0], "type", "veth", "peer", "name", self.interfaces[1])
            for ns, interface, address in zip(self.namespaces, self.interfaces, self.addresses):
                _ip("link", "set", interface, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", interface)
                _ip("-n", ns, "link", "set", interface, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as e:
            self.__exit__()
            raise RuntimeError(f"cannot make the two simulated machines ({' '.join(e.cmd)}: "
                               f"{e.stderr.strip()}); this needs root and iproute2") from e
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.namespaces:  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def shape(self, rate_bits: float, delay_s: float = 0.0) -> None:
        """Each machine sends at most `rate_bits` per second (and, with a delay, each packet
        waits `delay_s` before it leaves). The token bucket's burst is one timer tick's worth
        of bytes (HZ = 250 here: at 10 Gbit/s, 5 MB), or it could not reach the rate."""
        burst = max(64 << 10, int(rate_bits / 8 / 250))
        for ns, interface in zip(self.namespaces, self.interfaces):
            tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", interface, "root"]
            if delay_s:
                cmd = [*tc, "netem", "delay", f"{delay_s * 1e6:g}us", "rate", f"{rate_bits:g}bit"]
            else:
                cmd = [*tc, "tbf", "rate", f"{rate_bits:g}bit", "burst", str(burst), "latency", "10ms"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                why = done.stderr.strip()
                if delay_s and "unknown" in why.lower():
                    why += ("; this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so no delay can be added "
                            "here: shape the rate alone")
                raise RuntimeError(f"cannot shape the link ({' '.join(cmd)}): {why}")
        self.link = f"{rate_bits / 1e9:g} Gbit/s each way" + (f", {delay_s * 1e6:g} us delay" if delay_s else "") \
            + (" (tc netem)" if delay_s else " (tc tbf)")

    def command(self, host: int, argv: list) -> list:
        """`argv` run on machine `host`: in its network namespace, with its own /dev/shm and
        its own host name (ringcoll-host0, ringcoll-host1: what messages call the machines)."""
        private = f'mount -t tmpfs -o size=1g ringcoll-shm /dev/shm && hostname ringcoll-host{host} && exec "$@"'
        return ["ip", "netns", "exec", self.namespaces[host], "unshare", "--mount", "--ipc", "--uts", "--propagation",
                "private", "sh", "-c", private, "sh", *argv]

    def torchrun(self, job: list, nproc_per_node: int = 2, port: int = 29631, timeout: float = 600,
                 env: Optional[dict] = None, cwd: Optional[str] = None) -> tuple[int, list]:
        """Run torchrun `job` (a script and its arguments, or -m module ...) on both machines,
        ``torchrun --nnodes 2 --node-rank i --nproc-per-node N --master-addr <machine 0>``:
        exactly what one types on two real machines. (worst exit status, [output of each])."""
        env = dict(os.environ if env is None else env)
        procs = []
        for host in range(HOSTS):
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(HOSTS), "--node-rank", str(host),
                        "--nproc-per-node", str(nproc_per_node), "--master-addr", self.addresses[0],
                        "--master-port", str(port), *job]
            # gloo (ringcoll's between-machines level) binds to this machine's interface.
            host_env = {**env, "GLOO_SOCKET_IFNAME": self.interfaces[host]}
            procs.append(subprocess.Popen(self.command(host, torchrun), cwd=cwd, env=host_env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outputs = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                out, _ = proc.communicate()
                out += f"\n[two hosts: killed after {timeout:g} s]"
            outputs.append(out)
        return max(abs(p.returncode) for p in procs), outputs


def run(job: list, nproc_per_node: int = 2, port: int = 29631, timeout: float = 600,
        env: Optional[dict] = None, cwd: Optional[str] = None) -> tuple[int, list]:
    """torchrun `job` on two fresh machines, removed afterwards (TwoHosts.torchrun)."""
    with TwoHosts(os.getpid()) as hosts:
        return hosts.torchrun(job, nproc_per_node, port, timeout, env, cwd)
