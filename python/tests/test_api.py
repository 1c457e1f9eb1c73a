"""The Python API of Replay on every backend: array inputs of every kind, extraction and its
safety, output formats, errors, block transfers, streams."""

from __future__ import annotations

import io

import numpy as np
import pytest

import routing_replay as rr
from conftest import requires_cuda

E, K = 16, 2


def make(device, **kw) -> rr.Replay:
    args = dict(num_experts=E, top_k=K, max_tokens_per_step=8, max_model_len=32, moe_layers=[0, 1], device=device.name)
    args.update(kw)
    return rr.Replay(**args)


def routing(rows: int, layers: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, E, size=(rows, layers, K), dtype=np.int64)


def capture_request(replay, ids: np.ndarray, make_array) -> None:
    """Adds request "a" and captures `ids` [N, L, K] as its positions [0, N) in one step, each
    layer's [N, K] ids handed over as `make_array(ids)`."""
    replay.add_request("a")
    plan = rr.StepPlan()
    plan.schedule("a", 0, ids.shape[0])
    with replay.step(plan):
        for layer in range(ids.shape[1]):
            replay.capture(layer, make_array(ids[:, layer]))


def run_step(replay, device, runs, ids, layers=(0, 1), **capture_kw) -> rr.StepPlan:
    """One step: runs = [(id, first_position, num_tokens)], ids = [N, L, K] routing."""
    plan = rr.StepPlan()
    for rid, first, n in runs:
        plan.schedule(rid, first, n)
    with replay.step(plan):
        for i, layer in enumerate(layers):
            replay.capture(layer, device.array(ids[:, i, :]), **capture_kw)
    return plan


# ---- extraction --------------------------------------------------------------------------------


def test_extract_is_a_guarded_zero_copy_view(device):
    replay = make(device)
    replay.add_request("a", prompt_length=3)
    replay.add_request(7)
    ids = routing(5)
    run_step(replay, device, [("a", 0, 3), (7, 0, 2)], ids)
    second = routing(2, seed=1)
    run_step(replay, device, [(7, 2, 1), ("a", 3, 1)], second)
    a = replay.extract("a")
    np.testing.assert_array_equal(a, np.concatenate([ids[:3], second[1:2]]))
    np.testing.assert_array_equal(replay.extract(7), np.concatenate([ids[3:5], second[0:1]]))
    assert a.dtype == np.int16 and not a.flags.writeable and replay.live_views == 1  # 7's view is gone
    tail = a[2:]  # a derived view keeps the lease too
    del a
    with pytest.raises(BufferError, match="zero-copy"):
        replay.release("a")
    plan = rr.StepPlan()
    plan.schedule("a", 4, 1)
    with pytest.raises(BufferError):
        replay.begin_step(plan)
    with pytest.raises(BufferError):
        replay.abort("a")
    del tail
    assert replay.live_views == 0
    replay.release("a")
    replay.release(7)
    assert replay.num_requests == 0


def test_extract_options_and_copies(device):
    replay = make(device, num_model_layers=3, moe_layers=[0, 2])
    replay.add_request("a", prompt_length=2)
    ids = routing(4)
    run_step(replay, device, [("a", 0, 4)], ids, layers=(0, 2))
    owned = replay.extract("a", 1, 3, copy=True)
    assert owned.flags.writeable and replay.live_views == 0
    np.testing.assert_array_equal(owned, ids[1:3])
    dense = replay.extract("a", include_dense_layers=True)
    assert dense.shape == (4, 3, K) and dense.flags.writeable
    np.testing.assert_array_equal(dense[:, 0], ids[:, 0])
    np.testing.assert_array_equal(dense[:, 2], ids[:, 1])
    assert (dense[:, 1] == -1).all()
    assert replay.extract("a", 4).shape == (0, 2, K)
    with pytest.raises(rr.Error) as e:
        replay.extract("a", 0, 5)
    assert e.value.code == "position_out_of_range"
    assert replay.recorded_rows("a") == 4


def test_output_formats(device, tmp_path):
    replay = make(device, index="int32", copy="double_buffered")
    replay.add_request("a")
    ids = routing(3)
    run_step(replay, device, [("a", 0, 3)], ids)
    want = ids.astype(np.int32)
    np.testing.assert_array_equal(np.load(io.BytesIO(replay.extract_npy("a"))), want)
    field = replay.extract_base64_npy("a")
    assert isinstance(field, str)
    np.testing.assert_array_equal(rr.from_base64_npy(field), want)
    replay.write_npy("a", tmp_path / "a.npy", 1)
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), want[1:])


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "int32", "uint32"])
def test_module_npy_helpers(tmp_path, dtype):
    a = np.arange(24).reshape(2, 3, 4).astype(dtype)
    np.testing.assert_array_equal(np.load(io.BytesIO(rr.to_npy(a))), a)
    assert np.load(io.BytesIO(rr.to_npy(a[0, 1]))).shape == (4,)
    np.testing.assert_array_equal(rr.from_base64_npy(rr.to_base64_npy(a)), a)
    rr.write_npy(tmp_path / "x.npy", a)
    assert np.load(tmp_path / "x.npy").dtype == a.dtype


def test_npy_refuses_wide_types():
    with pytest.raises(rr.Error) as e:
        rr.to_npy(np.zeros(3, dtype=np.int64))
    assert e.value.code == "invalid_argument"


# ---- inputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"])
def test_every_integer_source_dtype(device, dtype):
    replay = make(device, num_fused_shared_experts=1)
    ids = routing(3)

    def with_shared_column(layer_ids):
        source = np.full((3, K + 1), E + 5, dtype=dtype)  # the shared-expert column is skipped
        source[:, :K] = layer_ids
        return device.array(source)

    capture_request(replay, ids, with_shared_column)
    np.testing.assert_array_equal(replay.extract("a"), ids)


def test_row_offset_and_physical_to_logical(device):
    replay = make(device)
    replay.add_request("a")
    logical = routing(2)
    # both ranks' tokens in one router output; this rank's rows start at 3; ids are physical:
    # physical p holds logical p // 2 (each expert replicated twice)
    physical = np.zeros((6, 2, K), dtype=np.int64)
    physical[3:5] = logical * 2 + 1
    mapping = device.array((np.arange(2 * E) // 2).astype(np.int32))
    plan = rr.StepPlan()
    plan.schedule("a", 0, 2)
    with replay.step(plan):
        for layer in (0, 1):
            replay.capture(layer, device.array(physical[:, layer]), num_tokens=2, row_offset=3,
                           physical_to_logical=mapping)
    np.testing.assert_array_equal(replay.extract("a"), logical)
    with pytest.raises(ValueError):
        replay.capture(0, device.array(physical[:, 0]), num_tokens=4, row_offset=3)


def test_strided_rows(device):
    replay = make(device)
    ids = routing(4)

    def column_window(layer_ids):  # a window of a wider array: row stride K + 3
        wide = np.full((4, K + 3), 99, dtype=np.int64)
        wide[:, :K] = layer_ids
        return device.array(wide)[:, :K]

    capture_request(replay, ids, column_window)
    np.testing.assert_array_equal(replay.extract("a"), ids)
    with pytest.raises(ValueError, match="overlap"):
        replay.capture(0, np.broadcast_to(np.zeros(K, dtype=np.int64), (3, K)))
    with pytest.raises(ValueError, match="columns"):
        replay.capture(0, np.zeros((3, 2 * K), dtype=np.int64)[:, ::2])


def test_capture_pointer(device):
    replay = make(device)
    replay.add_request("a")
    ids = routing(2)
    arrays = [device.array(ids[:, layer]) for layer in (0, 1)]
    plan = rr.StepPlan()
    plan.schedule("a", 0, 2)
    replay.begin_step(plan)
    for layer, a in enumerate(arrays):
        pointer = a.__array_interface__["data"][0] if device.backend == "host" else a.data_ptr()
        replay.capture_pointer(layer, pointer, "int64", 2, K)
    replay.end_step()
    np.testing.assert_array_equal(replay.extract("a"), ids)


class DLPackOnly:
    """An array that offers nothing but DLPack."""

    def __init__(self, a) -> None:
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_dlpack_input(device):
    replay = make(device)
    ids = routing(3)
    capture_request(replay, ids, lambda layer_ids: DLPackOnly(device.array(layer_ids)))
    np.testing.assert_array_equal(replay.extract("a"), ids)


class CudaArrayInterfaceOnly:
    """An array that offers nothing but __cuda_array_interface__ (as Numba or older CuPy)."""

    def __init__(self, t) -> None:
        self._t = t
        self.__cuda_array_interface__ = t.__cuda_array_interface__


@requires_cuda
def test_cuda_array_interface_input():
    import torch

    replay = rr.Replay(num_experts=E, top_k=K, max_tokens_per_step=8, max_model_len=32, moe_layers=[0, 1],
                       device="cuda")
    ids = routing(3)
    capture_request(replay, ids,
                    lambda layer_ids: CudaArrayInterfaceOnly(torch.from_numpy(layer_ids.astype(np.int32)).cuda()))
    np.testing.assert_array_equal(replay.extract("a"), ids)


@requires_cuda
def test_arrays_on_the_wrong_device():
    import torch

    cuda = rr.Replay(num_experts=E, top_k=K, max_tokens_per_step=8, max_model_len=32, moe_layers=[0], device="cuda")
    host = rr.Replay(num_experts=E, top_k=K, max_tokens_per_step=8, max_model_len=32, moe_layers=[0], device="cpu")
    with pytest.raises(ValueError, match="host backend"):
        host.capture(0, torch.zeros((1, K), dtype=torch.int64, device="cuda"))
    with pytest.raises(ValueError, match="buffers are on cuda"):
        cuda.capture(0, np.zeros((1, K), dtype=np.int64))


@pytest.mark.skipif("cuda" not in rr.backends(), reason="the CUDA backend module was not built")
def test_cuda_module_shares_the_classes():
    """The CUDA module returns classes _core binds, and its errors reach Python as rr.Error."""
    from routing_replay import _core_cuda

    plan = _core_cuda._cross_module_check()
    assert isinstance(plan, rr.StepPlan) and plan.num_rows == 3
    if not rr.cuda_available():
        expect_error("backend_error", rr.Replay, num_experts=E, top_k=K, max_tokens_per_step=8, max_model_len=32,
                     moe_layers=[0], device="cuda")


def test_host_capture_reads_the_array_during_the_call():
    stream = rr.HostStream()
    replay = rr.Replay(num_experts=E, top_k=K, max_tokens_per_step=8, max_model_len=32, moe_layers=[0, 1],
                       device="cpu", copy="async_event")
    replay.add_request("a")
    ids = routing(3)
    buffer = np.zeros((3, K), dtype=np.int64)  # one router output buffer reused by every layer
    plan = rr.StepPlan()
    plan.schedule("a", 0, 3)
    replay.begin_step(plan, stream)
    for layer in (0, 1):
        buffer[:] = ids[:, layer]
        replay.capture(layer, buffer, stream=stream)
    buffer[:] = 0
    replay.end_step(stream)
    np.testing.assert_array_equal(replay.extract("a"), ids)


def test_layer_view(device):
    for layout in ("layer_major", "token_major"):
        replay = make(device, layout=layout)
        replay.add_request("a")
        ids = routing(3)
        plan = rr.StepPlan()
        plan.schedule("a", 0, 3)
        with replay.step(plan):
            for layer in (0, 1):
                view = replay.layer_view(layer, 3)
                assert tuple(view.shape) == (3, K)
                if device.backend == "host":
                    assert view.strides[0] == (K if layout == "layer_major" else 2 * K) * 2
                    view[:] = ids[:, layer]
                else:
                    assert view.stride(0) == (K if layout == "layer_major" else 2 * K)
                    view.copy_(device.array(ids[:, layer].astype(np.int16)))
        np.testing.assert_array_equal(replay.extract("a"), ids)


# ---- errors ------------------------------------------------------------------------------------


def expect_error(code: str, f, *args, **kw):
    with pytest.raises(rr.Error) as e:
        f(*args, **kw)
    assert e.value.code == code, str(e.value)
    assert isinstance(e.value, RuntimeError)
    return e.value


def test_errors(device):
    replay = make(device)
    expect_error("unknown_request", replay.extract, "nobody")
    replay.add_request("a")
    expect_error("duplicate_request", replay.add_request, "a")
    expect_error("unknown_layer", replay.capture, 5, device.array(np.zeros((1, K), dtype=np.int64)))
    plan = rr.StepPlan()
    plan.schedule("a", 0, 9)
    expect_error("too_many_tokens", replay.begin_step, plan)

    plan = rr.StepPlan()
    plan.schedule("a", 0, 2)
    bad = routing(2)
    bad[1, 0, 1] = E + 3
    replay.begin_step(plan)
    replay.capture(0, device.array(bad[:, 0]))
    replay.capture(1, device.array(bad[:, 1]))
    error = expect_error("invalid_expert_id", replay.end_step)
    assert str(E + 3) in str(error) and "'a'" in str(error)
    assert replay.recorded_rows("a") == 0

    replay.begin_step(plan)
    replay.capture(0, device.array(routing(2)[:, 0]))
    expect_error("missing_routing", replay.end_step)

    with pytest.raises(KeyError):  # the body's exception wins; the step is still closed
        with replay.step(plan):
            raise KeyError("forward failed")
    run_step(replay, device, [("a", 0, 2)], routing(2))
    assert replay.recorded_rows("a") == 2


def test_construction_errors(device):
    expect_error("index_type_too_narrow", make, device, index="uint8", num_experts=300,
                 copy="double_buffered")
    expect_error("invalid_config", make, device, top_k=0)
    with pytest.raises(ValueError, match="layout must be"):
        make(device, layout="column_major")
    with pytest.raises(ValueError, match="copy must be"):
        make(device, copy="sometimes")
    with pytest.raises(rr.Error, match="takes no copy stream"):
        make(device, copy_stream=rr.HostStream() if device.backend == "host" else 0)


def test_drafts(device):
    replay = make(device)
    replay.add_request("a")
    plan = rr.StepPlan()
    plan.schedule("a", 0, 3, num_draft_tokens=2)
    ids = routing(3)
    with replay.step(plan):
        for layer in (0, 1):
            replay.capture(layer, device.array(ids[:, layer]))
    expect_error("draft_error", replay.extract, "a")
    replay.accept_draft("a", 1)
    np.testing.assert_array_equal(replay.extract("a"), ids[:2])
    expect_error("draft_error", replay.accept_draft, "a", 1)


def test_plan_from_positions():
    plan = rr.StepPlan()
    plan.schedule_positions(["a", 3], [2, 1], np.array([5, 6, 9], dtype=np.int64))
    assert plan.num_rows == 3 and len(plan) == 2
    with pytest.raises(rr.Error) as e:
        rr.StepPlan().schedule_positions(["a"], [2], [5, 7])
    assert e.value.code == "invalid_plan" and "consecutive" in str(e.value)
    with pytest.raises(TypeError):
        rr.StepPlan().schedule(1.5, 0, 1)


# ---- block-slot storage ------------------------------------------------------------------------


def test_handles_schedule_columnar_plans(device):
    """add_request returns a handle; a columnar plan of handles files exactly what a plan of ids
    does; a handle outlives its request only as a refused value; errors name the request's id."""
    by_id, by_handle = make(device), make(device)
    handles = {}
    for rid in ("a", 7, "b"):
        by_id.add_request(rid)
        handles[rid] = by_handle.add_request(rid)
        assert by_handle.handle(rid) == handles[rid]
    assert len(set(handles.values())) == 3
    steps = [[("a", 0, 3), (7, 0, 2), ("b", 0, 1)], [(7, 2, 1), ("b", 1, 2), ("a", 3, 1)]]
    for s, runs in enumerate(steps):
        ids = routing(sum(n for _, _, n in runs), seed=s)
        run_step(by_id, device, runs, ids)
        plan = rr.StepPlan()
        plan.schedule_handles(np.array([handles[r] for r, _, _ in runs], dtype=np.uint64),
                              np.array([p for _, p, _ in runs]), [n for _, _, n in runs])
        assert plan.num_rows == ids.shape[0] and len(plan) == len(runs)
        with by_handle.step(plan):
            for layer in range(2):
                by_handle.capture(layer, device.array(ids[:, layer, :]))
    for rid in handles:
        np.testing.assert_array_equal(by_handle.extract(rid, copy=True), by_id.extract(rid, copy=True))
    # a zero-copy view guards its request against a plan that names it by handle, too
    view = by_handle.extract("a")
    plan = rr.StepPlan()
    plan.schedule_handles([handles["a"]], [4], [1])
    with pytest.raises(BufferError):
        by_handle.begin_step(plan)
    del view
    # errors name the request by its id
    plan.clear()
    plan.schedule_handles([handles["b"]], [40], [1])
    with pytest.raises(rr.Error) as e:
        by_handle.begin_step(plan)
    assert e.value.code == "position_out_of_range" and "'b'" in str(e.value)
    # a released request's handle is refused, also once its index serves a new request
    by_handle.release("a")
    fresh = by_handle.add_request("c")
    assert fresh != handles["a"]
    plan.clear()
    plan.schedule_handles([handles["a"]], [4], [1])
    with pytest.raises(rr.Error) as e:
        by_handle.begin_step(plan)
    assert e.value.code == "unknown_request"
    # columns of different lengths, and bad counts
    with pytest.raises(rr.Error) as e:
        rr.StepPlan().schedule_handles([fresh], [0, 1], [1])
    assert e.value.code == "invalid_plan"
    with pytest.raises(rr.Error):
        rr.StepPlan().schedule_handles([fresh], [0], [-1])
    with pytest.raises(TypeError):
        rr.StepPlan().schedule_handles([fresh], [0.5], [1])


def test_columnar_plan_dtypes(host):
    """Columns read in place (contiguous 64-bit handles and positions, 32- or 64-bit counts) and
    columns converted (other widths, strided views, sequences) give the same plan; bad counts are
    refused with their value, whatever the column's dtype."""
    firsts = np.zeros(6, dtype=np.int64)
    counts = np.array([1, 2, 3, 1, 2, 3], dtype=np.int64)
    ways = [
        lambda h: (h, firsts, counts),
        lambda h: (h.astype(np.int64), firsts, counts.astype(np.int32)),
        lambda h: (h, firsts.astype(np.int32), counts.astype(np.uint32)),
        lambda h: (np.repeat(h, 2)[::2], np.repeat(firsts, 2)[::2], np.repeat(counts.astype(np.int32), 2)[::2]),
        lambda h: (h.tolist(), firsts.tolist(), counts.astype(np.int16)),
    ]
    ids = routing(12)
    for way in ways:
        replay = make(host, max_tokens_per_step=16)
        handles = np.array([replay.add_request(r) for r in range(6)], dtype=np.uint64)
        plan = rr.StepPlan()
        plan.schedule_handles(*way(handles))
        assert len(plan) == 6 and plan.num_rows == 12
        with replay.step(plan):
            for layer in range(2):
                replay.capture(layer, host.array(ids[:, layer, :]))
        row = 0
        for r in range(6):
            np.testing.assert_array_equal(replay.extract(r, copy=True), ids[row:row + counts[r]])
            row += counts[r]
    for bad in (np.array([-1], dtype=np.int32), np.array([-1], dtype=np.int64), np.array([1 << 31], dtype=np.uint32),
                np.array([1 << 40], dtype=np.int64)):
        with pytest.raises(rr.Error) as e:
            rr.StepPlan().schedule_handles(np.zeros(1, dtype=np.uint64), firsts[:1], bad)
        assert e.value.code == "invalid_plan" and str(int(bad[0])) in str(e.value)


def test_block_transfers_and_prefix_hits(device):
    replay = make(device, storage="block_slot", block_size=2, num_blocks=8, copy="double_buffered")
    replay.add_request("a")
    ids = routing(4)
    plan = rr.StepPlan()
    plan.schedule("a", 0, 4, slots=[4, 5, 2, 3])  # blocks 2 and 1
    plan.add_fresh_blocks([2, 1])
    with replay.step(plan):
        for layer in (0, 1):
            replay.capture(layer, device.array(ids[:, layer]))
    exported = replay.export_blocks([2, 1])
    np.testing.assert_array_equal(exported, ids)
    replay.release("a")
    replay.add_request("b", cached_slots=[4, 5, 2])  # a prefix hit on a's blocks
    np.testing.assert_array_equal(replay.extract("b"), ids[:3])
    replay.copy_blocks([2], [6])
    np.testing.assert_array_equal(replay.export_blocks([6]), ids[:2])
    replay.import_blocks([7], exported[2:4])
    replay.add_request("c", cached_slots=[14, 15])
    np.testing.assert_array_equal(replay.extract("c"), ids[2:4])
    per_request = make(device)
    expect_error("invalid_argument", per_request.export_blocks, [0])


# ---- streams, lifetime, module -----------------------------------------------------------------


def test_host_streams_and_events():
    copy_stream = rr.HostStream()
    replay = rr.Replay(num_experts=E, top_k=K, max_tokens_per_step=8, max_model_len=32, moe_layers=[0],
                       device="cpu", copy="double_buffered", copy_stream=copy_stream)
    compute = rr.HostStream()
    event = rr.HostEvent()
    for step in range(4):
        replay.add_request(step)
        plan = rr.StepPlan()
        plan.schedule(step, 0, 1)
        replay.begin_step(plan, compute)
        replay.capture(0, np.array([[step, step + 1]]), stream=compute)
        replay.end_step(compute)
    event.record(compute)
    event.synchronize()
    assert event.ready()
    compute.synchronize()
    replay.drain()
    assert replay.steps_in_flight == 0
    np.testing.assert_array_equal(replay.extract(3), [[[3, 4]]])
    with pytest.raises(TypeError):
        replay.end_step(stream=0)
    del replay  # waits for its streams; the copy stream outlives it
    copy_stream.synchronize()


def test_destroyed_with_work_in_flight(device):
    for copy in ("sync", "double_buffered", "device_scatter"):
        storage = "block_slot" if copy == "device_scatter" else "per_request"
        replay = make(device, copy=copy, storage=storage, block_size=4, num_blocks=4)
        replay.add_request("a")
        plan = rr.StepPlan()
        plan.schedule("a", 0, 2, slots=[0, 1] if storage == "block_slot" else None)
        replay.begin_step(plan)
        for layer in (0, 1):
            replay.capture(layer, device.array(routing(2)[:, layer]))
        replay.end_step()
        replay.capture(0, device.array(routing(2)[:, 0]))  # outside any step: a warm-up
        del replay
    device.synchronize()


def test_module_information(device):
    assert "host" in rr.backends()
    assert rr.sentinel("int16") == -1 and rr.sentinel("uint8") == 255 and rr.sentinel("uint16") == 65535
    replay = make(device, index="uint8", copy="double_buffered")
    assert replay.sentinel == 255 and replay.index_dtype == np.uint8
    assert replay.device_bytes == 8 * 2 * K
    assert replay.snapshot_bytes == 2 * replay.device_bytes
    assert replay.layer_slot(1) == 1 and replay.num_layers == 2 and replay.top_k == K
    assert replay.config.max_model_len == 32
    assert "uint8" in repr(replay)
    assert replay.backend == device.backend
    assert replay.device == ("cpu" if device.backend == "host" else "cuda:0")
    replay.add_request("a")
    assert "a" in replay and "b" not in replay
    run_step(replay, device, [("a", 0, 3)], routing(3))
    replay.drain()
    assert replay.host_bytes >= 3 * 2 * K


@pytest.mark.parametrize("storage", ["per_request", "block_slot"])
def test_wait_for_host_memory_ahead(device, storage):
    """Returns once the rows kept ahead are ready (at once for block_slot and without any kept
    ahead); the steps after it work as before."""
    kw = dict(storage=storage, block_size=4, num_blocks=16) if storage == "block_slot" else dict(storage=storage)
    for ahead in (0, 1 << 20):
        replay = make(device, host_memory_ahead=ahead, **kw)
        replay.wait_for_host_memory_ahead()
        ids = routing(3)
        replay.add_request("a")
        plan = rr.StepPlan()
        plan.schedule("a", 0, 3, 0, [0, 1, 2] if storage == "block_slot" else None)
        with replay.step(plan):
            for layer in range(2):
                replay.capture(layer, device.array(ids[:, layer]))
        replay.drain()
        np.testing.assert_array_equal(replay.extract("a", copy=True).astype(np.int64), ids)
