"""How arrays and streams from any framework become the pointers and handles the native calls take.

Arrays (router outputs): torch tensors (read directly: data_ptr, dtype, strides), numpy arrays,
objects with ``__cuda_array_interface__`` (CuPy, Numba, JAX) and anything DLPack or the buffer
protocol can hand over. No framework is imported here; torch is only looked at when the caller
already imported it.

Streams (CUDA backend): an ``int`` (a ``cudaStream_t``), an object with ``cuda_stream`` (torch) or
``ptr`` (CuPy) or ``__cuda_stream__`` (the CUDA stream protocol), or ``None``: the current torch
stream when torch has initialised CUDA, else CuPy's current stream when CuPy is imported, else 0
(the legacy default stream). Host backend: a :class:`routing_replay.HostStream`, or ``None`` for the
replay's own default stream.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, NamedTuple

import numpy as np

from . import _core

#: numpy/torch dtype name -> native dtype code.
DTYPE_CODES: dict[str, int] = dict(_core.DTYPES)

_DLPACK_CPU = 1
_DLPACK_CUDA = 2
_DLPACK_CUDA_HOST = 3
_DLPACK_CUDA_MANAGED = 13


class IdArray(NamedTuple):
    """A 2-D integer array as the native calls see it."""

    ptr: int  #: address of element (0, 0)
    dtype: int  #: native dtype code
    rows: int  #: first dimension
    cols: int  #: second dimension
    row_stride: int  #: elements between rows
    device: str  #: "cpu" or "cuda"
    device_index: int  #: CUDA device (0 on the CPU)
    owner: Any  #: the object whose memory this is


def _code(name: str) -> int:
    try:
        return DTYPE_CODES[name]
    except KeyError:
        raise TypeError(f"routing ids must be an integer array (int8 ... uint64), got dtype {name}") from None


def _two_d(shape, strides, what: str, itemsize: int = 1) -> tuple[int, int, int]:
    if len(shape) != 2:
        raise ValueError(f"{what}: expected a 2-D array [num_tokens, K (+ shared experts)], got shape {tuple(shape)}")
    rows, cols = int(shape[0]), int(shape[1])
    if strides is None or rows == 0:
        return rows, cols, cols
    row_stride, col_stride = int(strides[0]) // itemsize, int(strides[1]) // itemsize
    if col_stride != 1 and cols > 1:
        raise ValueError(f"{what}: the columns of each row must be contiguous (column stride {col_stride})")
    if rows == 1:
        return rows, cols, max(row_stride, cols)
    if row_stride < cols:
        raise ValueError(f"{what}: rows overlap (row stride {row_stride} for {cols} columns)")
    return rows, cols, row_stride


def _torch_tensor(a) -> IdArray:
    name = str(a.dtype).rsplit(".", 1)[-1]
    rows, cols, stride = _two_d(tuple(a.shape), a.stride(), "topk_ids")
    dev = a.device
    return IdArray(a.data_ptr(), _code(name), rows, cols, stride, "cuda" if dev.type == "cuda" else dev.type,
                   dev.index or 0, a)


def _numpy_array(a: np.ndarray) -> IdArray:
    rows, cols, stride = _two_d(a.shape, a.strides, "topk_ids", a.itemsize)
    return IdArray(a.__array_interface__["data"][0], _code(a.dtype.name), rows, cols, stride, "cpu", 0, a)


def _cuda_array_interface(a, cai: dict) -> IdArray:
    dtype = np.dtype(cai["typestr"])
    strides = cai.get("strides")
    rows, cols, stride = _two_d(cai["shape"], strides, "topk_ids", dtype.itemsize)
    return IdArray(int(cai["data"][0]), _code(dtype.name), rows, cols, stride, "cuda", _cai_device(a), a)


def _cai_device(a) -> int:
    device = getattr(a, "device", None)
    index = getattr(device, "id", None)  # CuPy
    if index is None:
        index = getattr(device, "index", None)
    return int(index or 0)


def _dlpack(a) -> IdArray:
    ptr, code, shape, strides, device_type, device_id = _core.array_info(a)
    rows, cols, stride = _two_d(shape, strides, "topk_ids")
    if device_type in (_DLPACK_CPU, _DLPACK_CUDA_HOST):
        device = "cpu"
    elif device_type in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED):
        device = "cuda"
    else:
        raise TypeError(f"topk_ids: unsupported DLPack device type {device_type}")
    return IdArray(ptr, code, rows, cols, stride, device, device_id, a)


@functools.cache
def _torch_dtype_codes() -> dict[Any, int]:
    """torch dtype -> native dtype code, for every dtype the core takes that torch has."""
    torch = sys.modules["torch"]
    dtypes = ((getattr(torch, name, None), code) for name, code in DTYPE_CODES.items())
    return {dtype: code for dtype, code in dtypes if isinstance(dtype, torch.dtype)}


def torch_hot_capture(launch, device_index: int, top_k: int, read_stream, stream_key, is_compiling, widths=None):
    """capture()'s hot path for torch tensors, as one flat function ``hot(layer, t) -> bool``.

    A plain 2-D integer tensor on device `device_index` (-1: the CPU) whose rows hold at least `top_k`
    contiguous ids goes to ``launch(layer, pointer, dtype code, rows, row stride, stream)``, with the
    stream ``read_stream(stream_key)`` (torch's current raw stream of the device, no stream object);
    anything else, or a call while torch.compile traces, returns False for the general path, which
    describes, checks and reports it. Flat on purpose: every value it needs is a closure constant and
    a call is five reads of the tensor and one native call, where method layers, an argument tuple
    and a stream closure cost about a microsecond more (docs/performance.md). `widths`: a pair of the
    only row widths allowed (others return False, for the general path to reject), so that the
    caller need not read the shape again. Needs torch imported."""
    tensor_type = sys.modules["torch"].Tensor
    codes = _torch_dtype_codes()
    if widths is not None:
        first, second = widths

        def hot_of_widths(layer: int, t) -> bool:
            if type(t) is not tensor_type or is_compiling():
                return False
            code = codes.get(t.dtype)
            shape = t.shape
            if code is None or len(shape) != 2 or (shape[1] != first and shape[1] != second) or \
                    t.get_device() != device_index:
                return False
            row_stride, col_stride = t.stride()
            if col_stride != 1 or (row_stride < shape[1] and shape[0] > 1):
                return False
            launch(layer, t.data_ptr(), code, shape[0], max(row_stride, shape[1]), read_stream(stream_key))
            return True

        return hot_of_widths

    def hot(layer: int, t) -> bool:
        if type(t) is not tensor_type or is_compiling():  # torch.compile traces the custom op instead
            return False
        code = codes.get(t.dtype)
        shape = t.shape
        if code is None or len(shape) != 2 or shape[1] < top_k or t.get_device() != device_index:
            return False
        row_stride, col_stride = t.stride()
        if col_stride != 1 or (row_stride < shape[1] and shape[0] > 1):
            return False
        launch(layer, t.data_ptr(), code, shape[0], max(row_stride, shape[1]), read_stream(stream_key))
        return True

    return hot


def never_hot(layer: int, array) -> bool:
    """The hot path before torch is imported: no array takes it."""
    return False


def current_stream_reader(device_index: int):
    """A function returning the current CUDA stream of `device_index` as a cudaStream_t int, as
    cuda_stream_handle(None) does, but without a torch stream object per call where torch offers
    the raw handle."""
    raw, key = raw_stream_reader(device_index)
    if key is None:
        return lambda: cuda_stream_handle(None)
    torch = sys.modules["torch"]
    initialized = False

    def current() -> int:
        nonlocal initialized
        if not initialized:
            if not torch.cuda.is_initialized():  # torch holds no stream yet: as cuda_stream_handle(None)
                return cuda_stream_handle(None)
            initialized = True
        return raw(key)

    return current


def raw_stream_reader(device_index: int):
    """(function, argument) whose call gives the current CUDA stream of `device_index` as a
    cudaStream_t int: torch's raw-stream reader and the device index where torch has one (call it
    only once torch's CUDA state exists, e.g. holding a tensor on that device), else a function
    doing cuda_stream_handle(None) and None."""
    torch = sys.modules.get("torch")
    raw = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None) if torch is not None else None
    if raw is None:
        return (lambda _: cuda_stream_handle(None)), None
    return raw, device_index


def is_torch_tensor(a) -> bool:
    """Whether `a` is a torch tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(a, torch.Tensor)


def describe(a) -> IdArray:
    """Pointer, dtype, shape, row stride and device of a 2-D integer array from any framework."""
    if isinstance(a, np.ndarray):
        return _numpy_array(a)
    if is_torch_tensor(a):
        return _torch_tensor(a)
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is not None:
        return _cuda_array_interface(a, cai)
    if hasattr(a, "__dlpack__") or hasattr(a, "__array_interface__") or isinstance(a, memoryview):
        return _dlpack(a)
    return _numpy_array(np.asarray(a))


def int32_vector(a, what: str) -> tuple[int, int, str, int, Any]:
    """(pointer, length, device, device index, owner) of a 1-D int32 array (a physical->logical map)."""
    if isinstance(a, np.ndarray):
        if a.dtype != np.int32 or a.ndim != 1 or not a.flags.c_contiguous:
            raise TypeError(f"{what}: expected a contiguous 1-D int32 array")
        return a.__array_interface__["data"][0], a.shape[0], "cpu", 0, a
    if is_torch_tensor(a):
        if str(a.dtype) != "torch.int32" or a.dim() != 1 or not a.is_contiguous():
            raise TypeError(f"{what}: expected a contiguous 1-D int32 tensor")
        return a.data_ptr(), a.shape[0], ("cuda" if a.device.type == "cuda" else "cpu"), a.device.index or 0, a
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is not None:
        if np.dtype(cai["typestr"]) != np.int32 or len(cai["shape"]) != 1:
            raise TypeError(f"{what}: expected a 1-D int32 array")
        if cai.get("strides") not in (None, (4,)):
            raise TypeError(f"{what}: expected a contiguous array")
        return int(cai["data"][0]), int(cai["shape"][0]), "cuda", _cai_device(a), a
    return int32_vector(np.ascontiguousarray(a, dtype=np.int32), what)


def cuda_stream_handle(stream) -> int:
    """The cudaStream_t of `stream` as an int (see the module docstring for what is accepted)."""
    if stream is None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return int(torch.cuda.current_stream().cuda_stream)
        cupy = sys.modules.get("cupy")
        if cupy is not None:
            return int(cupy.cuda.get_current_stream().ptr)
        return 0
    if isinstance(stream, int):
        return stream
    for attribute in ("cuda_stream", "ptr"):
        value = getattr(stream, attribute, None)
        if isinstance(value, int):
            return value
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        return int(protocol()[1])
    raise TypeError(f"not a CUDA stream: {stream!r} (pass an int cudaStream_t, a torch or CuPy stream, or None)")
