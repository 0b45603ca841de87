"""Build a sanitizer check (tests/pure/sanitize/*.cpp) with the emulator under ThreadSanitizer
and run it: the shared part of the tests that use one."""

import atexit
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# -Wno-tsan: TSan does not model fences, which only the descriptor's sequence lock uses;
# every word that lock guards is a C++ atomic, so TSan has nothing to misreport there.
# -g1: functions and line tables, all a TSan report prints (full -g added a quarter to the
# emulator's build, 32 s against 25 on the 2-core CI machine).
FLAGS = ["-std=c++20", "-O1", "-g1", "-fsanitize=thread", "-Wno-tsan", f"-I{ROOT / 'csrc/include'}"]
# Each kernel in a file of its own (instantiated for every dtype and op), so the two cores
# build the emulator side by side.
EMULATOR = ["csrc/emulation/emulated_ring.cpp", "csrc/emulation/emulated_ring_kernel.cpp",
            "csrc/emulation/emulated_plan_kernel.cpp", "csrc/emulation/emulated_streams.cpp"]
_objects: list = []  # the emulator compiled once per test session


def _compiler() -> str:
    compiler = shutil.which("g++")
    assert compiler, "g++ is needed to build the sanitizer check"
    return compiler


def _emulator_objects() -> list:
    """The emulator's sources compiled under TSan, side by side, once per session."""
    if not _objects:
        folder = Path(tempfile.mkdtemp(prefix="ringcoll-tsan-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        targets = [folder / (Path(src).stem + ".o") for src in EMULATOR]
        builds = [subprocess.Popen([_compiler(), *FLAGS, "-c", str(ROOT / src), "-o", str(obj)],
                                   stderr=subprocess.PIPE, text=True) for src, obj in zip(EMULATOR, targets)]
        for src, build in zip(EMULATOR, builds):
            _, err = build.communicate(timeout=600)
            assert build.returncode == 0, f"{src}: {err[-4000:]}"
        _objects.extend(targets)
    return list(_objects)


def run_under_tsan(tmp_path, source: str, runs: int = 1) -> list[str]:
    """Build tests/pure/sanitize/`source` with the emulator's sources, run it `runs` times;
    returns each run's stdout, having asserted that TSan reported nothing and it exited 0."""
    binary = tmp_path / Path(source).stem
    build = subprocess.run(
        [_compiler(), *FLAGS, str(ROOT / "tests/pure/sanitize" / source), *map(str, _emulator_objects()),
         "-o", str(binary)],
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
