"""SGLang 0.5's routed-experts capturer (``sglang/srt/state_capturer/routed_experts.py``) on
routing_replay: the same constructor, calls and outputs, backed by the library's ``slot_rows``.

SGLang drives it so, per forward::

    cap.capture(layer_id, topk_ids)          # every MoE layer, inside the forward (CUDA graphs too)
    out = cap.on_forward_end(forward_batch, can_run_graph, cuda_graph_batch, no_copy_to_cpu)
    # overlap path (no_copy_to_cpu=True): the engine calls out.map_device_tensors(copy) on its copy
    # stream, synchronizes, then out.finalize()
    cap.get_topk(req_pool_idx, seqlen, req_to_token_pool, start_len)   # a finished request

Underneath, ``capture`` is the library's capture kernel (ids narrowed once to the narrowest index
type that holds E plus the sentinel: uint8 for E <= 255), and ``on_forward_end`` enqueues one kernel
and an event for a step of at most ``fused_scatter_max_rows`` rows (a decode step of a small batch):
the end-of-step kernel reads the step's KV slots (``out_cache_loc``, which stays on the GPU), checks
the rows, writes each into a pinned, device-mapped pool of one row per KV slot and resets the device
buffer. A larger step takes two kernels and an event or two: the end-of-step kernel snapshots the
rows and slots, and a scatter on a side stream writes them into the pool. Nothing waits on either
path, and nothing is done per request or per row on the engine's thread. ``get_topk`` waits only for
the steps the engine has finished with (the synchronous path's steps, the overlap path's finalized
ones), then reads the pool at the request's slots and widens to int32.

Differences from SGLang's own (docs/engines.md): a row no step wrote, or a step refused (an id
outside ``[0, E)`` in one of its rows, a captured layer missing a row, a slot outside the pool), is
an error naming the request pool index, position and slot, never zeros; a layer no capture ever
wrote (a dense layer) reads 0, as SGLang's zero-filled cache does.
"""

from __future__ import annotations

import logging
import sys

import numpy as np

try:
    import pybase64 as _b64
except ImportError:  # the stdlib module has the same b64 functions
    import base64 as _b64

from .. import _arrays, _core, _live, _replay_ids, _torch_capture_op
from .._record import record_options
from .. import _cuda_device, _parse_device, _usable_cuda
from .._replay import _kept_pool_for
from . import _context

logger = logging.getLogger("routing_replay.sglang")

__all__ = [
    "RoutedExpertsCapturer",
    "TopkCaptureOutput",
    "get_global_experts_capturer",
    "set_global_experts_capturer",
    "destroy_global_experts_capturer",
    "extract_routed_experts_from_meta_info",
    "disable_routed_experts_capture_for_draft",
]

#: hf_text_config attributes naming E, in the order they are tried.
EXPERT_COUNT_ATTRIBUTES = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")


def index_type_for(num_experts: int) -> str:
    """The narrowest stored index type that holds ids ``[0, E)`` plus the sentinel."""
    if num_experts <= 255:
        return "uint8"
    if num_experts <= 65535:
        return "uint16"
    return "int32"


def _never_hot_end(loc, graph, padded, check):
    """on_forward_end's hot path before torch is imported: every array takes the general path."""
    return None


def _torch_hot_end(end_step, device_index: int, read_stream, stream_key):
    """on_forward_end's hot path, as one flat function ``end(loc, graph, padded, check) -> serial``:
    a contiguous 1-D integer tensor of KV slots on device `device_index` (-1: the CPU) goes to
    ``end_step`` with torch's current raw stream; anything else returns None for the general path,
    which checks and reports it. Flat, with closure constants, for the reason of
    ``_arrays.torch_hot_capture``: a step of a small batch costs the host little else."""
    tensor_type = sys.modules["torch"].Tensor
    codes = _arrays._torch_dtype_codes()

    def end(loc, graph: bool, padded: int, check: bool):
        if type(loc) is not tensor_type:
            return None
        code = codes.get(loc.dtype)
        shape = loc.shape
        if code is None or len(shape) != 1 or loc.get_device() != device_index or (shape[0] > 1 and
                                                                                   loc.stride(0) != 1):
            return None
        return end_step(loc.data_ptr(), code, shape[0], read_stream(stream_key), graph, padded, check)

    return end


class TopkCaptureOutput:
    """What :meth:`RoutedExpertsCapturer.on_forward_end` returns on the overlap path: a step whose
    rows a kernel is already writing into the host pool. It holds no device tensor."""

    __slots__ = ("_capturer", "serial")

    def __init__(self, capturer: RoutedExpertsCapturer, serial: int) -> None:
        self._capturer = capturer
        self.serial = serial  #: the step's serial (1, 2, ...)

    def map_device_tensors(self, fn) -> None:
        """Nothing to copy: the step's rows reach the host without the engine's copy."""

    def finalize(self) -> None:
        """Waits for the step's scatter (done by now in practice) and raises, once, the error of the
        first refused step up to this one; from here on ``get_topk`` reads this step's rows."""
        capturer, serial = self._capturer, self.serial
        if serial > capturer._visible:  # inline, not a method: this runs once a step on the engine's thread
            capturer._visible = serial
        capturer._native.finalize(serial)


class RoutedExpertsCapturer:
    """SGLang 0.5's ``RoutedExpertsCapturer``: ``capture``, ``on_forward_end``, ``get_topk``,
    ``destroy``, as SGLang's engine calls them.

    Args (SGLang's):
        model_config: reads ``hf_text_config.num_experts_per_tok`` (K), ``num_hidden_layers`` (L) and
            E from ``num_experts`` / ``n_routed_experts`` / ``num_local_experts``.
        num_tokens: slots of the KV pool (the pool holds one row per slot).
        max_running_requests: sizes the device buffer, with the chunked-prefill size.
        num_fused_shared_experts: columns after the first K of a router output, dropped.
        device: ``"cuda"``, ``"cuda:N"``, a ``torch.device``, or ``"cpu"`` (the host backend: numpy
            arrays or CPU tensors, its streams worker threads).
    Keyword-only (ours):
        num_experts: E where ``hf_text_config`` does not name it.
        max_batch_size: rows of the device buffer (default: SGLang's, ``max(chunked_prefill_size,
            max_running_requests)``, times the DP ranks).
        page_size: the KV pool's tokens per page.
        layers: model layers the pool keeps (default: all ``num_hidden_layers``, as SGLang sizes its
            cache); others read 0 and capturing them is an error.
        index: stored index type (default: the narrowest for E).
        steps_in_flight: steps whose scatter may still run (4).
        scatter_on_compute_stream: run the scatter of a step larger than ``fused_scatter_max_rows``
            right after the end-of-step kernel on the compute stream (no event wait on the host)
            instead of on a side stream.
        fused_scatter_max_rows: steps of at most this many rows (64) are stored by the end-of-step
            kernel itself, on the compute stream: one launch and one event record per step, where a
            scattered step takes two launches, two records and a stream wait. 0: never.
        record: what ``get_topk`` and ``get_topk_base64`` return by default: None or False, SGLang's
            int32 rows; else a route record, as their ``record`` argument takes it. ``create``
            passes what ``ROUTING_REPLAY_SGLANG_RECORD`` asks for (docs/engines.md).
    """

    @staticmethod
    def create(*, model, model_config, num_tokens: int, max_running_requests: int, device):
        """SGLang's factory: None where routed experts are not returned, else a capturer sized
        from the model (its fused shared experts) and the engine."""
        if not _context.enabled():
            return None
        return RoutedExpertsCapturer(
            model_config,
            num_tokens=num_tokens,
            max_running_requests=max_running_requests,
            num_fused_shared_experts=_context.fused_shared_experts(model),
            device=device,
            page_size=_context.page_size(),
            record=_context.record(),
        )

    def __init__(self, model_config, num_tokens: int, max_running_requests: int, num_fused_shared_experts: int,
                 device, *, num_experts: int | None = None, max_batch_size: int | None = None, page_size: int = 1,
                 layers=None, index: str | None = None, steps_in_flight: int = 4,
                 scatter_on_compute_stream: bool = False, fused_scatter_max_rows: int = 64, record=None) -> None:
        _context.check_supported()
        text = model_config.hf_text_config
        self.num_fused_shared_experts = num_fused_shared_experts
        self.topk_size = int(text.num_experts_per_tok)
        self.num_layers = int(text.num_hidden_layers)
        if num_experts is None:
            num_experts = next((getattr(text, a) for a in EXPERT_COUNT_ATTRIBUTES if getattr(text, a, None)), None)
            if num_experts is None:
                raise ValueError(f"model_config.hf_text_config names no expert count ({', '.join(EXPERT_COUNT_ATTRIBUTES)}):"
                                 " pass num_experts=")
        self.num_experts = int(num_experts)
        self._record = record_options(record)
        if self._record is not None:
            _quiet_row_count_check()
        self._device_width = self.topk_size + num_fused_shared_experts
        self._routed_width = self.topk_size
        config = _core.SlotRowsConfig()
        config.num_experts = self.num_experts
        config.top_k = self.topk_size
        config.num_fused_shared_experts = num_fused_shared_experts
        config.max_tokens_per_step = int(max_batch_size or _context.max_batch_size(max_running_requests))
        config.num_model_layers = self.num_layers
        config.layers = [] if layers is None else [int(layer) for layer in layers]
        config.num_slots = int(num_tokens)
        config.page_size = int(page_size)
        config.steps_in_flight = steps_in_flight
        config.scatter_on_compute_stream = scatter_on_compute_stream
        config.fused_scatter_max_rows = int(fused_scatter_max_rows)
        index = index or index_type_for(self.num_experts)
        backend, device_index = _parse_device(device)
        self._torch_op, self._compiling = _torch_capture_op(import_torch=True)
        self._torch = sys.modules.get("torch")
        if backend == "host":
            self._native = _core.create_slot_rows(index, config)
            self._stream = _core.HostStream()  # the compute stream of the host backend's kernels
            handle = self._stream.handle
            read_stream, key = (lambda _: handle), None
            self._device_index = -1
        else:
            cuda = _usable_cuda(device)
            with _cuda_device(cuda, device_index):
                self._native = cuda.create_slot_rows(index, config)
            self._stream = None
            self._device_index = self._native.device
            read_stream, key = _arrays.raw_stream_reader(self._device_index)
        self._read_stream, self._stream_key = read_stream, key
        # get_topk's arrays, which SGLang keeps until it sends them: memory faulted in ahead by a thread
        # of the pool's own (docs/kept_outputs.md); a read larger than an extent gets memory of its own
        self._kept = _kept_pool_for(8 << 20)
        self._visible = 0  # the newest step whose rows get_topk may read
        self._codes = _arrays._torch_dtype_codes() if self._torch is not None else {}
        self._hot = _arrays.never_hot
        self._hot_end = _never_hot_end
        if self._torch is not None:
            self._hot = _arrays.torch_hot_capture(self._native.capture, self._device_index, self.topk_size,
                                                  read_stream, key, self._compiling,
                                                  widths=(self._device_width, self._routed_width))
            self._hot_end = _torch_hot_end(self._native.end_step, self._device_index, read_stream, key)
        self._id = next(_replay_ids)
        _live[self._id] = self
        logger.info("routing_replay: routed experts of %d layers x top-%d stored at %d KV slots as %s, %.2f GB "
                    "pinned (%s)", self.num_layers, self.topk_size, int(num_tokens), index,
                    self._native.pinned_bytes / 2**30, "host backend" if self._stream is not None else
                    f"cuda:{self._device_index}")

    # ---- the forward --------------------------------------------------------------------------

    def capture(self, layer_id: int, topk_indices) -> None:
        """Records a MoE layer's top-k ids ``[n, K]`` or ``[n, K + shared]`` (the shared columns are
        dropped): one kernel on the current stream, CUDA-graph and torch.compile safe."""
        if self._hot(layer_id, topk_indices):  # a tensor of either width: checked there, not read twice
            return
        width = topk_indices.shape[1]
        if width != self._device_width and width != self._routed_width:
            raise ValueError(f"Captured top-k width {width} is neither the device width {self._device_width} "
                             f"nor its routed part {self._routed_width}")
        if self._torch_op is not None and self._compiling():
            self._torch_op(topk_indices, self._id, layer_id, -1, 0, None)
            return
        self._capture_any(layer_id, topk_indices)

    def _op_capture(self, layer: int, topk_ids, num_tokens: int, row_offset: int, physical_to_logical) -> None:
        """Body of the torch custom op (routing_replay.torch_ops), run outside the traced graph."""
        if not self._hot(layer, topk_ids):
            self._capture_any(layer, topk_ids)

    def _capture_any(self, layer_id: int, topk_indices) -> None:
        if self._stream is not None and type(topk_indices) is np.ndarray:
            if self._native.capture_array(layer_id, topk_indices, self._stream.handle):
                return
        ids = _arrays.describe(topk_indices)
        if (ids.device == "cpu") != (self._stream is not None) or (ids.device != "cpu" and
                                                                   ids.device_index != self._device_index):
            raise ValueError(f"topk_indices is on {ids.device}:{ids.device_index}, but the capturer runs on "
                             f"{'the host' if self._stream is not None else f'cuda:{self._device_index}'}")
        self._native.capture(layer_id, ids.ptr, ids.dtype, ids.rows, ids.row_stride, self._stream_handle())

    def _stream_handle(self) -> int:
        return self._read_stream(self._stream_key)

    def on_forward_end(self, forward_batch, can_run_graph: bool, cuda_graph_batch, no_copy_to_cpu: bool = False):
        """Ends the forward just enqueued: its rows go to the KV slots ``forward_batch.out_cache_loc``
        (``out_cache_loc_virtual`` where set: a padded kernel batch stores its real tokens only), on
        the device. One kernel and an event (two kernels and an event or two above
        ``fused_scatter_max_rows`` rows); never waits.

        Returns None (synchronous path: the previous step's error, if any, is raised here; its
        scatter, which in SGLang's synchronous scheduler finished before this forward was planned,
        is waited for) or, with ``no_copy_to_cpu``, a :class:`TopkCaptureOutput` whose
        ``finalize()`` raises this step's error."""
        loc = forward_batch.out_cache_loc
        virtual = getattr(forward_batch, "out_cache_loc_virtual", None)
        if virtual is not None:
            if virtual.shape[0] > loc.shape[0]:
                raise ValueError(f"out_cache_loc_virtual has {virtual.shape[0]} slots, more than the "
                                 f"{loc.shape[0]} rows the forward captured")
            loc = virtual
        graph = True if can_run_graph else False
        padded = int(cuda_graph_batch) if graph and cuda_graph_batch else 0
        check = not no_copy_to_cpu
        try:
            serial = self._hot_end(loc, graph, padded, check)
            if serial is None:
                serial = self._end_any(loc, graph, padded, check)
        except _core.Error:
            if check:  # an earlier step's error: this step was enqueued all the same
                self._visible = self._native.last_step
            raise
        if no_copy_to_cpu:
            return TopkCaptureOutput(self, serial)
        self._visible = serial
        return None

    def _end_any(self, loc, graph: bool, padded: int, check: bool) -> int:
        """on_forward_end's general path: host arrays, and tensors the hot path declines (checked
        here, copied where not contiguous)."""
        if type(loc) is np.ndarray:
            return self._native.end_step_array(loc, self._stream.handle, graph, padded, check)
        if loc.get_device() != self._device_index:
            raise ValueError(f"out_cache_loc is on device {loc.get_device()}, the capturer on "
                             f"{self._device_index}")
        code = self._codes.get(loc.dtype)
        if code is None:
            raise TypeError(f"out_cache_loc must hold integer KV slots, not {loc.dtype}")
        if loc.dim() != 1 or (loc.shape[0] > 1 and loc.stride(0) != 1):
            loc = loc.contiguous().reshape(-1)
        return self._native.end_step(loc.data_ptr(), code, loc.shape[0], self._read_stream(self._stream_key), graph,
                                     padded, check)

    # ---- results ------------------------------------------------------------------------------

    def _request_slots(self, req_pool_idx: int, seqlen: int, req_to_token_pool, start_len: int):
        if start_len < 0:
            raise ValueError(f"{start_len=} must be non-negative")
        start_len = min(start_len, seqlen - 1)
        slots = req_to_token_pool.req_to_token[req_pool_idx][start_len: seqlen - 1]
        if type(slots) is not np.ndarray:
            slots = slots.cpu()
        return slots, start_len

    def get_topk(self, req_pool_idx: int, seqlen: int, req_to_token_pool, start_len: int = 0, *, record=None):
        """The request's routing: int32 ``[seqlen - 1 - start_len, L, K]`` on the CPU (a torch
        tensor; numpy where torch is absent), read at ``req_to_token[req_pool_idx][start_len:seqlen-1]``
        as SGLang does. Waits for the steps the engine has finished with, no later one.

        ``record`` (default: the capturer's ``record``; off unless asked for): the same rows as a
        route record written straight from the pool, a 1-D uint8 tensor (numpy without torch) of its
        bytes, so that SGLang's detokenizer, which sends base64 of the tensor's bytes, sends base64
        of the record. Its first position is the first one read, its layer map the layers captured
        (dense layers are left out, where the int32 rows hold 0), a slot no step wrote a missing row.
        ``True``, a codec name or a dict, as :meth:`routing_replay.Replay.extract` takes it.

        Raises:
            ValueError: a negative ``start_len``.
            routing_replay.Error: a slot outside the pool (``slot_out_of_range``), or a captured layer
                with no routing at a slot (``missing_routing``; with ``record``, a slot with routing
                for some captured layers only), named by request pool index, position and slot."""
        slots, first = self._request_slots(req_pool_idx, seqlen, req_to_token_pool, start_len)
        options = self._record_of(record)
        if options is not None:
            out = self._read_record(slots, first, req_pool_idx, options, True)
            return self._torch.from_numpy(out) if self._torch is not None else out
        shape = (int(slots.shape[0]), self.num_layers, self.topk_size)
        array = self._kept.array(shape, "int32")
        out = self._torch.from_numpy(array) if self._torch is not None else array  # shares the slice
        self._native.read_into(slots, out, first, f"request pool index {int(req_pool_idx)}", 0, self._visible)
        return out

    @property
    def kept_pool(self) -> dict:
        """The pool get_topk's arrays come from: its figures (as ``routing_replay.vllm``'s
        ``connector.kept_pool``)."""
        return self._kept.stats

    def get_topk_base64(self, req_pool_idx: int, seqlen: int, req_to_token_pool, start_len: int = 0, *,
                        record=None) -> str:
        """SGLang's ``routed_experts`` field for the request, byte for byte: base64 of the int32 bytes
        of :meth:`get_topk`'s array (what SGLang's detokenizer sends), written straight from the pool
        into the str, without the array; with ``record`` (as :meth:`get_topk`), base64 of the route
        record, the field a client decodes with ``routing_replay.wire.decode(base64.b64decode(field))``."""
        slots, first = self._request_slots(req_pool_idx, seqlen, req_to_token_pool, start_len)
        options = self._record_of(record)
        if options is not None:
            return _core.base64_encode(self._read_record(slots, first, req_pool_idx, options, False))
        return self._native.read_base64(slots, first, f"request pool index {int(req_pool_idx)}", 0, self._visible)

    def _record_of(self, record):
        return self._record if record is None else record_options(record)

    def _read_record(self, slots, first: int, req_pool_idx: int, options, as_array: bool):
        return self._native.read_record(slots, first, f"request pool index {int(req_pool_idx)}", self._visible,
                                        options.codec, options.ordered, options.chunk_tokens, options.zstd_level,
                                        as_array)

    def destroy(self) -> None:
        """Frees the pool (after the steps in flight); the capturer is unusable afterwards."""
        self._native = None
        _live.pop(self._id, None)

    # ---- accounting ---------------------------------------------------------------------------

    @property
    def native(self):
        """The routing_replay._core.SlotRows underneath."""
        return self._native

    @property
    def pinned_bytes(self) -> int:
        """Pinned host bytes: the pool of one row per KV slot (and the steps' statuses)."""
        return self._native.pinned_bytes

    @property
    def device_bytes(self) -> int:
        """Device bytes: the capture buffer and, per step in flight, its snapshot and slots."""
        return self._native.device_bytes

    @property
    def index_dtype(self) -> np.dtype:
        """The stored id type."""
        return np.dtype(self._native.index_dtype)

    def __repr__(self) -> str:
        return (f"RoutedExpertsCapturer(L={self.num_layers}, K={self.topk_size}, E={self.num_experts}, "
                f"{self._native.index_dtype}, slots={self._native.config.num_slots})")


#: SGLang 0.5.23's logger that warns when get_topk's tensor has not seqlen - 1 - start_len rows.
ROW_COUNT_LOGGER = "sglang.srt.managers.scheduler_components.batch_result_processor"


class _RecordRowCount(logging.Filter):
    """Drops SGLang's row-count warning, which a route record (its bytes, not its rows) always
    trips: the record states its own T, and the library checked the rows it read."""

    def filter(self, entry: logging.LogRecord) -> bool:
        return not str(entry.msg).startswith("routed_experts row-count mismatch")


def _quiet_row_count_check() -> None:
    """Installs :class:`_RecordRowCount` on SGLang's scheduler logger, once a process."""
    target = logging.getLogger(ROW_COUNT_LOGGER)
    if not any(isinstance(f, _RecordRowCount) for f in target.filters):
        target.addFilter(_RecordRowCount())


# ---- the module functions SGLang imports from routed_experts.py ----------------------------------

_global_capturer: list = [None]


def get_global_experts_capturer():
    """The process's capturer (None until set)."""
    return _global_capturer[0]


def set_global_experts_capturer(capturer) -> None:
    """Sets the process's capturer."""
    _global_capturer[0] = capturer


def destroy_global_experts_capturer() -> None:
    """Destroys and forgets the process's capturer."""
    if (capturer := _global_capturer[0]) is not None:
        capturer.destroy()
    _global_capturer[0] = None


#: The first bytes of every route record (docs/wire.md).
RECORD_MAGIC = b"RROUTE\r\n"


def extract_routed_experts_from_meta_info(data):
    """The flat int32 array of a response's ``meta_info["routed_experts"]`` (base64 of int32 bytes).

    Raises ValueError for a field that holds a route record (a server with
    ``ROUTING_REPLAY_SGLANG_RECORD`` set), which ``routing_replay.wire.decode`` reads instead."""
    encoded = data["meta_info"].get("routed_experts", None)
    raw = _b64.b64decode(encoded.encode("utf-8"))
    if raw[: len(RECORD_MAGIC)] == RECORD_MAGIC:
        raise ValueError("meta_info['routed_experts'] holds a route record, not int32 rows: decode it with "
                         "routing_replay.wire.decode(base64.b64decode(field))")
    return np.frombuffer(raw, dtype=np.int32)


def disable_routed_experts_capture_for_draft(model) -> None:
    """Opts every draft MoE ``TopK`` of SGLang out of capture (capture is the target model's only)."""
    from sglang.srt.layers.moe.topk import TopK

    for module in model.modules():
        if isinstance(module, TopK):
            module.topk_config.allow_routed_experts_capture = False
