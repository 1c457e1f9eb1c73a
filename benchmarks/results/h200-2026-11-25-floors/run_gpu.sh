#!/usr/bin/env bash
# One lease on nvidia-h200 (carry .deps .baseline .peers): the block-slot probe on the host's CPU,
# then the package built once and three rounds of the side by side with vLLM PR 39917's capturer
# (device_scatter) and the Python engine loop with the floors (api none and launch_floor) beside
# replay and the drop-in. Each line carries its round; a round is not started past ROUND_BUDGET_S
# seconds so the lease's 10 minutes are not overrun.
# Usage (repository root): OUT=... benchmarks/results/h200-2026-11-25-floors/run_gpu.sh [rounds]
# (FLOORS_PROBE=0 skips the probe; ROUND_BUDGET_S, default 330; FLOORS_SCENARIOS: engine_loop.py's
# --scenarios)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../.."
out=${OUT:-build/floors}
mkdir -p "$out"
start=$(date +%s)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
nproc >>"$out/machine.txt"
git rev-parse HEAD >>"$out/machine.txt" 2>/dev/null

if [ "${FLOORS_PROBE:-1}" = 1 ]; then
  echo "== block-slot probe (host backend, this machine's CPU)"
  bash "$here/run_probe.sh" 4 >"$out/block_slot_floor_probe.jsonl" 2>"$out/probe.err"
  echo "   $(wc -l <"$out/block_slot_floor_probe.jsonl") lines in $(( $(date +%s) - start )) s"
fi

PY_BENCH_PARTS=none OUT="$out" bash scripts/python_gpu_bench.sh || { echo "build failed"; exit 1; }
site="$PWD/build/python-gpu-site"
tag() { python3 -c 'import json, sys
for line in sys.stdin:
    r = json.loads(line); print(json.dumps(dict(round=int(sys.argv[1]), **r)))' "$1"; }
: >"$out/peer_side_by_side_device_scatter_rounds.jsonl"
: >"$out/python_engine_loop_rounds.jsonl"
for round in $(seq "${1:-3}"); do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-330}" ]; then
    echo "== round $round not started: $(( $(date +%s) - start )) s spent"; break
  fi
  echo "== round $round at $(( $(date +%s) - start )) s"
  PYTHONPATH="$site" python3 .peers/engine_loop_vs_peer.py --copy device_scatter 2>>"$out/errors.log" |
    tag "$round" >>"$out/peer_side_by_side_device_scatter_rounds.jsonl"
  PYTHONPATH="$site" python3 benchmarks/python/engine_loop.py --api none,replay,dropin,launch_floor \
    --modes eager,graph --scenarios "${FLOORS_SCENARIOS:-decode_B1,decode_B64,decode_B256,decode_B1024,prefill_8k}" 2>>"$out/errors.log" |
    tag "$round" >>"$out/python_engine_loop_rounds.jsonl"
done
python3 benchmarks/python/summarize.py "$out/python_engine_loop_rounds.jsonl" | tail -n 40
python3 benchmarks/python/summarize.py "$out/peer_side_by_side_device_scatter_rounds.jsonl" | tail -n 30
echo "== done in $(( $(date +%s) - start )) s"
