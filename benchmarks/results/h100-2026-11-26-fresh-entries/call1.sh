#!/usr/bin/env bash
# Call 1 (a fresh machine; carry .deps .baseline .baseline_a: `git archive REV` of eb08cb2, the
# previous stop, and of e430e14, change 1 alone, each less benchmarks/results, docs and
# tests/fuzz/corpus): the GPU checks of this tree (d3d8118, changes 1 and 2; scripts/gpu_check.sh,
# tests part) while the other trees' C++ engine loop and the host-backend floor probes build; then
# rounds that rotate the three trees (which runs first too) until ROUND_BUDGET_S: the C++ engine
# loop, block-slot storage at decode B1024 and B64 and at prefill 8k (64 MB of host memory ahead),
# per-request storage at decode B1024 (code no change touches: a control); and each round the
# floor probes of block-slot storage (decode B1024, prefill 8k) for the previous stop and this tree.
# Every line carries its round and tree.
# Usage (repository root): OUT=... benchmarks/results/h100-2026-11-26-fresh-entries/call1.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/fresh_entries_1}
logs=build/fresh_entries_1_logs
mkdir -p "$out" "$logs"
start=$(date +%s)
. scripts/common.sh  # nvcc on PATH
tag() { python3 benchmarks/results/tag_rounds.py "$@"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
prefix=()
[ -d .deps/usr ] && prefix=(-DCMAKE_PREFIX_PATH="$PWD/.deps/usr")
for t in baseline baseline_a; do
  ( cmake -S ".$t" -B "build/$t" -G Ninja -DCMAKE_BUILD_TYPE=Release "${prefix[@]}" \
      -DROUTING_REPLAY_BUILD_TESTS=OFF -DROUTING_REPLAY_BUILD_EXAMPLES=OFF &&
    cmake --build "build/$t" -j 3 --target engine_loop ) >"$logs/build_$t.log" 2>&1 &
done
cccl=$(dirname "$(command -v nvcc)")/../include/cccl
for t in base head; do
  inc=include; [ "$t" = base ] && inc=.baseline/include
  for probe in benchmarks/results/h200-2026-11-25-floors/block_slot_floor_probe.cpp \
               benchmarks/results/h100-2026-11-26-page-line/block_slot_prefill_floor_probe.cpp; do
    g++ -std=c++20 -O3 -DNDEBUG -pthread -I "$inc" -I benchmarks -I "$cccl" "$probe" -o "build/$(basename "$probe" .cpp)_$t" \
      >>"$logs/probes_build.log" 2>&1 &
  done
done
GPU_CHECK_PARTS=tests OUT="$logs/gpu_check" bash scripts/gpu_check.sh >"$logs/gpu_check_stdout.log" 2>&1
echo "gpu_check exit $? at $(( $(date +%s) - start )) s"
cp "$logs/gpu_check/summary.txt" "$out/gpu_check_summary.txt" 2>/dev/null; tail -n 8 "$out/gpu_check_summary.txt"
wait
echo "== built at $(( $(date +%s) - start )) s"; ls build/baseline/benchmarks/engine_loop build/baseline_a/benchmarks/engine_loop build/*floor_probe_*
for round in $(seq 1 20); do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-450}" ]; then echo "== round $round not started"; break; fi
  echo "== round $round at $(( $(date +%s) - start )) s"
  case $(( round % 3 )) in 1) trees="base a head" ;; 2) trees="a head base" ;; *) trees="head base a" ;; esac
  for tree in $trees; do
    exe=build/gpu/benchmarks/engine_loop
    [ "$tree" = base ] && exe=build/baseline/benchmarks/engine_loop
    [ "$tree" = a ] && exe=build/baseline_a/benchmarks/engine_loop
    "$exe" --backend cuda --mode both --copy device_scatter --storage block_slot --scenarios decode_B1024,decode_B64 \
      2>>"$out/errors.log" | tag round="$round" tree="$tree" >>"$out/engine_loop_cpp.jsonl"
    "$exe" --backend cuda --mode both --copy device_scatter --storage block_slot --scenarios prefill_8k \
      --host-memory-ahead 67108864 2>>"$out/errors.log" | tag round="$round" tree="$tree" ahead=64MB >>"$out/engine_loop_cpp.jsonl"
    "$exe" --backend cuda --mode both --copy device_scatter --storage per_request --scenarios decode_B1024 \
      2>>"$out/errors.log" | tag round="$round" tree="$tree" >>"$out/engine_loop_cpp.jsonl"
  done
  for tree in base head; do
    build/block_slot_floor_probe_$tree 600 | tag round="$round" tree="$tree" >>"$out/floor_probes.jsonl"
    build/block_slot_prefill_floor_probe_$tree 300 | tag round="$round" tree="$tree" >>"$out/floor_probes.jsonl"
  done
done
echo "== done in $(( $(date +%s) - start )) s"
