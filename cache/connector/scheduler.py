"""Scheduler side: decides what each request loads from the tiers and what gets saved.

Runs in vLLM's engine-core process, inside the scheduler loop: nothing here may block.
A lookup hashes the prompt once per request (BLAKE2b, microseconds per chunk) and asks
each tier ``contains`` (one ``stat`` per chunk and rank); no payload is read here.

Shared tier (L3). Its ``contains`` answers from memory; for chunks it does not know yet,
``store.probe`` starts background existence checks and the request is deferred (vLLM's
"ask me again" answer, ``None``) until they answer or ``lookup_wait`` passes, whichever
comes first; then it goes on with what is known. Loads from L3 are asynchronous (worker
threads) like every load below DRAM.

Chunk boundaries. A prompt of *n* tokens is looked up up to ``align(n - 1)`` (block
aligned; the last token is always recomputed for its logits): whole chunks, then one
partial *tail* chunk of whole blocks. Saves cover the same whole chunks, every further
whole chunk of the prompt, and that tail, so the same prompt sent again hits in full.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from cache.config import CacheConfig
from cache.connector.metadata import ChunkIO, LoadRequest, TieredKVMetadata
from cache.keys import Namespace, chunk_keys
from cache.store import TieredStore
from cache.tiers import make_tiers

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# Longest a new request waits for the shared tier to say whether it holds its prefix.
LOOKUP_WAIT_MAX_S = 0.5


@dataclass
class Chunk:
    key: str
    parent: Optional[str]
    start: int  # first token
    end: int    # one past the last token


@dataclass
class RequestState:
    request: "Request"
    lookup: list[Chunk] = field(default_factory=list)   # chunks up to align(n - 1)
    saves: list[Chunk] = field(default_factory=list)    # chunks to store once computed
    next_save: int = 0
    n_tokens: int = -1                                   # token count the chunks were cut for
    pending_load: Optional[LoadRequest] = None
    planned: dict[str, int] = field(default_factory=dict)
    loaded_tokens: dict[str, int] = field(default_factory=dict)  # per tier name
    probe_until: Optional[float] = None  # deadline of the wait for the shared tier
    issued: list[ChunkIO] = field(default_factory=list)  # chunks sent to workers to load


class SchedulerSide:
    def __init__(self, config: CacheConfig, namespaces: list[Namespace], block_size: int,
                 kv_cache_manager_getter) -> None:
        self.config = config
        self.block_size = block_size
        self.chunk = config.chunk_tokens
        self.chain = namespaces[0].chain_digest
        # One lookup-only view per worker rank: a chunk counts only if every rank has it.
        self.views = [TieredStore(make_tiers(config, ns.id), ns.digest) for ns in namespaces]
        for view in self.views:  # the shared tier starts listing what it holds now, not at
            view.probe([])       # the first request (which would then wait for it)
        self._kv_manager = kv_cache_manager_getter
        self.lookup_wait = min(config.remote_timeout_ms / 1000, LOOKUP_WAIT_MAX_S) if config.remote_url else 0.0
        self.requests: dict[str, RequestState] = {}
        self._loads: list[LoadRequest] = []
        self._upcoming: dict[str, None] = {}  # ordered set of chunk keys queued requests hit

    # -- chunking --------------------------------------------------------------
    def _state(self, request: "Request") -> RequestState:
        st = self.requests.get(request.request_id)
        if st is None:
            st = self.requests[request.request_id] = RequestState(request)
        tokens = request.prompt_token_ids or []
        if st.n_tokens != len(tokens):
            st.lookup, st.saves = self._cut(tokens, request)
            st.n_tokens = len(tokens)
        return st

    def _cut(self, tokens, request) -> tuple[list[Chunk], list[Chunk]]:
        salt = f"lora:{request.lora_request.lora_name}" if getattr(request, "lora_request", None) else ""
        n, c, b = len(tokens), self.chunk, self.block_size
        limit = max(0, (n - 1) // b * b)
        full, tail = divmod(limit, c)
        lookup_keys = chunk_keys(self.chain, tokens[:limit], c, tail_tokens=tail, salt=salt)
        bounds = [(i * c, (i + 1) * c) for i in range(full)] + ([(full * c, limit)] if tail else [])
        lookup = [Chunk(k, lookup_keys[i - 1] if i else None, s, e)
                  for i, (k, (s, e)) in enumerate(zip(lookup_keys, bounds))]
        saves = lookup[:full]
        if n // c > full:  # one more whole chunk, past the lookup limit
            k = chunk_keys(self.chain, tokens[: (full + 1) * c], c, salt=salt)[-1]
            saves.append(Chunk(k, lookup_keys[full - 1] if full else None, full * c, (full + 1) * c))
        if tail:
            saves.append(lookup[-1])
        return lookup, saves

    def _cacheable(self, request: "Request") -> bool:
        return not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None

    # -- vLLM hooks ------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        if not self._cacheable(request):
            return 0, False
        st = self._state(request)
        st.pending_load = None
        keys = [c.key for c in st.lookup]
        # One lookup per rank's view; a chunk counts when every rank has it, and it
        # loads from the slowest tier any rank holds it in.
        per_view = [v.lookup(keys) for v in self.views]
        found = min(map(len, per_view)) if per_view else 0
        if (found < len(keys) and st.lookup[-1].end > num_computed_tokens
                and self._awaiting_shared(st, keys[found:])):
            return None, False  # ask again at the next step
        tiers = [max(tiers_of[i] for tiers_of in per_view) for i in range(found)]
        if not found or st.lookup[found - 1].end <= num_computed_tokens:
            return 0, False
        hit_end = st.lookup[found - 1].end
        self._upcoming.update(dict.fromkeys(c.key for c in st.lookup[:found]))
        needed = [i for i in range(found) if st.lookup[i].end > num_computed_tokens]
        # Only the top local tier (DRAM) loads before the forward pass; the rest, and the
        # shared tier even when it is the only one, load on worker threads.
        first = self.views[0].tiers[0] if self.views[0].n_local else None
        sync_tier = 0 if first is not None and first.name == "dram" else -1
        asynchronous = any(tiers[i] != sync_tier for i in needed)
        names = [t.name for t in self.views[0].tiers]
        st.planned = {}
        for i in needed:
            n = st.lookup[i].end - max(st.lookup[i].start, num_computed_tokens)
            st.planned[names[tiers[i]]] = st.planned.get(names[tiers[i]], 0) + n
        chunks = [ChunkIO(st.lookup[i].key, st.lookup[i].parent, [],
                          max(0, num_computed_tokens - st.lookup[i].start) // self.block_size)
                  for i in needed]
        st.pending_load = LoadRequest(request.request_id, chunks, asynchronous)
        return hit_end - num_computed_tokens, asynchronous

    def _awaiting_shared(self, st: RequestState, keys: list[str]) -> bool:
        """Whether to defer the request while the shared tier is asked about ``keys``:
        at most ``lookup_wait`` after the first ask; then it goes on with what is known."""
        if not self.lookup_wait:
            return False
        pending = [v.probe(keys) for v in self.views]  # every rank's view starts its checks
        if not any(pending):
            return False
        now = time.monotonic()
        if st.probe_until is None:
            st.probe_until = now + self.lookup_wait
        return now < st.probe_until

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        st = self.requests.get(request.request_id)
        if num_external_tokens == 0 or st is None or st.pending_load is None:
            return
        block_ids = blocks.get_block_ids()[0]
        load, st.pending_load = st.pending_load, None
        for name, n in st.planned.items():
            st.loaded_tokens[name] = st.loaded_tokens.get(name, 0) + n
        by_start = {c.key: c for c in st.lookup}
        for chunk in load.chunks:
            c = by_start[chunk.key]
            first_block = c.start // self.block_size + chunk.first
            chunk.block_ids = list(block_ids[first_block: c.end // self.block_size])
        self._loads.append(load)
        st.issued.extend(load.chunks)

    def build_connector_meta(self, out: "SchedulerOutput") -> TieredKVMetadata:
        meta = TieredKVMetadata(loads=self._loads, upcoming=list(self._upcoming))
        self._loads, self._upcoming = [], {}
        scheduled = [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        scheduled += list(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, computed in scheduled:
            st = self.requests.get(req_id)
            if st is None or not st.saves:
                continue
            done = computed + out.num_scheduled_tokens.get(req_id, 0)
            block_ids = None
            while st.next_save < len(st.saves) and st.saves[st.next_save].end <= done:
                c = st.saves[st.next_save]
                st.next_save += 1
                if all(v.lookup([c.key], local_only=True) for v in self.views):
                    continue  # already stored here (by us, another engine, or an earlier turn)
                if block_ids is None:
                    block_ids = self._kv_manager().get_block_ids(req_id)[0]
                meta.saves.append(ChunkIO(c.key, c.parent,
                                          list(block_ids[c.start // self.block_size: c.end // self.block_size])))
        return meta

    def loads_failed(self, invalid_block_ids: set[int]) -> None:
        """Workers could not load these blocks (entry gone, damaged, foreign, late).
        The first failed chunk of each request is dropped from the shared tier's view
        (a local tier's bad entry was already deleted by the worker), so later requests
        do not pay for the same bad read again."""
        for st in self.requests.values():
            bad = next((c for c in st.issued if invalid_block_ids.intersection(c.block_ids)), None)
            if bad is None:
                continue
            for view in self.views:
                if view.shared is not None:
                    view.shared.reject(bad.key)

    def request_finished(self, request: "Request") -> dict:
        """Forget the request; returns the tokens it loaded per tier (for its output)."""
        st = self.requests.pop(request.request_id, None)
        return dict(st.loaded_tokens) if st else {}
