#!/usr/bin/env bash
# Copies the files of the doctest-dev and Google Benchmark packages into .deps/ (git-ignored), for
# a machine that has no package registry (a GPU machine without internet). Copy .deps/ there with
# the checkout; scripts/gpu_check.sh picks it up.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
apt_install doctest-dev libbenchmark-dev
rm -rf .deps && mkdir -p .deps
for pkg in doctest-dev libbenchmark-dev libbenchmark1debian; do
  dpkg -L "$pkg" | while read -r f; do
    [ -f "$f" ] || [ -L "$f" ] || continue
    case "$f" in /usr/share/doc/*|/usr/share/man/*) continue ;; esac
    mkdir -p ".deps$(dirname "$f")"
    cp -P "$f" ".deps$f"
  done
done
du -sh .deps
