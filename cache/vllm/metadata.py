"""Messages between the scheduler-side connector and the workers, one each way per
engine step.

``TieredKVMetadata`` is built in the scheduler (``build_connector_meta``) and pickled to
every worker; ``TieredKVWorkerMetadata`` comes back from each worker
(``build_connector_worker_meta``), merged across ranks by vLLM. Plain lists, cheap to send.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class ChunkIO:
    """One chunk to load or save: its key, its parent key, and the KV blocks it covers.

    ``skip_blocks``: how many of the chunk's leading blocks to leave alone (vLLM's own
    prefix cache computed them); ``block_ids`` are the blocks after those.
    """

    key: str
    parent: Optional[str]
    block_ids: list[int]
    skip_blocks: int = 0
    # Hybrid models (cache.vllm.groups): which entry kind, and the blocks of each of
    # its KV cache groups back to back in ``block_ids`` (the same count per group).
    kind: int = 0
    tokens: Optional[int] = None  # prompt tokens this load serves (counted once per chunk)
    shared: bool = False  # a save to publish to the shared tier at once (a pin)
    tier: str = ""  # a load: the tier the lookup found it on (the worker says
    # when another served it: cache.explain.SERVED)


@dataclass
class LoadRequest:
    req_id: str
    chunks: list[ChunkIO]
    asynchronous: bool  # True: load on a worker thread, report through get_transfer_results
    hit_end: int = 0  # tokens computed once loaded
    estimate_s: Optional[float] = None  # expected load time (cache.cost)
    deadline_s: Optional[float] = None  # cut short after this long; the rest is recomputed
    compute_tokens: int = 0  # prompt tokens the request computes after it (cache.vllm.layered)


@dataclass
class TieredKVMetadata(KVConnectorMetadata):
    loads: list[LoadRequest] = field(default_factory=list)
    saves: list[ChunkIO] = field(default_factory=list)
    # Chunks that requests waiting in the queue will load soon: the policies protect them.
    upcoming: list[str] = field(default_factory=list)
    # Stored chunks that new requests found (used again, loaded or in vLLM's own prefix
    # cache): the workers copy them down to disk so a restart finds them (durability).
    reused: list[str] = field(default_factory=list)
    # This step's compute: tokens scheduled and attention pairs (cache.cost); the workers
    # time the forward pass and send both back, to learn the engine's prefill rate.
    compute: Optional[tuple[int, float]] = None
    # Pinned chunks to publish to the shared tier now, if a local tier holds them (cache.pins).
    publish: list[str] = field(default_factory=list)
    # A request waits for saves in flight (cache.vllm.saves): the workers write what they
    # hold back for a quiet moment (cache.store.idle_gate) at once.
    hurry: bool = False


@dataclass
class TieredKVWorkerMetadata(KVConnectorWorkerMetadata):
    """Keys of the saves a worker settled since its last step (stored, refused or
    dropped): the scheduler stops holding back requests that wait for them. One entry
    per rank after ``aggregate``, so a key settled on every rank appears world-size times.
    ``events``: what happened to chunks meanwhile, ``(key, event, tier)`` in order
    (``cache.explain``)."""

    settled: list[str] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    # Measurements for the scheduler's cost model (cache.vllm.planner): ("load", tier,
    # bytes, seconds) per finished load, ("step", tokens, pairs, seconds) per forward pass.
    samples: list[tuple] = field(default_factory=list)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "TieredKVWorkerMetadata":
        assert isinstance(other, TieredKVWorkerMetadata)
        return TieredKVWorkerMetadata(
            self.settled + other.settled, self.events + other.events, self.samples + other.samples
        )
