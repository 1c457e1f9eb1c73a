"""vLLM's own unit tests of its routed-experts worker connector, restated (adapted from vLLM's
tests/distributed/aux_output_connector/test_store.py and the capturer's tests, Apache-2.0) so that
each runs against vLLM 0.33's connector (the peer), the plain reference and routing_replay.vllm.

Upstream inspects the connector's private parts (its buffer, its store, its request states); here
every check goes through what an engine can see: the outputs of ``process_output``, what a later
request reads back from the store (a "reader": a request whose prefix hit covers the blocks, emitting
from token 0), and where a call is refused. Where vLLM asserts, the library must raise ValueError or
RuntimeError instead (``impl.refusal``).

Not restated: the shared-memory and Mooncake stores, logprobs, VariableBlockObjectStore and the
store's refusal of an oversized batch (not in 0.33, whose store grows instead: see
``test_store_grows_when_every_block_is_referenced``); the non-output TP rank and the DP/SP row
restoration of the capturer (they read vLLM's TP group and forward context, which the peer stubs);
the capture-profile check (it guards a mocked capturer; through ``capture`` the shape is fixed);
the scheduler connector's own tests (the trace model is checked against it in
test_vllm_differential.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import requires_cuda
from _vllm_driver import B, K, L, Sched, Worker, h, logical, refused
from _vllm_harness import Library, Peer, Reference, capturer_of, have_library
from _vllm_trace import Forward

requires_library = pytest.mark.skipif(not have_library(), reason="routing_replay.vllm is not built here")


@pytest.fixture(params=["vllm", "reference", pytest.param("host", marks=requires_library),
                        pytest.param("cuda", marks=[requires_library, requires_cuda])],
                ids=["vllm", "reference", "routing_replay-host", "routing_replay-cuda"])
def impl(request):
    if request.param == "vllm":
        return Peer()
    if request.param == "reference":
        return Reference()
    return Library(request.param)


# -- refusals ---------------------------------------------------------------------------------------
def test_generation_cannot_move_back(impl):
    w = Worker(impl, max_num_seqs=1)
    w.begin(generation=1)
    refused(impl, w.begin, generation=0)


def test_request_cannot_run_and_finish_in_one_step(impl):
    w = Worker(impl, max_num_seqs=1)
    refused(impl, w.begin, [Sched("r", 0, 1)], finished={"r": []})


def test_emit_start_cannot_move_ahead_of_the_worker(impl):
    w = Worker(impl, max_num_seqs=1)
    w.begin([Sched("r", 0, 1, emit=0)])
    refused(impl, w.begin, [Sched("r", 1, 1, emit=1)])


def test_at_most_max_concurrent_batches_in_flight(impl):
    w = Worker(impl, max_num_seqs=1, max_concurrent_batches=2)
    run = [Sched("r", 0, 1)]
    for _ in range(2):
        w.begin(run)
        assert w.forward(run, logical(1)) is not None
    w.begin(run)
    refused(impl, w.forward, run, logical(1))


@pytest.mark.parametrize("rejected", [-1, 2])
def test_rejected_count_must_fit_the_step(impl, rejected):
    w = Worker(impl, max_num_seqs=1)
    refused(impl, w.step, [Sched("r", 0, 1)], logical(1), rejected=[rejected])


def test_capture_cannot_move_back(impl):
    """Rows overlapping rows already captured are refused (upstream: 'capture moved backwards')."""
    w = Worker(impl, max_num_seqs=1)
    w.step([Sched("r", 0, 3)], logical(3), sampled=[0])
    stale = logical(2, 2)
    stale[0] += 100
    refused(impl, w.step, [Sched("r", 2, 2, hashes=[h("a")])], stale)


def test_a_gap_needs_an_optimistic_step_behind_it(impl):
    """A step starting past the captured rows is only valid after rejected drafts ('unbacked gap')."""
    w = Worker(impl, max_num_seqs=1)
    w.step([Sched("r", 0, 1)], logical(1), sampled=[0])
    refused(impl, w.step, [Sched("r", 2, 1)], logical(1, 2), sampled=[0])


# -- steps and outputs ------------------------------------------------------------------------------
def test_step_without_metadata_emits_nothing(impl):
    """An internal step (warm-up, profiling) has no metadata: nothing is snapshot or emitted."""
    w = Worker(impl, max_num_seqs=1)
    w.conn.begin_step(None)
    assert w.forward([], np.zeros((0, L, K), np.uint8), query_start_loc=[0]) is None
    w.close()


def test_next_step_leaves_an_output_in_flight_alone(impl):
    w = Worker(impl, max_num_seqs=1)
    run = [Sched("r", 0, 1)]
    w.begin(run)
    pending = w.forward(run, np.ones((1, L, K), np.uint8))
    w.begin()
    out = w.finish_step(pending, run)
    np.testing.assert_array_equal(out["r"][1], np.ones((1, L, K), np.uint8))
    w.close()


@pytest.mark.parametrize("num_pending", [1, 2])
def test_finish_waits_for_every_output_in_flight(impl, num_pending):
    w = Worker(impl, max_num_seqs=1)
    rows = logical(4)
    in_flight = []
    for i in range(num_pending):
        run = [Sched("r", 4 * i, 4, emit=4 * i, hashes=[bytes([i]) * 4])]
        w.begin(run)
        pending = w.forward(run, rows)
        w._fw.num_sampled, w._fw.num_rejected = np.ones(1, np.int32), np.zeros(1, np.int32)
        in_flight.append((pending, impl.enqueue(pending, w._fw)))
    w.begin(finished={"r": []})  # the request finishes while its outputs are unconsumed
    for pending, token in in_flight:
        impl.wait(token)
        np.testing.assert_array_equal(np.asarray(pending.process_output()["r"].rows), rows)
    # torn down: the id starts afresh at token 0 (a leftover state would refuse moving back)
    assert w.step([Sched("r", 0, 1)], logical(1))["r"][0] == 0
    w.close()


def test_padded_query_start_loc_is_ignored(impl):
    """CUDA graphs pad the batch; the connector reads only the scheduled requests' boundaries."""
    w = Worker(impl, max_num_seqs=2)
    rows = logical(2)
    out = w.step([Sched("first", 0, 1), Sched("second", 0, 1)], rows, sampled=[1, 1], rejected=[0, 0],
                 query_start_loc=[0, 1, 2, 2])
    np.testing.assert_array_equal(out["first"][1], rows[:1])
    np.testing.assert_array_equal(out["second"][1], rows[1:])
    w.close()


def test_rejected_drafts_reattach_at_the_accepted_end(impl):
    """A step scheduled before its predecessor's rejections were known starts, in the batch, past
    the accepted rows; its rows continue from them."""
    w = Worker(impl, max_num_seqs=1, max_num_batched_tokens=8)
    rows = logical(5)
    first = w.step([Sched("r", 0, 5)], rows[:5], rejected=[4])
    queued = w.step([Sched("r", 5, 4)], rows[1:], rejected=[3])
    rolled_back = w.step([Sched("r", 6, 3, hashes=[h("a")])], rows[2:])
    np.testing.assert_array_equal(first["r"][1], rows[:1])
    assert queued["r"][0] == 1
    np.testing.assert_array_equal(queued["r"][1], rows[1:2])
    assert rolled_back["r"][0] == 2
    np.testing.assert_array_equal(rolled_back["r"][1], rows[2:])
    w.close()


def test_emitted_rows_are_not_emitted_again(impl):
    """With asynchronous scheduling the scheduler's emit start lags; the worker's cursor rules."""
    w = Worker(impl, max_num_seqs=1)
    rows = logical(8)
    w.step([Sched("r", 0, 4, hashes=[h("a"), h("b")])], rows[:4])
    out = w.step([Sched("r", 4, 4, emit=0)], rows[4:])
    assert out["r"][0] == 4
    np.testing.assert_array_equal(out["r"][1], rows[4:])
    w.close()


def test_resumes_at_the_schedulers_emit_start(impl):
    w = Worker(impl, max_num_seqs=1)
    rows = logical(5)
    out = w.step([Sched("r", 4, 1, emit=4, hashes=[h("a")])], rows[4:])
    assert out["r"][0] == 4
    np.testing.assert_array_equal(out["r"][1], rows[4:])
    w.close()


def test_chunked_prefill_emits_the_whole_prompt_at_its_last_chunk(impl):
    w = Worker(impl, max_num_seqs=1)
    rows = logical(3)
    assert w.step([Sched("r", 0, 2)], rows[:2], sampled=[0]) == {}
    out = w.step([Sched("r", 2, 1)], rows[2:])
    assert out["r"][0] == 0
    np.testing.assert_array_equal(out["r"][1], rows)
    w.close()


def test_stored_block_and_incomplete_block_emit_together(impl):
    w = Worker(impl, max_num_seqs=1)
    rows = logical(7)
    assert w.step([Sched("r", 0, 6, hashes=[h("a")])], rows[:6], sampled=[0]) == {}
    out = w.step([Sched("r", 6, 1)], rows[6:])
    np.testing.assert_array_equal(out["r"][1], rows)
    w.close()


@pytest.mark.parametrize("chunk", [2, 4])
@pytest.mark.parametrize("max_tokens", [1, 2])
def test_emit_start_at_the_end_of_the_prompt(impl, chunk, max_tokens):
    """routed_experts_prompt_start at the prompt's end: an empty first output, then decode rows."""
    w = Worker(impl, max_num_seqs=1)
    rows = logical(5)
    out = {}
    for start in range(0, 4, chunk):
        out = w.step([Sched("r", start, chunk, emit=4, hashes=[h("a")] if start + chunk >= 4 else [])],
                     rows[start:start + chunk], sampled=[int(start + chunk == 4)])
        if start + chunk < 4:
            assert out == {}
    assert out["r"][0] == 4 and len(out["r"][1]) == 0
    if max_tokens == 2:
        out = w.step([Sched("r", 4, 1, emit=4)], rows[4:])
        assert out["r"][0] == 4
        np.testing.assert_array_equal(out["r"][1], rows[4:])
    w.close()


def test_output_does_not_alias_memory_reused_later(impl):
    w = Worker(impl, max_num_seqs=1)
    rows = logical(4)
    w.step([Sched("r", 0, 2, hashes=[h("a")])], rows[:2], sampled=[0])
    emitted = w.step([Sched("r", 2, 2)], rows[2:])["r"][1]
    w.step([Sched("reuse", 0, 4, hashes=[h("b")])], np.full((4, L, K), 99, np.uint8), sampled=[0])
    np.testing.assert_array_equal(emitted, rows)
    w.close()


def test_capture_does_not_keep_the_routers_array(impl):
    """The router's output may be overwritten once capture returns (its memory is reused by the next
    layer); neither the output nor the stored block may change with it."""
    w = Worker(impl, max_num_seqs=1)
    rows = logical(4)
    run = [Sched("r", 0, 4, hashes=[h("a")])]
    w.begin(run)
    capturer = capturer_of(w.conn)
    for layer in range(L):
        ids = impl.ids(w.conn, np.ascontiguousarray(rows[:, layer, :].astype(np.int64)))
        capturer.capture(layer, ids)
        ids[...] = 0  # the next kernel writes here
    w._fw = Forward(0, ["r"], np.array([0, 4], np.int32), np.array([0], np.int32), rows, None, None)
    pending = w.conn.prepare_output(impl.input_batch(w._fw))
    out = w.finish_step(pending, run)
    np.testing.assert_array_equal(out["r"][1], rows)
    np.testing.assert_array_equal(w.read([h("a")]), rows)
    w.close()


@pytest.mark.parametrize("num_experts, dtype", [(256, np.uint8), (257, np.uint16)])
def test_rows_use_the_narrowest_dtype(impl, num_experts, dtype):
    w = Worker(impl, max_num_seqs=1, num_experts=num_experts)
    rows = logical(2).astype(np.int64)
    rows[1, 0, 1] = num_experts - 1
    out = w.step([Sched("r", 0, 2)], rows)
    assert out["r"][1].dtype == dtype
    np.testing.assert_array_equal(out["r"][1], rows.astype(dtype))
    w.close()


# -- blocks and the store ---------------------------------------------------------------------------
def test_blocks_are_stored_and_serve_a_prefix_hit(impl):
    w = Worker(impl, max_num_seqs=2)
    hashes = [h("a"), h("b"), h("c")]
    rows = logical(10)
    np.testing.assert_array_equal(w.step([Sched("first", 0, 8, hashes=hashes)], rows[:8])["first"][1], rows[:8])
    out = w.step([Sched("second", 8, 2, hashes=hashes)], rows[8:], finished={"first": []})
    np.testing.assert_array_equal(out["second"][1], rows)
    w.close()


def test_one_row_per_decode_step_fills_a_block(impl):
    w = Worker(impl, max_num_seqs=1)
    rows = logical(5)
    for i in range(4):
        w.step([Sched("r", i, 1, emit=i)], rows[i:i + 1])
    w.step([Sched("r", 4, 1, emit=4, hashes=[h("a")])], rows[4:])
    np.testing.assert_array_equal(w.read([h("a")]), rows[:4])
    w.close()


def test_a_full_block_waits_for_its_hash(impl):
    w = Worker(impl, max_num_seqs=1)
    rows = logical(5)
    np.testing.assert_array_equal(w.step([Sched("r", 0, 4)], rows[:4])["r"][1], rows[:4])
    out = w.step([Sched("r", 4, 1, emit=4, hashes=[h("a")])], rows[4:])
    np.testing.assert_array_equal(out["r"][1], rows[4:])
    np.testing.assert_array_equal(w.read([h("a")]), rows[:4])
    w.close()


def test_a_hash_only_update_stores_a_waiting_block(impl):
    """A hash may arrive for a request not scheduled in that step (no forward at all here)."""
    w = Worker(impl, max_num_seqs=1)
    rows = logical(4)
    w.step([Sched("r", 0, 4)], rows)
    w.begin(hash_updates={"r": [h("a")]})
    np.testing.assert_array_equal(w.read([h("a")]), rows)
    w.close()


def test_unscheduled_requests_blocks_are_stored_on_their_hashes(impl):
    w = Worker(impl, max_num_seqs=2, max_num_batched_tokens=20, max_concurrent_batches=1)
    rows = logical(48)
    w.step([Sched("first", 0, 4, hashes=[h("a")]), Sched("second", 0, 4, hashes=[h("b")])], rows[:8],
           sampled=[0, 0])
    w.step([Sched("first", 4, 20)], rows[8:28], sampled=[0])
    first = [bytes([v]) * 32 for v in range(2, 7)]
    w.step([Sched("second", 4, 20)], rows[28:48], sampled=[0], hash_updates={"first": first})
    np.testing.assert_array_equal(w.read([h("a")] + first), np.concatenate([rows[:4], rows[8:28]]))
    w.close()


def test_the_batch_is_stored_before_a_consumer_reads_it(impl):
    """A consumer may hit a block its producer computes in the same step."""
    w = Worker(impl, max_num_seqs=2)
    hashes = [h("a"), h("b")]
    rows = logical(8)
    out = w.step([Sched("consumer", 4, 4, hashes=hashes), Sched("producer", 0, 4, hashes=hashes)],
                 np.concatenate([rows[4:], rows[:4]]))
    np.testing.assert_array_equal(out["consumer"][1], rows)
    np.testing.assert_array_equal(out["producer"][1], rows[:4])
    w.close()


def test_hash_deltas_accumulate(impl):
    w = Worker(impl, max_num_seqs=1)
    rows = logical(12)
    w.step([Sched("r", 0, 8, hashes=[h("a"), h("b")])], rows[:8], sampled=[0])
    w.step([Sched("r", 8, 4, hashes=[h("c")])], rows[8:], sampled=[0])
    np.testing.assert_array_equal(w.read([h("a"), h("b"), h("c")]), rows)
    w.close()


def test_finish_stores_a_block_keyed_at_the_end_and_forgets_the_request(impl):
    w = Worker(impl, max_num_seqs=1)
    rows = logical(8)
    w.step([Sched("r", 0, 8)], rows, sampled=[0])
    w.begin(finished={"r": [h("a")]})
    np.testing.assert_array_equal(w.read([h("a")]), rows[:4])
    assert w.step([Sched("r", 0, 1)], rows[:1])["r"][0] == 0
    w.close()


def test_preempted_request_keeps_the_blocks_of_its_step_in_flight(impl):
    w = Worker(impl, max_num_seqs=1)
    rows = logical(8)
    w.step([Sched("r", 0, 4, hashes=[h("a")])], rows[:4])
    w.step([Sched("r", 4, 4, hashes=[h("b")])], rows[4:], sampled=[0])
    w.begin(finished={"r": []})
    np.testing.assert_array_equal(w.read([h("a"), h("b")]), rows)
    w.close()


def test_a_finished_request_releases_before_the_same_steps_blocks_are_stored(impl):
    w = Worker(impl, max_num_seqs=2, store_blocks=1)
    victim, producer = np.zeros((B, L, K), np.uint8), np.ones((B, L, K), np.uint8)
    w.step([Sched("victim", 0, B, hashes=[h("a")]), Sched("producer", 0, B)], np.concatenate([victim, producer]),
           sampled=[0, 0])
    w.begin(finished={"victim": []}, hash_updates={"producer": [h("b")]})
    np.testing.assert_array_equal(w.read([h("b")]), producer)
    with pytest.raises(impl.store_error):
        w.read([h("a")])


def test_a_missing_block_fails_closed(impl):
    w = Worker(impl, max_num_seqs=1)
    with pytest.raises(impl.store_error):
        w.step([Sched("r", 8, 1, hashes=[h("a"), h("b")])], logical(1))


def test_store_evicts_in_the_kv_caches_order(impl):
    """Finished requests release their blocks tail first; the least recently used go first."""
    w = Worker(impl, max_num_seqs=2, store_blocks=3)
    blocks = [np.full((B, L, K), v, np.uint8) for v in range(5)]
    for rid, which in [("s", [0]), ("ab", [1, 2]), ("c", [3]), ("d", [4])]:
        w.step([Sched(rid, 0, B * len(which), hashes=[h(i) for i in which])],
               np.concatenate([blocks[i] for i in which]))
        w.begin(finished={rid: []})
    np.testing.assert_array_equal(w.read([h(1), h(3), h(4)]), np.concatenate([blocks[1], blocks[3], blocks[4]]))
    with pytest.raises(impl.store_error):
        w.read([h(2)])


def _store_blocks(w, named):
    """Each (request, hash) stores one block of value = its index, then finishes."""
    rows = {}
    for i, (rid, key) in enumerate(named):
        rows[key] = np.full((B, L, K), i + 1, np.uint8)
        w.step([Sched(rid, 0, B, hashes=[key])], rows[key])
        w.begin(finished={rid: []})
    return rows


def test_a_block_a_request_read_outlives_older_ones(impl):
    """The reader held the block while it read (retained, then released): it goes to the end of the
    eviction order, behind a block no one used since."""
    w = Worker(impl, max_num_seqs=1, store_blocks=2)
    rows = _store_blocks(w, [("p", h("p")), ("q", h("q"))])
    w.read([h("p")])
    rows.update(_store_blocks(w, [("r", h("r"))]))
    np.testing.assert_array_equal(w.read([h("p"), h("r")]), np.concatenate([rows[h("p")], rows[h("r")]]))
    with pytest.raises(impl.store_error):
        w.read([h("q")])


def test_store_never_evicts_a_retained_block(impl):
    """Blocks the scheduler retains (its KV cache holds them) outlive older unreferenced ones."""
    w = Worker(impl, max_num_seqs=1, store_blocks=2)
    rows = _store_blocks(w, [("p", h("p")), ("q", h("q"))])
    w.begin(retained=[h("p")])
    rows.update(_store_blocks(w, [("r", h("r"))]))
    np.testing.assert_array_equal(w.read([h("p"), h("r")]), np.concatenate([rows[h("p")], rows[h("r")]]))
    w.begin(released=[h("p")])
    with pytest.raises(impl.store_error):
        w.read([h("q")])


def test_finished_request_is_evicted_tail_first(impl):
    w = Worker(impl, max_num_seqs=1, store_blocks=3)
    rows = logical(12)
    w.step([Sched("r", 0, 12, hashes=[h("x"), h("y"), h("z")])], rows)
    w.begin(finished={"r": []})
    _store_blocks(w, [("d", h("d"))])
    np.testing.assert_array_equal(w.read([h("x"), h("y")]), rows[:8])
    with pytest.raises(impl.store_error):
        w.read([h("z")])


def test_store_grows_when_every_block_is_referenced(impl):
    """vLLM 0.33 grows its store rather than drop a block a running request still holds."""
    w = Worker(impl, max_num_seqs=2, store_blocks=2)
    rows = logical(12)
    w.step([Sched("r", 0, 12, hashes=[h("x"), h("y"), h("z")])], rows)
    np.testing.assert_array_equal(w.read([h("x"), h("y"), h("z")]), rows)
    w.close()


def test_generation_bump_starts_a_new_namespace(impl):
    """After a prefix-cache reset, blocks stored under the old generation are not read back."""
    w = Worker(impl, max_num_seqs=1)
    rows = _store_blocks(w, [("p", h("p"))])
    np.testing.assert_array_equal(w.read([h("p")]), rows[h("p")])
    w.begin(generation=1)
    with pytest.raises(impl.store_error):
        w.read([h("p")], generation=1)


def test_closed_connector_refuses_steps(impl):
    w = Worker(impl, max_num_seqs=1)
    w.close()
    with pytest.raises(Exception):
        w.begin([Sched("r", 0, 1, hashes=[h("a")])])


# -- the capturer -----------------------------------------------------------------------------------
def _capturer_module(impl):
    return impl.module if hasattr(impl, "module") else None


def _config(num_layers=3, num_experts=8, top_k=2):
    from types import SimpleNamespace

    model = SimpleNamespace(get_total_num_hidden_layers=lambda: num_layers, get_num_experts=lambda: num_experts,
                            get_num_experts_per_tok=lambda: top_k, hf_text_config=SimpleNamespace(model_type="test"))
    return SimpleNamespace(model_config=model,
                           parallel_config=SimpleNamespace(data_parallel_rank=0, tensor_parallel_size=1),
                           scheduler_config=SimpleNamespace(max_num_batched_tokens=8, max_num_seqs=2),
                           max_concurrent_batches=2, aux_output_config=SimpleNamespace(max_bytes=None))


@pytest.mark.parametrize("counts", [(0, 8, 2), (3, 0, 2), (3, 8, 0)])
def test_capturer_refuses_a_model_without_routed_experts(impl, counts):
    module = _capturer_module(impl)
    if module is None:
        pytest.skip("the reference has no vLLM-config constructor")
    with pytest.raises(ValueError):
        module.RoutedExpertsCapturer(8, _config(*counts), **({} if impl.name == "vllm" else {"device": _device(impl)}))


def test_capturer_refuses_a_layer_out_of_range(impl):
    w = Worker(impl, max_num_seqs=1)
    with pytest.raises(IndexError if impl.name != "routing_replay" else Exception):
        capturer_of(w.conn).capture(L, impl.ids(w.conn, np.zeros((1, K), np.int64)))
    w.close()


def _device(impl):
    return "cpu" if getattr(impl, "backend", "host") == "host" else "cuda"
