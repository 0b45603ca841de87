#!/usr/bin/env bash
# ptxas_report.sh: registers, spills and stack of every ring (or plan) kernel instantiation,
# as ptxas reports them (-Xptxas -v), compiled with the build's own flags for
# ring_kernels.cu or plan_kernels.cu (CMakeLists.txt, Release: -O3, sm_90). No GPU needed.
# docs/cuda.md records the figures.
#   bench/ptxas_report.sh [arch] [ring|plan]   (default 90 ring; the full ptxas log goes to $OUT or /tmp)
set -euo pipefail
cd "$(dirname "$0")/.."
ARCH="${1:-90}"
KERNEL="${2:-ring}"
LOG="${OUT:-/tmp}/ptxas_${KERNEL}_sm${ARCH}.log"
nvcc -O3 -DNDEBUG -DRINGCOLL_WITH_CUDA=1 --generate-code=arch=compute_${ARCH},code=sm_${ARCH} -std=c++17 \
  -Xcompiler=-fPIC -Icsrc/include -Xptxas -v -c "csrc/cuda/${KERNEL}_kernels.cu" -o /dev/null 2> "$LOG"
# ptxas prints, per kernel: "Compiling entry function '<mangled>'", then "N bytes stack frame,
# N bytes spill stores, N bytes spill loads", then "Used N registers, ...".
printf "%5s %6s %11s %10s  %s\n" regs stack "spill st B" "spill ld B" "${KERNEL}_kernel<T, Op>"
awk '
  /Compiling entry function/ { name = $0; sub(/.*function ./, "", name); sub(/. for .*/, "", name) }
  /bytes stack frame/ { stack = $1; spill_st = $5; spill_ld = $9 }
  /Used [0-9]+ registers/ { regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs);
                            printf "%5s %6s %11s %10s  %s\n", regs, stack, spill_st, spill_ld, name }
' "$LOG" | c++filt | sed -E "s/void ringcoll::cuda::\(anonymous namespace\)::${KERNEL}_kernel<(.*)>\(ringcoll::cuda::RingParams, bool\)\$/\1/"
