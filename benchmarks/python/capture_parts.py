"""What one eager capture() costs, part by part, on a CUDA machine with torch (docs/performance.md):
each part of Replay's hot path timed alone, then the whole call, in two conditions:
warm (the part called back to back) and cold (48 calls, a layer's worth each, after 64 MB of host
memory is swept, standing for the forward's own host work between captures). One JSON line per
part, medians in us per call:

  launch            the native capture call with every argument precomputed (one kernel)
  stream            reading the current raw stream (torch._C._cuda_getCurrentRawStream)
  is_compiling      torch.compiler.is_compiling()
  geometry          the five reads of the tensor the hot path makes (dtype, shape, device, strides,
                    pointer)
  hot               the hot path itself (Replay._hot: checks, geometry, stream, the native call)
  capture           Replay.capture(layer, ids): the public call around it
  dropin            RoutedExpertsCapturer.capture(layer, ids) (the staged hot path)
  capture_pointer   Replay.capture_pointer(...) with the geometry given (no tensor read)

Usage: PYTHONPATH=<package> python3 benchmarks/python/capture_parts.py
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import torch

import routing_replay as rr
from routing_replay import _arrays
from routing_replay.capturer import RoutedExpertsCapturer

L, K, E, ROWS = 48, 8, 128, 64


def timed(fn, calls: int, rounds: int, sweep: np.ndarray | None) -> float:
    """Median over rounds of the mean time of `calls` back-to-back calls (after a sweep if given)."""
    times = []
    for _ in range(rounds):
        if sweep is not None:
            sweep += 1  # the engine's host work between layers: caches cold for what follows
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i % L)
        times.append((time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize()
    return round(statistics.median(times), 3)


def main() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    replay = rr.Replay(num_experts=E, top_k=K, max_tokens_per_step=ROWS, max_model_len=4096, moe_layers=range(L),
                       device="cuda", index="int16", layout="layer_major", copy="device_scatter")
    ids = torch.randint(0, E, (ROWS, K), dtype=torch.int64, device=device)
    native, ptr, code = replay._native, ids.data_ptr(), _arrays.DTYPE_CODES["int64"]
    index = ids.get_device()
    raw = torch._C._cuda_getCurrentRawStream
    stream = raw(index)
    is_compiling = torch.compiler.is_compiling

    def geometry(layer, t=ids):
        return t.dtype, t.shape, t.get_device(), t.stride(), t.data_ptr()

    dropin = RoutedExpertsCapturer(L, K, ROWS, 4096, 0, "cuda", num_experts=E, copy="device_scatter")
    parts = {
        "launch": lambda layer: native.capture(layer, ptr, code, ROWS, K, stream),
        "stream": lambda layer: raw(index),
        "is_compiling": lambda layer: is_compiling(),
        "geometry": geometry,
        # an earlier tree's package (A/B runs) has no flat hot path
        **({"hot": lambda layer: replay._hot(layer, ids)} if hasattr(replay, "_hot") else {}),
        "capture": lambda layer: replay.capture(layer, ids),
        "dropin": lambda layer: dropin.capture(layer, ids),
        "capture_pointer": lambda layer: replay.capture_pointer(layer, ptr, "int64", ROWS, K),
    }
    sweep = np.zeros(64 << 20, dtype=np.uint8)
    for name, fn in parts.items():
        for _ in range(3):  # warm up (and let the replay's first captures allocate what they need)
            timed(fn, L, 1, None)
        warm = timed(fn, 2000, 7, None)
        cold = timed(fn, L, 41, sweep)
        print(json.dumps(dict(bench="capture_parts", part=name, warm_us=warm, cold_us=cold,
                              gpu=torch.cuda.get_device_name(), torch=torch.__version__)), flush=True)


if __name__ == "__main__":
    main()
