#!/usr/bin/env bash
# Call 5 (a fresh machine; carry .deps .baseline .baseline_b: `git archive REV` of eb08cb2, the
# previous stop, and of b1f15d7, changes 1 to 6 (call 4's head), each less benchmarks/results, docs
# and tests/fuzz/corpus): the C++ engine loop of the three trees and of this one (558d871: a prefill
# chunk's position entries written with non-temporal stores) built side by side, with the
# host-backend floor probe of block-slot prefill for this tree; then rounds that rotate the three
# (which runs first too) until ROUND_BUDGET_S: block-slot storage at decode B1024 and at prefill 8k
# (64 MB of host memory ahead), per-request storage at decode B1024 (a control), eager and CUDA
# graph, and the floor probe. Every line carries its round and tree.
# Usage (repository root): OUT=... benchmarks/results/h100-2026-11-26-fresh-entries/call5.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/fresh_entries_5}
logs=build/fresh_entries_5_logs
mkdir -p "$out" "$logs"
start=$(date +%s)
. scripts/common.sh  # nvcc on PATH
tag() { python3 benchmarks/results/tag_rounds.py "$@"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
prefix=()
[ -d .deps/usr ] && prefix=(-DCMAKE_PREFIX_PATH="$PWD/.deps/usr")
for t in "" baseline baseline_b; do
  src=".$t"; dir="build/$t"; [ -z "$t" ] && { src=.; dir=build/head; }
  ( cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${prefix[@]}" \
      -DROUTING_REPLAY_BUILD_TESTS=OFF -DROUTING_REPLAY_BUILD_EXAMPLES=OFF &&
    cmake --build "$dir" -j 5 --target engine_loop ) >"$logs/build_${t:-head}.log" 2>&1 &
done
cccl=$(dirname "$(command -v nvcc)")/../include/cccl
g++ -std=c++20 -O3 -DNDEBUG -pthread -I include -I benchmarks -I "$cccl" \
  benchmarks/results/h100-2026-11-26-page-line/block_slot_prefill_floor_probe.cpp -o build/block_slot_prefill_floor_probe_head \
  >"$logs/probe_build.log" 2>&1 &
wait
echo "== built at $(( $(date +%s) - start )) s"
ls build/head/benchmarks/engine_loop build/baseline/benchmarks/engine_loop build/baseline_b/benchmarks/engine_loop || { tail -n 20 "$logs"/build_*.log; exit 1; }
for round in $(seq 1 40); do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-450}" ]; then echo "== round $round not started"; break; fi
  echo "== round $round at $(( $(date +%s) - start )) s"
  case $(( round % 3 )) in 1) trees="base b head" ;; 2) trees="b head base" ;; *) trees="head base b" ;; esac
  for tree in $trees; do
    exe=build/head/benchmarks/engine_loop
    [ "$tree" = base ] && exe=build/baseline/benchmarks/engine_loop
    [ "$tree" = b ] && exe=build/baseline_b/benchmarks/engine_loop
    "$exe" --backend cuda --mode both --copy device_scatter --storage block_slot,per_request --scenarios decode_B1024 \
      2>>"$out/errors.log" | tag round="$round" tree="$tree" >>"$out/engine_loop_cpp.jsonl"
    "$exe" --backend cuda --mode both --copy device_scatter --storage block_slot --scenarios prefill_8k \
      --host-memory-ahead 67108864 2>>"$out/errors.log" | tag round="$round" tree="$tree" ahead=64MB >>"$out/engine_loop_cpp.jsonl"
  done
  build/block_slot_prefill_floor_probe_head 300 | tag round="$round" tree=head >>"$out/floor_probes.jsonl"
done
echo "== done in $(( $(date +%s) - start )) s"
