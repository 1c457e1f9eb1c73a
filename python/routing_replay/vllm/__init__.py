"""vLLM 0.33's routed-experts data plane (its auxiliary-output worker connector, the capturer it
binds, and the scheduler-side data classes) on routing_replay: the same constructor arguments,
methods, metadata and outputs, with each step's rows checked on the device, moved by one copy, and
filed off the engine's thread into a content-addressed block tier.

::

    from routing_replay.vllm import make_worker_connector, AuxOutputConnectorMetadata, InputBatch
    conn = make_worker_connector(num_layers=48, num_experts=128, top_k=8, max_num_batched_tokens=8192,
                                 max_num_seqs=256)
    conn.begin_step(AuxOutputConnectorMetadata(0, {"r": 0}, {}, ()))
    for layer in range(48):
        conn.capturer.capture(layer, topk_ids[layer])
    pending = conn.prepare_output(InputBatch(["r"], query_start_loc, num_computed_tokens))
    pending.enqueue_cpu_copy(num_sampled, num_rejected)
    outputs = pending.process_output()   # {"r": AuxRequestOutput(token_start, rows [n, 48, 8] uint8)}

docs/python.md (routing_replay.vllm) describes what runs where.
"""

from __future__ import annotations

from .._core import AuxRequestOutput, BlockObjectStoreError, PendingAuxOutput
from ._types import AuxOutputConnectorMetadata, InputBatch, PackedBlockHashes
from .capturer import RoutedExpertsCapturer
from .connector import AuxOutputWorkerConnector, get_aux_output_connector, make_worker_connector
from .plugin import warn_if_left_out as _warn_if_left_out

# ROUTING_REPLAY_VLLM set but left out of VLLM_PLUGINS: vLLM never calls the plugin, so say it here
_warn_if_left_out()

__all__ = [
    "AuxOutputConnectorMetadata",
    "AuxOutputWorkerConnector",
    "AuxRequestOutput",
    "BlockObjectStoreError",
    "InputBatch",
    "PackedBlockHashes",
    "PendingAuxOutput",
    "RoutedExpertsCapturer",
    "get_aux_output_connector",
    "make_worker_connector",
]
