"""Probe: the engine-side host path per step of vLLM 0.33's routed-experts worker connector
(begin_step + prepare_output + enqueue_cpu_copy + wait + process_output), ours
(routing_replay.vllm) against the peer (vLLM 0.33's released code, loaded at run time), same
trace, same rows, every output compared between the two where both run.

L = 48, K = 8, E = 128, block 16, max_num_batched_tokens 8192. Captures are made before the timed
part of each step (all layers, every step). Scenarios: decode at B1/B64/B256/B1024 (requests at
position 1024, one token a step, a key every 16 steps), prefill 8k (4 new requests of 2048 tokens a
step), multi-turn (64 conversations, each turn a new request whose prompt is the conversation so
far: a prefix hit on every full block, emit start at the new turn, 64 new tokens then 32 decode
steps). Prints one JSON line per (impl, scenario): median and p10/p90 of the timed part in us.

    PYTHONPATH=build/site python benchmarks/results/cpu-2026-11-26-vllm-streams/host_path_probe.py \
        [--impl ours,peer] [--scenarios decode_B1,...] [--steps 64] [--device cpu|cuda] [--peers DIR]

On a GPU (--device cuda) captures are torch tensors on the GPU and the GPU is drained (a
synchronize) before each timed part, as the side-by-side does.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

L, K, E, BS, N_MAX = 48, 8, 128, 16, 8192


def load_peer(folder: str | None):
    here = Path(__file__).resolve()
    folders = [folder] if folder else []
    folders += [os.environ.get("ROUTING_REPLAY_PEERS", ""), str(here.parents[3] / ".peers"),
                str(here.parents[3].parent / "shared" / "peers")]
    for f in folders:
        path = Path(f) / "vllm_0_33_routed_experts.py"
        if f and path.is_file():
            spec = importlib.util.spec_from_file_location("vllm_0_33_peer", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules["vllm_0_33_peer"] = module
            spec.loader.exec_module(module)
            return module
    raise SystemExit(f"peer vllm_0_33_routed_experts.py not found in {folders}")


class Impl:
    """One connector and the classes of its side."""

    def __init__(self, name: str, peer, device: str, max_num_seqs: int):
        self.name = name
        if name == "peer":
            self.mod = peer
            self.conn = peer.make_worker_connector(L, E, K, N_MAX, max_num_seqs, block_size=BS)
            self.capturer = self.conn._capturer
            self.packed = lambda hashes: peer.pack_hashes(hashes)
        else:
            import routing_replay.vllm as mod

            self.mod = mod
            self.conn = mod.make_worker_connector(L, E, K, N_MAX, max_num_seqs, block_size=BS, device=device)
            self.capturer = self.conn.capturer
            self.packed = lambda hashes: mod.PackedBlockHashes(b"".join(hashes), 32) if hashes else None


def hash_of(conversation: int, block: int) -> bytes:
    return conversation.to_bytes(8, "little") + block.to_bytes(8, "little") + bytes(16)


class Router:
    """Router outputs per layer for n rows, made once per row count (ids a function of the row)."""

    def __init__(self, device: str, torch_tensors: bool):
        self.device = device
        self.torch_tensors = torch_tensors or device == "cuda"
        self.cache = {}

    def layers(self, n: int):
        if n not in self.cache:
            base = (np.arange(n)[:, None] * 7 + np.arange(K)[None, :] * 13) % E
            per_layer = [np.ascontiguousarray((base + layer) % E, dtype=np.int64) for layer in range(L)]
            if self.torch_tensors:
                import torch

                per_layer = [torch.from_numpy(a).to(self.device) for a in per_layer]
            self.cache[n] = per_layer
        return self.cache[n]


def run_step(impl: Impl, router: Router, requests, hashes, finished, batch, sync):
    """One step; returns the timed part in us and the outputs."""
    mod = impl.mod
    meta = mod.AuxOutputConnectorMetadata(0, requests, {r: impl.packed(h) for r, h in hashes.items()}, tuple(finished))
    n = sum(t for _, _, t in batch)
    ids = [r for r, _, _ in batch]
    qsl = np.cumsum([0] + [t for _, _, t in batch]).astype(np.int32)
    starts = np.array([s for _, s, _ in batch], np.int32)
    sampled = np.ones(len(batch), np.int32)
    rejected = np.zeros(len(batch), np.int32)
    input_batch = mod.InputBatch(ids, qsl, starts)
    sync()
    t0 = time.perf_counter()
    impl.conn.begin_step(meta)
    t1 = time.perf_counter()
    for layer, topk in enumerate(router.layers(n)):  # the forward: not timed
        impl.capturer.capture(layer, topk)
    sync()
    t2 = time.perf_counter()
    pending = impl.conn.prepare_output(input_batch)
    pending.enqueue_cpu_copy(sampled, rejected)
    outputs = pending.process_output()
    t3 = time.perf_counter()
    return ((t1 - t0) + (t3 - t2)) * 1e6, outputs


def decode_trace(batch_size: int, steps: int):
    """(requests, hashes, finished, batch) per step: batch_size requests decoding from 1024."""
    for step in range(steps):
        pos = 1024 + step
        requests = {f"d{i}": 1024 for i in range(batch_size)}
        hashes = {}
        if (pos + 1) % BS == 0:
            hashes = {f"d{i}": [hash_of(i, (pos + 1) // BS - 1)] for i in range(batch_size)}
        elif step == 0:
            hashes = {f"d{i}": [hash_of(i, b) for b in range(1024 // BS)] for i in range(batch_size)}
        yield requests, hashes, [], [(f"d{i}", pos, 1) for i in range(batch_size)]


def prefill_trace(steps: int):
    for step in range(steps):
        reqs = [f"p{step}-{i}" for i in range(4)]
        finished = [f"p{step - 1}-{i}" for i in range(4)] if step > 0 else []
        hashes = {r: [hash_of(step * 4 + i + 10_000, b) for b in range(2048 // BS)] for i, r in enumerate(reqs)}
        yield {r: 0 for r in reqs}, hashes, finished, [(r, 0, 2048) for r in reqs]


def multi_turn_trace(conversations: int = 64, turns: int = 20, new_tokens: int = 64, decode_steps: int = 32):
    length = [0] * conversations
    finished = []
    for turn in range(turns):
        reqs = [f"c{c}-t{turn}" for c in range(conversations)]
        hit = [length[c] // BS * BS for c in range(conversations)]
        prompt = [length[c] + new_tokens for c in range(conversations)]
        requests = {r: length[c] for c, r in enumerate(reqs)}  # emit start: the new turn
        # keys of every full block of the prompt computed so far (the hit's included)
        hashes = {r: [hash_of(c, b) for b in range(prompt[c] // BS)] for c, r in enumerate(reqs)}
        yield requests, hashes, finished, [(r, hit[c], prompt[c] - hit[c]) for c, r in enumerate(reqs)]
        finished = []
        for step in range(decode_steps):
            pos = [prompt[c] + step for c in range(conversations)]
            hashes = {r: [hash_of(c, (pos[c] + 1) // BS - 1)] for c, r in enumerate(reqs) if (pos[c] + 1) % BS == 0}
            yield requests, hashes, [], [(r, pos[c], 1) for c, r in enumerate(reqs)]
        for c in range(conversations):
            length[c] = prompt[c] + decode_steps
        finished = reqs


def scenario_trace(name: str, steps: int):
    if name.startswith("decode_B"):
        return decode_trace(int(name[len("decode_B"):]), steps), int(name[len("decode_B"):])
    if name == "prefill_8k":
        return prefill_trace(steps), 8
    if name == "multi_turn":
        return multi_turn_trace(), 64
    raise SystemExit(f"unknown scenario {name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="ours,peer")
    ap.add_argument("--scenarios", default="decode_B1,decode_B64,decode_B256,decode_B1024,prefill_8k,multi_turn")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--peers", default=None)
    args = ap.parse_args()
    peer = load_peer(args.peers) if "peer" in args.impl else None
    if args.device == "cuda":
        import torch

        sync = torch.cuda.synchronize
    else:
        sync = lambda: None  # noqa: E731
    routers = {"ours": Router(args.device, False), "peer": Router(args.device, True)}  # the peer takes torch tensors
    for scenario in args.scenarios.split(","):
        results = {}
        outputs_by_impl = {}
        for name in args.impl.split(","):
            trace, seqs = scenario_trace(scenario, args.steps)
            impl = Impl(name, peer, args.device, max(seqs, 8))
            times, outs = [], []
            for requests, hashes, finished, batch in trace:
                us, out = run_step(impl, routers[name], requests, hashes, finished, batch, sync)
                times.append(us)
                outs.append({k: (v.token_start, v.rows.shape, int(np.asarray(v.rows, np.int64).sum())) for k, v in out.items()})
            warm = times[min(4, len(times) // 4):]
            q = statistics.quantiles(warm, n=10)
            results[name] = {"impl": name, "scenario": scenario, "device": args.device, "steps": len(warm),
                             "median_us": round(statistics.median(warm), 1), "p10_us": round(q[0], 1),
                             "p90_us": round(q[-1], 1)}
            outputs_by_impl[name] = outs
            impl.conn.close()
        if len(outputs_by_impl) == 2:
            a, b = outputs_by_impl.values()
            same = a == b
            for r in results.values():
                r["outputs_match"] = same
        for r in results.values():
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
