#!/usr/bin/env bash
# Call 5 of this folder, a fresh machine (carry .deps .baseline .peers; .baseline staged with
# scripts/stage_baseline.sh f90cf95, the tree before launch_async moved to cudaLaunchKernelEx):
# the GPU checks of this tree (scripts/gpu_check.sh, tests part) while both Python packages, the
# baseline's C++ engine loop and launch_probe.cu build; the launch probe; the Python suite on the
# GPU for this tree's package (scripts/python_gpu_check.sh); then alternating rounds (which tree
# first alternates too) of the C++ engine loop (device scatter, both storages, eager and CUDA
# graph, decode B1024 and B64) until ROUND_BUDGET_S. Only files of this call go to $OUT.
# Usage (repository root): OUT=... benchmarks/results/h200-2026-11-26-planner-trim/call5.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
here=benchmarks/results/h200-2026-11-26-planner-trim
out=${OUT:-build/planner_trim_5}
logs=build/call5_logs
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
nvcc -std=c++20 -O3 -DNDEBUG -arch=native -I include "$here/launch_probe.cu" -o build/launch_probe \
  >"$logs/build_launch_probe.log" 2>&1 &
GPU_CHECK_PARTS=tests OUT="$logs/gpu_check" bash scripts/gpu_check.sh >"$logs/gpu_check_stdout.log" 2>&1
echo "gpu_check exit $? at $(( $(date +%s) - start )) s"
cp "$logs/gpu_check/summary.txt" "$out/gpu_check_summary.txt" 2>/dev/null; tail -n 8 "$out/gpu_check_summary.txt"
wait
echo "== built at $(( $(date +%s) - start )) s"; grep "built both" "$logs/py_build.log"
build/launch_probe | tee "$out/launch_probe.jsonl"
PY_GPU_SKIP_BUILD=1 scripts/python_gpu_check.sh >"$out/python_gpu_check.log" 2>&1
echo "python_gpu_check exit $? at $(( $(date +%s) - start )) s"
grep -E "passed|failed|bit-exact" "$out/python_gpu_check.log" | tail -3
for round in $(seq 1 40); do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-460}" ]; then echo "== round $round not started"; break; fi
  trees="base head"; [ $(( round % 2 )) = 0 ] && trees="head base"
  for tree in $trees; do
    exe=build/gpu/benchmarks/engine_loop; [ "$tree" = base ] && exe=build/baseline/benchmarks/engine_loop
    "$exe" --backend cuda --mode both --copy device_scatter --storage all --scenarios decode_B1024,decode_B64 \
      2>>"$out/errors.log" | tag round="$round" tree="$tree" >>"$out/engine_loop_cpp.jsonl"
  done
done
python3 "$here/summary_cpp.py" "$out/engine_loop_cpp.jsonl"
echo "== done in $(( $(date +%s) - start )) s"
