"""A drop-in for the routed-experts capturer of vLLM PR 39917, on top of routing_replay.

Engine code written against that capturer swaps one line::

    capturer = RoutedExpertsCapturer(num_layers, top_k, num_batched_tokens, max_model_len,
                                     num_fused_shared_experts, device)

and keeps calling ``capture(layer_id, topk_ids)`` inside the forward,
``sync_fwd_experts_buffer_DtoH(positions, num_scheduled_tokens)`` after it,
``finalize_pending_copy()`` and ``get_routed_experts(req_id, seqlen, free_slot)``.

Underneath, every step is a routing_replay step plan built from the positions the engine hands
over (never from counters), and rows leave the GPU without the host copying them: by default
(``device_scatter``) a kernel on a side stream writes each row straight into its request's pinned
host storage, so the engine's thread neither waits for the step just issued nor files rows.

How the capture fits the library's order: the library wants a step's plan before its forward,
and this interface gives the positions only after it. So ``capture`` writes a private staging
buffer (one small kernel, graph safe, any integer dtype), and ``sync_fwd_experts_buffer_DtoH`` opens
the step and closes it: the library's end-of-step kernel moves the staged rows into its device
buffer first (checking every id as the library's capture paths do and reporting an invalid one
with its value), so the staged rows cost no launch of their own. Layers that were not captured
read as missing and fail the step, as with the library's own capture.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from . import _arrays
from ._core import base64_encode
from ._record import record_options
from ._replay import Replay, _live, _replay_ids, _torch_capture_op
from ._wire import sentinel

__all__ = ["RoutedExpertsCapturer"]


class RoutedExpertsCapturer:
    """Captures routed experts during the forward and returns them per request as ``[T, L, K]``.

    Args:
        num_layers: L, MoE layers captured; ``capture(layer_id, ...)`` takes ``layer_id`` in
            ``[0, L)`` (or the model layer indices given as ``moe_layers``).
        top_k: K, routed experts per token.
        num_batched_tokens: the most tokens of one forward (vLLM's ``max_num_batched_tokens``).
        max_model_len: positions lie in ``[0, max_model_len)``.
        num_fused_shared_experts: columns after the first K of ``topk_ids`` (skipped).
        device: where forwards run: ``"cuda"``, ``"cuda:N"``, a ``torch.device``, or ``"cpu"`` for the
            host backend (numpy or CPU tensors).
        num_experts: E, for the range check of ids (default: the largest E the index type holds,
            which then only refuses negative ids and ids past that).
        moe_layers: the model layer index of each captured layer (default ``range(num_layers)``).
        index, layout, copy: routing_replay policies (defaults: ``int16``, ``layer_major``,
            ``device_scatter``: no host work per row on the engine's thread); storage is per request.
        host_memory_limit: cap on host bytes of stored rows.
        host_memory_ahead: host bytes a worker thread keeps mapped ahead of need (None: two full
            steps' rows; 0: none).
    """

    def __init__(
        self,
        num_layers: int,
        top_k: int,
        num_batched_tokens: int,
        max_model_len: int,
        num_fused_shared_experts: int = 0,
        device="cuda",
        *,
        num_experts: int | None = None,
        moe_layers: Iterable[int] | None = None,
        index: str = "int16",
        layout: str = "layer_major",
        copy: str = "device_scatter",
        host_memory_limit: int | None = None,
        host_memory_ahead: int | None = None,
    ) -> None:
        if num_experts is None:
            info = np.iinfo(np.dtype(index))
            num_experts = int(info.max) + 1 if info.min < 0 else int(info.max)
        self.num_layers = num_layers
        self.num_experts_per_tok = top_k
        self.num_batched_tokens = num_batched_tokens
        self.max_model_len = max_model_len
        self.num_fused_shared_experts = num_fused_shared_experts
        # its callers are torch engines: torch imported first, so the replay builds its hot paths
        self._torch_op, self._compiling = _torch_capture_op(import_torch=True)
        self._replay = Replay(
            num_experts=num_experts,
            top_k=top_k,
            max_tokens_per_step=num_batched_tokens,
            max_model_len=max_model_len,
            moe_layers=range(num_layers) if moe_layers is None else moe_layers,
            device=device,
            index=index,
            layout=layout,
            copy=copy,
            storage="per_request",
            num_fused_shared_experts=num_fused_shared_experts,
            host_memory_limit=host_memory_limit,
            host_memory_ahead=host_memory_ahead,
            _staging=True,
        )
        # built once at the engine's start-up: the first steps of new requests then take host memory
        # that is mapped (and registered) already, not a prefill's megabytes mapped on the step's path
        self._replay.wait_for_host_memory_ahead()
        self._native = self._replay._native
        self._id = next(_replay_ids)
        _live[self._id] = self

    @property
    def replay(self) -> Replay:
        """The routing_replay.Replay underneath (its extraction, npy and accounting calls)."""
        return self._replay

    # ---- the forward --------------------------------------------------------------------------

    def capture(self, layer_id: int, topk_ids) -> None:
        """Records one layer's router output ``topk_ids`` ``[n, K (+shared)]``, any integer dtype,
        on the current stream: one small kernel, safe inside CUDA graphs and ``torch.compile``."""
        replay = self._replay
        if replay._hot_staged(layer_id, topk_ids):  # eager forwards: one native call, one kernel
            return
        if replay._on_host and replay._capture_numpy(layer_id, topk_ids, True):
            return
        if self._torch_op is None and _arrays.is_torch_tensor(topk_ids):
            self._torch_op, self._compiling = _torch_capture_op()
            self._replay._torch_arrived()
        if self._torch_op is not None and self._compiling():
            self._torch_op(topk_ids, self._id, layer_id, -1, 0, None)
            return
        self._stage(layer_id, topk_ids, None)

    def _stage(self, layer_id: int, topk_ids, stream) -> None:
        ids = self._replay._check_array(topk_ids)
        if ids.cols < self.num_experts_per_tok:
            raise ValueError(f"capture: {ids.cols} columns, fewer than top_k = {self.num_experts_per_tok}")
        self._native.stage_capture(layer_id, ids.ptr, ids.dtype, ids.rows, ids.row_stride,
                                   self._replay.stream_handle(stream))

    def _op_capture(self, layer: int, topk_ids, num_tokens: int, row_offset: int, physical_to_logical) -> None:
        """Body of the torch custom op (routing_replay.torch_ops)."""
        self._stage(layer, topk_ids, None)

    # ---- after the forward --------------------------------------------------------------------

    def sync_fwd_experts_buffer_DtoH(self, positions, num_scheduled_tokens: Mapping[Any, int] | None = None,
                                     **legacy: Any) -> None:
        """Files the forward just enqueued: ``positions`` (CPU int64 tensor or array) holds the step's
        token positions in batch order, ``num_scheduled_tokens`` maps each request id to its tokens
        this step, in the same order. Requests seen for the first time are added.

        Issues the copy on the side stream and files earlier steps whose copies have finished;
        never waits for this step's copy.

        Raises:
            routing_replay.Error: a step's routing was refused (invalid id, uncaptured layer...),
                named with its step, layer, row and request.
        """
        if num_scheduled_tokens is None:  # an older spelling of the argument
            num_scheduled_tokens = legacy.pop("num_scheduled_tokes")
        if legacy:
            raise TypeError(f"unexpected arguments {sorted(legacy)}")
        stream = self._replay._current_stream()
        if not num_scheduled_tokens:
            self._native.reset_staging(stream)
            return
        if type(positions) is not np.ndarray:
            positions = positions.numpy() if _arrays.is_torch_tensor(positions) else np.asarray(positions, np.int64)
        if not isinstance(num_scheduled_tokens, dict):
            num_scheduled_tokens = dict(num_scheduled_tokens)
        # one native pass over the dict: each id's handle from a cache (new ids are added), positions
        # checked, the step committed (or, if no request has tokens, the staged rows reset)
        self._native.commit_scheduled(num_scheduled_tokens, positions, stream)

    def finalize_pending_copy(self) -> None:
        """Waits for every step still being copied and files it."""
        self._replay.drain()

    # ---- results ------------------------------------------------------------------------------

    def get_routed_experts(self, req_id, seqlen: int | None = None, free_slot: bool = True, *,
                           record=False) -> np.ndarray | bytes | None:
        """The request's routing as a numpy ``[T, L, K]`` array (an independent copy), its first
        ``seqlen`` rows when given; None for an unknown request or one with no rows. ``free_slot``
        releases the request afterwards. Rows never recorded hold the index type's sentinel.

        ``record`` (off by default; as :meth:`routing_replay.Replay.extract`'s): the same rows as a
        route record, ``bytes`` written straight from storage (first position 0, the capturer's
        ``moe_layers``, E ``num_experts``; rows never recorded missing), which
        ``routing_replay.wire.decode`` reads back."""
        if record_options(record) is not None:
            return self._finished(req_id, seqlen, free_slot,
                                  lambda end: self._replay.extract(req_id, 0, end, record=record))
        return self._finished(req_id, seqlen, free_slot, lambda end: self._replay.extract(req_id, 0, end, copy=True))

    def get_routed_experts_base64(self, req_id, seqlen: int | None = None, free_slot: bool = True, *,
                                  record=False) -> str | None:
        """As :meth:`get_routed_experts`, as vLLM's ``routed_experts`` field (base64 of a ``.npy``),
        written straight from storage without a numpy copy; with ``record``, base64 of the route
        record in the field's place (decode it with ``routing_replay.wire.decode(base64.b64decode(field))``)."""
        if record_options(record) is not None:
            return self._finished(req_id, seqlen, free_slot, lambda end: base64_encode(
                self._replay.extract(req_id, 0, end, record=record)))
        return self._finished(req_id, seqlen, free_slot, lambda end: self._replay.extract_base64_npy(req_id, 0, end))

    def _finished(self, req_id, seqlen, free_slot, read):
        if req_id not in self._replay:
            return None
        recorded = self._replay.recorded_rows(req_id)
        result = None
        if recorded > 0:
            result = read(recorded if seqlen is None else max(0, min(recorded, seqlen)))
        if free_slot:
            self._replay.release(req_id)
        return result

    def abort(self, req_id) -> None:
        """Forgets a request at once (its rows still in flight are dropped)."""
        if req_id in self._replay:
            self._replay.abort(req_id)

    def reset_device_buffer(self) -> None:
        """Forgets rows staged by forwards that no step will file (warm-up, profiling or dummy
        runs), on the current stream. The next ``sync_fwd_experts_buffer_DtoH`` resets what its own
        forward staged by itself."""
        self._native.reset_staging(self._replay.stream_handle(None))

    @property
    def sentinel(self) -> int:
        """The value of rows never recorded."""
        return sentinel(self._native.index_dtype)

    def __repr__(self) -> str:
        return (f"RoutedExpertsCapturer(L={self.num_layers}, K={self.num_experts_per_tok}, "
                f"N_max={self.num_batched_tokens}, {self._replay.device}, copy={self._replay.policies['copy']})")

