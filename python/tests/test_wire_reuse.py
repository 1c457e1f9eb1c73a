"""routing_replay.wire.encode keeps one encoder per thread between calls and packs a packed record
straight into the bytes object it returns: every record must be the one a fresh encoder makes,
whatever came before it on the thread (other shapes, codecs, layer maps and first positions, a
record with missing rows, a call that was refused half way) and on other threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from routing_replay import wire

from test_wire import make_rows


def check(record, rows, E, *, token_start=0, layer_map=None, ordered=True, missing=()):
    head = wire.info(record)
    wire.verify(record)
    assert head["token_start"] == token_start and head["num_tokens"] == len(rows) and head["num_experts"] == E
    assert head["layer_map"] == (list(range(rows.shape[1])) if layer_map is None else list(layer_map))
    assert head["missing_rows"] == len(missing)
    out = wire.decode(record)
    want = rows if ordered else np.sort(rows, axis=2)
    present = np.setdiff1d(np.arange(len(rows)), np.asarray(missing, dtype=np.int64))
    np.testing.assert_array_equal(out[present], want[present])
    for t in missing:
        assert (out[t] == np.iinfo(out.dtype).max).all() or (out[t] == -1).all()


def test_a_sequence_of_records_on_one_thread():
    shapes = [(48, 8, 128), (94, 8, 128), (48, 8, 128), (60, 8, 384), (48, 10, 512)]
    seen = {}
    for i, (L, K, E) in enumerate(shapes * 2):
        for T in (0, 1, 255, 256, 257, 600, 1024):
            rows = make_rows(T, L, K, E, seed=i * 31 + T, persist=0.3)
            for codec in wire.CODECS:
                record = wire.encode(rows, E, token_start=T + i, codec=codec)
                check(record, rows, E, token_start=T + i)
                key = (L, K, E, T, codec, T + i, i % len(shapes))
                if key in seen:  # the same call again, after other calls: the same bytes
                    assert seen[key] == record
                seen[key] = record
            lmap = list(range(2 * L - 1, -1, -2))
            record = wire.encode(rows, E, token_start=7, layer_map=lmap)
            check(record, rows, E, token_start=7, layer_map=lmap)
            record = wire.encode(rows, E)  # the layer map and first position of the previous call do not stay
            check(record, rows, E)


def test_packed_in_place_matches_the_copying_path():
    # zstd of random routing keeps every chunk packed: the same payload through the encoder's own
    # buffers; the records differ only in the codec byte of the header and the chunk index
    if "zstd" not in wire.CODECS:
        pytest.skip("this build has no zstd (wire.CODECS lacks it)")
    L, K, E = 48, 8, 128
    rows = make_rows(700, L, K, E, seed=3, persist=0.0)
    packed = wire.encode(rows, E, codec="packed")
    copied = wire.encode(rows, E, codec="zstd")
    assert wire.info(copied)["chunk_codecs"] == ["packed"] * 3
    head = wire.info(packed)
    start = len(packed) - head["payload_bytes"]
    assert len(packed) == len(copied) and packed[start:] == copied[start:]


@pytest.mark.parametrize("ordered", [True, False])
def test_missing_rows_leave_the_in_place_path(ordered):
    L, K, E = 48, 8, 128
    for T, missing in [(600, (0,)), (600, (599,)), (600, (255, 256, 300)), (256, (100,)), (1, (0,))]:
        rows = make_rows(T, L, K, E, seed=T + len(missing), persist=0.0)
        holes = rows.copy()
        holes[list(missing)] = -1
        record = wire.encode(holes, E, token_start=5, ordered=ordered)
        check(record, rows, E, token_start=5, ordered=ordered, missing=missing)
        record = wire.encode(rows, E, token_start=5, ordered=ordered)  # and the next record has none
        check(record, rows, E, token_start=5, ordered=ordered)


def test_a_refused_call_leaves_nothing_behind():
    L, K, E = 48, 8, 128
    rows = make_rows(600, L, K, E, seed=9)
    bad = rows.copy()
    bad[400, 3, 2] = E  # refused after the first chunk is packed
    partly = rows.copy()
    partly[500, :2] = -1  # a row only partly missing
    for codec in wire.CODECS:
        with pytest.raises(Exception, match="expert id"):
            wire.encode(bad, E, codec=codec)
        with pytest.raises(Exception, match="partly missing"):
            wire.encode(partly, E, codec=codec)
        record = wire.encode(rows, E, token_start=3, codec=codec)
        check(record, rows, E, token_start=3)
        assert record == wire.encode(rows, E, token_start=3, codec=codec)
    with pytest.raises(Exception):
        wire.encode(rows, E, token_start=-1)
    check(wire.encode(rows, E), rows, E)


def test_threads_keep_their_own_encoder():
    shapes = [(48, 8, 128), (58, 8, 256), (60, 8, 384)]
    inputs = [make_rows(300 + 50 * i, *shape, seed=i) for i, shape in enumerate(shapes)]
    want = [wire.encode(rows, shape[2], token_start=i) for i, (rows, shape) in enumerate(zip(inputs, shapes))]
    errors = []

    def work(i):
        try:
            for n in range(30):
                j = (i + n) % len(shapes)
                got = wire.encode(inputs[j], shapes[j][2], token_start=j)
                if got != want[j]:
                    errors.append((i, n, j))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
