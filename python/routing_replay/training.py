"""From the engine's per-request routing to a trainer's batch (R3, "Rollout Routing Replay").

The engine hands back, per request, an array ``[R, L, K]`` of expert ids (numpy, a ``.npy`` file or
vLLM's base64 ``routed_experts`` field). A trainer replaying that routing needs it in the shape of
its own batch, on its own ranks: padded to the attention mask or packed with ``cu_seqlens``, with
the final sampled token accounted for, restricted to the layers a pipeline stage owns, and sliced
the way context and sequence parallelism slice tokens. Each of those steps is a place to be off by
one token or one layer without any error, so each is one small function here with its rule
written down (docs/training.md) and every mismatch raised with the request and both sizes named.

numpy only; torch is imported by :func:`to_torch` alone. The hand-off to the models themselves is
in :mod:`routing_replay.megatron` (Megatron-core's ``RouterReplay``) and :mod:`routing_replay.hf`
(routers of Hugging Face ``transformers`` MoE models).

Terms: ``T`` tokens of a request (prompt plus generated, the last sampled one included), ``R`` rows
of routing the engine recorded for it (``T`` or ``T - 1``: the last sampled token never went
through the model), ``L`` layers on the routing's layer axis, ``K`` top-k.
"""

from __future__ import annotations

import binascii
import io
import os
import pickle
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ._rank_slices import (LayerMap, context_parallel_split, megatron_token_order, pipeline_layers,
                           sequence_parallel_split)
from ._wire import from_base64_npy

__all__ = [
    "FINAL_TOKEN_RULES",
    "PAD_ROWS",
    "LayerMap",
    "PackedRouting",
    "complete_rows",
    "context_parallel_split",
    "convert",
    "load_routing",
    "megatron_token_order",
    "packed_batch",
    "padded_batch",
    "pipeline_layers",
    "sentinel_of",
    "sequence_parallel_split",
    "to_torch",
]

#: How a request with one row fewer than its tokens is completed (the last sampled token never went
#: through the model, so the engine has no routing for it): ``"refuse"`` raises, ``"sentinel"``
#: appends a row of the sentinel (no routing: a replaying consumer must not read it),
#: ``"repeat"`` appends a copy of the last recorded row (valid ids; the row only feeds the logits of
#: the final token, which predict nothing and carry no loss).
FINAL_TOKEN_RULES = ("refuse", "sentinel", "repeat")

#: What rows that are no token (batch padding, alignment padding) hold: ``"sentinel"`` (nothing
#: there), or ``"first_k"``: experts ``0 .. K-1``, distinct valid ids, for consumers that gather
#: router scores at every row (a replaying router sees padding tokens too).
PAD_ROWS = ("sentinel", "first_k")


def sentinel_of(dtype) -> int:
    """The id that marks "no routing" in an integer dtype: -1 if signed, the maximum if unsigned.

    The same rule as the library's index types (``routing_replay.sentinel``), for any integer dtype.
    """
    dtype = np.dtype(dtype)
    if dtype.kind not in "iu":
        raise TypeError(f"routing ids are integers, got dtype {dtype}")
    return -1 if dtype.kind == "i" else int(np.iinfo(dtype).max)


def load_routing(source: Any) -> np.ndarray:
    """One request's routing ``[R, L, K]`` from what the engine handed over.

    ``source`` is a numpy array (or anything ``numpy.asarray`` takes), a ``str`` holding vLLM's
    ``routed_experts`` field (base64 of a ``.npy`` file), ``bytes`` of a ``.npy`` file, or a
    ``pathlib.Path`` / ``os.PathLike`` naming a ``.npy`` file. A ``str`` is always read as base64,
    never as a path (a path that happens to be valid base64 would otherwise decode into garbage):
    pass files as ``pathlib.Path``.
    """
    if isinstance(source, str):
        try:
            array = from_base64_npy(source)
        except (binascii.Error, ValueError, EOFError, pickle.UnpicklingError) as e:
            raise ValueError("a str routing source is vLLM's base64 `routed_experts` field, and this one does not "
                             f"decode into a .npy file ({e}); pass a .npy file as pathlib.Path") from None
    elif isinstance(source, (bytes, bytearray, memoryview)):
        array = np.load(io.BytesIO(bytes(source)), allow_pickle=False)
    elif isinstance(source, os.PathLike):
        array = np.load(os.fspath(source), allow_pickle=False)
    else:
        array = np.asarray(source)
    if array.ndim != 3:
        raise ValueError(f"routing is [rows, layers, top_k], got shape {array.shape}")
    if array.dtype.kind not in "iu":
        raise TypeError(f"routing ids are integers, got dtype {array.dtype}")
    return array


def convert(routing: np.ndarray, dtype) -> np.ndarray:
    """``routing`` as integer ``dtype``: the sentinel of its dtype becomes the sentinel of ``dtype``
    (uint8's 255 is "no routing", and must not become expert 255 in int32), and any id that does not
    fit ``dtype`` raises instead of wrapping around. Returns ``routing`` itself when nothing changes."""
    routing = np.asarray(routing)
    src, dst = routing.dtype, np.dtype(dtype)
    if dst.kind not in "iu":
        raise TypeError(f"routing ids are integers, cannot convert to {dst}")
    if src == dst:
        return routing
    s_in, s_out = sentinel_of(src), sentinel_of(dst)
    missing = routing == s_in
    valid = routing[~missing]
    info = np.iinfo(dst)
    if valid.size and (int(valid.min()) < info.min or int(valid.max()) > info.max or
                       (dst.kind == "u" and int(valid.max()) == info.max)):
        raise OverflowError(f"expert ids in [{int(valid.min())}, {int(valid.max())}] do not fit {dst} "
                            f"(its sentinel is {s_out}); ask for a wider dtype")
    out = routing.astype(dst)
    out[missing] = s_out
    return out


def _label(request_ids: Sequence[Any] | None, i: int) -> Any:
    """What errors call request ``i`` of a batch: its id when given, else its index."""
    return request_ids[i] if request_ids is not None else i


def complete_rows(routing: np.ndarray, num_tokens: int, *, final_token: str, request: Any = None) -> np.ndarray:
    """Request routing with exactly one row per token: ``[num_tokens, L, K]``.

    ``R == num_tokens`` is returned as it is; ``R == num_tokens - 1`` (the final sampled token never
    went through the model) is completed as ``final_token`` says (one of :data:`FINAL_TOKEN_RULES`;
    there is no default, so the choice is the caller's and shows in its code). Any other ``R`` is a
    ``ValueError`` naming ``request`` and both lengths: it means routing and tokens belong to
    different requests, turns or truncations, and no rule can repair that.
    """
    if final_token not in FINAL_TOKEN_RULES:
        raise ValueError(f"final_token must be one of {FINAL_TOKEN_RULES}, got {final_token!r}")
    rows = routing.shape[0]
    who = "request" if request is None else f"request {request!r}"
    if rows == num_tokens:
        return routing
    if rows != num_tokens - 1:
        raise ValueError(f"{who}: {rows} rows of routing for {num_tokens} tokens (expected {num_tokens} or "
                         f"{num_tokens - 1}, the last sampled token having none)")
    if final_token == "refuse":
        raise ValueError(f"{who}: {rows} rows of routing for {num_tokens} tokens: the final token has no routing "
                         "and final_token='refuse'")
    if final_token == "sentinel":
        last = np.full((1,) + routing.shape[1:], sentinel_of(routing.dtype), dtype=routing.dtype)
    else:
        if rows == 0:
            raise ValueError(f"{who}: no routing rows to repeat for its single token")
        last = routing[-1:]
    return np.concatenate([routing, last], axis=0)


def _pad_row(shape_lk: tuple[int, int], pad_rows: str, dtype: np.dtype) -> np.ndarray:
    if pad_rows == "sentinel":
        return np.full(shape_lk, sentinel_of(dtype), dtype=dtype)
    if pad_rows == "first_k":
        return np.broadcast_to(np.arange(shape_lk[1], dtype=dtype), shape_lk)
    raise ValueError(f"pad_rows must be one of {PAD_ROWS}, got {pad_rows!r}")


def _prepare(routings: Sequence[Any], lengths: Sequence[int], final_token: str, dtype,
             request_ids: Sequence[Any] | None) -> tuple[list[np.ndarray], np.dtype]:
    """Loads, checks shapes, completes rows and converts every request."""
    if request_ids is not None and len(request_ids) != len(routings):
        raise ValueError(f"{len(request_ids)} request ids for {len(routings)} requests")
    if len(lengths) != len(routings):
        raise ValueError(f"{len(routings)} routing arrays for a batch of {len(lengths)} sequences")
    arrays = [load_routing(r) for r in routings]
    if not arrays:
        raise ValueError("an empty batch")
    out_dtype = np.dtype(dtype) if dtype is not None else np.result_type(*[a.dtype for a in arrays])
    lk = arrays[0].shape[1:]
    done = []
    for i, (a, n) in enumerate(zip(arrays, lengths)):
        if a.shape[1:] != lk:
            raise ValueError(f"request {_label(request_ids, i)!r}: routing of [layers, top_k] = {list(a.shape[1:])}, "
                             f"but request {_label(request_ids, 0)!r} has {list(lk)}")
        done.append(convert(complete_rows(a, int(n), final_token=final_token, request=_label(request_ids, i)),
                            out_dtype))
    return done, out_dtype


def padded_batch(routings: Sequence[Any], attention_mask, *, final_token: str, pad_rows: str = "sentinel",
                 dtype=None, request_ids: Sequence[Any] | None = None) -> np.ndarray:
    """The routing of a padded batch: ``[B, S, L, K]`` aligned to ``attention_mask`` ``[B, S]``.

    Request ``b`` has ``T_b = attention_mask[b].sum()`` tokens, and its rows go, in order, to the
    positions where the mask is 1: left padding, right padding, or any other placement the mask
    describes. The other positions hold ``pad_rows`` (:data:`PAD_ROWS`). ``final_token`` completes
    requests with ``T_b - 1`` rows (:func:`complete_rows`). ``routings``: anything
    :func:`load_routing` takes, one per row of the mask. ``dtype``: of the result (default: the
    inputs' common dtype), converted by :func:`convert` (never narrowed silently).
    """
    mask = np.asarray(attention_mask)
    if mask.ndim != 2:
        raise ValueError(f"attention_mask is [batch, seq], got shape {mask.shape}")
    mask = mask.astype(bool)
    lengths = mask.sum(axis=1)
    arrays, out_dtype = _prepare(routings, list(lengths), final_token, dtype, request_ids)
    b, s = mask.shape
    lk = arrays[0].shape[1:]
    out = np.empty((b, s) + lk, dtype=out_dtype)
    out[:] = _pad_row(lk, pad_rows, out_dtype)
    for i, a in enumerate(arrays):
        out[i, mask[i]] = a
    return out


class PackedRouting(NamedTuple):
    """The routing of a packed batch (:func:`packed_batch`)."""

    #: ``[cu_seqlens_padded[-1], L, K]``: the sequences one after another, each followed by its
    #: alignment padding.
    routing: np.ndarray
    #: ``[B + 1]`` int32: offsets of the tokens of each sequence, without alignment padding
    #: (Megatron-core's ``cu_seqlens_q``, flash-attention's ``cu_seqlens``).
    cu_seqlens: np.ndarray
    #: ``[B + 1]`` int32: where each sequence starts and ends in ``routing``, padding included
    #: (Megatron-core's ``cu_seqlens_q_padded``). Equal to ``cu_seqlens`` when ``align`` is 1.
    cu_seqlens_padded: np.ndarray


def packed_batch(routings: Sequence[Any], num_tokens: Sequence[int], *, final_token: str, align: int = 1,
                 pad_rows: str = "sentinel", dtype=None, request_ids: Sequence[Any] | None = None) -> PackedRouting:
    """The routing of a packed batch: the sequences' rows one after another, ``[sum T_pad, L, K]``.

    Sequence ``b`` has ``num_tokens[b]`` tokens and is padded at its end to a multiple of ``align``
    (Megatron-core with context parallel size ``CP`` wants ``align = 2 * CP``, and with sequence
    parallelism the total a multiple of the TP size; pick the ``align`` the trainer's packer uses).
    Padding rows hold ``pad_rows``. ``final_token``, ``dtype``, ``request_ids``: as in
    :func:`padded_batch`.
    """
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    arrays, out_dtype = _prepare(routings, [int(n) for n in num_tokens], final_token, dtype, request_ids)
    lk = arrays[0].shape[1:]
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    padded = -(-lengths // align) * align
    cu = np.zeros(len(arrays) + 1, dtype=np.int64)
    cu_pad = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    np.cumsum(padded, out=cu_pad[1:])
    if cu_pad[-1] > np.iinfo(np.int32).max:
        raise OverflowError(f"{cu_pad[-1]} packed tokens do not fit int32 cu_seqlens")
    out = np.empty((int(cu_pad[-1]),) + lk, dtype=out_dtype)
    out[:] = _pad_row(lk, pad_rows, out_dtype)
    for i, a in enumerate(arrays):
        out[cu_pad[i]:cu_pad[i] + len(a)] = a
    return PackedRouting(out, cu.astype(np.int32), cu_pad.astype(np.int32))


_TORCH_DTYPES = ("int8", "uint8", "int16", "int32", "int64")


def to_torch(routing, *, dtype: str = "int64", device: Any = "cpu"):
    """``routing`` as a torch tensor of ``dtype`` on ``device`` (any torch device): the sentinel is
    carried over and ids that do not fit raise (:func:`convert`). ``int64`` is what
    ``torch.gather`` and Megatron-core's replay want; ``int32`` halves the bytes moved."""
    import torch

    name = str(dtype).replace("torch.", "")
    if name not in _TORCH_DTYPES:
        raise ValueError(f"dtype is one of {_TORCH_DTYPES}, got {dtype!r}")
    array = np.ascontiguousarray(convert(np.asarray(routing), name))
    return torch.from_numpy(array).to(device)
