#!/usr/bin/env bash
# The request-id look-up by object address on the GPU (carry .deps .baseline; .baseline is
# 44e1e0a, whose drop-in path is 6e4412f's): both Python packages built at once, then alternating
# rounds of the Python engine loop's drop-in (eager and CUDA graph, decode B64 and B1024) until
# ROUND_BUDGET_S, then scripts/python_gpu_check.sh on this tree's package.
# Usage (repository root): OUT=... benchmarks/results/gpu-2026-11-25-prefetch/call4.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/call4}
mkdir -p "$out"
start=$(date +%s)
OUT="$out" APIS=dropin SIDE_BY_SIDE=0 SCENARIOS=decode_B64,decode_B1024 ROUND_BUDGET_S=${ROUND_BUDGET_S:-240} \
  benchmarks/results/h200-2026-11-25-fused/run_gpu.sh 8
echo "== python check at $(( $(date +%s) - start )) s"
PY_GPU_SKIP_BUILD=1 scripts/python_gpu_check.sh >"$out/python_gpu_check.log" 2>&1
echo "python_gpu_check exit $?"; grep -E "passed|failed|bit-exact" "$out/python_gpu_check.log" | tail -3
echo "== done in $(( $(date +%s) - start )) s"
