#!/usr/bin/env bash
# Times what a user waits for: `pip install ./python` in fresh virtual environments (three, one
# after the other: the first may download the build requirements, the others use pip's cache), and
# the first use of a combination not compiled ahead of time (host backend, from an empty cache),
# then the second (from the cache). Prints a summary; the figures are docs/python.md's (section 1).
# Usage: scripts/time_install.sh [extra pip install arguments, e.g. -C cmake.define.ROUTING_REPLAY_PYTHON_CUDA=OFF]
# Environment: TIME_INSTALL_RUNS (default 3), TIME_INSTALL_DIR (default /tmp/rr-time-install).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${TIME_INSTALL_RUNS:-3}
dir=${TIME_INSTALL_DIR:-/tmp/rr-time-install}
rm -rf "$dir"
mkdir -p "$dir"
echo "== $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, load:$(uptime | sed 's/.*load average://')"
summary=()
for run in $(seq 1 "$runs"); do
  venv="$dir/v$run"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  start=$(date +%s.%N)
  "$venv/bin/pip" install -q ./python "$@"
  took=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$start" "$(date +%s.%N)")
  summary+=("pip install ./python, fresh venv $run: $took s")
  echo "== ${summary[-1]}"
done
venv="$dir/v$runs"
first_use() {
  ROUTING_REPLAY_CACHE_DIR="$dir/cache" "$venv/bin/python" -c '
import time
start = time.monotonic()
import routing_replay as rr
imported = time.monotonic()
rr.Replay(num_experts=64, top_k=4, max_tokens_per_step=64, max_model_len=128, moe_layers=[0, 1], device="cpu",
          index="int32", layout="token_major")
done = time.monotonic()
print(f"import {imported - start:.2f} s, first Replay(index=int32, layout=token_major) {done - imported:.1f} s")'
}
summary+=("first use, empty cache: $(first_use 2>&1 | tr '\n' ' ')")
echo "== ${summary[-1]}"
summary+=("second process, cached: $(first_use 2>&1 | tr '\n' ' ')")
echo "== ${summary[-1]}"
record=$(find "$venv" -path '*routing_replay/_jit_sources/commands.json' | head -n 1)
if "$venv/bin/python" -c 'import json, sys; sys.exit(0 if "cuda" in json.load(open(sys.argv[1])) else 1)' "$record"; then
  # the CUDA unit's compile (its first use needs a GPU; the compile does not)
  cuda_took=$("$venv/bin/python" - "$dir" <<'PY'
import pathlib, sys, time
from routing_replay import _jit
command, record = _jit._command("cuda", "int32", "token_major")
target = pathlib.Path(sys.argv[1], "cuda_unit", "cuda_int32_token_major.so")
target.parent.mkdir(parents=True, exist_ok=True)
start = time.monotonic()
_jit._compile("cuda", "int32", "token_major", command, record, target)
print(f"{time.monotonic() - start:.1f}")
PY
)
  summary+=("nvcc compile of one first-use CUDA unit (int32, token_major): $cuda_took s")
  echo "== ${summary[-1]}"
fi
echo "== summary"
printf '  %s\n' "${summary[@]}"
