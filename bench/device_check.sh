#!/usr/bin/env bash
# device_check.sh: the one command a session lent a GPU machine runs (see
# /work/.library/device/). Such a loan is a few minutes, so the stages run in the order of
# what they answer, each printing its result as it finishes:
#
#   1 info        versions, the GPU (name, driver, compute mode), MPS: started, and does a
#                 CUDA process really run under it; CUDA_MODULE_LOADING in force
#   2 build       ringcoll with its CUDA backend, sm_90 only, timed (started in the
#                 background at once: it is the longest step and needs no GPU)
#   3 smoke       bench/cuda_smoke.py: P = 2 hello, one collective of each kind, both kernel
#                 variants, exact checks, one ring hop timed; multi-process and in-process
#   4 features    the GPU tests less the exhaustive ones: async, graphs, close, timeout,
#                 mismatch, CuPy, the torch.distributed backend
#   5 bench       the benchmark: in-process P = 2, 4, 8 and multi-process P = 2, 4 KiB to
#                 256 MiB, beside a device-to-device copy of the same bytes, each run
#                 stopping when its time budget is spent
#   6 exhaustive  every dtype x op x awkward size, only with the time that is left
#
# Budget. In the normal case it ends within 5 minutes on an H200; every stage has its own
# limit and none may run past HARD_S (9 minutes, under the device tool's 10 per command),
# so the worst case ends by then too. Stage 6 runs only while the normal budget lasts.
# Then one summary line per stage: ok, FAILED or skipped, and its seconds.
#
# What comes back (files under $OUT, default ./out: at most 8 come back, so few):
#   device_check.log   everything printed, in order
#   build.log          the build's full output
#   bench_*.json       one per benchmark run (4)
#
# Dry run without a GPU: stages 1 and 2 run, then it stops, saying there is no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/device_check.log") 2>&1
tee_pid=$!

NORMAL_S=300   # the normal case ends by then; stage 6 starts only if it can end by then
HARD_S=540     # no stage may run past this (seconds since the start)
RESERVE_S=30   # kept back for a killed stage's grace, stopping MPS, the log's last lines
T0=$SECONDS

declare -a SUMMARY=()
failed=0
stage_name="" stage_t0=0
begin() { stage_name=$1; stage_t0=$SECONDS; echo; echo "=== stage $1 (at $((SECONDS - T0)) s)"; }
end() {  # status: ok, FAILED or skipped (+ why)
  local line="$stage_name: $1 in $((SECONDS - stage_t0)) s"
  SUMMARY+=("$line"); echo "=== $line"
  case "$1" in FAILED*) failed=1 ;; esac
}
skip() { SUMMARY+=("$1: skipped ($2)"); echo "=== $1: skipped ($2)"; }
# A stage's limit: its own cap, cut to what is left before HARD_S (never below 5 s).
limit() {
  local cap=$1 left=$((HARD_S - RESERVE_S - (SECONDS - T0)))
  (( left < cap )) && cap=$left
  (( cap < 5 )) && cap=5
  echo "$cap"
}

mps_started=0
stop_mps() {  # bounded: a control daemon that does not answer must not hold the machine
  [ "$mps_started" = 1 ] || return 0
  mps_started=0
  if timeout 10 sh -c 'echo quit | nvidia-cuda-mps-control'; then echo "== MPS stopped"
  else echo "== MPS did not stop within 10 s (left running)"; fi
}
finish() {  # the summary, MPS stopped, then (bounded) time for tee to write the last lines
  local rc=$?
  [ -n "${build_pid:-}" ] && kill "$build_pid" 2>/dev/null  # timeout passes it on to the build
  stop_mps
  echo
  echo "=== summary ($((SECONDS - T0)) s in all)"
  for line in "${SUMMARY[@]}"; do echo "  $line"; done
  echo "=== exit status $rc"
  exec >&- 2>&-
  for _ in $(seq 50); do kill -0 "$tee_pid" 2>/dev/null || return 0; sleep 0.1; done
}
trap finish EXIT

# --- stage 2 starts first: the build, in the background ----------------------------------
# CMake finds nvcc only on PATH or through $CUDACXX / $CUDA_PATH, so look where toolkits
# usually live when it is not on PATH. Likewise cmake and ninja may be pip packages beside
# this Python, outside PATH.
if ! command -v nvcc >/dev/null 2>&1; then
  for nvcc in "${CUDA_HOME:-/nonexistent}/bin/nvcc" "${CUDA_PATH:-/nonexistent}/bin/nvcc" /usr/local/cuda/bin/nvcc \
              $(ls -d /usr/local/cuda-*/bin/nvcc 2>/dev/null | sort -V -r) /opt/cuda/bin/nvcc; do
    if [ -x "$nvcc" ]; then export CUDACXX="$nvcc" PATH="$(dirname "$nvcc"):$PATH"; break; fi
  done
fi
py_bin="$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))' 2>/dev/null)"
for tool in cmake ninja; do
  command -v "$tool" >/dev/null 2>&1 || { [ -x "$py_bin/$tool" ] && export PATH="$PATH:$py_bin"; }
done
build_t0=$SECONDS
BUILD_S=180
# In place, with the machine's own setuptools/pybind11/cmake/ninja: nothing is installed into
# its Python (no downloads there), and the tests and spawned ranks import ./ringcoll.
# timeout runs it in a process group of its own and stops all of it at the limit.
timeout -k 5 "$BUILD_S" env CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" RINGCOLL_CUDA_ARCHS=90 RINGCOLL_REQUIRE_CUDA=1 \
  "$PY" setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 &
build_pid=$!

# --- stage 1: what machine this is --------------------------------------------------------
begin info
echo "== $(date -u +%FT%TZ) $(uname -srm), $(nproc) cores"
if command -v nvidia-smi >/dev/null 2>&1; then
  timeout 20 nvidia-smi --query-gpu=name,driver_version,compute_mode,memory.total,clocks.max.sm --format=csv \
    || echo "nvidia-smi did not answer within 20 s"
  # Exclusive_Process lets one process at a time hold the GPU (unless MPS serves them all):
  # without MPS the multi-process ring cannot even start then; the in-process one can.
  compute_mode=$(timeout 10 nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | head -1)
  [ -n "$compute_mode" ] && [ "$compute_mode" != Default ] && \
    echo "NOTE: compute mode $compute_mode: processes cannot share this GPU without MPS"
else
  echo "no nvidia-smi on PATH"
fi
echo "nvcc: $(command -v nvcc || echo 'not found') ($(nvcc --version 2>/dev/null | tail -1))${CUDACXX:+, CUDACXX=$CUDACXX}"
echo "cmake: $(cmake --version 2>/dev/null | head -1 || echo 'not found'); ninja: $(ninja --version 2>/dev/null || echo 'not found')"
timeout 60 "$PY" - <<'EOF' || echo "python/torch did not report within 60 s"
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
# ring kernels for that reason).
probe() {
  timeout 30 "$PY" - <<'EOF'
import ctypes, os, torch
if not torch.cuda.is_available():
    raise SystemExit("probe: no CUDA device")
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
mps="off"
if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/ringcoll-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/ringcoll-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if timeout 10 nvidia-cuda-mps-control -d; then
    mps_started=1
    if probe; then
      servers=$(timeout 5 sh -c 'echo get_server_list | nvidia-cuda-mps-control' 2>/dev/null | grep -E '^[0-9]+$' | tr '\n' ' ')
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
  probe || echo "probe: no CUDA process ran (see above)"
fi
end "ok (MPS $mps)"

# --- stage 2: the build (wait for it) -----------------------------------------------------
begin build
build_ok=0
wait "$build_pid"
build_rc=$?
build_pid=""
case "$build_rc" in
  0) build_ok=1 ;;
  124|137) echo "build did not finish within ${BUILD_S} s; the end of build.log:"; tail -30 "$OUT/build.log" ;;
  *) echo "build FAILED (exit $build_rc); the end of build.log:"; tail -60 "$OUT/build.log" ;;
esac
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$build_ok" = 1 ] && timeout 30 "$PY" -c "import ringcoll._C as c, sys; sys.exit(0 if c.built_with_cuda else 'built, but without the CUDA backend')"; then
  end "ok (sm_90, $((SECONDS - build_t0)) s from the start of the build)"
else
  end "FAILED"
  for s in smoke features bench exhaustive; do skip "$s" "no build"; done
  exit 1
fi
# Without a GPU every stage below would skip or fail: stop here, saying so.
if ! timeout 30 "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no GPU: torch sees no CUDA device, so stages 3-6 cannot run here (a dry run stops here)"
  for s in smoke features bench exhaustive; do skip "$s" "no GPU"; done
  exit 1
fi

# --- stage 3: smoke -----------------------------------------------------------------------
# Seconds long, and it answers the first questions: do IPC mapping, the flags and both
# kernel variants work at all, in both process modes, and what does one ring hop cost.
begin smoke
if timeout -k 5 "$(limit 90)" "$PY" bench/cuda_smoke.py --world 2 --ring-timeout 20 --part-timeout 40; then
  end ok
else
  end "FAILED"
fi

# --- stage 4: features --------------------------------------------------------------------
# The features before the exhaustive value checks, whose many ring steps cost most when the
# processes are time-sliced. Per-test limit where pytest-timeout is there; SIGINT at the
# stage's limit, so pytest still prints which test was running and its summary (SIGINT
# reset to its default: a background job of a non-interactive shell would ignore it).
EXHAUSTIVE="collectives_exact or every_dtype or larger_than_buffer"
run_tests() {  # limit (s), -k expression
  local per_test=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=75)
  timeout -s INT -k 15 "$1" env --default-signal=INT "$PY" -m pytest -p no:cacheprovider -m gpu -v -rfE \
    --durations=15 "${per_test[@]}" tests/gpu/test_cuda.py tests/gpu/test_backend_cuda.py -k "$2"
}
have_pytest=1
if ! "$PY" -c "import pytest" 2>/dev/null; then
  have_pytest=0
  echo "pytest is MISSING from $PY: the test stages cannot run (carry it as a wheel, see the device README)"
fi
begin features
if [ "$have_pytest" = 0 ]; then end "FAILED (no pytest)"
elif run_tests "$(limit 150)" "not ($EXHAUSTIVE)"; then end ok
else end "FAILED"; fi

# --- stage 5: bench -----------------------------------------------------------------------
# The checked benchmark's harness (ringcoll-bench --device cuda: results checked before
# timing, a device-to-device copy of the same bytes as the ceiling, NCCL where it runs, run
# mode and MPS in each table's header). Each run stops going to larger sizes once its
# --max-seconds are spent and still prints what it measured; the outer limit leaves room
# for the size in flight. In-process first: its rings are co-resident whatever MPS does.
# Buffers: the default 4 MiB at P = 2 in both modes (the two differ only in the mode); 64 MiB
# at P = 4 and 8, whose slots give a large message a block per SM (docs/cuda.md, "What the
# fused kernel should reach").
begin bench
bench_failed=0
bench() {  # name, cap (s), P, buffer, mode flags...
  local name=$1 cap=$2 nproc=$3 buffer=$4; shift 4
  local lim; lim=$(limit "$cap")
  echo "== $name: P=$nproc $* RINGCOLL_BUFFER_BYTES=$buffer (limit ${lim} s)"
  timeout -k 10 "$lim" env RINGCOLL_BUFFER_BYTES="$buffer" "$PY" -m ringcoll.harness.bench --device cuda "$@" \
    --nproc "$nproc" -b 4K -e 256M -f 4 -w 2 -n 5 --trials 3 --min-ms 5 \
    --max-seconds $(( lim * 2 / 3 )) --no-progress --json "$OUT/$name.json" || bench_failed=1
}
bench bench_inproc_p2 35 2 4MiB --in-process
bench bench_inproc_p4 35 4 64MiB --in-process
bench bench_inproc_p8 35 8 64MiB --in-process
bench bench_mp_p2 40 2 4MiB
if [ "$bench_failed" = 0 ]; then end ok; else end "FAILED"; fi

# --- stage 6: exhaustive ------------------------------------------------------------------
# Every dtype x op x awkward size, both variants: only in the time the normal budget has left.
left=$((T0 + NORMAL_S - SECONDS))
if [ "$have_pytest" = 0 ]; then skip exhaustive "no pytest"
elif (( left < 40 )); then skip exhaustive "only ${left} s of the normal budget left"
else
  begin exhaustive
  if run_tests "$(limit "$left")" "$EXHAUSTIVE"; then end ok; else end "FAILED (or cut at ${left} s)"; fi
fi
exit "$failed"
