"""Outputs a consumer keeps (host backend): vLLM 0.33's in-process output processor holds every
step's rows until the request finishes. routing_replay.vllm's outputs are slices of a pool faulted
in ahead of need by a thread of its own: kept outputs stay exact however many steps follow, their
memory comes back when they go, the engine's thread makes no extent while the pool keeps ahead, the
budget is the engine's to set, and the pool's figures are readable. The same pool design serves
Replay's extraction copies (the drop-in's get_routed_experts).
"""

from __future__ import annotations

import resource
import time

import numpy as np
import pytest

import routing_replay
from routing_replay.capturer import RoutedExpertsCapturer
from routing_replay.vllm import AuxOutputConnectorMetadata, InputBatch, PackedBlockHashes, make_worker_connector

L, K, E, BS, NMAX = 48, 8, 64, 16, 2048  # a full step: 768 KiB of uint8 ids

POOL_FIELDS = {"size_bytes", "size_high_water_bytes", "in_use_bytes", "high_water_bytes", "budget_bytes", "ahead_bytes",
               "extent_bytes", "slices", "extents_made", "extents_over_budget", "extents_in_step", "extents_freed",
               "filling_failed"}


def ids_of(content: int, first: int, count: int) -> np.ndarray:
    p = np.arange(first, first + count)[:, None, None]
    return (content * 31 + p * 7 + np.arange(L)[None, :, None] * 3 + np.arange(K)[None, None, :]) % E


def hashes(content: int, first: int, last: int) -> PackedBlockHashes:
    return PackedBlockHashes(b"".join(f"{content}:{b}".encode().ljust(32, b".") for b in range(first, last)), 32)


def eventually(done, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if done():
            return True
        time.sleep(0.005)
    return done()


class Engine:
    """Drives a connector as vLLM's model runner does: (request id, content, first, tokens) a step."""

    def __init__(self, **kwargs) -> None:
        self.conn = make_worker_connector(L, E, K, NMAX, 16, block_size=BS, device="cpu", **kwargs)

    def step(self, batch, requests, finished=()):
        # the keys of the blocks each request completes in the step, as vLLM's scheduler sends them
        keys = {rid: hashes(c, s // BS, (s + t) // BS) for rid, c, s, t in batch if (s + t) // BS > s // BS}
        self.conn.begin_step(AuxOutputConnectorMetadata(0, requests, keys, tuple(finished)))
        rows = np.concatenate([ids_of(c, s, t) for _, c, s, t in batch])
        for layer in range(L):
            self.conn.capturer.capture(layer, np.ascontiguousarray(rows[:, layer, :]))
        qsl = np.cumsum([0] + [t for *_, t in batch]).astype(np.int32)
        pending = self.conn.prepare_output(InputBatch([b[0] for b in batch], qsl, np.array([b[2] for b in batch], np.int32)))
        n = len(batch)
        pending.enqueue_cpu_copy(np.ones(n, np.int32), np.zeros(n, np.int32))
        return pending.process_output()


def test_the_pool_reports_its_figures_and_fills_its_budget_ahead():
    e = Engine()
    pool = e.conn.kept_pool
    assert set(pool) == POOL_FIELDS
    step = NMAX * L * K  # uint8 ids
    assert pool["extent_bytes"] >= 2 * step
    assert pool["size_bytes"] >= pool["budget_bytes"] > 0  # faulted in at construction
    assert pool["in_use_bytes"] == 0 and not pool["filling_failed"]
    e.conn.kept_budget_bytes = pool["budget_bytes"] + 4 * pool["extent_bytes"]
    assert e.conn.kept_budget_bytes == pool["budget_bytes"] + 4 * pool["extent_bytes"]
    assert eventually(lambda: e.conn.kept_pool["size_bytes"] >= e.conn.kept_budget_bytes)
    e.conn.close()


def test_kept_outputs_stay_exact_and_their_memory_comes_back_when_they_go():
    e = Engine(kept_budget_bytes=0)  # every kept output past the memory kept ahead: the pool grows
    kept = {}  # request -> its chunks, as vLLM's output processor keeps them
    requests = {f"r{i}": 0 for i in range(8)}
    out = e.step([(rid, i, 0, 16) for i, rid in enumerate(requests)], requests)
    for rid, o in out.items():
        kept.setdefault(rid, []).append(o.rows)
    for position in range(16, 16 + 100):  # 100 decode steps, every output kept
        out = e.step([(rid, i, position, 1) for i, rid in enumerate(requests)], requests)
        for rid, o in out.items():
            kept[rid].append(o.rows)
    for i, rid in enumerate(requests):
        np.testing.assert_array_equal(np.concatenate(kept[rid]), ids_of(i, 0, 116))
    pool = e.conn.kept_pool
    assert pool["in_use_bytes"] > 0 and pool["high_water_bytes"] >= pool["in_use_bytes"]
    assert pool["slices"] >= 101
    e.conn.native.drain()  # filing tasks let their chunks go
    kept.clear()
    del out, o
    assert eventually(lambda: e.conn.kept_pool["in_use_bytes"] == 0)
    e.conn.close()


def test_a_consumer_keeping_past_the_budget_grows_the_pool_off_the_engine_thread():
    e = Engine(kept_budget_bytes=0)
    pool0 = e.conn.kept_pool
    held = []
    for s in range(40):  # a full step of new rows each step, every output kept
        out = e.step([(f"p{s}", s, 0, NMAX)], {f"p{s}": 0}, finished=[f"p{s - 1}"] if s else ())
        held.append(out[f"p{s}"].rows)
        time.sleep(0.002)  # a step's pace: the filling thread keeps ahead
    for s, rows in enumerate(held):
        np.testing.assert_array_equal(rows, ids_of(s, 0, NMAX))
    pool = e.conn.kept_pool
    assert pool["size_bytes"] >= 40 * NMAX * L * K > pool0["size_bytes"]
    assert pool["extents_over_budget"] > 0  # made by the filling thread (how many the engine's thread made
    # itself, extents_in_step, depends on the machine's pace: a benchmark's figure, not a test's)
    e.conn.native.drain()
    held.clear()
    del out
    # past the budget and what is kept ahead, emptied extents go back to the system
    assert eventually(lambda: e.conn.kept_pool["size_bytes"] <= pool0["size_bytes"] + 2 * pool0["extent_bytes"])
    assert e.conn.kept_pool["extents_freed"] > 0
    e.conn.close()


def test_kept_steps_fault_no_page_in_on_the_engine_thread_once_the_pool_is_filled():
    step_bytes = NMAX * L * K
    e = Engine(kept_budget_bytes=64 * step_bytes)  # room for every step below, faulted in at construction
    held, faults = [], []
    for s in range(48):
        rid = f"q{s}"
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        out = e.step([(rid, s, 0, NMAX)], {rid: 0}, finished=[f"q{s - 1}"] if s else ())
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)
        held.append(out[rid].rows)
    assert e.conn.kept_pool["extents_in_step"] == 0
    # the step's rows (192 pages of them) land in pages faulted in ahead; Python's own objects (the
    # outputs, the dict) may take a page now and then
    assert sorted(faults[8:])[len(faults[8:]) // 2] <= 2, faults
    e.conn.close()


def test_replay_copies_come_from_a_pool_and_go_back_when_let_go():
    r = routing_replay.Replay(num_experts=E, top_k=K, max_tokens_per_step=64, max_model_len=128, moe_layers=range(L),
                              device="cpu", copy="sync")
    assert set(r.kept_pool) == POOL_FIELDS
    r.add_request(7)
    plan = routing_replay.StepPlan()
    plan.schedule(7, 0, 10)
    r.begin_step(plan)
    rows = ids_of(7, 0, 10)
    for layer in range(L):
        r.capture(layer, np.ascontiguousarray(rows[:, layer, :]))
    r.end_step()
    r.drain()
    copy = r.extract(7, copy=True)
    assert copy.flags.writeable and copy.flags.owndata is False  # a slice of the pool, owned by its capsule
    np.testing.assert_array_equal(copy, rows)
    assert r.kept_pool["in_use_bytes"] > 0
    r.release(7)  # a copy does not hold the request
    copy[0, 0, 0] = 1
    del copy
    assert r.kept_pool["in_use_bytes"] == 0


def test_the_drop_in_hands_out_copies_from_the_pool():
    cap = RoutedExpertsCapturer(L, K, 64, 128, 0, "cpu", num_experts=E, copy="sync")
    rows = ids_of(3, 0, 12)
    for layer in range(L):
        cap.capture(layer, np.ascontiguousarray(rows[:, layer, :]))
    cap.sync_fwd_experts_buffer_DtoH(np.arange(12), {"a": 12})
    cap.finalize_pending_copy()
    out = cap.get_routed_experts("a")
    np.testing.assert_array_equal(out, rows)
    assert cap.replay.kept_pool["in_use_bytes"] > 0
    del out
    assert cap.replay.kept_pool["in_use_bytes"] == 0


@pytest.mark.parametrize("shape", [(0, L, K), (5, L, K), (3000, 48, 8)])
def test_kept_pool_arrays(shape):
    pool = routing_replay._core.KeptPool(1 << 21, 1 << 21)
    pool.wait_until_filled()
    a = pool.array(shape, "int32")
    assert a.shape == shape and a.dtype == np.int32 and a.flags.writeable
    a[...] = 5
    assert pool.stats["in_use_bytes"] >= a.nbytes
    view = a[1:]
    del a
    assert pool.stats["in_use_bytes"] > 0 or shape[0] == 0  # a view made from it holds the slice
    del view
    assert pool.stats["in_use_bytes"] == 0
    with pytest.raises(TypeError):
        pool.array((1,), "float32")


def test_the_drop_in_runs_a_steady_prefill_on_storage_made_ahead_and_parked():
    """Four new requests of 256 tokens a step, each finished (extracted and released) before the next
    step, as an engine finishes them: the first steps take row memory the worker made ahead, later
    ones adopt the ranges of released requests; no step maps row memory itself."""
    cap = RoutedExpertsCapturer(L, K, 1024, 1024, 0, "cpu", num_experts=E)  # device scatter, the default
    previous = []
    for s in range(12):
        cap.finalize_pending_copy()
        for content, rid in previous:  # the last step's requests finish
            np.testing.assert_array_equal(cap.get_routed_experts(rid), ids_of(content, 0, 256))
        rids = [f"s{s}-{j}" for j in range(4)]
        rows = np.concatenate([ids_of(100 * s + j, 0, 256) for j in range(4)])
        for layer in range(L):
            cap.capture(layer, np.ascontiguousarray(rows[:, layer, :]))
        cap.sync_fwd_experts_buffer_DtoH(np.tile(np.arange(256), 4), {rid: 256 for rid in rids})
        previous = [(100 * s + j, rid) for j, rid in enumerate(rids)]
    growth = cap.replay._native.host_memory_growth
    assert growth["superblocks_in_step"] == 0
    assert growth["superblocks_ahead"] > 0
