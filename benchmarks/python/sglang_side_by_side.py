"""SGLang 0.5.23's routed-experts capturer (the peer) against routing_replay.sglang's, side by side.

One synthetic engine loop (48 MoE layers, top-8 of 128 experts; ids a pure function of request,
position, layer and column; eager forwards) drives each capturer through SGLang's own engine-side
calls, one after the other in the same run:

  path=sync     on_forward_end(forward_batch, can_run_graph=False, cuda_graph_batch=None)
  path=overlap  out = on_forward_end(..., no_copy_to_cpu=True); on the engine's copy stream (which
                waits for the forward stream): out.map_device_tensors(t.to("cpu", non_blocking=True)),
                copy_done.record(); then copy_done.synchronize(); out.finalize()

timed per step with the device drained first (host backend: its compute stream synchronized and 1 ms
for its side stream), so the figures are the engine thread's host path alone. Scenarios:

  decode_B1/B64/B256/B1024   B requests decoding one token a step (prefilled first, untimed)
  prefill_8k                 4 new requests of 2048 tokens a step

Each request's rows are read at the end with get_topk and checked against the ids its forward
produced. One JSON line per (impl, path, scenario):

  host_us, host_us_p90     the host path per step (median, 90th percentile), warm-up steps excluded
  page_faults_per_step     minor page faults during the host path, per steady-state step (getrusage)
  pinned_bytes             host bytes of the KV-slot cache (the peer: its int32 host cache)
  extract_us               get_topk per request (median)
  correct                  every request's [T, L, K] equals its ids

impls: sglang (the peer); ours (defaults: a step of at most 64 rows stored by the end-of-step
kernel alone, one launch; a larger one scattered on a side stream); ours_compute (larger steps
scattered on the compute stream: scatter_on_compute_stream=True); ours_unfused (every step scattered
on a side stream by a second kernel: fused_scatter_max_rows=0, two launches at every size). The peer is loaded from --peers, or where the tests look
(ROUTING_REPLAY_PEERS, <checkout>/.peers, <checkout>/../shared/peers).

Usage:
  python3 benchmarks/python/sglang_side_by_side.py --device cuda|cpu [--steps 64] [--warmup 8]
      [--scenarios decode_B1,...] [--impls sglang,ours,ours_compute,ours_unfused] [--paths sync,overlap]
      [--pool-tokens N] [--prompt P] [--torch-threads T] [--peers PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
import torch

L, K, E = 48, 8, 128
SCENARIOS = ("decode_B1", "decode_B64", "decode_B256", "decode_B1024", "prefill_8k")
CHECKOUT = Path(__file__).resolve().parents[2]


def load_peer(folder):
    candidates = [Path(folder)] if folder else []
    if os.environ.get("ROUTING_REPLAY_PEERS"):
        candidates.append(Path(os.environ["ROUTING_REPLAY_PEERS"]))
    candidates += [CHECKOUT / ".peers", CHECKOUT.parent / "shared" / "peers"]
    for c in candidates:
        path = c / "sglang_0_5_23_capturer.py"
        if path.is_file():
            spec = importlib.util.spec_from_file_location("sglang_peer_capturer", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            return module
    sys.exit(f"sglang_0_5_23_capturer.py not found in {', '.join(map(str, candidates))}")


def pct(xs, q):
    return round(float(np.percentile(xs, q)), 2) if xs else None


class Engine:
    """Requests with contiguous KV slots, a req_to_token pool, and forwards of 48 layers."""

    def __init__(self, device, num_requests, max_len, pool_tokens):
        self.device = device
        self.max_len = max_len
        if num_requests * max_len + 1 > pool_tokens:
            sys.exit(f"--pool-tokens {pool_tokens} is too small: {num_requests} requests of {max_len} tokens")
        self.base = torch.arange(num_requests, dtype=torch.int64, device=device) * max_len + 1
        positions = torch.arange(max_len, dtype=torch.int64, device=device)
        self.req_to_token = (self.base[:, None] + positions[None, :]).to(torch.int32)
        self.pool = SimpleNamespace(req_to_token=self.req_to_token)
        self.kk = torch.arange(K, dtype=torch.int64, device=device) * 17
        self.layer_term = torch.arange(L, dtype=torch.int64, device=device) * 131

    def batch(self, reqs, first, count):
        """Rows of `count` tokens per request from position `first[i]`: (req, pos, out_cache_loc)."""
        req = torch.repeat_interleave(torch.as_tensor(reqs, device=self.device), count)
        offset = torch.arange(len(req), device=self.device) - torch.repeat_interleave(
            torch.arange(0, len(req), count, device=self.device), count)
        pos = torch.repeat_interleave(torch.as_tensor(first, device=self.device), count) + offset
        return req, pos, self.base[req] + pos

    def forward(self, cap, req, pos):
        base = req * 7919 + pos * 31
        for layer in range(L):
            ids = ((base[:, None] + self.layer_term[layer] + self.kk[None, :]) % E).to(torch.int32)
            cap.capture(layer, ids)


def expected(req, length):
    pos = np.arange(length)[:, None, None]
    return ((req * 7919 + pos * 31 + np.arange(L)[None, :, None] * 131 + np.arange(K)[None, None, :] * 17) % E
            ).astype(np.int32)


def make(impl, peer, device, pool_tokens, max_requests):
    mc = SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=L, num_experts_per_tok=K, num_experts=E))
    if impl == "sglang":
        before = peer._PINNED_BYTES[0]
        cap = peer.RoutedExpertsCapturer(mc, num_tokens=pool_tokens, max_running_requests=max_requests,
                                         num_fused_shared_experts=0, device=device)
        return cap, peer._PINNED_BYTES[0] - before
    from routing_replay.sglang import RoutedExpertsCapturer

    options = {"ours": {}, "ours_compute": {"scatter_on_compute_stream": True},
               "ours_unfused": {"fused_scatter_max_rows": 0}}
    if impl not in options:
        sys.exit(f"unknown impl {impl!r}: sglang, {', '.join(options)}")
    cap = RoutedExpertsCapturer(mc, num_tokens=pool_tokens, max_running_requests=max_requests,
                                num_fused_shared_experts=0, device=device, **options[impl])
    return cap, cap.pinned_bytes


def drain(cap, device):
    if device == "cuda":
        torch.cuda.synchronize()
    elif getattr(cap, "_stream", None) is not None:
        cap._stream.synchronize()
        time.sleep(0.001)  # the side stream's worker


def run(impl, path, scenario, peer, args):
    device = args.device
    b = 4 if scenario == "prefill_8k" else int(scenario.split("_B")[1])
    steps = args.warmup + args.steps
    if scenario == "prefill_8k":
        num_requests, max_len = 4 * steps, 2048 + 1
    else:
        num_requests, max_len = b, args.prompt + steps + 1
    engine = Engine(device, num_requests, max_len, args.pool_tokens)
    cap, pinned = make(impl, peer, device, args.pool_tokens, max(b, 1024))
    copy_stream = torch.cuda.Stream() if device == "cuda" else None
    copy_done = torch.cuda.Event() if device == "cuda" else None
    overlap = path == "overlap"

    def step(req, pos, loc, timed):
        engine.forward(cap, req, pos)
        fb = SimpleNamespace(out_cache_loc=loc, out_cache_loc_virtual=None)
        drain(cap, device)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        if overlap:
            out = cap.on_forward_end(fb, False, None, no_copy_to_cpu=True)
            if copy_stream is not None:
                copy_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(copy_stream):
                    out.map_device_tensors(lambda t: t.to("cpu", non_blocking=True))
                    copy_done.record()
                copy_done.synchronize()
            else:
                out.map_device_tensors(lambda t: t.to("cpu", non_blocking=True))
            out.finalize()
        else:
            cap.on_forward_end(fb, False, None)
        host = (time.perf_counter() - t0) * 1e6
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        if timed:
            host_us.append(host)
            fault_counts.append(faults)

    host_us, fault_counts = [], []
    lengths = {}
    if scenario == "prefill_8k":
        for s in range(steps):
            reqs = list(range(4 * s, 4 * s + 4))
            req, pos, loc = engine.batch(reqs, [0] * 4, 2048)
            step(req, pos, loc, s >= args.warmup)
            lengths.update({r: 2048 for r in reqs})
    else:
        per_step = max(1, 8192 // args.prompt)
        for g in range(0, b, per_step):  # prefill, untimed
            reqs = list(range(g, min(b, g + per_step)))
            req, pos, loc = engine.batch(reqs, [0] * len(reqs), args.prompt)
            step(req, pos, loc, False)
        for s in range(steps):
            req, pos, loc = engine.batch(list(range(b)), [args.prompt + s] * b, 1)
            step(req, pos, loc, s >= args.warmup)
        lengths = {r: args.prompt + steps for r in range(b)}
    extract, correct = [], True
    for r, length in lengths.items():
        t0 = time.perf_counter()
        rows = cap.get_topk(r, length + 1, engine.pool)
        extract.append((time.perf_counter() - t0) * 1e6)
        correct = correct and np.array_equal(rows.numpy(), expected(r, length))
    index = "int32" if impl == "sglang" else str(cap.index_dtype)
    cap.destroy()
    return {"impl": impl, "path": path, "scenario": scenario, "device": device, "steps": len(host_us),
            "host_us": round(statistics.median(host_us), 2), "host_us_p90": pct(host_us, 90),
            "page_faults_per_step": round(statistics.mean(fault_counts[len(fault_counts) // 4:]), 2),
            "pinned_bytes": int(pinned), "extract_us": round(statistics.median(extract), 2),
            "index": index, "correct": bool(correct)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--peers", default=None, help="folder holding sglang_0_5_23_capturer.py")
    p.add_argument("--steps", type=int, default=64, help="timed steps per scenario")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps before them")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--impls", default="sglang,ours")
    p.add_argument("--paths", default="sync,overlap")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens of the decode scenarios' requests")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch's CPU threads (default: 1 with --device cpu, where the peer's host-cache writes "
                        "otherwise wait on idle OpenMP threads of a busy machine; torch's default on CUDA)")
    p.add_argument("--pool-tokens", type=int, default=None,
                   help="KV pool slots (default: 2M on CUDA, as SGLang's 3.2 GB example; 512k on the CPU)")
    args = p.parse_args()
    threads = args.torch_threads or (1 if args.device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    if args.pool_tokens is None:
        args.pool_tokens = 2 * 1024 * 1024 if args.device == "cuda" else 512 * 1024
    peer = load_peer(args.peers)
    for scenario in args.scenarios.split(","):
        for path in args.paths.split(","):
            for impl in args.impls.split(","):
                print(json.dumps(run(impl, path, scenario, peer, args)), flush=True)


if __name__ == "__main__":
    main()
