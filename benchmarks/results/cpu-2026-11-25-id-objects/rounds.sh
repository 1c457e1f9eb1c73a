#!/usr/bin/env bash
# Alternating rounds of the Python engine loop's drop-in on the host backend (the 2-core CPU
# machine), two packages built beforehand (pip install --no-build-isolation --no-deps --target
# /tmp/site_<tree> ./python -C cmake.define.ROUTING_REPLAY_PYTHON_CUDA=OFF): BASE and HEAD, the
# order flipped every round, each with --ids new and --ids kept (IDS); one tagged JSON line per
# run and scenario, then per ids mode the medians and the slope of the post-forward call between
# decode B64 and B1024.
# Usage (repository root): OUT=... BASE=/tmp/site_base HEAD=/tmp/site_head ROUNDS=4 rounds.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/id_objects}
mkdir -p "$out"
for round in $(seq "${ROUNDS:-4}"); do
  trees="base head"; [ $(( round % 2 )) = 0 ] && trees="head base"
  for tree in $trees; do
   for ids in ${IDS:-new kept}; do
    site=$BASE; [ "$tree" = head ] && site=$HEAD
    PYTHONPATH="$site" python3 benchmarks/python/engine_loop.py --device cpu --api dropin --ids "$ids" \
      --scenarios decode_B1,decode_B64,decode_B256,decode_B1024 2>>"$out/errors.log" |
      python3 -c 'import json, sys
for line in sys.stdin:
    try: r = json.loads(line)
    except ValueError: continue
    print(json.dumps(dict(round=int(sys.argv[1]), tree=sys.argv[2], **r)))' "$round" "$tree" >>"$out/dropin_rounds.jsonl"
   done
  done
done
python3 - "$out/dropin_rounds.jsonl" <<'PY'
import collections, json, statistics, sys
d = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "scenario" in r:
        d[(r["ids"], r["tree"], r["scenario"])].append(r)
for ids, tree in sorted({k[:2] for k in d}):
    host = {s: statistics.median(x["host_us"] for x in d[(ids, tree, s)]) for s in ("decode_B1", "decode_B64", "decode_B256", "decode_B1024")}
    cap = {s: statistics.median(x["capture_us"] for x in d[(ids, tree, s)]) for s in host}
    slopes = [(b["host_us"] - a["host_us"]) / 960 for a, b in zip(d[(ids, tree, "decode_B64")], d[(ids, tree, "decode_B1024")])]
    print("ids", ids, tree, "post-forward", {k: round(v, 1) for k, v in host.items()}, "capture", {k: round(v, 2) for k, v in cap.items()},
          "slope B64->B1024 us/request", round((host["decode_B1024"] - host["decode_B64"]) / 960, 3),
          "per run", [round(s, 3) for s in slopes], "all correct", all(x["correct"] for v in d.values() for x in v))
PY
