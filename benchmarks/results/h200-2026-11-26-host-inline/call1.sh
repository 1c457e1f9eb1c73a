#!/usr/bin/env bash
# Call 1 of this folder, a fresh machine (carry .deps .baseline .peers; .baseline staged with
# scripts/stage_baseline.sh ece01a8, the previous stop): both Python packages build (this tree's
# into build/python-gpu-site) while the GPU checks of this tree run (scripts/gpu_check.sh, tests
# part); then the Python suite on the GPU (scripts/python_gpu_check.sh: graph and compile cases,
# example (a)); then alternating rounds of the Python engine loop and the side by side with vLLM
# PR 39917's capturer (h200-2026-11-25-fused/run_gpu.sh) until ROUND_BUDGET_S.
# Usage (repository root): OUT=... benchmarks/results/h200-2026-11-26-host-inline/call1.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/host_inline_1}
logs=build/call1_logs
mkdir -p "$out" "$logs"
start=$(date +%s)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
( OUT="$logs/py_build" benchmarks/results/h200-2026-11-25-fused/run_gpu.sh 0 >"$logs/py_build.log" 2>&1 ) &
GPU_CHECK_PARTS=tests OUT="$logs/gpu_check" bash scripts/gpu_check.sh >"$logs/gpu_check_stdout.log" 2>&1
echo "gpu_check exit $? at $(( $(date +%s) - start )) s"
cp "$logs/gpu_check/summary.txt" "$out/gpu_check_summary.txt" 2>/dev/null; tail -n 8 "$out/gpu_check_summary.txt"
wait
echo "== built at $(( $(date +%s) - start )) s"; grep "built both" "$logs/py_build.log" || tail -20 "$logs/py_build.log"
PY_GPU_SKIP_BUILD=1 scripts/python_gpu_check.sh >"$out/python_gpu_check.log" 2>&1
echo "python_gpu_check exit $? at $(( $(date +%s) - start )) s"
grep -E "passed|failed|bit-exact" "$out/python_gpu_check.log" | tail -3
OUT="$out" SKIP_BUILD=1 ROUND_BUDGET_S=$(( ${ROUND_BUDGET_S:-540} - ($(date +%s) - start) )) \
  SCENARIOS=${SCENARIOS:-decode_B1,decode_B64,decode_B256,decode_B1024,prefill_8k} \
  benchmarks/results/h200-2026-11-25-fused/run_gpu.sh 8
echo "== done in $(( $(date +%s) - start )) s"
