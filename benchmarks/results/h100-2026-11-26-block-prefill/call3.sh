#!/usr/bin/env bash
# Call 3 (a fresh machine; carry .deps .baseline .peers; .baseline staged with
# scripts/stage_baseline.sh 7eee932): the GPU checks of the final tree (scripts/gpu_check.sh, tests
# part: the randomized schedules now include KV blocks of 3 slots) while both trees' C++ engine loop
# and this tree's Python package build; then rounds until ROUND_BUDGET_S: the C++ engine loop of
# both trees, alternating (block-slot storage with device scatter at prefill 8k and decode B1024,
# per-request storage at decode B64 and B1024), then this tree's Python engine loop (none, Replay,
# the drop-in; eager and CUDA graph; decode B1 to B1024, prefill 8k) and the side by side with vLLM
# PR 39917's capturer. Every line carries its round and tree. Builds log under build/call3_logs.
# Usage (repository root): OUT=... benchmarks/results/h100-2026-11-26-block-prefill/call3.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/block_prefill_3}
logs=build/call3_logs
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
( cmake -S .baseline -B build/baseline -G Ninja -DCMAKE_BUILD_TYPE=Release "${prefix[@]}" \
    -DROUTING_REPLAY_BUILD_TESTS=OFF -DROUTING_REPLAY_BUILD_EXAMPLES=OFF &&
  cmake --build build/baseline -j 4 --target engine_loop ) >"$logs/build_base.log" 2>&1 &
GPU_CHECK_PARTS=tests OUT="$logs/gpu_check" bash scripts/gpu_check.sh >"$logs/gpu_check_stdout.log" 2>&1
echo "gpu_check exit $? at $(( $(date +%s) - start )) s"
cp "$logs/gpu_check/summary.txt" "$out/gpu_check_summary.txt" 2>/dev/null; tail -n 8 "$out/gpu_check_summary.txt"
wait
echo "== built at $(( $(date +%s) - start )) s"; python3 -c "import sys; sys.path.insert(0, '$site'); import routing_replay" && echo "package ok"
for round in $(seq 1 12); do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-450}" ]; then echo "== round $round not started"; break; fi
  echo "== round $round at $(( $(date +%s) - start )) s"
  trees="base head"; [ $(( round % 2 )) = 0 ] && trees="head base"
  for tree in $trees; do
    exe=build/gpu/benchmarks/engine_loop; [ "$tree" = base ] && exe=build/baseline/benchmarks/engine_loop
    "$exe" --backend cuda --mode both --copy device_scatter --storage block_slot --scenarios prefill_8k,decode_B1024 \
      2>>"$out/errors.log" | tag round="$round" tree="$tree" >>"$out/engine_loop_cpp.jsonl"
    "$exe" --backend cuda --mode both --copy device_scatter --storage per_request --scenarios decode_B1024,decode_B64 \
      2>>"$out/errors.log" | tag round="$round" tree="$tree" >>"$out/engine_loop_cpp.jsonl"
  done
  PYTHONPATH="$site" python3 benchmarks/python/engine_loop.py --api none,replay,dropin --modes eager,graph \
    --scenarios decode_B1,decode_B64,decode_B256,decode_B1024,prefill_8k 2>>"$out/errors.log" |
    tag round="$round" tree=head >>"$out/python_engine_loop.jsonl"
  PYTHONPATH="$site" python3 .peers/engine_loop_vs_peer.py --copy device_scatter --impl peer,dropin 2>>"$out/errors.log" |
    tag round="$round" tree=head >>"$out/peer_side_by_side_device_scatter.jsonl"
done
echo "== done in $(( $(date +%s) - start )) s"
