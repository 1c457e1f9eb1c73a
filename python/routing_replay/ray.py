"""Route records from the rollout to every trainer rank through Ray's object store, by reference,
each rank decoding only its slice (docs/training.md, "Through Ray").

The rollout side publishes one object per route record (:mod:`routing_replay.wire`'s bytes) and
hands small :class:`RouteRef` references along with its samples; they carry the record's shape,
first position and a digest of its layer map, never its payload. A trainer rank passes the
references of its micro-batch and its :class:`RankPlace` to :func:`rank_routing`, which returns
exactly the array :mod:`routing_replay.training` builds for that rank from the whole batch
(``LayerMap.take(megatron_token_order(packed_batch(...) or padded_batch(...)), layers)``, the
array :mod:`routing_replay.megatron` hands to the routers), reading only the record chunks the
rank's tokens and layers touch. The records are mapped from the object store without a copy where
they are on the rank's node (``ray.get`` of a uint8 numpy array is zero-copy there), and the rows
are decoded straight into the rank's array.

Rollout actor::

    from routing_replay import ray as rr_ray, wire
    records = [wire.encode(routing, 128, layer_map=moe_layers) for routing in routings]
    refs = rr_ray.publish(records, samples=request_ids)     # one object each; refs of a few hundred bytes

Trainer rank (data-parallel 2 x pipeline 2 x context-parallel 2)::

    place = rr_ray.RankPlace.megatron(layer_map, pp_size=2, pp_rank=pp, dp_size=2, dp_rank=dp,
                                      cp_size=2, cp_rank=cp)
    routing = rr_ray.rank_routing(refs, place, layer_map=layer_map, num_tokens=lengths,
                                  final_token="repeat", align=4, pad_rows="first_k")

Objects live as long as some :class:`RouteRef` (or its ``object_ref``) does, and belong to the
process that published them: if that process exits first, or Ray loses the object, reading it
raises :class:`RouteLostError`, never returns other rows.

Requires the ``ray`` extra (``pip install "routing-replay[ray]"``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

try:
    import ray
    import ray.exceptions
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("routing_replay.ray needs Ray: pip install 'routing-replay[ray]' (or pip install ray)") from e

from . import wire
from ._rank_slices import LayerMap, megatron_token_order, pipeline_layers
from .training import FINAL_TOKEN_RULES, PAD_ROWS, sentinel_of

__all__ = [
    "RankPlace",
    "RecordMismatchError",
    "RouteLostError",
    "RouteRef",
    "fetch",
    "layer_map_digest",
    "publish",
    "rank_routing",
]


class RecordMismatchError(ValueError):
    """A route record does not belong to the sample it was handed with: its token count, layer map,
    first position (``token_start``) or shape differ from what the trainer's sample says. The
    message names the sample and both values; :attr:`sample` and :attr:`field` hold them."""

    def __init__(self, sample: Any, field: str, message: str) -> None:
        super().__init__(f"sample {sample!r}: {message}")
        self.sample = sample
        self.field = field


class RouteLostError(RuntimeError):
    """Ray no longer has a sample's route record: its owner (the process that published it) exited,
    it was freed, or its node died. Its rows cannot be recomputed on the trainer's side: re-run that
    sample's rollout, and publish from a process that outlives the fetches. :attr:`sample` names it."""

    def __init__(self, sample: Any, cause: BaseException) -> None:
        super().__init__(
            f"sample {sample!r}: its route record is gone from Ray's object store ({type(cause).__name__}: the "
            "process that published it exited, or the object was freed or lost with its node) and Ray cannot "
            "rebuild an object made by ray.put. Re-run this sample's rollout; to keep records alive until every "
            "rank has fetched them, publish from a process that outlives the fetches (the actor driving the "
            "rollout, not a per-request worker) and keep its RouteRefs until the training step is done")
        self.sample = sample


def layer_map_digest(layer_map: Sequence[int]) -> str:
    """A 16-hex-digit digest of a layer map (the model layer of each captured layer, in order): what
    a :class:`RouteRef` carries instead of the map itself."""
    data = np.asarray([int(x) for x in layer_map], dtype="<i8").tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


@dataclasses.dataclass(frozen=True)
class RouteRef:
    """A published route record: a Ray object reference and the record's header fields a trainer
    checks its sample against, without the payload (under 500 bytes pickled, Ray's owner address included).

    The object stays in Ray's object store while any copy of this reference (or of
    :attr:`object_ref`) is alive anywhere in the cluster.
    """

    #: the Ray object: the record's bytes as a uint8 numpy array (``ray.get`` maps it, no copy)
    object_ref: Any
    #: what errors call the sample (the ``samples`` given to :func:`publish`, else its index)
    sample: Any
    #: rows in the record (``T``): one per position from :attr:`token_start`
    num_tokens: int
    #: captured layers (``L``)
    num_layers: int
    #: ids per row (``K``)
    top_k: int
    #: routed experts (``E``)
    num_experts: int
    #: the position of the record's first row
    token_start: int
    #: :func:`layer_map_digest` of the record's layer map
    layer_map_digest: str
    #: the record's size in bytes (what the object store holds for it)
    nbytes: int


def _header(record) -> dict:
    """The fields a RouteRef keeps, from :func:`routing_replay.wire.info`."""
    h = wire.info(record)
    return {"num_tokens": int(h["num_tokens"]), "num_layers": int(h["num_layers"]), "top_k": int(h["top_k"]),
            "num_experts": int(h["num_experts"]), "token_start": int(h["token_start"]),
            "layer_map": [int(x) for x in h["layer_map"]], "chunk_tokens": int(h.get("chunk_tokens") or 0)}


def publish(records: Sequence[Any], *, samples: Sequence[Any] | None = None) -> list[RouteRef]:
    """Puts each route record (bytes-like, from :func:`routing_replay.wire.encode`) into Ray's object
    store as one object and returns one :class:`RouteRef` per record, in order.

    Each object is the record's bytes as a uint8 numpy array, so the store holds the record's size
    and no more, and a reader on the same node maps it without copying. ``samples``: what errors
    call each record's sample (request ids; default: the index). The objects belong to the calling
    process (Ray's ownership: a process's objects go when it exits), so publish from one that
    outlives the ranks' reads, such as the long-lived actor that drives the rollout. Call it in a
    Ray worker or driver (``ray.init()`` done). A record the decoder's header check refuses raises
    that error here, before anything is put.
    """
    if samples is not None and len(samples) != len(records):
        raise ValueError(f"{len(samples)} sample ids for {len(records)} records")
    headers = []
    for i, record in enumerate(records):
        if not isinstance(record, (bytes, bytearray, memoryview, np.ndarray)):
            raise TypeError(f"sample {samples[i] if samples is not None else i!r}: a route record is the bytes "
                            f"routing_replay.wire.encode returns, got {type(record).__name__}")
        headers.append(_header(record))
    refs = []
    for i, (record, h) in enumerate(zip(records, headers)):
        # a uint8 array, not bytes: Ray stores numpy buffers out of band, so ray.get maps them without a copy
        payload = np.frombuffer(record, dtype=np.uint8)
        object_ref = ray.put(payload)
        refs.append(RouteRef(object_ref=object_ref, sample=samples[i] if samples is not None else i,
                             num_tokens=h["num_tokens"], num_layers=h["num_layers"], top_k=h["top_k"],
                             num_experts=h["num_experts"], token_start=h["token_start"],
                             layer_map_digest=layer_map_digest(h["layer_map"]), nbytes=payload.nbytes))
    return refs


def _get(refs: Sequence[RouteRef], timeout: float | None) -> list[np.ndarray]:
    """``ray.get`` of the records, a lost object raised as RouteLostError naming its sample."""
    for r in refs:
        if not isinstance(r, RouteRef):
            raise TypeError(f"expected RouteRef (from routing_replay.ray.publish), got {type(r).__name__}")
    try:
        return ray.get([r.object_ref for r in refs], timeout=timeout)
    except ray.exceptions.ObjectLostError as e:
        lost = getattr(e, "object_ref_hex", None)
        sample = next((r.sample for r in refs if r.object_ref.hex() == lost), refs[0].sample if len(refs) == 1 else
                      f"<one of {[r.sample for r in refs]}>")
        raise RouteLostError(sample, e) from e


def _check_object(buffer, ref: RouteRef) -> dict:
    """The record's header, checked against the reference it was fetched through."""
    h = _header(buffer)
    got = (h["num_tokens"], h["num_layers"], h["top_k"], h["num_experts"], h["token_start"],
           layer_map_digest(h["layer_map"]))
    want = (ref.num_tokens, ref.num_layers, ref.top_k, ref.num_experts, ref.token_start, ref.layer_map_digest)
    if got != want:
        raise RecordMismatchError(ref.sample, "object", f"the object holds a record of (T, L, K, E, token_start, "
                                  f"layer map digest) = {got}, its reference says {want}")
    return h


def fetch(ref: RouteRef, *, tokens: slice | None = None, layers: slice | None = None, out=None,
          timeout: float | None = None) -> np.ndarray:
    """The rows of a published record, as :func:`routing_replay.wire.decode` gives them for the same
    record and slices: ``tokens`` (positions, absolute: from the record's ``token_start``) and
    ``layers`` (captured layers), only the chunks they touch decoded, straight from the object
    store (mapped, not copied, where the object is on this node). ``out``: as ``wire.decode``'s.

    Callable in any Ray worker or driver. Raises :class:`RouteLostError` where Ray lost the object,
    ``ray.exceptions.GetTimeoutError`` after ``timeout`` seconds, and what ``wire.decode`` raises.
    """
    [buffer] = _get([ref], timeout)
    _check_object(buffer, ref)
    return wire.decode(buffer, tokens=tokens, layers=layers, out=out)


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """Where a trainer rank sits, as far as routing goes: the layers its routers run and the slices
    of data, context and sequence parallelism it takes.

    ``layers``: the model layers whose routers this rank runs, in router order (a pipeline stage's
    MoE layers: :meth:`megatron`, or ``routing_replay.megatron.router_layers(model)``); None: every
    captured layer (no pipeline parallelism). The data-parallel share of a batch is its
    ``dp_rank``-th of ``dp_size`` equal contiguous parts (as ``DataProto.chunk`` and Megatron's
    sampler cut a global batch); context parallelism is Megatron's two chunks per sequence, and
    ``sequence_parallel`` the contiguous ``tp_rank``-th slice of the rank's tokens
    (:func:`routing_replay.training.megatron_token_order`).
    """

    layers: tuple[int, ...] | None = None
    dp_rank: int = 0
    dp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        for name, size in (("dp", self.dp_size), ("cp", self.cp_size), ("tp", self.tp_size)):
            rank = getattr(self, f"{name}_rank")
            if not 0 <= rank < size:
                raise ValueError(f"{name}_rank {rank} outside a group of {size}")

    @classmethod
    def megatron(cls, layer_map: LayerMap, *, pp_size: int = 1, pp_rank: int = 0, vpp_size: int | None = None,
                 vpp_rank: int | None = None, first_stage_layers: int | None = None,
                 last_stage_layers: int | None = None, **ranks: Any) -> RankPlace:
        """The place of a rank of pipeline stage ``pp_rank`` (virtual stage ``vpp_rank``): the MoE
        layers among the model layers Megatron-core gives that stage
        (:func:`routing_replay.training.pipeline_layers`, same arguments); ``ranks``: the other
        fields (``dp_rank=``, ``cp_size=``, ...)."""
        stage = pipeline_layers(layer_map.num_layers, pp_size, pp_rank, vpp_size, vpp_rank,
                                first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers)
        return cls(layers=tuple(layer_map.moe_in(stage)), **ranks)


def _runs(keys: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) of the runs where ``keys`` increases by exactly 1 from one element to the next."""
    if keys.size == 0:
        return []
    cut = np.flatnonzero(np.diff(keys) != 1) + 1
    starts = np.concatenate([[0], cut])
    stops = np.concatenate([cut, [keys.size]])
    return list(zip(starts.tolist(), stops.tolist()))


def rank_routing(refs: Sequence[RouteRef], place: RankPlace, *, layer_map: LayerMap, final_token: str,
                 num_tokens: Sequence[int] | None = None, attention_mask=None, align: int = 1,
                 pad_rows: str = "sentinel", dtype=None, token_starts: Sequence[int] | int = 0,
                 timeout: float | None = None) -> np.ndarray:
    """This rank's routing for one batch: ``[rank tokens, len(place.layers), K]``, the array
    :mod:`routing_replay.training` builds for it from the whole batch, decoded from the records
    touching only the chunks the rank's tokens and layers need.

    ``refs``: the batch's references, one per sample in batch order (the rank takes its
    data-parallel share, :class:`RankPlace`). The batch is either packed (``num_tokens``: each
    sample's token count, sequences padded to a multiple of ``align``; Megatron's THD) or padded
    (``attention_mask`` ``[B, S]``). The result equals, for the rank's share::

        routing = training.packed_batch(arrays, num_tokens, final_token=..., align=..., pad_rows=..., dtype=...)
        local = training.megatron_token_order(routing.routing, packed=True, cu_seqlens_padded=routing.cu_seqlens_padded,
                                              cp_size=..., cp_rank=..., tp_size=..., tp_rank=..., sequence_parallel=...)
        layer_map.take(local, place.layers or "moe")

    (``padded_batch`` and ``packed=False`` with ``attention_mask``), where ``arrays`` are the records
    decoded whole; ``dtype`` defaults to the records' own (``wire.decode``'s).

    Each record is checked against its sample first: its rows must be the sample's token count or one
    fewer (the last sampled token), its layer map ``layer_map.moe_layers``, its first position
    ``token_starts`` (one per sample, or one for all); otherwise :class:`RecordMismatchError`
    naming the sample. A lost object raises :class:`RouteLostError`.
    """
    if final_token not in FINAL_TOKEN_RULES:
        raise ValueError(f"final_token must be one of {FINAL_TOKEN_RULES}, got {final_token!r}")
    if pad_rows not in PAD_ROWS:
        raise ValueError(f"pad_rows must be one of {PAD_ROWS}, got {pad_rows!r}")
    if (num_tokens is None) == (attention_mask is None):
        raise ValueError("pass num_tokens (a packed batch) or attention_mask (a padded batch), one of them")
    packed = attention_mask is None
    refs = list(refs)
    if packed:
        lengths_all = np.asarray([int(n) for n in num_tokens], dtype=np.int64)
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
    else:
        mask_all = np.asarray(attention_mask)
        if mask_all.ndim != 2:
            raise ValueError(f"attention_mask is [batch, seq], got shape {mask_all.shape}")
        mask_all = mask_all.astype(bool)
        lengths_all = mask_all.sum(axis=1).astype(np.int64)
    if len(lengths_all) != len(refs):
        raise ValueError(f"{len(refs)} route references for a batch of {len(lengths_all)} samples")
    starts_all = (np.full(len(refs), int(token_starts), dtype=np.int64) if np.isscalar(token_starts)
                  else np.asarray([int(s) for s in token_starts], dtype=np.int64))
    if len(starts_all) != len(refs):
        raise ValueError(f"{len(starts_all)} token starts for {len(refs)} samples")
    if not refs:
        raise ValueError("an empty batch")

    # the data-parallel share: contiguous equal parts of the batch
    if len(refs) % place.dp_size:
        raise ValueError(f"a batch of {len(refs)} samples does not split evenly over {place.dp_size} "
                         "data-parallel ranks")
    per = len(refs) // place.dp_size
    share = slice(place.dp_rank * per, (place.dp_rank + 1) * per)
    refs, lengths, starts = refs[share], lengths_all[share], starts_all[share]
    mask = None if packed else mask_all[share]

    # every record against its sample, before anything is decoded
    digest = layer_map_digest(layer_map.moe_layers)
    top_k = refs[0].top_k
    for r, n, s in zip(refs, lengths.tolist(), starts.tolist()):
        if r.layer_map_digest != digest or r.num_layers != len(layer_map.moe_layers):
            raise RecordMismatchError(r.sample, "layer_map", f"the record's layer map ({r.num_layers} layers, digest "
                                      f"{r.layer_map_digest}) is not the trainer's {layer_map.moe_layers} (digest "
                                      f"{digest})")
        if r.num_tokens not in (n, n - 1):
            raise RecordMismatchError(r.sample, "num_tokens", f"the record has {r.num_tokens} rows for a sample of {n} "
                                      f"tokens (expected {n} or {n - 1}, the last sampled token having none)")
        if r.num_tokens == n - 1 and final_token == "refuse":
            raise ValueError(f"request {r.sample!r}: {r.num_tokens} rows of routing for {n} tokens: the final token "
                             "has no routing and final_token='refuse'")
        if r.num_tokens == n - 1 and final_token == "repeat" and r.num_tokens == 0:
            raise ValueError(f"request {r.sample!r}: no routing rows to repeat for its single token")
        if r.token_start != s:
            raise RecordMismatchError(r.sample, "token_start", f"the record starts at position {r.token_start}, the "
                                      f"sample's tokens at position {s}")
        if r.top_k != top_k:
            raise RecordMismatchError(r.sample, "top_k", f"the record has top-k {r.top_k}, sample {refs[0].sample!r}'s "
                                      f"{top_k}")

    # where each of the rank's rows comes from: Megatron's token order applied to the batch's indices,
    # so that the rule (and its errors) is exactly routing_replay.training's
    if packed:
        padded_len = -(-lengths // align) * align
        cu = np.zeros(len(refs) + 1, dtype=np.int64)
        np.cumsum(padded_len, out=cu[1:])
        if cu[-1] > np.iinfo(np.int32).max:
            raise OverflowError(f"{cu[-1]} packed tokens do not fit int32 cu_seqlens")
        index = np.arange(int(cu[-1]), dtype=np.int64)[:, None, None]
        order = megatron_token_order(index, packed=True, cu_seqlens_padded=cu, cp_size=place.cp_size,
                                     cp_rank=place.cp_rank, tp_size=place.tp_size, tp_rank=place.tp_rank,
                                     sequence_parallel=place.sequence_parallel and place.tp_size > 1)[:, 0, 0]
        del index
        sample = np.searchsorted(cu, order, side="right") - 1
        token = order - cu[sample]  # the token of its sequence; >= T_b: alignment padding
        is_token = token < lengths[sample]
    else:
        b, s_len = mask.shape
        index = np.arange(b * s_len, dtype=np.int64).reshape(b, s_len)[:, :, None, None]
        order = megatron_token_order(index, packed=False, cp_size=place.cp_size, cp_rank=place.cp_rank,
                                     tp_size=place.tp_size, tp_rank=place.tp_rank,
                                     sequence_parallel=place.sequence_parallel and place.tp_size > 1)[:, 0, 0]
        del index
        sample, position = np.divmod(order, s_len)
        token = np.cumsum(mask, axis=1)[sample, position] - 1  # rows go, in order, where the mask is 1
        is_token = mask[sample, position]
    rows = np.asarray([r.num_tokens for r in refs], dtype=np.int64)
    recorded = is_token & (token < rows[sample])
    final = is_token & ~recorded  # the last sampled token of a record one row short
    del order

    # the layers: captured-layer slots of the rank's routers, dense ones (no router) as the sentinel
    wanted = list(layer_map.moe_layers) if place.layers is None else list(place.layers)
    bad = [x for x in wanted if not 0 <= x < layer_map.num_layers]
    if bad:
        raise ValueError(f"layers {bad} are outside the model's {layer_map.num_layers} layers")
    slot_of = {layer: i for i, layer in enumerate(layer_map.moe_layers)}
    slots = np.asarray([slot_of.get(x, -1) for x in wanted], dtype=np.int64)
    dense = slots < 0
    real = slots[~dense]
    lo = int(real.min()) if real.size else 0
    hi = int(real.max()) + 1 if real.size else 0
    direct = not dense.any() and np.array_equal(slots, np.arange(lo, hi))

    # the plan, made before the rank's array exists so that its index arrays never add to its peak:
    # runs of consecutive record rows, each decoded once (contiguous in the result where the order
    # allows, as in packed batches; strided, a padded batch's [s, b] order, placed by index)
    picked = np.flatnonzero(recorded)
    by_sample = picked[np.lexsort((token[picked], sample[picked]))]
    del picked
    src = sample[by_sample] * (int(rows.max()) + 2) + token[by_sample]  # consecutive within a sample only
    runs = []
    for start, stop in _runs(src):
        where = by_sample[start:stop]
        contiguous = bool(where[-1] - where[0] == stop - start - 1 and np.all(np.diff(where) == 1))
        runs.append((int(sample[where[0]]), int(token[where[0]]), stop - start, int(where[0]),
                     None if contiguous else where.copy()))
    finals = [(i, int(sample[i])) for i in np.flatnonzero(final).tolist()]
    padding = np.flatnonzero(~is_token)
    count_out = len(sample)
    del src, by_sample, sample, token, is_token, recorded, final

    buffers = _get(refs, timeout)
    headers = [_check_object(buf, r) for buf, r in zip(buffers, refs)]
    out_dtype = np.dtype(dtype) if dtype is not None else wire.dtype_for(refs[0].num_experts)
    if out_dtype.kind not in "iu":
        raise TypeError(f"routing ids are integers, got dtype {out_dtype}")
    sentinel = sentinel_of(out_dtype)
    out = np.empty((count_out, len(wanted), top_k), dtype=out_dtype)

    def decode_into(target, b: int, first: int, count: int) -> None:
        """Rows [first, first + count) of record b (its own row numbers), the rank's layers, into
        ``target`` (any array of their shape): straight in where it is contiguous and the layers a
        contiguous run of captured ones, else at most one chunk of the record at a time, placed."""
        if not real.size:
            target[...] = sentinel  # no router of the rank has routing (dense layers only)
            return
        begin = refs[b].token_start + first
        if direct and target.flags.c_contiguous:
            wire.decode(buffers[b], tokens=slice(begin, begin + count), layers=slice(lo, hi), out=target)
            return
        chunk = headers[b]["chunk_tokens"] or 1024
        for k in range(0, count, chunk):
            n = min(chunk, count - k)
            block = wire.decode(buffers[b], tokens=slice(begin + k, begin + k + n), layers=slice(lo, hi),
                                out=np.empty((n, hi - lo, top_k), dtype=out_dtype))
            if direct:
                target[k:k + n] = block
            else:
                target[k:k + n, ~dense] = block[:, real - lo]
                target[k:k + n, dense] = sentinel

    for b, first, count, at, where in runs:
        if where is None:
            decode_into(out[at:at + count], b, first, count)
        else:  # strided rows (a padded batch's [s, b] order): decoded a chunk at a time, placed by index
            chunk = headers[b]["chunk_tokens"] or 1024
            for k in range(0, count, chunk):
                n = min(chunk, count - k)
                block = np.empty((n, len(wanted), top_k), dtype=out_dtype)
                decode_into(block, b, first + k, n)
                out[where[k:k + n]] = block
    # the final token of records one row short
    for i, b in finals:
        if final_token == "sentinel":
            out[i] = sentinel
        else:  # "repeat": the record's last row
            decode_into(out[i:i + 1], b, int(rows[b]) - 1, 1)
    del buffers
    if padding.size:
        out[padding] = sentinel if pad_rows == "sentinel" else np.arange(top_k, dtype=out_dtype)
        if dense.any():
            out[np.ix_(padding, np.flatnonzero(dense))] = sentinel
    return out
