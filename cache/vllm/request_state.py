"""Scheduler side, per request: its chunks as the cache cuts its prompt, and what the
scheduler knows of it between vLLM's hooks (``cache.vllm.scheduler``).

Plain data, held in vLLM's engine-core process; nothing here runs or blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from cache.explain import Lookup
from cache.vllm.metadata import ChunkIO, LoadRequest

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass
class Chunk:
    key: str
    parent: Optional[str]
    start: int  # first token
    end: int  # one past the last token
    keys: tuple[str, ...] = ()  # entry key per entry kind (groups.EntryKind.key)


@dataclass
class RequestState:
    request: "Request"
    chunks: list[Chunk] = field(default_factory=list)  # looked up, and saved once computed
    hit: list[Chunk] = field(default_factory=list)  # the pending load's chunks (may end in an earlier tail)
    next_save: int = 0  # first chunk not yet saved
    n_tokens: int = -1  # token count the chunks were cut for
    pending_load: Optional[LoadRequest] = None
    planned: dict[str, int] = field(default_factory=dict)
    loaded_tokens: dict[str, int] = field(default_factory=dict)  # per tier name
    probe_until: Optional[float] = None  # deadline of the wait for the shared tier
    save_wait_until: Optional[float] = None  # deadline of the wait for saves in flight
    issued: list[ChunkIO] = field(default_factory=list)  # chunks sent to workers to load
    # Hybrid models: hit ends whose sliding windows are stored (groups.checkpoints), and
    # per window kind the chunks whose window entries those need.
    checkpoints: set[int] = field(default_factory=set)
    window_saves: dict[int, set[int]] = field(default_factory=dict)
    why: Optional[Lookup] = None  # what the last lookup learnt, for the explanation
    reuse_noted: bool = False  # its stored chunks were reported as used again
