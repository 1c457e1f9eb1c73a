"""Where a trainer's ranks take their part of a batch's routing: the layers a pipeline stage (and
its virtual stages) owns (:class:`LayerMap`, :func:`pipeline_layers`), the token chunks of context
parallelism, the slice of sequence parallelism, and Megatron-core's token order
(:func:`megatron_token_order`). Each rule is Megatron-core's own, written down in docs/training.md
and checked against Megatron's functions by the tests. Re-exported by :mod:`routing_replay.training`,
whose batch shaping (padding, packing, the final token) comes before these slices."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _sentinel_of(dtype) -> int:
    # training.sentinel_of, imported when first used: training re-exports this module
    from .training import sentinel_of

    return sentinel_of(dtype)


class LayerMap:
    """Which model layers have routing, and where they sit on a routing array's layer axis.

    The engine captures MoE layers only (``moe_layers``: the model layer index of each captured
    layer, in capture order, as given to ``Replay(moe_layers=...)``), or all ``num_layers`` model
    layers with dense ones marked by the sentinel (``extract(include_dense_layers=True)``). A
    consumer wants one of: the MoE layers only (Megatron-core has one ``RouterReplay`` per MoE
    layer), all layers, or the layers one pipeline stage owns. :meth:`take` converts between them
    along the second-to-last axis of any array (one request ``[T, L, K]``, a batch ``[B, S, L, K]``).
    """

    def __init__(self, moe_layers: Sequence[int], num_layers: int) -> None:
        self.moe_layers = [int(x) for x in moe_layers]
        self.num_layers = int(num_layers)
        if len(set(self.moe_layers)) != len(self.moe_layers):
            raise ValueError(f"moe_layers {self.moe_layers} repeat a layer")
        bad = [x for x in self.moe_layers if not 0 <= x < self.num_layers]
        if bad:
            raise ValueError(f"moe_layers {bad} are outside the model's {self.num_layers} layers")
        self._slot = {layer: i for i, layer in enumerate(self.moe_layers)}

    def __repr__(self) -> str:
        return f"LayerMap(moe_layers={self.moe_layers}, num_layers={self.num_layers})"

    def is_moe(self, layer: int) -> bool:
        """Whether model layer ``layer`` has a router (was captured)."""
        return int(layer) in self._slot

    def moe_in(self, layers: Sequence[int]) -> list[int]:
        """The MoE layers among ``layers`` (e.g. a pipeline stage's), in the order given."""
        return [int(x) for x in layers if int(x) in self._slot]

    def take(self, routing, layers: str | Sequence[int] = "moe", axis: int = -2) -> np.ndarray:
        """``routing`` with its layer axis (``axis``) holding ``layers``.

        ``routing``'s layer axis has either ``len(moe_layers)`` entries (MoE layers only) or
        ``num_layers`` (all model layers); any other size raises. ``layers``: ``"moe"`` (the MoE
        layers in capture order), ``"all"`` (every model layer, dense ones as the sentinel), or a
        sequence of model layer indices (dense ones, again, as the sentinel).
        """
        routing = np.asarray(routing)
        size = routing.shape[axis]
        if size == len(self.moe_layers):
            source = self._slot
        elif size == self.num_layers:
            source = {layer: layer for layer in self.moe_layers}
        else:
            raise ValueError(f"routing has {size} layers on axis {axis}, but {self!r} expects "
                             f"{len(self.moe_layers)} (MoE layers) or {self.num_layers} (all layers)")
        if isinstance(layers, str):
            if layers == "moe":
                wanted = self.moe_layers
            elif layers == "all":
                wanted = list(range(self.num_layers))
            else:
                raise ValueError(f"layers is 'moe', 'all' or a list of model layers, got {layers!r}")
        else:
            wanted = [int(x) for x in layers]
            bad = [x for x in wanted if not 0 <= x < self.num_layers]
            if bad:
                raise ValueError(f"layers {bad} are outside the model's {self.num_layers} layers")
        index = np.array([source.get(x, -1) for x in wanted], dtype=np.int64)
        dense = index < 0
        out = np.take(routing, np.where(dense, 0, index), axis=axis)
        if dense.any():
            where = [slice(None)] * routing.ndim
            where[axis] = np.flatnonzero(dense)
            out[tuple(where)] = _sentinel_of(routing.dtype)
        return out


def pipeline_layers(num_layers: int, pp_size: int, pp_rank: int, vpp_size: int | None = None,
                    vpp_rank: int | None = None, *, first_stage_layers: int | None = None,
                    last_stage_layers: int | None = None) -> list[int]:
    """The model layers a pipeline stage (and virtual stage) owns, as Megatron-core assigns them.

    Without virtual stages, stage ``p`` owns a contiguous range; with ``vpp_size`` virtual stages
    the layers are cut into ``pp_size * vpp_size`` chunks, and virtual stage ``v`` of stage ``p``
    owns chunk ``v * pp_size + p`` (the interleaved schedule). ``first_stage_layers`` /
    ``last_stage_layers`` (Megatron's ``num_layers_in_first/last_pipeline_stage``) give the first
    and last stages their own counts, split evenly over their virtual stages; the remaining layers
    are split evenly over the middle stages. A split that does not divide raises. Megatron's
    ``pipeline_model_parallel_layout`` and ``account_for_embedding/loss_in_pipeline_split`` are not
    modelled (:mod:`routing_replay.megatron` reads the layers from the routers instead).
    """
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} outside a pipeline of {pp_size} stages")
    vpp = 1 if vpp_size is None else int(vpp_size)
    v = 0 if vpp_rank is None else int(vpp_rank)
    if vpp_size is None and vpp_rank not in (None, 0):
        raise ValueError(f"vpp_rank {vpp_rank} without vpp_size")
    if not 0 <= v < vpp:
        raise ValueError(f"vpp_rank {v} outside {vpp} virtual stages")
    per_stage = [None] * pp_size
    rest, middle = num_layers, list(range(pp_size))
    if first_stage_layers is not None:
        per_stage[0] = int(first_stage_layers)
        rest -= per_stage[0]
        middle.remove(0)
    if last_stage_layers is not None:
        if pp_size == 1 and first_stage_layers is not None:
            raise ValueError("first and last stage layer counts given for a pipeline of one stage")
        per_stage[-1] = int(last_stage_layers)
        rest -= per_stage[-1]
        middle.remove(pp_size - 1)
    if middle:
        if rest < 0 or rest % len(middle):
            raise ValueError(f"{rest} layers do not split evenly over {len(middle)} pipeline stages")
        for p in middle:
            per_stage[p] = rest // len(middle)
    elif rest != 0:
        raise ValueError(f"stage layer counts {per_stage} do not add up to {num_layers} layers")
    for p, n in enumerate(per_stage):
        if n < 0 or n % vpp:
            raise ValueError(f"pipeline stage {p}'s {n} layers do not split evenly over {vpp} virtual stages")
    # chunk (v, p) follows every chunk (v', p') with v' < v, and (v, p') with p' < p
    start = sum(n // vpp for n in per_stage) * v + sum(n // vpp for n in per_stage[:pp_rank])
    return list(range(start, start + per_stage[pp_rank] // vpp))


def context_parallel_split(routing, cp_size: int, cp_rank: int, *, cu_seqlens_padded=None,
                           axis: int = 1) -> np.ndarray:
    """The tokens context-parallel rank ``cp_rank`` of ``cp_size`` holds, as Megatron-core splits them.

    Every sequence is cut into ``2 * cp_size`` equal chunks, and rank ``r`` takes chunks ``r`` and
    ``2 * cp_size - 1 - r`` (so that causal attention costs every rank the same). Padded batches:
    the sequence axis is ``axis`` (1 for ``[B, S, L, K]``), and ``S`` must divide by ``2 * cp_size``.
    Packed batches: pass ``cu_seqlens_padded``; the token axis is 0, every sequence is split on its
    own and must have a length divisible by ``2 * cp_size`` (pack with ``align = 2 * cp_size``).
    """
    routing = np.asarray(routing)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside a context-parallel group of {cp_size}")
    chunks = 2 * cp_size
    if cu_seqlens_padded is None:
        s = routing.shape[axis]
        if s % chunks:
            raise ValueError(f"sequence length {s} does not split into 2 * CP = {chunks} equal chunks")
        c = s // chunks
        pieces = [np.take(routing, np.arange(k * c, (k + 1) * c), axis=axis) for k in (cp_rank, chunks - 1 - cp_rank)]
        return np.concatenate(pieces, axis=axis)
    cu = np.asarray(cu_seqlens_padded, dtype=np.int64)
    if cu[0] != 0 or cu[-1] != routing.shape[0] or np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens_padded {cu.tolist()} does not cover the {routing.shape[0]} packed tokens")
    index = []
    for i in range(len(cu) - 1):
        n = int(cu[i + 1] - cu[i])
        if n % chunks:
            raise ValueError(f"packed sequence {i} has {n} tokens, not a multiple of 2 * CP = {chunks} "
                             "(pack with align = 2 * CP)")
        c = n // chunks
        for k in (cp_rank, chunks - 1 - cp_rank):
            index.append(np.arange(cu[i] + k * c, cu[i] + (k + 1) * c))
    return routing[np.concatenate(index) if index else np.zeros(0, dtype=np.int64)]


def sequence_parallel_split(routing, tp_size: int, tp_rank: int, *, axis: int = 0) -> np.ndarray:
    """The tokens tensor-parallel rank ``tp_rank`` holds under sequence parallelism: the
    ``tp_rank``-th of ``tp_size`` equal contiguous slices of the token axis ``axis`` (after the
    context-parallel split). The axis must divide by ``tp_size``."""
    routing = np.asarray(routing)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside a tensor-parallel group of {tp_size}")
    n = routing.shape[axis]
    if n % tp_size:
        raise ValueError(f"{n} tokens do not split evenly over {tp_size} sequence-parallel ranks")
    c = n // tp_size
    return np.take(routing, np.arange(tp_rank * c, (tp_rank + 1) * c), axis=axis)


def megatron_token_order(routing, *, packed: bool, cu_seqlens_padded=None, cp_size: int = 1, cp_rank: int = 0,
                         tp_size: int = 1, tp_rank: int = 0, sequence_parallel: bool = False) -> np.ndarray:
    """The rows one Megatron-core rank's routers see, in their order: ``[tokens, L, K]``.

    Megatron-core's transformer runs on ``[s, b, h]`` activations and its router flattens them, so
    router row ``i`` is token ``s = i // b`` of sequence ``i % b`` (sequence-major, not
    batch-major). Padded batches (``packed=False``): ``routing`` ``[B, S, L, K]``; packed ones
    (``packed=True``, Megatron's THD with ``b = 1``): ``routing`` ``[N, L, K]`` with
    ``cu_seqlens_padded``. The context-parallel split comes first
    (:func:`context_parallel_split`), then, with ``sequence_parallel``, the contiguous slice of the
    sequence axis that TP rank ``tp_rank`` holds (:func:`sequence_parallel_split`).
    """
    routing = np.asarray(routing)
    if packed:
        if routing.ndim != 3:
            raise ValueError(f"packed routing is [tokens, L, K], got shape {routing.shape}")
        if cp_size > 1:
            if cu_seqlens_padded is None:
                raise ValueError("a packed batch with context parallelism needs cu_seqlens_padded")
            routing = context_parallel_split(routing, cp_size, cp_rank, cu_seqlens_padded=cu_seqlens_padded)
        if sequence_parallel:
            routing = sequence_parallel_split(routing, tp_size, tp_rank, axis=0)
        return routing
    if routing.ndim != 4:
        raise ValueError(f"padded routing is [batch, seq, L, K], got shape {routing.shape}")
    if cp_size > 1:
        routing = context_parallel_split(routing, cp_size, cp_rank, axis=1)
    if sequence_parallel:
        routing = sequence_parallel_split(routing, tp_size, tp_rank, axis=1)
    s_b = np.swapaxes(routing, 0, 1)
    return np.ascontiguousarray(s_b).reshape((-1,) + routing.shape[2:])
