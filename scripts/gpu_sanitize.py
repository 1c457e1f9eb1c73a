#!/usr/bin/env python3
"""compute-sanitizer over the GPU suite, spread over the machine's cores (scripts/gpu_check.sh, parts
sanitize, sanitize1, sanitize2).

The suite's test cases (those passing the filters, in doctest's file order) are cut into runs of
--cases-per-run consecutive cases; each (tool, run) is one `compute-sanitizer --tool T gpu_tests
--first=a --last=b` process, and --workers of them run at once on the one GPU (a sanitized test is
bound by the host's side of the instrumentation, not by the GPU: four tools side by side took a
quarter of their time one after the other). Runs are taken tool by tool, the slowest tool first, so
that tools finish one after another. As each run ends, a line goes to the summary file and its log
to the results folder; when a tool's last run ends, the tool's line (errors over every case, PASS
or FAIL) and its whole log (sanitizer_TOOL.log) follow. At --deadline-s no run is started and
running ones are stopped: their cases are reported with the command that runs them on the same
machine (--cases a-b, --tools), so nothing already done is lost or redone.

Exit status: 0 when every (tool, case) ran and passed with 0 errors (0 hazards for racecheck).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

#: the slowest first (measured on an H200, 2026-11-23, one tool at a time over 89 test cases:
#: racecheck 625 s, initcheck 410 s, synccheck 348 s, memcheck 317 s)
TOOLS = ("racecheck", "initcheck", "synccheck", "memcheck")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu-tests", required=True, help="the gpu_tests program")
    p.add_argument("--tools", default=",".join(TOOLS), help="comma-separated compute-sanitizer tools")
    p.add_argument("--exclude", default="", help="doctest -tce filter (test cases left out)")
    p.add_argument("--cases", default="", help="a-b: only test cases a to b (1-based, of those passing the filters)")
    p.add_argument("--cases-per-run", type=int, default=4)
    p.add_argument("--workers", type=int, default=0, help="runs at once (0: the cores less two, at least 2)")
    p.add_argument("--deadline-s", type=float, default=0, help="no run starts after this many seconds (0: none)")
    p.add_argument("--work", required=True, help="folder for the logs as they are written")
    p.add_argument("--results", required=True, help="folder the logs are copied to as runs end")
    p.add_argument("--summary", required=True, action="append", help="file the lines are appended to (repeatable)")
    p.add_argument("--sanitizer", default="compute-sanitizer")
    return p.parse_args(argv)


class Summary:
    """Appends lines to the summary file (and stdout) as they come, from any thread."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self.lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self.lock:
            for path in self.paths:
                with open(path, "a") as f:
                    f.write(line + "\n")
            print(line, flush=True)


def count_cases(args) -> int:
    command = [args.gpu_tests, "--count"] + ([f"-tce={args.exclude}"] if args.exclude else [])
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    found = re.search(r"unskipped test cases passing the current filters: (\d+)", out.stdout)
    if not found:
        raise SystemExit(f"{' '.join(command)}: no count (exit {out.returncode}): {out.stdout[-400:]}{out.stderr[-400:]}")
    return int(found.group(1))


def verdict(log: str, tool: str, cases: int) -> tuple[bool, str, int]:
    """(passed, "N errors | doctest line", errors) of one run's log of `cases` test cases.

    doctest's summary counts every case that passes the name filters, whichever of them
    --first/--last let run, so it cannot tell how many ran: a run passes with 0 errors (0 hazards
    for racecheck), no failed case and doctest's "Status: SUCCESS!"."""
    with open(log, errors="replace") as f:
        text = f.read()
    errors = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    hazards = re.findall(r"RACECHECK SUMMARY: (\d+) hazard", text)
    doctest = re.findall(r"\[doctest\] test cases:\s*(\d+) \|\s*(\d+) passed \|\s*(\d+) failed", text)
    found = int(errors[-1]) if errors else None
    if tool == "racecheck" and hazards:
        found = max(found or 0, int(hazards[-1]))
    failed = int(doctest[-1][2]) if doctest else 0
    success = "[doctest] Status: SUCCESS!" in text
    ok = found == 0 and doctest and failed == 0 and success
    what = (f"{'no summary' if found is None else f'{found} errors'} | cases {cases} run, "
            f"{failed} failed, doctest {'SUCCESS' if success else 'no SUCCESS'}")
    return bool(ok), what, found or 0


def main(argv=None) -> int:
    args = parse_args(argv)
    say = Summary(args.summary)
    os.makedirs(args.work, exist_ok=True)
    os.makedirs(args.results, exist_ok=True)
    start = time.monotonic()
    tools = [t for t in TOOLS if t in args.tools.split(",")] + [t for t in args.tools.split(",") if t not in TOOLS]
    total = count_cases(args)
    first, last = 1, total
    if args.cases:
        first, last = (int(x) for x in args.cases.split("-"))
        last = min(last, total)
    workers = args.workers or max(2, (os.cpu_count() or 4) - 2)
    runs = [(tool, a, min(a + args.cases_per_run - 1, last)) for tool in tools
            for a in range(first, last + 1, args.cases_per_run)]
    say(f"compute-sanitizer {', '.join(tools)}: test cases {first}-{last} of {total} "
        f"(excluded: {args.exclude or 'none'}), {len(runs)} runs of {args.cases_per_run} cases, {workers} at once"
        + (f", none started after {args.deadline_s:.0f} s" if args.deadline_s else ""))

    results: dict[tuple[str, int, int], tuple[bool, str, int, float]] = {}
    remaining = {tool: sum(1 for r in runs if r[0] == tool) for tool in tools}
    lock = threading.Lock()

    def finish_tool(tool: str) -> None:
        mine = sorted((r, v) for r, v in results.items() if r[0] == tool)
        with open(os.path.join(args.results, f"sanitizer_{tool}.log"), "w") as whole:
            for (t, a, b), _ in mine:
                with open(os.path.join(args.work, f"sanitizer_{t}_{a}-{b}.log"), errors="replace") as part:
                    whole.write(f"==== {t}, test cases {a}-{b}\n")
                    whole.write(part.read())
        shutil.copy(os.path.join(args.results, f"sanitizer_{tool}.log"), os.path.join(args.work, f"sanitizer_{tool}.log"))
        errors = sum(v[2] for _, v in mine)
        not_run = [f"{a}-{b}" for (_, a, b), v in mine if v[1].startswith(("not run", "stopped"))]
        ok = all(v[0] for _, v in mine)
        seconds = sum(v[3] for _, v in mine)
        line = (f"compute-sanitizer {tool}: {'PASS' if ok else 'FAIL'}, {errors} errors over test cases {first}-{last} "
                f"in {len(mine)} runs ({seconds:.0f} s of runs, done {time.monotonic() - start:.0f} s after the start)")
        if not_run:
            line += (f"; not run: cases {', '.join(not_run)}: GPU_CHECK_PARTS=sanitize GPU_CHECK_SANITIZE_TOOLS={tool} "
                     f"GPU_CHECK_SANITIZE_CASES={not_run[0].split('-')[0]}-{last} scripts/gpu_check.sh")
        say(line)

    def run(unit) -> None:
        tool, a, b = unit
        log = os.path.join(args.work, f"sanitizer_{tool}_{a}-{b}.log")
        left = args.deadline_s - (time.monotonic() - start) if args.deadline_s else None
        t0 = time.monotonic()
        if left is not None and left < 5:
            with open(log, "w") as f:
                f.write("not run: deadline\n")
            outcome = (False, "not run (deadline)", 0, 0.0)
        else:
            command = [args.sanitizer, "--tool", tool, "--error-exitcode", "3", args.gpu_tests,
                       f"--first={a}", f"--last={b}"] + ([f"-tce={args.exclude}"] if args.exclude else [])
            with open(log, "w") as f:
                f.write(" ".join(command) + "\n")
                f.flush()
                # a process group of its own (Python 3.11+): at the deadline the sanitizer and the program under it both stop
                process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, process_group=0)
                try:
                    rc = process.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                    rc = None
            ok, what, errors = verdict(log, tool, b - a + 1)
            if rc is None:
                ok, what = False, f"stopped at the deadline | {what}"
            elif rc != 0:
                ok, what = False, f"exit {rc} | {what}"
            outcome = (ok, what, errors, time.monotonic() - t0)
        shutil.copy(log, os.path.join(args.results, os.path.basename(log)))
        with lock:
            results[unit] = outcome
            remaining[tool] -= 1
            last_of_tool = remaining[tool] == 0
        say(f"  {tool} cases {a}-{b}: {'ok' if outcome[0] else 'FAIL'} | {outcome[1]} | {outcome[3]:.0f} s")
        if last_of_tool:
            with lock:
                finish_tool(tool)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for future in [pool.submit(run, unit) for unit in runs]:
            future.result()
    ok = all(v[0] for v in results.values())
    say(f"compute-sanitizer: {'PASS' if ok else 'FAIL'} ({len(tools)} tools, {time.monotonic() - start:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
