#!/usr/bin/env python3
"""Side-by-side medians of engine-loop JSON lines from two builds run alternately on one machine.

Usage: compare_runs.py FILE.jsonl
Each line is an engine_loop result with two added keys: "build" (e.g. "before", "after") and
"round" (1, 2, ...). Prints, per (policy, scenario, mode), each field's value per build as the
median over rounds, with the spread over rounds, so a difference can be told from noise.
"""
import collections
import json
import statistics
import sys

FIELDS = ("host_us", "begin_us", "eos_gpu_us", "added_fwd_us", "overhead_pct", "extract_us")


def overhead_pct(r):
    """Step time added by the library, in percent of the step without it: the median of the
    per-step differences where the build reports it (overhead_us), else the difference of the
    medians (older builds)."""
    if not r.get("step0_us"):
        return None
    added = r.get("overhead_us")
    if added is None and r.get("step_us") is not None:
        added = r["step_us"] - r["step0_us"]
    return None if added is None else 100.0 * added / r["step0_us"]


def added_fwd(r):
    if r.get("fwd_gpu_us") is None or r.get("fwd0_gpu_us") is None:
        return None
    return r["fwd_gpu_us"] - r["fwd0_gpu_us"]


def main(path):
    runs = collections.defaultdict(lambda: collections.defaultdict(list))
    builds = []
    for line in open(path):
        r = json.loads(line)
        r["added_fwd_us"] = added_fwd(r)
        r["overhead_pct"] = overhead_pct(r)
        key = (r["policy"], r["scenario"], r["mode"], r.get("capture_path", "capture"))
        if r["build"] not in builds:
            builds.append(r["build"])
        runs[key][r["build"]].append(r)
    cols = [f"{f} {b}" for f in FIELDS for b in builds]
    print("| policy | scenario | mode | capture path | " + " | ".join(cols) + " | correct |")
    print("|" + "---|" * (5 + len(cols)))
    for key in sorted(runs):
        cells = []
        for f in FIELDS:
            for b in builds:
                values = [x[f] for x in runs[key][b] if x.get(f) is not None]
                if not values:
                    cells.append("-")
                    continue
                spread = max(values) - min(values)
                cells.append(f"{statistics.median(values):.1f} (±{spread / 2:.1f})")
        correct = all(x["correct"] for b in builds for x in runs[key][b])
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + f" | {correct} |")


if __name__ == "__main__":
    main(sys.argv[1])
