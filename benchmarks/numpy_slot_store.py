#!/usr/bin/env python3
"""The host cost per step of vLLM main's scheduler-side slot store, for the side-by-side figure of
DESIGN.md section 5: one numpy fancy-index assignment per step,
``host_buffer[slot_mapping, :, :] = routing`` into a [num_slots, L, K] array in shared memory
(the .cpu() copy and the file lock around it are not counted).

Same shape and schedule as benchmarks/engine_loop's decode_B<B>: B requests, 16-token KV blocks,
one region of blocks per request, decode positions 1024 .. 1024 + steps - 1. Prints one JSON line:
{"impl": "numpy_slot_store", "scenario": ..., "dtype": ..., "host_us": median, "min_us": ...}.

usage: numpy_slot_store.py [--batch 1024] [--steps 64] [--layers 48] [--topk 8] [--dtype int16]
"""
import argparse
import json
import time
from multiprocessing import shared_memory

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--dtype", default="int16", choices=["int16", "int32", "uint8"])
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5, help="passes over the decode steps")
    a = p.parse_args()

    block = 16
    rows_per_request = a.prompt + a.steps
    blocks_per_request = -(-rows_per_request // block)
    num_slots = a.batch * blocks_per_request * block
    dtype = np.dtype(a.dtype)
    shape = (num_slots, a.layers, a.topk)
    shm = shared_memory.SharedMemory(create=True, size=int(np.prod(shape)) * dtype.itemsize)
    try:
        host_buffer = np.ndarray(shape, dtype=dtype, buffer=shm.buf)
        host_buffer.fill(-1 if dtype.kind == "i" else 255)  # pages resident: the steady state
        rng = np.random.default_rng(0)
        routing = rng.integers(0, 128, size=(a.batch, a.layers, a.topk)).astype(dtype)
        requests = np.arange(a.batch, dtype=np.int64)
        times = []
        for _ in range(a.repeats):
            for d in range(a.steps):
                position = a.prompt + d
                slot_mapping = (requests * blocks_per_request + position // block) * block + position % block
                t0 = time.perf_counter()
                host_buffer[slot_mapping, :, :] = routing
                times.append((time.perf_counter() - t0) * 1e6)
        assert (host_buffer[slot_mapping] == routing).all()
        print(json.dumps({"impl": "numpy_slot_store", "scenario": f"decode_B{a.batch}", "dtype": a.dtype,
                          "layers": a.layers, "topk": a.topk, "numpy": np.__version__,
                          "host_us": round(float(np.median(times)), 2), "min_us": round(min(times), 2)}))
        del host_buffer
    finally:
        shm.close()
        shm.unlink()


if __name__ == "__main__":
    main()
