"""routing_replay.vllm on the host backend: vLLM 0.33's worker-connector calls, step by step, with
every output checked against the rows captured (ids a function of content, position, layer, k).

Streaming from the emit cursor, rejected drafts, prefix hits read back from the block tier, the
output types (uint8 up to 256 experts, uint16 above), vLLM-shaped objects read by attribute, and
each refusal: an id outside [0, E), a layer that skipped a row, an evicted block, a malformed call.
The thorough comparison with vLLM's own code is in the differential tests.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import pytest

import routing_replay
from routing_replay.vllm import (
    AuxOutputConnectorMetadata,
    AuxRequestOutput,
    BlockObjectStoreError,
    InputBatch,
    PackedBlockHashes,
    make_worker_connector,
)

L, K, BS = 3, 2, 4


def ids_of(content: int, first: int, count: int, experts: int) -> np.ndarray:
    """[count, L, K] int64: the router's ids for positions [first, first + count)."""
    p = np.arange(first, first + count)[:, None, None]
    return (content * 31 + p * 7 + np.arange(L)[None, :, None] * 3 + np.arange(K)[None, None, :]) % experts


def hashes(content: int, first: int, last: int) -> PackedBlockHashes:
    return PackedBlockHashes(b"".join(f"{content}:{b}".encode().ljust(32, b".") for b in range(first, last)), 32)


class Engine:
    """Drives a connector as vLLM's model runner does."""

    def __init__(self, experts: int = 100, **kwargs) -> None:
        self.experts = experts
        self.conn = make_worker_connector(L, experts, K, 64, 8, block_size=BS, device="cpu", **kwargs)

    def step(self, batch, *, requests=None, block_hashes=None, finished=(), skip_layer=None, bad_id=False):
        """batch: (request id, content, first position, tokens, rejected, sampled)."""
        if requests is not None:
            self.conn.begin_step(AuxOutputConnectorMetadata(0, requests, block_hashes or {}, tuple(finished)))
        rows = np.concatenate([ids_of(c, s, t, self.experts) for _, c, s, t, _, _ in batch])
        if bad_id:
            rows[0, 0, 0] = self.experts + 3
        for layer in range(L):
            if layer != skip_layer:
                self.conn.capturer.capture(layer, np.ascontiguousarray(rows[:, layer, :]))
        qsl = np.cumsum([0] + [t for _, _, _, t, _, _ in batch]).astype(np.int32)
        pending = self.conn.prepare_output(
            InputBatch([b[0] for b in batch], qsl, np.array([b[2] for b in batch], np.int32)))
        pending.enqueue_cpu_copy(np.array([b[5] for b in batch]), np.array([b[4] for b in batch]))
        return pending.process_output()


def check(output: AuxRequestOutput, content: int, start: int, count: int, experts: int = 100) -> None:
    assert output.token_start == start
    assert output.rows.shape == (count, L, K)
    assert output.rows.dtype == (np.uint8 if experts <= 256 else np.uint16)
    np.testing.assert_array_equal(output.rows, ids_of(content, start, count, experts))


def test_prefill_then_decode_streams_each_step_from_the_emit_cursor():
    e = Engine()
    out = e.step([("a", 1, 0, 6, 0, 1)], requests={"a": 0}, block_hashes={"a": hashes(1, 0, 1)})
    check(out["a"], 1, 0, 6)
    assert not out["a"].rows.flags.writeable  # a view of the step's host copy
    for position in range(6, 10):
        out = e.step([("a", 1, position, 1, 0, 1)], requests={"a": 0})
        check(out["a"], 1, position, 1)
    assert e.conn.tier_stats()["stored_blocks"] == 1


def test_rejected_drafts_are_dropped():
    e = Engine()
    e.step([("a", 1, 0, 4, 0, 1)], requests={"a": 0})
    out = e.step([("a", 1, 4, 3, 2, 1)], requests={"a": 0})  # one accepted of three
    check(out["a"], 1, 4, 1)
    out = e.step([("a", 1, 5, 1, 0, 1)], requests={"a": 0})
    check(out["a"], 1, 5, 1)


def test_a_prefix_hit_reads_its_rows_back_from_the_tier():
    e = Engine()
    e.step([("a", 7, 0, 8, 0, 1)], requests={"a": 0}, block_hashes={"a": hashes(7, 0, 2)})
    e.conn.begin_step(AuxOutputConnectorMetadata(0, {}, {}, ("a",)))
    out = e.step([("b", 7, 8, 3, 0, 1)], requests={"b": 0}, block_hashes={"b": hashes(7, 0, 2)})
    check(out["b"], 7, 0, 11)
    assert out["b"].rows.flags.writeable  # read back: an array of its own


def test_an_evicted_block_raises_block_object_store_error():
    block_bytes = BS * L * K
    e = Engine(max_bytes=2 * block_bytes)
    e.step([("a", 1, 0, 8, 0, 1)], requests={"a": 0}, block_hashes={"a": hashes(1, 0, 2)})
    e.conn.begin_step(AuxOutputConnectorMetadata(0, {}, {}, ("a",)))
    e.step([("c", 2, 0, 8, 0, 1)], requests={"c": 0}, block_hashes={"c": hashes(2, 0, 2)})
    with pytest.raises(BlockObjectStoreError, match="request b"):
        e.step([("b", 1, 8, 1, 0, 1)], requests={"b": 0}, block_hashes={"b": hashes(1, 0, 2)})
    assert isinstance(BlockObjectStoreError("x"), RuntimeError)


def test_output_dtypes_follow_the_expert_count():
    for experts in (256, 300):
        e = Engine(experts=experts)
        out = e.step([("a", 1, 0, 5, 0, 1)], requests={"a": 0})
        check(out["a"], 1, 0, 5, experts)


def test_invalid_ids_and_unwritten_rows_are_refused_naming_the_request():
    e = Engine()
    with pytest.raises(routing_replay.Error, match="request a, position 0") as info:
        e.step([("a", 1, 0, 2, 0, 1)], requests={"a": 0}, bad_id=True)
    assert info.value.code == "invalid_expert_id"
    e = Engine()
    e.step([("a", 1, 0, 2, 0, 1)], requests={"a": 0})
    with pytest.raises(routing_replay.Error, match="layer 1") as info:
        e.step([("a", 1, 2, 1, 0, 1)], requests={"a": 0}, skip_layer=1)
    assert info.value.code == "missing_routing"


def test_a_first_step_that_starts_mid_block_is_kept_out_of_the_tier():
    e = Engine()
    out = e.step([("r", 5, 6, 1, 0, 1)], requests={"r": 6}, block_hashes={"r": hashes(5, 0, 1)})
    check(out["r"], 5, 6, 1)
    out = e.step([("r", 5, 7, 5, 0, 1)], requests={"r": 6}, block_hashes={"r": hashes(5, 1, 3)})
    check(out["r"], 5, 7, 5)
    assert e.conn.tier_stats()["stored_blocks"] == 1  # [8, 12); [4, 8) began elsewhere


def test_refusals_of_malformed_calls():
    e = Engine()
    e.step([("a", 1, 0, 3, 0, 1)], requests={"a": 0})
    with pytest.raises(ValueError, match="cannot run and finish"):
        e.conn.begin_step(AuxOutputConnectorMetadata(0, {"a": 0}, {}, ("a",)))
    with pytest.raises(ValueError, match="capture moved backwards"):
        e.step([("a", 1, 1, 1, 0, 1)], requests={"a": 0})
    with pytest.raises(ValueError, match="not known"):
        e.conn.begin_step(AuxOutputConnectorMetadata(0, {}, {}, ("nobody",)))
    with pytest.raises(IndexError):
        e.conn.capturer.capture(L, np.zeros((1, K), np.int64))


def test_vllm_shaped_objects_are_read_by_attribute():
    e = Engine()
    meta = SimpleNamespace(generation=0, requests={"a": 0}, block_hashes={"a": [b"h" * 32]}, finished_requests=["x"][:0])
    e.conn.begin_step(meta)
    rows = ids_of(3, 0, 4, 100)
    for layer in range(L):
        e.conn.capturer.capture(layer, np.ascontiguousarray(rows[:, layer, :]))
    batch = SimpleNamespace(req_ids=["a"], query_start_loc_np=np.array([0, 4, 9, 9]), num_computed_tokens_np=np.array([0]))
    pending = e.conn.prepare_output(batch)
    pending.enqueue_cpu_copy([1], [0])
    check(e.conn.process_output(pending)["a"], 3, 0, 4)
    assert e.conn.tier_stats()["stored_blocks"] == 1


def test_aux_request_output_is_a_plain_value():
    o = AuxRequestOutput(3, np.zeros((1, 2, 2), np.uint8))
    assert o.token_start == 3 and o.rows.shape == (1, 2, 2)
    again = pickle.loads(pickle.dumps(o))
    assert again.token_start == 3 and (again.rows == o.rows).all()
    assert "token_start=3" in repr(o)


def test_outputs_outlive_the_connector():
    e = Engine()
    out = e.step([("a", 1, 0, 5, 0, 1)], requests={"a": 0})
    e.conn.close()
    del e
    check(out["a"], 1, 0, 5)


def test_torch_cpu_tensors_are_captured():
    torch = pytest.importorskip("torch")
    e = Engine()
    e.conn.begin_step(AuxOutputConnectorMetadata(0, {"a": 0}, {}, ()))
    rows = ids_of(2, 0, 3, 100)
    for layer in range(L):
        e.conn.capturer.capture(layer, torch.from_numpy(np.ascontiguousarray(rows[:, layer, :])).to(torch.int32))
    pending = e.conn.prepare_output(InputBatch(["a"], np.array([0, 3]), np.array([0])))
    pending.enqueue_cpu_copy(np.array([1]), np.array([0]))
    check(pending.process_output()["a"], 2, 0, 3)
    assert e.conn.capturer.output_dtype == torch.uint8


def test_cuda_connector_hands_out_what_the_host_backend_does():
    """The same trace on the CUDA backend (router outputs as torch tensors on the GPU) and on the
    host backend: every output equal, errors alike."""
    torch = pytest.importorskip("torch")
    if not routing_replay.cuda_available() or not torch.cuda.is_available():
        pytest.skip("no CUDA device (or no CUDA backend module)")
    results = {}
    for device in ("cpu", "cuda"):
        conn = make_worker_connector(L, 100, K, 64, 8, block_size=BS, device=device)
        outs = []
        # b's second block fills in the second step, whose metadata brings its hash, as vLLM's scheduler
        # sends it (without the hash, vLLM and the library both refuse to read those rows back)
        trace = [({"a": 0, "b": 0}, {"a": hashes(1, 0, 2), "b": hashes(2, 0, 1)}, [("a", 1, 0, 9, 0, 1), ("b", 2, 0, 5, 0, 0)]),
                 ({"a": 0, "b": 0}, {"b": hashes(2, 1, 2)}, [("a", 1, 9, 3, 1, 1), ("b", 2, 5, 3, 0, 1)]),
                 ({"c": 0}, {"c": hashes(1, 0, 2)}, [("c", 1, 8, 2, 0, 1)])]
        for requests, block_hashes, batch in trace:
            conn.begin_step(AuxOutputConnectorMetadata(0, requests, block_hashes, ()))
            rows = np.concatenate([ids_of(c, s, t, 100) for _, c, s, t, _, _ in batch])
            for layer in range(L):
                ids = np.ascontiguousarray(rows[:, layer, :])
                conn.capturer.capture(layer, torch.from_numpy(ids).cuda() if device == "cuda" else ids)
            qsl = np.cumsum([0] + [t for _, _, _, t, _, _ in batch]).astype(np.int32)
            pending = conn.prepare_output(InputBatch([b[0] for b in batch], qsl, np.array([b[2] for b in batch], np.int32)))
            pending.enqueue_cpu_copy(np.array([b[5] for b in batch]), np.array([b[4] for b in batch]))
            outs.append({k: (v.token_start, v.rows.copy()) for k, v in pending.process_output().items()})
        results[device] = outs
    for host, cuda in zip(results["cpu"], results["cuda"]):
        assert host.keys() == cuda.keys()
        for k in host:
            assert host[k][0] == cuda[k][0]
            np.testing.assert_array_equal(host[k][1], cuda[k][1])
