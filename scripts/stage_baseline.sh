#!/usr/bin/env bash
# Exports the tree of an earlier revision into .baseline/ (git-ignored), for a GPU machine that
# has no git history: scripts/gpu_check.sh builds its engine-loop benchmark beside the current one
# and prints both side by side, run alternately on one machine ("before/after in one run").
# Usage: scripts/stage_baseline.sh REV   (then copy .baseline/ to the GPU machine with the checkout)
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: scripts/stage_baseline.sh REV}
rm -rf .baseline && mkdir -p .baseline
git archive "$rev" | tar -x -C .baseline
git rev-parse --short "$rev" >.baseline/REVISION
echo "staged $(cat .baseline/REVISION) in .baseline/"
