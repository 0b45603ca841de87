"""Run an example script the way the README does: torchrun, 2 ranks, a free port."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_example(script: str, *options: str, epochs: int = 3) -> str:
    """Run examples/<script> under torchrun (--standalone: a free port, not 29500) and check
    what every example promises: it exits 0, the loss falls, all ranks end identical.
    Returns its stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGCOLL_")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           os.path.join(ROOT, "examples", script), "--epochs", str(epochs), *options],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert len(losses) == epochs and losses[-1] < losses[0], proc.stdout
    assert "parameters identical on all 2 ranks: True" in proc.stdout, proc.stdout
    return proc.stdout
