#!/usr/bin/env bash
# Call 3 of this folder, a fresh machine (carry .deps): the GPU checks of the final tree after the
# review mends (scripts/gpu_check.sh, tests part, and scripts/python_gpu_check.sh, which builds this
# tree's package: graph and compile cases, example (a)).
# Usage (repository root): OUT=... benchmarks/results/h200-2026-11-26-host-inline/call3.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/host_inline_3}
mkdir -p "$out"
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
( scripts/python_gpu_check.sh >"$out/python_gpu_check.log" 2>&1; echo "python_gpu_check exit $?" >>"$out/python_gpu_check.log" ) &
GPU_CHECK_PARTS=tests OUT="$out/gpu_check" bash scripts/gpu_check.sh >"$out/gpu_check_stdout.log" 2>&1
echo "gpu_check exit $? at $(( $(date +%s) - start )) s"
cp "$out/gpu_check/summary.txt" "$out/gpu_check_summary.txt" 2>/dev/null; rm -rf "$out/gpu_check"
tail -n 8 "$out/gpu_check_summary.txt"
wait
tail -n 1 "$out/python_gpu_check.log"; grep -E "passed|failed|bit-exact" "$out/python_gpu_check.log" | tail -3
echo "== done in $(( $(date +%s) - start )) s"
