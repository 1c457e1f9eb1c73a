#!/usr/bin/env bash
# Downloads into .whl/ the wheels scripts/training_gpu_check.sh installs on a GPU machine without
# internet (python 3.12, x86_64): megatron-core, whose base requirements (torch, numpy, packaging)
# the GPU image already has; its extras (Transformer Engine...) are not needed by the tests.
# .whl/ is not tracked: keep it out of git (e.g. a line `/.whl/` in .git/info/exclude) and copy it
# to the GPU machine with the checkout.
# Usage: scripts/stage_training_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MEGATRON_CORE_VERSION=0.16.1
mkdir -p .whl
rm -f .whl/megatron_core-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl "megatron-core==$MEGATRON_CORE_VERSION"
for w in .whl/*.whl; do
  echo "== $(basename "$w"): $(du -h "$w" | cut -f1); requirements outside extras:"
  unzip -p "$w" '*/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | sed 's/^/   /'
done
