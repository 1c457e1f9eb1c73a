#!/usr/bin/env bash
# Call 1 of this folder, a fresh machine (carry .deps .peers): the GPU checks of this tree
# (scripts/gpu_check.sh, tests part) while the Python package builds, the Python suite on the GPU
# (scripts/python_gpu_check.sh on that package), then rounds of this tree alone until
# ROUND_BUDGET_S: the C++ engine loop (device scatter, both storages, eager and CUDA graph, decode
# B64 and B1024; prefill 8k with 64 MB of host memory ahead), the Python engine loop (none, Replay, the drop-in; eager and CUDA
# graph; decode B1 to B1024, prefill 8k) and the side by side with vLLM PR 39917's capturer.
# Every line carries its round. Builds log under build/verify_logs.
# Usage (repository root): OUT=... benchmarks/results/h100-2026-11-26-verify/call1.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/verify_1}
logs=build/verify_logs
mkdir -p "$out" "$logs"
start=$(date +%s)
export PYTHONUNBUFFERED=1
tag() { python3 benchmarks/results/tag_rounds.py "$@"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
git log -1 --format=%H >>"$out/machine.txt" 2>/dev/null
site="$PWD/build/python-gpu-site"
( rm -rf "$site" && python3 -m pip install -q --no-build-isolation --no-deps --target "$site" ./python ) \
  >"$logs/py_build.log" 2>&1 &
py_pid=$!
GPU_CHECK_PARTS=tests OUT="$logs/gpu_check" bash scripts/gpu_check.sh >"$logs/gpu_check_stdout.log" 2>&1
echo "gpu_check exit $? at $(( $(date +%s) - start )) s"
cp "$logs/gpu_check/summary.txt" "$out/gpu_check_summary.txt" 2>/dev/null; tail -n 8 "$out/gpu_check_summary.txt"
wait "$py_pid"; echo "python package built (exit $?) at $(( $(date +%s) - start )) s"
PY_GPU_SKIP_BUILD=1 scripts/python_gpu_check.sh >"$out/python_gpu_check.log" 2>&1
echo "python_gpu_check exit $? at $(( $(date +%s) - start )) s"
grep -E "passed|failed|bit-exact" "$out/python_gpu_check.log" | tail -3
for round in $(seq 1 12); do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-450}" ]; then echo "== round $round not started"; break; fi
  echo "== round $round at $(( $(date +%s) - start )) s"
  build/gpu/benchmarks/engine_loop --backend cuda --mode both --copy device_scatter --storage all \
    --scenarios decode_B1024,decode_B64 2>>"$out/errors.log" | tag round="$round" tree=head >>"$out/engine_loop_cpp.jsonl"
  build/gpu/benchmarks/engine_loop --backend cuda --mode both --copy device_scatter --storage all \
    --scenarios prefill_8k --host-memory-ahead 67108864 2>>"$out/errors.log" |
    tag round="$round" tree=head ahead=64MB >>"$out/engine_loop_cpp.jsonl"
  PYTHONPATH="$site" python3 benchmarks/python/engine_loop.py --api none,replay,dropin --modes eager,graph \
    --scenarios decode_B1,decode_B64,decode_B256,decode_B1024,prefill_8k 2>>"$out/errors.log" |
    tag round="$round" tree=head >>"$out/python_engine_loop.jsonl"
  PYTHONPATH="$site" python3 .peers/engine_loop_vs_peer.py --copy device_scatter --impl peer,dropin 2>>"$out/errors.log" |
    tag round="$round" tree=head >>"$out/peer_side_by_side_device_scatter.jsonl"
done
echo "== done in $(( $(date +%s) - start )) s"
