#!/usr/bin/env bash
# begin_probe.cpp against this tree and the staged baseline (.baseline/), on the machine it runs
# on (the host backend: no GPU needed), ROUNDS alternating rounds (default 5) of decode B1024,
# lockstep and staggered, warm and with the caches swept; one tagged JSON line per run.
# Usage (repository root): OUT=... benchmarks/results/h200-2026-11-25-planned/probe_rounds.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/planned_probe}
mkdir -p "$out"
here=benchmarks/results/h200-2026-11-25-planned
cccl=$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")/../include
build() {  # TREE OUTPUT
  g++ -std=c++20 -O3 -DNDEBUG -pthread -I "$1/include" -I benchmarks -I "$cccl/cccl" -isystem "$cccl" \
    "$here/begin_probe.cpp" -o "$2"
}
build . "$out/probe_head" & build .baseline "$out/probe_base" & wait
for round in $(seq "${ROUNDS:-5}"); do
  trees="base head"; [ $(( round % 2 )) = 0 ] && trees="head base"
  for tree in $trees; do
    for args in "1500 1024 0 0" "1500 1024 0 1" "1500 1024 1 0" "1500 1024 1 1"; do
      "$out/probe_$tree" $args | python3 -c 'import json, sys
r = json.loads(sys.stdin.read()); r.update(tree=sys.argv[1], round=int(sys.argv[2])); print(json.dumps(r))' \
        "$tree" "$round" >>"$out/begin_probe.jsonl"
    done
  done
done
python3 - "$out/begin_probe.jsonl" <<'PY'
import collections, json, statistics, sys
d = collections.defaultdict(list)
for t in open(sys.argv[1]):
    r = json.loads(t)
    d[(r["stagger"], r["cold"], r["tree"])].append(r["begin_us"])
for k in sorted(d):
    print("stagger", k[0], "cold", k[1], k[2], "begin_us median", round(statistics.median(d[k]), 1), d[k])
PY
