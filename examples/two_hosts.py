"""Run a torchrun job over two simulated machines on this one (needs root).

    sudo python examples/two_hosts.py examples/train_ddp.py --epochs 3
    sudo python examples/two_hosts.py examples/train_zero.py
    sudo python examples/two_hosts.py -m ringcoll.harness.backend_check
    sudo python examples/two_hosts.py --nproc-per-node 3 examples/train_ddp.py

Each "machine" is a network namespace of its own (``ip netns``; the two are joined by a
veth pair, 10.231.N.1 and 10.231.N.2, so the traffic between them crosses a network
interface), in a mount and IPC namespace of its own with a private tmpfs on /dev/shm (so
its ranks cannot map the other machine's shared memory, as on two real machines). On each,
``torchrun --nnodes 2 --node-rank i --nproc-per-node N --master-addr 10.231.N.1`` starts
the job's ranks: exactly what one types on two real machines, where the namespaces are not
needed. The job's output is printed machine by machine; the exit status is the worse of
the two torchruns'. The namespaces are removed at the end, also after an error.

Everything after the options is torchrun's script (or ``-m module``) and its arguments.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class TwoHosts:
    """Two network namespaces joined by a veth pair (context manager: removed on exit)."""

    def __init__(self, tag: int):
        self.subnet = tag % 250 + 1
        self.namespaces = [f"ringcoll-host{i}-{tag}" for i in range(2)]
        self.interfaces = [f"rc{tag % 100000}h{i}" for i in range(2)]  # at most 15 characters
        self.addresses = [f"10.231.{self.subnet}.{i + 1}" for i in range(2)]

    def __enter__(self) -> "TwoHosts":
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

    def command(self, host: int, argv: list) -> list:
        """`argv` run on machine `host`: in its network namespace, with its own /dev/shm and
        its own host name (ringcoll-host0, ringcoll-host1: what messages call the machines)."""
        private = f'mount -t tmpfs -o size=1g ringcoll-shm /dev/shm && hostname ringcoll-host{host} && exec "$@"'
        return ["ip", "netns", "exec", self.namespaces[host], "unshare", "--mount", "--ipc", "--uts", "--propagation",
                "private", "sh", "-c", private, "sh", *argv]


def run(job: list, nproc_per_node: int = 2, port: int = 29631, timeout: float = 600,
        env: dict | None = None) -> tuple[int, list]:
    """Run torchrun `job` on the two machines (environment `env`, default this one's);
    (worst exit status, [output of each])."""
    env = dict(os.environ if env is None else env)
    with TwoHosts(os.getpid()) as hosts:
        procs = []
        for host in range(2):
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(host),
                        "--nproc-per-node", str(nproc_per_node), "--master-addr", hosts.addresses[0],
                        "--master-port", str(port), *job]
            # gloo (ringcoll's between-machines level) binds to this machine's interface.
            host_env = {**env, "GLOO_SOCKET_IFNAME": hosts.interfaces[host]}
            procs.append(subprocess.Popen(hosts.command(host, torchrun), cwd=ROOT, env=host_env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outputs = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                out, _ = proc.communicate()
                out += f"\n[two_hosts: killed after {timeout:g} s]"
            outputs.append(out)
        return max(abs(p.returncode) for p in procs), outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     usage="%(prog)s [--nproc-per-node N] [--port P] script-or--m ... args")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--port", type=int, default=29631, help="torchrun's rendezvous port on machine 0")
    parser.add_argument("--timeout", type=float, default=600)
    args, job = parser.parse_known_args()
    if not job:
        parser.error("give the torchrun script (or -m module) to run")
    status, outputs = run(job, args.nproc_per_node, args.port, args.timeout)
    for host, out in enumerate(outputs):
        print(f"=== machine {host} ===")
        print(out, end="" if out.endswith("\n") else "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
