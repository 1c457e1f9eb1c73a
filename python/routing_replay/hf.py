"""Makes the routers of a Hugging Face ``transformers`` MoE model replay recorded routing.

Inside ``with replay(model, routing, layer_map=...)`` every router of the model returns the
recorded experts instead of its own top-k, with routing weights computed from the router's own
logits at those experts and normalised as the model's config says, so the forward uses the
rollout's experts and the gradients reach the router weights as in an ordinary training forward.

Routers this knows (transformers 5.x; each returns ``(router_logits, weights, indices)`` and the MoE
block feeds ``weights`` and ``indices`` to its experts), and the weights at the recorded experts:

- ``Qwen3MoeTopKRouter`` (Qwen3-MoE): ``softmax(logits)`` gathered, divided by their sum if
  ``norm_topk_prob``, cast to the logits' dtype;
- ``MixtralTopKRouter`` (Mixtral): ``softmax(logits)`` gathered, divided by their sum;
- ``DeepseekV3TopkRouter`` (DeepSeek-V3): ``sigmoid(logits)`` gathered (the correction bias only
  chooses), divided by their sum + 1e-20 if ``norm_topk_prob``, times ``routed_scaling_factor``.

Other routers with the same interface can be added with :func:`register_router`.

The router sees the batch's tokens flattened batch-major (``[B, S, H]`` reshaped to ``[B * S, H]``),
which is the order of :func:`routing_replay.training.padded_batch` ``[B, S, L, K]`` flattened, and
of a packed ``[N, L, K]`` batch run as one row. torch is imported when this module is.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from . import training

__all__ = ["ROUTER_RULES", "register_router", "replay", "routers"]

#: Router weights rule: ``(router module, router_logits [tokens, E], indices [tokens, K] int64) -> weights``.
WeightsRule = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _softmax_weights(module, logits, indices, always_normalise: bool):
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights = probs.gather(1, indices)
    if always_normalise or module.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def _qwen3_moe(module, logits, indices):
    return _softmax_weights(module, logits, indices, False).to(logits.dtype)


def _mixtral(module, logits, indices):
    return _softmax_weights(module, logits, indices, True)  # Mixtral keeps the float32 weights


def _deepseek_v3(module, logits, indices):
    weights = logits.sigmoid().gather(1, indices)  # e_score_correction_bias steers the choice only
    if module.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * module.routed_scaling_factor


#: Router class name -> how its weights follow from its logits at given experts.
ROUTER_RULES: dict[str, WeightsRule] = {
    "Qwen3MoeTopKRouter": _qwen3_moe,
    "MixtralTopKRouter": _mixtral,
    "DeepseekV3TopkRouter": _deepseek_v3,
}


def register_router(class_name: str, rule: WeightsRule) -> None:
    """Teaches :func:`replay` a router class: its ``forward(hidden_states)`` must return
    ``(router_logits [tokens, E], weights [tokens, K], indices [tokens, K])``, and ``rule`` must
    compute ``weights`` from ``router_logits`` at given ``indices`` exactly as the router does."""
    ROUTER_RULES[class_name] = rule


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The model's known routers by 0-based model layer (read from the module path ``...layers.N...``)."""
    found: dict[int, torch.nn.Module] = {}
    for name, module in model.named_modules():
        if type(module).__name__ in ROUTER_RULES:
            match = _LAYER.search(name)
            if match is None:
                raise ValueError(f"router {name} ({type(module).__name__}) is not inside a numbered layer")
            layer = int(match.group(1))
            if layer in found:
                raise ValueError(f"two routers in model layer {layer}")
            found[layer] = module
    return found


@contextlib.contextmanager
def replay(model: torch.nn.Module, routing, *, layer_map: training.LayerMap) -> Iterator[dict[int, torch.Tensor]]:
    """Inside the block, the routers of ``model`` return the experts of ``routing``.

    ``routing``: a padded batch ``[B, S, L, K]`` or packed tokens ``[N, L, K]`` (numpy, from
    :mod:`routing_replay.training`), its layer axis as ``layer_map`` describes; its rows are the
    tokens in the order the routers see them (batch-major). Every router must find exactly as many
    rows as it gets tokens, and every row valid ids in ``[0, E)``: a sentinel (padding built with
    ``pad_rows="sentinel"``, a final token completed with ``final_token="sentinel"``) raises here,
    naming the layer, since a router must route every token it sees. Yields the index tensors
    handed to each model layer. The routers are restored on exit, also when the block raises.
    """
    found = routers(model)
    if not found:
        raise ValueError(f"no known MoE router in {type(model).__name__} (known: {sorted(ROUTER_RULES)})")
    unknown = sorted(set(found) - set(layer_map.moe_layers))
    if unknown:
        raise ValueError(f"model layers {unknown} have routers but are not MoE layers of {layer_map!r}")
    routing = np.asarray(routing)
    if routing.ndim not in (3, 4):
        raise ValueError(f"routing is [B, S, L, K] or [N, L, K], got shape {routing.shape}")
    tokens = routing.reshape((-1,) + routing.shape[-2:])
    layers = sorted(found)
    per_layer = layer_map.take(tokens, layers)  # [tokens, len(layers), K]
    tensors: dict[int, torch.Tensor] = {}
    for slot, layer in enumerate(layers):
        module = found[layer]
        ids = per_layer[:, slot]
        if ids.shape[-1] != module.top_k:
            raise ValueError(f"model layer {layer}: routing has top-k {ids.shape[-1]}, the router {module.top_k}")
        bad = (ids < 0) | (ids >= module.num_experts)
        if bad.any():
            raise ValueError(f"model layer {layer}: {int(bad.any(axis=-1).sum())} of {len(ids)} rows hold no routing "
                             f"or ids outside [0, {module.num_experts}); build the batch with pad_rows='first_k' "
                             "and final_token='repeat' for replay")
        tensors[layer] = training.to_torch(ids, dtype="int64", device=module.weight.device)

    patched = []
    try:
        for layer in layers:
            module = found[layer]
            module.forward = _replaying_forward(module, type(module).forward, ROUTER_RULES[type(module).__name__],
                                                tensors[layer], layer)
            patched.append(module)
        yield tensors
    finally:
        for module in patched:
            del module.forward  # the class's forward again


def _replaying_forward(module: torch.nn.Module, original: Callable[..., Any], rule: WeightsRule,
                       indices: torch.Tensor, layer: int) -> Callable[..., Any]:
    def forward(hidden_states, *args, **kwargs):
        # The router's own forward computes the logits exactly as in an ordinary forward (dtype,
        # casts); only its choice is replaced.
        logits = original(module, hidden_states, *args, **kwargs)[0]
        if logits.shape[0] != indices.shape[0]:
            raise ValueError(f"model layer {layer}: the router got {logits.shape[0]} tokens, the replayed routing "
                             f"has {indices.shape[0]} rows")
        return logits, rule(module, logits, indices), indices

    return forward
