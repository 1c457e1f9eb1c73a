#!/usr/bin/env bash
# Builds the test targets and runs every test, keeping nvcc and g++ work to one build of each
# translation unit where possible (CI has 2 cores: 25 minutes on a clean clone, most of it compiling):
# - the CUDA targets (GPU tests with 8 representative policy combinations of the 16 in their
#   schedules, the 2-GPU test, demo, benchmarks but the GPU microbenchmarks), every library header
#   compiled on its own (header_checks) and the packaging tests, the .cu files' host code at -O0 and
#   the C++ files at -O1: CI proves they build and run; every combination and the figures come from
#   scripts/gpu_check.sh on a GPU. The GPU tests report Skipped, not Passed, where there is no GPU;
# - the host tests in two halves, each source built once: the schedules (every copy strategy, 8
#   representative policy combinations), the pipeline tests and the parallel tests (ranks as threads) under
#   ThreadSanitizer: the host backend's streams are real threads, so the pipeline's ordering and
#   the in-process collectives are checked there; the scenario, error, unit and misuse tests, the
#   numpy round trip and the fault injection sweeps (every backend operation, device/pinned and
#   host allocation fails once) under AddressSanitizer + UBSan at -O0 (they build in about 60 % of
#   -O1's time and run in seconds either way);
# - the short soak (every copy strategy, 100000 steps in all, memory flat) in the -O1 build;
# - the fuzzer for 2 minutes (clang, its own build: scripts/fuzz.sh), one thread beside the steps
#   after the CUDA build, several of which leave the second core idle (serial tests, the soak);
# - the Python package exactly as a user installs it (a fresh virtual environment, pip install
#   "./python[plot,ray]"), every policy combination ahead of time (ROUTING_REPLAY_PYTHON_ALL_COMBINATIONS=ON:
#   the suite runs all 64; test_jit.py compiles one host unit on first use), host module only (-C cmake.define.ROUTING_REPLAY_PYTHON_CUDA=OFF: the CUDA module
#   builds on the GPU machines, scripts/python_gpu_check.sh) at -O1, with torch from PyPI (the vLLM
#   and SGLang differential tests run those engines' code on the CPU) and transformers (the
#   examples and replay tests on a random MoE model), and its pytest suite: every policy
#   combination on the host backend, Ray's tests on a cluster of the machine's cores;
# - the packaging checks (Conan, vcpkg port), the documentation check, the engine-loop benchmark on
#   the host backend (every line must be correct), a short run of the block-slot floor benchmark
#   and the demo on a small run with the README's numpy check of its files, and the host example
#   (examples/host_quickstart).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
apt_install cmake ninja-build g++ doctest-dev libbenchmark-dev doxygen clang libclang-rt-14-dev libzstd-dev
pip_install numpy numpy
# each step's header says when it started, so that CI's time can be read step by step
stage() { echo "== $* [${SECONDS} s]"; }

stage "build: GPU tests, demo, benchmarks (.cu host code -O0, C++ -O1)"
# -O0 for the .cu files' host code: nvcc's g++ pass there is most of their build (a third less at
# -O0), and in CI it runs only the demo's small run
# The schedule tests with 8 representative policy combinations of the 16 (tests/CMakeLists.txt): CI
# proves they build; the GPU runs all (scripts/gpu_check.sh). device_bench (GPU microbenchmarks,
# nothing to run here) builds on the GPU machines only.
cmake -S . -B build/ci -G Ninja -DCMAKE_BUILD_TYPE= -DCMAKE_CXX_FLAGS="-O1" -DCMAKE_CUDA_FLAGS="-O0" \
  -DROUTING_REPLAY_TEST_COMBINATIONS=representative >/dev/null
ci_targets=(gpu_tests slot_rows_gpu_tests engine_loop host_quickstart engine_loop_bench host_path_bench block_slot_floor_bench step_floor_bench soak header_checks)
# the 2-GPU test of the parallel engines exists where NCCL was found (CI machines have it)
if cmake --build build/ci --target help | grep -q '^multi_gpu_tests:'; then ci_targets+=(multi_gpu_tests); fi
cmake --build build/ci -j "$(build_jobs)" --target "${ci_targets[@]}"

# Fuzzing is one thread: it builds and runs beside the steps below, and its output follows at the end.
scripts/fuzz.sh 120 >build/fuzz.log 2>&1 &
fuzz_pid=$!

stage "GPU and packaging tests"
ctest --test-dir build/ci --output-on-failure -j 2 -L "gpu|packaging"
stage "soak (short): every copy strategy, 100000 steps in all, memory flat after warm-up"
build/ci/tests/soak --steps 100000 >build/ci/soak.log 2>&1 || { cat build/ci/soak.log; exit 1; }
grep '"soak"' build/ci/soak.log

stage "schedules, pipeline and parallel tests under ThreadSanitizer"
# -O1 -g1: the usual sanitizer trade-off, and a much faster build of the template-heavy tests
# the schedules with 8 representative policy combinations a copy strategy: threads differ by copy
# strategy and storage, not by index type; the Python suite runs every combination
cmake -S . -B build/tsan -G Ninja -DCMAKE_BUILD_TYPE= -DCMAKE_CXX_FLAGS="-O1 -g1" \
  -DROUTING_REPLAY_TEST_COMBINATIONS=representative -DROUTING_REPLAY_SANITIZE_THREAD=ON -DROUTING_REPLAY_ENABLE_CUDA=OFF -DROUTING_REPLAY_BUILD_EXAMPLES=OFF \
  -DROUTING_REPLAY_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build build/tsan -j "$(build_jobs)" --target host_schedule_tests parallel_tests
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1"
build/tsan/tests/host_schedule_tests >build/tsan/host_schedule_tests.log 2>&1 &
schedules_pid=$!
parallel_status=0
build/tsan/tests/parallel_tests >build/tsan/parallel_tests.log 2>&1 || parallel_status=$?
schedules_status=0
wait "$schedules_pid" || schedules_status=$?
for log in host_schedule_tests parallel_tests; do
  echo "$log: $(grep -E '^\[doctest\] test cases' "build/tsan/$log.log")"
done
if [ "$schedules_status" -ne 0 ] || [ "$parallel_status" -ne 0 ]; then
  cat build/tsan/host_schedule_tests.log build/tsan/parallel_tests.log; exit 1
fi
unset TSAN_OPTIONS

stage "scenario, error, unit and misuse tests, numpy round trip, fault injection, under AddressSanitizer + UBSan"
cmake -S . -B build/asan -G Ninja -DCMAKE_BUILD_TYPE= -DCMAKE_CXX_FLAGS="-O0 -g1" -DROUTING_REPLAY_SANITIZE=ON \
  -DROUTING_REPLAY_ENABLE_CUDA=OFF -DROUTING_REPLAY_BUILD_EXAMPLES=OFF \
  -DROUTING_REPLAY_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build build/asan -j "$(build_jobs)" --target host_core_tests fault_tests
export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1
build/asan/tests/host_core_tests
python3 tests/check_npy.py build/asan/tests/host_core_tests build/asan/npy_out
ctest --test-dir build/asan --output-on-failure -L faults
unset ASAN_OPTIONS UBSAN_OPTIONS

stage "Python package: fresh virtual environment, pip install ./python (host module), pytest"
python_venv=build/python-venv
rm -rf "$python_venv"
python3 -m venv "$python_venv"
python_start=$(date +%s)
# -O1: CI checks behaviour, not speed, and the instantiations build a third faster (the unit
# test_jit.py compiles on first use too: it reuses the build's flags). The ray extra:
# test_ray.py starts a Ray cluster of this machine's cores and eight trainer-rank actors.
"$python_venv/bin/pip" install -q "./python[plot,ray]" -C cmake.define.ROUTING_REPLAY_PYTHON_CUDA=OFF \
  -C "cmake.define.CMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG" -C cmake.define.ROUTING_REPLAY_PYTHON_ALL_COMBINATIONS=ON
echo "installed in $(( $(date +%s) - python_start )) s"
# torch (PyPI's build; on a machine without a GPU it runs on the CPU): the vLLM and SGLang tests run
# the engines' own released code, which needs it, beside ours (differential tests; they skip, saying
# why, where that code is not beside the checkout). About 2 minutes, as much unpacking (5 GB with
# its CUDA libraries) as download: beside the builds it slows them by more than it saves.
# transformers: the examples on a random Qwen3-MoE (examples/python/*.py through test_examples.py:
# the closed loop, and the rollout through Ray to trainer actors) and the Hugging Face replay tests
# run on the CPU.
torch_start=$(date +%s)
"$python_venv/bin/pip" install -q torch transformers
echo "torch and transformers installed in $(( $(date +%s) - torch_start )) s"
"$python_venv/bin/python" -m pytest -q -p no:cacheprovider python/tests

scripts/packaging_check.sh
stage "every public entity documented (doxygen)"
mkdir -p build
undocumented=$(doxygen docs/Doxyfile 2>&1 | grep -v '/detail/' || true)
if [ -n "$undocumented" ]; then echo "$undocumented"; exit 1; fi
echo "ok"

stage "fuzzing (run beside the steps since the CUDA build)"
fuzz_status=0
wait "$fuzz_pid" || fuzz_status=$?
cat build/fuzz.log
[ "$fuzz_status" -eq 0 ] || exit "$fuzz_status"

build/ci/benchmarks/engine_loop --backend host --mode eager --scenarios decode_B64,prefill_8k --decode-steps 8 --copy all --storage all | python3 -c 'import json, sys; r = [json.loads(l) for l in sys.stdin]; ok = bool(r) and all(x["correct"] for x in r); print("== engine loop benchmark (host backend):", len(r), "runs,", "all correct" if ok else "NOT ALL CORRECT"); sys.exit(0 if ok else 1)'
build/ci/benchmarks/block_slot_floors --decode-steps 8 --prefill-steps 8 | python3 -c 'import json, sys; r = [json.loads(l) for l in sys.stdin]; ok = len(r) == 2 and all(x["begin_us"] > 0 and x["floor_us"] > 0 for x in r); print("== block-slot floor benchmark (host backend):", len(r), "scenarios,", "ok" if ok else "NOT OK"); sys.exit(0 if ok else 1)'
stage "demo (small run, default backend), its numpy check, and the host example"
rm -rf build/ci/demo_out
build/ci/examples/engine_loop --out build/ci/demo_out --requests 3 --max-tokens 256 | tail -n 2
python3 examples/engine_loop/verify_npy.py build/ci/demo_out | tail -n 1
build/ci/examples/host_quickstart | tail -n 1
echo "== all passed in $SECONDS s"
