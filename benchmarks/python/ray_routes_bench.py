#!/usr/bin/env python3
"""Routes from a rollout actor to eight trainer-rank actors through Ray, three ways (docs/training.md,
"Through Ray"). One JSON line per rank and method, then one summary line per method.

A batch of ``--samples`` samples of ``--tokens`` tokens at Qwen3-30B-A3B's shape (48 MoE layers,
top-8 of 128 experts) by default; each record holds ``tokens - 1`` rows (the last sampled token
never went through the model; ``final_token="repeat"`` completes it). The ranks are data-parallel
2 x pipeline 2 x context-parallel 2 (``--dp/--pp/--cp``): a rank's tensor is its data-parallel
half of the samples, packed (aligned to 2 * CP), its context-parallel half of each sequence in
Megatron's order, its pipeline stage's half of the layers: an eighth of the batch.

Methods:
  records      the rollout encodes each sample's routing as a route record (routing_replay.wire,
               packed codec) and publishes them (routing_replay.ray.publish: one object each);
               each rank calls routing_replay.ray.rank_routing on the references, which decodes
               only the chunks of its tokens and layers, mapped from the object store.
  int32_batch  (a) today's pattern: the rollout puts each sample's int32 array (SGLang's and
               NeMo-RL's dtype); every rank takes the whole batch into its own memory (what a rank
               handed the batch holds; on another node, the copy it receives) and cuts its slice.
  uint8_batch  (b) the same with uint8 numpy arrays through ray.put.

Per rank: ``peak_private_bytes``, the peak of the memory the rank allocated for routes
(tracemalloc: numpy traces its buffers; the output tensor included); ``store_touched_bytes``, the
object-store pages the rank's process mapped while at it (RssShmem: shared by the node's ranks,
not the rank's own; every method starts fresh rank processes); ``peak_rss_delta_bytes``, the rise of its peak resident set (VmHWM reset first:
both together); ``rank_s``, from the call to the finished tensor; ``wall_s``, from the start of
publishing to the finished tensor. ``--sequential`` methods run one rank at a time (each rank's
``wall_s`` then counts publishing and that rank alone): int32_batch by default, whose eight ranks
would hold 8 x the int32 batch at once. Each summary line has the slice's uint8 bytes, one
chunk's, the object store's bytes and the ranks' tensors' digests compared across methods
(``correct``).

    python3 benchmarks/python/ray_routes_bench.py > out.jsonl              # 256 samples x 8k tokens
    python3 benchmarks/python/ray_routes_bench.py --samples 16 --tokens 1024  # a quick run
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import ray

METHODS = ("records", "int32_batch", "uint8_batch")


def status() -> dict[str, int]:
    """This process's VmRSS, VmHWM, RssAnon and RssShmem, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def sample_routing(seed: int, i: int, rows: int, layers: int, top_k: int, experts: int) -> np.ndarray:
    """Sample i's routing, uint8 [rows, L, K]: distinct ids per row (the packed codec's size does not
    depend on which ids they are)."""
    rng = np.random.default_rng([seed, i])
    base = rng.integers(0, experts, size=(rows, layers, 1), dtype=np.int64)
    return ((base + np.arange(top_k) * (experts // top_k)) % experts).astype(np.uint8)


class Rollout:
    """Makes the batch and puts it into the object store, in the form a method moves."""

    def __init__(self, args: dict) -> None:
        self.a = args

    def publish(self, method: str) -> dict:
        from routing_replay import ray as rr_ray
        from routing_replay import wire

        a = self.a
        rows = a["tokens"] - 1
        shape = (rows, a["layers"], a["top_k"], a["experts"])
        if method == "records":
            t = time.perf_counter()
            records = [wire.encode(sample_routing(a["seed"], i, *shape), a["experts"], layer_map=range(a["layers"]))
                       for i in range(a["samples"])]
            encode_s = time.perf_counter() - t
            started = time.time()
            refs = rr_ray.publish(records, samples=list(range(a["samples"])))
            published = time.time()
            info = wire.info(records[0])
            chunk_tokens = int(info.get("chunk_tokens") or 0)
            return {"refs": refs, "started": started, "publish_s": published - started, "encode_s": encode_s,
                    "store_bytes": sum(r.nbytes for r in refs), "chunk_tokens": chunk_tokens}
        dtype = np.int32 if method == "int32_batch" else np.uint8
        refs, put_s, nbytes = [], 0.0, 0
        started = time.time()
        for i in range(a["samples"]):
            array = sample_routing(a["seed"], i, *shape).astype(dtype)  # the rollout's output, before publishing
            t = time.perf_counter()
            refs.append(ray.put(array))
            put_s += time.perf_counter() - t
            nbytes += array.nbytes
        # wall time counts the puts only, not making the arrays (records' encode is not counted either)
        return {"refs": refs, "started": time.time() - put_s, "publish_s": put_s, "encode_s": 0.0,
                "store_bytes": nbytes, "chunk_tokens": 0}

    def ping(self) -> bool:
        return True


def cut_whole(arrays, lengths, place, layer_map, align: int, dtype) -> np.ndarray:
    """The baselines' cut: the rank's tensor from whole per-sample arrays, as routing_replay.training
    builds it (packed_batch over the data-parallel share, megatron_token_order, LayerMap.take), one
    sample at a time so that no packed copy of the share adds to the rank's peak (no sequence
    parallelism: every sequence is cut on its own)."""
    from routing_replay import training as rrt

    per = len(arrays) // place.dp_size
    share = range(place.dp_rank * per, (place.dp_rank + 1) * per)
    parts = []
    for i in share:
        one = rrt.packed_batch([arrays[i]], [lengths[i]], final_token="repeat", align=align)
        local = rrt.megatron_token_order(one.routing, packed=True, cu_seqlens_padded=one.cu_seqlens_padded,
                                         cp_size=place.cp_size, cp_rank=place.cp_rank)
        parts.append(layer_map.take(local, list(place.layers)).astype(dtype, copy=False))
    return np.concatenate(parts)


class Rank:
    """A trainer rank: builds its tensor from what the method hands it and measures what it cost."""

    def __init__(self, place_args: dict, num_layers: int) -> None:
        from routing_replay import ray as rr_ray
        from routing_replay import training as rrt

        self.layer_map = rrt.LayerMap(range(num_layers), num_layers)
        self.place = rr_ray.RankPlace.megatron(self.layer_map, **place_args)

    def run(self, method: str, refs, lengths, align: int, started: float) -> dict:
        from routing_replay import ray as rr_ray

        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before = status()
        t = time.perf_counter()
        if method == "records":
            out = rr_ray.rank_routing(refs, self.place, layer_map=self.layer_map, num_tokens=lengths,
                                      final_token="repeat", align=align)
            held = None
        else:
            # handed the whole batch: every sample's array in the rank's own memory
            held = [np.array(x) for x in ray.get(list(refs))]
            out = cut_whole(held, lengths, self.place, self.layer_map, align, held[0].dtype)
        rank_s = time.perf_counter() - t
        finished = time.time()
        after = status()
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        digest = hashlib.blake2b(np.ascontiguousarray(out.astype(np.uint8, copy=False)).data, digest_size=16).hexdigest()
        result = {"shape": list(out.shape), "dtype": str(out.dtype), "tensor_bytes": int(out.nbytes),
                  "peak_private_bytes": int(peak), "store_touched_bytes": after["RssShmem"] - before["RssShmem"],
                  "peak_rss_delta_bytes": after["VmHWM"] - before["VmRSS"], "rank_s": round(rank_s, 4),
                  "wall_s": round(finished - started, 4), "digest": digest}
        del out, held
        gc.collect()
        return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per sample (records hold one row fewer)")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--sequential", default="int32_batch",
                        help="methods whose ranks run one at a time (comma-separated; '' for none)")
    parser.add_argument("--object-store-gb", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    sequential = {m for m in args.sequential.split(",") if m}
    for m in methods:
        if m not in METHODS:
            parser.error(f"unknown method {m!r}; choose from {METHODS}")

    try:
        tree = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        tree = ""
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             object_store_memory=int(args.object_store_gb * 2**30))
    common = {"tree": tree, "cpus": os.cpu_count(), "samples": args.samples, "tokens": args.tokens,
              "layers": args.layers, "top_k": args.top_k, "experts": args.experts,
              "parallel": f"dp{args.dp}xpp{args.pp}xcp{args.cp}", "ray": ray.__version__}
    shape_args = {k: getattr(args, k) for k in ("samples", "tokens", "layers", "top_k", "experts", "seed")}
    rollout = ray.remote(num_cpus=0)(Rollout).remote(shape_args)
    places = [{"dp_size": args.dp, "dp_rank": d, "pp_size": args.pp, "pp_rank": p, "cp_size": args.cp, "cp_rank": c}
              for d in range(args.dp) for p in range(args.pp) for c in range(args.cp)]
    ray.get(rollout.ping.remote())
    lengths = [args.tokens] * args.samples
    align = 2 * args.cp
    slice_bytes = (args.samples // args.dp) * args.tokens // args.cp * (args.layers // args.pp) * args.top_k
    digests: dict[str, list[str]] = {}
    summaries = []
    for method in methods:
        # fresh rank processes for each method: nothing mapped or allocated by an earlier one
        ranks = [ray.remote(num_cpus=0)(Rank).remote(place, args.layers) for place in places]
        ray.get([r.__ray_ready__.remote() for r in ranks])
        batch = ray.get(rollout.publish.remote(method))
        calls = lambda r: r.run.remote(method, batch["refs"], lengths, align, batch["started"])  # noqa: E731
        if method in sequential:
            results = []
            for r in ranks:
                res = ray.get(calls(r))
                res["wall_s"] = round(batch["publish_s"] + res["rank_s"], 4)  # publishing, then this rank alone
                results.append(res)
        else:
            results = ray.get([calls(r) for r in ranks])
        chunk_bytes = batch["chunk_tokens"] * args.layers * args.top_k  # one chunk as uint8
        for place, res in zip(places, results):
            print(json.dumps({"kind": "rank", "method": method, **common, **place, **res,
                              "sequential": method in sequential}), flush=True)
        digests[method] = [r["digest"] for r in results]
        summaries.append({"kind": "summary", "method": method, **common, "sequential": method in sequential,
                          "store_bytes": batch["store_bytes"], "publish_s": round(batch["publish_s"], 4),
                          "encode_s": round(batch["encode_s"], 4), "slice_uint8_bytes": slice_bytes,
                          "chunk_tokens": batch["chunk_tokens"], "chunk_uint8_bytes": chunk_bytes,
                          "max_peak_private_bytes": max(r["peak_private_bytes"] for r in results),
                          "max_store_touched_bytes": max(r["store_touched_bytes"] for r in results),
                          "max_peak_rss_delta_bytes": max(r["peak_rss_delta_bytes"] for r in results),
                          "max_rank_s": max(r["rank_s"] for r in results),
                          "max_wall_s": max(r["wall_s"] for r in results)})
        for r in ranks:
            ray.kill(r)
        del batch, results, ranks
        gc.collect()
    agree = all(d == next(iter(digests.values())) for d in digests.values())
    by = {s["method"]: s for s in summaries}
    for s in summaries:
        s["correct"] = agree
        rec = by.get("records")
        if rec is not None and s["method"] != "records":
            s["peak_private_vs_records"] = round(s["max_peak_private_bytes"] / rec["max_peak_private_bytes"], 2)
            s["wall_vs_records"] = round(s["max_wall_s"] / rec["max_wall_s"], 2)
        if s["method"] == "records":
            s["peak_private_vs_slice_plus_chunk"] = round(
                s["max_peak_private_bytes"] / (slice_bytes + s["chunk_uint8_bytes"]), 3)
        print(json.dumps(s), flush=True)
    ray.shutdown()
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
