#!/usr/bin/env bash
# Call 3 of this folder, a fresh machine (carry .deps .baseline; .baseline staged with
# scripts/stage_baseline.sh fa0e384, the tree before this folder's change): both trees' C++ engine
# loop built at once (and both Python packages in the background, for call 4 on the same warm
# machine) and launch_probe.cu (run once the builds are done), then alternating rounds (which tree
# first alternates too) of the engine loop with device scatter, both storages, eager and CUDA
# graph, decode B1024 and B64, until ROUND_BUDGET_S.
# Calls 1 and 2 read both trees three and four times; this call asks for enough rounds to tell
# `begin_us` apart through the machine's slow phases. Every line carries its round and tree.
# Usage (repository root): OUT=... benchmarks/results/h200-2026-11-26-planner-trim/call3.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/planner_trim_3}
logs=build/call3_logs
mkdir -p "$out" "$logs"
start=$(date +%s)
tag() { python3 benchmarks/results/tag_rounds.py "$@"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
prefix=()
[ -d .deps/usr ] && prefix=(-DCMAKE_PREFIX_PATH="$PWD/.deps/usr")
( OUT="$logs/py_build" benchmarks/results/h200-2026-11-25-fused/run_gpu.sh 0 >"$logs/py_build.log" 2>&1 ) &
py_build=$!
for tree in head base; do
  src=.; dir=build/gpu; [ "$tree" = base ] && { src=.baseline; dir=build/baseline; }
  ( cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${prefix[@]}" \
      -DROUTING_REPLAY_BUILD_TESTS=OFF -DROUTING_REPLAY_BUILD_EXAMPLES=OFF &&
    cmake --build "$dir" -j 6 --target engine_loop ) >"$logs/build_$tree.log" 2>&1 &
done
nvcc -std=c++20 -O3 -DNDEBUG -arch=native -I include "$(dirname "$0")/launch_probe.cu" -o build/launch_probe \
  >"$logs/build_launch_probe.log" 2>&1 &
wait $(jobs -p | grep -v "^$py_build$")
echo "== built at $(( $(date +%s) - start )) s"
build/launch_probe | tee "$out/launch_probe.jsonl"
for round in $(seq 1 40); do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-420}" ]; then echo "== round $round not started"; break; fi
  trees="base head"; [ $(( round % 2 )) = 0 ] && trees="head base"
  for tree in $trees; do
    exe=build/gpu/benchmarks/engine_loop; [ "$tree" = base ] && exe=build/baseline/benchmarks/engine_loop
    "$exe" --backend cuda --mode both --copy device_scatter --storage all --scenarios decode_B1024,decode_B64 \
      2>>"$out/errors.log" | tag round="$round" tree="$tree" >>"$out/engine_loop_cpp.jsonl"
  done
done
wait
grep "built both" "$logs/py_build.log"
python3 benchmarks/results/h200-2026-11-26-planner-trim/summary_cpp.py "$out/engine_loop_cpp.jsonl"
echo "== done in $(( $(date +%s) - start )) s"
