"""Hands a training batch's routing to Megatron-core's routers (``RouterReplay``, megatron-core >= 0.16).

Megatron-core builds one ``RouterReplay`` per MoE layer when ``TransformerConfig(
moe_enable_routing_replay=True)``, and keeps them in ``RouterReplay.global_router_replay_instances``
in the order the routers were instantiated (all model chunks of this process: every virtual
pipeline stage). ``RouterReplay.set_replay_data`` takes one ``[tokens, K]`` index tensor per
instance, in that order, and ``RouterReplayAction.REPLAY_FORWARD`` makes each router use them
(``scores.gather`` at the given experts, so the routing weights still come from the model's own
logits and gradients flow through them).

What this module adds is the part that is easy to get wrong: which rows and layers each instance
gets on this rank. The layer of an instance is read from its router (``TopKRouter.layer_number``,
global and 1-based, pipeline and virtual-stage offsets included), never assumed from a position;
the rows are the tokens this rank's routers see, in their order
(:func:`routing_replay.training.megatron_token_order`: context-parallel chunks, the
sequence-parallel slice, and ``[s, b]`` flattening).

Usage, per micro-batch, on every rank::

    from routing_replay import megatron as rrm, training as rrt
    batch = rrt.padded_batch(fields, attention_mask, final_token="repeat", pad_rows="first_k")
    with rrm.replay(model_chunks, batch, layer_map=rrt.LayerMap(moe_layers, num_layers)):
        output = forward_step(...)

torch and megatron-core are imported when this module is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from . import training

__all__ = ["RouterReplay", "RouterReplayAction", "replay", "replay_tensors", "router_layers", "set_replay_data"]


def _chunks(model) -> list[torch.nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _instances(model) -> list[tuple[RouterReplay, int, int]]:
    """(instance, 0-based model layer, chunk index) for every RouterReplay instance, in
    ``RouterReplay.global_router_replay_instances`` order; raises on instances of other models."""
    owner: dict[int, tuple[int, int]] = {}
    for c, chunk in enumerate(_chunks(model)):
        for module in chunk.modules():
            if isinstance(module, TopKRouter) and module.router_replay is not None:
                if module.layer_number is None:
                    raise ValueError("a TopKRouter has no layer_number: it is not inside a TransformerLayer")
                owner[id(module.router_replay)] = (int(module.layer_number) - 1, c)
    instances = RouterReplay.global_router_replay_instances
    if not instances:
        raise ValueError("no RouterReplay instances: build the model with "
                         "TransformerConfig(moe_enable_routing_replay=True)")
    missing = [i for i, inst in enumerate(instances) if id(inst) not in owner]
    if missing:
        raise ValueError(f"RouterReplay instances {missing} (of {len(instances)}) belong to no router of this model; "
                         "call RouterReplay.clear_global_router_replay_instances() before building the model")
    if len(owner) != len(instances):
        raise ValueError(f"the model has {len(owner)} replaying routers but RouterReplay lists {len(instances)}")
    return [(inst,) + owner[id(inst)] for inst in instances]


def router_layers(model, vp_stage: int | None = None) -> list[int]:
    """The 0-based model layer of each ``RouterReplay`` instance, in
    ``RouterReplay.global_router_replay_instances`` order (of model chunk ``vp_stage`` only, if given).

    ``model``: this rank's model chunk, or its list of chunks (virtual pipeline stages). Every
    instance must belong to a router of ``model``: a stale one (a model built earlier in the process)
    would shift every layer after it, so it raises; clear them with
    ``RouterReplay.clear_global_router_replay_instances()`` before building the model.
    """
    return [layer for _, layer, c in _instances(model) if vp_stage is None or c == vp_stage]


def replay_tensors(model, routing, *, layer_map: training.LayerMap, packed: bool = False, cu_seqlens_padded=None,
                   cp_size: int | None = None, cp_rank: int | None = None, tp_size: int | None = None,
                   tp_rank: int | None = None, sequence_parallel: bool | None = None, vp_stage: int | None = None,
                   device: Any = None) -> list[torch.Tensor]:
    """The ``[tokens, K]`` int64 tensors ``RouterReplay.set_replay_data`` takes on this rank.

    ``routing``: the whole batch, padded ``[B, S, L, K]`` (:func:`training.padded_batch`) or packed
    ``[N, L, K]`` (``packed=True``, with ``cu_seqlens_padded`` from :func:`training.packed_batch`),
    its layer axis as ``layer_map`` describes (MoE layers only, or all layers). Ranks and
    ``sequence_parallel`` default to Megatron's ``parallel_state`` and the model's config.
    ``vp_stage``: only the routers of model chunk ``vp_stage`` (``model`` is the list of chunks),
    for interleaved schedules that run another micro-batch on each chunk. Rows with
    no routing (the sentinel) or ids outside ``[0, num_moe_experts)`` raise, naming the layer:
    a replaying router gathers at every row, padding included (build batches with
    ``pad_rows="first_k"`` and a ``final_token`` rule other than ``"sentinel"``).
    """
    from megatron.core import parallel_state as ps

    chunks = _chunks(model)
    config = chunks[0].config
    initialized = ps.model_parallel_is_initialized()
    if cp_size is None:
        cp_size = ps.get_context_parallel_world_size() if initialized else 1
    if cp_rank is None:
        cp_rank = ps.get_context_parallel_rank() if initialized else 0
    if tp_size is None:
        tp_size = ps.get_tensor_model_parallel_world_size() if initialized else 1
    if tp_rank is None:
        tp_rank = ps.get_tensor_model_parallel_rank() if initialized else 0
    if sequence_parallel is None:
        sequence_parallel = bool(config.sequence_parallel)
    layers = router_layers(chunks, vp_stage)
    local = training.megatron_token_order(routing, packed=packed, cu_seqlens_padded=cu_seqlens_padded,
                                          cp_size=cp_size, cp_rank=cp_rank, tp_size=tp_size, tp_rank=tp_rank,
                                          sequence_parallel=sequence_parallel and tp_size > 1)
    local = layer_map.take(local, layers)  # [tokens, len(layers), K]
    num_experts = int(config.num_moe_experts)
    if local.shape[-1] != config.moe_router_topk:
        raise ValueError(f"routing has top-k {local.shape[-1]}, the model routes to {config.moe_router_topk}")
    bad = (local < 0) | (local >= num_experts)
    if bad.any():
        slot = int(np.flatnonzero(bad.any(axis=(0, 2)))[0])
        rows = int(bad[:, slot].any(axis=-1).sum())
        raise ValueError(f"model layer {layers[slot]}: {rows} of {len(local)} rows on this rank hold no routing or "
                         f"ids outside [0, {num_experts}) (sentinel {training.sentinel_of(local.dtype)}); build the "
                         "batch with pad_rows='first_k' and final_token='repeat' for replay")
    if device is None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    tensor = training.to_torch(local, dtype="int64", device=device)
    return [tensor[:, i].contiguous() for i in range(len(layers))]


def set_replay_data(model, routing, *, layer_map: training.LayerMap, action=RouterReplayAction.REPLAY_FORWARD,
                    vp_stage: int | None = None, **kwargs) -> list[torch.Tensor]:
    """Hands ``routing`` to the routers and sets ``action`` on them (``REPLAY_FORWARD``; ``None``
    leaves the actions alone). Arguments as :func:`replay_tensors`; returns the tensors handed over.

    All routers: ``RouterReplay.set_replay_data``. One model chunk (``vp_stage``): the
    ``set_target_indices`` of that chunk's instances, the others untouched. ``set_target_indices``
    also queues each tensor for ``REPLAY_BACKWARD`` (activation recompute replays them in the
    backward pass); ``RouterReplay.clear_global_indices()`` empties the queue.
    """
    tensors = replay_tensors(model, routing, layer_map=layer_map, vp_stage=vp_stage, **kwargs)
    if vp_stage is None:
        RouterReplay.set_replay_data(tensors)
        if action is not None:
            RouterReplay.set_global_router_replay_action(action)
        return tensors
    chunk = [inst for inst, _, c in _instances(model) if c == vp_stage]
    for inst, tensor in zip(chunk, tensors):
        inst.set_target_indices(tensor)
        if action is not None:
            inst.set_router_replay_action(action)
    return tensors


@contextlib.contextmanager
def replay(model, routing, *, layer_map: training.LayerMap, vp_stage: int | None = None,
           **kwargs) -> Iterator[Sequence[torch.Tensor]]:
    """``with replay(model, batch, layer_map=...)``: routers replay ``batch`` inside the block (all of
    them, or those of chunk ``vp_stage``); their indices and actions are cleared on exit (also when
    the block raises), so a later forward routes on its own again."""
    tensors = set_replay_data(model, routing, layer_map=layer_map, vp_stage=vp_stage, **kwargs)
    try:
        yield tensors
    finally:
        for inst, _, c in _instances(model):
            if vp_stage is None or c == vp_stage:
                inst.clear_indices()
                inst.clear_router_replay_action()
