"""The machine's floors under the Python engine loop's figures (docs/performance.md):
what the cheapest possible version of each host-side operation costs here, so that a missed target
can be told from a slow implementation. One JSON line per measurement (medians):

  launch_us            one native call that launches one kernel (capture_pointer of one row: no
                       tensor inspection, no stream lookup) - the floor of capture()
  capture_us           capture() of a torch tensor on the replay's device, for comparison
  torch_op_us          one small torch op (a [1, 8] int64 add_) - what an eager forward pays per op
  dict_items_ns        per entry, iterating a 1024-entry {str: int} dict in Python (the engine
                       builds one per step; the drop-in reads it natively)
  first_touch_us_per_mb  writing fresh anonymous memory once (page faults), median of 5 rounds;
                       first_touch_first_us_per_mb the first round (memory the process never had:
                       on a VM the host may have to back the pages too) - the floor of a step that
                       stores rows in memory never used
  resident_us_per_mb   writing the same memory again (no faults): memory bandwidth
  shmem_populate_fresh_us_per_mb     mmap(MAP_SHARED | MAP_POPULATE) of a memfd's fresh pages
  shmem_populate_resident_us_per_mb  the same pages mapped again, populated (they are resident):
                       what per-request storage pays to map rows kept ahead into a request's range
  shmem_map_lazy_us    the same mapping without MAP_POPULATE (one call, any size)
  register_us_per_mb   cudaHostRegister (mapped, portable) of resident pages: what device scatter
                       pays per byte of new row memory
Usage: python3 benchmarks/python/floors.py   (a CUDA machine with torch)
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import torch

import routing_replay as rr


def median_us(fn, reps: int, inner: int = 1) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / inner)
    return round(statistics.median(times), 3)


def shared_memory_floors(mb: int = 32) -> dict:
    """Per-request storage's mapping costs, measured on a memfd as the library uses one."""
    import mmap
    import os

    size = mb << 20
    populate = getattr(mmap, "MAP_POPULATE", 0x8000)
    fd = os.memfd_create("floors")
    os.ftruncate(fd, size)
    t0 = time.perf_counter()
    first = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
    t1 = time.perf_counter()
    again = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
    t2 = time.perf_counter()
    lazy = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    t3 = time.perf_counter()
    address = np.frombuffer(first, dtype=np.uint8).ctypes.data
    cudart = torch.cuda.cudart()
    t4 = time.perf_counter()
    status = cudart.cudaHostRegister(address, size, 3)  # cudaHostRegisterPortable | cudaHostRegisterMapped
    t5 = time.perf_counter()
    cudart.cudaHostUnregister(address)
    result = {"shmem_populate_fresh_us_per_mb": round((t1 - t0) * 1e6 / mb, 1),
              "shmem_populate_resident_us_per_mb": round((t2 - t1) * 1e6 / mb, 1),
              "shmem_map_lazy_us": round((t3 - t2) * 1e6, 1),
              "register_us_per_mb": round((t5 - t4) * 1e6 / mb, 1), "register_status": int(status)}
    del address
    for m in (lazy, again):
        m.close()
    os.close(fd)
    return result


def main() -> None:
    torch.cuda.init()
    replay = rr.Replay(num_experts=128, top_k=8, max_tokens_per_step=8192, max_model_len=4096, moe_layers=range(48),
                       device="cuda", copy="device_scatter")
    ids = torch.randint(0, 128, (64, 8), device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    out = {"part": "floors", "gpu": torch.cuda.get_device_name()}
    for _ in range(200):  # warm-up: module load, first launches
        replay.capture_pointer(0, ids.data_ptr(), "int64", 1, 8, stream)
        replay.capture(0, ids)
    replay.reset_device_buffer()
    out["launch_us"] = median_us(lambda: replay.capture_pointer(0, ids.data_ptr(), "int64", 1, 8, stream), 50, 48)
    torch.cuda.synchronize()
    out["capture_us"] = median_us(lambda: replay.capture(0, ids), 50, 48)
    torch.cuda.synchronize()
    replay.reset_device_buffer()
    x = torch.zeros(1, 8, dtype=torch.int64, device="cuda")
    out["torch_op_us"] = median_us(lambda: x.add_(1), 50, 48)
    torch.cuda.synchronize()
    d = {f"r{i}": 1 for i in range(1024)}
    cache = {k: i for i, k in enumerate(d)}

    def walk():
        for k, v in d.items():
            cache[k]

    out["dict_items_ns"] = round(median_us(walk, 50) * 1e3 / 1024, 1)
    mb = 64
    fresh = []
    again = []
    for _ in range(5):
        a = np.empty(mb << 20, dtype=np.uint8)
        t0 = time.perf_counter()
        a.fill(1)
        t1 = time.perf_counter()
        a.fill(2)
        t2 = time.perf_counter()
        fresh.append((t1 - t0) * 1e6 / mb)
        again.append((t2 - t1) * 1e6 / mb)
        del a
    out.update(shared_memory_floors())
    out["first_touch_us_per_mb"] = round(statistics.median(fresh), 1)
    out["first_touch_first_us_per_mb"] = round(fresh[0], 1)  # memory this process never had
    out["resident_us_per_mb"] = round(statistics.median(again), 1)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
