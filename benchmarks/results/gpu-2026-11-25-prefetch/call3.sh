#!/usr/bin/env bash
# After call2.sh on the same warm machine (its package in build/python-gpu-site; carry .peers):
# the side by side's harness floor (benchmarks/python/harness_floor.py: vLLM's post-forward call
# with a capturer that does nothing, beside the drop-in and the peer), then the Python engine loop
# (none, Replay, drop-in; eager and CUDA graph; every scenario) if time is left.
# Usage (repository root): OUT=... benchmarks/results/gpu-2026-11-25-prefetch/call3.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/call3}
mkdir -p "$out"
start=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/build/python-gpu-site"
[ -d build/python-gpu-site/routing_replay ] ||
  python3 -m pip install -q --no-build-isolation --no-deps --target build/python-gpu-site ./python >"$out/python_build.log" 2>&1
for copy in device_scatter double_buffered; do
  python3 benchmarks/python/harness_floor.py --peers .peers --copy "$copy" >>"$out/harness_floor.jsonl" 2>>"$out/errors.log"
  echo "== harness floor $copy at $(( $(date +%s) - start )) s"
done
python3 - "$out/harness_floor.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "scenario" in r:
        print(r["scenario"], r["capturer"], r["host_path_us"], r.get("over_floor_us", ""))
    else:
        print(r)
PY
if [ $(( $(date +%s) - start )) -lt "${LOOP_BEFORE_S:-300}" ]; then
  python3 benchmarks/python/engine_loop.py --api none,replay,dropin --modes eager,graph >"$out/python_engine_loop.jsonl" 2>>"$out/errors.log"
  echo "== engine loop at $(( $(date +%s) - start )) s"
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$out/machine.txt"
echo "== done in $(( $(date +%s) - start )) s"
