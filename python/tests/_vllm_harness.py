"""Replays a trace (``_vllm_trace``) through one implementation of vLLM 0.33's routed-experts worker
connector and compares what two of them emitted.

Implementations: vLLM's own (the peer, with torch), the library's ``routing_replay.vllm`` (host or
CUDA backend; its metadata built from its own classes or from vLLM's, as the engine hands them over)
and the plain reference (``_vllm_reference``). Each is driven exactly as vLLM's model runner drives
it: ``begin_step(metadata)``; per layer ``capture(layer, topk_ids)`` (int64 [n, K]: numpy on the
host, torch tensors on a device); ``prepare_output(input_batch)`` with an object that only has
vLLM's three InputBatch fields; ``enqueue_cpu_copy(num_sampled=..., num_rejected=...)`` (on CUDA
on a side copy stream, an event recorded after it and waited on before ``process_output``, as
vLLM's AsyncOutput does).

A run stops at the first exception. ``compare`` reports, by trace seed, step and request, every
output that differs (token_start, rows, dtype, type) and an exception raised by one side only or at
a different event. ``truth_errors`` checks every output of a run, after the run, against the rows
the device computed (so outputs that alias memory reused later are caught too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from _peers import load_vllm_peer
import _vllm_reference
from _vllm_reference import ReferenceConnector
from _vllm_scheduler import Meta
from _vllm_trace import Begin, Forward, Process, Trace, TraceConfig

def have_library() -> bool:
    """Whether routing_replay.vllm (the connector, not only its plugin) is importable."""
    try:
        import routing_replay.vllm as module
    except ImportError:
        return False
    return hasattr(module, "make_worker_connector")


def _pack(cls, hashes):
    hashes = [bytes(h) for h in hashes]
    return cls(b"".join(hashes), len(hashes[0])) if hashes else None


class Impl:
    """One implementation, one backend: builds connectors, metadata, batches and router outputs."""

    name = "?"
    backend = "host"
    #: what it raises where vLLM asserts
    refusal: tuple = (AssertionError,)
    #: what it raises when a block the output needs is not stored
    store_error: type = Exception

    def connector(self, cfg: TraceConfig):
        raise NotImplementedError

    def metadata(self, meta: Meta):
        raise NotImplementedError

    def ids(self, conn, array: np.ndarray):
        return array

    def counts(self, conn) -> dict:
        return {}

    def input_batch(self, fw: Forward):
        # only the three fields vLLM's model runner's InputBatch carries that the connector reads
        return SimpleNamespace(req_ids=list(fw.req_ids), query_start_loc_np=fw.query_start_loc.copy(),
                               num_computed_tokens_np=fw.num_computed_tokens.copy())

    copy_stream = None  # CUDA: the output copy stream (vLLM's model runner has one)

    def enqueue(self, pending, fw: Forward):
        """enqueue_cpu_copy as vLLM's AsyncOutput calls it; on CUDA on the copy stream after the
        main stream's work, with an event recorded after it (returned, for ``wait``)."""
        if self.copy_stream is None:
            pending.enqueue_cpu_copy(num_sampled=fw.num_sampled.copy(), num_rejected=fw.num_rejected.copy())
            return None
        import torch

        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            pending.enqueue_cpu_copy(num_sampled=fw.num_sampled.copy(), num_rejected=fw.num_rejected.copy())
            event = torch.cuda.Event(blocking=True)
            event.record(self.copy_stream)
        return event

    def wait(self, token) -> None:
        if token is not None:
            token.synchronize()


def _metadata_with(module, meta: Meta):
    return module.AuxOutputConnectorMetadata(
        meta.generation, dict(meta.requests),
        {rid: _pack(module.PackedBlockHashes, h) for rid, h in meta.block_hashes.items()},
        tuple(meta.finished_requests), _pack(module.PackedBlockHashes, meta.retained),
        _pack(module.PackedBlockHashes, meta.released))


class Peer(Impl):
    """vLLM 0.33's own connector (torch on the CPU here; on a GPU machine its buffer is on CUDA)."""

    name = "vllm"

    def __init__(self) -> None:
        self.module = load_vllm_peer()
        import torch

        self.torch = torch
        self.store_error = self.module.BlockObjectStoreError
        if self.module.current_platform.device_type == "cuda":  # vLLM's buffer is where its platform is
            self.copy_stream = torch.cuda.Stream()

    def connector(self, cfg: TraceConfig):
        return self.module.make_worker_connector(*cfg.connector_args(), **cfg.connector_kwargs())

    def metadata(self, meta: Meta):
        return _metadata_with(self.module, meta)

    def ids(self, conn, array):
        return self.torch.from_numpy(array).to(conn._capturer.device_buffer.device)


class Reference(Impl):
    name = "reference"
    store_error = _vllm_reference.BlockObjectStoreError

    def __init__(self, *, mid_block_start: bool = False) -> None:
        self.mid_block_start = mid_block_start

    def connector(self, cfg: TraceConfig):
        return ReferenceConnector(*cfg.connector_args(), **cfg.connector_kwargs(),
                                  mid_block_start=self.mid_block_start)

    def metadata(self, meta: Meta):
        return SimpleNamespace(generation=meta.generation, requests=dict(meta.requests),
                               block_hashes={k: list(v) for k, v in meta.block_hashes.items()},
                               finished_requests=tuple(meta.finished_requests),
                               retained_block_hashes=list(meta.retained) or None,
                               released_block_hashes=list(meta.released) or None)

    def counts(self, conn) -> dict:
        counts = dict(conn.counts)
        counts["store_growth"] = conn.store.grew
        return counts


class Library(Impl):
    """``routing_replay.vllm`` on one backend; metadata from its own classes or from vLLM's."""

    name = "routing_replay"
    refusal = (ValueError, RuntimeError)  # where vLLM asserts, a clear exception

    def __init__(self, backend: str = "host", *, metadata_from: str = "library", cpu_tensors: bool = False) -> None:
        import routing_replay.vllm as module

        self.module = module
        self.store_error = module.BlockObjectStoreError
        self.backend = backend
        self.metadata_from = metadata_from
        if metadata_from == "vllm":
            self.vllm = load_vllm_peer()
        self.cpu_tensors = cpu_tensors  # the host backend also takes CPU torch tensors
        if backend == "cuda" or cpu_tensors:
            import torch

            self.torch = torch
        if backend == "cuda":
            self.copy_stream = torch.cuda.Stream()

    def connector(self, cfg: TraceConfig):
        device = "cpu" if self.backend == "host" else "cuda"
        return self.module.make_worker_connector(*cfg.connector_args(), **cfg.connector_kwargs(), device=device)

    def metadata(self, meta: Meta):
        return _metadata_with(self.vllm if self.metadata_from == "vllm" else self.module, meta)

    def ids(self, conn, array):
        if self.backend == "host":
            return self.torch.from_numpy(array) if self.cpu_tensors else array
        return self.torch.from_numpy(array).to("cuda")


def capturer_of(conn):
    return getattr(conn, "_capturer", None) or conn.capturer


@dataclass
class Run:
    impl: str
    outputs: list = field(default_factory=list)  # (event index, step, {request: (token_start, rows)})
    error: tuple[int, int, BaseException] | None = None  # (event index, step, exception)
    counts: dict = field(default_factory=dict)


def run(impl: Impl, trace: Trace) -> Run:
    """Replays every event of ``trace`` through ``impl``; stops at the first exception."""
    result = Run(impl.name)
    conn = impl.connector(trace.config)
    capturer = capturer_of(conn)
    num_layers = trace.config.num_layers
    pending: dict[int, tuple] = {}
    index, step = -1, -1
    try:
        for index, event in enumerate(trace.events):
            step = event.step
            if isinstance(event, Begin):
                conn.begin_step(None if event.meta is None else impl.metadata(event.meta))
            elif isinstance(event, Forward):
                for layer in range(num_layers):
                    capturer.capture(layer, impl.ids(conn, np.ascontiguousarray(event.ids[:, layer, :])))
                p = conn.prepare_output(impl.input_batch(event))
                if p is None:
                    raise RuntimeError("prepare_output returned None for a step with metadata")
                pending[event.step] = (p, impl.enqueue(p, event))
            elif isinstance(event, Process):
                p, token = pending.pop(event.step)
                impl.wait(token)
                out = p.process_output()
                result.outputs.append((index, step, {rid: (o.token_start, o.rows) for rid, o in out.items()}))
    except Exception as error:  # the comparison decides whether failing here is right
        result.error = (index, step, error)
    finally:
        result.counts = impl.counts(conn)
        try:
            conn.close()
        except Exception as error:
            if result.error is None:
                result.error = (len(trace.events), -1, error)
    return result


def _describe(value) -> str:
    if value is None:
        return "nothing"
    token_start, rows = value
    shape = getattr(rows, "shape", None)
    return f"token_start {int(token_start)}, rows {type(rows).__name__} {tuple(shape) if shape is not None else '?'} " \
           f"{getattr(rows, 'dtype', '?')}"


def _first_difference(a: np.ndarray, b: np.ndarray) -> str:
    where = np.argwhere(a != b)
    if not len(where):
        return ""
    pos = tuple(int(x) for x in where[0])
    return f"; first difference at [row {pos[0]}, layer {pos[1]}, k {pos[2]}]: expected {a[pos]}, got {b[pos]}"


def compare(expected: Run, got: Run, trace: Trace, *, limit: int = 20) -> list[str]:
    """Every difference between two runs of one trace, as sentences naming seed, step, request."""
    seed = trace.config.seed
    problems: list[str] = []
    stop = expected.error[0] if expected.error else len(trace.events) + 1
    got_stop = got.error[0] if got.error else len(trace.events) + 1
    exp_outputs = [o for o in expected.outputs if o[0] < min(stop, got_stop)]
    got_outputs = [o for o in got.outputs if o[0] < min(stop, got_stop)]
    for (i, step, exp), (_, _, out) in zip(exp_outputs, got_outputs):
        for rid in sorted(exp.keys() | out.keys()):
            a, b = exp.get(rid), out.get(rid)
            where = f"seed {seed} step {step} request {rid}"
            if a is None or b is None:
                problems.append(f"{where}: {expected.impl} emitted {_describe(a)}, {got.impl} emitted {_describe(b)}")
                continue
            ta, ra = a
            tb, rb = b
            if not isinstance(rb, np.ndarray):
                problems.append(f"{where}: {got.impl}'s rows are a {type(rb).__name__}, not a numpy array")
                continue
            if ra.flags.c_contiguous and not rb.flags.c_contiguous:  # vLLM serializes slices of them
                problems.append(f"{where}: {got.impl}'s rows are not C-contiguous ({rb.strides})")
            if int(ta) != int(tb) or ra.dtype != rb.dtype or ra.shape != rb.shape or not np.array_equal(ra, rb):
                detail = _first_difference(ra, rb) if ra.shape == rb.shape and ra.dtype == rb.dtype else ""
                problems.append(f"{where}: expected {_describe(a)} ({expected.impl}), got {_describe(b)}{detail}")
        if len(problems) >= limit:
            return problems
    if len(exp_outputs) != len(got_outputs):
        problems.append(f"seed {seed}: {expected.impl} produced {len(exp_outputs)} step outputs, {got.impl} "
                        f"{len(got_outputs)}")
    if expected.error and not got.error:
        i, step, error = expected.error
        problems.append(f"seed {seed} step {step} (event {i}, {type(trace.events[i]).__name__}): "
                        f"{expected.impl} raised {type(error).__name__}: {error}; {got.impl} did not")
    elif got.error and not expected.error:
        i, step, error = got.error
        problems.append(f"seed {seed} step {step} (event {i}, {type(trace.events[min(i, len(trace.events) - 1)]).__name__}): "
                        f"{got.impl} raised {type(error).__name__}: {error}; {expected.impl} did not")
    elif expected.error and got.error and expected.error[0] != got.error[0]:
        (i, s, e), (j, t, f) = expected.error, got.error
        problems.append(f"seed {seed}: {expected.impl} raised {type(e).__name__} at step {s} (event {i}): {e}; "
                        f"{got.impl} raised {type(f).__name__} at step {t} (event {j}): {f}")
    return problems


def truth_errors(result: Run, trace: Trace, *, limit: int = 5) -> list[str]:
    """Outputs whose rows are not the rows the device computed at those positions."""
    problems = []
    dtype = trace.config.dtype
    for _, step, out in result.outputs:
        for rid, (token_start, rows) in out.items():
            truth = trace.truth[rid]
            start = int(token_start)
            want = truth[start:start + len(rows)].astype(dtype)
            rows = np.asarray(rows)
            if start + len(rows) > len(truth) or rows.dtype != dtype or not np.array_equal(rows, want):
                problems.append(f"seed {trace.config.seed} step {step} request {rid}: {result.impl} emitted rows "
                                f"[{start}, {start + len(rows)}) {rows.dtype} that are not the computed routing "
                                f"(request computed {len(truth)} positions)")
                if len(problems) >= limit:
                    return problems
    return problems
