"""The route record: one request's routing, compact and self-describing, from the engine to the
trainer (docs/wire.md).

A record holds ``[T, L, K]`` expert ids at ceil(log2 E) bits each, in chunks of 256 tokens, with its
shape, layer map, first position (``token_start``), missing rows (a validity bitmap) and checksums in
its header. A reader needs nothing else, and decodes any token range and layer range reading only
the chunks that range lies in::

    from routing_replay import wire
    record = wire.encode(rows, num_experts=128, token_start=1024)   # rows: any integer [T, L, K]
    wire.info(record)["num_tokens"]
    part = wire.decode(record, tokens=slice(1024 + 256, 1024 + 512), layers=slice(0, 12))

The engines' own fields convert both ways: :func:`from_vllm` / :func:`to_vllm` (vLLM 0.33's
``routed_experts``, base64 of an ``.npy``) and :func:`from_sglang` / :func:`to_sglang` (SGLang
0.5.23's base64 of raw int32, and the narrow-dtype wire that names ``routed_experts_dtype``).
Errors the record's code detects raise :class:`routing_replay.Error` (``code`` names the library's
errc value: ``invalid_record``, ``invalid_expert_id``, ...); malformed arguments raise ValueError or
TypeError naming what is wrong.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any, Iterable

import numpy as np

from . import _core
from ._wire import sentinel

_native = _core._wire

#: The codecs this build writes and reads: "packed" always; "zstd" and "zstd_columns" where the
#: package was built with libzstd.
CODECS: tuple[str, ...] = tuple(_native.CODECS)
#: The record format version written and read.
VERSION: int = int(_native.VERSION)

__all__ = ["CODECS", "VERSION", "encode", "decode", "info", "verify", "dtype_for", "from_vllm", "to_vllm",
           "from_sglang", "to_sglang"]


def dtype_for(num_experts: int) -> np.dtype:
    """The narrowest dtype that holds every id of ``num_experts`` experts and the sentinel of a
    missing row: uint8 up to 255 experts, uint16 up to 65535, int32 past that."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be at least 1, got {num_experts}")
    if num_experts <= 255:
        return np.dtype(np.uint8)
    if num_experts <= 65535:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def _record_array(record) -> np.ndarray:
    """The record's bytes as a uint8 array, without a copy (bytes, bytearray, memoryview, numpy)."""
    if isinstance(record, np.ndarray):
        return np.ascontiguousarray(record).view(np.uint8).reshape(-1)
    try:
        return np.frombuffer(record, dtype=np.uint8)
    except TypeError:
        raise TypeError(f"a route record is bytes-like, got {type(record).__name__}") from None


def encode(rows, num_experts: int, *, token_start: int = 0, layer_map: Iterable[int] | None = None,
           codec: str = "packed", ordered: bool = True, zstd_level: int = 3) -> bytes:
    """A route record of ``rows``, any integer ``[T, L, K]`` array (numpy, or anything
    ``numpy.asarray`` takes), read through its strides without a copy where its last axis is
    contiguous.

    A row (one token's ``[L, K]`` ids) whose ids all equal the sentinel of its dtype (-1 signed, the
    maximum unsigned: :func:`routing_replay.sentinel`) is missing, and the record marks it in its
    validity bitmap; a row only partly so is refused, naming it. (Where the sentinel is itself an
    expert id, as 255 is in uint8 rows of 256 experts, no row reads as missing.) Every other id must lie in
    ``[0, num_experts)``. ``layer_map``: the model layer of each captured layer (default 0 .. L-1).
    ``codec``: one of :data:`CODECS`. ``ordered=False`` stores each entry's K ids as a set (fewer
    bits; decode returns them ascending): only for consumers that need no top-k column order.
    """
    array = np.asarray(rows)
    if array.ndim != 3:
        raise ValueError(f"rows must be [T, L, K], got shape {array.shape}")
    if array.dtype.kind not in "iu":
        raise TypeError(f"rows must be integers, got dtype {array.dtype}")
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if array.shape[2] > 1 and array.strides[2] != array.itemsize:
        array = np.ascontiguousarray(array)
    if codec not in ("packed", "zstd", "zstd_columns"):
        raise ValueError(f"unknown codec {codec!r}: want one of packed, zstd, zstd_columns")
    if codec not in CODECS:
        raise ValueError(f"codec {codec!r} needs libzstd, which this build of routing_replay lacks (CODECS: {CODECS})")
    lmap = None if layer_map is None else [int(x) for x in layer_map]
    return _native.encode(array, int(num_experts), int(token_start), lmap, codec, bool(ordered), True, int(zstd_level))


def info(record) -> dict[str, Any]:
    """The header's fields of a record, after checking its header, layer map, chunk index, bitmap
    and their checksum: version, num_tokens, num_layers, top_k, num_experts, token_start,
    bits_per_id, entry_bits, ordered, codec, chunk_tokens, num_chunks, missing_rows, record_bytes,
    payload_bytes, layer_map, chunk_codecs (each chunk's codec: "packed" where compression did not
    shrink it). Raises :class:`routing_replay.Error` (``invalid_record``) for a bad record."""
    return _native.info(_record_array(record))


def verify(record) -> None:
    """Checks every chunk of a record too (checksum, frame, ids < E); raises like :func:`decode`."""
    _native.verify(_record_array(record))


def _range(sl, first: int, count: int, what: str) -> tuple[int, int]:
    """[begin, end) of a slice or range of step 1 over [first, first + count), made relative."""
    if sl is None:
        return 0, count
    if isinstance(sl, range):
        sl = slice(sl.start, sl.stop, sl.step)
    if not isinstance(sl, slice):
        raise TypeError(f"{what} must be a slice or a range, got {type(sl).__name__}")
    if sl.step not in (None, 1):
        raise ValueError(f"{what}: only step 1 is supported, got {sl.step}")
    begin = first if sl.start is None else int(sl.start)
    end = first + count if sl.stop is None else int(sl.stop)
    if not first <= begin <= end <= first + count:
        raise ValueError(f"{what} [{begin}, {end}) outside the record's [{first}, {first + count})")
    return begin - first, end - first


def decode(record, *, tokens=None, layers=None, out: np.ndarray | None = None, dtype=None) -> np.ndarray:
    """Decodes a record, or the part of it that ``tokens`` (a slice of positions, absolute: the
    first row is at ``token_start``) and ``layers`` (a slice of captured layers) select, reading
    only the chunks those rows lie in.

    Returns ``[tokens, layers, K]`` ids of :func:`dtype_for` ``(E)`` (or ``dtype``), or fills and
    returns ``out`` (any integer array of that shape whose last axis is contiguous). Missing rows
    read as the sentinel of the returned dtype. Order-free records give each entry's ids ascending.
    """
    buf = _record_array(record)
    head = _native.info(buf)
    t0, t1 = _range(tokens, head["token_start"], head["num_tokens"], "tokens")
    l0, l1 = _range(layers, 0, head["num_layers"], "layers")
    shape = (t1 - t0, l1 - l0, head["top_k"])
    if out is None:
        out = np.empty(shape, dtype=dtype_for(head["num_experts"]) if dtype is None else np.dtype(dtype))
    elif not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
    if out.dtype.kind not in "iu":
        raise TypeError(f"out must be an integer array, got dtype {out.dtype}")
    info_max = np.iinfo(out.dtype).max
    if head["num_experts"] - 1 > info_max:
        raise ValueError(f"dtype {out.dtype} cannot hold the ids of {head['num_experts']} experts")
    if head["missing_rows"] and out.dtype.kind == "u" and sentinel(out.dtype.str) < head["num_experts"]:
        raise ValueError(f"the record has {head['missing_rows']} missing rows, and dtype {out.dtype}'s sentinel "
                         f"{sentinel(out.dtype.str)} is an expert id of {head['num_experts']}: use a wider dtype")
    _native.decode_into(buf, out, t0, t1, l0, l1)
    return out


# ---- the engines' own fields ---------------------------------------------------------------------

def _b64decode(field, what: str) -> bytes:
    if isinstance(field, str):
        field = field.encode("ascii")
    try:
        return base64.b64decode(field, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{what} is not valid base64: {e}") from None


def _check_ids(rows: np.ndarray, num_experts: int, what: str) -> None:
    """Every id in [0, E), or the dtype's sentinel filling a whole row (a missing row)."""
    if rows.size == 0:
        return
    bad = (rows < 0) | (rows >= num_experts)
    if not bad.any():
        return
    if rows.dtype.kind in "iu":
        s = sentinel(rows.dtype.str)
        whole = (rows == s).all(axis=(1, 2))
        bad &= ~whole[:, None, None]
    if bad.any():
        t, l, k = (int(i[0]) for i in np.nonzero(bad))
        raise ValueError(f"{what}: row {t}, layer {l}, column {k}: expert id {int(rows[t, l, k])} outside "
                         f"[0, {num_experts})")


def from_vllm(field, num_experts: int, *, num_layers: int | None = None, top_k: int | None = None,
              token_start: int = 0, layer_map: Iterable[int] | None = None, codec: str = "packed",
              ordered: bool = True) -> bytes:
    """A route record of vLLM 0.33's ``routed_experts`` field: base64 of an ``.npy`` file holding
    ``[T, L, K]`` uint8 (E <= 256) or uint16 ids, as vLLM's serving layer writes it. ``num_layers``
    and ``top_k``, where given, are checked against the array's shape; so are the dtype (it must be
    vLLM's for ``num_experts``) and every id (< E). ``token_start``: the position of the first row
    (vLLM's output's ``token_start``)."""
    raw = _b64decode(field, "routed_experts")
    try:
        rows = np.load(io.BytesIO(raw), allow_pickle=False)
    except Exception as e:  # numpy raises ValueError, EOFError, ... for a malformed file
        raise ValueError(f"routed_experts is not an .npy file: {e}") from None
    if rows.ndim != 3:
        raise ValueError(f"routed_experts: want [T, L, K], got shape {rows.shape}")
    want = np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.uint16)
    if rows.dtype != want:
        raise ValueError(f"routed_experts: dtype {rows.dtype}, vLLM writes {want} for {num_experts} experts")
    for name, given, actual in (("num_layers", num_layers, rows.shape[1]), ("top_k", top_k, rows.shape[2])):
        if given is not None and given != actual:
            raise ValueError(f"routed_experts: shape {rows.shape} has {name} {actual}, expected {given}")
    # vLLM has no missing rows: its uint8 sentinel 255 is a valid id of 256 experts; ids >= E are wrong
    if rows.size and int(rows.max()) >= num_experts:
        t, l, k = (int(i[0]) for i in np.nonzero(rows >= num_experts))
        raise ValueError(f"routed_experts: row {t}, layer {l}, column {k}: expert id {int(rows[t, l, k])} outside "
                         f"[0, {num_experts})")
    return _native.encode(rows, int(num_experts), int(token_start), None if layer_map is None else list(layer_map),
                          _checked_codec(codec), bool(ordered), False, 3)


def to_vllm(record, *, tokens=None, layers=None) -> str:
    """vLLM 0.33's ``routed_experts`` field of a record (or of the part ``tokens`` and ``layers``
    select): base64 of an ``.npy`` of uint8 (E <= 256) or uint16, what ``numpy.load`` reads back.
    vLLM's field has no missing rows: a record with one in the range is refused."""
    head = info(record)
    first = _range(tokens, head["token_start"], head["num_tokens"], "tokens")[0] + head["token_start"]
    dtype = np.uint8 if head["num_experts"] <= 256 else np.uint16
    wide = decode(record, tokens=tokens, layers=layers, dtype=np.int32)
    missing = (wide < 0).all(axis=(1, 2)) if wide.size else np.zeros(0, bool)
    if missing.any():
        raise ValueError(f"the row at position {first + int(np.argmax(missing))} is missing, and vLLM's field has "
                         "no missing rows")
    buf = io.BytesIO()
    np.save(buf, wide.astype(dtype), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


_SGLANG_DTYPES = {"int32": np.int32, "int16": np.int16, "uint16": np.uint16, "uint8": np.uint8, "int8": np.int8,
                  "int64": np.int64}


def _checked_codec(codec: str) -> str:
    if codec not in CODECS:
        raise ValueError(f"codec {codec!r} is not one of this build's {CODECS}")
    return codec


def from_sglang(meta_info: dict, num_layers: int, top_k: int, num_experts: int, *, token_start: int = 0,
                layer_map: Iterable[int] | None = None, codec: str = "packed", ordered: bool = True) -> bytes:
    """A route record of SGLang's field: ``meta_info["routed_experts"]``, base64 of the raw ids of
    ``[T, L, K]`` in C order, int32 as SGLang 0.5.23 sends them, or of the dtype that
    ``meta_info["routed_experts_dtype"]`` names (SGLang's narrow-dtype wire). The field carries no
    shape: ``num_layers`` and ``top_k`` (the model's) give it, and the byte count must be a whole
    number of rows. Accepts the response itself too (a dict with a ``meta_info`` key)."""
    if "meta_info" in meta_info and "routed_experts" not in meta_info:
        meta_info = meta_info["meta_info"]
    if meta_info.get("routed_experts") is None:
        raise ValueError("meta_info has no routed_experts (was the request sent with return_routed_experts?)")
    name = meta_info.get("routed_experts_dtype", "int32")
    if str(name) not in _SGLANG_DTYPES:
        raise ValueError(f"routed_experts_dtype {name!r}: want one of {', '.join(_SGLANG_DTYPES)}")
    dtype = np.dtype(_SGLANG_DTYPES[str(name)]).newbyteorder("<")
    raw = _b64decode(meta_info["routed_experts"], "routed_experts")
    row_bytes = num_layers * top_k * dtype.itemsize
    if row_bytes == 0 or len(raw) % row_bytes:
        raise ValueError(f"routed_experts: {len(raw)} bytes are not whole rows of {num_layers} layers x {top_k} ids "
                         f"of {dtype.name} ({row_bytes} bytes a row)")
    rows = np.frombuffer(raw, dtype=dtype).reshape(-1, num_layers, top_k)
    _check_ids(rows, num_experts, "routed_experts")
    return _native.encode(rows, int(num_experts), int(token_start), None if layer_map is None else list(layer_map),
                          _checked_codec(codec), bool(ordered), True, 3)


def to_sglang(record, *, tokens=None, layers=None, dtype: str | None = None) -> dict:
    """SGLang's ``meta_info`` entries for a record (or the part ``tokens`` and ``layers`` select):
    ``{"routed_experts": base64 of the raw int32 ids}`` as SGLang 0.5.23 sends them, which its
    ``extract_routed_experts_from_meta_info`` reads; with ``dtype`` (e.g. "uint8", "int16") the
    narrow-dtype wire, naming it in ``routed_experts_dtype``. Missing rows read as the dtype's
    sentinel (-1 for int32)."""
    name = "int32" if dtype is None else str(np.dtype(dtype).name)
    if name not in _SGLANG_DTYPES:
        raise ValueError(f"dtype {dtype!r}: want one of {', '.join(_SGLANG_DTYPES)}")
    rows = decode(record, tokens=tokens, layers=layers, dtype=_SGLANG_DTYPES[name])
    field = {"routed_experts": base64.b64encode(rows.astype(np.dtype(name).newbyteorder("<"), copy=False).tobytes())
             .decode("ascii")}
    if dtype is not None:
        field["routed_experts_dtype"] = name
    return field
