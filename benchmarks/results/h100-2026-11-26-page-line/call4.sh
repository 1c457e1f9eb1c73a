#!/usr/bin/env bash
# Call 4 (a fresh machine; carry .deps .baseline .baseline_a .baseline_b): each change of this
# session on its own, in one lease. Trees, each `git archive REV` with benchmarks/results, docs and
# the fuzz corpus left out: .baseline 12c45d4 (the previous stop), .baseline_a 18328d8 (change 1,
# the one-line entry), .baseline_b 33a320e (change 2, the prefetch in reserve()), and this tree
# (changes 3 and 4: the claim cuts, the blank page). Every tree's C++ engine loop is built
# (Release), then rounds rotate the four trees (which runs first too) until ROUND_BUDGET_S:
# block-slot storage with a device scatter at decode B1024 and at prefill 8k (64 MB of host memory
# ahead), eager and CUDA graph. Every line carries its round and tree.
# Usage (repository root): OUT=... benchmarks/results/h100-2026-11-26-page-line/call4.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/page_line_4}
logs=build/page_line_4_logs
mkdir -p "$out" "$logs"
start=$(date +%s)
. scripts/common.sh  # nvcc on PATH
tag() { python3 benchmarks/results/tag_rounds.py "$@"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
prefix=()
[ -d .deps/usr ] && prefix=(-DCMAKE_PREFIX_PATH="$PWD/.deps/usr")
for t in baseline baseline_a baseline_b head; do
  src=".$t"; [ "$t" = head ] && src=.
  ( cmake -S "$src" -B "build/$t" -G Ninja -DCMAKE_BUILD_TYPE=Release "${prefix[@]}" \
      -DROUTING_REPLAY_BUILD_TESTS=OFF -DROUTING_REPLAY_BUILD_EXAMPLES=OFF &&
    cmake --build "build/$t" -j 4 --target engine_loop ) >"$logs/build_$t.log" 2>&1 &
done
wait
echo "== built at $(( $(date +%s) - start )) s"; ls build/*/benchmarks/engine_loop
for round in $(seq 1 40); do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-450}" ]; then echo "== round $round not started"; break; fi
  echo "== round $round at $(( $(date +%s) - start )) s"
  case $(( round % 4 )) in 1) trees="base a b head" ;; 2) trees="a b head base" ;; 3) trees="b head base a" ;; *) trees="head base a b" ;; esac
  for tree in $trees; do
    case $tree in base) dir=baseline ;; a) dir=baseline_a ;; b) dir=baseline_b ;; *) dir=head ;; esac
    exe=build/$dir/benchmarks/engine_loop
    "$exe" --backend cuda --mode both --copy device_scatter --storage block_slot --scenarios decode_B1024 \
      2>>"$out/errors.log" | tag round="$round" tree="$tree" >>"$out/engine_loop_cpp.jsonl"
    "$exe" --backend cuda --mode both --copy device_scatter --storage block_slot --scenarios prefill_8k \
      --host-memory-ahead 67108864 2>>"$out/errors.log" | tag round="$round" tree="$tree" ahead=64MB >>"$out/engine_loop_cpp.jsonl"
  done
done
echo "== done in $(( $(date +%s) - start )) s"
