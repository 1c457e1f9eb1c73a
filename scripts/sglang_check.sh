#!/usr/bin/env bash
# The SGLang tests against SGLang itself, on a machine without a GPU: a virtual environment with
# sglang==0.5.23 (about 11 GB; made once, then reused) and the package (host module only, one wheel
# for every environment: host_package_wheel in scripts/common.sh), then the SGLang capturer's
# differential tests, SGLang's own tests restated and the install tests against the installed
# SGLang's own classes (ROUTING_REPLAY_SGLANG_PEER=installed: a run that cannot import SGLang
# stops). Ends with the summary of scripts/engine_check_summary.py; fails where a case skipped for
# want of a peer. Not part of scripts/test.sh or CI (too heavy); docs/engines.md quotes its figures.
# Usage: scripts/sglang_check.sh [extra pytest arguments]
#   SGLANG_CHECK_VENV=DIR   the environment to make or reuse (default build/sglang-venv)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
start=$(date +%s)
venv="${SGLANG_CHECK_VENV:-$PWD/build/sglang-venv}"
if "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '0.5.23')" \
    >/dev/null 2>&1; then
  echo "== reusing $venv (SGLang 0.5.23)"
else
  echo "== making $venv: pip install sglang==0.5.23 (about 11 GB)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q sglang==0.5.23
  echo "   installed in $(( $(date +%s) - start )) s"
fi
"$venv/bin/pip" install -q pytest
built=$(date +%s)
wheel=$(host_package_wheel)
"$venv/bin/pip" install -q --no-deps --force-reinstall "$wheel"
echo "== package (host module) built and installed in $(( $(date +%s) - built )) s: $(basename "$wheel")"

files=(python/tests/test_sglang_capturer.py python/tests/test_sglang_ported.py python/tests/test_sglang_install.py)
report="$PWD/build/sglang-check"
mkdir -p "$report"
tests=$(date +%s)
set +e
# SGLang's import-time warnings (its kernels' packages on a machine without a GPU) are left out
PYTHONWARNINGS=ignore ROUTING_REPLAY_SGLANG_PEER=installed "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  --junitxml="$report/junit.xml" "${files[@]}" "$@" 2>&1 | tee "$report/pytest.log"
status=${PIPESTATUS[0]}
set -e
echo "== summary (SGLang 0.5.23 at $venv; tests $(( $(date +%s) - tests )) s, all $(( $(date +%s) - start )) s)"
"$venv/bin/python" scripts/engine_check_summary.py "$report/junit.xml" "$report/pytest.log" || status=1
exit "$status"
