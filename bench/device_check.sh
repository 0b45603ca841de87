#!/usr/bin/env bash
# device_check.sh: one command for a lent GPU machine (see /work/.library/device/): build
# ringcoll with the CUDA backend for sm_90, run the GPU tests, then a short benchmark at
# P = 2 and 4 processes on one GPU. Everything it writes goes under $OUT (default ./out).
# Budget: about 4-5 minutes on an H200; every step has its own limit, ~9.5 minutes at
# worst (under the device tool's 10-minute limit per command).
#
# MPS. Without the MPS daemon, kernels of different processes on one GPU are time-sliced:
# only one process's kernel runs at a time, so a ring kernel spinning on its neighbour's
# flag makes progress only when the scheduler switches contexts (milliseconds per step).
# With MPS the processes share the GPU concurrently, as the ring needs. We start it when
# nvidia-cuda-mps-control exists and a CUDA process can then really run (the control daemon
# starts even where the MPS server cannot, e.g. under gVisor); else tests still pass, more
# slowly, and the benchmark's header says MPS=off.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/device_check.log") 2>&1
tee_pid=$!
echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
echo "== nvcc: $(command -v nvcc) $(nvcc --version 2>/dev/null | tail -1); python: $("$PY" -c 'import sys, sysconfig; print(sys.version.split()[0], sysconfig.get_paths()["include"])')"
timeout 30 "$PY" -c "import torch; print('== torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else '-')"

mps_started=0
stop_mps() { [ "$mps_started" = 1 ] && { echo quit | nvidia-cuda-mps-control; mps_started=0; }; true; }
finish() {  # stop MPS, then give tee (bounded) time to write the log's last lines
  stop_mps; exec >&- 2>&-
  for _ in $(seq 50); do kill -0 "$tee_pid" 2>/dev/null || return 0; sleep 0.1; done
}
trap finish EXIT
if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/ringcoll-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/ringcoll-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d && mps_started=1 &&
     timeout 30 "$PY" -c "import torch; assert torch.ones(1, device='cuda').sum().item() == 1"; then
    echo "== MPS daemon started, and a CUDA process runs under it"
  else
    stop_mps
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    echo "== MPS unavailable (daemon or server did not start); kernels of different processes are time-sliced"
    tail -5 /tmp/ringcoll-mps-log/*.log 2>/dev/null
  fi
else
  echo "== no nvidia-cuda-mps-control; kernels of different processes are time-sliced"
fi

echo "== build (sm_90)"
t0=$(date +%s)
# In place, with the machine's own setuptools/pybind11/cmake/ninja: nothing is installed into
# its Python (no downloads there), and tests and spawned ranks import ./ringcoll.
RINGCOLL_CUDA_ARCHS=90 RINGCOLL_REQUIRE_CUDA=1 timeout 120 "$PY" setup.py -q build_ext --inplace \
  > "$OUT/build.log" 2>&1 || { echo "build FAILED"; tail -50 "$OUT/build.log"; exit 1; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "build ok in $(( $(date +%s) - t0 )) s"
timeout 30 "$PY" -c "import ringcoll._C as c; assert c.built_with_cuda, 'no CUDA backend'; print('built_with_cuda', c.built_with_cuda)" || exit 1
# Without a GPU every test below would skip and "pass": refuse instead.
timeout 30 "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'torch sees no CUDA device')" || exit 1

# Tests in two rounds, the features first (async, timeouts, mismatch, close, graphs, CuPy,
# NCCL), then the exhaustive value checks, whose many ring steps cost most when processes
# are time-sliced. Per-test limit where pytest-timeout is there; SIGINT at the round's
# limit, so pytest still prints which test was running and its summary (SIGINT reset to
# its default: a background job of a non-interactive shell would ignore it).
per_test=()
"$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=80)
EXHAUSTIVE="collectives_exact or every_dtype or larger_than_buffer"
tests_rc=0
run_tests() {  # name, limit (s), -k expression
  echo "== GPU tests: $1"
  timeout -s INT -k 15 "$2" env --default-signal=INT "$PY" -m pytest -m gpu -v -rfE --durations=0 "${per_test[@]}" tests/gpu/test_cuda.py tests/gpu/test_backend_cuda.py -k "$3" \
    2>&1 | tee "$OUT/pytest_gpu_$1.txt"
  local rc=${PIPESTATUS[0]}
  echo "pytest ($1) rc=$rc"
  [ "$rc" = 0 ] || tests_rc=1
}
run_tests features 115 "not ($EXHAUSTIVE)"
run_tests exhaustive 85 "$EXHAUSTIVE"

# The checked benchmark's own harness (ringcoll-bench --device cuda: the CUDA ring, a
# device-to-device copy of the same bytes as the ceiling, NCCL where it runs; run mode and
# MPS in each table's header). Each run stops going to larger sizes when its time budget
# is spent and still prints what it measured.
echo "== benchmark"
bench_failed=0
bench() {  # file, limit (s), kernel variant, P, max bytes, collectives, buffer bytes per rank
  echo "== $1: $3, P=$4, RINGCOLL_BUFFER_BYTES=$7"
  timeout -k 10 "$2" env RINGCOLL_CUDA_KERNEL="$3" RINGCOLL_BUFFER_BYTES="$7" "$PY" -m ringcoll.harness.bench \
    --device cuda --nproc "$4" -b 4K -e "$5" -f 4 --trials 3 --min-ms 5 --collectives "$6" \
    --max-seconds $(($2 - 25)) --no-progress --json "$OUT/${1%.txt}.json" 2>&1 | tee "$OUT/$1"
  [ "${PIPESTATUS[0]}" = 0 ] || bench_failed=1
}
# The default buffer (4 MiB) at P = 2; at P = 4 a 64 MiB one, whose 8 MiB slots give a large
# message a block per SM with several tiles each per ring step (docs/cuda.md, "What it
# should reach"): the two bound what the fused kernel's grid can do.
bench bench_p2.txt 45 fused 2 256M all_reduce,reduce_scatter,all_gather 4MiB
bench bench_p4_buf64m.txt 45 fused 4 256M all_reduce,reduce_scatter,all_gather 64MiB
# The teaching variant (one launch per ring step): what per-step launches cost.
bench bench_p2_naive.txt 30 naive 2 16M all_reduce 4MiB
echo "== done: tests $([ $tests_rc = 0 ] && echo ok || echo FAILED), benchmark $([ $bench_failed = 0 ] && echo ok || echo FAILED)"
[ "$tests_rc" = 0 ] && [ "$bench_failed" = 0 ]
