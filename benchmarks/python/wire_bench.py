"""The route record (routing_replay.wire, docs/wire.md) against the engines' own fields, one JSON line
per (model shape, routing source):

  bytes_per_id        {form: record bytes / ids} for packed, zstd, zstd_columns, and the order-free
                      set form packed and zstd (header, layer map, chunk index and bitmap included);
                      vllm (base64 .npy, uint8 or uint16) and sglang (base64 int32) for the same rows
  ideal_bytes_per_id  ceil(log2 E) / 8
  encode_gbps, decode_gbps  {form: ids a second / 1e9} (ids counted as bytes of uint8), one thread,
                      median of --reps; vllm and sglang: their field's encode (numpy.save + base64 /
                      tobytes + base64) and decode (base64 + numpy.load / frombuffer)
  slice_decode_us     {form: decoding tokens [0, 512) x all layers (2 of 16 chunks) and tokens
                      [2048, 2304) x layers [0, L/4) (1 chunk)}, against decode_us of the whole record
  chunks_touched      the chunks each slice lies in

Routing sources, T = --tokens rows of the shape's [L, K] of E:
  synthetic   each entry K distinct experts drawn uniformly (no structure: the packed codec's case)
  skewed      expert popularity Zipf(s = 1.1) over a random permutation per layer, and token-to-token
              persistence: each entry repeats the previous token's with probability 0.6
  transformers  a transformers Qwen3-MoE model with the shape's L, K, E and random weights
              (hidden 64, seed 0, one sequence of T random tokens), its router's top-k per layer;
              skipped, with the reason in the line, where torch or transformers is not installed

With --loop N, instead: one line per shape ("bench": "wire_encode_loop"), synthetic rows encoded
packed N times in a row, each record dropped before the next (a server encoding one finished
request after another): encode_gbps over the whole loop, and minor_faults_per_call (getrusage)
against record_bytes, which shows whether each record lands in fresh pages.

Usage: python3 benchmarks/python/wire_bench.py [--tokens 4096] [--reps 5] [--sources ...] [--shapes ...]
       python3 benchmarks/python/wire_bench.py --loop 300 [--tokens 4096] [--shapes ...]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

from routing_replay import wire

SHAPES = {  # name: (L, K, E)
    "qwen3-30b-a3b": (48, 8, 128),
    "qwen3-235b-a22b": (94, 8, 128),
    "deepseek-v3": (58, 8, 256),
    "kimi-k2": (60, 8, 384),
    "e512": (48, 10, 512),
}
ZIPF_S = 1.1
PERSIST = 0.6


def synthetic(T, L, K, E, rng):
    return np.argsort(rng.random((T, L, E), dtype=np.float32), axis=2)[:, :, :K].astype(np.int16)


def skewed(T, L, K, E, rng):
    weights = 1.0 / np.arange(1, E + 1) ** ZIPF_S
    rows = np.empty((T, L, K), np.int16)
    for layer in range(L):
        perm = rng.permutation(E)
        p = weights[perm] / weights.sum()
        # K distinct experts an entry with probabilities p: Gumbel top-k
        keys = np.log(p)[None, :] - np.log(-np.log(rng.random((T, E))))
        rows[:, layer] = np.argsort(-keys, axis=1)[:, :K]
    keep = rng.random((T, L)) < PERSIST
    for t in range(1, T):
        rows[t][keep[t]] = rows[t - 1][keep[t]]
    return rows


def transformers_router(T, L, K, E, rng):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=1024, hidden_size=64, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=L, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                            num_experts=E, num_experts_per_tok=K, decoder_sparse_step=1, mlp_only_layers=[],
                            max_position_embeddings=max(T, 128), norm_topk_prob=True)
    model = Qwen3MoeForCausalLM(config).eval()
    ids = torch.from_numpy(rng.integers(0, 1024, size=(1, T))).long()
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True, use_cache=False)
    logits = out.router_logits  # per layer [T, E]
    return np.stack([torch.topk(l.float(), K, dim=-1).indices.numpy() for l in logits], axis=1).astype(np.int16)


SOURCES = {"synthetic": synthetic, "skewed": skewed, "transformers": transformers_router}


def median_s(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def vllm_encode(rows):
    buf = io.BytesIO()
    np.save(buf, rows)
    return base64.b64encode(buf.getvalue()).decode()


def vllm_decode(field):
    return np.load(io.BytesIO(base64.b64decode(field)))


def measure(shape_name, source, T, reps):
    L, K, E = SHAPES[shape_name]
    rng = np.random.default_rng(abs(hash((shape_name, source))) % 2**32)
    line = {"bench": "wire", "shape": shape_name, "L": L, "K": K, "E": E, "T": T, "source": source}
    try:
        rows = SOURCES[source](T, L, K, E, rng)
    except ImportError as e:
        line["skipped"] = f"needs {e.name or e}: not installed"
        return line
    ids = rows.size
    line["ideal_bytes_per_id"] = math.ceil(math.log2(E)) / 8
    forms = {"packed": dict(codec="packed"), "order_free": dict(ordered=False)}
    if "zstd" in wire.CODECS:
        forms.update({"zstd": dict(codec="zstd"), "zstd_columns": dict(codec="zstd_columns"),
                      "order_free_zstd": dict(codec="zstd", ordered=False)})
    sizes, enc, dec, slices = {}, {}, {}, {}
    out = np.empty(rows.shape, wire.dtype_for(E))
    sl_a = (slice(0, 512), slice(None))
    sl_b = (slice(2048, 2304), slice(0, L // 4))
    for name, kw in forms.items():
        record = wire.encode(rows, E, **kw)
        assert np.array_equal(wire.decode(record), rows if kw.get("ordered", True) else np.sort(rows, axis=2))
        sizes[name] = round(len(record) / ids, 5)
        enc[name] = round(ids / median_s(lambda: wire.encode(rows, E, **kw), reps) / 1e9, 3)
        whole = median_s(lambda: wire.decode(record, out=out), reps)
        dec[name] = round(ids / whole / 1e9, 3)
        if T >= 2304:
            ta = median_s(lambda: wire.decode(record, tokens=sl_a[0], layers=sl_a[1]), reps)
            tb = median_s(lambda: wire.decode(record, tokens=sl_b[0], layers=sl_b[1]), reps)
            slices[name] = {"whole_us": round(whole * 1e6, 1), "tokens_0_512_us": round(ta * 1e6, 1),
                            "tokens_2048_2304_quarter_layers_us": round(tb * 1e6, 1)}
    narrow = rows.astype(np.uint8 if E <= 256 else np.uint16)
    field = vllm_encode(narrow)
    sizes["vllm"] = round(len(field) / ids, 5)
    enc["vllm"] = round(ids / median_s(lambda: vllm_encode(narrow), reps) / 1e9, 3)
    dec["vllm"] = round(ids / median_s(lambda: vllm_decode(field), reps) / 1e9, 3)
    wide = rows.astype(np.int32)
    sg = base64.b64encode(wide.tobytes()).decode()
    sizes["sglang"] = round(len(sg) / ids, 5)
    enc["sglang"] = round(ids / median_s(lambda: base64.b64encode(wide.tobytes()).decode(), reps) / 1e9, 3)
    dec["sglang"] = round(ids / median_s(lambda: np.frombuffer(base64.b64decode(sg), np.int32).reshape(rows.shape),
                                         reps) / 1e9, 3)
    line.update(bytes_per_id=sizes, encode_gbps=enc, decode_gbps=dec, slice_decode_us=slices,
                chunks_touched={"tokens_0_512": 2, "tokens_2048_2304": 1, "of": math.ceil(T / 256)},
                packed_vs_vllm=round(sizes["vllm"] / sizes["packed"], 3),
                packed_vs_sglang=round(sizes["sglang"] / sizes["packed"], 3),
                packed_over_ideal=round(sizes["packed"] / line["ideal_bytes_per_id"], 5))
    return line


def encode_loop(shape_name, T, calls):
    L, K, E = SHAPES[shape_name]
    rows = synthetic(T, L, K, E, np.random.default_rng(0))
    size = len(wire.encode(rows, E))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    for _ in range(calls):
        wire.encode(rows, E)
    seconds = time.perf_counter() - t0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return {"bench": "wire_encode_loop", "shape": shape_name, "L": L, "K": K, "E": E, "T": T, "calls": calls,
            "record_bytes": size, "encode_gbps": round(rows.size * calls / seconds / 1e9, 3),
            "us_per_call": round(seconds / calls * 1e6, 1), "minor_faults_per_call": round(faults / calls, 1),
            "pages_per_record": round(size / resource.getpagesize(), 1)}


def tree() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sources", nargs="+", default=list(SOURCES), choices=list(SOURCES))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--loop", type=int, default=0, help="encode in a loop of this many calls (see above)")
    args = ap.parse_args()
    meta = {"bench": "wire_meta", "tree": tree(), "python": platform.python_version(), "numpy": np.__version__,
            "codecs": list(wire.CODECS), "cpus": os.cpu_count(), "machine": platform.machine(),
            "zipf_s": ZIPF_S, "persistence": PERSIST, "tokens": args.tokens, "reps": args.reps,
            "package": os.path.dirname(os.path.abspath(wire.__file__))}  # the routing_replay measured
    if args.loop:
        meta["loop"] = args.loop
    print(json.dumps(meta), flush=True)
    if args.loop:
        for shape in args.shapes:
            print(json.dumps(encode_loop(shape, args.tokens, args.loop)), flush=True)
        return
    for shape in args.shapes:
        for source in args.sources:
            print(json.dumps(measure(shape, source, args.tokens, args.reps)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
