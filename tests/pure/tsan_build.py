"""Build a sanitizer check (tests/pure/sanitize/*.cpp) with the emulator under ThreadSanitizer
and run it: the shared part of the tests that use one."""

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_under_tsan(tmp_path, source: str, runs: int = 1) -> list[str]:
    """Build tests/pure/sanitize/`source` with the emulator's sources, run it `runs` times;
    returns each run's stdout, having asserted that TSan reported nothing and it exited 0."""
    compiler = shutil.which("g++")
    assert compiler, "g++ is needed to build the sanitizer check"
    binary = tmp_path / Path(source).stem
    # -Wno-tsan: TSan does not model fences, which only the descriptor's sequence lock uses;
    # every word that lock guards is a C++ atomic, so TSan has nothing to misreport there.
    build = subprocess.run(
        [compiler, "-std=c++20", "-O1", "-g", "-fsanitize=thread", "-Wno-tsan", f"-I{ROOT / 'csrc/include'}",
         str(ROOT / "tests/pure/sanitize" / source), str(ROOT / "csrc/emulation/emulated_ring.cpp"),
         str(ROOT / "csrc/emulation/emulated_streams.cpp"), "-o", str(binary)],
        capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-4000:]
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1 exitcode=66")
    outputs = []
    for _ in range(runs):
        run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300, env=env)
        assert "ThreadSanitizer" not in run.stderr, run.stderr[-6000:]
        assert run.returncode == 0, run.stdout + run.stderr[-2000:]
        outputs.append(run.stdout)
    return outputs
