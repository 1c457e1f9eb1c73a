#!/usr/bin/env bash
# Fuzzes the library's public calls for SECONDS seconds (default 60), a sixth of them the block
# tier (tests/fuzz/fuzz_block_tier.cpp) and a sixth the route record's decoder
# (tests/fuzz/fuzz_route_record.cpp, seed corpus tests/fuzz/corpus_route_record): builds the libFuzzer harness
# tests/fuzz/fuzz_replay.cpp with clang (-fsanitize=fuzzer,address,undefined) in build/fuzz, runs
# every regression input once, then fuzzes from the seed corpus (which it first runs whole, within
# the time given). New inputs go to build/fuzz/corpus; to refresh the seed corpus:
#   build/fuzz/tests/fuzz_replay -merge=1 -use_counters=0 NEW_DIR tests/fuzz/corpus build/fuzz/corpus
#
# Any finding (a contract violation, a sanitizer report, a timeout) fails the script; the input is
# left in build/fuzz/findings/ and the line to reproduce it is printed (RR_FUZZ_TRACE=1 traces every
# call). Keep each fixed finding in tests/fuzz/regressions/ (a bug of the harness) or
# tests/fuzz/core_bugs/ (a bug of the library). RR_FUZZ_TYPE=N (0 to 8) runs every input as the
# harness's policy combination N: the seed corpus replayed under each N reaches states its own types
# do not.
#
#   scripts/fuzz.sh [SECONDS] [extra libFuzzer flags]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
seconds=${1:-60}
shift || true
apt_install cmake ninja-build clang libclang-rt-14-dev doctest-dev libzstd-dev

cxx=$(command -v clang++ || command -v clang++-14)
echo "== build: libFuzzer harness ($("$cxx" --version | head -n 1))"
cmake -S . -B build/fuzz -G Ninja -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE= -DCMAKE_CXX_FLAGS="-O1 -g" \
  -DROUTING_REPLAY_BUILD_FUZZER=ON -DROUTING_REPLAY_ENABLE_CUDA=OFF -DROUTING_REPLAY_BUILD_EXAMPLES=OFF \
  -DROUTING_REPLAY_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build build/fuzz -j "$(build_jobs)" --target fuzz_replay fuzz_block_tier fuzz_route_record
fuzzer=build/fuzz/tests/fuzz_replay
mkdir -p build/fuzz/corpus build/fuzz/findings build/fuzz/corpus_block_tier build/fuzz/corpus_route_record
# the block tier's harness (tests/fuzz/fuzz_block_tier.cpp) gets a sixth of the time, the route
# record's decoder (tests/fuzz/fuzz_route_record.cpp) another sixth, the replay the rest
tier_seconds=$(( seconds / 6 > 5 ? seconds / 6 : 5 ))
record_seconds=$tier_seconds
seconds=$(( seconds - tier_seconds - record_seconds > 5 ? seconds - tier_seconds - record_seconds : 5 ))

export ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=0
export UBSAN_OPTIONS=print_stacktrace=1
echo "== regressions and the core bugs' inputs, each once (the seed corpus runs when fuzzing starts)"
"$fuzzer" -runs=0 tests/fuzz/regressions tests/fuzz/core_bugs 2>&1 | tail -n 1

echo "== fuzzing for ${seconds}s"
log=build/fuzz/last_run.log
status=0
"$fuzzer" -max_total_time="$seconds" -len_control=0 -max_len=1024 -timeout=30 -rss_limit_mb=4096 \
  -print_final_stats=1 -artifact_prefix=build/fuzz/findings/ "$@" build/fuzz/corpus tests/fuzz/corpus >"$log" 2>&1 ||
  status=$?
# fuzz_harness NAME TITLE MAX_LEN RSS_MB SECONDS: one of the smaller harnesses (build/fuzz/tests/NAME,
# seed corpus tests/fuzz/corpus_SUFFIX) for SECONDS; a finding prints its lines and ends the script.
fuzz_harness() {
  local name=$1 title=$2 max_len=$3 rss=$4 time=$5 suffix=${1#fuzz_}
  local harness_log=build/fuzz/last_run_$suffix.log harness_status=0
  echo "== $title: fuzzing for ${time}s"
  "build/fuzz/tests/$name" -max_total_time="$time" -len_control=0 -max_len="$max_len" -timeout=30 \
    -rss_limit_mb="$rss" -print_final_stats=1 -artifact_prefix=build/fuzz/findings/ \
    "build/fuzz/corpus_$suffix" "tests/fuzz/corpus_$suffix" >"$harness_log" 2>&1 || harness_status=$?
  local harness_execs
  harness_execs=$(grep -E '^stat::number_of_executed_units' "$harness_log" | awk '{print $2}' || true)
  echo "fuzz ($title): ${harness_execs:-?} executions"
  if [ "$harness_status" -ne 0 ]; then
    grep -E 'contract violation|ERROR: |runtime error|what\(\)|SUMMARY' "$harness_log" | head -n 20 || true
    echo "FINDING: the input is in build/fuzz/findings/; reproduce with: build/fuzz/tests/$name build/fuzz/findings/<file>"
    exit "$harness_status"
  fi
}
if [ "$status" -eq 0 ]; then
  fuzz_harness fuzz_block_tier "block tier" 512 2048 "$tier_seconds"
  fuzz_harness fuzz_route_record "route record" 2048 2048 "$record_seconds"
fi
# figures: executions, rate, coverage (edges, "cov") and features ("ft") at the end
execs=$(grep -E '^stat::number_of_executed_units' "$log" | awk '{print $2}' || true)
rate=$(grep -E '^stat::average_exec_per_sec' "$log" | awk '{print $2}' || true)
coverage=$(grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+' "$log" | tail -n 1 || true)
echo "fuzz: ${execs:-?} executions (${rate:-?}/s), ${coverage:-no coverage line}"
if [ "$status" -ne 0 ]; then
  grep -E 'contract violation|ERROR: |runtime error|SUMMARY|policies:' "$log" | head -n 20 || true
  echo "FINDING: the input is in build/fuzz/findings/; reproduce with:"
  echo "  RR_FUZZ_TRACE=1 $fuzzer build/fuzz/findings/<file>"
  exit "$status"
fi
