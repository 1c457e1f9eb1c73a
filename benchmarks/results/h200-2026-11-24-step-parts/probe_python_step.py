"""Probe of 2026-11-24 (kept with its results): Replay's per-step calls from Python on a GPU, by part, on torch's
default (legacy) stream and on a side stream."""
import json, statistics, time
import numpy as np
import torch
import routing_replay as rr

L, K, E = 48, 8, 128
pc = time.perf_counter
med = lambda x: round(statistics.median(x) * 1e6, 2)

for kind in ("default", "side"):
    for B in (1, 64, 1024):
        rp = rr.Replay(num_experts=E, top_k=K, max_tokens_per_step=8192, max_model_len=4096, moe_layers=range(L),
                       device="cuda", copy="device_scatter", storage="per_request")
        hs = np.array([rp.add_request(r) for r in range(B)], dtype=np.uint64)
        firsts = np.zeros(B, np.int64)
        counts = np.ones(B, np.int32)
        plan = rr.StepPlan()
        ids = torch.randint(0, E, (B, K), device="cuda")
        s = torch.cuda.Stream() if kind == "side" else torch.cuda.current_stream()
        T = {k: [] for k in ("plan", "begin", "end", "end_native", "capture", "handle", "noop")}
        with torch.cuda.stream(s):
            raw = s.cuda_stream
            for st in range(240):
                firsts[:] = st
                t0 = pc(); plan.clear(); plan.schedule_handles(hs, firsts, counts); t1 = pc()
                rp.begin_step(plan); t2 = pc()
                for layer in range(L):
                    c0 = pc(); rp.capture(layer, ids); T["capture"].append(pc() - c0)
                torch.cuda.synchronize()
                h0 = pc(); rp.stream_handle(None); h1 = pc(); rp._native.num_requests; h2 = pc()
                t3 = pc()
                if st % 2:
                    rp.end_step()
                else:
                    rp._native.end_step(raw)
                t4 = pc()
                torch.cuda.synchronize()
                if st >= 40:
                    T["plan"].append(t1 - t0); T["begin"].append(t2 - t1)
                    T["end" if st % 2 else "end_native"].append(t4 - t3)
                    T["handle"].append(h1 - h0); T["noop"].append(h2 - h1)
        print(json.dumps({"probe": "python_step", "stream": kind, "B": B, **{k + "_us": med(v) for k, v in T.items()}}), flush=True)
        rp.drain()
        del rp
