#!/usr/bin/env bash
# Call 5 (a fresh machine; carry .deps .baseline; .baseline staged with scripts/stage_baseline.sh
# 7eee932, the stop before this session): the GPU checks of the final tree (position pages, the
# first eight page addresses in the request's entry; scripts/gpu_check.sh, tests part) while both trees' C++ engine loop and this tree's Python
# package build; the Python suite on the GPU (scripts/python_gpu_check.sh); then rounds that
# alternate the trees (which runs first too) until ROUND_BUDGET_S: the C++ engine loop, block-slot
# storage at prefill 8k (device scatter; device scatter and double_buffered with 64 MB of host
# memory ahead, which this tree's block-slot store takes as position pages made when built) and at
# decode B64 and B1024, and per-request storage at decode B64 and B1024 (unchanged: a control). Every line
# carries its round and tree. Builds log under build/call5_logs.
# Usage (repository root): OUT=... benchmarks/results/h100-2026-11-26-block-prefill/call5.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/block_prefill_5}
logs=build/call5_logs
mkdir -p "$out" "$logs"
start=$(date +%s)
export PYTHONUNBUFFERED=1
tag() { python3 benchmarks/results/tag_rounds.py "$@"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
prefix=()
[ -d .deps/usr ] && prefix=(-DCMAKE_PREFIX_PATH="$PWD/.deps/usr")
site="$PWD/build/python-gpu-site"
( rm -rf "$site" && python3 -m pip install -q --no-build-isolation --no-deps --target "$site" ./python ) \
  >"$logs/py_build.log" 2>&1 &
py_pid=$!
( cmake -S .baseline -B build/baseline -G Ninja -DCMAKE_BUILD_TYPE=Release "${prefix[@]}" \
    -DROUTING_REPLAY_BUILD_TESTS=OFF -DROUTING_REPLAY_BUILD_EXAMPLES=OFF &&
  cmake --build build/baseline -j 4 --target engine_loop ) >"$logs/build_base.log" 2>&1 &
GPU_CHECK_PARTS=tests OUT="$logs/gpu_check" bash scripts/gpu_check.sh >"$logs/gpu_check_stdout.log" 2>&1
echo "gpu_check exit $? at $(( $(date +%s) - start )) s"
cp "$logs/gpu_check/summary.txt" "$out/gpu_check_summary.txt" 2>/dev/null; tail -n 8 "$out/gpu_check_summary.txt"
wait "$py_pid"; echo "python package built (exit $?) at $(( $(date +%s) - start )) s"
wait
PY_GPU_SKIP_BUILD=1 scripts/python_gpu_check.sh >"$out/python_gpu_check.log" 2>&1
echo "python_gpu_check exit $? at $(( $(date +%s) - start )) s"
grep -E "passed|failed|bit-exact" "$out/python_gpu_check.log" | tail -3
for round in $(seq 1 12); do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-450}" ]; then echo "== round $round not started"; break; fi
  echo "== round $round at $(( $(date +%s) - start )) s"
  trees="base head"; [ $(( round % 2 )) = 0 ] && trees="head base"
  for tree in $trees; do
    exe=build/gpu/benchmarks/engine_loop; [ "$tree" = base ] && exe=build/baseline/benchmarks/engine_loop
    "$exe" --backend cuda --mode both --copy device_scatter --storage block_slot --scenarios prefill_8k \
      2>>"$out/errors.log" | tag round="$round" tree="$tree" >>"$out/engine_loop_cpp.jsonl"
    "$exe" --backend cuda --mode both --copy device_scatter,double_buffered --storage block_slot --scenarios prefill_8k \
      --host-memory-ahead 67108864 2>>"$out/errors.log" | tag round="$round" tree="$tree" ahead=64MB >>"$out/engine_loop_cpp.jsonl"
    "$exe" --backend cuda --mode both --copy device_scatter --storage block_slot --scenarios decode_B1024,decode_B64 \
      2>>"$out/errors.log" | tag round="$round" tree="$tree" >>"$out/engine_loop_cpp.jsonl"
    "$exe" --backend cuda --mode both --copy device_scatter --storage per_request --scenarios decode_B1024,decode_B64 \
      2>>"$out/errors.log" | tag round="$round" tree="$tree" >>"$out/engine_loop_cpp.jsonl"
  done
done
echo "== done in $(( $(date +%s) - start )) s"
