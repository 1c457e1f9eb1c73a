#!/usr/bin/env python3
"""Renders engine_loop JSON lines as a Markdown table, one row per (policy, scenario, mode).

usage: results_table.py engine_loop.jsonl [more.jsonl ...]   (or the lines on stdin)

One row per (policy, scenario, mode), in input order; "added GPU" is fwd_gpu_us - fwd0_gpu_us and
"added step" is step_us - step0_us. Missing readings (the host backend's GPU fields) print as "-".
"""
import fileinput
import json

COLUMNS = ["policy", "scenario", "mode", "host_us", "fwd_gpu_us", "fwd0_gpu_us", "added GPU",
           "eos_gpu_us", "step_us", "step0_us", "added step", "extract_us", "correct"]


def cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def difference(a, b):
    return None if a is None or b is None else a - b


def main() -> None:
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for line in fileinput.input():
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        r["added GPU"] = difference(r["fwd_gpu_us"], r["fwd0_gpu_us"])
        r["added step"] = difference(r["step_us"], r["step0_us"])
        print("| " + " | ".join(cell(r.get(c)) for c in COLUMNS) + " |")


if __name__ == "__main__":
    main()
