"""The :class:`Replay` class: one compiled ``RoutingReplay`` instantiation driven from Python
(requests, steps, capture, extraction), and the registry of live replays the torch custom op
(:mod:`routing_replay.torch_ops`) and the drop-in capturer (:mod:`routing_replay.capturer`) reach
them through. Re-exported by the package as ``routing_replay.Replay``; the native modules and
policy names come from :mod:`routing_replay._native`, the sentinel from :mod:`routing_replay._wire`.

Over 400 lines because it is one class: every method is a thin, documented call into the native
``Replay`` (most are a line or two of checks and a docstring), kept together so that the Python face
of ``RoutingReplay`` reads in one place."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import sys
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from . import _arrays, _core, _jit
from ._core import Config, Error, HostStream, StepPlan
from ._native import (COPY_STRATEGIES, INDEX_TYPES, LAYOUTS, STORAGES, _cuda_device, _parse_device,
                      _policy_error, _usable_cuda)
from ._record import record_options
from ._wire import sentinel

_replay_ids = itertools.count(1)
#: Live replays and capturers by id, for the torch custom op (routing_replay.torch_ops).
_live: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()

_MIB = 1 << 20


def _kept_pool_for(request_bytes: int):
    """A pool for copies of requests of at most `request_bytes`: extents of one such request (2 to
    16 MiB; a larger copy gets memory of its own, faulted in on the calling thread), two kept ahead,
    a budget of two."""
    extent = min(max(request_bytes, 2 * _MIB), 16 * _MIB)
    extent = (extent + 2 * _MIB - 1) // (2 * _MIB) * (2 * _MIB)
    return _core.KeptPool(extent, 2 * extent)


class Replay:
    """One compiled ``RoutingReplay<Backend, Index, Layout, Copy, Storage>``, chosen by arguments.

    Args:
        num_experts: E, routed experts per MoE layer (ids ``[0, E)`` are valid).
        top_k: K, experts per token and layer.
        max_tokens_per_step: N_max, the most rows (tokens) of one step.
        max_model_len: positions lie in ``[0, max_model_len)``.
        moe_layers: the layer map: the model layer index of each captured layer, in capture order.
        device: ``"cpu"``/``"host"`` (host backend), ``"cuda"`` or ``"cuda:N"`` (CUDA backend), a
            ``torch.device``, or ``None``: CUDA if available, else host.
        index: stored id type, one of :data:`INDEX_TYPES`.
        layout: device-buffer layout, one of :data:`LAYOUTS`.
        copy: copy strategy, one of :data:`COPY_STRATEGIES`.
        storage: host storage, one of :data:`STORAGES`.
        num_fused_shared_experts: extra router-output columns after the first K, skipped.
        num_model_layers: layers of the model (0: one past the last MoE layer).
        block_size, num_blocks: KV blocks (``block_slot`` storage).
        host_memory_limit: cap on host bytes of stored rows (None: no cap).
        host_memory_ahead: per-request storage: host bytes a worker thread keeps mapped and faulted
            in ahead of need, so steps of new requests do not map fresh pages (None: two full steps'
            rows; 0: no thread); block-slot storage: bytes of position metadata (24 a position) made
            when built, which released requests' pages return to (None: two steps of positions).
        overwrite_recomputed_rows: preemption: keep the latest routing of a position, not the first.
        copy_stream: the side stream copies run on (side-stream strategies; default: the replay's
            own). It must outlive the replay; the replay keeps a reference to it.

    Raises:
        Error: the library refused the configuration (``code`` says why).
        ValueError: a policy name is unknown.
        RuntimeError: the combination was not compiled ahead of time and cannot be compiled here
            (no compiler; the message names it and the install option that compiles everything ahead).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        max_tokens_per_step: int,
        max_model_len: int,
        moe_layers: Iterable[int],
        *,
        device=None,
        index: str = "int16",
        layout: str = "layer_major",
        copy: str = "sync",
        storage: str = "per_request",
        num_fused_shared_experts: int = 0,
        num_model_layers: int = 0,
        block_size: int = 0,
        num_blocks: int = 0,
        host_memory_limit: int | None = None,
        host_memory_ahead: int | None = None,
        overwrite_recomputed_rows: bool = False,
        copy_stream=None,
        _staging: bool = False,
    ) -> None:
        config = Config()
        config.num_experts = num_experts
        config.top_k = top_k
        config.max_tokens_per_step = max_tokens_per_step
        config.max_model_len = max_model_len
        config.moe_layers = [int(layer) for layer in moe_layers]
        config.num_fused_shared_experts = num_fused_shared_experts
        config.num_model_layers = num_model_layers
        config.block_size = block_size
        config.num_blocks = num_blocks
        if host_memory_limit is not None:
            config.host_memory_limit = host_memory_limit
        if host_memory_ahead is not None:
            config.host_memory_ahead = host_memory_ahead
        config.overwrite_recomputed_rows = overwrite_recomputed_rows
        for value, allowed, what in ((index, INDEX_TYPES, "index"), (layout, LAYOUTS, "layout"),
                                     (copy, COPY_STRATEGIES, "copy"), (storage, STORAGES, "storage")):
            if value not in allowed:
                raise ValueError(f"{what} must be one of {allowed}, got {value!r}")

        backend, device_index = _parse_device(device)
        self._copy_stream = copy_stream  # keeps it alive as long as the replay
        if backend == "host":
            if copy_stream is not None and not isinstance(copy_stream, HostStream):
                raise TypeError("the host backend's copy_stream is a routing_replay.HostStream")
            _jit.ensure("host", index, layout, _core)  # compiled on first use where not ahead of time
            try:
                native = _core.create(index, layout, copy, storage, config, copy_stream, _staging)
            except Error as e:
                raise _policy_error(e) from None
            self._default_stream: HostStream | None = HostStream()
        else:
            cuda = _usable_cuda(device)
            handle = None if copy_stream is None else _arrays.cuda_stream_handle(copy_stream)
            _jit.ensure("cuda", index, layout, cuda)
            with _cuda_device(cuda, device_index):
                try:
                    native = cuda.create(index, layout, copy, storage, config, handle, _staging)
                except Error as e:
                    raise _policy_error(e) from None
            self._default_stream = None
        self._native = native
        self._on_host = native.on_host
        self._held_stream = None
        self._top_k = top_k
        # what capture()'s hot path compares against: the device index a tensor reports
        # (get_device(): -1 on the CPU) and this replay's current stream, read without building
        # a stream object
        self._device_index = -1 if self._on_host else native.device
        self._current_stream = None
        if self._on_host:
            default_handle = self.stream_handle(None)  # held from now on
            self._current_stream = lambda: default_handle
        else:
            self._current_stream = _arrays.current_stream_reader(native.device)
        # copies of per-request views (extract(copy=True), the drop-in's get_routed_experts) a
        # consumer keeps: memory faulted in ahead by a thread of the pool's own (docs/kept_outputs.md)
        self._kept = _kept_pool_for(max_model_len * len(config.moe_layers) * top_k * np.dtype(index).itemsize) \
            if storage == "per_request" else None
        self._id = next(_replay_ids)
        _live[self._id] = self
        self._torch_op, self._compiling = _torch_capture_op()
        self._hot, self._hot_staged = _arrays.never_hot, _arrays.never_hot
        if self._torch_op is not None:
            self._build_hot_paths()

    # ---- shape and accounting ------------------------------------------------------------------

    @property
    def backend(self) -> str:
        """``"host"`` or ``"cuda"``."""
        return "host" if self._on_host else "cuda"

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:N"``: where the device buffer lives."""
        return "cpu" if self._on_host else f"cuda:{self._native.device}"

    @property
    def policies(self) -> dict[str, str]:
        """The instantiation: ``backend``, ``index``, ``layout``, ``copy``, ``storage``."""
        return self._native.policies

    @property
    def config(self) -> Config:
        """The validated configuration (a copy)."""
        return self._native.config

    @property
    def index_dtype(self) -> np.dtype:
        """The numpy dtype of stored ids (and of extracted arrays)."""
        return np.dtype(self._native.index_dtype)

    @property
    def sentinel(self) -> int:
        """The value of missing rows: -1 for signed index types, the maximum for unsigned ones."""
        return sentinel(self._native.index_dtype)

    @property
    def num_layers(self) -> int:
        """L: captured MoE layers."""
        return self._native.num_layers

    @property
    def top_k(self) -> int:
        """K."""
        return self.config.top_k

    @property
    def device_bytes(self) -> int:
        """Bytes of the device buffer D (N_max * L * K * itemsize)."""
        return self._native.device_bytes

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of the device snapshots the copies read (one D per ring slot)."""
        return self._native.snapshot_bytes

    @property
    def host_bytes(self) -> int:
        """Bytes of host row storage in use."""
        return self._native.host_bytes

    @property
    def steps_in_flight(self) -> int:
        """Steps copied but not yet filed (deferred copy strategies)."""
        return self._native.steps_in_flight

    @property
    def num_requests(self) -> int:
        """Live requests."""
        return self._native.num_requests

    def wait_for_host_memory_ahead(self) -> None:
        """Blocks until the host row memory kept ahead of need (``host_memory_ahead``) is mapped and,
        for device scatter, registered: call it once at start-up, so that the first steps of new
        requests take memory that is ready. Returns at once for block_slot storage and where nothing
        is kept ahead."""
        self._native.wait_for_host_memory_ahead()

    @property
    def live_views(self) -> int:
        """Zero-copy extractions still alive (see :meth:`extract`)."""
        return self._native.live_views

    def layer_slot(self, model_layer: int) -> int:
        """The captured index of a model layer (raises Error ``unknown_layer`` if not captured)."""
        return self._native.layer_slot(model_layer)

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: int | str, prompt_length: int = -1, cached_slots=None) -> int:
        """Registers a request that asked for its routing (others are only ``StepPlan.skip``-ped).

        ``prompt_length`` splits prompt and generation rows; ``cached_slots`` (a prefix-cache hit)
        names the KV slots holding positions ``[0, len(cached_slots))``.

        Returns the request's handle (an ``int``): keep it beside the engine's request and schedule
        steps with :meth:`StepPlan.schedule_handles`, which then costs no id lookup per request. A
        handle of a released or aborted request is refused, never taken for a later one.
        """
        return self._native.add_request(request_id, prompt_length, cached_slots)

    def handle(self, request_id: int | str) -> int:
        """The handle of a live request (what :meth:`add_request` returned)."""
        return self._native.handle(request_id)

    def add_cached_prefix(self, request_id: int | str, cached_slots) -> None:
        """A live request restarts with positions ``[0, len(cached_slots))`` served from the prefix cache."""
        self._native.add_cached_prefix(request_id, cached_slots)

    def __contains__(self, request_id: int | str) -> bool:
        """Whether a request is live."""
        return self._native.contains(request_id)

    def recorded_rows(self, request_id: int | str) -> int:
        """T: one past the highest committed position (files the request's steps in flight first)."""
        return self._native.recorded_rows(request_id)

    def accept_draft(self, request_id: int | str, num_accepted: int) -> None:
        """Resolves the request's oldest pending draft group: the first ``num_accepted`` drafts are kept."""
        self._native.accept_draft(request_id, num_accepted)

    def release(self, request_id: int | str) -> None:
        """Forgets a finished request and frees its rows.

        Raises:
            BufferError: a zero-copy extraction of the request is still alive.
        """
        self._native.release(request_id)

    def abort(self, request_id: int | str) -> None:
        """Drops a request at any time (raises BufferError while a zero-copy extraction of it lives)."""
        self._native.abort(request_id)

    # ---- extraction ----------------------------------------------------------------------------

    def extract(
        self,
        request_id: int | str,
        start_position: int = 0,
        end_position: int | None = None,
        *,
        prompt_length: int | None = None,
        include_dense_layers: bool = False,
        copy: bool = False,
        record=False,
    ) -> np.ndarray | bytes:
        """A request's routing, rows ``[start_position, end_position)``, as a numpy ``[T, L, K]`` array.

        With ``per_request`` storage the array is a read-only zero-copy view of the storage (unless
        ``copy=True`` or ``include_dense_layers``). While such a view (or any array derived from it)
        is alive, :meth:`release`, :meth:`abort` and a step that schedules the request raise
        ``BufferError``: delete the views, or extract with ``copy=True``. Other extractions are owned
        copies. Missing rows hold :attr:`sentinel`. ``end_position`` clips (default: the recorded
        length); ``include_dense_layers`` returns every model layer, dense ones as the sentinel.

        ``record`` (off by default): the same rows as a route record (docs/wire.md), ``bytes``
        encoded from the storage where the rows lie, without the array: its ``token_start`` is
        ``start_position``, its layer map the replay's ``moe_layers``, its E and K the replay's, rows never
        recorded (or stale) missing rows; ``routing_replay.wire.decode`` reads it back. ``True``
        for the packed codec, a codec name (``"zstd"``), or a dict of ``codec``, ``ordered``,
        ``chunk_tokens``, ``zstd_level``. Not with ``include_dense_layers`` or ``copy``.
        """
        end = -1 if end_position is None else end_position
        options = record_options(record)
        if options is not None:
            if include_dense_layers or copy:
                raise ValueError("extract(record=...) writes the captured layers from storage: include_dense_layers "
                                 "and copy do not apply")
            return self._native.extract_record(request_id, start_position, end, options.codec, options.ordered,
                                               options.chunk_tokens, options.zstd_level, False)
        prompt = -1 if prompt_length is None else prompt_length
        if copy and self._kept is not None and not include_dense_layers:
            view = self._native.extract(request_id, start_position, end, prompt, False, False)
            out = self._kept.array(view.shape, view.dtype.name)
            np.copyto(out, view)
            return out
        return self._native.extract(request_id, start_position, end, prompt, include_dense_layers, copy)

    @property
    def kept_pool(self) -> dict:
        """The pool extraction copies come from (per-request storage; empty otherwise): its figures,
        as ``routing_replay.vllm``'s ``connector.kept_pool``."""
        return {} if self._kept is None else self._kept.stats

    def extract_npy(self, request_id: int | str, start_position: int = 0, end_position: int | None = None, *,
                    include_dense_layers: bool = False) -> bytes:
        """The bytes of a ``.npy`` file with the request's routing (see :meth:`extract`)."""
        return self._native.extract_npy(request_id, start_position, -1 if end_position is None else end_position, -1,
                                        include_dense_layers)

    def extract_base64_npy(self, request_id: int | str, start_position: int = 0, end_position: int | None = None, *,
                           include_dense_layers: bool = False) -> str:
        """base64 of :meth:`extract_npy`: vLLM's ``routed_experts`` field."""
        return self._native.extract_base64_npy(request_id, start_position,
                                               -1 if end_position is None else end_position, -1, include_dense_layers)

    def write_npy(self, request_id: int | str, path: str | os.PathLike, start_position: int = 0,
                  end_position: int | None = None, *, include_dense_layers: bool = False) -> None:
        """Writes the request's routing to a ``.npy`` file."""
        self._native.write_npy(request_id, os.fspath(path), start_position,
                               -1 if end_position is None else end_position, -1, include_dense_layers)

    # ---- block-slot storage --------------------------------------------------------------------

    def export_blocks(self, blocks: Sequence[int]) -> np.ndarray:
        """Rows of whole KV blocks, ``[len(blocks) * block_size, L, K]`` (block_slot storage)."""
        return self._native.export_blocks(blocks)

    def import_blocks(self, blocks: Sequence[int], rows: np.ndarray) -> None:
        """Fills whole KV blocks with rows from :meth:`export_blocks` (block_slot storage)."""
        self._native.import_blocks(blocks, np.ascontiguousarray(rows))

    def copy_blocks(self, source: Sequence[int], destination: Sequence[int]) -> None:
        """The rows of block ``source[i]`` move with its KV to ``destination[i]`` (block_slot storage)."""
        self._native.copy_blocks(source, destination)

    # ---- steps ---------------------------------------------------------------------------------

    def stream_handle(self, stream=None) -> int:
        """The native handle of a stream argument (see :mod:`routing_replay._arrays`)."""
        if stream is None and self._current_stream is not None:  # read without a stream object
            return self._current_stream()
        if self._on_host:
            s = self._default_stream if stream is None else stream
            if s is not self._held_stream:
                if not isinstance(s, HostStream):
                    raise TypeError("host backend streams are routing_replay.HostStream objects")
                self._native.hold_stream(s)  # the replay waits for it before it is destroyed
                self._held_stream = s
            return s.handle
        return _arrays.cuda_stream_handle(stream)

    @property
    def default_stream(self) -> HostStream | None:
        """Host backend: the stream calls use when given none (None on CUDA)."""
        return self._default_stream

    def begin_step(self, plan: StepPlan, stream=None) -> None:
        """Opens a step: validates the whole plan and reserves host storage (raises before any change)."""
        self._native.begin_step(plan, self.stream_handle(stream))

    def end_step(self, stream=None) -> None:
        """Closes the step after its forward was enqueued on `stream`: checks, snapshots and resets the
        device buffer, copies, and files (now, or later for deferred strategies)."""
        self._native.end_step(self.stream_handle(stream))

    @contextlib.contextmanager
    def step(self, plan: StepPlan, stream=None) -> Iterator[Replay]:
        """``with replay.step(plan): forward()`` runs :meth:`begin_step` and :meth:`end_step` around it.

        If the body raises, the step is still closed, and the body's exception is the one raised.
        """
        self.begin_step(plan, stream)
        try:
            yield self
        except BaseException:
            with contextlib.suppress(Exception):
                self.end_step(stream)
            raise
        self.end_step(stream)

    def drain(self) -> None:
        """Files every step still in flight, waiting for their copies."""
        self._native.drain()

    def reset_device_buffer(self, stream=None) -> None:
        """Resets every row capture paths were handed (after replaying a recorded forward outside a step)."""
        self._native.reset_device_buffer(self.stream_handle(stream))

    # ---- capture -------------------------------------------------------------------------------

    def capture(self, layer: int, topk_ids, num_tokens: int | None = None, stream=None, *, row_offset: int = 0,
                physical_to_logical=None) -> None:
        """Records a layer's router output: the first K columns of ``topk_ids`` ``[n, K (+shared)]``.

        ``topk_ids`` is any integer array on the replay's device (torch, numpy on the host backend,
        CuPy/Numba/JAX through ``__cuda_array_interface__`` or DLPack). One small kernel on `stream`;
        safe inside ``torch.cuda.graph`` (fixed addresses, no sync, no allocation) and, with torch,
        inside ``torch.compile`` (a registered custom op). ``num_tokens`` defaults to the rows after
        ``row_offset`` (data parallel: this rank's first row). ``physical_to_logical``: a device int32
        map from physical (EPLB) to logical expert ids. On the host backend the ids are read during
        the call, so the array may be reused at once.
        """
        if num_tokens is None and stream is None and row_offset == 0 and physical_to_logical is None:
            # eager forwards: one native call, one kernel
            if self._hot(layer, topk_ids) or (self._on_host and self._capture_numpy(layer, topk_ids, False)):
                return
        if self._torch_op is None and _arrays.is_torch_tensor(topk_ids):  # torch was imported after __init__
            self._torch_arrived()
        if self._torch_op is not None and self._compiling():
            if stream is not None:
                raise ValueError("capture under torch.compile runs on the current stream: pass no stream")
            self._torch_op(topk_ids, self._id, layer, -1 if num_tokens is None else num_tokens, row_offset,
                           physical_to_logical)
            return
        self._capture_now(layer, topk_ids, num_tokens, stream, row_offset, physical_to_logical)

    def _torch_arrived(self) -> None:
        """torch was imported after this replay was built: its op, streams and hot paths."""
        self._torch_op, self._compiling = _torch_capture_op()
        if not self._on_host:
            self._current_stream = _arrays.current_stream_reader(self._native.device)
        self._build_hot_paths()

    def _build_hot_paths(self) -> None:
        """capture()'s hot path (and the drop-in's staged one) for torch tensors: the eager forward's
        48 calls a step, each one native call and one kernel (_arrays.torch_hot_capture)."""
        if self._on_host:
            default_handle = self._current_stream()
            read_stream, key = (lambda _: default_handle), None
        else:
            read_stream, key = _arrays.raw_stream_reader(self._native.device)
        native, index, k, compiling = self._native, self._device_index, self._top_k, self._compiling
        self._hot = _arrays.torch_hot_capture(native.capture, index, k, read_stream, key, compiling)
        self._hot_staged = _arrays.torch_hot_capture(native.stage_capture, index, k, read_stream, key, compiling)

    def _capture_numpy(self, layer: int, ids, staged: bool) -> bool:
        """The host backend's hot path: a plain 2-D integer numpy array, read natively without
        describing it; False for anything else (the general path describes, checks and reports it)."""
        return type(ids) is np.ndarray and self._native.capture_array(layer, ids, self._current_stream(), staged)

    def capture_pointer(self, layer: int, data: int, dtype: str, num_tokens: int, row_stride: int, stream=None,
                        *, physical_to_logical: int = 0, num_physical_experts: int = 0) -> None:
        """:meth:`capture` from a raw device pointer: ``num_tokens`` rows of ``row_stride`` elements of
        ``dtype`` (e.g. ``"int64"``), and a stream handle. Nothing checks the pointer."""
        self._native.capture(layer, data, _arrays.DTYPE_CODES[str(dtype)], num_tokens, row_stride,
                             self.stream_handle(stream), 0, physical_to_logical, num_physical_experts)

    def _capture_now(self, layer, topk_ids, num_tokens, stream, row_offset, physical_to_logical) -> None:
        ids = self._check_array(topk_ids)
        n = ids.rows - row_offset if num_tokens is None or num_tokens < 0 else num_tokens
        if row_offset < 0 or n < 0 or row_offset + n > ids.rows:
            raise ValueError(f"capture: rows [{row_offset}, {row_offset + n}) of an array with {ids.rows} rows")
        if ids.cols < self.top_k:
            raise ValueError(f"capture: {ids.cols} columns, fewer than top_k = {self.top_k}")
        map_ptr, map_len = 0, 0
        if physical_to_logical is not None:
            map_ptr, map_len, map_device, map_index, _ = _arrays.int32_vector(physical_to_logical,
                                                                              "physical_to_logical")
            self._check_device(map_device, map_index, "physical_to_logical")
        self._native.capture(layer, ids.ptr, ids.dtype, n, ids.row_stride, self.stream_handle(stream), row_offset,
                             map_ptr, map_len)

    def _op_capture(self, layer: int, topk_ids, num_tokens: int, row_offset: int, physical_to_logical) -> None:
        """Body of the torch custom op (routing_replay.torch_ops): capture on the current stream."""
        self._capture_now(layer, topk_ids, num_tokens, None, row_offset, physical_to_logical)

    def _check_array(self, array) -> _arrays.IdArray:
        ids = _arrays.describe(array)
        self._check_device(ids.device, ids.device_index, "topk_ids")
        return ids

    def _check_device(self, device: str, index: int, what: str) -> None:
        if self._on_host:
            if device != "cpu":
                raise ValueError(f"{what} is on {device}, but this replay runs on the host backend")
        elif device != "cuda" or index != self._native.device:
            raise ValueError(f"{what} is on {device}:{index}, but this replay's buffers are on {self.device}")

    def layer_view(self, layer: int, num_rows: int, stream=None):
        """The ``[num_rows, K]`` window of the device buffer for a model layer, for kernels that write
        routing themselves (FlashInfer's ``routing_replay_out`` with ``layer_major`` and ``int16``).

        CUDA: a DLPack array (``torch.from_dlpack(view)``, ``cupy.from_dlpack(view)``); a torch tensor
        when torch is imported. Host: a writable numpy array; `stream` (or the default stream) is
        synchronized first, so writes from Python come after the work already enqueued on it.
        """
        if self._on_host:
            (self._default_stream if stream is None else stream).synchronize()
        view = self._native.layer_view(layer, num_rows)
        if not self._on_host and "torch" in sys.modules:
            return sys.modules["torch"].from_dlpack(view)
        return view

    def __repr__(self) -> str:
        p = self.policies
        return (f"Replay({p['backend']}, index={p['index']}, layout={p['layout']}, copy={p['copy']}, "
                f"storage={p['storage']}, L={self.num_layers}, K={self.top_k})")


def _torch_capture_op(import_torch: bool = False):
    """(the torch custom op capture() dispatches to under torch.compile, torch.compiler.is_compiling)
    when torch is imported (or, with `import_torch`, importable), else (None, a test that is always
    False). Both are stored
    as plain attributes, so Dynamo traces the test in capture()."""
    if "torch" not in sys.modules:
        if not import_torch or importlib.util.find_spec("torch") is None:
            return None, _never_compiling
    from . import torch_ops

    return torch_ops.capture_op(), sys.modules["torch"].compiler.is_compiling


def _never_compiling() -> bool:
    """torch.compiler.is_compiling() where torch is not imported."""
    return False
