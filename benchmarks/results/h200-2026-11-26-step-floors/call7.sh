#!/usr/bin/env bash
# Call 7 of this folder, a fresh machine (carry .deps .peers): this tree's package built, then the
# side by side with vLLM PR 39917's capturer (.peers/engine_loop_vs_peer.py --copy device_scatter,
# the peer and the drop-in in each round) until ROUND_BUDGET_S; medians as call 2's.
# Usage (repository root): OUT=... benchmarks/results/h200-2026-11-26-step-floors/call7.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-build/step_floors_7}
mkdir -p "$out" build
start=$(date +%s)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
site="$PWD/build/python-gpu-site"
rm -rf "$site"
python3 -m pip install -q --no-build-isolation --no-deps --target "$site" ./python >build/call7_build.log 2>&1 ||
  { tail -30 build/call7_build.log; exit 1; }
echo "== built in $(( $(date +%s) - start )) s"
for round in 1 2 3 4; do
  if [ $(( $(date +%s) - start )) -gt "${ROUND_BUDGET_S:-200}" ]; then echo "== round $round not started"; break; fi
  PYTHONPATH="$site" python3 .peers/engine_loop_vs_peer.py --copy device_scatter --impl peer,dropin 2>>"$out/errors.log" |
    python3 benchmarks/results/tag_rounds.py round="$round" tree=head >>"$out/peer_side_by_side_device_scatter.jsonl"
done
python3 benchmarks/results/h200-2026-11-25-fused/medians.py "$out"
echo "== done in $(( $(date +%s) - start )) s"
