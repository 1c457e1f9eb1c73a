"""The side by side's JSON lines as a markdown table: per scenario and round, each implementation's
median (p90) host path per step in us, their ratio, the connector's calls alone (vLLM / ours and
their ratio, where the lines carry connector_us_median), minor page faults per step (the engine
thread's median, the whole process's mean in brackets), and whether every request came back exact.
Usage: python3 table.py side_by_side.jsonl"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

ORDER = ["decode_B1", "decode_B64", "decode_B256", "decode_B1024", "prefill_8k", "multi_turn", "store_probe"]


def main(path: str) -> None:
    rows = defaultdict(dict)
    extra = []
    for line in open(path):
        r = json.loads(line)
        if "scenario" in r and "impl" in r:
            rows[(r["scenario"], r.get("round", 1))][r["impl"]] = r
        elif "slope_us_per_request_B64_B1024" in r:
            extra.append(f"- round {r.get('round', 1)}, {r['impl']}: {r['slope_us_per_request_B64_B1024']} us per "
                         "request between decode B64 and B1024")
    print("| scenario | round | vLLM 0.33 us median (p90) | routing_replay us median (p90) | vLLM / ours "
          "| connector calls alone, vLLM / ours (ratio) "
          "| page faults per step, engine thread (process mean), vLLM / ours | exact |")
    print("|---|---|---|---|---|---|---|---|")
    def order(item):
        (scenario, rnd), _ = item
        return (ORDER.index(scenario) if scenario in ORDER else len(ORDER), scenario, rnd)

    for (scenario, rnd), by in sorted(rows.items(), key=order):
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
        print(f"| {scenario}{memory} | {rnd} | {cell(v)} | {cell(o)} | {ratio} | {calls} | {faults} | {exact} |")
    print()
    print("\n".join(extra))


if __name__ == "__main__":
    main(sys.argv[1])
