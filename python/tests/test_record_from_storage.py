"""Route records written straight from storage: ``Replay.extract(record=...)``, the drop-in
capturer's ``record=``, ``routing_replay.sglang``'s ``get_topk(record=...)`` and the environment
switch its ``create()`` reads. Each record is byte for byte ``routing_replay.wire.encode`` of the
array the same read returns (sentinel rows as missing), with the read's first position and the
storage's layer map, and ``routing_replay.wire.decode`` gives the rows back."""

from __future__ import annotations

import base64
import logging
from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest

import routing_replay as rr
from routing_replay import _record
from routing_replay.capturer import RoutedExpertsCapturer

wire = pytest.importorskip("routing_replay.wire")

E, K = 16, 2
MOE_LAYERS = [1, 3]  # model layers 0 and 2 are dense


def make(device, **kw) -> rr.Replay:
    args = dict(num_experts=E, top_k=K, max_tokens_per_step=8, max_model_len=32, moe_layers=MOE_LAYERS,
                num_model_layers=4, device=device.name)
    args.update(kw)
    return rr.Replay(**args)


def ids_of(rows: int, seed: int) -> np.ndarray:
    """[rows, L, K] ids, distinct within each (row, layer) so the order-free form takes them too."""
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.choice(E, K, replace=False) for _ in MOE_LAYERS]) for _ in range(rows)])


def run(replay, device, rid, first, ids, slots=None):
    plan = rr.StepPlan()
    plan.schedule(rid, first, ids.shape[0], slots=slots)
    with replay.step(plan):
        for i, layer in enumerate(MOE_LAYERS):
            replay.capture(layer, device.array(np.ascontiguousarray(ids[:, i])))


def expected(replay, rid, start=0, end=None, **options) -> bytes:
    rows = replay.extract(rid, start, end, copy=True)
    return wire.encode(rows, E, token_start=start, layer_map=MOE_LAYERS, **options)


@pytest.mark.parametrize("storage", ["per_request", "block_slot"])
def test_replay_record_is_the_encoded_extraction(device, storage):
    kw = dict(storage=storage, block_size=4, num_blocks=8) if storage == "block_slot" else {}
    replay = make(device, **kw)
    block = storage == "block_slot"
    replay.add_request("a", cached_slots=[0, 1] if block else None)  # positions 0, 1: a prefix hit, no rows
    run(replay, device, "a", 2, ids_of(6, 1), slots=[2, 3, 4, 5, 12, 13] if block else None)
    run(replay, device, "a", 8, ids_of(3, 2), slots=[14, 15, 16] if block else None)
    replay.drain()
    for start, end in [(0, None), (2, 8), (0, 2), (4, 4), (7, 11), (10, None)]:
        record = replay.extract("a", start, end, record=True)
        assert isinstance(record, bytes)
        assert record == expected(replay, "a", start, end)
        rows = replay.extract("a", start, end, copy=True)
        np.testing.assert_array_equal(wire.decode(record, dtype=rows.dtype), rows)
        assert replay.extract("a", start, end, record={"ordered": False}) == expected(replay, "a", start, end,
                                                                                     ordered=False)
        chunked = replay.extract("a", start, end, record={"chunk_tokens": 3})
        np.testing.assert_array_equal(wire.decode(chunked, dtype=rows.dtype), rows)
    for codec in set(wire.CODECS) - {"packed"}:  # the zstd codecs, where the build has libzstd
        rows = replay.extract("a", copy=True)
        np.testing.assert_array_equal(wire.decode(replay.extract("a", record=codec), dtype=rows.dtype), rows)
        assert wire.info(replay.extract("a", record=codec))["codec"] == codec
    whole = wire.decode(replay.extract("a", record="packed"))
    assert whole.shape == (11, len(MOE_LAYERS), K)
    info = wire.info(replay.extract("a", 3, record=True))
    assert info["token_start"] == 3 and list(info["layer_map"]) == MOE_LAYERS


def test_replay_record_off_by_default_and_refusals(device):
    replay = make(device)
    replay.add_request("a")
    run(replay, device, "a", 0, ids_of(3, 0))
    assert isinstance(replay.extract("a"), np.ndarray)  # record=False: the array, as before
    with pytest.raises(ValueError, match="include_dense_layers"):
        replay.extract("a", record=True, include_dense_layers=True)
    with pytest.raises(ValueError, match="unknown key"):
        replay.extract("a", record={"level": 3})
    with pytest.raises(ValueError, match="codec"):
        replay.extract("a", record="lz4")
    with pytest.raises(TypeError):
        replay.extract("a", record=3)
    with pytest.raises(rr.Error) as e:
        replay.extract("a", 0, 9, record=True)
    assert e.value.code == "position_out_of_range"


def test_drop_in_record(device):
    capturer = RoutedExpertsCapturer(2, K, 8, 32, 0, device.name, num_experts=E)
    ids = np.arange(3 * K).reshape(3, K) % E
    for layer in range(2):
        capturer.capture(layer, device.array(ids))
    capturer.sync_fwd_experts_buffer_DtoH(np.arange(3, dtype=np.int64), OrderedDict(a=3))
    capturer.finalize_pending_copy()
    array = capturer.get_routed_experts("a", free_slot=False)
    record = capturer.get_routed_experts("a", seqlen=2, free_slot=False, record=True)
    assert record == wire.encode(array[:2], E, layer_map=[0, 1])
    field = capturer.get_routed_experts_base64("a", record=True)
    np.testing.assert_array_equal(wire.decode(base64.b64decode(field)), array.astype(wire.decode(record).dtype))
    assert capturer.get_routed_experts("a", record=True) is None  # released


def test_record_options_and_environment():
    assert _record.record_options(False) is None and _record.record_options(None) is None
    assert _record.record_options(True) == _record.RecordOptions()
    assert _record.record_options("zstd").codec == "zstd"
    assert _record.record_options({"ordered": False, "chunk_tokens": 64}) == _record.RecordOptions(ordered=False,
                                                                                                  chunk_tokens=64)
    for value, want in [("", None), ("0", None), ("off", None), ("1", _record.RecordOptions()),
                        ("zstd_columns", _record.RecordOptions(codec="zstd_columns"))]:
        assert _record.from_environment("X", {"X": value}) == want
    assert _record.from_environment("X", {}) is None
    with pytest.raises(ValueError, match="X='maybe'"):
        _record.from_environment("X", {"X": "maybe"})


# ---- routing_replay.sglang ------------------------------------------------------------------------

LAYERS, PE = 4, 300  # model layers 0..3, 0 dense; 300 experts: uint16 storage


def sglang_capturer(**kw):
    from routing_replay.sglang import RoutedExpertsCapturer as SGLangCapturer

    mc = SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=LAYERS, num_experts_per_tok=K,
                                                        num_experts=PE))
    return SGLangCapturer(mc, num_tokens=64, max_running_requests=8, num_fused_shared_experts=0, device="cpu", **kw)


def sglang_step(cap, slots):
    ids = {layer: (np.arange(len(slots) * K).reshape(len(slots), K) * 7 + np.asarray(slots)[:, None] + layer) % PE
           for layer in (1, 2, 3)}
    for layer, a in ids.items():
        cap.capture(layer, a)
    cap.on_forward_end(SimpleNamespace(out_cache_loc=np.asarray(slots, np.int64), out_cache_loc_virtual=None),
                       False, None)
    return ids


def test_sglang_record_is_the_encoded_rows_of_the_captured_layers():
    cap = sglang_capturer()
    sglang_step(cap, [5, 6, 7, 9])
    pool = SimpleNamespace(req_to_token=np.array([[5, 6, 7, 9, 9, 11]], np.int64))
    rows = np.asarray(cap.get_topk(0, 6, pool, start_len=1))  # slots 6, 7, 9, 9 (start 1, seqlen - 1)
    for record_arg in (True, {"ordered": False}):
        got = cap.get_topk(0, 6, pool, start_len=1, record=record_arg)
        got = got.numpy() if hasattr(got, "numpy") else got
        assert got.dtype == np.uint8 and got.ndim == 1
        options = {} if record_arg is True else {"ordered": False}
        want = wire.encode(np.ascontiguousarray(rows[:, 1:]), PE, token_start=1, layer_map=[1, 2, 3], **options)
        assert got.tobytes() == want
    # SGLang's detokenizer sends base64 of the tensor's bytes (its own expression): the record's
    field = cap.get_topk_base64(0, 6, pool, start_len=1, record=True)
    tensor = cap.get_topk(0, 6, pool, start_len=1, record=True)
    as_numpy = tensor.numpy() if hasattr(tensor, "numpy") else tensor
    assert base64.b64encode(as_numpy.tobytes()).decode("utf-8") == field
    np.testing.assert_array_equal(wire.decode(base64.b64decode(field)).astype(np.int64), rows[:, 1:])
    from routing_replay.sglang import extract_routed_experts_from_meta_info

    with pytest.raises(ValueError, match="route record"):
        extract_routed_experts_from_meta_info({"meta_info": {"routed_experts": field}})
    # a slot no step wrote is a missing row (the int32 read raises there)
    gap = SimpleNamespace(req_to_token=np.array([[5, 40, 6, 0]], np.int64))
    record = cap.get_topk(0, 4, gap, record=True)
    decoded = wire.decode(bytes(np.asarray(record)))
    assert decoded.shape == (3, 3, K)
    assert (decoded[1] == rr.sentinel(decoded.dtype.name)).all()
    with pytest.raises(rr.Error) as e:
        cap.get_topk(0, 4, gap)
    assert e.value.code == "missing_routing"


def test_sglang_create_reads_the_environment_switch(monkeypatch):
    from routing_replay.sglang import RoutedExpertsCapturer as SGLangCapturer
    from routing_replay.sglang import install

    mc = SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=LAYERS, num_experts_per_tok=K,
                                                        num_experts=PE))
    model = SimpleNamespace(num_fused_shared_experts=0)
    build = dict(model=model, model_config=mc, num_tokens=64, max_running_requests=8, device="cpu")
    pool = SimpleNamespace(req_to_token=np.array([[3, 4, 5]], np.int64))

    monkeypatch.delenv(install.RECORD_ENV, raising=False)
    off = SGLangCapturer.create(**build)
    sglang_step(off, [3, 4])
    assert np.asarray(off.get_topk(0, 3, pool)).dtype == np.int32  # off by default: SGLang's rows

    monkeypatch.setenv(install.RECORD_ENV, "1")
    on = SGLangCapturer.create(**build)
    sglang_step(on, [3, 4])
    record = bytes(np.asarray(on.get_topk(0, 3, pool)))
    np.testing.assert_array_equal(wire.decode(record).astype(np.int64),
                                  np.asarray(off.get_topk(0, 3, pool))[:, 1:].astype(np.int64))
    assert str(on.get_topk(0, 3, pool, record=False).dtype).endswith("int32")  # a call may still ask for rows
    # SGLang's row-count check (a record has bytes, not rows) is silenced, nothing else of its logger
    target = logging.getLogger("sglang.srt.managers.scheduler_components.batch_result_processor")
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    target.addHandler(handler)
    try:
        target.warning("routed_experts row-count mismatch for req %s: got %d, expected %d", "r", 120, 2)
        target.warning("something else")
    finally:
        target.removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["something else"]

    monkeypatch.setenv(install.RECORD_ENV, "sometimes")
    with pytest.raises(ValueError, match="ROUTING_REPLAY_SGLANG_RECORD"):
        SGLangCapturer.create(**build)
