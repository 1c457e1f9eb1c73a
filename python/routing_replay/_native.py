"""The native modules behind the package: which backends were built and import here, the
policies each compiled, and the device a replay runs on. The host module (``_core``) is always
there; the CUDA one (``_core_cuda``) is imported on first use. Re-exported by the package
(``routing_replay.backends()``, ...); :mod:`routing_replay._replay` builds replays on them."""

from __future__ import annotations

import contextlib

from . import _core
from ._build import BACKENDS as _BUILT_BACKENDS
from ._build import CUDA_NOTE as _CUDA_NOTE
from ._core import Error

#: Index types (stored id dtype): ``uint8`` (E <= 255), ``uint16``, ``int16`` (E <= 32768), ``int32``.
INDEX_TYPES = ("uint8", "uint16", "int16", "int32")
#: Device-buffer layouts: ``layer_major`` (L, N, K) and ``token_major`` (N, L, K).
LAYOUTS = ("layer_major", "token_major")
#: Copy strategies: ``sync``, ``async_event``, ``double_buffered`` (depth 2), ``device_scatter`` (depth 2).
COPY_STRATEGIES = ("sync", "async_event", "double_buffered", "device_scatter")
#: Host storages: ``per_request`` (zero-copy extraction) and ``block_slot`` (rows at KV slots).
STORAGES = ("per_request", "block_slot")

_cuda_module = None
_cuda_import_error: str | None = None


def _cuda():
    """The CUDA module, imported on first use; raises with the reason when it is not there."""
    global _cuda_module, _cuda_import_error
    if _cuda_module is None and _cuda_import_error is None:
        if "cuda" not in _BUILT_BACKENDS:
            _cuda_import_error = f"the CUDA backend module was {_CUDA_NOTE}"
        else:
            try:
                from . import _core_cuda

                _cuda_module = _core_cuda
            except ImportError as e:  # e.g. no CUDA runtime library on this machine
                _cuda_import_error = f"the CUDA backend module does not import: {e}"
    if _cuda_module is None:
        raise RuntimeError(f"routing_replay: no CUDA backend: {_cuda_import_error}")
    return _cuda_module


def backends() -> list[str]:
    """Backends whose native module was built and imports here: ``["host"]`` or ``["host", "cuda"]``.

    A listed ``cuda`` may still have no device: see :func:`cuda_available`.
    """
    try:
        _cuda()
        return ["host", "cuda"]
    except RuntimeError:
        return ["host"]


def cuda_available() -> bool:
    """Whether the CUDA backend is built and a CUDA device is usable."""
    try:
        return bool(_cuda().available())
    except RuntimeError:
        return False


def policies(backend: str = "host") -> list[dict[str, str]]:
    """The instantiations of a backend available now: dicts with ``index``, ``layout``, ``copy``, ``storage``.

    Those compiled ahead of time (index ``int16`` with layout ``layer_major``, each with every copy
    strategy and storage, unless the package was built with
    ``-C cmake.define.ROUTING_REPLAY_PYTHON_ALL_COMBINATIONS=ON``: all 64; ``routing_replay._build.AOT_UNITS``),
    and those a replay compiled or loaded from the cache on first use in this process. Every
    combination of :data:`INDEX_TYPES`, :data:`LAYOUTS`, :data:`COPY_STRATEGIES` and :data:`STORAGES`
    can be asked for: the others compile on first use (:mod:`routing_replay._jit`).
    """
    module = _core if backend == "host" else _cuda()
    out = []
    for key in module.policies():
        index, layout, copy, storage = key.split("/")
        out.append({"index": index, "layout": layout, "copy": copy, "storage": storage})
    return out


def _parse_device(device) -> tuple[str, int]:
    """("host", 0) or ("cuda", index) from "cpu"/"host"/"cuda"/"cuda:1"/torch.device/int/None."""
    if device is None:
        return ("cuda", -1) if cuda_available() else ("host", 0)
    if isinstance(device, int):
        return "cuda", device
    text = str(device)
    if text in ("cpu", "host"):
        return "host", 0
    if text == "cuda":
        return "cuda", -1
    if text.startswith("cuda:"):
        return "cuda", int(text[5:])
    raise ValueError(f"device must be 'cpu', 'host', 'cuda' or 'cuda:N', got {device!r}")


class _cuda_device(contextlib.AbstractContextManager):
    """Makes a CUDA device current for the block (-1: leave the current one)."""

    def __init__(self, cuda, index: int) -> None:
        self._cuda, self._index, self._previous = cuda, index, None

    def __enter__(self):
        if self._index >= 0:
            self._previous = self._cuda.current_device()
            if self._previous != self._index:
                self._cuda.set_device(self._index)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None and self._previous != self._index:
            self._cuda.set_device(self._previous)


def _policy_error(e: Error) -> Exception:
    """A missing instantiation is a ValueError for Python callers; other errors pass through."""
    return ValueError(str(e)) if getattr(e, "code", None) == "invalid_argument" and "no compiled" in str(e) else e


def _usable_cuda(device):
    """The CUDA module for a replay asked to run on ``device`` (a CUDA device), or a clear error.

    Without the module, or without a usable device (no GPU, no NVIDIA driver, or a driver older than
    the CUDA runtime the module was built for), the CUDA runtime's own error (e.g.
    ``cudaErrorInsufficientDriver``) would say nothing of the way out: this one names it, the host
    backend (``device="cpu"``). Raises RuntimeError without the module, :class:`Error` (code
    ``backend_error``) without a device.
    """
    try:
        cuda = _cuda()
    except RuntimeError as e:
        raise RuntimeError(f"{e}; device='cpu' runs on the host backend "
                           "(routing_replay.cuda_available() says whether CUDA can be used)") from None
    if not cuda.available():
        error = Error(f"routing_replay: device={device!r} asked for, but no CUDA device is usable here (no GPU, "
                      "or no NVIDIA driver, or one older than the CUDA runtime this module was built for); "
                      "device='cpu' runs on the host backend (routing_replay.cuda_available() says whether "
                      "CUDA can be used)")
        error.code = "backend_error"
        raise error
    return cuda
