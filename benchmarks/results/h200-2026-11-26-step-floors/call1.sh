#!/usr/bin/env bash
# Call 1 of this folder, a fresh machine (carry .deps .baseline .peers; .baseline staged with
# scripts/stage_baseline.sh 09d0b66): the GPU checks of this tree (scripts/gpu_check.sh, tests
# part) while both Python packages (this tree's and the baseline's, for call2.sh) and the floor
# probe build; then alternating rounds of step_floor_probe (begin_step and end_step against their
# floors, the C++ and the Python engine loop's orders, decode B1024 and B64) and of this tree's C++
# engine loop (device scatter, both storages, eager and CUDA graph, decode B1024 and B64), until
# ROUND_BUDGET_S.
# Usage (repository root): OUT=... benchmarks/results/h200-2026-11-26-step-floors/call1.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
here=benchmarks/results/h200-2026-11-26-step-floors
out=${OUT:-build/step_floors}
mkdir -p "$out"
start=$(date +%s)
tag() { python3 benchmarks/results/tag_rounds.py "$@"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
lscpu | grep -E "Model name|^CPU\(s\)" >>"$out/machine.txt"
( OUT="$out/py_build" benchmarks/results/h200-2026-11-25-fused/run_gpu.sh 0 >"$out/py_build.log" 2>&1 ) &
py=$!
mkdir -p build  # the probe's binary stays out of $OUT (files there come back to the caller)
( nvcc -std=c++20 -O3 -DNDEBUG -arch=native -I include -I benchmarks "$here/step_floor_probe.cu" \
    -o build/step_floor_probe ) >"$out/build_probe.log" 2>&1 &
probe=$!
GPU_CHECK_PARTS=tests OUT="$out/gpu_check" bash scripts/gpu_check.sh >"$out/gpu_check_stdout.log" 2>&1
echo "gpu_check exit $? at $(( $(date +%s) - start )) s"; tail -n 12 "$out/gpu_check/summary.txt" 2>/dev/null
wait "$probe"; echo "probe build exit $?"
wait "$py"; grep "built both" "$out/py_build.log"
for round in $(seq 1 12); do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-480}" ]; then echo "== round $round not started"; break; fi
  echo "== round $round at $(( $(date +%s) - start )) s"
  build/step_floor_probe 1200 300 2>>"$out/errors.log" | tag round="$round" >>"$out/step_floor_probe.jsonl"
  build/gpu/benchmarks/engine_loop --backend cuda --mode both --copy device_scatter --storage all \
    --scenarios decode_B1024,decode_B64 2>>"$out/errors.log" | tag round="$round" >>"$out/engine_loop_cpp.jsonl"
done
python3 - "$out" <<'PY'
import collections, json, statistics, sys, os
med = lambda v: round(statistics.median(v), 1)
rows = [json.loads(t) for t in open(os.path.join(sys.argv[1], "step_floor_probe.jsonl"))]
d = collections.defaultdict(list)
for r in rows:
    d[(r["order"], r["batch"])].append(r)
for k in sorted(d):
    v = d[k]
    print("step_floor", *k, *(f"{f} {med(r[f] for r in v)}" for f in ("begin_us", "begin_floor_us", "end_us", "end_floor_us")),
          "refused", sum(r["refused"] for r in v), "rounds", len(v))
d = collections.defaultdict(list)
for t in open(os.path.join(sys.argv[1], "engine_loop_cpp.jsonl")):
    r = json.loads(t)
    d[(r.get("policy"), r.get("mode"), r.get("scenario"))].append(r)
for k in sorted(d):
    v = d[k]
    print("engine_loop", *k, "begin_us", med(r["begin_us"] for r in v), "host_us", med(r["host_us"] for r in v),
          "correct", all(r.get("correct") for r in v), "rounds", len(v))
PY
echo "== done in $(( $(date +%s) - start )) s"
