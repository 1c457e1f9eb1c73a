#!/usr/bin/env bash
# Call 3 of this folder, a fresh machine (carry .deps .baseline .peers): both Python packages and
# both trees' C++ engine loop built at once, then rounds that alternate the trees (which runs first
# too): the C++ engine loop (device scatter, both storages, eager and CUDA graph, decode B1024 and
# B64) and the Python engine loop (Replay and the drop-in, eager and CUDA graph, decode B64 and
# B1024), until ROUND_BUDGET_S. Every line carries its round and tree.
# Usage (repository root): OUT=... benchmarks/results/gpu-2026-11-25-per-request-floor/call3.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/per_request_floor_3}
mkdir -p "$out"
start=$(date +%s)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
prefix=()
[ -d .deps/usr ] && prefix=(-DCMAKE_PREFIX_PATH="$PWD/.deps/usr")
( OUT="$out/py_build" benchmarks/results/h200-2026-11-25-fused/run_gpu.sh 0 >"$out/py_build.log" 2>&1 ) &
py=$!
for tree in head base; do
  src=.; dir=build/gpu; [ "$tree" = base ] && { src=.baseline; dir=build/baseline; }
  ( cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${prefix[@]}" \
      -DROUTING_REPLAY_BUILD_TESTS=OFF -DROUTING_REPLAY_BUILD_EXAMPLES=OFF &&
    cmake --build "$dir" -j 4 --target engine_loop ) >"$out/build_$tree.log" 2>&1 &
done
wait
echo "== built at $(( $(date +%s) - start )) s"; grep "built both" "$out/py_build.log"
tag() { python3 -c 'import json, sys
for line in sys.stdin:
    try: r = json.loads(line)
    except ValueError: continue
    print(json.dumps(dict(round=int(sys.argv[1]), tree=sys.argv[2], **r)))' "$@"; }
for round in $(seq 1 12); do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-420}" ]; then echo "== round $round not started"; break; fi
  trees="base head"; [ $(( round % 2 )) = 0 ] && trees="head base"
  for tree in $trees; do
    exe=build/gpu/benchmarks/engine_loop; site=build/python-gpu-site
    [ "$tree" = base ] && { exe=build/baseline/benchmarks/engine_loop; site=build/python-gpu-site-baseline; }
    "$exe" --backend cuda --mode both --copy device_scatter --storage all --scenarios decode_B1024,decode_B64 \
      2>>"$out/errors.log" | tag "$round" "$tree" >>"$out/engine_loop_cpp.jsonl"
    PYTHONPATH="$site" python3 benchmarks/python/engine_loop.py --api replay,dropin --modes eager,graph \
      --scenarios decode_B64,decode_B1024 2>>"$out/errors.log" | tag "$round" "$tree" >>"$out/python_engine_loop.jsonl"
  done
done
python3 - "$out" <<'PY'
import collections, json, statistics, sys, os
d = collections.defaultdict(list)
for t in open(os.path.join(sys.argv[1], "engine_loop_cpp.jsonl")):
    r = json.loads(t)
    d[("cpp", r.get("policy"), r.get("mode"), r.get("scenario"), r["tree"])].append((r["begin_us"], r["host_us"]))
for t in open(os.path.join(sys.argv[1], "python_engine_loop.jsonl")):
    r = json.loads(t)
    d[("py", r["api"], r["mode"], r["scenario"], r["tree"])].append((r.get("begin_us") or 0, r.get("host_us") or 0,
                                                                   r.get("plan_us") or 0, r.get("end_us") or 0))
for k in sorted(d):
    v = d[k]
    med = [round(statistics.median(x[i] for x in v), 1) for i in range(len(v[0]))]
    print(*k, "medians (begin, host[, plan, end])", med, "rounds", len(v))
PY
echo "== done in $(( $(date +%s) - start )) s"
