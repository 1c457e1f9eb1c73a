"""The drop-in capturer (vLLM PR 39917's interface) against a plain reference capturer with the
same interface, on one engine loop: chunked prefill, decode, padded batches, requests finishing at
different times, router outputs of every integer dtype with fused shared-expert columns."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

import routing_replay as rr
from routing_replay.capturer import RoutedExpertsCapturer

L, K, E, S = 4, 2, 24, 1
N_MAX, MAX_LEN = 16, 64
DTYPES = ("int64", "int32", "int16", "uint8", "int8", "uint16", "uint32", "uint64")


class PlainCapturer:
    """The reference: a device buffer [L, N, K] written by capture, rows copied to a dict of
    position -> row per request after the forward, as the capturer of vLLM PR 39917 does."""

    def __init__(self, num_layers, top_k, num_batched_tokens, max_model_len, num_fused_shared_experts, device):
        self.buffer = np.zeros((num_layers, num_batched_tokens, top_k), dtype=np.int16)
        self.top_k = top_k
        self.rows: dict[object, dict[int, np.ndarray]] = {}

    def capture(self, layer_id, topk_ids):
        ids = np.asarray(topk_ids if isinstance(topk_ids, np.ndarray) else topk_ids.cpu().numpy())
        self.buffer[layer_id, : ids.shape[0]] = ids[:, : self.top_k]

    def sync_fwd_experts_buffer_DtoH(self, positions, num_scheduled_tokens):
        positions = np.asarray(positions)
        row = 0
        for rid, n in num_scheduled_tokens.items():
            mine = self.rows.setdefault(rid, {})
            for t in range(n):
                mine[int(positions[row + t])] = self.buffer[:, row + t].copy()
            row += n

    def finalize_pending_copy(self):
        pass

    def get_routed_experts(self, req_id, seqlen=None, free_slot=True):
        mine = self.rows.get(req_id)
        if not mine:
            return None
        filled = max(mine) + 1
        end = filled if seqlen is None else min(filled, seqlen)
        out = np.stack([mine[p] for p in range(end)])
        if free_slot:
            del self.rows[req_id]
        return out


def make_array(device, a: np.ndarray):
    if device.backend == "host":
        return a
    return device.torch.from_numpy(a).to("cuda")


def positions_of(device, positions):
    array = np.asarray(positions, dtype=np.int64)
    if device.backend == "cuda":
        return device.torch.from_numpy(array)  # a CPU int64 tensor, as vLLM hands it over
    return array


@pytest.mark.parametrize("copy", ["sync", "async_event", "double_buffered", "device_scatter"])
def test_drop_in_matches_plain_reference(device, copy):
    rng = np.random.default_rng(7)
    capturer = RoutedExpertsCapturer(L, K, N_MAX, MAX_LEN, S, device.name, num_experts=E, copy=copy)
    plain = PlainCapturer(L, K, N_MAX, MAX_LEN, S, device.name)
    requests = {}  # id -> [next position, prompt, target]
    next_id = 0
    finished = 0
    for step in range(40):
        if len(requests) < 4 and rng.random() < 0.5:
            prompt = int(rng.integers(1, 10))
            requests[f"r{next_id}"] = [0, prompt, prompt + int(rng.integers(1, 8))]
            next_id += 1
        scheduled = OrderedDict()
        positions = []
        for rid, (pos, prompt, target) in requests.items():
            n = min(prompt - pos, int(rng.integers(1, 5))) if pos < prompt else 1
            if sum(scheduled.values()) + n > N_MAX - 2:
                break
            scheduled[rid] = n
            positions.extend(range(pos, pos + n))
        total = sum(scheduled.values())
        padded = total + (2 if step % 3 == 0 else 0)  # a CUDA-graph-like padded batch
        for layer in range(L):
            ids = rng.integers(0, E, size=(padded, K + S)).astype(DTYPES[(step + layer) % len(DTYPES)])
            capturer.capture(layer, make_array(device, ids))
            plain.capture(layer, ids)
        capturer.sync_fwd_experts_buffer_DtoH(positions_of(device, positions + [0] * (padded - total)), scheduled)
        plain.sync_fwd_experts_buffer_DtoH(positions, scheduled)
        for rid, n in scheduled.items():
            requests[rid][0] += n
        for rid in [r for r, (pos, _, target) in requests.items() if pos >= target]:
            del requests[rid]
            seqlen = None if finished % 2 else int(rng.integers(1, 6))
            if finished % 3 == 0:
                capturer.finalize_pending_copy()
            got = capturer.get_routed_experts(rid, seqlen)
            want = plain.get_routed_experts(rid, seqlen)
            np.testing.assert_array_equal(got, want, err_msg=rid)
            assert got.dtype == np.int16 and got.flags.writeable
            assert capturer.get_routed_experts(rid) is None  # freed
            finished += 1
    assert finished >= 5
    assert capturer.get_routed_experts("never-seen") is None


@pytest.mark.parametrize("rows", [3, 2500])
def test_router_outputs_reused_after_capture(device, rows):
    """The engine may overwrite a router output as soon as capture() returns (host backend: the
    capture either reads it in the call, on an idle stream, or copies it; 2500 rows of K int64 ids
    are past the size read in the call). Each layer's array is overwritten with invalid ids at
    once, and every step follows the previous one's post-forward call without a pause, so some
    captures find the stream still busy with the end of the step before."""
    capturer = RoutedExpertsCapturer(L, K, 4096, MAX_LEN, S, device.name, num_experts=E)
    steps = 6
    want = np.empty((steps, L, rows, K), dtype=np.int64)
    for step in range(steps):
        for layer in range(L):
            ids = (np.arange(rows * (K + S), dtype=np.int64).reshape(rows, K + S) * 7 + step * 5 + layer) % E
            want[step, layer] = ids[:, :K]
            capturer.capture(layer, make_array(device, ids))
            ids[:] = E + 3  # out of range: a late read would refuse the step
        scheduled = OrderedDict((f"r{i}", 1) for i in range(rows))
        capturer.sync_fwd_experts_buffer_DtoH(positions_of(device, [step] * rows), scheduled)
    capturer.finalize_pending_copy()
    for i in (0, rows // 2, rows - 1):
        np.testing.assert_array_equal(capturer.get_routed_experts(f"r{i}"), want[:, :, i])


def test_free_slot_false_keeps_the_request(device):
    capturer = RoutedExpertsCapturer(L, K, N_MAX, MAX_LEN, 0, device.name, num_experts=E)
    ids = np.arange(3 * K).reshape(3, K) % E
    for layer in range(L):
        capturer.capture(layer, make_array(device, ids))
    capturer.sync_fwd_experts_buffer_DtoH(positions_of(device, [0, 1, 2]), {"a": 3})
    first = capturer.get_routed_experts("a", free_slot=False)
    assert first.shape == (3, L, K)
    first[:] = 0  # an independent copy
    np.testing.assert_array_equal(capturer.get_routed_experts("a", seqlen=2), np.stack([ids[:2]] * L, axis=1))
    assert capturer.get_routed_experts("a") is None
    field = None
    for layer in range(L):
        capturer.capture(layer, make_array(device, ids[:1]))
    capturer.sync_fwd_experts_buffer_DtoH(positions_of(device, [0]), {"b": 1})
    field = capturer.get_routed_experts_base64("b")
    np.testing.assert_array_equal(rr.from_base64_npy(field), ids[None, :1].repeat(L, 0).transpose(1, 0, 2))


def test_errors_surface(device):
    capturer = RoutedExpertsCapturer(L, K, N_MAX, MAX_LEN, 0, device.name, num_experts=E, copy="sync")
    bad = np.zeros((2, K), dtype=np.int64)
    bad[1, 1] = E + 1
    for layer in range(L):
        capturer.capture(layer, make_array(device, bad if layer == 2 else bad * 0))
    with pytest.raises(rr.Error) as e:
        capturer.sync_fwd_experts_buffer_DtoH(positions_of(device, [0, 1]), {"a": 2})
    assert e.value.code == "invalid_expert_id" and str(E + 1) in str(e.value)
    # a layer the forward did not capture is missing routing, never stale rows from a step before
    for layer in range(L - 1):
        capturer.capture(layer, make_array(device, bad * 0))
    with pytest.raises(rr.Error) as e:  # deferred strategies: reported when the step is filed
        capturer.sync_fwd_experts_buffer_DtoH(positions_of(device, [0, 1]), {"a": 2})
        capturer.finalize_pending_copy()
    assert e.value.code == "missing_routing"
    with pytest.raises(rr.Error) as e:
        capturer.sync_fwd_experts_buffer_DtoH(positions_of(device, [0, 2]), {"a": 2})
    assert e.value.code == "invalid_plan"
    # the legacy spelling of the argument; an empty step
    capturer.sync_fwd_experts_buffer_DtoH(positions_of(device, []), num_scheduled_tokes={})


def test_warm_up_rows_are_forgotten(device):
    capturer = RoutedExpertsCapturer(L, K, N_MAX, MAX_LEN, 0, device.name, num_experts=E)
    warm = np.ones((8, K), dtype=np.int64)
    for layer in range(L):  # a dummy run no step files
        capturer.capture(layer, make_array(device, warm))
    capturer.reset_device_buffer()
    for layer in range(L - 1):  # the real forward misses a layer: it must not read the dummy rows
        capturer.capture(layer, make_array(device, warm[:2]))
    with pytest.raises(rr.Error) as e:  # deferred strategies: reported when the step is filed
        capturer.sync_fwd_experts_buffer_DtoH(positions_of(device, [0, 1]), {"a": 2})
        capturer.finalize_pending_copy()
    assert e.value.code == "missing_routing"


def test_request_ids_are_cached_and_forgotten(device):
    """The drop-in files a step in one pass over vLLM's dict: ids it has seen map to handles, a
    released id is forgotten (the same id later is a new request), int and str ids stay apart."""
    capturer = RoutedExpertsCapturer(L, K, N_MAX, MAX_LEN, 0, device.name, num_experts=E)
    rows = {"r1": np.full((1, K), 3), 1: np.full((1, K), 5)}

    def step(schedule, position):
        ids = np.concatenate([rows[rid] for rid in schedule]).astype(np.int64)
        for layer in range(L):
            capturer.capture(layer, make_array(device, ids))
        capturer.sync_fwd_experts_buffer_DtoH(positions_of(device, [position] * len(schedule)),
                                              {rid: 1 for rid in schedule})

    step(["r1", 1], 0)
    step([1, "r1"], 1)
    capturer.finalize_pending_copy()
    assert capturer.replay.num_requests == 2
    np.testing.assert_array_equal(capturer.get_routed_experts("r1"), np.full((2, L, K), 3))
    assert capturer.replay.num_requests == 1 and "r1" not in capturer.replay
    step(["r1"], 0)  # the same id again: a new request, its rows start over
    capturer.finalize_pending_copy()
    got = capturer.get_routed_experts("r1")
    assert got.shape == (1, L, K) and (got == 3).all()
    np.testing.assert_array_equal(capturer.get_routed_experts(1), np.full((2, L, K), 5))
    with pytest.raises(TypeError):
        capturer.sync_fwd_experts_buffer_DtoH(positions_of(device, [0]), {True: 1})
    # a step whose requests have no tokens is no step, and what its forward staged is forgotten
    capturer.sync_fwd_experts_buffer_DtoH(positions_of(device, []), {"r2": 0})
    assert "r2" not in capturer.replay


def test_request_id_objects_come_and_go(device):
    """Ids are looked up by value: vLLM passes the same id strings every step, an engine may as well
    build new but equal ids each step, release a request through another object than the one it
    was scheduled with, or reuse an id object for a new request."""
    n = 600
    capturer = RoutedExpertsCapturer(L, K, 1024, MAX_LEN, 0, device.name, num_experts=E)
    kept = [f"q{i}" for i in range(n)]  # the same objects every step

    def step(ids, position, value):
        rows = np.full((len(ids), K), value, dtype=np.int64)
        for layer in range(L):
            capturer.capture(layer, make_array(device, rows))
        capturer.sync_fwd_experts_buffer_DtoH(positions_of(device, [position] * len(ids)), dict.fromkeys(ids, 1))

    for position in range(3):
        step(kept, position, 1)
        step([f"f{i}" for i in range(n)], position, 2)  # new objects every step
    capturer.finalize_pending_copy()
    assert capturer.replay.num_requests == 2 * n
    for i in (0, n // 2, n - 1):
        np.testing.assert_array_equal(capturer.get_routed_experts("".join(["q", str(i)])), np.full((3, L, K), 1))
        np.testing.assert_array_equal(capturer.get_routed_experts(kept[i].replace("q", "f")), np.full((3, L, K), 2))
    # released through equal objects: the objects still held by the engine now name new requests
    step([kept[0], kept[n // 2]], 0, 3)
    step([kept[0]], 1, 4)
    capturer.finalize_pending_copy()
    np.testing.assert_array_equal(capturer.get_routed_experts(kept[0])[:, 0, 0], [3, 4])
    np.testing.assert_array_equal(capturer.get_routed_experts(kept[n // 2])[:, 0, 0], [3])
    assert capturer.replay.num_requests == 2 * n - 6
