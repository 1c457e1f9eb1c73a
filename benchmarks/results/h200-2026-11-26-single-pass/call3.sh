#!/usr/bin/env bash
# Call 3 of this folder, a fresh machine (carry .deps .baseline; .baseline staged with
# scripts/stage_baseline.sh 71bf7de): both Python packages (this tree's into
# build/python-gpu-site) and both trees' floor probes built; the Python suite on the GPU for this
# tree's package (scripts/python_gpu_check.sh); then rounds that alternate the trees (which runs
# first too) of step_floor_probe and the Python engine loop (Replay and the drop-in, eager and CUDA
# graph, decode B64, B256 and B1024) until ROUND_BUDGET_S. Every line carries its round and tree.
# Usage (repository root): OUT=... benchmarks/results/h200-2026-11-26-single-pass/call3.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
probe=benchmarks/results/h200-2026-11-26-step-floors/step_floor_probe.cu
out=${OUT:-build/single_pass_3}
logs=build/call3_logs
mkdir -p "$out" "$logs"
start=$(date +%s)
export PYTHONUNBUFFERED=1
tag() { python3 benchmarks/results/tag_rounds.py "$@"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
for tree in head base; do
  inc=include; [ "$tree" = base ] && inc=.baseline/include
  nvcc -std=c++20 -O3 -DNDEBUG -arch=native -I "$inc" -I benchmarks "$probe" \
    -o "build/step_floor_probe_$tree" >"$logs/build_probe_$tree.log" 2>&1 &
done
OUT="$logs/py_build" benchmarks/results/h200-2026-11-25-fused/run_gpu.sh 0 >"$logs/py_build.log" 2>&1
grep "built both" "$logs/py_build.log" || tail -20 "$logs/py_build.log"
wait
PY_GPU_SKIP_BUILD=1 scripts/python_gpu_check.sh >"$out/python_gpu_check.log" 2>&1
echo "python_gpu_check exit $? at $(( $(date +%s) - start )) s"
grep -E "passed|failed|bit-exact" "$out/python_gpu_check.log" | tail -3
for round in $(seq 1 12); do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-430}" ]; then echo "== round $round not started"; break; fi
  echo "== round $round at $(( $(date +%s) - start )) s"
  trees="base head"; [ $(( round % 2 )) = 0 ] && trees="head base"
  for tree in $trees; do
    site=build/python-gpu-site; [ "$tree" = base ] && site=build/python-gpu-site-baseline
    "build/step_floor_probe_$tree" 800 300 2>>"$out/errors.log" | tag round="$round" tree="$tree" >>"$out/step_floor_probe.jsonl"
    PYTHONPATH="$site" python3 benchmarks/python/engine_loop.py --api replay,dropin --modes eager,graph \
      --scenarios decode_B64,decode_B256,decode_B1024 2>>"$out/errors.log" | tag round="$round" tree="$tree" >>"$out/python_engine_loop.jsonl"
  done
done
python3 benchmarks/results/h200-2026-11-26-step-floors/summary.py "$out"
echo "== done in $(( $(date +%s) - start )) s"
