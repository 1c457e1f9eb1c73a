#!/usr/bin/env bash
# Calls 3 and 4 of this folder (call 3's GPU test build failed: the tests' fault-injecting backend
# lacked the new pinned-memory calls; call 4 ran after the fix), a fresh machine (carry .deps .baseline .peers; .baseline staged with
# scripts/stage_baseline.sh e6cebb0, the tree before the op list was written in place): the GPU
# checks of this tree (scripts/gpu_check.sh, tests part) while both trees' C++ engine loop, floor
# probe and Python package build; then rounds that alternate the trees (which runs first too):
# step_floor_probe, the C++ engine loop (device scatter, both storages, eager and CUDA graph, decode
# B1024 and B64) and the Python engine loop (Replay and the drop-in, eager and CUDA graph, decode
# B64 and B1024), until ROUND_BUDGET_S. Every line carries its round and tree.
# Only six files go to $OUT (a call returns eight): builds log under build/call3_logs.
# Usage (repository root): OUT=... benchmarks/results/h200-2026-11-26-step-floors/call3.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
here=benchmarks/results/h200-2026-11-26-step-floors
out=${OUT:-build/step_floors_3}
logs=build/call3_logs
mkdir -p "$out" "$logs"
start=$(date +%s)
export PYTHONUNBUFFERED=1
tag() { python3 benchmarks/results/tag_rounds.py "$@"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
prefix=()
[ -d .deps/usr ] && prefix=(-DCMAKE_PREFIX_PATH="$PWD/.deps/usr")
( OUT="$logs/py_build" benchmarks/results/h200-2026-11-25-fused/run_gpu.sh 0 >"$logs/py_build.log" 2>&1 ) &
( cmake -S .baseline -B build/baseline -G Ninja -DCMAKE_BUILD_TYPE=Release "${prefix[@]}" \
    -DROUTING_REPLAY_BUILD_TESTS=OFF -DROUTING_REPLAY_BUILD_EXAMPLES=OFF &&
  cmake --build build/baseline -j 4 --target engine_loop ) >"$logs/build_base.log" 2>&1 &
for tree in head base; do  # binaries stay out of $OUT (files there come back to the caller)
  inc=include; [ "$tree" = base ] && inc=.baseline/include
  nvcc -std=c++20 -O3 -DNDEBUG -arch=native -I "$inc" -I benchmarks "$here/step_floor_probe.cu" \
    -o "build/step_floor_probe_$tree" >"$logs/build_probe_$tree.log" 2>&1 &
done
GPU_CHECK_PARTS=tests OUT="$logs/gpu_check" bash scripts/gpu_check.sh >"$out/gpu_check_stdout.log" 2>&1
echo "gpu_check exit $? at $(( $(date +%s) - start )) s"; tail -n 8 "$logs/gpu_check/summary.txt" 2>/dev/null
wait
echo "== built at $(( $(date +%s) - start )) s"; grep "built both" "$logs/py_build.log"
for round in $(seq 1 12); do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-450}" ]; then echo "== round $round not started"; break; fi
  echo "== round $round at $(( $(date +%s) - start )) s"
  trees="base head"; [ $(( round % 2 )) = 0 ] && trees="head base"
  for tree in $trees; do
    exe=build/gpu/benchmarks/engine_loop; site=build/python-gpu-site
    [ "$tree" = base ] && { exe=build/baseline/benchmarks/engine_loop; site=build/python-gpu-site-baseline; }
    "build/step_floor_probe_$tree" 800 300 2>>"$out/errors.log" | tag round="$round" tree="$tree" >>"$out/step_floor_probe.jsonl"
    "$exe" --backend cuda --mode both --copy device_scatter --storage all --scenarios decode_B1024,decode_B64 \
      2>>"$out/errors.log" | tag round="$round" tree="$tree" >>"$out/engine_loop_cpp.jsonl"
    PYTHONPATH="$site" python3 benchmarks/python/engine_loop.py --api replay,dropin --modes eager,graph \
      --scenarios decode_B64,decode_B1024 2>>"$out/errors.log" | tag round="$round" tree="$tree" >>"$out/python_engine_loop.jsonl"
  done
done
python3 "$here/summary.py" "$out"
echo "== done in $(( $(date +%s) - start )) s"
