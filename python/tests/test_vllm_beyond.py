"""Where routing_replay.vllm goes beyond vLLM 0.33's connector, and vLLM's behaviour it replaces.

- A request whose first tokens were computed on another instance (prefill/decode disaggregation)
  starts capturing inside a block: vLLM asserts; the library emits from the first computed token,
  never files the partial block (a later read of it fails closed) and files the next full blocks.
- Expert ids outside [0, E) and a step that missed a layer captured before are refused: vLLM wraps
  the id into its narrow dtype, and emits the previous step's rows for the layer. A layer never
  captured (a dense layer the model's layer count includes) reads as 0 in both.

The vLLM cases document what it does (they run where torch is installed); the library's run on each
backend this machine has, and against the plain reference where the behaviour is shared.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import requires_cuda
from _vllm_driver import E, K, L, Sched, Worker, assert_clear, h, logical
from _vllm_harness import Library, Peer, Reference, capturer_of, have_library
from _vllm_trace import Forward

requires_library = pytest.mark.skipif(not have_library(), reason="routing_replay.vllm is not built here")
LIBRARY = [pytest.param("host", marks=requires_library), pytest.param("cuda", marks=[requires_library, requires_cuda])]


@pytest.fixture(params=["reference", *LIBRARY], ids=["reference", "routing_replay-host", "routing_replay-cuda"])
def beyond(request):
    """The implementations that start mid-block: the reference (told to) and the library."""
    if request.param == "reference":
        return Reference(mid_block_start=True)
    return Library(request.param)


@pytest.fixture(params=LIBRARY, ids=["host", "cuda"])
def library(request):
    return Library(request.param)


def test_vllm_cannot_start_mid_block():
    w = Worker(Peer(), max_num_seqs=1)
    with pytest.raises(AssertionError, match="not contiguous"):
        w.step([Sched("r", 6, 1, emit=6, hashes=[h("a")])], logical(1, 6))


def test_first_capture_mid_block(beyond):
    """Tokens [0, 6) were computed elsewhere; the first local forward starts at 6 (block size 4)."""
    w = Worker(beyond, max_num_seqs=2)
    rows = logical(12)
    out = w.step([Sched("r", 6, 1, emit=6, hashes=[h("a")])], rows[6:7])
    assert out["r"][0] == 6
    np.testing.assert_array_equal(out["r"][1], rows[6:7])
    out = w.step([Sched("r", 7, 2, emit=6, hashes=[h("b")])], rows[7:9])
    assert out["r"][0] == 7
    np.testing.assert_array_equal(out["r"][1], rows[7:9])
    out = w.step([Sched("r", 9, 3, emit=6, hashes=[h("c")])], rows[9:12])
    assert out["r"][0] == 9
    np.testing.assert_array_equal(out["r"][1], rows[9:12])
    np.testing.assert_array_equal(w.read([h("c")]), rows[8:12])  # the first full block captured here
    for missing in (h("b"), h("a")):  # [4, 8) lacks rows 4 and 5; [0, 4) was never computed here
        with pytest.raises(beyond.store_error):
            w.read([missing])


def test_first_capture_mid_block_emits_its_first_rows(beyond):
    w = Worker(beyond, max_num_seqs=1)
    rows = logical(7)
    out = w.step([Sched("r", 5, 2, emit=5, hashes=[h("a")])], rows[5:7])
    assert out["r"][0] == 5
    np.testing.assert_array_equal(out["r"][1], rows[5:7])
    w.close()


def _capture_step(w, impl, ids_per_layer, rows=1):
    run = [Sched("r", 0, rows)]
    w.begin(run)
    capturer = capturer_of(w.conn)
    for layer, ids in ids_per_layer.items():
        capturer.capture(layer, impl.ids(w.conn, np.ascontiguousarray(ids, dtype=np.int64)))
    w._fw = Forward(0, ["r"], np.array([0, rows], np.int32), np.array([0], np.int32), None, None, None)
    pending = w.conn.prepare_output(impl.input_batch(w._fw))
    return w.finish_step(pending, run)


@pytest.mark.parametrize("bad", [E, E + 7, -1])
def test_expert_id_out_of_range_is_refused(library, bad):
    w = Worker(library, max_num_seqs=1)
    ids = {layer: np.ones((1, K), np.int64) for layer in range(L)}
    ids[1][0, 1] = bad
    with pytest.raises(Exception) as info:
        _capture_step(w, library, ids)
    assert_clear(info.value)


def test_vllm_wraps_an_expert_id_out_of_range():
    peer = Peer()
    w = Worker(peer, max_num_seqs=1)
    ids = {layer: np.ones((1, K), np.int64) for layer in range(L)}
    ids[1][0, 1] = E + 7
    out = _capture_step(w, peer, ids)
    assert out["r"][1][0, 1, 1] == 7  # E + 7 as uint8: a valid-looking expert


def test_layer_not_captured_is_refused(library):
    w = Worker(library, max_num_seqs=2)
    full = {layer: np.ones((1, K), np.int64) for layer in range(L)}
    _capture_step(w, library, full)
    w.begin(finished={"r": []})
    partial = {layer: np.full((1, K), 2, np.int64) for layer in range(L - 1)}
    with pytest.raises(Exception) as info:
        _capture_step(w, library, partial)
    assert_clear(info.value)


@pytest.fixture(params=["vllm", "reference", *LIBRARY], ids=["vllm", "reference", "routing_replay-host",
                                                              "routing_replay-cuda"])
def every(request):
    if request.param == "vllm":
        return Peer()
    if request.param == "reference":
        return Reference()
    return Library(request.param)


def test_a_layer_never_captured_reads_as_zero(every):
    """Models whose first layers are dense count them among their hidden layers; their rows are
    never captured and read as expert 0, in vLLM as in the library."""
    w = Worker(every, max_num_seqs=1)
    out = _capture_step(w, every, {layer: np.full((1, K), 2, np.int64) for layer in range(1, L)})
    np.testing.assert_array_equal(out["r"][1][0, 0], np.zeros(K))
    np.testing.assert_array_equal(out["r"][1][0, 1:], np.full((L - 1, K), 2))


def test_vllm_emits_the_previous_steps_rows_for_a_layer_not_captured():
    peer = Peer()
    w = Worker(peer, max_num_seqs=2)
    _capture_step(w, peer, {layer: np.ones((1, K), np.int64) for layer in range(L)})
    w.begin(finished={"r": []})
    out = _capture_step(w, peer, {layer: np.full((1, K), 2, np.int64) for layer in range(L - 1)})
    assert (out["r"][1][0, L - 1] == 1).all()  # stale: the last layer's rows of the step before
