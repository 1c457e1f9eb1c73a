"""The torch custom op behind :meth:`routing_replay.Replay.capture` and the drop-in capturer's
``capture`` under ``torch.compile``.

Importing this module registers ``torch.ops.routing_replay.capture`` (``routing_replay`` imports it
by itself when torch is already imported as a replay or capturer is built). Dynamo then records the
call as one opaque op instead of breaking the graph at the native call; at run time the op finds
its replay by id and captures on the current stream, so it is also safe inside CUDA graphs that
``torch.compile`` records. The op mutates no tensor: it is marked as having a side effect, so dead
code elimination keeps it.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["capture_op"]


@torch.library.custom_op("routing_replay::capture", mutates_args=())
def _capture(
    topk_ids: torch.Tensor,
    replay_id: int,
    layer: int,
    num_tokens: int,
    row_offset: int,
    physical_to_logical: Optional[torch.Tensor],
) -> None:
    from ._replay import _live

    target = _live.get(replay_id)
    if target is None:
        raise RuntimeError(f"routing_replay::capture: replay {replay_id} no longer exists")
    target._op_capture(layer, topk_ids, num_tokens, row_offset, physical_to_logical)


@_capture.register_fake
def _capture_fake(topk_ids, replay_id, layer, num_tokens, row_offset, physical_to_logical) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.routing_replay.capture.default)


def capture_op():
    """``torch.ops.routing_replay.capture``: (topk_ids, replay_id, layer, num_tokens (-1: all rows),
    row_offset, physical_to_logical or None) -> None."""
    return torch.ops.routing_replay.capture
