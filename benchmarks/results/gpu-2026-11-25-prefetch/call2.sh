#!/usr/bin/env bash
# The stop's checks and A/B on one GPU call (carry .deps .baseline; .baseline staged with
# scripts/stage_baseline.sh 44e1e0a): this tree's Python package builds in the background while
# scripts/gpu_check.sh builds and runs the GPU checks (run_cpp.sh), then alternating rounds of the
# C++ engine loop (head vs .baseline, device scatter, both storages, eager and graph, decode B1024
# and B64) until ROUND_BUDGET_S, then scripts/python_gpu_check.sh on the package built.
# Usage (repository root): OUT=... benchmarks/results/gpu-2026-11-25-prefetch/call2.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/call2}
mkdir -p "$out"
start=$(date +%s)
( site="$PWD/build/python-gpu-site"; rm -rf "$site"
  python3 -m pip install -q --no-build-isolation --no-deps --target "$site" ./python \
    >"$out/python_build.log" 2>&1; echo "python build exit $? at $(( $(date +%s) - start )) s" >>"$out/python_build.log" ) &
pybuild=$!
OUT="$out/cpp" SCENARIOS=decode_B1024,decode_B64 ROUND_BUDGET_S=${ROUND_BUDGET_S:-300} \
  benchmarks/results/h200-2026-11-25-fused/run_cpp.sh 12
wait "$pybuild"; tail -2 "$out/python_build.log"
echo "== python check at $(( $(date +%s) - start )) s"
PY_GPU_SKIP_BUILD=1 scripts/python_gpu_check.sh >"$out/python_gpu_check.log" 2>&1
echo "python_gpu_check exit $?"; grep -E "passed|failed|bit-exact" "$out/python_gpu_check.log" | tail -3
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$out/machine.txt"
echo "== done in $(( $(date +%s) - start )) s"
