#!/usr/bin/env bash
# ptxas_report.sh: registers, spills and stack of every ring kernel instantiation, as
# ptxas reports them (-Xptxas -v), compiled with the build's own flags for ring_kernels.cu
# (CMakeLists.txt, Release: -O3, sm_90). No GPU needed. docs/cuda.md records the figures.
#   bench/ptxas_report.sh [arch]     (default 90; writes the full ptxas log to $OUT or /tmp)
set -euo pipefail
cd "$(dirname "$0")/.."
ARCH="${1:-90}"
LOG="${OUT:-/tmp}/ptxas_sm${ARCH}.log"
nvcc -O3 -DNDEBUG -DRINGCOLL_WITH_CUDA=1 --generate-code=arch=compute_${ARCH},code=sm_${ARCH} -std=c++17 \
  -Xcompiler=-fPIC -Icsrc/include -Xptxas -v -c csrc/cuda/ring_kernels.cu -o /dev/null 2> "$LOG"
# ptxas prints, per kernel: "Compiling entry function '<mangled>'", then "N bytes stack frame,
# N bytes spill stores, N bytes spill loads", then "Used N registers, ...".
printf "%5s %6s %11s %10s  %s\n" regs stack "spill st B" "spill ld B" "ring_kernel<T, Op>"
awk '
  /Compiling entry function/ { name = $0; sub(/.*function ./, "", name); sub(/. for .*/, "", name) }
  /bytes stack frame/ { stack = $1; spill_st = $5; spill_ld = $9 }
  /Used [0-9]+ registers/ { regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs);
                            printf "%5s %6s %11s %10s  %s\n", regs, stack, spill_st, spill_ld, name }
' "$LOG" | c++filt | sed -E 's/void ringcoll::cuda::\(anonymous namespace\)::ring_kernel<(.*)>\(ringcoll::cuda::RingParams, bool\)$/\1/'
