#!/usr/bin/env bash
# capture()'s flat hot path (this tree) against the staged baseline (.baseline/, scripts/
# stage_baseline.sh 73f7961: the hot path as method layers), one lease on nvidia-h200 (carry .deps
# .baseline .peers). Both packages are built at once, then rounds alternate the trees (which runs
# first too): benchmarks/python/capture_parts.py, the engine loop's eager decode steps (Replay and
# the drop-in), and the side by side with vLLM PR 39917's capturer (the peer once a round, the
# drop-in of each tree). Each line carries its round and tree. A round is not started past
# ROUND_BUDGET_S seconds (default 380), so the lease's 10 minutes are not overrun.
# Usage (repository root): OUT=... benchmarks/results/h200-2026-11-25-capture/run_gpu.sh [rounds]
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/capture_ab}
mkdir -p "$out"
start=$(date +%s)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
site="$PWD/build/python-gpu-site"
base_site="$PWD/build/python-gpu-site-baseline"
rm -rf "$site" "$base_site"
python3 -m pip install -q --no-build-isolation --no-deps --target "$site" ./python >"$out/build.log" 2>&1 &
head_pid=$!
python3 -m pip install -q --no-build-isolation --no-deps --target "$base_site" .baseline/python \
  >"$out/build_baseline.log" 2>&1 &
base_pid=$!
wait "$head_pid" || { tail -30 "$out/build.log"; exit 1; }
wait "$base_pid" || { tail -30 "$out/build_baseline.log"; exit 1; }
echo "== built both in $(( $(date +%s) - start )) s"
tag() {  # ROUND TREE: JSON lines on stdin -> the same with round and tree
  python3 -c 'import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        continue
    print(json.dumps(dict(round=int(sys.argv[1]), tree=sys.argv[2], **r)))' "$1" "$2"
}
for round in $(seq "${1:-2}"); do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-380}" ]; then
    echo "== round $round not started: $(( $(date +%s) - start )) s spent"; break
  fi
  echo "== round $round at $(( $(date +%s) - start )) s"
  trees="base head"; [ $(( round % 2 )) = 0 ] && trees="head base"
  for tree in $trees; do
    s=$site; impl="peer,dropin"
    [ "$tree" = base ] && { s=$base_site; impl=dropin; }
    PYTHONPATH="$s" python3 benchmarks/python/capture_parts.py 2>>"$out/errors.log" |
      tag "$round" "$tree" >>"$out/capture_parts.jsonl"
    PYTHONPATH="$s" python3 benchmarks/python/engine_loop.py --api replay,dropin --modes eager \
      --scenarios decode_B1,decode_B64,decode_B1024 2>>"$out/errors.log" |
      tag "$round" "$tree" >>"$out/python_engine_loop.jsonl"
    PYTHONPATH="$s" python3 .peers/engine_loop_vs_peer.py --copy device_scatter --impl "$impl" 2>>"$out/errors.log" |
      tag "$round" "$tree" >>"$out/peer_side_by_side_device_scatter.jsonl"
  done
done
python3 - "$out" <<'PY'
import collections, json, statistics, sys
d = collections.defaultdict(list)
for line in open(f"{sys.argv[1]}/capture_parts.jsonl"):
    r = json.loads(line)
    d[(r["part"], r["tree"])].append((r["warm_us"], r["cold_us"]))
for (part, tree), v in sorted(d.items()):
    print(f"{part:16} {tree}: warm {statistics.median(x for x, _ in v):.2f} cold {statistics.median(y for _, y in v):.2f} us")
PY
python3 benchmarks/python/summarize.py "$out/python_engine_loop.jsonl" "$out/peer_side_by_side_device_scatter.jsonl" | tail -n 60
echo "== done in $(( $(date +%s) - start )) s"
