"""SGLang's own unit tests of its routed-experts capturer, rewritten against the capturer's interface
and run against SGLang 0.5.23's capturer (the peer) and ours alike.

- The overlap result survives the next forward reusing the capture buffer and the slot tensor before
  the engine copies it (SGLang's state-capturer lifetime test,
  ``test_copy_stream_reads_snapshot_after_next_forward_reuses_buffers``, and the buffer reuse in its
  DP-slice test, ``test_local_capture_survives_dp_offsets_sharding_and_overlap``, one rank).
- Routes of a request re-prefilled at new slots after a retraction, read with several start offsets
  and through the wire format (``TestRetractRoutedExperts``, at the capturer's level: 0.5.23 reads the
  slots the request holds at the end).

Where SGLang reads zeros (a slot no step wrote), ours raises instead; the expectations say which.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from _peers import load_sglang_peer
from conftest import BACKENDS

import routing_replay as rr

torch = pytest.importorskip("torch")
from routing_replay.sglang import RoutedExpertsCapturer  # noqa: E402

IMPLS = ["sglang", "ours"]


def make(impl, backend, *, layers, top_k, num_tokens, experts=128):
    mc = SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=layers, num_experts_per_tok=top_k,
                                                        num_experts=experts))
    cls = load_sglang_peer().RoutedExpertsCapturer if impl == "sglang" else RoutedExpertsCapturer
    return cls(mc, num_tokens=num_tokens, max_running_requests=8, num_fused_shared_experts=0,
               device="cpu" if backend == "host" else "cuda")


def read(cap, slots, dev, start_len=0, seqlen=None):
    """get_topk over a request holding `slots` (seqlen - 1 of them by default)."""
    row = torch.tensor([list(slots) + [0]], dtype=torch.int32, device=dev)
    return cap.get_topk(0, len(slots) + 1 if seqlen is None else seqlen,
                        SimpleNamespace(req_to_token=row), start_len=start_len)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_overlap_result_survives_the_next_forward_reusing_its_buffers(impl, backend):
    dev = "cpu" if backend == "host" else "cuda"
    cap = make(impl, backend, layers=2, top_k=2, num_tokens=16)
    first_topk = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32, device=dev)
    cap.capture(layer_id=0, topk_indices=first_topk)
    out_cache_loc = torch.tensor([5, 6], device=dev)
    first = cap.on_forward_end(SimpleNamespace(out_cache_loc=out_cache_loc, out_cache_loc_virtual=None),
                               can_run_graph=False, cuda_graph_batch=None, no_copy_to_cpu=True)
    assert first is not None
    if dev == "cuda":
        forward_stream = torch.cuda.current_stream()
        copy_stream = torch.cuda.Stream()
        copy_done = torch.cuda.Event()
        copy_stream.wait_stream(forward_stream)  # result copies may start after the first forward only
    # the next forward reuses the capture buffer and the slot tensor before the copy reads them
    cap.capture(layer_id=0, topk_indices=torch.tensor([[9, 10], [11, 12]], dtype=torch.int32, device=dev))
    out_cache_loc.copy_(torch.tensor([7, 8], device=dev))
    if dev == "cuda":
        reused = torch.cuda.Event()
        reused.record(forward_stream)
        copy_stream.wait_event(reused)
        with torch.cuda.stream(copy_stream):
            first.map_device_tensors(lambda t: t.to("cpu", non_blocking=True))
            copy_done.record()
        copy_done.synchronize()
    else:
        first.map_device_tensors(lambda t: t.to("cpu", non_blocking=True))
    first.finalize()
    rows = read(cap, [5, 6], dev)
    assert torch.equal(rows[:, 0], first_topk.cpu())
    assert not rows[:, 1].any()  # layer 1 was never captured: zeros in both
    if impl == "sglang":
        assert not read(cap, [7, 8], dev).any()  # never written: zeros
    else:
        with pytest.raises(rr.Error, match=r"position 0 \(KV slot 7\) holds no routing"):
            read(cap, [7, 8], dev)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("graph", [False, True])
def test_buffer_refilled_before_finalize_keeps_the_step(impl, backend, graph):
    dev = "cpu" if backend == "host" else "cuda"
    layers, top_k = 3, 4
    cap = make(impl, backend, layers=layers, top_k=top_k, num_tokens=32)
    expected = torch.arange(6 * layers * top_k, dtype=torch.int32).reshape(6, layers, top_k) % 128
    locations = torch.tensor([4, 9, 13, 21, 7], device=dev)
    rows = 8 if graph else 5  # a replayed graph wrote its padded batch
    for layer in range(layers):
        ids = torch.full((rows, top_k), -1, dtype=torch.int32)
        ids[:5] = expected[:5, layer]
        cap.capture(layer, ids.to(dev))
    pending = cap.on_forward_end(SimpleNamespace(out_cache_loc=locations, out_cache_loc_virtual=None),
                                 can_run_graph=graph, cuda_graph_batch=8 if graph else None, no_copy_to_cpu=True)
    for layer in range(layers):  # another forward reuses the device buffer before the copy
        cap.capture(layer, torch.full((5, top_k), 63, dtype=torch.int32, device=dev))
    pending.map_device_tensors(lambda t: t.to("cpu"))  # the engine copies to the host before finalize
    pending.finalize()
    pool = SimpleNamespace(req_to_token=torch.tensor([[4, 9, 13, 21, 7, 0]], dtype=torch.int32, device=dev))
    assert torch.equal(cap.get_topk(0, 6, pool), expected[:5])


def prefill(cap, dev, version, slots, layers=2, top_k=2):
    """Distinct routes of one re-prefill `version` at `slots` (SGLang's retract test's _prefill)."""
    rows = len(slots)
    routes = torch.arange(rows * layers * top_k, dtype=torch.int32).reshape(rows, layers, top_k) + version * 32
    for layer in range(layers):
        cap.capture(layer, routes[:, layer].to(dev))
    cap.on_forward_end(SimpleNamespace(out_cache_loc=torch.tensor(slots, device=dev), out_cache_loc_virtual=None),
                       False, None)
    return routes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_reprefill_at_new_slots_after_retraction_reads_the_latest_routes(impl, backend):
    dev = "cpu" if backend == "host" else "cuda"
    peer = load_sglang_peer()
    for start in (0, 3, 4, 5, 10):
        cap = make(impl, backend, layers=2, top_k=2, num_tokens=64)
        prefill(cap, dev, 0, list(range(0, 6)))  # 4 prompt + 2 output tokens: positions 0..5
        second = prefill(cap, dev, 1, list(range(16, 22)))  # retracted, re-prefilled at new slots
        third = prefill(cap, dev, 2, list(range(32, 39)))  # and again, one token longer
        cap.on_forward_end(SimpleNamespace(out_cache_loc=torch.zeros(0, dtype=torch.int64, device=dev),
                                           out_cache_loc_virtual=None), False, None)  # an empty step
        actual = read(cap, list(range(32, 39)), dev, start_len=start, seqlen=8)
        assert torch.equal(actual, third[min(start, 7):])
        assert not torch.equal(read(cap, list(range(16, 22)), dev), third[:6])
        assert torch.equal(read(cap, list(range(16, 22)), dev), second)
        # SGLang's detokenizer sends base64 of the int32 bytes; a client decodes it back
        encoded = peer.pybase64.b64encode(actual.numpy().tobytes()).decode("utf-8")
        decoded = peer.extract_routed_experts_from_meta_info({"meta_info": {"routed_experts": encoded}})
        assert np.array_equal(decoded.reshape(actual.shape), actual.numpy())
        if impl == "ours":
            row = torch.tensor([list(range(32, 39)) + [0]], dtype=torch.int32, device=dev)
            assert cap.get_topk_base64(0, 8, SimpleNamespace(req_to_token=row), start_len=start) == encoded
