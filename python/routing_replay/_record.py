"""The ``record=`` option of the extractions that write a route record straight from storage
(:meth:`routing_replay.Replay.extract`, the drop-in capturer, ``routing_replay.sglang``), and the
environment switches of the engine adapters that put one in an engine's field.

A route record (docs/wire.md) is read back with :func:`routing_replay.wire.decode`.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

#: The codecs a record may ask for (zstd ones need a build with libzstd).
CODECS = ("packed", "zstd", "zstd_columns")
#: The keys a ``record=`` dict may hold.
KEYS = ("codec", "ordered", "chunk_tokens", "zstd_level")


class RecordOptions(NamedTuple):
    """How a record from storage is encoded (the encoder's own defaults)."""

    codec: str = "packed"
    ordered: bool = True
    chunk_tokens: int = 256
    zstd_level: int = 3


def record_options(record: Any) -> RecordOptions | None:
    """The options a ``record=`` argument asks for, None for False / None (no record).

    ``True``: the defaults; a codec name (``"packed"``, ``"zstd"``, ``"zstd_columns"``); or a dict
    of :data:`KEYS` (``{"codec": "zstd", "ordered": False}``)."""
    if record is None or record is False:
        return None
    if record is True:
        return RecordOptions()
    if isinstance(record, RecordOptions):
        return record
    if isinstance(record, str):
        record = {"codec": record}
    if not isinstance(record, dict):
        raise TypeError(f"record= takes True, a codec name or a dict of {', '.join(KEYS)}, not {type(record).__name__}")
    unknown = sorted(set(record) - set(KEYS))
    if unknown:
        raise ValueError(f"record= has unknown key(s) {', '.join(map(repr, unknown))}: it takes {', '.join(KEYS)}")
    options = RecordOptions(**record)
    if options.codec not in CODECS:
        raise ValueError(f"record codec {options.codec!r} is not one of {', '.join(CODECS)}")
    return RecordOptions(str(options.codec), bool(options.ordered), int(options.chunk_tokens), int(options.zstd_level))


def from_environment(name: str, environ=os.environ) -> RecordOptions | None:
    """The record an adapter's environment switch asks for: unset, empty, ``0``, ``false``,
    ``no``, ``off``: none; ``1``, ``true``, ``yes``, ``on``: the defaults; a codec name: that codec.

    Raises ValueError naming the variable for any other value."""
    value = environ.get(name, "").strip().lower()
    if value in {"", "0", "false", "no", "off"}:
        return None
    if value in {"1", "true", "yes", "on"}:
        return RecordOptions()
    if value in CODECS:
        return RecordOptions(codec=value)
    raise ValueError(f"{name}={environ[name]!r}: expected 1 (a packed record), a codec ({', '.join(CODECS)}) or 0")
