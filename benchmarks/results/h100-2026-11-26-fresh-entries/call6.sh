#!/usr/bin/env bash
# Call 6 (a fresh machine; carry .deps .peers; .peers is a copy of ../shared/peers), on the final
# library (558d871, and what follows it: documents and results):
# the GPU checks of this tree (scripts/gpu_check.sh, tests part), its Python package built for
# the GPU, the Python suite on the GPU
# (scripts/python_gpu_check.sh: graph and compile cases, example (a)), then rounds until
# ROUND_BUDGET_S of this tree's Python engine loop (none, Replay, the drop-in; eager and CUDA graph;
# decode B1 to B1024, prefill 8k) and the side by side with vLLM PR 39917's capturer
# (.peers/engine_loop_vs_peer.py, device scatter). Every line carries its round.
# Usage (repository root): OUT=... benchmarks/results/h100-2026-11-26-fresh-entries/call6.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/fresh_entries_6}
mkdir -p "$out"
start=$(date +%s)
export PYTHONUNBUFFERED=1
. scripts/common.sh  # nvcc on PATH
tag() { python3 benchmarks/results/tag_rounds.py "$@"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
site="$PWD/build/python-gpu-site"
GPU_CHECK_PARTS=tests OUT="$out/gpu_check" bash scripts/gpu_check.sh >"$out/gpu_check_stdout.log" 2>&1
echo "gpu_check exit $? at $(( $(date +%s) - start )) s"
mv "$out/gpu_check/summary.txt" "$out/gpu_check_summary.txt" 2>/dev/null; rm -rf "$out/gpu_check" "$out/gpu_check_stdout.log"
tail -n 8 "$out/gpu_check_summary.txt"
scripts/python_gpu_check.sh >"$out/python_gpu_check.log" 2>&1
echo "python_gpu_check exit $? at $(( $(date +%s) - start )) s"
grep -E "passed|failed|bit-exact" "$out/python_gpu_check.log" | tail -3
for round in $(seq 1 6); do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-450}" ]; then echo "== round $round not started"; break; fi
  echo "== round $round at $(( $(date +%s) - start )) s"
  PYTHONPATH="$site" python3 benchmarks/python/engine_loop.py --api none,replay,dropin --modes eager,graph \
    --scenarios decode_B1,decode_B64,decode_B256,decode_B1024,prefill_8k 2>>"$out/errors.log" |
    tag round="$round" tree=head >>"$out/python_engine_loop.jsonl"
  PYTHONPATH="$site" python3 .peers/engine_loop_vs_peer.py --copy device_scatter --impl peer,dropin 2>>"$out/errors.log" |
    tag round="$round" tree=head >>"$out/peer_side_by_side_device_scatter.jsonl"
done
echo "== done in $(( $(date +%s) - start )) s"
