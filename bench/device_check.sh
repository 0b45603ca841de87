#!/usr/bin/env bash
# device_check.sh: one command for a lent GPU machine (see /work/.library/device/): build
# ringcoll with the CUDA backend for sm_90, run the GPU tests, then a short benchmark at
# P = 2 and 4 processes on one GPU. Everything it writes goes under $OUT (default ./out).
# Budget: well under 5 minutes on an H200 (build ~1-2 min, tests ~1-2 min, bench < 1 min).
#
# MPS. Without the MPS daemon, kernels of different processes on one GPU are time-sliced:
# only one process's kernel runs at a time, so a ring kernel spinning on its neighbour's
# flag makes progress only when the scheduler switches contexts (milliseconds per step).
# With MPS the processes share the GPU concurrently, as the ring needs. We start it when
# nvidia-cuda-mps-control exists and can start (it may not under gVisor); else tests still
# pass, slowly, and the benchmark's figures say MPS=off.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/device_check.log") 2>&1
echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"

mps_started=0
if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/ringcoll-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/ringcoll-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    mps_started=1
    echo "== MPS daemon started"
  else
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    echo "== MPS daemon could not start; kernels of different processes will be time-sliced"
  fi
else
  echo "== no nvidia-cuda-mps-control; kernels of different processes will be time-sliced"
fi
stop_mps() { [ "$mps_started" = 1 ] && echo quit | nvidia-cuda-mps-control || true; }
trap stop_mps EXIT

echo "== build (sm_90)"
t0=$(date +%s)
# In place, with the machine's own setuptools/pybind11/cmake/ninja: nothing is installed into
# its Python (no downloads there), and tests and spawned ranks import ./ringcoll.
RINGCOLL_CUDA_ARCHS=90 RINGCOLL_REQUIRE_CUDA=1 timeout 240 "$PY" setup.py -q build_ext --inplace \
  > "$OUT/build.log" 2>&1 || { echo "build FAILED"; tail -50 "$OUT/build.log"; exit 1; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "build ok in $(( $(date +%s) - t0 )) s"
"$PY" -c "import ringcoll._C as c; assert c.built_with_cuda, 'no CUDA backend'; print('built_with_cuda', c.built_with_cuda)" || exit 1

echo "== GPU tests"
timeout 180 "$PY" -m pytest -m gpu -x -q tests/test_cuda.py 2>&1 | tee "$OUT/pytest_gpu.txt"
tests_rc=${PIPESTATUS[0]}
echo "pytest rc=$tests_rc"

echo "== benchmark"
for p in 2 4; do
  timeout 120 "$PY" bench/device_bench.py "$p" $((256 << 20)) 2>&1 | tee "$OUT/bench_p$p.txt"
done
# The teaching variant (one launch per ring step), smaller sizes: what per-step launches cost,
# and whether they help when processes are time-sliced (MPS off).
RINGCOLL_CUDA_KERNEL=naive timeout 60 "$PY" bench/device_bench.py 2 $((16 << 20)) 2>&1 | tee "$OUT/bench_p2_naive.txt"
exit "$tests_rc"
