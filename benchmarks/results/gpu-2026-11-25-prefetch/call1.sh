#!/usr/bin/env bash
# First GPU call of the session (carry .deps .peers .variants): the block-slot probe variants on the
# machine's CPU, then this tree's Python package, the side by side with vLLM PR 39917's capturer
# (device_scatter, the drop-in's default, and double_buffered, the issue's table) and the Python
# engine loop (none, Replay, drop-in; eager and CUDA graph; every scenario).
# Usage (repository root): OUT=... benchmarks/results/gpu-2026-11-25-prefetch/call1.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/call1}
mkdir -p "$out"
start=$(date +%s)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
lscpu | grep -E "Model name|^CPU\(s\)" >>"$out/machine.txt"
OUT="$out/probe" benchmarks/results/gpu-2026-11-25-prefetch/probe_variants.sh
echo "== probes done at $(( $(date +%s) - start )) s"
site="$PWD/build/python-gpu-site"
rm -rf "$site"
python3 -m pip install -q --no-build-isolation --no-deps --target "$site" ./python >"$out/python_build.log" 2>&1 ||
  { tail -30 "$out/python_build.log"; exit 1; }
echo "== python package built at $(( $(date +%s) - start )) s"
export PYTHONPATH="$site"
for round in 1 2; do
  for copy in device_scatter double_buffered; do
    python3 .peers/engine_loop_vs_peer.py --copy "$copy" --impl peer,dropin 2>>"$out/errors.log" |
      python3 -c 'import json, sys
for line in sys.stdin:
    try: r = json.loads(line)
    except ValueError: continue
    print(json.dumps(dict(round=int(sys.argv[1]), copy=sys.argv[2], **r)))' "$round" "$copy" >>"$out/peer_side_by_side.jsonl"
    echo "== side by side $copy round $round at $(( $(date +%s) - start )) s"
  done
  [ $(( $(date +%s) - start )) -gt "${LOOP_AFTER_S:-420}" ] && break
done
if [ $(( $(date +%s) - start )) -lt "${LOOP_BEFORE_S:-470}" ]; then
  python3 benchmarks/python/engine_loop.py --api none,replay,dropin --modes eager,graph >"$out/python_engine_loop.jsonl" 2>>"$out/errors.log"
fi
echo "== done in $(( $(date +%s) - start )) s"
