#!/usr/bin/env bash
# The Python engine loop on a GPU machine (docs/performance.md): builds the package into
# build/python-gpu-site (as scripts/python_gpu_check.sh does) and, where scripts/stage_baseline.sh
# staged an earlier tree in .baseline/, that tree's package beside it (both at once: their nvcc
# translation units build in parallel); then runs benchmarks/python/engine_loop.py for each tree and,
# where the peer was carried in .peers/ (../shared/peers/README.md), the side by side with vLLM PR
# 39917's capturer. JSON lines go to $OUT (when set) or build/python-bench/.
# Usage: scripts/python_gpu_bench.sh [engine_loop.py arguments]
# Environment: PY_BENCH_PARTS (default bench,baseline,peer), PY_BENCH_PEER_ARGS (extra arguments
# of the peer script, e.g. "--copy device_scatter"), PY_BENCH_SKIP_BUILD=1 (reuse the packages an
# earlier call built on a machine still warm).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
out=${OUT:-build/python-bench}
mkdir -p "$out"
parts=${PY_BENCH_PARTS:-bench,baseline,peer}
has() { [[ ",$parts," == *",$1,"* ]]; }
export PYTHONUNBUFFERED=1
site="$PWD/build/python-gpu-site"
base_site="$PWD/build/python-gpu-site-baseline"
start=$(date +%s)
build() {  # build TREE SITE LOG
  rm -rf "$2"
  # every combination ahead of time, as scripts/python_gpu_check.sh builds it (PY_GPU_SKIP_BUILD=1 reuses it)
  python3 -m pip install -q --no-build-isolation --no-deps --target "$2" "$1/python" \
    -C cmake.define.ROUTING_REPLAY_PYTHON_ALL_COMBINATIONS=ON >"$3" 2>&1 ||
    { cat "$3"; return 1; }
}
base_pid=
if [ "${PY_BENCH_SKIP_BUILD:-0}" = 1 ]; then
  [ -d "$base_site" ] && has baseline && base_pid=reused
  echo "== reusing $site${base_pid:+ and $base_site}"
else
  build . "$site" "$out/build.log" &
  new_pid=$!
  if has baseline && [ -d .baseline ]; then
    build .baseline "$base_site" "$out/build_baseline.log" &
    base_pid=$!
  fi
  wait "$new_pid"
  [ -z "$base_pid" ] || wait "$base_pid"
  echo "== built in $(( $(date +%s) - start )) s"
fi

summary() { python3 benchmarks/python/summarize.py "$@"; }
if has bench; then
  echo "== benchmarks/python/engine_loop.py (this tree)"
  PYTHONPATH="$site" python3 benchmarks/python/engine_loop.py "$@" | tee "$out/python_engine_loop.jsonl" >/dev/null
  summary "$out/python_engine_loop.jsonl"
fi
if [ -n "$base_pid" ]; then
  echo "== benchmarks/python/engine_loop.py (baseline $(cat .baseline/REVISION 2>/dev/null))"
  PYTHONPATH="$base_site" python3 benchmarks/python/engine_loop.py "$@" | tee "$out/python_engine_loop_baseline.jsonl" >/dev/null
  summary "$out/python_engine_loop_baseline.jsonl"
fi
if has peer && [ -f .peers/engine_loop_vs_peer.py ]; then
  echo "== side by side with vLLM PR 39917's capturer (.peers/engine_loop_vs_peer.py ${PY_BENCH_PEER_ARGS:-})"
  # shellcheck disable=SC2086
  PYTHONPATH="$site" python3 .peers/engine_loop_vs_peer.py ${PY_BENCH_PEER_ARGS:-} >"$out/peer_side_by_side.jsonl"
  summary "$out/peer_side_by_side.jsonl"
fi
echo "== python_gpu_bench done in $(( $(date +%s) - start )) s"
