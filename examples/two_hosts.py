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
the two torchruns'. The namespaces are removed at the end, also after an error. ``--link 10gbit`` limits the
link between the machines to that rate (a token bucket on each end), as a real cluster's
link is slower than memory. The machines themselves: ringcoll/harness/hosts.py.

Everything after the options is torchrun's script (or ``-m module``) and its arguments.
"""

from __future__ import annotations

import argparse
import os
import sys

from ringcoll.harness.hosts import TwoHosts, parse_link

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     usage="%(prog)s [--nproc-per-node N] [--port P] [--link RATE[,DELAY]] "
                                           "script-or--m ... args")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--port", type=int, default=29631, help="torchrun's rendezvous port on machine 0")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--link", default=None, help="the link's rate each way, as tc writes it (10gbit); a delay "
                                                     "after a comma (10gbit,30us) needs the kernel's netem qdisc")
    args, job = parser.parse_known_args()
    if not job:
        parser.error("give the torchrun script (or -m module) to run")
    try:
        link = parse_link(args.link) if args.link else None
    except ValueError as e:
        parser.error(str(e))
    with TwoHosts(os.getpid()) as hosts:
        if link:
            hosts.shape(*link)
        status, outputs = hosts.torchrun(job, args.nproc_per_node, args.port, args.timeout, cwd=ROOT)
    for host, out in enumerate(outputs):
        print(f"=== machine {host} ===")
        print(out, end="" if out.endswith("\n") else "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
