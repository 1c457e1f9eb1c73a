#!/usr/bin/env bash
# Call 2 of this folder, on the machine call1.sh left warm (its two packages in build/): the Python
# suite on the GPU for this tree's package (scripts/python_gpu_check.sh: graph and compile cases,
# example (a)), then alternating rounds of the Python engine loop and the side by side with vLLM PR
# 39917's capturer (h200-2026-11-25-fused/run_gpu.sh: none, Replay, the drop-in; eager and CUDA
# graph; this tree against .baseline, the peer in this tree's rounds) until ROUND_BUDGET_S.
# Usage (repository root): OUT=... benchmarks/results/h200-2026-11-26-step-floors/call2.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/step_floors_2}
mkdir -p "$out"
start=$(date +%s)
PY_GPU_SKIP_BUILD=1 scripts/python_gpu_check.sh >"$out/python_gpu_check.log" 2>&1
echo "python_gpu_check exit $? at $(( $(date +%s) - start )) s"
grep -E "passed|failed|bit-exact" "$out/python_gpu_check.log" | tail -3
OUT="$out" SKIP_BUILD=1 ROUND_BUDGET_S=$(( ${ROUND_BUDGET_S:-470} - ($(date +%s) - start) )) \
  SCENARIOS=${SCENARIOS:-decode_B1,decode_B64,decode_B256,decode_B1024,prefill_8k} \
  benchmarks/results/h200-2026-11-25-fused/run_gpu.sh 8
echo "== done in $(( $(date +%s) - start )) s"
