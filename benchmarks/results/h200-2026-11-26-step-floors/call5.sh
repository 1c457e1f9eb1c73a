#!/usr/bin/env bash
# Call 5 of this folder, a fresh machine (carry .deps .baseline; .baseline as for call3.sh): both
# trees' C++ engine loop built at once, then alternating rounds (which tree first alternates too) of
# per-request storage with device scatter, eager and CUDA graph: decode B1024 then B64 in one
# process (as calls 3 and 4 ran them), and decode B64 alone, until ROUND_BUDGET_S. Call 4 read
# head's B64 `host_us` and `begin_us` above base's in most rounds, where the floor probe read
# them lower; this call asks whether that holds. Every line carries its round, tree and run.
# Usage (repository root): OUT=... benchmarks/results/h200-2026-11-26-step-floors/call5.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/step_floors_5}
logs=build/call5_logs
mkdir -p "$out" "$logs"
start=$(date +%s)
tag() { python3 benchmarks/results/tag_rounds.py "$@"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
prefix=()
[ -d .deps/usr ] && prefix=(-DCMAKE_PREFIX_PATH="$PWD/.deps/usr")
for tree in head base; do
  src=.; dir=build/gpu; [ "$tree" = base ] && { src=.baseline; dir=build/baseline; }
  ( cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${prefix[@]}" \
      -DROUTING_REPLAY_BUILD_TESTS=OFF -DROUTING_REPLAY_BUILD_EXAMPLES=OFF &&
    cmake --build "$dir" -j 8 --target engine_loop ) >"$logs/build_$tree.log" 2>&1 &
done
wait
echo "== built at $(( $(date +%s) - start )) s"
for round in $(seq 1 30); do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-380}" ]; then echo "== round $round not started"; break; fi
  trees="base head"; [ $(( round % 2 )) = 0 ] && trees="head base"
  for tree in $trees; do
    exe=build/gpu/benchmarks/engine_loop; [ "$tree" = base ] && exe=build/baseline/benchmarks/engine_loop
    for run in both b64; do
      scen=decode_B1024,decode_B64; [ "$run" = b64 ] && scen=decode_B64
      "$exe" --backend cuda --mode both --copy device_scatter --storage per_request --scenarios "$scen" \
        2>>"$out/errors.log" | tag round="$round" tree="$tree" run="$run" >>"$out/engine_loop_cpp.jsonl"
    done
  done
done
python3 - "$out/engine_loop_cpp.jsonl" <<'PY'
import collections, json, statistics, sys
d = collections.defaultdict(list)
for t in open(sys.argv[1]):
    r = json.loads(t)
    d[(r["run"], r["scenario"], r["mode"], r["tree"])].append(r)
for k in sorted(d):
    v = d[k]
    m = lambda f: round(statistics.median(r[f] for r in v), 2)
    print(*k, "host_us", m("host_us"), "begin_us", m("begin_us"), "fwd_gpu_us", m("fwd_gpu_us"), "rounds", len(v))
PY
echo "== done in $(( $(date +%s) - start )) s"
