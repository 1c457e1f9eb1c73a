"""What the side by side's post-forward figure costs before any capturer runs.

`engine_loop_vs_peer.py` (the peer's harness, loaded from where it lives; never copied into the
project) times `Engine.after_forward(sched)`: it builds vLLM's dict of string ids for the step
(`{f"r{r}": t}`), calls vLLM's `issue_routing_d2h_copy`, which orders the dict again by the batch's
ids and copies the step's positions from the GPU into pinned memory (a synchronous copy), and only
then calls the capturer's `sync_fwd_experts_buffer_DtoH`. This script times the same
`after_forward`, on the same decode batches and prefill chunks as the harness's "post-forward host
path alone", with three capturers installed in turn:

  null     a capturer whose `sync_fwd_experts_buffer_DtoH` returns at once: the harness's floor, what
           every capturer pays under this figure whatever it does
  dropin   routing_replay's drop-in (its defaults, the harness's `--copy`)
  peer     vLLM PR 39917's capturer

One JSON line per (capturer, scenario): `host_path_us` (median, as the harness) and, for the
capturers, `over_floor_us` (its median less null's, from rounds that alternate the capturers).
Usage (a CUDA machine with torch; the project's package and the peer importable):
  python3 benchmarks/python/harness_floor.py --peers .peers [--copy device_scatter] [--rounds 3]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time


class NullCapturer:
    """Takes the post-forward call and does nothing: what the harness costs on its own."""

    def capture(self, layer_id, topk_ids):  # noqa: D102 - the capturer's interface
        pass

    def sync_fwd_experts_buffer_DtoH(self, positions, num_scheduled_tokens):  # noqa: N802, D102
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", required=True, help="the folder holding engine_loop_vs_peer.py")
    ap.add_argument("--copy", default="device_scatter", help="the drop-in's copy strategy")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30, help="post-forward calls timed per scenario and round")
    args = ap.parse_args()
    sys.path.insert(0, args.peers)
    harness = importlib.import_module("engine_loop_vs_peer")
    peer = harness.peer
    import torch

    harness.ARGS = argparse.Namespace(copy=args.copy, index="int16")
    scenarios = {name: steps for name, steps, _ in harness.scenarios()}
    # the harness's (b) part: decode batches one position on, prefill chunks of new requests
    names = ["decode_B1", "decode_B64", "decode_B256", "decode_B1024", "prefill_8k"]
    times: dict = {}
    for rnd in range(args.rounds):
        impls = ["null", "dropin", "peer"]
        if rnd % 2:
            impls.reverse()
        for impl in impls:
            for name in names:
                # a fresh engine per scenario, its steps run first (untimed), as the harness does
                eng = harness.Engine(impl, capture=impl != "null")
                if impl == "null":
                    eng.cap = NullCapturer()
                    peer.set_global_experts_capturer(eng.cap)
                steps = scenarios[name]
                for sched in steps:
                    eng.forward(eng.set_batch(sched))
                    eng.after_forward(sched)
                last = steps[-1]
                for rep in range(args.reps):
                    if name.startswith("decode"):
                        sched = [(r, p + 1 + rep, t) for (r, p, t) in last]
                    else:
                        sched = [(1000 + 4 * rep + j, 0, t) for j, (_, _, t) in enumerate(last)]
                    eng.forward(eng.set_batch(sched))
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    eng.after_forward(sched)
                    times.setdefault((impl, name), []).append((time.perf_counter() - t0) * 1e6)
                del eng
                torch.cuda.synchronize()
    print(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy=args.copy)), flush=True)
    for name in names:
        floor = statistics.median(times[("null", name)])
        for impl in ("null", "dropin", "peer"):
            med = statistics.median(times[(impl, name)])
            line = dict(scenario=name, capturer=impl, host_path_us=round(med, 2))
            if impl != "null":
                line["over_floor_us"] = round(med - floor, 2)
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
