"""The side by side's JSON lines as markdown tables.

First, per scenario, outputs mode (dropped, kept) and round: each implementation's median (p90) host
path per step in us, their ratio, the connector's calls alone (vLLM / ours and their ratio, where the
lines carry connector_us_median), minor page faults per step (the engine thread's median, the whole
process's mean in brackets), and whether every request came back exact. Then, where both modes ran,
kept / dropped per implementation (host path and connector calls) with routing_replay's output pool
(bytes held at the end, its high-water mark, extents made past the budget by its filling thread and
on the engine's thread). Then the drop-in's lines (engine_loop.py, where the file holds them): host
path per step and the engine thread's page faults.
Usage: python3 table.py side_by_side.jsonl [engine_loop.jsonl]"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

ORDER = ["decode_B1", "decode_B64", "decode_B256", "decode_B1024", "prefill_8k", "multi_turn", "store_probe"]
MODES = ["dropped", "kept"]


def order(key):
    scenario, mode, rnd = key
    return (ORDER.index(scenario) if scenario in ORDER else len(ORDER), scenario,
            MODES.index(mode) if mode in MODES else len(MODES), rnd)


def mib(b):
    return f"{b / 2**20:.0f}" if b is not None else "-"


def main(path: str, dropin: str | None = None) -> None:
    rows = defaultdict(dict)
    extra = []
    for line in open(path):
        r = json.loads(line)
        if "scenario" in r and "impl" in r:
            rows[(r["scenario"], r.get("outputs", "dropped"), r.get("round", 1))][r["impl"]] = r
        elif "slope_us_per_request_B64_B1024" in r:
            extra.append(f"- round {r.get('round', 1)}, {r['impl']} ({r.get('outputs', 'dropped')}): "
                         f"{r['slope_us_per_request_B64_B1024']} us per request between decode B64 and B1024")
    print("| scenario | outputs | round | vLLM 0.33 us median (p90) | routing_replay us median (p90) | vLLM / ours "
          "| connector calls alone, vLLM / ours (ratio) "
          "| page faults per step, engine thread (process mean), vLLM / ours | exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (scenario, mode, rnd), by in sorted(rows.items(), key=lambda item: order(item[0])):
        v, o = by.get("vllm"), by.get("routing_replay")

        def cell(x):
            return f"{x['host_us_median']} ({x['host_us_p90']})" if x else "-"

        ratio = round(v["host_us_median"] / o["host_us_median"], 1) if v and o and o["host_us_median"] else "-"

        def faults_of(x):
            return f"{x['minflt_per_step']} ({x.get('minflt_process_per_step_mean')})" if x else "-"

        faults = f"{faults_of(v)} / {faults_of(o)}"
        calls = "-"
        if v and o and v.get("connector_us_median") and o.get("connector_us_median"):
            calls = (f"{v['connector_us_median']} / {o['connector_us_median']} "
                     f"({round(v['connector_us_median'] / o['connector_us_median'], 1)})")
        exact = all(x["correct"] for x in (v, o) if x)
        memory = ""
        if scenario == "store_probe":
            memory = f" ({v and v.get('rss_per_filed_block_bytes')} / {o and o.get('rss_per_filed_block_bytes')} B per block)"
        print(f"| {scenario}{memory} | {mode} | {rnd} | {cell(v)} | {cell(o)} | {ratio} | {calls} | {faults} | {exact} |")
    print()
    print("\n".join(extra))

    kept_rows = []
    for (scenario, mode, rnd), by in sorted(rows.items(), key=lambda item: order(item[0])):
        if mode != "kept" or (scenario, "dropped", rnd) not in rows:
            continue
        dropped = rows[(scenario, "dropped", rnd)]
        cells = []
        for impl in ("vllm", "routing_replay"):
            k, d = by.get(impl), dropped.get(impl)
            if k and d and d["host_us_median"] and d.get("connector_us_median"):
                cells.append(f"{round(k['host_us_median'] / d['host_us_median'], 2)} / "
                             f"{round(k['connector_us_median'] / d['connector_us_median'], 2)}")
            else:
                cells.append("-")
        pool = (by.get("routing_replay") or {}).get("kept_pool") or {}
        pool_cell = (f"{mib(pool.get('size_bytes'))} / {mib(pool.get('high_water_bytes'))} MiB, "
                     f"{pool.get('extents_over_budget', '-')} / {pool.get('extents_in_step', '-')}") if pool else "-"
        kept_rows.append(f"| {scenario} | {rnd} | {cells[0]} | {cells[1]} | {pool_cell} |")
    if kept_rows:
        print()
        print("| scenario | round | kept / dropped, vLLM 0.33: host path / connector calls "
              "| kept / dropped, routing_replay: host path / connector calls "
              "| routing_replay's output pool at the end: held / high-water of outputs held, "
              "extents made past the budget (filling thread) / on the engine's thread |")
        print("|---|---|---|---|---|")
        print("\n".join(kept_rows))

    if dropin:
        print()
        print("| drop-in (engine_loop.py) | requests | round | host path us median | page faults per step, "
              "engine thread (median, mean) | superblocks ready / mapped in a step | exact |")
        print("|---|---|---|---|---|---|---|")
        for line in open(dropin):
            r = json.loads(line)
            if r.get("bench") != "python_engine_loop":
                continue
            g = r.get("host_memory_growth") or {}
            ahead = r.get("host_memory_ahead")
            ahead = f", {ahead >> 20} MiB ahead" if ahead else ""
            print(f"| {r['api']} {r['scenario']} {r['mode']} | finished at the {r.get('finish', 'end')}{ahead} "
                  f"| {r.get('round', 1)} | {r['host_us']} | {r.get('minflt_per_step')}, {r.get('minflt_per_step_mean')} "
                  f"| {g.get('superblocks_ahead', '-')} / {g.get('superblocks_in_step', '-')} | {r['correct']} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
