#!/usr/bin/env bash
# Call 5 (a fresh machine; carry .deps .baseline; .baseline staged with scripts/stage_baseline.sh
# 12c45d4, the previous stop): the GPU checks of the final tree (changes 2 to 4, the eight inline
# page addresses kept; scripts/gpu_check.sh, tests part) while the baseline's
# C++ engine loop builds; then rounds that alternate the two trees (which runs first too) until
# ROUND_BUDGET_S: the C++ engine loop, block-slot storage at decode B1024 and B64 and at prefill 8k
# (64 MB of host memory ahead), per-request storage at decode B1024 and B64 (code no change
# touches: a control). Every line carries its round and tree.
# Usage (repository root): OUT=... benchmarks/results/h100-2026-11-26-page-line/call5.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/page_line_5}
logs=build/page_line_5_logs
mkdir -p "$out" "$logs"
start=$(date +%s)
. scripts/common.sh  # nvcc on PATH
tag() { python3 benchmarks/results/tag_rounds.py "$@"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
prefix=()
[ -d .deps/usr ] && prefix=(-DCMAKE_PREFIX_PATH="$PWD/.deps/usr")
( cmake -S .baseline -B build/baseline -G Ninja -DCMAKE_BUILD_TYPE=Release "${prefix[@]}" \
    -DROUTING_REPLAY_BUILD_TESTS=OFF -DROUTING_REPLAY_BUILD_EXAMPLES=OFF &&
  cmake --build build/baseline -j 4 --target engine_loop ) >"$logs/build_base.log" 2>&1 &
GPU_CHECK_PARTS=tests OUT="$logs/gpu_check" bash scripts/gpu_check.sh >"$logs/gpu_check_stdout.log" 2>&1
echo "gpu_check exit $? at $(( $(date +%s) - start )) s"
cp "$logs/gpu_check/summary.txt" "$out/gpu_check_summary.txt" 2>/dev/null; tail -n 8 "$out/gpu_check_summary.txt"
wait
for round in $(seq 1 20); do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-450}" ]; then echo "== round $round not started"; break; fi
  echo "== round $round at $(( $(date +%s) - start )) s"
  trees="base head"; [ $(( round % 2 )) = 0 ] && trees="head base"
  for tree in $trees; do
    exe=build/gpu/benchmarks/engine_loop; [ "$tree" = base ] && exe=build/baseline/benchmarks/engine_loop
    "$exe" --backend cuda --mode both --copy device_scatter --storage block_slot,per_request --scenarios decode_B1024,decode_B64 \
      2>>"$out/errors.log" | tag round="$round" tree="$tree" >>"$out/engine_loop_cpp.jsonl"
    "$exe" --backend cuda --mode both --copy device_scatter --storage block_slot --scenarios prefill_8k \
      --host-memory-ahead 67108864 2>>"$out/errors.log" | tag round="$round" tree="$tree" ahead=64MB >>"$out/engine_loop_cpp.jsonl"
  done
done
echo "== done in $(( $(date +%s) - start )) s"
