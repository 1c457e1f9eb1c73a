#!/usr/bin/env bash
# Call 2 of this folder, a fresh machine (carry .deps .baseline .peers; .baseline staged with
# scripts/stage_baseline.sh 71bf7de, the previous stop): both Python packages built (this tree's
# into build/python-gpu-site), the Python suite on the GPU for this tree's package
# (scripts/python_gpu_check.sh: graph and compile cases, example (a)), then alternating rounds of
# the Python engine loop and the side by side with vLLM PR 39917's capturer
# (h200-2026-11-25-fused/run_gpu.sh) until ROUND_BUDGET_S.
# Usage (repository root): OUT=... benchmarks/results/h200-2026-11-26-single-pass/call2.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/single_pass_2}
mkdir -p "$out"
start=$(date +%s)
export PYTHONUNBUFFERED=1
OUT="$out" benchmarks/results/h200-2026-11-25-fused/run_gpu.sh 0 | grep -E "built both|machine" ; cat "$out/machine.txt"
PY_GPU_SKIP_BUILD=1 scripts/python_gpu_check.sh >"$out/python_gpu_check.log" 2>&1
echo "python_gpu_check exit $? at $(( $(date +%s) - start )) s"
grep -E "passed|failed|bit-exact" "$out/python_gpu_check.log" | tail -3
rm -f "$out/build.log" "$out/build_baseline.log"
OUT="$out" SKIP_BUILD=1 ROUND_BUDGET_S=$(( ${ROUND_BUDGET_S:-520} - ($(date +%s) - start) )) \
  SCENARIOS=${SCENARIOS:-decode_B1,decode_B64,decode_B256,decode_B1024,prefill_8k} \
  benchmarks/results/h200-2026-11-25-fused/run_gpu.sh 8
echo "== done in $(( $(date +%s) - start )) s"
