"""The Python engine loop: what routing_replay costs an engine's thread per step, from Python.

A synthetic engine (48 MoE layers, top-8 of 128 experts by default; ids a pure function of request,
position, layer and k, so every extracted request is checked exactly) drives the library through
its two Python faces, in the scenarios of the C++ engine loop (benchmarks/engine_loop_main.cpp):

  decode_B1/B64/B256/B1024   B requests decoding one token per step (prefilled first, untimed)
  prefill_8k                 4 new requests of N_max/4 tokens each step
  mixed                      256 decodes plus a 2048-token prefill chunk of a new request per step

  api=replay   routing_replay.Replay: the plan built from arrays of request handles
               (StepPlan.schedule_handles), begin_step before the forward, end_step after it
  api=dropin   routing_replay.capturer.RoutedExpertsCapturer (vLLM PR 39917's interface): capture()
               in the forward, sync_fwd_experts_buffer_DtoH(positions, {id: tokens}) after it
  api=none     the same forward with no capture and no library call: the step the others add to
  api=launch_floor  Replay's steps, but each capture() replaced by the cheapest call that launches a
               kernel: one native call with every argument precomputed, writing the step's rows
               from a zero array (CUDA only; its rows are not the forward's, so `correct` is
               null). What a step pays for 48 launches from Python in this loop, cold caches
               included: the floor under capture_us and under the step time capture adds

Each step the device is drained before each timed host call, as ../shared/peers/engine_loop_vs_peer.py
does, so the figures are host time alone (host backend: its compute stream synchronized, then 1 ms
for its copy stream's worker). Prints one JSON line per (api, mode, scenario):

  plan_us, begin_us, end_us   Replay: plan building, begin_step, end_step (medians of steps)
  host_us                     Replay: plan_us + begin_us + end_us; drop-in: the post-forward call
  per_request_ns              host_us per scheduled request
  capture_us                  capture() host time per call (median over the step's 48 layers)
  step_us                     whole step wall time: plan, forward, library (the side-by-side
                              with the peer, ../shared/peers/engine_loop_vs_peer.py, gives the
                              time capture adds to a step; here, step_us less api=none's)
  extract_us                  extraction per finished request (drop-in: finalize + get_routed_experts)
  minflt_per_step             minor page faults of the engine's thread in the library's calls of a
                              step (plan, begin_step, end_step; the drop-in's post-forward call),
                              median over the timed steps (_mean: their mean)
  host_memory_growth          per-request storage: superblocks of row memory taken ready from its
                              worker, and mapped on the engine's thread in a step (whole run)
  correct                     every request's [T, L, K] equals the ids its forward produced

Usage:
  python3 benchmarks/python/engine_loop.py [--device cpu|cuda] [--api replay,dropin]
      [--modes eager,graph] [--scenarios decode_B1,...] [--copy ...] [--storage ...] [--prompt P]
On the host backend (--device cpu) the forward is numpy and there are no graphs; prompts default
to 32 tokens there (1024 on CUDA) so that the decode scenarios reach their batch quickly.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # its idle threads spin on the cores the library's streams use

import numpy as np

import routing_replay as rr
from routing_replay.capturer import RoutedExpertsCapturer

L, K, E = 48, 8, 128
NMAX, MML = 8192, 4096
ARGS = argparse.Namespace()


def thread_minflt() -> int:
    """Minor page faults of this (the engine's) thread so far."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def med(xs):
    return round(statistics.median(xs), 2) if xs else None


def expected(req, length):
    pos = np.arange(length)[:, None, None]
    return (req * 7919 + pos * 31 + np.arange(L)[None, :, None] * 131 + np.arange(K)[None, None, :] * 17) % E


def scenarios(prompt):
    """(name, steps, warm-up steps): a step is [(request, first position, tokens)]."""
    per_step = NMAX // prompt
    for b in (1, 64, 256, 1024):
        steps = [[(r, 0, prompt) for r in range(g, min(b, g + per_step))] for g in range(0, b, per_step)]
        warm = len(steps)
        steps += [[(r, prompt + s, 1) for r in range(b)] for s in range(ARGS.decode_steps)]
        yield f"decode_B{b}", steps, warm
    chunk = NMAX // 4
    yield "prefill_8k", [[(4 * s + j, 0, chunk) for j in range(4)] for s in range(ARGS.prefill_steps)], 1
    base = 10_000
    steps = [[(r, 0, prompt) for r in range(g, min(256, g + per_step))] for g in range(0, 256, per_step)]
    warm = len(steps)
    steps += [[(r, prompt + s, 1) for r in range(256)] + [(base + s, 0, 2048)] for s in range(ARGS.prefill_steps)]
    yield "mixed", steps, warm


class Forward:
    """The router outputs of one step: per layer an int64 [n, K] array on the replay's device."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        if cuda:
            import torch

            self.torch = torch
            self.req = torch.zeros(NMAX, dtype=torch.int64, device="cuda")
            self.pos = torch.zeros(NMAX, dtype=torch.int64, device="cuda")
            self.kk = torch.arange(K, dtype=torch.int64, device="cuda") * 17
        self.positions = np.zeros(NMAX, dtype=np.int64)
        self.n = 0

    def set_batch(self, sched):
        pos = np.concatenate([np.arange(p, p + t) for (_, p, t) in sched])
        req = np.concatenate([np.full(t, r) for (r, _, t) in sched])
        self.n = len(pos)
        self.positions[: self.n] = pos
        if self.cuda:
            self.pos[: self.n].copy_(self.torch.from_numpy(pos))
            self.req[: self.n].copy_(self.torch.from_numpy(req))
        else:
            self.base = req * 7919 + pos * 31
        return self.n

    def run(self, n, capture):
        """The forward: each layer's ids, handed to `capture(layer, ids)`; host: capture times."""
        times = []
        if self.cuda:
            base = self.req[:n] * 7919 + self.pos[:n] * 31
            for layer in range(L):
                ids = (base[:, None] + layer * 131 + self.kk[None, :]) % E
                if capture is not None:
                    t0 = time.perf_counter()
                    capture(layer, ids)
                    times.append(time.perf_counter() - t0)
        else:
            kk = np.arange(K, dtype=np.int64) * 17
            for layer in range(L):
                ids = (self.base[:n, None] + layer * 131 + kk[None, :]) % E
                if capture is not None:
                    t0 = time.perf_counter()
                    capture(layer, ids)
                    times.append(time.perf_counter() - t0)
        return times


def ahead_kw() -> dict:
    """host_memory_ahead where asked for (an earlier tree's package has no such argument)."""
    return {} if ARGS.host_memory_ahead is None else {"host_memory_ahead": ARGS.host_memory_ahead}


class ReplayDriver:
    """routing_replay.Replay with a columnar plan of request handles."""

    api = "replay"

    def __init__(self, device):
        self.replay = rr.Replay(num_experts=E, top_k=K, max_tokens_per_step=NMAX, max_model_len=MML,
                                moe_layers=range(L), device=device, index=ARGS.index, layout=ARGS.layout,
                                copy=ARGS.copy, storage=ARGS.storage, block_size=16 if ARGS.storage == "block_slot" else 0,
                                num_blocks=(ARGS.blocks if ARGS.storage == "block_slot" else 0), **ahead_kw())
        if hasattr(self.replay, "wait_for_host_memory_ahead"):  # as an engine at start-up (earlier trees: none)
            self.replay.wait_for_host_memory_ahead()
        self.plan = rr.StepPlan()
        self.handles = {}
        self.columnar = hasattr(self.plan, "schedule_handles")
        self.blocks = {}
        self.next_block = 0
        self.capture = self.replay.capture

    def slots(self, r, p, t):
        need = (p + t + 15) // 16
        blocks = self.blocks.setdefault(r, [])
        fresh = []
        while len(blocks) < need:
            blocks.append(self.next_block)
            fresh.append(self.next_block)
            self.next_block += 1
        pos = np.arange(p, p + t)
        return np.asarray(blocks, dtype=np.int64)[pos // 16] * 16 + pos % 16, fresh

    def before(self, sched, sync):
        """Plan + begin_step; returns (plan_us, begin_us)."""
        for (r, p, _) in sched:
            if r not in self.handles:
                h = self.replay.add_request(r, prompt_length=p if p else -1)
                self.handles[r] = h
        sync()
        t0 = time.perf_counter()
        plan = self.plan
        plan.clear()
        if ARGS.storage == "block_slot":
            for (r, p, t) in sched:
                s, fresh = self.slots(r, p, t)
                if fresh:
                    plan.add_fresh_blocks(fresh)
                plan.schedule(r, p, t, 0, s)
        elif self.columnar:
            hs = np.fromiter((self.handles[r] for (r, _, _) in sched), dtype=np.uint64, count=len(sched))
            firsts = np.fromiter((p for (_, p, _) in sched), dtype=np.int64, count=len(sched))
            counts = np.fromiter((t for (_, _, t) in sched), dtype=np.int32, count=len(sched))
            t0 = time.perf_counter()  # the engine keeps these arrays; only the call is the library's
            plan.schedule_handles(hs, firsts, counts)
        else:
            for (r, p, t) in sched:
                plan.schedule(r, p, t)
        t1 = time.perf_counter()
        self.replay.begin_step(plan)
        t2 = time.perf_counter()
        return (t1 - t0) * 1e6, (t2 - t1) * 1e6

    def after(self, sched):
        t0 = time.perf_counter()
        self.replay.end_step()
        return (time.perf_counter() - t0) * 1e6

    def extract(self, r, length):
        self.replay.drain()
        x0 = time.perf_counter()
        arr = self.replay.extract(r, 0, length, copy=True)
        x = (time.perf_counter() - x0) * 1e6
        self.replay.release(r)
        del self.handles[r]
        return arr, x


class DropInDriver:
    """The drop-in capturer, as vLLM's model runner calls it (string request ids)."""

    api = "dropin"

    def __init__(self, device):
        self.cap = RoutedExpertsCapturer(L, K, NMAX, MML, 0, device, num_experts=E, copy=ARGS.copy,
                                         index=ARGS.index, layout=ARGS.layout, **ahead_kw())
        self.capture = self.cap.capture
        self.replay = self.cap.replay
        self.names = {}  # --ids kept: request -> its id object

    def before(self, sched, sync):
        return 0.0, 0.0

    def after(self, sched, positions=None):
        if ARGS.ids == "kept":  # the same id objects every step, as vLLM's input batch keeps them
            names = self.names
            num = {names.setdefault(r, f"r{r}"): t for (r, _, t) in sched}
        else:  # new id objects every step
            num = {f"r{r}": t for (r, _, t) in sched}
        t0 = time.perf_counter()
        self.cap.sync_fwd_experts_buffer_DtoH(positions, num)
        return (time.perf_counter() - t0) * 1e6

    def extract(self, r, length):
        x0 = time.perf_counter()
        self.cap.finalize_pending_copy()
        arr = self.cap.get_routed_experts(self.names.pop(r, f"r{r}"), seqlen=length)
        return arr, (time.perf_counter() - x0) * 1e6


class NoCaptureDriver:
    """The forward alone: no library call at all (the baseline of the step time others add)."""

    api = "none"
    capture = None
    replay = None

    def __init__(self, device):
        pass

    def before(self, sched, sync):
        return 0.0, 0.0

    def after(self, sched, positions=None):
        return 0.0

    def extract(self, r, length):
        return None, 0.0


class LaunchFloorDriver(ReplayDriver):
    """Replay's steps with capture() replaced by the floor of a launch from Python: one native call,
    arguments precomputed, one kernel writing the step's rows (zeros: every row must be written, or
    end_step rejects the step as it would a forward that skipped a layer)."""

    api = "launch_floor"

    def __init__(self, device):
        super().__init__(device)
        import torch

        from routing_replay import _arrays

        self.zeros = torch.zeros((NMAX, K), dtype=torch.int64, device=device)
        self.rows = [0]  # the step's token count, set before the forward
        native, ptr, code = self.replay._native, self.zeros.data_ptr(), _arrays.DTYPE_CODES["int64"]
        current, index, rows = torch._C._cuda_getCurrentRawStream, self.zeros.get_device(), self.rows

        def floor(layer, ids):  # on the current stream, as capture() (graphs record on their own)
            native.capture(layer, ptr, code, rows[0], K, current(index))

        self.capture = floor

    def before(self, sched, sync):
        self.rows[0] = sum(t for (_, _, t) in sched)
        return super().before(sched, sync)


DRIVERS = {"replay": ReplayDriver, "dropin": DropInDriver, "none": NoCaptureDriver, "launch_floor": LaunchFloorDriver}


def run(api, mode, name, steps, warm, cuda):
    device = "cuda" if cuda else "cpu"
    fwd = Forward(cuda)
    graph = mode == "graph"
    if cuda:
        import torch

        sync = torch.cuda.synchronize
    if api == "launch_floor" and not cuda:
        raise SystemExit("api=launch_floor needs CUDA")
    drv = DRIVERS[api](device)
    replay_steps = isinstance(drv, ReplayDriver)  # plan, begin_step, end_step (replay, launch_floor)
    if not cuda:
        stream = drv.replay.default_stream if drv.replay is not None else None

        def sync():
            # the host backend's "device" is worker threads: the compute stream, and the replay's copy
            # stream, which Python cannot reach; a millisecond lets its copy or scatter finish, so the
            # timed call runs alone on the cores, as it does on a GPU machine
            if stream is not None:
                stream.synchronize()
            time.sleep(0.001)
    graphs = {}

    def forward(n, capture):
        if not graph:
            return fwd.run(n, capture)
        if n not in graphs:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fwd.run(n, capture)  # warm-up outside the graph, as engines do
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fwd.run(n, capture)
            graphs[n] = g
            torch.cuda.synchronize()
            if replay_steps:
                drv.replay.reset_device_buffer()
            elif api == "dropin":
                drv.cap.reset_device_buffer()
            torch.cuda.synchronize()
        graphs[n].replay()
        return []

    plan_t, begin_t, end_t, host_t, cap_t, step_t, done, reqs, faults = [], [], [], [], [], [], {}, [], []
    finished = []  # (request, its length, its rows, extraction us)
    last_step = {r: si for si, sched in enumerate(steps) for (r, _, _) in sched}
    for si, sched in enumerate(steps):
        n = fwd.set_batch(sched)
        if graph and si >= warm and n not in graphs:
            forward(n, drv.capture)  # recorded outside the timed steps
        f0 = thread_minflt()
        pu, bu = drv.before(sched, sync)
        f1 = thread_minflt()
        sync()
        t0 = time.perf_counter()
        times = forward(n, drv.capture) if (graph and si >= warm) else fwd.run(n, drv.capture)
        sync()
        f2 = thread_minflt()
        if replay_steps:
            eu = drv.after(sched)
        else:
            eu = drv.after(sched, fwd.positions[:n])
        f3 = thread_minflt()
        t1 = time.perf_counter()
        if si >= warm:
            plan_t.append(pu)
            begin_t.append(bu)
            end_t.append(eu)
            host_t.append(pu + bu + eu)
            cap_t.extend(times)
            step_t.append((t1 - t0) * 1e6)
            reqs.append(len(sched))
            faults.append(f1 - f0 + f3 - f2)
        for (r, p, t) in sched:
            done[r] = p + t
        if ARGS.finish == "next" and api in ("replay", "dropin") and si + 1 < len(steps):
            # requests no later step schedules finish now, between steps, as an engine finishes
            # them: extracted (and released), so that new requests reuse their storage
            for r in [r for r in done if last_step[r] == si]:
                sync()
                length = done.pop(r)
                finished.append((r, length, *drv.extract(r, length)))
    sync()
    ok, xs = (True if api in ("replay", "dropin") else None), []
    finished += [(r, length, *drv.extract(r, length)) for r, length in (done.items() if ok else ())]
    for r, length, arr, x in finished:
        xs.append(x)
        ok = ok and arr is not None and arr.shape == (length, L, K) and np.array_equal(arr.astype(np.int64),
                                                                                        expected(r, length))
    host = med(host_t) if api != "none" else None
    out = dict(bench="python_engine_loop", api=api, device=device, mode=mode, scenario=name,
               index=ARGS.index, layout=ARGS.layout, copy=ARGS.copy,
               storage=ARGS.storage if replay_steps else ("per_request" if api == "dropin" else None),
               plan=(("handles" if drv.columnar else "per_request") if replay_steps
                     else ("dict" if api == "dropin" else None)),
               ids=ARGS.ids if api == "dropin" else None, finish=ARGS.finish,
               host_memory_ahead=ARGS.host_memory_ahead, requests=med(reqs), host_us=host, per_request_ns=round(1e3 * host / med(reqs), 1) if host else None,
               capture_us=med([t * 1e6 for t in cap_t]) if cap_t else None, step_us=med(step_t),
               extract_us=med(xs), correct=ok, steps=len(host_t),
               minflt_per_step=med(faults), minflt_per_step_mean=round(statistics.fmean(faults), 1) if faults else None)
    if replay_steps:
        out.update(plan_us=med(plan_t), begin_us=med(begin_t), end_us=med(end_t))
    native = getattr(drv.replay, "_native", None)
    if native is not None and hasattr(native, "host_memory_growth"):  # an earlier tree has no such figure
        out["host_memory_growth"] = dict(native.host_memory_growth)
    return out


def main():
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cpu (host backend) or cuda (default: cuda if available)")
    ap.add_argument("--api", default="replay,dropin")
    ap.add_argument("--modes", default=None, help="eager,graph (graph: CUDA only)")
    ap.add_argument("--scenarios", default="decode_B1,decode_B64,decode_B256,decode_B1024,prefill_8k,mixed")
    ap.add_argument("--copy", default="device_scatter")
    ap.add_argument("--storage", default="per_request", help="Replay's storage (the drop-in's is per_request)")
    ap.add_argument("--index", default="int16")
    ap.add_argument("--layout", default="layer_major")
    ap.add_argument("--prompt", type=int, default=None)
    ap.add_argument("--decode-steps", type=int, default=40)
    ap.add_argument("--prefill-steps", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=1 << 16)
    ap.add_argument("--ids", default="new", choices=("new", "kept"),
                    help="the drop-in's request ids: new str objects every step (the dict built afresh) or the "
                         "same objects every step (as vLLM's input batch keeps them)")
    ap.add_argument("--finish", default="end", choices=("end", "next"),
                    help="end: every request extracted after the last step (storage only grows); next: a request "
                         "no later step schedules is extracted and released before the next step (an engine's "
                         "finish: prefill_8k's four requests of each step finish before the next one)")
    ap.add_argument("--host-memory-ahead", type=int, default=None,
                    help="per-request storage: bytes mapped ahead by a worker thread (default: two steps' rows)")
    ARGS = ap.parse_args()
    cuda = (ARGS.device or ("cuda" if rr.cuda_available() else "cpu")) != "cpu"
    modes = (ARGS.modes or ("eager,graph" if cuda else "eager")).split(",")
    prompt = ARGS.prompt or (1024 if cuda else 32)
    wanted = ARGS.scenarios.split(",")
    for api in ARGS.api.split(","):
        for mode in modes:
            for name, steps, warm in scenarios(prompt):
                if name not in wanted or (mode == "graph" and not name.startswith("decode")):
                    continue
                print(json.dumps(run(api, mode, name, steps, warm, cuda)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
