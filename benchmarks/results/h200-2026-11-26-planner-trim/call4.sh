#!/usr/bin/env bash
# Call 4 of this folder, on the machine call3.sh left warm (both Python packages in build/):
# alternating rounds (which tree first alternates too) of the Python engine loop, Replay and the
# drop-in, eager and CUDA graph, decode B64 and B1024, until ROUND_BUDGET_S.
# Usage (repository root): OUT=... benchmarks/results/h200-2026-11-26-planner-trim/call4.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/planner_trim_4}
mkdir -p "$out"
start=$(date +%s)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
for round in $(seq 1 40); do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-420}" ]; then echo "== round $round not started"; break; fi
  trees="base head"; [ $(( round % 2 )) = 0 ] && trees="head base"
  for tree in $trees; do
    site=build/python-gpu-site; [ "$tree" = base ] && site=build/python-gpu-site-baseline
    PYTHONPATH="$site" python3 benchmarks/python/engine_loop.py --api replay,dropin --modes eager,graph \
      --scenarios decode_B64,decode_B1024 2>>"$out/errors.log" |
      python3 benchmarks/results/tag_rounds.py round="$round" tree="$tree" >>"$out/python_engine_loop.jsonl"
  done
done
python3 benchmarks/results/h200-2026-11-26-step-floors/summary.py "$out"
echo "== done in $(( $(date +%s) - start )) s"
