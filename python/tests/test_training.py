"""routing_replay.training (numpy only): every layout, rule, map and split against a plain-loop
reference written here, on randomized inputs, and every error path."""

from __future__ import annotations

import base64
import io
import pathlib

import numpy as np
import pytest

import routing_replay as rr
from routing_replay import training as tr

L, K, E = 5, 3, 40


def routing(rng, rows: int, layers: int = L, dtype=np.int16) -> np.ndarray:
    """Random routing [rows, layers, K]: distinct valid ids per row."""
    out = np.empty((rows, layers, K), dtype=dtype)
    for t in range(rows):
        for layer in range(layers):
            out[t, layer] = rng.choice(E, size=K, replace=False)
    return out


def sentinel_row(dtype) -> np.ndarray:
    return np.full((L, K), -1 if np.dtype(dtype).kind == "i" else np.iinfo(dtype).max, dtype=dtype)


def ref_complete(r: np.ndarray, n: int, rule: str) -> np.ndarray:
    rows = [r[t] for t in range(len(r))]
    if len(rows) == n - 1:
        rows.append(sentinel_row(r.dtype) if rule == "sentinel" else rows[-1])
    return np.array(rows, dtype=r.dtype).reshape((n,) + r.shape[1:])


def ref_pad(rule: str, dtype) -> np.ndarray:
    if rule == "sentinel":
        return sentinel_row(dtype)
    return np.array([[k for k in range(K)] for _ in range(L)], dtype=dtype)


# ---- sources --------------------------------------------------------------------------------------

def test_load_routing_every_source(tmp_path):
    rng = np.random.default_rng(1)
    a = routing(rng, 7)
    field = rr.to_base64_npy(a)
    buf = io.BytesIO()
    np.save(buf, a)
    rr.write_npy(tmp_path / "r.npy", a)
    for source in (a, a.tolist(), field, buf.getvalue(), pathlib.Path(tmp_path / "r.npy")):
        got = tr.load_routing(source)
        assert np.array_equal(got, a)
    assert tr.load_routing(field).dtype == np.int16


def test_load_routing_errors(tmp_path):
    with pytest.raises(ValueError, match="base64"):
        tr.load_routing(str(tmp_path / "r.npy"))  # a path as str is not read as a file
    with pytest.raises(ValueError, match=r"\[rows, layers, top_k\]"):
        tr.load_routing(np.zeros((3, 4), dtype=np.int16))
    with pytest.raises(TypeError, match="integers"):
        tr.load_routing(np.zeros((3, 4, 2), dtype=np.float32))
    field = base64.b64encode(b"not an npy file").decode()
    with pytest.raises(ValueError):
        tr.load_routing(field)


# ---- final-token rule -----------------------------------------------------------------------------

@pytest.mark.parametrize("rule", ["sentinel", "repeat"])
@pytest.mark.parametrize("dtype", [np.int16, np.uint8, np.int32])
def test_complete_rows(rule, dtype):
    rng = np.random.default_rng(2)
    for n in (1, 2, 9):
        full = routing(rng, n, dtype=dtype)
        assert tr.complete_rows(full, n, final_token=rule) is full
        if rule == "repeat" and n == 1:
            continue
        short = full[:-1]
        assert np.array_equal(tr.complete_rows(short, n, final_token=rule), ref_complete(short, n, rule))


def test_complete_rows_errors():
    r = routing(np.random.default_rng(3), 6)
    with pytest.raises(ValueError, match="'chat-1': 6 rows of routing for 7 tokens.*refuse"):
        tr.complete_rows(r, 7, final_token="refuse", request="chat-1")
    for n in (5, 8, 100):
        with pytest.raises(ValueError, match=f"'chat-1': 6 rows of routing for {n} tokens"):
            tr.complete_rows(r, n, final_token="repeat", request="chat-1")
    with pytest.raises(ValueError, match="final_token must be one of"):
        tr.complete_rows(r, 7, final_token="drop")
    with pytest.raises(ValueError, match="no routing rows to repeat"):
        tr.complete_rows(r[:0], 1, final_token="repeat")
    assert np.array_equal(tr.complete_rows(r[:0], 1, final_token="sentinel"), sentinel_row(np.int16)[None])


# ---- dtype conversion -----------------------------------------------------------------------------

def test_convert_carries_the_sentinel_and_refuses_narrowing():
    a = np.array([[[3, 255], [0, 254]]], dtype=np.uint8)
    b = tr.convert(a, np.int32)
    assert b.tolist() == [[[3, -1], [0, 254]]]
    assert tr.convert(b, np.uint8).tolist() == a.tolist()
    assert tr.convert(b, np.int64).dtype == np.int64
    assert tr.convert(a, np.uint8) is a
    with pytest.raises(OverflowError, match="do not fit int8"):
        tr.convert(b, np.int8)
    with pytest.raises(OverflowError, match="do not fit uint8"):
        tr.convert(np.array([[[255]]], dtype=np.int16), np.uint8)  # 255 would read as uint8's sentinel
    with pytest.raises(TypeError):
        tr.convert(a, np.float32)
    with pytest.raises(TypeError):
        tr.sentinel_of(np.float32)
    assert tr.sentinel_of(np.uint16) == 65535 and tr.sentinel_of(np.int64) == -1


# ---- padded batches -------------------------------------------------------------------------------

def random_batch(rng, b: int, width: int, side: str):
    lengths = rng.integers(1, width + 1, size=b)
    mask = np.zeros((b, width), dtype=np.int64)
    for i, n in enumerate(lengths):
        if side == "left":
            mask[i, width - n:] = 1
        else:
            mask[i, :n] = 1
    return lengths, mask


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("rule", ["sentinel", "repeat"])
@pytest.mark.parametrize("pad_rows", tr.PAD_ROWS)
def test_padded_batch(side, rule, pad_rows):
    rng = np.random.default_rng(4)
    for _ in range(5):
        lengths, mask = random_batch(rng, int(rng.integers(1, 6)), 11, side)
        short = [bool(rng.integers(2)) and n > 1 for n in lengths]
        reqs = [routing(rng, int(n) - s) for n, s in zip(lengths, short)]
        sources = [r if i % 3 else rr.to_base64_npy(r) for i, r in enumerate(reqs)]
        got = tr.padded_batch(sources, mask, final_token=rule, pad_rows=pad_rows)
        want = np.empty((len(reqs), mask.shape[1], L, K), dtype=np.int16)
        for b, r in enumerate(reqs):
            full = ref_complete(r, int(lengths[b]), rule)
            t = 0
            for s in range(mask.shape[1]):
                if mask[b, s]:
                    want[b, s] = full[t]
                    t += 1
                else:
                    want[b, s] = ref_pad(pad_rows, np.int16)
        assert np.array_equal(got, want)


def test_padded_batch_dtype_and_errors():
    rng = np.random.default_rng(5)
    mask = np.array([[0, 1, 1], [1, 1, 1]])
    reqs = [routing(rng, 2, dtype=np.uint8), routing(rng, 3, dtype=np.uint8)]
    out = tr.padded_batch(reqs, mask, final_token="refuse", dtype="int64")
    assert out.dtype == np.int64 and out[0, 0].tolist() == sentinel_row(np.int64).tolist()
    assert tr.padded_batch(reqs, mask, final_token="refuse").dtype == np.uint8
    with pytest.raises(ValueError, match="request 'a': 3 rows of routing for 2 tokens"):
        tr.padded_batch([reqs[1], reqs[0]], mask, final_token="refuse", request_ids=["a", "b"])
    with pytest.raises(ValueError, match="request 'b': 2 rows of routing for 3 tokens.*refuse"):
        tr.padded_batch([reqs[0], reqs[0]], mask, final_token="refuse", request_ids=["a", "b"])
    with pytest.raises(ValueError, match="request 1: 1 rows of routing for 3 tokens"):
        tr.padded_batch([reqs[0], reqs[0][:1]], mask, final_token="repeat")
    with pytest.raises(ValueError, match="2 routing arrays for a batch of 3"):
        tr.padded_batch(reqs, np.ones((3, 3)), final_token="repeat")
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        tr.padded_batch(reqs, np.ones(3), final_token="repeat")
    with pytest.raises(ValueError, match=r"request 1: routing of \[layers, top_k\] = \[4, 3\]"):
        tr.padded_batch([reqs[0], routing(rng, 3, layers=4)], mask, final_token="refuse")
    with pytest.raises(ValueError, match="pad_rows"):
        tr.padded_batch(reqs, mask, final_token="refuse", pad_rows="zeros")
    with pytest.raises(ValueError, match="1 request ids for 2"):
        tr.padded_batch(reqs, mask, final_token="refuse", request_ids=["a"])
    with pytest.raises(ValueError, match="empty"):
        tr.padded_batch([], np.ones((0, 3)), final_token="refuse")
    with pytest.raises(OverflowError):
        tr.padded_batch([np.full((3, L, K), 300, dtype=np.int16)] * 2, np.ones((2, 3)), final_token="repeat",
                        dtype="int8")


# ---- packed batches -------------------------------------------------------------------------------

@pytest.mark.parametrize("align", [1, 2, 4, 6])
@pytest.mark.parametrize("pad_rows", tr.PAD_ROWS)
def test_packed_batch(align, pad_rows):
    rng = np.random.default_rng(6 + align)
    for _ in range(5):
        lengths = [int(n) for n in rng.integers(1, 14, size=int(rng.integers(1, 6)))]
        reqs = [routing(rng, n - (n > 1 and bool(rng.integers(2)))) for n in lengths]
        got = tr.packed_batch(reqs, lengths, final_token="repeat", align=align, pad_rows=pad_rows)
        rows, cu, cu_pad = [], [0], [0]
        for r, n in zip(reqs, lengths):
            full = ref_complete(r, n, "repeat")
            for t in range(n):
                rows.append(full[t])
            while len(rows) % align if align > 1 else False:
                rows.append(ref_pad(pad_rows, np.int16))
            cu.append(cu[-1] + n)
            cu_pad.append(len(rows))
        assert np.array_equal(got.routing, np.array(rows))
        assert got.cu_seqlens.dtype == np.int32 and got.cu_seqlens.tolist() == cu
        assert got.cu_seqlens_padded.tolist() == cu_pad


def test_packed_batch_errors():
    rng = np.random.default_rng(7)
    with pytest.raises(ValueError, match="align"):
        tr.packed_batch([routing(rng, 2)], [2], final_token="refuse", align=0)
    with pytest.raises(ValueError, match="request 'x': 2 rows of routing for 4 tokens"):
        tr.packed_batch([routing(rng, 2)], [4], final_token="sentinel", request_ids=["x"])
    with pytest.raises(ValueError, match="1 routing arrays for a batch of 2"):
        tr.packed_batch([routing(rng, 2)], [2, 3], final_token="refuse")


# ---- layer maps -----------------------------------------------------------------------------------

def test_layer_map_take():
    rng = np.random.default_rng(8)
    num_layers, moe = 9, [0, 2, 3, 5, 8]
    lm = tr.LayerMap(moe, num_layers)
    r = routing(rng, 4, layers=len(moe))
    # all layers, dense as the sentinel, by a plain loop
    all_layers = np.empty((4, num_layers, K), dtype=np.int16)
    for t in range(4):
        for layer in range(num_layers):
            all_layers[t, layer] = r[t, moe.index(layer)] if layer in moe else -1
    assert np.array_equal(lm.take(r, "all"), all_layers)
    assert np.array_equal(lm.take(all_layers, "moe"), r)
    assert np.array_equal(lm.take(r, "moe"), r)
    assert np.array_equal(lm.take(all_layers, "all"), all_layers)
    stage = [3, 4, 5]
    assert np.array_equal(lm.take(r, stage), all_layers[:, stage])
    assert lm.moe_in(stage) == [3, 5] and lm.is_moe(8) and not lm.is_moe(1)
    assert np.array_equal(lm.take(r, lm.moe_in(stage)), r[:, [2, 3]])
    batch = np.stack([r, r[::-1]])  # [B, S, L, K]
    assert np.array_equal(lm.take(batch, "all"), np.stack([all_layers, all_layers[::-1]]))
    u8 = lm.take(r.astype(np.uint8), "all")
    assert (u8[:, 1] == 255).all()
    with pytest.raises(ValueError, match="has 4 layers on axis -2"):
        lm.take(r[:, :4], "moe")
    with pytest.raises(ValueError, match="outside the model's 9 layers"):
        lm.take(r, [9])
    with pytest.raises(ValueError, match="'moe', 'all'"):
        lm.take(r, "dense")
    with pytest.raises(ValueError, match="repeat"):
        tr.LayerMap([1, 1], 3)
    with pytest.raises(ValueError, match="outside"):
        tr.LayerMap([3], 3)


def ref_pipeline_layers(num_layers, pp, rank, vpp, vrank, first=None, last=None):
    """Counts per stage, then walks chunks in the interleaved order (v outer, p inner)."""
    counts = []
    for p in range(pp):
        if p == 0 and first is not None:
            counts.append(first)
        elif p == pp - 1 and last is not None:
            counts.append(last)
        else:
            middle = pp - (first is not None) - (last is not None)
            counts.append((num_layers - (first or 0) - (last or 0)) // middle)
    layer = 0
    for v in range(vpp):
        for p in range(pp):
            chunk = list(range(layer, layer + counts[p] // vpp))
            layer += counts[p] // vpp
            if (v, p) == (vrank, rank):
                return chunk


def test_pipeline_layers():
    for pp, vpp, num_layers, first, last in [(1, 1, 6, None, None), (2, 1, 8, None, None), (4, 2, 16, None, None),
                                             (3, 2, 12, None, None), (4, 1, 10, 1, 3), (3, 2, 14, 2, 4),
                                             (2, 1, 7, 3, None), (2, 3, 12, None, 6)]:
        seen = []
        for p in range(pp):
            for v in range(vpp):
                got = tr.pipeline_layers(num_layers, pp, p, vpp if vpp > 1 else None, v if vpp > 1 else None,
                                         first_stage_layers=first, last_stage_layers=last)
                assert got == ref_pipeline_layers(num_layers, pp, p, vpp, v, first, last), (pp, vpp, p, v)
                seen += got
        assert sorted(seen) == list(range(num_layers))
    with pytest.raises(ValueError, match="do not split evenly over 3 pipeline stages"):
        tr.pipeline_layers(10, 3, 0)
    with pytest.raises(ValueError, match="virtual stages"):
        tr.pipeline_layers(12, 2, 0, 4, 0)
    with pytest.raises(ValueError, match="outside a pipeline"):
        tr.pipeline_layers(12, 2, 2)
    with pytest.raises(ValueError, match="outside 2 virtual"):
        tr.pipeline_layers(12, 2, 0, 2, 2)
    with pytest.raises(ValueError, match="without vpp_size"):
        tr.pipeline_layers(12, 2, 0, None, 1)
    with pytest.raises(ValueError, match="do not add up"):
        tr.pipeline_layers(12, 2, 0, first_stage_layers=5, last_stage_layers=5)


# ---- context and sequence parallel ----------------------------------------------------------------

def ref_cp_tokens(n: int, cp: int, rank: int) -> list[int]:
    """Token indices of one sequence of n tokens that CP rank `rank` holds."""
    c = n // (2 * cp)
    return [t for t in range(n) if t // c == rank] + [t for t in range(n) if t // c == 2 * cp - 1 - rank]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_context_parallel_padded(cp):
    rng = np.random.default_rng(9 + cp)
    b, s = 3, 2 * cp * 3
    x = routing(rng, b * s).reshape(b, s, L, K)
    parts = []
    for rank in range(cp):
        got = tr.context_parallel_split(x, cp, rank)
        want = np.stack([np.stack([x[i, t] for t in ref_cp_tokens(s, cp, rank)]) for i in range(b)])
        assert np.array_equal(got, want)
        parts.append(got)
    assert sum(p.shape[1] for p in parts) == s
    with pytest.raises(ValueError, match="2 \\* CP"):
        tr.context_parallel_split(x[:, :s - 1], cp, 0) if cp > 1 or (s - 1) % 2 else (_ for _ in ()).throw(
            ValueError("2 * CP"))


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_context_parallel_packed(cp):
    rng = np.random.default_rng(20 + cp)
    lengths = [int(n) for n in rng.integers(1, 20, size=4)]
    packed = tr.packed_batch([routing(rng, n) for n in lengths], lengths, final_token="refuse", align=2 * cp)
    cu = packed.cu_seqlens_padded
    all_tokens = []
    for rank in range(cp):
        got = tr.context_parallel_split(packed.routing, cp, rank, cu_seqlens_padded=cu)
        index = []
        for i in range(len(lengths)):
            index += [int(cu[i]) + t for t in ref_cp_tokens(int(cu[i + 1] - cu[i]), cp, rank)]
        assert np.array_equal(got, packed.routing[index])
        all_tokens += index
    assert sorted(all_tokens) == list(range(int(cu[-1])))


def test_context_parallel_errors():
    x = np.zeros((10, L, K), dtype=np.int16)
    with pytest.raises(ValueError, match="packed sequence 1 has 3 tokens, not a multiple of 2 \\* CP = 4"):
        tr.context_parallel_split(x, 2, 0, cu_seqlens_padded=[0, 4, 7, 10])
    with pytest.raises(ValueError, match="does not cover"):
        tr.context_parallel_split(x, 2, 0, cu_seqlens_padded=[0, 4, 8])
    with pytest.raises(ValueError, match="outside a context-parallel group"):
        tr.context_parallel_split(x, 2, 2)
    with pytest.raises(ValueError, match="sequence length 6 does not split into 2 \\* CP = 4"):
        tr.context_parallel_split(np.zeros((2, 6, L, K)), 2, 0)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sequence_parallel(tp):
    x = routing(np.random.default_rng(30), 8 * tp)
    for rank in range(tp):
        got = tr.sequence_parallel_split(x, tp, rank)
        assert np.array_equal(got, np.stack([x[t] for t in range(len(x)) if t // 8 == rank]))
    with pytest.raises(ValueError, match="do not split evenly over"):
        tr.sequence_parallel_split(x[:-1], tp, 0) if tp > 1 else (_ for _ in ()).throw(ValueError("do not split "
                                                                                                   "evenly over"))
    with pytest.raises(ValueError, match="outside a tensor-parallel group"):
        tr.sequence_parallel_split(x, tp, tp)


@pytest.mark.parametrize("cp,tp,sp", [(1, 1, False), (2, 1, False), (1, 2, True), (2, 2, True), (2, 4, False)])
def test_megatron_token_order(cp, tp, sp):
    """Reference: token (b, s) of the batch is router row s_local * B + b on the rank holding it."""
    rng = np.random.default_rng(40)
    b, s = 3, 2 * cp * tp * 2
    x = routing(rng, b * s).reshape(b, s, L, K)
    seen = 0
    for cr in range(cp):
        for tr_ in range(tp):
            got = tr.megatron_token_order(x, packed=False, cp_size=cp, cp_rank=cr, tp_size=tp, tp_rank=tr_,
                                          sequence_parallel=sp)
            local = ref_cp_tokens(s, cp, cr)
            if sp:
                local = local[tr_ * len(local) // tp:(tr_ + 1) * len(local) // tp]
            want = np.stack([x[i, t] for t in local for i in range(b)])
            assert np.array_equal(got, want)
            seen += len(got) if sp else len(got) / tp
    assert seen == b * s
    # packed: [N] tokens, b = 1
    lengths = [int(n) for n in rng.integers(1, 15, size=3)]
    packed = tr.packed_batch([routing(rng, n) for n in lengths], lengths, final_token="refuse", align=2 * cp * tp)
    for cr in range(cp):
        cp_part = tr.context_parallel_split(packed.routing, cp, cr, cu_seqlens_padded=packed.cu_seqlens_padded)
        for tr_ in range(tp):
            got = tr.megatron_token_order(packed.routing, packed=True, cu_seqlens_padded=packed.cu_seqlens_padded,
                                          cp_size=cp, cp_rank=cr, tp_size=tp, tp_rank=tr_, sequence_parallel=sp)
            n = len(cp_part)
            want = cp_part[tr_ * n // tp:(tr_ + 1) * n // tp] if sp else cp_part
            assert np.array_equal(got, want)
    with pytest.raises(ValueError, match="needs cu_seqlens_padded"):
        tr.megatron_token_order(packed.routing, packed=True, cp_size=2)
    with pytest.raises(ValueError, match=r"\[batch, seq, L, K\]"):
        tr.megatron_token_order(packed.routing, packed=False)
    with pytest.raises(ValueError, match=r"\[tokens, L, K\]"):
        tr.megatron_token_order(x, packed=True)


def test_to_torch():
    torch = pytest.importorskip("torch")
    a = np.array([[[3, 255]]], dtype=np.uint8)
    t = tr.to_torch(a)
    assert t.dtype == torch.int64 and t.tolist() == [[[3, -1]]]
    assert tr.to_torch(a, dtype="int32").dtype == torch.int32
    assert tr.to_torch(a, dtype=torch.int16).tolist() == [[[3, -1]]]
    with pytest.raises(ValueError, match="dtype is one of"):
        tr.to_torch(a, dtype="float32")
    with pytest.raises(OverflowError):
        tr.to_torch(np.array([[[300]]], dtype=np.int16), dtype="int8")
