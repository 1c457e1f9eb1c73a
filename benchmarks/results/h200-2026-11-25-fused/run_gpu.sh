#!/usr/bin/env bash
# The drop-in's staged rows moved by the end-of-step kernel (no launch of their own) and the
# columnar plan built in place, this tree against the staged baseline (.baseline/,
# scripts/stage_baseline.sh 1184d9f), one lease on nvidia-h200 (carry .deps .baseline .peers).
# Both packages are built at once (this tree's into build/python-gpu-site, which
# scripts/python_gpu_check.sh then tests with PY_GPU_SKIP_BUILD=1), then rounds alternate the
# trees (which runs first too): the engine loop (none, Replay, the drop-in; eager and CUDA graph;
# decode B1 / B64 / B256 / B1024 and prefill 8k) and the side by side with vLLM PR 39917's capturer
# (the peer once a round, beside this tree's drop-in; the baseline's drop-in alone). Every line
# carries its round and tree. A round is not started past ROUND_BUDGET_S seconds (default 300).
# APIS, SCENARIOS: engine_loop.py's; SIDE_BY_SIDE=0 leaves the peer's script out.
# Usage (repository root): OUT=... benchmarks/results/h200-2026-11-25-fused/run_gpu.sh [rounds]
#   SKIP_BUILD=1 reuses both packages of an earlier call on the same (warm) machine.
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/fused_ab}
mkdir -p "$out"
start=$(date +%s)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$out/machine.txt"
site="$PWD/build/python-gpu-site"
base_site="$PWD/build/python-gpu-site-baseline"
if [ "${SKIP_BUILD:-0}" != 1 ] || [ ! -d "$site/routing_replay" ] || [ ! -d "$base_site/routing_replay" ]; then
  rm -rf "$site" "$base_site"
  python3 -m pip install -q --no-build-isolation --no-deps --target "$site" ./python >"$out/build.log" 2>&1 &
  head_pid=$!
  python3 -m pip install -q --no-build-isolation --no-deps --target "$base_site" .baseline/python \
    >"$out/build_baseline.log" 2>&1 &
  base_pid=$!
  wait "$head_pid" || { tail -30 "$out/build.log"; exit 1; }
  wait "$base_pid" || { tail -30 "$out/build_baseline.log"; exit 1; }
  echo "== built both in $(( $(date +%s) - start )) s"
fi
tag() {  # ROUND TREE: JSON lines on stdin -> the same with round and tree
  python3 -c 'import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        continue
    print(json.dumps(dict(round=sys.argv[1], tree=sys.argv[2], **r)))' "$1" "$2"
}
first=${FIRST_ROUND:-1}
for round in $(seq "$first" $(( first + ${1:-2} - 1 ))); do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-300}" ]; then
    echo "== round $round not started: $(( $(date +%s) - start )) s spent"; break
  fi
  echo "== round $round at $(( $(date +%s) - start )) s"
  trees="base head"; [ $(( round % 2 )) = 0 ] && trees="head base"
  for tree in $trees; do
    s=$site; impl="peer,dropin"
    [ "$tree" = base ] && { s=$base_site; impl=dropin; }
    PYTHONPATH="$s" python3 benchmarks/python/engine_loop.py --api "${APIS:-none,replay,dropin}" --modes eager,graph \
      --scenarios "${SCENARIOS:-decode_B1,decode_B64,decode_B256,decode_B1024,prefill_8k}" 2>>"$out/errors.log" |
      tag "$round" "$tree" >>"$out/python_engine_loop.jsonl"
    [ "${SIDE_BY_SIDE:-1}" = 1 ] || continue
    PYTHONPATH="$s" python3 .peers/engine_loop_vs_peer.py --copy device_scatter --impl "$impl" 2>>"$out/errors.log" |
      tag "$round" "$tree" >>"$out/peer_side_by_side_device_scatter.jsonl"
  done
done
python3 benchmarks/results/h200-2026-11-25-fused/medians.py "$out"
echo "== done in $(( $(date +%s) - start )) s"
