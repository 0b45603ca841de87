#!/usr/bin/env bash
# device_check.sh: the one command a session lent a GPU machine runs (see the device tool's
# README). A loan is 15 minutes of device time, the machine's start included, and one command
# may run 10, so this one is sized to leave room for a second run. `--plan` prints its stages,
# in the order of what they answer, with each one's cap and what it runs (no GPU needed; it
# builds and runs nothing):
#
#   stage       cap  tier   runs
#   build        90  core   setup.py build_ext (sm_90, CUDA required); meanwhile the machine's
#                           details: nvidia-smi, versions, MPS (started; does a CUDA process
#                           really run under it), a CUDA probe
#   smoke        50  core   bench/cuda_smoke.py: multi-process, then in-process, both kernel
#                           variants; then multi-process again with RINGCOLL_CUDA_FLAG_SCOPE=system
#   backend      90  core   pytest tests/gpu/test_backend_cuda.py (torch.distributed, DDP, ZeRO)
#   bench        60  core   ringcoll-bench --device cuda, 16K to 64M: in-process P = 2, 4, 8,
#                           then multi-process P = 2, each run with its own share of the 60 s
#   features    120  extra  bench/cuda_error_probe.py (do C++ errors reach Python; a native stack
#                           for a case that dies), then pytest tests/gpu/test_cuda.py less the
#                           exhaustive tests
#   exhaustive   60  extra  pytest tests/gpu/test_cuda.py's exhaustive tests (every dtype x op x size)
#   wrapup       10  core   MPS stopped if it was started; the summary
#
# Budget. Each command of a stage gets its share of the stage, cut to what the stage has left
# less the GRACE_S its kill may take, so no stage outlasts its cap and the caps bound the
# whole run. Their sums, which the script checks before it starts (and
# tests/pure/test_device_check.py checks too):
#   normal case = the core stages, which every run makes:            at most 300 s
#   hard stop   = every stage, the extras (features, exhaustive) too: at most 480 s
# `--core` skips the extras, so the whole command ends within 5 minutes (a rerun, or a loan
# with little time left). A stage whose prerequisite failed is skipped, with one line saying
# why: every stage after the build needs the build and a GPU; backend needs the multi-process
# smoke; each bench run needs the smoke of its mode; features and exhaustive either smoke.
# The smoke's and the benchmark's rings time out after 10 s, so a hang there costs seconds
# (and says where it hung) instead of the stage.
#
# What comes back (files under $OUT, default ./out; a loan returns at most 8), each written as
# its stage goes, so a stage cut at its cap still leaves what it did:
#   device_check.log   all printed here: the plan, each stage's key lines, the summary
#   build.log          the build's output
#   smoke.log          cuda_smoke.py's output
#   tests.log          pytest's output for backend, features, exhaustive (tracebacks, durations)
#   errors.log         cuda_error_probe.py's output (features)
#   bench.log          ringcoll-bench's output: a line per row as it is measured, then the tables
#   bench_rows.jsonl   every row as one JSON line, appended as it is measured (--rows-file);
#                      a {"kind": "run", ...} line before each run says which run follows
#
# Exit status: 0 when every stage ran and passed, 1 when one failed or was cut, 2 without a
# GPU (1 if the rehearsal failed). Without a GPU (a dry run: OUT=/tmp/dc_out bash
# bench/device_check.sh) it prints the plan, builds, describes the machine, then rehearses the
# later stages' commands on the CPU (the smoke script on the shared-memory ring, the
# benchmark's command line at small sizes, the error probe's CPU cases, each test stage's
# selection collected) and stops, saying there is no GPU: about 45 s after a warm build.
set -uo pipefail

# --- the plan -----------------------------------------------------------------------------
CORE_S=300    # the core stages' caps add up to at most this: the normal case
HARD_S=480    # all caps add up to at most this: the hard stop (the device tool allows 600 a command)
GRACE_S=5     # a command stopped at its limit is killed this much later, still inside its stage
RING_TIMEOUT=10  # seconds, for every ring: a hang costs this, and says where it hung
REHEARSAL_S=60  # without a GPU (a dry run), a CPU rehearsal instead of the stages after the build
EXHAUSTIVE="collectives_exact or every_dtype or larger_than_buffer"
STAGES=(
  # name     cap  tier   what it runs
  "build      90  core   python setup.py build_ext --inplace, sm_90, CUDA required (build.log); meanwhile nvidia-smi, versions, MPS, a CUDA probe"
  "smoke      50  core   bench/cuda_smoke.py (smoke.log): --parts multi-process, then --parts in-process, both variants; then RINGCOLL_CUDA_FLAG_SCOPE=system bench/cuda_smoke.py --parts multi-process --variants fused"
  "backend    90  core   pytest tests/gpu/test_backend_cuda.py -k 'not symmetric' (tests.log)"
  "bench      60  core   ringcoll-bench --device cuda -b 16K -e 64M -f 8 --rows-file (bench.log, bench_rows.jsonl), its runs below"
  "features  120  extra  bench/cuda_error_probe.py (errors.log), then pytest tests/gpu/test_cuda.py -k 'not ($EXHAUSTIVE)' (tests.log)"
  "exhaustive 60  extra  pytest tests/gpu/test_cuda.py -k '$EXHAUSTIVE', the in-process ones first (tests.log)"
  "wrapup     10  core   stop MPS if it was started; the summary"
)
# The bench stage's runs, in order, each with its share of the stage's cap. Buffers: the
# CUDA default at P = 2 and 4 (16 MiB x P, whose slots give a large message a block per SM:
# docs/cuda.md, "What the fused kernel should reach"), the same in both modes at P = 2 (the
# two differ only in the mode); 64 MiB at P = 8. (The first run, 2026-12-04, used 4 MiB at
# P = 2: 64 MiB all-reduces moved 133 GB/s of bus bandwidth, in 64 slices of ~8 us each.)
# In-process first: its rings are co-resident whatever MPS does.
BENCH_RUNS=(
  # name     share  P  buffer  mode
  "inproc_p2   13   2  32MiB   in-process"
  "inproc_p4   14   4  64MiB   in-process"
  "inproc_p8   15   8  64MiB   in-process"
  "mp_p2       18   2  32MiB   multi-process"
)
# Without the symmetric-memory tests (ZeRO's buckets, the bench's --symmetric: ~25 s more),
# which would push the stage past its cap (67 s of 85 on 2026-12-04): a full GPU run has them.
BACKEND_TESTS=(tests/gpu/test_backend_cuda.py -k "not symmetric")
FEATURE_TESTS=(tests/gpu/test_cuda.py -k "not ($EXHAUSTIVE)")
# The same tests as -k "$EXHAUSTIVE" selects, named so that they run in this order: the
# in-process ones first (on 2026-12-04 the stage's cap came before they did; at P = 4 and 8
# they have not passed on a GPU yet).
EXHAUSTIVE_TESTS=(tests/gpu/test_cuda.py::test_in_process_collectives_exact tests/gpu/test_cuda.py::test_collectives_exact
                  tests/gpu/test_cuda.py::test_every_dtype_and_op tests/gpu/test_cuda.py::test_larger_than_buffer)

cap_of() {  # a stage's cap
  local line name cap
  for line in "${STAGES[@]}"; do
    read -r name cap _ <<<"$line"
    if [ "$name" = "$1" ]; then echo "$cap"; return; fi
  done
}
sum_caps() {  # sets CORE_SUM, ALL_SUM, BENCH_SHARES
  local line name cap tier share
  CORE_SUM=0 ALL_SUM=0 BENCH_SHARES=0
  for line in "${STAGES[@]}"; do
    read -r name cap tier _ <<<"$line"
    ALL_SUM=$((ALL_SUM + cap))
    if [ "$tier" = core ]; then CORE_SUM=$((CORE_SUM + cap)); fi
  done
  for line in "${BENCH_RUNS[@]}"; do
    read -r name share _ <<<"$line"
    BENCH_SHARES=$((BENCH_SHARES + share))
  done
}
plan() {
  local line run name cap tier what share nproc buffer mode
  echo "device_check plan: the stages in order; cap (s), tier (core: every run; extra: not with --core), what it runs"
  for line in "${STAGES[@]}"; do
    read -r name cap tier what <<<"$line"
    printf '  %-10s %3d s  %-5s  %s\n' "$name" "$cap" "$tier" "$what"
    if [ "$name" = bench ]; then
      for run in "${BENCH_RUNS[@]}"; do
        read -r name share nproc buffer mode <<<"$run"
        printf '      - %s (%d s): %s P=%d, RINGCOLL_BUFFER_BYTES=%s\n' "$name" "$share" "$mode" "$nproc" "$buffer"
      done
    fi
  done
  echo "  (without a GPU: a CPU rehearsal of the later stages' commands, ${REHEARSAL_S} s at most, instead of them)"
  sum_caps
  echo "  normal case (the core stages): ${CORE_SUM} s of at most ${CORE_S}; hard stop (every stage): ${ALL_SUM} s of at most ${HARD_S}"
}
within_budget() {
  sum_caps
  local bench_cap; bench_cap=$(cap_of bench)
  if (( CORE_SUM > CORE_S || ALL_SUM > HARD_S || BENCH_SHARES > bench_cap )); then
    echo "device_check: OVER BUDGET: core ${CORE_SUM} s (at most ${CORE_S}), all ${ALL_SUM} s (at most ${HARD_S}), bench runs ${BENCH_SHARES} s (at most ${bench_cap})"
    return 1
  fi
}

CORE_ONLY=0
case "${1:-}" in
  --plan) plan; within_budget; exit ;;
  --core) CORE_ONLY=1 ;;
  "") ;;
  *) echo "usage: bash bench/device_check.sh [--plan | --core]"; exit 2 ;;
esac
within_budget || exit 2

# --- the run ------------------------------------------------------------------------------
# Before anything here initialises CUDA: the in-process mode puts P ranks x 2 streams on one
# GPU, and by default the driver spreads a process's streams over 8 hardware queues, each
# run in order. One rank's stream-ordered wait, queued in the same queue ahead of a peer's
# ring kernel, holds that kernel back while the wait itself needs the ring to move: a
# deadlock until the ring's timeout. 32 (the most there is) gives each of P = 8 ranks'
# 16 streams a queue of its own.
export CUDA_DEVICE_MAX_CONNECTIONS=32

cd "$(dirname "$0")/.." || exit 2
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
rm -f "$OUT"/{smoke,tests,bench,errors}.log "$OUT/bench_rows.jsonl"  # appended to below: none of an earlier run's
PY="${PYTHON:-python3}"
# The tests and the ranks they spawn import this checkout's ringcoll, built in place.
# PYTHONFAULTHANDLER: a Python process that dies of a signal (a rank, a torchrun child)
# prints every thread's stack first, so a crash says where it happened.
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec > >(tee "$OUT/device_check.log") 2>&1
tee_pid=$!
T0=$SECONDS
plan

declare -a SUMMARY=()
failed=0 stage="" stage_t0=0 stage_end=0
begin() {  # name [cap]: the stage starts; its commands share its cap (from STAGES unless given)
  local cap=${2:-$(cap_of "$1")}
  stage=$1 stage_t0=$SECONDS stage_end=$((SECONDS + cap))
  echo; echo "=== $1 (cap ${cap} s, at $((SECONDS - T0)) s)"
}
end() {  # ok | cut (...) | FAILED (...)
  local line="$stage: $1 in $((SECONDS - stage_t0)) s"
  SUMMARY+=("$line"); echo "=== $line"
  case "$1" in ok*) ;; *) failed=1 ;; esac
}
skip() {  # name, why
  SUMMARY+=("$1: skipped ($2)"); echo; echo "=== $1: skipped ($2)"
}
upto() {  # the seconds a command may run now: its share, cut to what the stage has left
  local left=$((stage_end - SECONDS - GRACE_S))
  if (( left < $1 )); then echo $(( left > 1 ? left : 1 )); else echo "$1"; fi
}
outcome() {  # a command's exit status as a stage's or run's word
  case "$1" in 0) echo ok ;; 124|137) echo "cut at its limit" ;; *) echo "FAILED (exit $1)" ;; esac
}
note() {  # file, text: the text here and in $OUT/file
  echo "$2"; echo "$2" >> "$OUT/$1"
}
show() {  # file, pattern, command...: its output appended to $OUT/file as it comes, the lines
          # matching pattern shown here too; the command's exit status
  local file=$1 pattern=$2; shift 2
  "$@" 2>&1 | tee -a "$OUT/$file" | grep --line-buffered -E "$pattern"
  return "${PIPESTATUS[0]}"
}

mps_started=0
stop_mps() {  # bounded: a control daemon that does not answer must not hold the machine
  [ "$mps_started" = 1 ] || return 0
  mps_started=0
  if timeout 8 sh -c 'echo quit | nvidia-cuda-mps-control'; then echo "== MPS stopped"
  else echo "== MPS did not stop within 8 s (left running)"; fi
}
# shellcheck disable=SC2317  # (run by the EXIT trap)
finish() {  # the wrapup stage: MPS stopped, the summary, then (bounded) time for tee's last lines
  local rc=$?
  [ -n "${build_pid:-}" ] && kill "$build_pid" 2>/dev/null  # timeout passes it on to the build
  begin wrapup
  stop_mps
  echo
  echo "=== summary ($((SECONDS - T0)) s in all)"
  for line in "${SUMMARY[@]}"; do echo "  $line"; done
  echo "=== exit status $rc"
  exec >&- 2>&-
  for _ in $(seq 30); do kill -0 "$tee_pid" 2>/dev/null || return 0; sleep 0.1; done
}
trap finish EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

# --- stage: build (and the machine, while it builds) --------------------------------------
begin build
# CMake finds nvcc only on PATH or through $CUDACXX / $CUDA_PATH, so look where toolkits
# usually live when it is not on PATH. Likewise cmake and ninja may be pip packages beside
# this Python, outside PATH.
if ! command -v nvcc >/dev/null 2>&1; then
  for nvcc in "${CUDA_HOME:-/nonexistent}/bin/nvcc" "${CUDA_PATH:-/nonexistent}/bin/nvcc" /usr/local/cuda/bin/nvcc \
              $(printf '%s\n' /usr/local/cuda-*/bin/nvcc | sort -V -r) /opt/cuda/bin/nvcc; do
    if [ -x "$nvcc" ]; then CUDACXX="$nvcc" PATH="${nvcc%/nvcc}:$PATH"; export CUDACXX PATH; break; fi
  done
fi
py_bin="$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))' 2>/dev/null)"
for tool in cmake ninja; do
  command -v "$tool" >/dev/null 2>&1 || { [ -x "$py_bin/$tool" ] && export PATH="$PATH:$py_bin"; }
done
# In place, with the machine's own setuptools/pybind11/cmake/ninja: nothing is installed into
# its Python (no downloads there). RelWithDebInfo keeps the symbols (a Release build of a
# pybind11 module is stripped), so a native backtrace names ringcoll's functions; the
# kernels are optimised as in Release (nvcc's device code is not affected by -g). timeout
# runs it in a process group of its own and stops all of it at the limit. It runs in the
# background while the machine is described.
timeout -k "$GRACE_S" "$(upto "$(cap_of build)")" \
  env CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" RINGCOLL_CUDA_ARCHS=90 RINGCOLL_REQUIRE_CUDA=1 RINGCOLL_BUILD_TYPE=RelWithDebInfo \
  "$PY" setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 &
build_pid=$!

echo "== $(date -u +%FT%TZ) $(uname -srm), $(nproc) cores; CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS"
if command -v nvidia-smi >/dev/null 2>&1; then
  gpu_line=$(timeout "$(upto 15)" nvidia-smi --query-gpu=name,driver_version,compute_mode,memory.total,clocks.max.sm \
             --format=csv,noheader 2>&1 | head -1)
  echo "nvidia-smi: ${gpu_line:-no answer within 15 s}"
  # Exclusive_Process lets one process at a time hold the GPU (unless MPS serves them all):
  # without MPS the multi-process ring cannot even start then; the in-process one can.
  case "$gpu_line" in *Exclusive*|*Prohibited*)
    echo "NOTE: that compute mode keeps processes from sharing this GPU without MPS" ;; esac
else
  echo "no nvidia-smi on PATH"
fi
echo "nvcc: $(command -v nvcc || echo 'not found') ($(nvcc --version 2>/dev/null | tail -1))${CUDACXX:+, CUDACXX=$CUDACXX}"
echo "cmake: $(cmake --version 2>/dev/null | head -1 || echo 'not found'); ninja: $(ninja --version 2>/dev/null || echo 'not found'); c++: $(c++ --version 2>/dev/null | head -1 || echo 'not found')"
timeout "$(upto 30)" "$PY" - <<'EOF' || echo "python/torch did not report in time"
import importlib, sys
import torch
mods = []
for name in ("cupy", "pytest", "pytest_timeout", "pybind11"):
    try:
        m = importlib.import_module(name)
        mods.append(f"{name} {getattr(m, '__version__', '?')}")
    except Exception:
        mods.append(f"{name} MISSING")
print(f"python {sys.version.split()[0]} ({sys.executable}); torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else '-'}; "
      + "; ".join(mods))
EOF

# The probe: a CUDA process that creates a context, runs a kernel, and says which module
# loading mode the driver applies (CUDA_MODULE_LOADING unset means LAZY since CUDA 12.2:
# kernels load on first launch, which may synchronise the context; ringcoll preloads its
# ring kernels for that reason). Exit status 3: torch sees no GPU.
probe() {
  timeout "$(upto 25)" "$PY" - <<'EOF'
import ctypes, os, torch
if not torch.cuda.is_available():
    print("probe: no CUDA device (torch.cuda.is_available() is False)")
    raise SystemExit(3)
assert torch.ones(1 << 20, device="cuda").sum().item() == 1 << 20
mode = ctypes.c_int(0)
try:
    rc = ctypes.CDLL("libcuda.so.1").cuModuleGetLoadingMode(ctypes.byref(mode))
    in_force = {1: "EAGER", 2: "LAZY"}.get(mode.value, f"mode {mode.value}") if rc == 0 else f"error {rc}"
except (OSError, AttributeError) as e:
    in_force = f"unknown ({e})"
p = torch.cuda.get_device_properties(0)
print(f"probe: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory >> 30} GiB; "
      f"CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', 'unset')}, the driver applies {in_force}")
EOF
}
# MPS. Without it, kernels of different processes on one GPU are time-sliced: only one
# process's kernel runs at a time, so a ring kernel spinning on its neighbour's flag moves
# only when the scheduler switches contexts. With MPS they run side by side, as the ring
# needs. The control daemon may start where the server cannot (under gVisor, say), so the
# proof is a CUDA process that runs while it is up, and a server the daemon then lists.
mps="off" probe_rc=3
if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/ringcoll-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/ringcoll-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if timeout "$(upto 10)" nvidia-cuda-mps-control -d; then
    mps_started=1
    probe; probe_rc=$?
    if [ "$probe_rc" = 0 ]; then
      servers=$(timeout "$(upto 5)" sh -c 'echo get_server_list | nvidia-cuda-mps-control' 2>/dev/null | grep -E '^[0-9]+$' | tr '\n' ' ')
      if [ -n "$servers" ]; then mps="on"; echo "MPS: on: a CUDA process ran under it (server pid ${servers% })"
      else echo "MPS: the probe ran, but the daemon lists no server: not counted as MPS"; fi
    fi
    if [ "$mps" != on ]; then
      echo "MPS: the daemon started, but no CUDA process ran under it (probe above); its log:"
      tail -5 "$CUDA_MPS_LOG_DIRECTORY"/*.log 2>/dev/null
      stop_mps
      unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    fi
  else
    echo "MPS: nvidia-cuda-mps-control -d failed"
  fi
else
  echo "MPS: no nvidia-cuda-mps-control on PATH"
fi
if [ "$mps" = off ]; then
  echo "MPS: off: kernels of different processes are time-sliced (multi-process figures include that)"
  probe; probe_rc=$?
fi

wait "$build_pid"
build_rc=$?
build_pid=""
build_ok=0
case "$build_rc" in
  0) build_ok=1 ;;
  124|137) echo "the build did not finish in time; the end of build.log:"; tail -30 "$OUT/build.log" ;;
  *) echo "the build FAILED (exit $build_rc); the end of build.log:"; tail -60 "$OUT/build.log" ;;
esac
if [ "$build_ok" = 1 ] && timeout "$(upto 20)" "$PY" -c "import ringcoll._C as c, sys; sys.exit(0 if c.built_with_cuda else 'built, but without the CUDA backend')"; then
  # What the module exports (CMakeLists.txt: only PyInit__C) and which C++ runtime it loads:
  # a copy of libstdc++ of its own, or exported runtime code, would show here.
  module=$(ls ringcoll/_C*.so 2>/dev/null | head -1)
  # libstdc++'s own compiled code (locale ids, codecvt: never instantiated from headers)
  # inside the module means a static copy of the C++ runtime beside the process's shared one
  # (on the H200, 2026-12-04: 116; harmless since the module exports PyInit__C alone).
  if command -v nm >/dev/null 2>&1 && [ -n "$module" ]; then
    echo "module: $(nm -D --defined-only "$module" | wc -l) exported symbol(s): $(nm -D --defined-only "$module" | awk '{print $3}' | head -3 | tr '\n' ' ')"
    echo "module holds $(nm -C --defined-only "$module" 2>/dev/null | grep -c -E 'std::locale::id|std::codecvt<|std::ios_base::Init') libstdc++-internal symbol(s) (0 unless the C++ runtime is linked in statically)"
  fi
  [ -n "$module" ] && echo "module links: $(ldd "$module" 2>/dev/null | awk '/stdc\+\+|gcc_s|cudart/ {print $1 " => " $3}' | tr '\n' ' ')"
  end "ok (sm_90; MPS $mps)"
else
  end "FAILED"
  for s in smoke backend bench features exhaustive; do skip "$s" "the build failed"; done
  exit 1
fi

# --- the later stages' commands (the CPU rehearsal runs them too) -------------------------
smoke_run() {  # share (s), then cuda_smoke.py's arguments (one part per run: its own limit)
  local lim; lim=$(upto "$1"); shift
  note smoke.log "== cuda_smoke.py $* (up to ${lim} s)"
  show smoke.log . timeout -k "$GRACE_S" "$lim" "$PY" bench/cuda_smoke.py --ring-timeout "$RING_TIMEOUT" \
    --part-timeout $((lim > 10 ? lim - 3 : lim)) "$@"
}
bench_run() {  # name, share (s), P, buffer, mode, then more ringcoll-bench arguments
  local name=$1 lim nproc=$3 buffer=$4 mode=$5 flags=() rc
  lim=$(upto "$2"); shift 5
  [ "$mode" = in-process ] && flags=(--in-process)
  note bench.log "== $name: P=$nproc $mode, RINGCOLL_BUFFER_BYTES=$buffer, up to ${lim} s"
  echo "{\"kind\": \"run\", \"name\": \"$name\", \"world\": $nproc, \"mode\": \"$mode\", \"buffer\": \"$buffer\"}" \
    >> "$OUT/bench_rows.jsonl"
  # Each run stops going to larger sizes once half its time is spent (--max-seconds), so it
  # usually ends with its tables; killed at its limit, its rows are in the rows file anyway.
  show bench.log '^# (Out of bounds|Avg bus|worst|--max-seconds)|^ringcoll-bench: [^m]|Error|Traceback' \
    timeout -k "$GRACE_S" "$lim" env RINGCOLL_BUFFER_BYTES="$buffer" RINGCOLL_TIMEOUT="$RING_TIMEOUT" \
    "$PY" -m ringcoll.harness.bench "${flags[@]}" --nproc "$nproc" -w 2 -n 5 --trials 3 --min-ms 5 \
    --max-seconds $((lim / 2)) --no-progress --rows-file "$OUT/bench_rows.jsonl" "$@"
  rc=$?
  echo "== $name: $(outcome "$rc")"
  return "$rc"
}
# SIGINT at a pytest command's limit, so pytest still prints which test was running and its
# summary (its default action restored: a non-interactive shell's jobs may ignore it).
default_int=()
env --default-signal=INT true 2>/dev/null && default_int=(env --default-signal=INT)
per_test=()  # a hung test is stopped at 40 s where pytest-timeout is installed
"$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=40)
# Where pytest-xdist is installed, the tests run in one worker process: a test that crashes
# it (a segfault) is reported as such and the rest still run and report; without it the
# crash ended the stage before any failure's traceback was printed (2026-12-04, H200).
"$PY" -c "import xdist" 2>/dev/null && per_test+=(-n 1)
pytest_run() {  # pytest's arguments: the rest of the stage is theirs
  local lim; lim=$(upto "$((stage_end - SECONDS))")
  note tests.log "== pytest $* (up to ${lim} s)"
  show tests.log '(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS|crashed)|^=+ .* =+$' \
    timeout -s INT -k "$GRACE_S" "$lim" "${default_int[@]}" "$PY" -m pytest -p no:cacheprovider -m gpu -v -rfE \
    --tb=short --durations=10 "${per_test[@]}" "$@"
}
collect() {  # a test stage's selection, collected only (pytest exits 5 when it is empty)
  local out rc
  out=$(timeout "$(upto 10)" "$PY" -m pytest -p no:cacheprovider -m gpu --collect-only -q "$@" 2>&1)
  rc=$?
  echo "== pytest --collect-only $*: $(tail -1 <<<"$out")"
  return "$rc"
}
have_pytest=1
"$PY" -c "import pytest" 2>/dev/null || have_pytest=0
error_probe() {  # share (s), then cuda_error_probe.py's arguments: each case 15 s at most
  local lim; lim=$(upto "$1"); shift
  note errors.log "== cuda_error_probe.py $* (up to ${lim} s)"
  show errors.log . timeout -k "$GRACE_S" "$lim" "$PY" bench/cuda_error_probe.py --timeout 15 "$@"
}

# --- without a GPU: a rehearsal on the CPU, then stop ------------------------------------
# The later stages' commands, run as they will be on a GPU where they have a CPU form, so a
# mistake in them shows on a dry run rather than on a lent machine. Bounded like a stage.
if [ "$probe_rc" = 3 ]; then
  begin rehearsal "$REHEARSAL_S"
  ok=1
  smoke_run 15 --device cpu --parts multi-process,in-process --variants fused --hop-seconds 0.2 || ok=0
  bench_run rehearsal_cpu 12 2 4MiB in-process --device cpu -b 16K -e 128K -f 8 || ok=0
  error_probe 20 --cases cuda_check,host_timeout --no-debugger || ok=0
  collect "${BACKEND_TESTS[@]}" || ok=0
  collect "${FEATURE_TESTS[@]}" || ok=0
  collect "${EXHAUSTIVE_TESTS[@]}" || ok=0
  if [ "$ok" = 1 ]; then end ok; else end "FAILED"; fi
  echo "no GPU: torch sees no CUDA device, so the GPU stages cannot run here (a dry run stops here)"
  for s in smoke backend bench features exhaustive; do skip "$s" "no GPU"; done
  exit $(( failed ? 1 : 2 ))
fi

# --- stage: smoke -------------------------------------------------------------------------
# Seconds long, and it answers the first questions: do IPC mapping, the flags and both
# kernel variants work at all, in both process modes, and what does one ring hop cost. Then
# the multi-process check again with every flag at system scope (RINGCOLL_CUDA_FLAG_SCOPE,
# where ranks on one GPU would use .gpu): if the scope is what fails, this one passes.
begin smoke
smoke_mp=0 smoke_ip=0 smoke_sys=0
smoke_run 20 --parts multi-process && smoke_mp=1
smoke_run 15 --parts in-process && smoke_ip=1
RINGCOLL_CUDA_FLAG_SCOPE=system smoke_run 15 --parts multi-process --variants fused && smoke_sys=1
if (( smoke_mp && smoke_ip && smoke_sys )); then end ok
else end "FAILED (passed: multi-process $smoke_mp, in-process $smoke_ip, multi-process at system scope $smoke_sys)"; fi
if (( ! smoke_mp && ! smoke_ip )); then
  for s in backend bench features exhaustive; do skip "$s" "no smoke passed"; done
  exit 1
fi

# --- stage: backend -----------------------------------------------------------------------
if (( ! smoke_mp )); then skip backend "needs the multi-process smoke, which failed"
elif (( ! have_pytest )); then skip backend "no pytest in $PY"
else
  begin backend
  pytest_run "${BACKEND_TESTS[@]}"
  end "$(outcome $?)"
fi

# --- stage: bench -------------------------------------------------------------------------
# The checked benchmark's harness (results checked before timing, a device-to-device copy
# of the same bytes as the ceiling, NCCL where it runs, run mode and MPS in each table's
# header), a run at a time.
begin bench
bench_ok=1
for run in "${BENCH_RUNS[@]}"; do
  read -r name share nproc buffer mode <<<"$run"
  if { [ "$mode" = in-process ] && (( ! smoke_ip )); } || { [ "$mode" = multi-process ] && (( ! smoke_mp )); }; then
    echo "== $name: not run (the $mode smoke failed)"; bench_ok=0; continue
  fi
  bench_run "$name" "$share" "$nproc" "$buffer" "$mode" --device cuda -b 16K -e 64M -f 8 || bench_ok=0
done
if (( bench_ok )); then end ok; else end "FAILED or cut (see the runs above; bench_rows.jsonl has every row measured)"; fi

# --- stages: features, exhaustive ---------------------------------------------------------
# The features (async, graphs, close, timeout, mismatch, CuPy, NCCL) before the exhaustive
# value checks, whose many ring steps cost most when the processes are time-sliced.
for s in features exhaustive; do
  if (( CORE_ONLY )); then skip "$s" "--core: the core stages only"
  elif (( ! have_pytest )); then skip "$s" "no pytest in $PY"
  else
    begin "$s"
    if [ "$s" = features ]; then
      error_probe 45; probe_outcome=$?
      pytest_run "${FEATURE_TESTS[@]}"; rc=$?
      if (( rc == 0 && probe_outcome != 0 )); then rc=$probe_outcome; fi
    else
      pytest_run "${EXHAUSTIVE_TESTS[@]}"; rc=$?
    fi
    end "$(outcome $rc)"
  fi
done
exit "$failed"
