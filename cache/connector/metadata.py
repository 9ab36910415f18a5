"""Messages from the scheduler-side connector to the workers, one per engine step.

Built in the scheduler (``build_connector_meta``), pickled to every worker; plain lists
so they are cheap to send.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class ChunkIO:
    """One chunk to load or save: its key, its parent key, and the KV blocks it covers.

    ``first`` is the number of the chunk's leading blocks to skip (already computed
    by vLLM's own prefix cache); ``block_ids`` are the blocks after those.
    """

    key: str
    parent: Optional[str]
    block_ids: list[int]
    first: int = 0


@dataclass
class LoadRequest:
    req_id: str
    chunks: list[ChunkIO]
    asynchronous: bool     # True: load on a worker thread, report through get_finished


@dataclass
class TieredKVMetadata(KVConnectorMetadata):
    loads: list[LoadRequest] = field(default_factory=list)
    saves: list[ChunkIO] = field(default_factory=list)
    # Chunks that requests waiting in the queue will load soon: the policies protect them.
    upcoming: list[str] = field(default_factory=list)
