"""The scheduler-side data classes of vLLM 0.33's auxiliary-output connector, for engines and tests
that build them without vLLM. The connector reads vLLM's own objects of the same names just as well:
it reads their attributes, never their types."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class PackedBlockHashes:
    """Block hashes of equal length back to back: ``data`` holds ``len(data) // item_size`` hashes."""

    data: bytes
    item_size: int

    def __iter__(self) -> Iterator[bytes]:
        """Each hash, in order."""
        step = self.item_size
        return (self.data[at : at + step] for at in range(0, len(self.data), step))


@dataclass
class AuxOutputConnectorMetadata:
    """One scheduler step's updates for the worker connector.

    ``requests`` maps each scheduled request to its emit start (the first position whose rows it
    wants); ``block_hashes`` gives requests their next full blocks' hashes; ``finished_requests``
    ended since the last step; ``retained_block_hashes`` / ``released_block_hashes`` are the
    scheduler's own references on blocks the KV cache keeps. A larger ``generation`` follows a
    prefix-cache reset.
    """

    generation: int
    requests: dict[Any, int]
    block_hashes: dict[Any, PackedBlockHashes]
    finished_requests: tuple[Any, ...]
    retained_block_hashes: PackedBlockHashes | None = None
    released_block_hashes: PackedBlockHashes | None = None


@dataclass
class InputBatch:
    """The three fields of vLLM's InputBatch that ``prepare_output`` reads: request ids in batch
    order, ``query_start_loc_np`` (request i's rows are ``[q[i], q[i + 1])``) and
    ``num_computed_tokens_np`` (request i's first position this step)."""

    req_ids: list
    query_start_loc_np: Any
    num_computed_tokens_np: Any
