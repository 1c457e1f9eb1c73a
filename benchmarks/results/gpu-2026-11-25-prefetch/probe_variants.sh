#!/usr/bin/env bash
# ../h200-2026-11-25-floors/block_slot_floor_probe.cpp (block-slot begin_step at decode B1024 on the host backend, beside
# the floor of its accesses) built against each variant of include/ under .variants/ (staged by
# hand from this folder's README, carried with `carry .variants`), ROUNDS alternating rounds
# (default 6), on the machine it runs on (no GPU needed). One tagged JSON line per run, then medians.
# Usage (repository root): OUT=... benchmarks/results/gpu-2026-11-25-prefetch/probe_variants.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/probe_variants}
mkdir -p "$out"
cccl=$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")/../include
variants=${VARIANTS:-$(ls .variants)}
for v in $variants; do
  g++ -std=c++20 -O3 -DNDEBUG -pthread -I ".variants/$v/include" -I benchmarks -I "$cccl/cccl" -isystem "$cccl" \
    benchmarks/results/h200-2026-11-25-floors/block_slot_floor_probe.cpp -o "$out/probe_$v" &
done
wait
for round in $(seq "${ROUNDS:-6}"); do
  order=$variants; [ $(( round % 2 )) = 0 ] && order=$(echo "$variants" | tr ' ' '\n' | tac | tr '\n' ' ')
  for v in $order; do
    "$out/probe_$v" "${STEPS:-1500}" | python3 -c 'import json, sys
r = json.loads(sys.stdin.read()); r.update(variant=sys.argv[1], round=int(sys.argv[2])); print(json.dumps(r))' \
      "$v" "$round" >>"$out/block_slot_probe.jsonl"
  done
done
python3 - "$out/block_slot_probe.jsonl" <<'PY'
import collections, json, statistics, sys
d = collections.defaultdict(list)
for t in open(sys.argv[1]):
    r = json.loads(t)
    d[r["variant"]].append((r["begin_us"], r["floor_touch_us"]))
for v, xs in d.items():
    print(v, "begin_us median", round(statistics.median(b for b, _ in xs), 1), "floor", round(statistics.median(f for _, f in xs), 1),
          "begin/floor", round(statistics.median(b / f for b, f in xs), 2), [round(b) for b, _ in xs])
PY
