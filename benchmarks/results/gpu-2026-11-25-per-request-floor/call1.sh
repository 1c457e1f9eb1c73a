#!/usr/bin/env bash
# Call 1 of this folder (carry .deps .baseline .peers; .baseline staged with
# scripts/stage_baseline.sh 959055f): the GPU checks of this tree (scripts/gpu_check.sh, tests part)
# while both Python packages (this tree's and the baseline's, for call2.sh) and the baseline's C++
# engine loop build; then alternating rounds of the C++ engine loop, head against .baseline (device
# scatter, both storages, eager and CUDA graph, decode B1024 and B64) until ROUND_BUDGET_S; then,
# on the host's CPU, begin_probe and per_request_floor_probe of both trees in alternating rounds.
# Usage (repository root): OUT=... benchmarks/results/gpu-2026-11-25-per-request-floor/call1.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
here=benchmarks/results/gpu-2026-11-25-per-request-floor
out=${OUT:-build/per_request_floor}
mkdir -p "$out"
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
. scripts/common.sh
prefix=()
[ -d .deps/usr ] && prefix=(-DCMAKE_PREFIX_PATH="$PWD/.deps/usr")
( OUT="$out/py_build" benchmarks/results/h200-2026-11-25-fused/run_gpu.sh 0 >"$out/py_build.log" 2>&1 ) &
py=$!
( cmake -S .baseline -B build/baseline -G Ninja -DCMAKE_BUILD_TYPE=Release "${prefix[@]}" \
    -DROUTING_REPLAY_BUILD_TESTS=OFF -DROUTING_REPLAY_BUILD_EXAMPLES=OFF &&
  cmake --build build/baseline -j 4 --target engine_loop ) >"$out/build_baseline.log" 2>&1 &
base=$!
GPU_CHECK_PARTS=tests OUT="$out/gpu_check" bash scripts/gpu_check.sh >"$out/gpu_check_stdout.log" 2>&1
echo "gpu_check exit $? at $(( $(date +%s) - start )) s"; tail -n 12 "$out/gpu_check/summary.txt" 2>/dev/null
wait "$base"; echo "baseline engine_loop exit $?"
wait "$py"; grep "built both" "$out/py_build.log"
echo "== C++ rounds from $(( $(date +%s) - start )) s"
OUT="$out/cpp" SKIP_CHECK=1 SCENARIOS=decode_B1024,decode_B64 ROUND_BUDGET_S=$(( ${ROUND_BUDGET_S:-450} - ($(date +%s) - start) )) \
  benchmarks/results/h200-2026-11-25-fused/run_cpp.sh 12
cccl=$(dirname "$(command -v nvcc)")/../include
bin=build/per_request_floor_probes  # not under $OUT: binaries there crowd out the files a call returns
mkdir -p "$bin"
for tree in head base; do
  inc=include; [ "$tree" = base ] && inc=.baseline/include
  for probe in begin_probe:benchmarks/results/h200-2026-11-25-planned/begin_probe.cpp per_request_floor_probe:$here/per_request_floor_probe.cpp; do
    g++ -std=c++20 -O3 -DNDEBUG -pthread -I "$inc" -I benchmarks -I "$cccl/cccl" -isystem "$cccl" "${probe#*:}" \
      -o "$bin/${probe%%:*}_$tree" &
  done
done
wait
tag() { python3 -c 'import json, sys
for line in sys.stdin:
    try: r = json.loads(line)
    except ValueError: continue
    print(json.dumps(dict(round=int(sys.argv[1]), tree=sys.argv[2], **r)))' "$@"; }
for round in 1 2 3 4; do
  [ $(( $(date +%s) - start )) -gt "${PROBE_BUDGET_S:-560}" ] && break
  trees="base head"; [ $(( round % 2 )) = 0 ] && trees="head base"
  for tree in $trees; do
    "$bin/per_request_floor_probe_$tree" 1000 0 | tag "$round" "$tree" >>"$out/per_request_floor_probe.jsonl"
    "$bin/per_request_floor_probe_$tree" 1000 1 | tag "$round" "$tree" >>"$out/per_request_floor_probe.jsonl"
    "$bin/begin_probe_$tree" 1000 1024 0 1 | tag "$round" "$tree" >>"$out/begin_probe.jsonl"
  done
done
python3 - "$out" <<'PY'
import collections, json, statistics, sys, os
d = collections.defaultdict(list)
for name in ("per_request_floor_probe.jsonl", "begin_probe.jsonl"):
    p = os.path.join(sys.argv[1], name)
    if not os.path.exists(p): continue
    for t in open(p):
        r = json.loads(t)
        d[(r["probe"], r["batch"], r.get("cold"), r.get("stagger", 0), r["tree"])].append((r["begin_us"], r.get("floor_touch_us")))
for k in sorted(d):
    v = d[k]
    print(*k, "begin_us", round(statistics.median(x[0] for x in v), 1),
          "floor_us", round(statistics.median(x[1] for x in v), 1) if v[0][1] is not None else "-", "runs", len(v))
PY
echo "== done in $(( $(date +%s) - start )) s"
