"""bench/device_check.sh's plan, without a GPU: `--plan` prints every stage with its cap, its
tier and what it runs, from the very table the script runs by. The device loan is 15
minutes, the machine's start included, and one command may run 10, so the budget is held
here, as sums of caps:

    normal case = the core stages (every run makes them; --core runs nothing else): <= 300 s
    hard stop   = every stage, the extras (features, exhaustive) included:          <= 480 s

and the stages come in the order of what they answer. Raising a cap past either sum fails
here, and the script itself then refuses to start.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "device_check.sh"
NORMAL_S, HARD_S = 300, 480
ORDER = ["build", "smoke", "backend", "bench", "features", "exhaustive", "wrapup"]
CORE = {"build", "smoke", "backend", "bench", "wrapup"}
STAGE_LINE = re.compile(r"^  (\S+)\s+(\d+) s  (core|extra)\s+(.+)$")
RUN_LINE = re.compile(r"^      - (\S+) \((\d+) s\): (in-process|multi-process) P=(\d+), (.+)$")


def plan(script=SCRIPT, tmp_path=None):
    env = dict(os.environ, OUT=str(tmp_path / "out")) if tmp_path else None
    return subprocess.run(["bash", str(script), "--plan"], capture_output=True, text=True, timeout=30, env=env,
                          cwd=tmp_path)


def parse(text):
    stages, runs = [], []
    for line in text.splitlines():
        if m := STAGE_LINE.match(line):
            stages.append((m[1], int(m[2]), m[3], m[4]))
        elif m := RUN_LINE.match(line):
            runs.append((m[1], int(m[2]), m[3], int(m[4])))
    return stages, runs


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True).returncode == 0


def test_plan_is_within_budget_in_order_and_builds_nothing(tmp_path):
    done = plan(tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    stages, runs = parse(done.stdout)
    assert [s[0] for s in stages] == ORDER, done.stdout
    assert {name for name, _, tier, _ in stages if tier == "core"} == CORE
    core = sum(cap for name, cap, tier, _ in stages if tier == "core")
    every = sum(cap for _, cap, _, _ in stages)
    assert core <= NORMAL_S and every <= HARD_S, (core, every)
    assert f"normal case (the core stages): {core} s of at most {NORMAL_S}" in done.stdout
    assert f"hard stop (every stage): {every} s of at most {HARD_S}" in done.stdout
    # Printing the plan runs nothing: no output folder, no build, no log.
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []
    # The bench stage's runs: in-process P = 2, 4, 8, then multi-process P = 2, within its cap.
    assert [(mode, nproc) for _, _, mode, nproc in runs] == [("in-process", 2), ("in-process", 4),
                                                               ("in-process", 8), ("multi-process", 2)]
    assert sum(share for _, share, _, _ in runs) <= dict((s[0], s[1]) for s in stages)["bench"]


def test_each_stage_names_what_it_runs():
    stages, _ = parse(plan().stdout)
    what = {name: text for name, _, _, text in stages}
    exhaustive = re.search(r"-k '([^']+)'", what["exhaustive"])[1]
    expected = {
        "build": ["setup.py build_ext", "sm_90"],
        "smoke": ["bench/cuda_smoke.py", "--parts multi-process", "--parts in-process",
                  "RINGCOLL_CUDA_FLAG_SCOPE=system"],
        "backend": ["pytest tests/gpu/test_backend_cuda.py"],
        "bench": ["ringcoll-bench --device cuda", "-e 64M", "--rows-file"],
        "features": ["pytest tests/gpu/test_cuda.py", f"-k 'not ({exhaustive})'"],
        "exhaustive": ["pytest tests/gpu/test_cuda.py"],
        "wrapup": ["MPS", "summary"],
    }
    for name, needles in expected.items():
        for needle in needles:
            assert needle in what[name], (name, needle, what[name])
    # multi-process first, then in-process, and the named files exist
    assert what["smoke"].index("--parts multi-process") < what["smoke"].index("--parts in-process")
    for path in ("bench/cuda_smoke.py", "tests/gpu/test_backend_cuda.py", "tests/gpu/test_cuda.py", "setup.py"):
        assert (ROOT / path).exists(), path


def test_the_exhaustive_stage_names_the_tests_its_keywords_select():
    """The exhaustive stage names its tests (to order them), the features stage excludes them
    by keyword: the two must mean the same tests, or one would be run twice or never."""
    script = SCRIPT.read_text()
    keywords = re.search(r'^EXHAUSTIVE="([^"]+)"', script, re.M)[1].split(" or ")
    named = re.search(r"^EXHAUSTIVE_TESTS=\(([^)]*)\)", script, re.M)[1].split()
    tests = re.findall(r"^def (test_\w+)", (ROOT / "tests/gpu/test_cuda.py").read_text(), re.M)
    by_keyword = {name for name in tests if any(k in name for k in keywords)}
    assert sorted(entry.split("::")[1] for entry in named) == sorted(by_keyword), (named, by_keyword)
    assert all(entry.startswith("tests/gpu/test_cuda.py::") for entry in named), named


def test_header_table_matches_the_plan():
    """The comment at the top of the script repeats the caps: it must stay true."""
    stages, _ = parse(plan().stdout)
    header = SCRIPT.read_text().split("\nset -uo pipefail", 1)[0]
    in_header = [(m[1], int(m[2]), m[3]) for m in re.finditer(r"^#   (\w+)\s+(\d+)  (core|extra)  ", header, re.M)]
    assert in_header == [(name, cap, tier) for name, cap, tier, _ in stages]


@pytest.mark.parametrize("old, new", [
    ("features  120", "features  121"),   # every stage: 481 s
    ("smoke      50", "smoke      51"),   # the core: 301 s
    ("mp_p2       18", "mp_p2       19"),  # the bench runs: 61 s in a 60 s stage
])
def test_a_cap_over_budget_is_refused(tmp_path, old, new):
    text = SCRIPT.read_text()
    assert text.count(old) == 1, old
    copy = tmp_path / "bench" / "device_check.sh"
    copy.parent.mkdir()
    copy.write_text(text.replace(old, new))
    done = plan(copy)
    assert done.returncode != 0 and "OVER BUDGET" in done.stdout, done.stdout
    stages, runs = parse(done.stdout)
    core = sum(cap for _, cap, tier, _ in stages if tier == "core")
    bench = dict((s[0], s[1]) for s in stages)["bench"]
    assert (core > NORMAL_S or sum(s[1] for s in stages) > HARD_S
            or sum(share for _, share, _, _ in runs) > bench)
