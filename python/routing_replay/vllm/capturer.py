"""vLLM 0.33's routed-experts capturer on the library's capture path.

``capture(layer_id, topk_ids)`` writes one layer's router output into a token-major device buffer
with one small kernel (no allocation, no host synchronization: safe inside CUDA graphs, and inside
``torch.compile`` through the library's custom op). Ids are narrowed once, to the narrowest type
that holds E and a "never written" mark; an id outside ``[0, E)`` is caught on the device and
refused when its step is processed, as is a row a captured layer left unwritten. Nothing is
allocated per step: the worker connector snapshots the buffer at the end of each step into a ring.

Where vLLM is importable, rows are restored to this data-parallel rank's tokens from the forward
context as vLLM does (naive dispatch, gathered shards, a sequence-parallel shard all-gathered over
the tensor-parallel group), and micro-batches (dual-batch overlap) land at their token offset.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import numpy as np

from .. import _arrays, _core, _live, _replay_ids, _torch_capture_op
from .._native import _parse_device, _usable_cuda


def routed_experts_shape(vllm_config) -> tuple[int, int, int]:
    """(L, E, K) from ``vllm_config.model_config``, as vLLM reads them; all must be positive."""
    model_config = vllm_config.model_config
    num_layers = model_config.get_total_num_hidden_layers()
    num_experts = model_config.get_num_experts()
    top_k = model_config.get_num_experts_per_tok()
    if num_layers <= 0 or num_experts <= 0 or top_k <= 0:
        raise ValueError(
            "routed-experts capture needs positive layer, expert and experts-per-token counts, got "
            f"num_layers={num_layers}, num_experts={num_experts}, num_experts_per_tok={top_k}"
        )
    return num_layers, num_experts, top_k


def _vllm_forward_hooks():
    """vLLM's forward context, micro-batch offset and TP group where vLLM is importable, else None."""
    try:
        from vllm.distributed.parallel_state import get_tp_group
        from vllm.forward_context import get_forward_context
    except Exception:  # noqa: BLE001 - no vLLM (or a vLLM that does not import here): rows pass through
        return None
    try:
        from vllm.v1.worker.ubatching import dbo_current_ubatch_token_offset
    except Exception:  # noqa: BLE001 - a vLLM without micro-batching
        dbo_current_ubatch_token_offset = None
    return get_forward_context, dbo_current_ubatch_token_offset, get_tp_group


@contextlib.contextmanager
def _on_cuda_device(cuda, index: int):
    previous = cuda.current_device() if index >= 0 else None
    if previous is not None and previous != index:
        cuda.set_device(index)
    try:
        yield
    finally:
        if previous is not None and previous != index:
            cuda.set_device(previous)


def _output_dtype(name: str):
    torch = sys.modules.get("torch")
    return getattr(torch, name) if torch is not None else np.dtype(name)


class RoutedExpertsCapturer:
    """Captures each MoE layer's top-k expert ids into a device buffer of
    ``[max_num_batched_tokens, L, K]``.

    Args:
        max_num_batched_tokens: the most tokens of one step.
        vllm_config: vLLM's config (or an object with the fields vLLM's capturer reads:
            ``model_config.get_total_num_hidden_layers() / get_num_experts() /
            get_num_experts_per_tok()``, ``parallel_config``, ``max_concurrent_batches``).
        device: ``"cuda"``, ``"cuda:N"``, ``"cpu"`` (the host backend: numpy arrays or CPU tensors),
            or None: CUDA where the CUDA backend is built and a GPU is usable, else the host.
    """

    def __init__(self, max_num_batched_tokens: int, vllm_config, *, device=None) -> None:
        num_layers, num_experts, top_k = routed_experts_shape(vllm_config)
        self.shape_per_token = (num_layers, top_k)
        self.num_experts = num_experts
        self.max_num_batched_tokens = max_num_batched_tokens
        self.output_dtype_name = "uint8" if num_experts <= 256 else "uint16"
        self.output_dtype = _output_dtype(self.output_dtype_name)
        parallel = getattr(vllm_config, "parallel_config", None)
        self.dp_rank = int(getattr(parallel, "data_parallel_rank", 0) or 0)
        self.tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        depth = int(getattr(vllm_config, "max_concurrent_batches", 2) or 2)
        backend, index = _parse_device(device)
        if backend == "host":
            self._device = _core.create_stream_device(num_layers, top_k, num_experts, max_num_batched_tokens, depth)
        else:
            cuda = _usable_cuda(device)
            with _on_cuda_device(cuda, index):
                self._device = cuda.create_stream_device(num_layers, top_k, num_experts, max_num_batched_tokens, depth)
        self._on_host = self._device.on_host
        self._device_index = -1 if self._on_host else self._device.device
        self._vllm = _vllm_forward_hooks()
        self._id = next(_replay_ids)
        _live[self._id] = self
        self._torch_op, self._compiling = _torch_capture_op()
        self._hot = _arrays.never_hot
        if self._torch_op is not None:
            self._build_hot_path()

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:N"``."""
        return "cpu" if self._on_host else f"cuda:{self._device_index}"

    @property
    def device_bytes(self) -> int:
        """Bytes of the device buffer and its snapshots."""
        return self._device.device_bytes

    def stream_handle(self) -> int:
        """The stream calls enqueue on now: the current CUDA stream (0 on the host backend, which
        uses its own)."""
        return 0 if self._on_host else self._current_stream()

    # ---- the forward ---------------------------------------------------------------------------

    def capture(self, layer_id: int, topk_ids) -> None:
        """Records layer ``layer_id``'s router output ``[n, K (+ more columns)]`` (int64, int32 or
        int16; other integer types are converted first) on the current stream."""
        offset = 0
        if self._vllm is not None:
            topk_ids, offset = self._vllm_rows(topk_ids)
        if offset == 0 and self._hot(layer_id, topk_ids):  # eager forwards: one native call, one kernel
            return
        if self._on_host and type(topk_ids) is np.ndarray and self._device.capture_array(layer_id, topk_ids, offset):
            return
        if self._torch_op is None and _arrays.is_torch_tensor(topk_ids):  # torch arrived after __init__
            self._torch_op, self._compiling = _torch_capture_op()
            self._build_hot_path()
        if self._torch_op is not None and self._compiling():
            self._torch_op(topk_ids, self._id, layer_id, -1, offset, None)
            return
        self._capture_now(layer_id, topk_ids, offset)

    def _op_capture(self, layer: int, topk_ids, num_tokens: int, row_offset: int, physical_to_logical) -> None:
        """Body of the torch custom op (routing_replay.torch_ops): ``row_offset`` is the row of the
        step the rows start at (a micro-batch's offset)."""
        self._capture_now(layer, topk_ids, row_offset)

    def _capture_now(self, layer_id: int, topk_ids, offset: int) -> None:
        ids = _arrays.describe(topk_ids)
        if self._on_host != (ids.device == "cpu") or (not self._on_host and ids.device_index != self._device_index):
            raise ValueError(f"topk_ids is on {ids.device}:{ids.device_index}, but the capturer's buffer is on {self.device}")
        if ids.cols < self.shape_per_token[1]:
            raise ValueError(f"capture: {ids.cols} columns, fewer than num_experts_per_tok = {self.shape_per_token[1]}")
        if ids.dtype not in _NATIVE_DTYPES:  # converted once here: the kernels read int64, int32 and int16
            topk_ids = topk_ids.to(sys.modules["torch"].int32) if _arrays.is_torch_tensor(topk_ids) else np.asarray(topk_ids, np.int64)
            ids = _arrays.describe(topk_ids)
        self._device.capture_at(layer_id, ids.ptr, ids.dtype, ids.rows, ids.row_stride, offset, self.stream_handle())

    def _build_hot_path(self) -> None:
        if self._on_host:
            read_stream, key = (lambda _: 0), None
            self._current_stream = lambda: 0
        else:
            read_stream, key = _arrays.raw_stream_reader(self._device_index)
            self._current_stream = _arrays.current_stream_reader(self._device_index)
        self._hot = _arrays.torch_hot_capture(self._device.capture, self._device_index, self.shape_per_token[1],
                                              read_stream, key, self._compiling)

    def _current_stream(self) -> int:  # replaced by _build_hot_path once torch is there
        return 0 if self._on_host else _arrays.cuda_stream_handle(None)

    # ---- vLLM's row layouts --------------------------------------------------------------------

    def _vllm_rows(self, topk_ids) -> tuple[Any, int]:
        get_forward_context, ubatch_offset, _ = self._vllm
        try:
            ctx = get_forward_context()
        except Exception:  # noqa: BLE001 - outside a vLLM forward: the rows are this rank's as they are
            return topk_ids, 0
        rows = self._restore_local_topk_ids(topk_ids, ctx)
        return rows, (int(ubatch_offset()) if ubatch_offset is not None else 0)

    def _restore_local_topk_ids(self, topk_ids, ctx):
        """This data-parallel rank's rows of a router output, as laid out by vLLM's dispatch:
        without DP metadata, the batch descriptor's token count (none: all rows); with it, in this
        order, every DP rank's tokens, this rank's own, the gathered shards of every rank, a
        sequence-parallel shard (gathered over the TP group), or (no DP) every TP rank's padded
        shards. Trailing padding is trimmed."""
        n = topk_ids.shape[0]
        dp = getattr(ctx, "dp_metadata", None)
        if dp is None:
            descriptor = getattr(ctx, "batch_descriptor", None)
            if descriptor is None:
                return topk_ids
            local = int(descriptor.num_tokens)
        else:
            per_rank = [int(x) for x in dp.num_tokens_across_dp_cpu.tolist()]
            local = per_rank[self.dp_rank]
            if n == sum(per_rank):
                end = sum(per_rank[: self.dp_rank + 1])
                return topk_ids[end - local : end]
        if n == local:
            return topk_ids
        shards = getattr(dp, "local_sizes", None) if dp is not None else None
        if shards is not None and n == sum(shards):
            ranks = len(per_rank)
            if len(shards) % ranks != 0:
                raise ValueError(f"RoutedExpertsCapturer: {len(shards)} gathered shards do not divide among {ranks} DP ranks")
            first = sum(shards[: self.dp_rank * (len(shards) // ranks)])
            return topk_ids[first : first + local]
        shard = -(-local // self.tp_size)
        if n == shard:
            get_tp_group = self._vllm[2]
            return get_tp_group().all_gather(topk_ids.contiguous(), dim=0)[:local]
        if dp is None and n == shard * self.tp_size:
            return topk_ids[:local]
        raise ValueError(
            f"RoutedExpertsCapturer: a router output of {n} rows fits no layout of this rank's {local} tokens "
            f"(dp_rank={self.dp_rank}, tp_size={self.tp_size})"
        )

    def __repr__(self) -> str:
        layers, top_k = self.shape_per_token
        return (f"RoutedExpertsCapturer(L={layers}, K={top_k}, E={self.num_experts}, "
                f"N_max={self.max_num_batched_tokens}, {self.device}, out={self.output_dtype_name})")


_NATIVE_DTYPES = frozenset(_arrays.DTYPE_CODES[name] for name in ("int64", "int32", "int16"))
