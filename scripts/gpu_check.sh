#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, one command: configure, build, run the GPU tests (which must
# really run: "skipped" is a failure here), the host tests, the demo on CUDA for several policy
# combinations (checked with numpy) and the benchmarks; logs and results go to $OUT/gpu_check.tgz
# (default OUT: build/gpu_check), the summary to $OUT/summary.txt and is printed last. Missing packages (doctest, Google Benchmark) may come from .deps/
# (scripts/stage_deps.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
script_start=$(date +%s)
RESULTS=${OUT:-build/gpu_check}
OUT=build/gpu_check_work  # everything is written here, then packed into $RESULTS
rm -rf "$OUT" && mkdir -p "$OUT" "$RESULTS"
summary=()
status=0
note() { summary+=("$1"); }
# Which parts run (comma-separated): tests (GPU and host tests, memcheck, demo), bench (engine
# loop), micro (Google Benchmark programs), compare (before/after against .baseline), overhead
# (step time added at realistic step lengths, three rounds, both capture paths), sanitize (below),
# soak (the CUDA soak: all eight copy strategy x storage combinations at N_max 8192, L 48, K 8,
# GPU_CHECK_SOAK_STEPS steps each (default 100000), at once, one thread each in one process;
# projected 2 to 4 minutes on an H200 with 16 cores, docs/reliability.md 2.4;
# GPU_CHECK_SOAK_ONLY="sync/block_slot,..." runs some of them, to split it over two calls); the last
# three are not run by default. Parts that need only gpu_tests (sanitize, soak) build only it: the
# soak alone is `GPU_CHECK_PARTS=soak scripts/gpu_check.sh`. The parts may run in separate
# invocations on one machine (where a command may last only 10 minutes); the build is reused.
#
# sanitize: compute-sanitizer racecheck, initcheck, synccheck and memcheck over the GPU suite (all
# but two named test cases, docs/reliability.md 2.4), by scripts/gpu_sanitize.py: the suite cut
# into runs of GPU_CHECK_SANITIZE_CASES_PER_RUN (4) consecutive test cases, GPU_CHECK_SANITIZE_WORKERS
# (the cores less two) sanitizer processes at once on the one GPU, tool after tool. Each run's line
# and log land in $OUT as it ends (sanitize_summary.txt, sanitize/sanitizer_TOOL_A-B.log), each
# tool's line and whole log (sanitize/sanitizer_TOOL.log) as its last run ends. The four tools one
# after the other took 1700 s on an H200 over 89 test cases (2026-11-23; racecheck 625 s); at 14
# processes at once they are expected to take 3 to 4 minutes, so that with the build of gpu_tests
# (108 s on a fresh H200) the part fits one 10-minute call. No run starts after
# GPU_CHECK_SANITIZE_DEADLINE_S (default: 570 s after this script started, within a call's 10
# minutes), running ones are stopped then, and the summary names the cases left and the command
# that runs them. Should one call not be enough, two calls on the same warm machine (the second
# reuses the build) cover the four tools:
#   GPU_CHECK_PARTS=sanitize1 scripts/gpu_check.sh    # racecheck, memcheck (about 55 % of the work)
#   GPU_CHECK_PARTS=sanitize2 scripts/gpu_check.sh    # initcheck, synccheck
# GPU_CHECK_SANITIZE_TOOLS=racecheck and GPU_CHECK_SANITIZE_CASES=41-90 pick tools and cases.
PARTS=${GPU_CHECK_PARTS:-tests,bench,micro,compare}
want() { [[ ",$PARTS," == *",$1,"* ]]; }
bench_lines() {  # PROGRAM: Google Benchmark JSON on stdin -> one JSON line per benchmark
  python3 -c 'import json, sys
d = json.load(sys.stdin)
print(json.dumps({"program": sys.argv[1], "context": d.get("context", {})}))
for b in d.get("benchmarks", []): print(json.dumps(dict(program=sys.argv[1], **b)))' "$1"
}

prefix_args=()
if [ -d .deps/usr ]; then
  prefix_args=(-DCMAKE_PREFIX_PATH="$PWD/.deps/usr")
  export LD_LIBRARY_PATH="$PWD/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n1)
note "gpu: ${gpu:-none found} | nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"

# everything, unless the parts need only the GPU test program
targets=()
only_gpu_tests=1
for part in ${PARTS//,/ }; do
  case "$part" in sanitize|sanitize1|sanitize2|soak) ;; *) only_gpu_tests=0 ;; esac
done
[ $only_gpu_tests -eq 1 ] && targets=(--target gpu_tests)
start=$(date +%s)
if ! cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release "${prefix_args[@]}" >"$OUT/build.log" 2>&1 ||
   ! cmake --build build/gpu -j "$(build_jobs)" "${targets[@]}" >>"$OUT/build.log" 2>&1; then
  tail -n 40 "$OUT/build.log"
  echo "build failed"; tar czf "$RESULTS/gpu_check.tgz" -C "$OUT" .; exit 1
fi
note "build${targets[*]:+ (${targets[*]})}: ok in $(( $(date +%s) - start )) s"

if want tests; then
build/gpu/tests/gpu_tests >"$OUT/gpu_tests.log" 2>&1; rc=$?
note "gpu_tests: exit $rc | $(grep -E '^\[doctest\] test cases' "$OUT/gpu_tests.log" | sed 's/\[doctest\] //')"
[ $rc -eq 0 ] || status=1   # 77 (no GPU) is a failure on this machine
# the GPU test programs of single parts (slot_rows_gpu_tests, ...), likewise
for program in build/gpu/tests/*_gpu_tests; do
  [ -x "$program" ] || continue
  [ "$(basename "$program")" = multi_gpu_tests ] && continue  # two GPUs: scripts/gpu_check_multi.sh
  name=$(basename "$program")
  "$program" >"$OUT/$name.log" 2>&1; rc=$?
  note "$name: exit $rc | $(grep -E '^\[doctest\] test cases' "$OUT/$name.log" | sed 's/\[doctest\] //')"
  [ $rc -eq 0 ] || status=1
done
if command -v compute-sanitizer >/dev/null 2>&1; then
  # memcheck over the CUDA-graph and device-error tests (every kernel of the library runs there)
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 3 build/gpu/tests/gpu_tests \
    -tc='*graph*,*device-detected*,*stress*' >"$OUT/sanitizer.log" 2>&1; rc=$?
  note "compute-sanitizer memcheck (graph + device-error tests): exit $rc | $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -n1)"
  [ $rc -eq 0 ] || status=1
fi
build/gpu/tests/host_tests >"$OUT/host_tests.log" 2>&1; rc=$?
note "host_tests: exit $rc | $(grep -E '^\[doctest\] test cases' "$OUT/host_tests.log" | sed 's/\[doctest\] //')"
[ $rc -eq 0 ] || status=1

demo_ok=0; demo_runs=0
for combo in "int16 layer_major per_request" "int16 layer_major block_slot" "uint8 token_major per_request" \
             "int32 token_major block_slot" "uint16 layer_major per_request"; do
  set -- $combo
  dir="build/gpu/demo_$1_$2_$3"
  demo_runs=$((demo_runs + 1))
  echo "== demo --index $1 --layout $2 --storage $3" >>"$OUT/demo.log"
  if build/gpu/examples/engine_loop --backend cuda --index "$1" --layout "$2" --storage "$3" --out "$dir" \
       >>"$OUT/demo.log" 2>&1 && python3 examples/engine_loop/verify_npy.py "$dir" "$1" >>"$OUT/demo.log" 2>&1; then
    demo_ok=$((demo_ok + 1))
  else
    status=1; tail -n 5 "$OUT/demo.log"
  fi
done
note "demo on cuda: $demo_ok/$demo_runs policy combinations verified with numpy"
fi

# Benchmarks (docs/performance.md): the engine loop on CUDA, DESIGN.md section 5 scenarios, eager
# and graph, every copy strategy and storage -> $OUT/engine_loop.jsonl (and with --hidden 4096 ->
# $OUT/engine_loop_hidden.jsonl); the microbenchmarks
# (device_bench, host_path_bench), one JSON line per benchmark -> $OUT/microbench.jsonl.
if want bench && [ -x build/gpu/benchmarks/engine_loop ]; then
  start=$(date +%s)
  if err=$(build/gpu/benchmarks/engine_loop --backend cuda --mode both --copy all --storage all \
             2>&1 >"$OUT/engine_loop.jsonl"); then
    note "engine_loop: $(wc -l <"$OUT/engine_loop.jsonl") runs in $(( $(date +%s) - start )) s -> $OUT/engine_loop.jsonl"
  else
    note "engine_loop: failed: $(printf '%s' "$err" | tail -n 3 | tr '\n' ' ')"; status=1
  fi
  # realistic step lengths: a stand-in bf16 GEMM [n, 4096] x [4096, 4096] per layer, graph mode
  if build/gpu/benchmarks/engine_loop --backend cuda --mode graph --copy all --storage all --hidden 4096 \
       --scenarios decode_B256,decode_B1024,prefill_8k >"$OUT/engine_loop_hidden.jsonl" 2>>"$OUT/build.log"; then
    note "engine_loop --hidden 4096: $(wc -l <"$OUT/engine_loop_hidden.jsonl") runs -> $OUT/engine_loop_hidden.jsonl"
  else
    note "engine_loop --hidden 4096: failed"; status=1
  fi
  mapfile -t lines < <(python3 -c 'import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    added = None if r["fwd_gpu_us"] is None else r["fwd_gpu_us"] - r["fwd0_gpu_us"]
    print("  %s %s %s: host_us %s | fwd_gpu_us - fwd0_gpu_us %s | eos_gpu_us %s | extract_us %s | correct %s" % (
        r["policy"], r["scenario"], r["mode"], r["host_us"], added if added is None else round(added, 2),
        r.get("eos_gpu_us"), r["extract_us"], r["correct"]))' \
    "$OUT/engine_loop.jsonl")
  summary+=("${lines[@]}")
fi
if want micro && [ -x build/gpu/benchmarks/device_bench ]; then
  : >"$OUT/microbench.jsonl"
  for program in device_bench host_path_bench; do
    if build/gpu/benchmarks/$program --benchmark_min_time=0.05 --benchmark_format=json 2>/dev/null |
         bench_lines "$program" >>"$OUT/microbench.jsonl"; then
      note "$program: $(grep -c "^{\"program\": \"$program\", \"name\"" "$OUT/microbench.jsonl") benchmarks -> $OUT/microbench.jsonl"
    else
      note "$program: failed"; status=1
    fi
  done
fi

# Before/after on one machine (scripts/stage_baseline.sh REV staged .baseline/): the baseline's
# benchmarks and this tree's, run alternately on one machine -> $OUT/compare.jsonl, compare.md:
# - the engine loop (graph mode, decode B256/B1024, prefill 8k, every copy strategy and storage),
#   twice each, so a difference can be told from the spread;
# - the same with --hidden 4096 (realistic step lengths), once each, and this tree's with the
#   router recording through the device reference (--capture-path record) too;
# - capture() per layer inside a CUDA graph (device_bench), both builds.
if want compare && [ -d .baseline ] && [ -x build/gpu/benchmarks/engine_loop ]; then
  base_rev=$(cat .baseline/REVISION 2>/dev/null || echo baseline)
  if cmake -S .baseline -B build/baseline -G Ninja -DCMAKE_BUILD_TYPE=Release "${prefix_args[@]}" \
       -DROUTING_REPLAY_BUILD_TESTS=OFF -DROUTING_REPLAY_BUILD_EXAMPLES=OFF >>"$OUT/build.log" 2>&1 &&
     cmake --build build/baseline -j "$(build_jobs)" --target engine_loop_bench device_bench >>"$OUT/build.log" 2>&1; then
    tag() { python3 -c 'import json, sys
for line in sys.stdin: r = json.loads(line); r.update(build=sys.argv[1], round=int(sys.argv[2])); print(json.dumps(r))' "$@"; }
    before="before:$base_rev"
    : >"$OUT/compare.jsonl"
    compare_args=(--backend cuda --mode graph --copy all --storage all --scenarios decode_B256,decode_B1024,prefill_8k)
    for round in 1 2; do
      build/baseline/benchmarks/engine_loop "${compare_args[@]}" 2>/dev/null | tag "$before" $round >>"$OUT/compare.jsonl"
      build/gpu/benchmarks/engine_loop "${compare_args[@]}" 2>/dev/null | tag after $round >>"$OUT/compare.jsonl"
    done
    python3 benchmarks/compare_runs.py "$OUT/compare.jsonl" >"$OUT/compare.md"
    : >"$OUT/compare_hidden.jsonl"
    build/baseline/benchmarks/engine_loop "${compare_args[@]}" --hidden 4096 2>/dev/null | tag "$before" 1 >>"$OUT/compare_hidden.jsonl"
    build/gpu/benchmarks/engine_loop "${compare_args[@]}" --hidden 4096 2>/dev/null | tag after 1 >>"$OUT/compare_hidden.jsonl"
    build/gpu/benchmarks/engine_loop "${compare_args[@]}" --hidden 4096 --capture-path record 2>/dev/null |
      tag after 1 >>"$OUT/compare_hidden.jsonl"
    python3 benchmarks/compare_runs.py "$OUT/compare_hidden.jsonl" >>"$OUT/compare.md"
    for build in baseline gpu; do
      build/$build/benchmarks/device_bench --benchmark_filter='capture/int16/layer_major' --benchmark_min_time=0.05 \
        --benchmark_format=json 2>/dev/null | bench_lines "device_bench:$build" >>"$OUT/compare_capture.jsonl"
    done
    note "before ($base_rev) / after: $(cat "$OUT"/compare*.jsonl | wc -l) results -> $OUT/compare.md"
    mapfile -t lines <"$OUT/compare.md"
    summary+=("${lines[@]}")
  else
    note "baseline ($base_rev): build failed"; status=1
  fi
fi

# The library's share of a realistic step (--hidden 4096: a bf16 GEMM [n, 4096] x [4096, 4096] per
# layer), every strategy and storage, both capture paths, three rounds -> $OUT/overhead.jsonl and
# overhead.md (overhead_pct: the median of per-step differences against the same step without the
# library; begin_us: add_request() + begin_step(); host_us: end_step()).
if want overhead && [ -x build/gpu/benchmarks/engine_loop ]; then
  : >"$OUT/overhead.jsonl"
  for round in 1 2 3; do
    for path in capture record; do
      build/gpu/benchmarks/engine_loop --backend cuda --mode graph --copy all --storage all --hidden 4096 \
        --scenarios decode_B256,decode_B1024,prefill_8k --capture-path "$path" 2>/dev/null |
        python3 -c 'import json, sys
for line in sys.stdin: r = json.loads(line); r.update(build="after", round=int(sys.argv[1])); print(json.dumps(r))' "$round" \
        >>"$OUT/overhead.jsonl"
    done
  done
  python3 benchmarks/compare_runs.py "$OUT/overhead.jsonl" >"$OUT/overhead.md"
  note "overhead (--hidden 4096, 3 rounds): $(wc -l <"$OUT/overhead.jsonl") results -> $OUT/overhead.md"
  mapfile -t lines <"$OUT/overhead.md"
  summary+=("${lines[@]}")
fi

# compute-sanitizer over the whole GPU suite but two tests (docs/reliability.md 2.4 says why): the
# scale tests (the schedule tests' code paths at 2000 steps: hours under a sanitizer) and the
# copy-stream gate (the sanitizer serializes kernels across streams, so the compute stream cannot
# finish while the copy stream is held shut). The header says how the work is spread and split.
sanitize_tools=""
want sanitize && sanitize_tools=racecheck,initcheck,synccheck,memcheck
want sanitize1 && sanitize_tools=${sanitize_tools:-racecheck,memcheck}
want sanitize2 && sanitize_tools=${sanitize_tools:+$sanitize_tools,}initcheck,synccheck
sanitize_tools=${GPU_CHECK_SANITIZE_TOOLS:-$sanitize_tools}
if [ -n "$sanitize_tools" ]; then
  if command -v compute-sanitizer >/dev/null 2>&1; then
    mkdir -p "$RESULTS/sanitize" "$OUT/sanitize"
    rm -f "$RESULTS"/sanitize/sanitizer_*.log
    printf '%s\n' "${summary[@]}" | tee "$OUT/sanitize_summary.txt" >"$RESULTS/sanitize_summary.txt"  # GPU, build
    python3 scripts/gpu_sanitize.py --gpu-tests build/gpu/tests/gpu_tests --tools "$sanitize_tools" \
      --exclude 'CUDA at scale*,CUDA: with the copy stream shut*' --cases "${GPU_CHECK_SANITIZE_CASES:-}" \
      --cases-per-run "${GPU_CHECK_SANITIZE_CASES_PER_RUN:-4}" --workers "${GPU_CHECK_SANITIZE_WORKERS:-0}" \
      --deadline-s "${GPU_CHECK_SANITIZE_DEADLINE_S:-$(( 570 - ($(date +%s) - script_start) ))}" \
      --work "$OUT/sanitize" --results "$RESULTS/sanitize" \
      --summary "$RESULTS/sanitize_summary.txt" --summary "$OUT/sanitize_summary.txt" >"$OUT/sanitize.log" 2>&1 ||
      status=1
    mapfile -t lines < <(grep -E '^compute-sanitizer' "$OUT/sanitize.log")
    summary+=("${lines[@]}")
    [ ${#lines[@]} -gt 0 ] || { note "compute-sanitizer: no result: $(tail -n 3 "$OUT/sanitize.log" | tr '\n' ' ')"; status=1; }
  else
    note "compute-sanitizer: not found (it comes with the CUDA toolkit)"; status=1
  fi
fi

# The CUDA soak at N_max 8192, L 48, K 8: every copy strategy with both storages, each run
# GPU_CHECK_SOAK_STEPS steps (default 100000), bit-exact, device and host memory flat after
# warm-up; the eight at once, one thread each in one process (one CUDA context: their kernels run
# side by side instead of being time-sliced between processes). GPU_CHECK_SOAK_PROCESSES=1 runs
# them as one process each instead, all at once (the fallback; each process's probes then see the
# others' memory too, without the threads' start and end barriers). One JSON line per combination
# -> $OUT/soak.jsonl (steps/s, rows checked, memory figures, where a step's time went), and
# "soak: P/N PASS". The program's own watchdog (GPU_CHECK_SOAK_DEADLINE_S, default: what is left of
# 570 s since this script started) prints each run's progress and aborts if it runs too long;
# `timeout` is the last resort.
if want soak; then
  # by default the watchdog fires before a lent machine's 10-minute limit on the whole command
  # (the build included), so the log still says how far each run got
  soak_deadline=${GPU_CHECK_SOAK_DEADLINE_S:-$(( 570 - ($(date +%s) - script_start) ))}
  [ "$soak_deadline" -ge 60 ] || soak_deadline=60
  soak_all=sync/per_request,sync/block_slot,async_event/per_request,async_event/block_slot
  soak_all+=,double_buffered/per_request,double_buffered/block_slot,device_scatter/block_slot,device_scatter/per_request
  soak_only=${GPU_CHECK_SOAK_ONLY:-}
  run_soak() {  # ONLY LOG: the concurrent soak of the combinations in ONLY (empty: all)
    ROUTING_REPLAY_SOAK_STEPS=${GPU_CHECK_SOAK_STEPS:-100000} ROUTING_REPLAY_SOAK_ONLY=$1 \
      ROUTING_REPLAY_SOAK_DEADLINE_S=$soak_deadline timeout $((soak_deadline + 30)) \
      build/gpu/tests/gpu_tests --no-skip -tc='CUDA concurrent soak*' >"$2" 2>&1
  }
  start=$(date +%s)
  rc=0
  if [ "${GPU_CHECK_SOAK_PROCESSES:-0}" = 1 ]; then
    mode="one process each"
    pids=()
    combos=${soak_only:-$soak_all}
    for combo in ${combos//,/ }; do
      run_soak "$combo" "$OUT/soak_${combo//\//_}.log" &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    cat "$OUT"/soak_*.log >"$OUT/soak.log"
    expected=$(tr ',' '\n' <<<"$combos" | grep -c .)
  else
    mode="threads of one process"
    run_soak "$soak_only" "$OUT/soak.log"; rc=$?
    expected=$(tr ',' '\n' <<<"${soak_only:-$soak_all}" | grep -c .)
  fi
  grep -h '^{"soak": "cuda"' "$OUT/soak.log" >"$OUT/soak.jsonl"
  cp "$OUT/soak.jsonl" "$RESULTS/soak.jsonl"
  passed=$(grep -c '"verdict": "PASS"' "$OUT/soak.jsonl")
  verdict="soak: $passed/$expected $( [ "$passed" -eq "$expected" ] && [ $rc -eq 0 ] && echo PASS || echo FAIL)"
  note "CUDA soak ($mode, ${GPU_CHECK_SOAK_STEPS:-100000} steps each): exit $rc in $(( $(date +%s) - start )) s | $verdict"
  mapfile -t lines < <(grep -E 'deadline|^  [a-z_]+/[a-z_]+: [0-9]+$' "$OUT/soak.log" | head -n 12 | sed 's/^/  /')
  summary+=("${lines[@]}")
  mapfile -t lines < <(python3 -c 'import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "error" in r:
        print("  %s: FAIL: %s" % (r["combination"], r["error"])); continue
    print("  %s/%s: %s, %d steps in %.0f s (%d/s), %d rows bit-exact, device %d KiB after warm-up, growth %d KiB; host RSS %d KiB, growth %d KiB (limits %d / %d KiB, %d runs share the probes)" % (
        r["copy"], r["storage"], r["verdict"], r["steps"], r["seconds"], r["steps_per_s"], r["rows_checked"],
        r["kib_after_warmup"], r["growth_kib"], r["rss_kib_after_warmup"], r["rss_growth_kib"],
        r["device_limit_kib"], r["rss_limit_kib"], r["runs_sharing_probes"]))
    print("    us per step: %s" % r["us_per_step"])' "$OUT/soak.jsonl")
  summary+=("${lines[@]}")
  summary+=("$verdict")
  [ $rc -eq 0 ] && [ "$passed" -eq "$expected" ] || status=1
fi

{
  echo "==== gpu_check summary"
  printf '%s\n' "${summary[@]}"
  echo "==== $( [ $status -eq 0 ] && echo PASS || echo FAIL )"
} | tee "$RESULTS/summary.txt"
tar czf "$RESULTS/gpu_check.tgz" -C "$OUT" .
exit $status
