"""The wire formats of extracted routing, for arrays the caller holds: ``.npy`` bytes, base64 of
them (vLLM's ``routed_experts`` field), and the sentinel that marks a missing row. Re-exported by
the package (``routing_replay.to_npy()``, ...); a replay's own ``extract_npy()`` and
``extract_base64_npy()`` (:mod:`routing_replay._replay`) produce the same bytes natively."""

from __future__ import annotations

import base64
import io
import os

import numpy as np

from . import _core

def sentinel(index: str) -> int:
    """The value that marks a missing row for an index type: -1 (signed) or the type's maximum."""
    info = np.iinfo(np.dtype(index))
    return -1 if info.min < 0 else int(info.max)


def to_npy(array) -> bytes:
    """The bytes of a ``.npy`` file holding an integer array (8, 16 or 32 bits), as the library writes it."""
    return _core.to_npy(np.ascontiguousarray(array))


def to_base64_npy(array) -> str:
    """base64 of :func:`to_npy`: the wire format of vLLM's OpenAI API field ``routed_experts``."""
    return _core.base64_encode(to_npy(array))


def from_base64_npy(field: str) -> np.ndarray:
    """Decodes a ``routed_experts`` field (base64 of a ``.npy`` file) into its array."""
    return np.load(io.BytesIO(base64.b64decode(field)), allow_pickle=False)


def write_npy(path: str | os.PathLike, array) -> None:
    """Writes an integer array as a ``.npy`` file (what :func:`to_npy` returns)."""
    with open(path, "wb") as f:
        f.write(to_npy(array))
