"""Prints one short line per JSON line of benchmarks/python/engine_loop.py or of the side by side
with the peer (../shared/peers/engine_loop_vs_peer.py). Usage: summarize.py FILE..."""

import json
import sys


def line(r: dict) -> str | None:
    if r.get("bench") == "python_engine_loop":
        return (f"{r['api']:12} {r['mode']:5} {r['scenario']:12} step {r.get('step_us')} us  host {r['host_us']} us "
                f"({r['per_request_ns']} ns/request)  plan {r.get('plan_us')} begin {r.get('begin_us')} "
                f"end {r.get('end_us')}  capture {r['capture_us']} us  extract {r['extract_us']} us  "
                f"correct {r['correct']}")
    if r.get("part") == "capture":
        return (f"{r['impl']:6} capture rows {r['rows']:>5}: host {r['host_us_per_call']} us/call, "
                f"gpu {r['gpu_us_per_call']} us/call")
    if r.get("part") == "steps":
        return (f"{r['impl']:6} {r['mode']:5} {r['scenario']:12} host_path {r.get('host_path_us')} us  "
                f"added_step {r.get('added_step_us')} us  added_fwd_gpu {r.get('added_fwd_gpu_us')} us  "
                f"extract {r.get('extract_us')} us  correct {r.get('correct')}")
    return None


for path in sys.argv[1:]:
    for text in open(path):
        try:
            out = line(json.loads(text))
        except (ValueError, KeyError):
            out = None
        if out:
            print("  " + out)
