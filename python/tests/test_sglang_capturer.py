"""routing_replay.sglang.RoutedExpertsCapturer against SGLang 0.5.23's own capturer (the peer):
the same randomized engine traces through both, every get_topk result and every routed_experts
field equal byte for byte, and ours raising a clear exception wherever the peer fails.

The peer is SGLang's released code: the installed SGLang's own capturer where it imports, the
stubbed copy otherwise (tests/_peers.py, ROUTING_REPLAY_SGLANG_PEER); these tests skip where neither
or torch is there. Host backend always; CUDA where the conftest allows.
"""

from __future__ import annotations

import collections
from types import SimpleNamespace

import numpy as np
import pytest

from _peers import load_sglang_peer
from _sglang_engine import SimEngine
from conftest import BACKENDS

import routing_replay as rr

torch = pytest.importorskip("torch")
from routing_replay.sglang import RoutedExpertsCapturer, extract_routed_experts_from_meta_info  # noqa: E402


def peer():
    return load_sglang_peer()


def model_config(layers, top_k, experts):
    return SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=layers, num_experts_per_tok=top_k,
                                                          num_experts=experts))


def torch_device(backend):
    return "cpu" if backend == "host" else "cuda"


def pair(backend, *, layers, top_k, experts, num_tokens, shared=0, max_running_requests=16, **ours):
    """(ours, the peer's) for the same engine."""
    dev = torch_device(backend)
    mc = model_config(layers, top_k, experts)
    mine = RoutedExpertsCapturer(mc, num_tokens=num_tokens, max_running_requests=max_running_requests,
                                 num_fused_shared_experts=shared, device=dev, **ours)
    theirs = peer().RoutedExpertsCapturer(mc, num_tokens=num_tokens, max_running_requests=max_running_requests,
                                          num_fused_shared_experts=shared, device=dev)
    return mine, theirs


def forward_batch(slots, captured_rows, virtual, dev):
    loc = torch.from_numpy(slots).to(dev)
    if not virtual:
        return SimpleNamespace(out_cache_loc=loc, out_cache_loc_virtual=None)
    padded = np.zeros(captured_rows, np.int64)
    padded[: len(slots)] = slots
    return SimpleNamespace(out_cache_loc=torch.from_numpy(padded).to(dev), out_cache_loc_virtual=loc)


def finish_overlap(out, dev):
    out.map_device_tensors(lambda t: t.to("cpu", non_blocking=True))
    if dev == "cuda":
        torch.cuda.synchronize()
    out.finalize()


def b64_of(tensor):
    """SGLang's detokenizer: base64 of the raw bytes of get_topk's array."""
    return peer().pybase64.b64encode(tensor.numpy().tobytes()).decode("utf-8")


def run_trace(backend, seed, path, *, steps=70, stats=None, ours=None, **engine_args):
    """Drives both capturers through one engine trace; returns how many requests were compared (and
    adds the engine's feature counts to `stats`). `ours`: extra keywords of our capturer."""
    rng = np.random.default_rng(seed)
    engine = SimEngine(rng, **engine_args)
    dev = torch_device(backend)
    mine, theirs = pair(backend, layers=engine.num_layers, top_k=engine.top_k, experts=engine.num_experts,
                        num_tokens=engine.num_tokens, shared=engine.shared, page_size=engine.page_size,
                        **(ours or {}))
    caps = (mine, theirs)
    overlap = path == "overlap"
    pending = []
    compared = 0

    def process(step, outs):
        nonlocal compared
        if overlap:
            for out in outs:
                finish_overlap(out, dev)
        pool = SimpleNamespace(req_to_token=torch.from_numpy(engine.req_to_token).to(dev))
        for req, f in step.finished:
            got, want = (cap.get_topk(f.req_pool_idx, f.seqlen, pool, f.start_len) for cap in caps)
            assert got.dtype == torch.int32 and got.device.type == "cpu"
            assert got.shape == want.shape, (f, got.shape, want.shape)
            assert torch.equal(got, want), f"request {f.uid}: rows differ from SGLang's"
            field = mine.get_topk_base64(f.req_pool_idx, f.seqlen, pool, f.start_len)
            assert field == b64_of(want)
            decoded = extract_routed_experts_from_meta_info({"meta_info": {"routed_experts": field}})
            assert np.array_equal(decoded, want.numpy().reshape(-1))
            compared += 1
            engine.release(req)

    for step in engine.steps(steps):
        if step is None:
            if pending:
                process(*pending.pop())
            continue
        topk = {layer: torch.from_numpy(ids).to(dev) for layer, ids in step.topk.items()}
        fb = forward_batch(step.slots, step.captured_rows, step.virtual, dev)
        graph = step.graph_batch is not None
        outs = []
        for cap in caps:
            for layer, ids in topk.items():
                cap.capture(layer, ids)
            outs.append(cap.on_forward_end(fb, graph, step.graph_batch, no_copy_to_cpu=overlap))
        if not overlap:
            assert outs == [None, None]
            process(step, outs)
        else:
            if pending:
                process(*pending.pop())
            pending.append((step, outs))
    if pending:
        process(*pending.pop())
    if stats is not None:
        stats.update(engine.stats)
    return compared


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", ["sync", "overlap"])
@pytest.mark.parametrize("seed", range(4))
def test_random_traces_match_sglang(backend, path, seed):
    assert run_trace(backend, seed, path) > 5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", ["sync", "overlap"])
@pytest.mark.parametrize("fused", [0, 8])
def test_traces_match_sglang_with_steps_scattered(backend, path, fused):
    # the traces' steps (at most a chunk of 24 rows) are all stored by the end-of-step kernel by
    # default: here every step is scattered (0), or those above 8 rows are
    assert run_trace(backend, 5, path, ours={"fused_scatter_max_rows": fused}) > 5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", ["sync", "overlap"])
@pytest.mark.parametrize("seed", [11, 12])
def test_pages_shared_experts_and_wide_ids_match_sglang(backend, path, seed):
    # pages of 4 tokens (page-aligned prefix hits), fused shared-expert columns handed with and
    # without them, and E = 300 (uint16 storage)
    compared = run_trace(backend, seed, path, page_size=4, num_pages=40, shared=2, num_experts=300, top_k=3,
                         dense=(0,), num_layers=5)
    assert compared > 5


def test_the_traces_cover_the_engine_features():
    stats = collections.Counter()
    for seed in range(4):
        run_trace("host", seed, "sync", stats=stats)
        run_trace("host", seed + 11, "overlap", stats=stats, page_size=4, num_pages=40, shared=2)
    for feature in ("prefix_hit", "retract", "graph", "padded_rows", "virtual", "reused_slot", "evicted",
                    "shared_columns", "routed_columns", "start_len", "start_len_0", "start_len_clamped"):
        assert stats[feature] > 0, (feature, stats)


@pytest.mark.parametrize("backend", BACKENDS)
def test_storage_is_the_narrowest_index_type(backend):
    for experts, index, share in ((128, "uint8", 4), (300, "uint16", 2), (70000, "int32", 1)):
        mine, theirs = pair(backend, layers=4, top_k=8, experts=experts, num_tokens=4096)
        assert mine.index_dtype == np.dtype(index)
        pool = 4096 * 4 * 8
        assert mine.pinned_bytes - pool * mine.index_dtype.itemsize < 1024  # the pool, plus the steps' statuses
        assert theirs.host_cache.get_buffer_size_bytes() == pool * 4
        assert mine.pinned_bytes * share <= theirs.host_cache.get_buffer_size_bytes() * 1.01


# ---- where SGLang fails, ours raises --------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_capture_width_mismatch_raises_as_sglang(backend):
    dev = torch_device(backend)
    for cap in pair(backend, layers=3, top_k=4, experts=16, num_tokens=64, shared=2):
        with pytest.raises(ValueError, match="Captured top-k width 5 is neither the device width 6 nor its routed "
                                             "part 4"):
            cap.capture(1, torch.zeros((2, 5), dtype=torch.int32, device=dev))


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_start_len_raises_as_sglang(backend):
    pool = SimpleNamespace(req_to_token=torch.zeros((2, 8), dtype=torch.int32, device=torch_device(backend)))
    for cap in pair(backend, layers=3, top_k=2, experts=16, num_tokens=64):
        with pytest.raises(ValueError, match="start_len=-1 must be non-negative"):
            cap.get_topk(0, 5, pool, start_len=-1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_capture_past_the_device_buffer_raises(backend):
    dev = torch_device(backend)
    for cap in pair(backend, layers=3, top_k=2, experts=16, num_tokens=64, max_batch_size=None):
        too_many = torch.zeros((8193, 2), dtype=torch.int32, device=dev)
        with pytest.raises(RuntimeError):  # torch's shape error; ours routing_replay.Error(too_many_tokens)
            cap.capture(1, too_many)


def one_step(cap, slots, dev, *, layers=(1, 2), no_copy=False, ids=None):
    n = len(slots)
    for layer in layers:
        rows = ids if ids is not None else torch.arange(n * 2, dtype=torch.int32).reshape(n, 2) % 16
        cap.capture(layer, rows.to(dev))
    fb = SimpleNamespace(out_cache_loc=torch.tensor(slots, dtype=torch.int64, device=dev), out_cache_loc_virtual=None)
    return cap.on_forward_end(fb, False, None, no_copy_to_cpu=no_copy)


@pytest.mark.parametrize("backend", BACKENDS)
def test_slot_out_of_range_in_req_to_token_raises(backend):
    dev = torch_device(backend)
    mine, theirs = pair(backend, layers=3, top_k=2, experts=16, num_tokens=64)
    pool = SimpleNamespace(req_to_token=torch.tensor([[3, 4, 99, 0]], dtype=torch.int32, device=dev))
    for cap in (mine, theirs):
        one_step(cap, [3, 4], dev)
    with pytest.raises(IndexError):
        theirs.get_topk(0, 4, pool)
    with pytest.raises(rr.Error, match=r"request pool index 0, position 2 has KV slot 99, outside the pool \[0, 64\)") as e:
        mine.get_topk(0, 4, pool)
    assert e.value.code == "slot_out_of_range"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", ["sync", "overlap"])
def test_slot_out_of_range_in_out_cache_loc_raises(backend, path):
    dev = torch_device(backend)
    mine, theirs = pair(backend, layers=3, top_k=2, experts=16, num_tokens=64)
    overlap = path == "overlap"
    if overlap:
        out = one_step(theirs, [5, 70], dev, no_copy=True)
        with pytest.raises(IndexError):
            finish_overlap(out, dev)
        out = one_step(mine, [5, 70], dev, no_copy=True)
        with pytest.raises(rr.Error, match="step 1: row 1 has KV slot 70, outside the pool") as e:
            finish_overlap(out, dev)
    else:
        with pytest.raises(IndexError):
            one_step(theirs, [5, 70], dev)
        one_step(mine, [5, 70], dev)  # found on the device: raised by the next call
        with pytest.raises(rr.Error, match="step 1: row 1 has KV slot 70, outside the pool") as e:
            one_step(mine, [6], dev)
    assert e.value.code == "slot_out_of_range"
    # the refused step stored nothing: its other slot reads as missing, never as routing
    pool = SimpleNamespace(req_to_token=torch.tensor([[5, 0]], dtype=torch.int32, device=dev))
    with pytest.raises(rr.Error, match="KV slot 5"):
        mine.get_topk(0, 2, pool)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_slot_no_step_wrote_raises_where_sglang_returns_zeros(backend):
    dev = torch_device(backend)
    mine, theirs = pair(backend, layers=3, top_k=2, experts=16, num_tokens=64)
    pool = SimpleNamespace(req_to_token=torch.tensor([[7, 8, 9]], dtype=torch.int32, device=dev))
    for cap in (mine, theirs):
        one_step(cap, [7], dev)
    assert not theirs.get_topk(0, 3, pool)[1].any()  # SGLang: silent zeros
    with pytest.raises(rr.Error, match=r"request pool index 0, position 1 \(KV slot 8\) holds no routing") as e:
        mine.get_topk(0, 3, pool)
    assert e.value.code == "missing_routing"
    assert torch.equal(mine.get_topk(0, 2, pool), theirs.get_topk(0, 2, pool))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", ["sync", "overlap"])
def test_dense_layers_read_zero_and_a_layer_missing_from_a_step_is_an_error(backend, path):
    dev = torch_device(backend)
    mine, _ = pair(backend, layers=4, top_k=2, experts=16, num_tokens=64)
    overlap = path == "overlap"
    out = one_step(mine, [1, 2], dev, layers=(2, 3), no_copy=overlap)  # layers 0 and 1: dense
    if overlap:
        finish_overlap(out, dev)
    pool = SimpleNamespace(req_to_token=torch.tensor([[1, 2, 3, 4]], dtype=torch.int32, device=dev))
    rows = mine.get_topk(0, 3, pool)
    assert not rows[:, :2].any() and rows[:, 2:].any()
    out = one_step(mine, [3], dev, layers=(2,), no_copy=overlap)  # layer 3 was captured before: missing now
    with pytest.raises(rr.Error, match=r"step 2: layer 3 \(slot 3\), row 0 holds no valid expert id") as e:
        finish_overlap(out, dev) if overlap else one_step(mine, [4], dev, layers=(2, 3))
    assert e.value.code == "missing_routing"
    with pytest.raises(rr.Error, match=r"position 2 \(KV slot 3\) holds no routing for layer 2"):
        mine.get_topk(0, 4, pool)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_id_outside_the_experts_in_a_step_row_is_refused(backend):
    # SGLang would store it; the library refuses the step (padding rows of a graph are not checked)
    dev = torch_device(backend)
    mine, _ = pair(backend, layers=3, top_k=2, experts=16, num_tokens=64)
    out = one_step(mine, [1, 2], dev, ids=torch.tensor([[1, 2], [3, 16]], dtype=torch.int32), no_copy=True)
    with pytest.raises(rr.Error, match="row 1 holds no valid expert id") as e:
        finish_overlap(out, dev)
    assert e.value.code == "missing_routing"
    padded = torch.tensor([[1, 2], [3, 4], [-1, -1], [-1, -1]], dtype=torch.int32)
    for layer in (1, 2):
        mine.capture(layer, padded.to(dev))
    fb = SimpleNamespace(out_cache_loc=torch.tensor([3, 4], device=dev), out_cache_loc_virtual=None)
    finish_overlap(mine.on_forward_end(fb, True, 4, no_copy_to_cpu=True), dev)


def test_create_reads_the_model_and_the_engine():
    from routing_replay.sglang import _context

    model = SimpleNamespace(shared_experts_config=SimpleNamespace(num_fused_shared_experts=1))
    cap = RoutedExpertsCapturer.create(model=model, model_config=model_config(3, 2, 16), num_tokens=32,
                                       max_running_requests=4, device="cpu")
    assert cap.num_fused_shared_experts == 1 and cap.native.config.max_tokens_per_step == 8192
    try:
        _context.set_engine_hooks(enabled=lambda: False)
        assert RoutedExpertsCapturer.create(model=model, model_config=model_config(3, 2, 16), num_tokens=32,
                                            max_running_requests=4, device="cpu") is None
        _context.set_engine_hooks(enabled=lambda: True, chunked_prefill_size=lambda: 64, num_dp_ranks=lambda: 2,
                                  unsupported=lambda: None)
        assert RoutedExpertsCapturer(model_config(3, 2, 16), 32, 4, 0, "cpu").native.config.max_tokens_per_step == 128
        _context.set_engine_hooks(unsupported=lambda: "DP attention")
        with pytest.raises(NotImplementedError, match="DP attention"):
            RoutedExpertsCapturer(model_config(3, 2, 16), 32, 4, 0, "cpu")
    finally:
        _context.reset_engine_hooks()
    no_count = SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=2, num_experts_per_tok=2))
    with pytest.raises(ValueError, match="pass num_experts="):
        RoutedExpertsCapturer(no_count, 32, 4, 0, "cpu")
    assert RoutedExpertsCapturer(no_count, 32, 4, 0, "cpu", num_experts=500).index_dtype == np.uint16


def test_module_functions():
    from routing_replay import sglang as ours

    cap = RoutedExpertsCapturer(model_config(2, 2, 8), 16, 2, 0, "cpu")
    ours.set_global_experts_capturer(cap)
    assert ours.get_global_experts_capturer() is cap
    ours.destroy_global_experts_capturer()
    assert ours.get_global_experts_capturer() is None and cap.native is None
    field = peer().pybase64.b64encode(np.arange(6, dtype=np.int32).tobytes()).decode()
    data = {"meta_info": {"routed_experts": field}}
    assert np.array_equal(ours.extract_routed_experts_from_meta_info(data), peer().extract_routed_experts_from_meta_info(data))


@pytest.mark.parametrize("backend", BACKENDS)
def test_capture_inside_torch_compile(backend):
    # Dynamo records capture() as the library's custom op; it runs at every call of the compiled forward
    dev = torch_device(backend)
    mine, theirs = pair(backend, layers=3, top_k=2, experts=16, num_tokens=64)

    def forward(cap, logits):
        for layer in (1, 2):
            cap.capture(layer, torch.topk(logits + layer, 2, dim=-1).indices.to(torch.int32))
        return logits.sum()

    compiled = torch.compile(forward, backend="eager", fullgraph=True)
    for step in range(3):
        logits = torch.randn(4, 16, device=dev, generator=torch.Generator(dev).manual_seed(step))
        slots = torch.arange(4 * step, 4 * step + 4, device=dev)
        for cap, fn in ((mine, compiled), (theirs, forward)):
            fn(cap, logits)
            cap.on_forward_end(SimpleNamespace(out_cache_loc=slots, out_cache_loc_virtual=None), False, None)
    pool = SimpleNamespace(req_to_token=torch.arange(13, dtype=torch.int32, device=dev)[None])
    assert torch.equal(mine.get_topk(0, 13, pool), theirs.get_topk(0, 13, pool))
