"""Scheduler side: decides what each request loads from the tiers and what gets saved.

Runs in vLLM's engine-core process, inside the scheduler loop: nothing here may block.
A lookup hashes the prompt once per request (BLAKE2b, microseconds per chunk) and asks
each tier ``contains`` (one ``stat`` per chunk and rank); no payload is read here.

Shared tier (L3). Its ``contains`` answers from memory; for chunks it does not know yet,
``store.probe`` starts background existence checks and the request is deferred (vLLM's
"ask me again" answer, ``None``) until they answer or ``lookup_wait`` passes, whichever
comes first; then it goes on with what is known. Loads from L3 are asynchronous (worker
threads) like every load below DRAM.

Saves in flight. Saves are written behind the forward pass, so a request can arrive
before the chunks an earlier request just computed are on a tier (the same prompt
again once vLLM's own prefix cache dropped it, the warm tool's second pass). A request
whose next missing chunk is still being written is deferred the same way until every
rank's worker reports that save settled (``saves_settled``), at most ``SAVE_WAIT_MAX_S``
from its first deferral. (That wait counts from the request, not from the save: a save
is sent before the forward pass that computes its chunk, and a long prefill on a slow
host may take longer than the wait.)

Chunk boundaries. A prompt of *n* tokens is cut into whole chunks and one partial
*tail* chunk holding the rest of the prompt (keyed by exactly those tokens); saves and
lookups use the same cut. A hit loads up to *n - 1* tokens (vLLM computes the last
token for its logits), so the same prompt sent again costs one token of compute, and a
prompt that extends an earlier one hits its whole chunks. A tail's last block is
partly filled: only its first positions are loaded, and vLLM writes the rest.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from cache.assembly import lookup_view
from cache.config import CacheConfig
from cache.keys import Namespace, chunk_keys
from cache.vllm.metadata import ChunkIO, LoadRequest, TieredKVMetadata

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# Longest a new request waits for the shared tier to say whether it holds its prefix.
LOOKUP_WAIT_MAX_S = 0.5
# Longest a request waits for a chunk an earlier step sent to be saved (write-behind) to
# land; normally the worker reports it settled within a step or two.
SAVE_WAIT_MAX_S = 2.0
# A save not reported settled this long after it was sent is forgotten (a report lost).
SAVE_REPORT_LOST_S = 60.0


def prefix_salt(request: "Request") -> str:
    """What besides the tokens changes a prefix's KV or who may see it, folded into the
    first key of its chain: the LoRA adapter, and vLLM's per-request ``cache_salt`` (a
    tenant's secret against prefix-cache timing attacks). A prompt without either keeps
    the plain chain, so it never meets a salted entry, and salted prompts meet only
    entries of the same salt, in every tier."""
    lora = getattr(request, "lora_request", None)
    parts = {"lora": lora.lora_name if lora else None, "cache_salt": getattr(request, "cache_salt", None)}
    if not any(parts.values()):
        return ""
    return json.dumps(parts, sort_keys=True)


@dataclass
class Chunk:
    key: str
    parent: Optional[str]
    start: int  # first token
    end: int    # one past the last token


@dataclass
class RequestState:
    request: "Request"
    chunks: list[Chunk] = field(default_factory=list)   # looked up, and saved once computed
    next_save: int = 0                                   # first chunk not yet saved
    n_tokens: int = -1                                   # token count the chunks were cut for
    pending_load: Optional[LoadRequest] = None
    planned: dict[str, int] = field(default_factory=dict)
    planned_chunks: dict[str, tuple[str, int]] = field(default_factory=dict)  # key -> (tier, tokens)
    loaded_tokens: dict[str, int] = field(default_factory=dict)  # per tier name, failed loads taken off
    loading: dict[str, tuple[str, int]] = field(default_factory=dict)  # issued chunk key -> (tier, tokens)
    reuse_noted: bool = False  # its stored chunks were reported as used again
    probe_until: Optional[float] = None  # deadline of the wait for the shared tier
    save_wait_until: Optional[float] = None  # deadline of the wait for saves in flight
    issued: list[ChunkIO] = field(default_factory=list)  # chunks sent to workers to load


class SchedulerSide:
    def __init__(self, config: CacheConfig, namespaces: list[Namespace], block_size: int,
                 kv_cache_manager_getter) -> None:
        self.config = config
        self.block_size = block_size
        self.chunk = config.chunk_tokens
        self.chain = namespaces[0].chain_digest
        # One lookup-only view per worker rank: a chunk counts only if every rank has it.
        self.views = [lookup_view(config, ns) for ns in namespaces]
        # Tier roles, in the views' tier order: names (for kv_transfer_params) and which
        # tiers load before the forward pass (the others load on worker threads).
        specs = config.tiers()
        self.tier_names = [t.name for t in specs]
        self.sync_tiers = {i for i, t in enumerate(specs) if t.synchronous}
        for view in self.views:  # the shared tier starts listing what it holds now, not at
            view.probe([])       # the first request (which would then wait for it)
        self._kv_manager = kv_cache_manager_getter
        self.lookup_wait = min(config.shared_timeout_ms / 1000, LOOKUP_WAIT_MAX_S) if config.has_shared else 0.0
        self.requests: dict[str, RequestState] = {}
        self._loads: list[LoadRequest] = []
        self._upcoming: dict[str, None] = {}  # ordered set of chunk keys queued requests hit
        self._reused: dict[str, None] = {}    # ordered set of stored chunk keys new requests found
        # Saves sent to workers and not yet settled: key -> [ranks left, when to forget
        # it], in the order sent (so those times ascend).
        self._saving: dict[str, list] = {}

    # -- chunking --------------------------------------------------------------
    def _state(self, request: "Request") -> RequestState:
        st = self.requests.get(request.request_id)
        if st is None:
            st = self.requests[request.request_id] = RequestState(request)
        tokens = request.prompt_token_ids or []
        if st.n_tokens != len(tokens):
            st.chunks = self._cut(tokens, request)
            st.n_tokens = len(tokens)
        return st

    def _cut(self, tokens, request) -> list[Chunk]:
        """The prompt's chunks, for lookups and for saves alike."""
        salt = prefix_salt(request)
        n, c = len(tokens), self.chunk
        full, tail = divmod(n, c)
        if tail < 2:  # a one-token tail would load nothing: the last token is always computed
            tail = 0
        keys = chunk_keys(self.chain, tokens[: full * c + tail], c, tail_tokens=tail, salt=salt)
        bounds = [(i * c, (i + 1) * c) for i in range(full)] + ([(full * c, full * c + tail)] if tail else [])
        return [Chunk(k, keys[i - 1] if i else None, s, e) for i, (k, (s, e)) in enumerate(zip(keys, bounds))]

    def _cacheable(self, request: "Request") -> bool:
        # Multimodal inputs and prompt embeddings change what the tokens' KV is without
        # changing the token ids: such prompts are never keyed, stored or loaded.
        return not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None

    @staticmethod
    def _wants(request: "Request", what: str) -> bool:
        """The request's ``kv_transfer_params`` may say ``kvcache_load: false`` (compute,
        do not load from the tiers) or ``kvcache_save: false`` (store nothing of it)."""
        params = getattr(request, "kv_transfer_params", None) or {}
        return params.get(f"kvcache_{what}", True) is not False

    # -- vLLM hooks ------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        if not self._cacheable(request):
            return 0, False
        st = self._state(request)
        st.pending_load = None
        if not self._wants(request, "load"):
            return 0, False
        keys = [c.key for c in st.chunks]
        # One lookup per rank's view; a chunk counts when every rank has it, and it
        # loads from the slowest tier any rank holds it in.
        per_view = [v.lookup(keys) for v in self.views]
        found = min(map(len, per_view)) if per_view else 0
        if (found < len(keys) and st.chunks[-1].end > num_computed_tokens
                and (self._awaiting_save(st, keys[found]) or self._awaiting_shared(st, keys[found:]))):
            return None, False  # ask again at the next step
        if not st.reuse_noted:  # what was stored before it came is used again: the workers
            st.reuse_noted = True  # copy it to disk too (a preempted request's own chunks are not)
            self._reused.update(dict.fromkeys(keys[:found]))
        tiers = [max(tiers_of[i] for tiers_of in per_view) for i in range(found)]
        hit_end = min(st.chunks[found - 1].end, st.n_tokens - 1) if found else 0
        if hit_end <= num_computed_tokens:
            return 0, False
        self._upcoming.update(dict.fromkeys(c.key for c in st.chunks[:found]))
        needed = [i for i in range(found) if st.chunks[i].end > num_computed_tokens]
        # Only a synchronous tier (DRAM: a memory copy) loads before the forward pass; any
        # chunk from another tier makes the whole load asynchronous (worker threads).
        asynchronous = any(tiers[i] not in self.sync_tiers for i in needed)
        st.planned, st.planned_chunks = {}, {}
        for i in needed:
            n = min(st.chunks[i].end, hit_end) - max(st.chunks[i].start, num_computed_tokens)
            name = self.tier_names[tiers[i]]
            st.planned[name] = st.planned.get(name, 0) + n
            st.planned_chunks[st.chunks[i].key] = (name, n)
        chunks = [ChunkIO(st.chunks[i].key, st.chunks[i].parent, [],
                          max(0, num_computed_tokens - st.chunks[i].start) // self.block_size)
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

    def _awaiting_save(self, st: RequestState, key: str) -> bool:
        """Whether to defer the request while ``key`` is being saved: until the save
        settles, at most ``SAVE_WAIT_MAX_S`` after the request's first deferral."""
        if key not in self._saving:
            return False
        now = time.monotonic()
        if st.save_wait_until is None:
            st.save_wait_until = now + SAVE_WAIT_MAX_S
        return now < st.save_wait_until

    def saves_settled(self, keys: list[str]) -> None:
        """Workers settled these saves (one entry per rank). A shared tier's view asks
        about them again (this engine may just have published them)."""
        for view in self.views:
            view.recheck_shared(keys)
        for key in keys:
            pending = self._saving.get(key)
            if pending is not None:
                pending[0] -= 1
                if pending[0] <= 0:
                    del self._saving[key]

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        st = self.requests.get(request.request_id)
        if num_external_tokens == 0 or st is None or st.pending_load is None:
            return
        block_ids = blocks.get_block_ids()[0]
        load, st.pending_load = st.pending_load, None
        for name, n in st.planned.items():
            st.loaded_tokens[name] = st.loaded_tokens.get(name, 0) + n
        st.loading = dict(st.planned_chunks)  # until the workers say a chunk failed
        by_key = {c.key: c for c in st.chunks}
        b = self.block_size
        for chunk in load.chunks:
            c = by_key[chunk.key]
            end = min(c.end, st.n_tokens - 1)  # the last token is computed, not loaded
            chunk.block_ids = list(block_ids[c.start // b + chunk.skip_blocks: -(-end // b)])
        self._loads.append(load)
        st.issued = list(load.chunks)  # blocks of an earlier load were freed (preemption)

    def build_connector_meta(self, out: "SchedulerOutput") -> TieredKVMetadata:
        meta = TieredKVMetadata(loads=self._loads, upcoming=list(self._upcoming), reused=list(self._reused))
        self._loads, self._upcoming, self._reused = [], {}, {}
        scheduled = [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        scheduled += list(zip(cached.req_ids, cached.num_computed_tokens))
        now = time.monotonic()
        while self._saving and next(iter(self._saving.values()))[1] <= now:  # a report lost
            del self._saving[next(iter(self._saving))]
        for req_id, computed in scheduled:
            st = self.requests.get(req_id)
            if st is None or not st.chunks or not self._wants(st.request, "save"):
                continue
            done = computed + out.num_scheduled_tokens.get(req_id, 0)
            block_ids = None
            while st.next_save < len(st.chunks) and st.chunks[st.next_save].end <= done:
                c = st.chunks[st.next_save]
                st.next_save += 1
                if c.key in self._saving or all(v.lookup([c.key], local_only=v.has_local) for v in self.views):
                    continue  # being saved, or stored (by us, another engine, an earlier turn)
                if block_ids is None:
                    block_ids = self._kv_manager().get_block_ids(req_id)[0]
                meta.saves.append(ChunkIO(c.key, c.parent,
                                          list(block_ids[c.start // self.block_size: -(-c.end // self.block_size)])))
                self._saving[c.key] = [len(self.views), now + SAVE_REPORT_LOST_S]
        return meta

    def loads_failed(self, invalid_block_ids: set[int]) -> None:
        """Workers could not load these blocks (entry gone, damaged, foreign, late): the
        failed chunks' tokens no longer count as loaded (vLLM recomputes them). The first
        failed chunk of each request is dropped from the shared tier's view (a local
        tier's bad entry was already deleted by the worker), so later requests do not pay
        for the same bad read again."""
        for st in self.requests.values():
            failed = [c for c in st.issued if invalid_block_ids.intersection(c.block_ids)]
            if not failed:
                continue
            for view in self.views:
                view.reject_shared(failed[0].key)
            for chunk in failed:
                name, n = st.loading.pop(chunk.key, ("", 0))
                if n:
                    st.loaded_tokens[name] -= n

    def request_finished(self, request: "Request") -> dict:
        """Forget the request; returns the tokens it loaded per tier (for its output)."""
        st = self.requests.pop(request.request_id, None)
        return {name: n for name, n in st.loaded_tokens.items() if n > 0} if st else {}
