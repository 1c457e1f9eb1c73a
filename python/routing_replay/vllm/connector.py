"""vLLM 0.33's auxiliary-output worker connector for routed experts, on routing_replay.

Each step, as vLLM drives it::

    conn.begin_step(metadata)                   # emit starts, new block hashes, finished requests
    ... forward: conn.capturer.capture(layer_id, topk_ids)
    pending = conn.prepare_output(input_batch)  # one kernel: check, snapshot, reset (compute stream)
    pending.enqueue_cpu_copy(num_sampled, num_rejected)  # one copy to host memory (output stream)
    outputs = pending.process_output()          # {request id: AuxRequestOutput(token_start, rows)}

Rows stream out from each request's emit cursor; rejected draft rows are dropped; full blocks are
filed by a background thread into a content-addressed block tier keyed by the KV block hashes, so
a request whose prefix hits the KV cache gets those rows back from it. Everything vLLM asserts is
refused with an exception that names the request, the range and the block; a needed block that is
gone raises BlockObjectStoreError. Outputs are numpy views of the step's host copy where the rows
came in the step: a slice of a pool of pinned memory that a thread of its own faults in ahead of
need. Keeping an output (vLLM's in-process output processor keeps every step's rows until the
request finishes) keeps its slice; the slice goes back to the pool when the last view of it goes.
The pool holds ``kept_budget_bytes`` and grows past it, on its own thread, while consumers keep
more, so a step never faults a page in for its outputs (``kept_pool``: its figures).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np

from .. import _arrays, _core
from .capturer import RoutedExpertsCapturer


def _is_output_rank() -> bool:
    """vLLM's tensor-parallel first rank owns the data plane; without vLLM (or its groups) every
    process does."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return bool(get_tp_group().is_first_rank)
    except Exception:  # noqa: BLE001 - no vLLM, or its parallel groups are not set up
        return True


def _block_sizes(kv_cache_config, vllm_config) -> tuple[int, int]:
    """(scheduler block size, hash block size): vLLM's own resolution where it is importable and
    the configs are vLLM's, else the KV cache config's block size for both."""
    try:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        scheduler, hashed = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        return int(scheduler), int(hashed)
    except Exception:  # noqa: BLE001 - no vLLM, or configs made without it
        return int(kv_cache_config.block_size), int(kv_cache_config.block_size)


def _bind(model, capturer: RoutedExpertsCapturer) -> None:
    """Attaches the capturer to the model's MoE routers with vLLM's own binding (needs vLLM)."""
    if model is None:
        return
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

    bind_routed_experts_capturer(model, capturer)


class AuxOutputWorkerConnector:
    """The worker side of vLLM 0.33's routed-experts auxiliary output (see the module docstring).

    Args:
        vllm_config: vLLM's config, or an object with the fields vLLM reads (``model_config``,
            ``parallel_config``, ``scheduler_config.max_num_batched_tokens / max_num_seqs``,
            ``max_concurrent_batches``, ``aux_output_config.max_bytes``).
        model: the model whose routers get the capturer (vLLM's binding), or None.
        kv_cache_config: ``block_size`` (the hash block) and ``num_blocks`` (the default budget:
            one block of rows per KV block).
        device: as for :class:`RoutedExpertsCapturer`.
        kept_budget_bytes: host memory for outputs the pool faults in at construction and keeps
            (None: the steps in flight at once plus two full steps, in whole extents of two full
            steps); consumers that keep more make it grow past the budget off the engine's thread.
    """

    def __init__(self, *, vllm_config, model, kv_cache_config, device=None, kept_budget_bytes: int | None = None) -> None:
        scheduler = vllm_config.scheduler_config
        max_num_batched_tokens = scheduler.max_num_batched_tokens
        capturer = RoutedExpertsCapturer(max_num_batched_tokens=max_num_batched_tokens, vllm_config=vllm_config,
                                         device=device)
        _bind(model, capturer)
        self._capturer = capturer
        self._native = None
        self._max_concurrent_batches = vllm_config.max_concurrent_batches
        if not _is_output_rank():  # every rank captures (collectives); the output rank files
            return
        layers, top_k = capturer.shape_per_token
        itemsize = np.dtype(capturer.output_dtype_name).itemsize
        scheduler_block_size, hash_block_size = _block_sizes(kv_cache_config, vllm_config)
        block_nbytes = hash_block_size * layers * top_k * itemsize
        max_bytes = vllm_config.aux_output_config.max_bytes
        if max_bytes is None:
            max_bytes = kv_cache_config.num_blocks * (scheduler_block_size // hash_block_size) * block_nbytes
        if max_bytes < block_nbytes:
            raise ValueError(f"auxiliary output store of {max_bytes} bytes holds no block of {block_nbytes} bytes")
        current_stream = None if capturer._on_host else _arrays.current_stream_reader(capturer._device_index)
        self._native = _core.VllmStreams(capturer._device, hash_block_size, scheduler.max_num_seqs,
                                         max_num_batched_tokens, vllm_config.max_concurrent_batches, max_bytes,
                                         current_stream, -1 if kept_budget_bytes is None else int(kept_budget_bytes))
        if current_stream is not None:
            read, key = _arrays.raw_stream_reader(capturer._device_index)
            if key is not None:  # torch's builtin, called natively once torch holds its CUDA state
                self._native.use_raw_stream_reader(read, key, sys.modules["torch"].cuda.is_initialized)
        # the engine's calls go to the native methods without a Python frame in between
        self.begin_step = self._native.begin_step
        self.prepare_output = self._native.prepare_output

    @property
    def capturer(self) -> RoutedExpertsCapturer:
        """The capturer the model's routers call."""
        return self._capturer

    def begin_step(self, metadata) -> None:
        """Applies one scheduler step's metadata (AuxOutputConnectorMetadata, or None). On the output
        rank this is the native method itself."""
        if self._native is not None:
            self._native.begin_step(metadata)

    def prepare_output(self, input_batch):
        """Snapshots the step on the current stream: a PendingAuxOutput, or None off the output rank
        or without step metadata. On the output rank this is the native method itself."""
        if self._native is None:
            return None
        return self._native.prepare_output(input_batch)

    def process_output(self, pending) -> dict:
        """Files a step whose copy was enqueued and returns its outputs by request id."""
        return pending.process_output()

    def close(self) -> None:
        """Waits for filing and closes the block tier: later steps that would update it raise."""
        if self._native is not None:
            self._native.close()

    # ---- introspection -------------------------------------------------------------------------

    def tier_stats(self) -> dict:
        """The block tier's figures (stored, limit, evictable blocks, arena bytes, growths)."""
        return {} if self._native is None else self._native.tier_stats()

    @property
    def kept_pool(self) -> dict:
        """The pool of output memory: ``size_bytes`` held (faulted in) and ``size_high_water_bytes``,
        ``in_use_bytes`` (outputs not let go) and ``high_water_bytes``, ``budget_bytes``,
        ``ahead_bytes`` (kept free beyond those in use), ``extent_bytes``, ``slices`` taken,
        ``extents_made`` by its filling thread (``extents_over_budget`` of them past the budget),
        ``extents_in_step`` (made on the engine's thread: nothing was ready), ``extents_freed``,
        ``filling_failed``. Empty off the output rank."""
        return {} if self._native is None else self._native.kept_pool

    @property
    def kept_budget_bytes(self) -> int:
        """The output pool's budget; setting it makes the filling thread fault in up to it."""
        return 0 if self._native is None else self._native.kept_budget_bytes

    @kept_budget_bytes.setter
    def kept_budget_bytes(self, value: int) -> None:
        if self._native is not None:
            self._native.kept_budget_bytes = int(value)

    @property
    def native(self):
        """The native data plane (None off the output rank)."""
        return self._native


def get_aux_output_connector(model, vllm_config, kv_cache_config) -> AuxOutputWorkerConnector:
    """The connector for a model, as vLLM builds its own."""
    return AuxOutputWorkerConnector(model=model, vllm_config=vllm_config, kv_cache_config=kv_cache_config)


def make_worker_connector(num_layers: int, num_experts: int, top_k: int, max_num_batched_tokens: int,
                          max_num_seqs: int, *, block_size: int = 16, num_kv_blocks: int = 65536,
                          max_concurrent_batches: int = 2, max_bytes: int | None = None,
                          device=None, kept_budget_bytes: int | None = None) -> AuxOutputWorkerConnector:
    """A connector without vLLM: the config objects are made here, with the fields vLLM's code reads
    (one data-parallel rank, one tensor-parallel rank). No model is bound: call
    ``connector.capturer.capture`` yourself."""
    model_config = SimpleNamespace(get_total_num_hidden_layers=lambda: num_layers, get_num_experts=lambda: num_experts,
                                   get_num_experts_per_tok=lambda: top_k,
                                   hf_text_config=SimpleNamespace(model_type="routing_replay"))
    vllm_config = SimpleNamespace(
        model_config=model_config,
        parallel_config=SimpleNamespace(data_parallel_rank=0, tensor_parallel_size=1),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs),
        max_concurrent_batches=max_concurrent_batches,
        aux_output_config=SimpleNamespace(max_bytes=max_bytes),
    )
    kv_cache_config = SimpleNamespace(block_size=block_size, num_blocks=num_kv_blocks)
    return AuxOutputWorkerConnector(vllm_config=vllm_config, model=None, kv_cache_config=kv_cache_config, device=device,
                                    kept_budget_bytes=kept_budget_bytes)
