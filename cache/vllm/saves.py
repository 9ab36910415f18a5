"""Scheduler side: which computed chunks to save, and the saves in flight.

Runs in vLLM's engine-core process, in the scheduler loop (``build_connector_meta``):
nothing here blocks; a lookup is one ``contains`` per tier and rank.

A chunk is sent to be saved once the forward pass has computed it, unless it is stored
already (by us, another engine, an earlier turn) or being saved. Saves are written behind
the forward pass, so a request can arrive before the chunks an earlier request just
computed are on a tier; such a request is deferred until every rank's worker reports the
save settled (``settled``), at most ``SAVE_WAIT_MAX_S`` from its first deferral
(``awaiting``). A save not reported within ``SAVE_REPORT_LOST_S`` is forgotten.
Hybrid models (``cache.vllm.groups``): a sliding-window entry is saved only where a
checkpoint needs it (``RequestState.window_saves``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from cache.request_params import SAVE, request_wants
from cache.vllm.groups import GroupLayout, null_block
from cache.vllm.hits import entry
from cache.vllm.metadata import ChunkIO
from cache.vllm.pinning import Pinner
from cache.vllm.tails import TailIndex

if TYPE_CHECKING:
    from cache.store.tiered import TieredStore
    from cache.vllm.request_state import RequestState

# Longest a request waits for a chunk sent to be saved (write-behind) to land.
SAVE_WAIT_MAX_S = 2.0
# A save not reported settled this long after it was sent is forgotten (a report lost).
SAVE_REPORT_LOST_S = 60.0


class Saves:
    """What the scheduler sends to be saved, and what it waits for."""

    def __init__(
        self,
        layout: GroupLayout,
        views: list["TieredStore"],
        kv_manager: Callable[[], Any],
        block_size: int,
        pinner: Optional[Pinner] = None,
        tails: Optional[TailIndex] = None,
    ) -> None:
        """``views``: one lookup-only store per worker rank; ``kv_manager()``: vLLM's KV
        cache manager (block ids of a request); ``tails``: notes each tail chunk saved
        (or already stored), for longer prompts to continue from (``cache.vllm.tails``)."""
        self.layout, self.views, self.block_size, self.pinner = layout, views, block_size, pinner
        self.tails = tails
        self._kv_manager = kv_manager
        # Saves sent to workers and not yet settled: key -> [ranks left, when to forget
        # it], in the order sent (so those times ascend).
        self.in_flight: dict[str, list] = {}

    def awaiting(self, st: "RequestState", key: str) -> bool:
        """Whether to defer the request while ``key`` is being saved: until the save
        settles, at most ``SAVE_WAIT_MAX_S`` after the request's first deferral."""
        if key not in self.in_flight:
            return False
        now = time.monotonic()
        if st.save_wait_until is None:
            st.save_wait_until = now + SAVE_WAIT_MAX_S
        return now < st.save_wait_until

    def settled(self, keys: list[str]) -> None:
        """Workers settled these saves (one entry per rank)."""
        for key in keys:
            pending = self.in_flight.get(key)
            if pending is not None:
                pending[0] -= 1
                if pending[0] <= 0:
                    del self.in_flight[key]

    def step(self, scheduled: list[tuple[str, int]], num_scheduled: dict, states: dict) -> list[ChunkIO]:
        """The saves of one engine step: for each scheduled ``(request id, computed
        tokens)``, the chunks this step completes (``num_scheduled``: tokens scheduled per
        request; ``states``: ``RequestState`` by id). Requests that opted out save nothing."""
        now = time.monotonic()
        while self.in_flight and next(iter(self.in_flight.values()))[1] <= now:  # a report lost
            del self.in_flight[next(iter(self.in_flight))]
        saves: list[ChunkIO] = []
        for req_id, computed in scheduled:
            st = states.get(req_id)
            if st is not None and st.chunks and request_wants(st.request, SAVE):
                saves += self._request(req_id, st, computed + num_scheduled.get(req_id, 0), now)
        return saves

    def _request(self, req_id: str, st: "RequestState", done: int, now: float) -> list[ChunkIO]:
        saves: list[ChunkIO] = []
        block_ids, null = None, 0  # (both fetched at the first save)
        while st.next_save < len(st.chunks) and st.chunks[st.next_save].end <= done:
            i = st.next_save
            c = st.chunks[i]
            st.next_save += 1
            if self.tails is not None and i == len(st.chunks) - 1:
                self.tails.note(st.chunks[i - 1].key if i else None, st.request.prompt_token_ids[c.start : c.end])
            for k, kind in enumerate(self.layout.kinds):
                if not kind.full and i not in st.window_saves.get(k, ()):
                    continue  # no checkpoint needs this chunk's window
                key, parent = entry(st.chunks, k, i)
                if key in self.in_flight or all(v.lookup([key], local_only=v.has_local) for v in self.views):
                    continue  # being saved, or stored (by us, another engine, an earlier turn)
                if block_ids is None:
                    manager = self._kv_manager()
                    block_ids, null = manager.get_block_ids(req_id), null_block(manager)  # one list per group
                ids = kind.save_blocks(c.start, c.end, block_ids, null, self.block_size)
                if ids is None:
                    continue  # vLLM freed part of the window (never expected): a future miss
                shared = bool(self.pinner and self.pinner.shares(key))
                saves.append(ChunkIO(key, parent, ids, kind=k, shared=shared))
                self.in_flight[key] = [len(self.views), now + SAVE_REPORT_LOST_S]
        return saves
