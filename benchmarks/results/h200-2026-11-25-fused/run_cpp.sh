#!/usr/bin/env bash
# The C++ side of this folder on nvidia-h200 (carry .deps .baseline): the GPU checks of this tree
# (scripts/gpu_check.sh's tests part: GPU tests, memcheck, host tests, the demo on CUDA; it builds
# every target into build/gpu), then the engine loop of the staged baseline (.baseline/, built into
# build/baseline) and of this tree in alternating rounds (base first in odd rounds), decode B1024
# (SCENARIOS=...) with the device scatter, both storages, eager and CUDA graph: begin_us and host_us
# per step. Each line carries its round and build. A round is not started past ROUND_BUDGET_S seconds.
# Usage (repository root): OUT=... benchmarks/results/h200-2026-11-25-fused/run_cpp.sh [rounds]
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/fused_cpp}
mkdir -p "$out"
start=$(date +%s)
if [ "${SKIP_CHECK:-0}" != 1 ]; then
  GPU_CHECK_PARTS=tests OUT="$out/gpu_check" bash scripts/gpu_check.sh >"$out/gpu_check_stdout.log" 2>&1
  echo "gpu_check exit $?"; tail -n 12 "$out/gpu_check/summary.txt" 2>/dev/null
fi
. scripts/common.sh
prefix=()
[ -d .deps/usr ] && prefix=(-DCMAKE_PREFIX_PATH="$PWD/.deps/usr")
if [ ! -x build/baseline/benchmarks/engine_loop ]; then
  cmake -S .baseline -B build/baseline -G Ninja -DCMAKE_BUILD_TYPE=Release "${prefix[@]}" \
    -DROUTING_REPLAY_BUILD_TESTS=OFF -DROUTING_REPLAY_BUILD_EXAMPLES=OFF >"$out/build_baseline.log" 2>&1 &&
    cmake --build build/baseline -j "$(build_jobs)" --target engine_loop >>"$out/build_baseline.log" 2>&1 ||
    { tail -20 "$out/build_baseline.log"; exit 1; }
fi
[ -x build/gpu/benchmarks/engine_loop ] || cmake --build build/gpu -j "$(build_jobs)" --target engine_loop >/dev/null
echo "== built at $(( $(date +%s) - start )) s"
tag() { python3 -c 'import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        continue
    r.update(build=sys.argv[1], round=int(sys.argv[2])); print(json.dumps(r))' "$@"; }
args=(--backend cuda --mode both --copy device_scatter --storage all --scenarios "${SCENARIOS:-decode_B1024}")
for round in $(seq "${1:-4}"); do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-480}" ]; then echo "== round $round not started"; break; fi
  builds="base head"; [ $(( round % 2 )) = 0 ] && builds="head base"
  for b in $builds; do
    exe=build/gpu/benchmarks/engine_loop; [ "$b" = base ] && exe=build/baseline/benchmarks/engine_loop
    "$exe" "${args[@]}" 2>>"$out/errors.log" | tag "$b" "$round" >>"$out/engine_loop_cpp.jsonl"
  done
done
python3 - "$out/engine_loop_cpp.jsonl" <<'PY'
import collections, json, statistics, sys
d = collections.defaultdict(list)
for t in open(sys.argv[1]):
    r = json.loads(t)
    d[(r.get("policy"), r.get("mode"), r.get("scenario"), r["build"])].append(r)
for k in sorted(d):
    rs = d[k]
    f = lambda key: round(statistics.median(r[key] for r in rs if r.get(key) is not None), 1)
    print(*k, "begin_us", f("begin_us"), "host_us", f("host_us"), "rounds", len(rs),
          "per round begin", [round(r["begin_us"], 1) for r in sorted(rs, key=lambda r: r["round"])])
PY
echo "== done in $(( $(date +%s) - start )) s"
