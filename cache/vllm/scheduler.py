"""Scheduler side: decides what each request loads from the tiers and what gets saved.

Runs in vLLM's engine-core process, inside the scheduler loop: nothing here may block.
A lookup hashes the prompt once per request (BLAKE2b, microseconds per chunk) and asks
each tier ``contains`` (one ``stat`` per chunk and rank); no payload is read here.

Shared tier (L3). Its ``contains`` answers from memory; for chunks it does not know yet,
``store.probe`` starts background existence checks and the request is deferred (vLLM's
"ask me again" answer, ``None``) until they answer or ``lookup_wait`` passes, whichever
comes first; then it goes on with what is known. Loads from L3 are asynchronous (worker
threads) like every load below DRAM, unless no other request is running.

Saves in flight (``cache.vllm.saves``). Saves are written behind the forward pass, so a
request can arrive before the chunks an earlier request just computed are on a tier (the
same prompt again once vLLM's own prefix cache dropped it, the warm tool's second pass).
A request whose next missing chunk is still being written is deferred the same way until
every rank's worker reports that save settled (``saves_settled``), at most
``SAVE_WAIT_MAX_S`` from its first deferral. (That wait counts from the request, not from
the save: a save is sent before the forward pass that computes its chunk, and a long
prefill on a slow host may take longer than the wait.)

Chunk boundaries. A prompt of *n* tokens is cut into whole chunks and one partial
*tail* chunk holding the rest of the prompt (keyed by exactly those tokens); saves and
lookups use the same cut. A hit loads up to *n - 1* tokens (vLLM computes the last
token for its logits), so the same prompt sent again costs one token of compute, and a
prompt that extends an earlier one hits its whole chunks, then the earlier prompt's tail
where this engine saved it (``cache.vllm.tails``). A tail's last block is
partly filled: only its first positions are loaded, and vLLM writes the rest.

Hybrid models (``cache.vllm.groups``): each chunk has an entry per entry kind (full
attention under the chunk key, sliding windows only at checkpoints); ``cache.vllm.hits``
finds the longest hit every kind can serve and plans its loads, which are always
asynchronous (vLLM takes only whole-request load failures for several KV cache groups).
The cost model decides them too, all or nothing: a hit's entries serve it only together.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional

from cache.assembly import lookup_view
from cache.config import CacheConfig
from cache.curves import Curves
from cache.explain import Explainer, Lookup
from cache.keys import Namespace, prompt_chunks
from cache.popularity import Popularity
from cache.request_params import LOAD, SAVE, request_wants
from cache.vllm.groups import GroupLayout, HitPlan, checkpoints, window_chunks
from cache.vllm.hits import find_hit, full_hit, load_spans, plan_loads
from cache.vllm.metadata import LoadRequest, TieredKVMetadata
from cache.vllm.metrics import TieredKVStats
from cache.vllm.namespace import Salts
from cache.vllm.pinning import Pinner
from cache.vllm.planner import LoadPlanner
from cache.vllm.request_state import Chunk, RequestState
from cache.vllm.saves import Saves
from cache.vllm.tails import TailIndex

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# Longest a new request waits for the shared tier to say whether it holds its prefix.
LOOKUP_WAIT_MAX_S = 0.5


class SchedulerSide:
    def __init__(
        self,
        config: CacheConfig,
        namespaces: list[Namespace],
        block_size: int,
        kv_cache_manager_getter,
        layout: Optional[GroupLayout] = None,
        retention_interval: Optional[int] = 0,
        bytes_per_block: int = 0,
        pinner: Optional[Pinner] = None,
        curves: Optional[Curves] = None,
        popularity: Optional[Popularity] = None,
        kind_bytes: tuple[int, ...] = (),
    ) -> None:
        """``bytes_per_block``: KV bytes of one block on one rank, every layer (0: unknown);
        ``popularity``: counts each request's chunks for the shared tier's notes (``cache.popularity``);
        ``kind_bytes``: per entry kind, bytes of a block (``groups.kind_block_bytes``; hybrid models)."""
        self.config = config
        self.pinner = pinner  # pins requests ask for (cache.vllm.pinning), None: none taken
        self.curves = curves or Curves({}, config.policy)  # miss-ratio curves (cache.curves)
        self.popularity = popularity
        self.block_size = block_size
        # KV cache groups and what each stores (groups.py); one full-attention kind unless
        # the model is hybrid. ``retention_interval``: vLLM's prefix_cache_retention_interval.
        self.layout = layout or GroupLayout.single(block_size)
        self.retention_interval = retention_interval
        self.chunk = config.chunk_tokens
        self.chain, self.salt = namespaces[0].chain_digest, Salts(config.weights_hash)  # salt: cache_salt + adapter
        # One lookup-only view per worker rank: a chunk counts only if every rank has it.
        self.views = [lookup_view(config, ns) for ns in namespaces]
        # Tier roles: names, fastest first (for kv_transfer_params), and which tiers (by
        # ``TierId``) load before the forward pass (the others load on worker threads).
        specs = config.tiers()
        self.tier_names = [t.name for t in specs]
        self.sync_tiers = {t.id for t in specs if t.synchronous}
        # Load or recompute, per request, from costs measured online (cache.cost).
        self.planner = LoadPlanner(
            self.tier_names,
            {t.name for t in specs if t.synchronous},
            block_size,
            bytes_per_block=bytes_per_block,
            decide=config.load_decision == "cost",
            kind_bytes=kind_bytes if self.layout.hybrid else (),
        )
        for view in self.views:  # the shared tier starts listing what it holds now, not at
            view.probe([])  # the first request (which would then wait for it)
        # Tails saved here, which longer prompts continue from (full attention only: a
        # hybrid model's windows are stored at checkpoints of its own cut).
        self.tails = None if self.layout.hybrid else TailIndex(self.chunk)
        self.saves = Saves(self.layout, self.views, kv_cache_manager_getter, block_size, pinner, self.tails)
        self.lookup_wait = min(config.shared_timeout_ms / 1000, LOOKUP_WAIT_MAX_S) if config.has_shared else 0.0
        self.requests: dict[str, RequestState] = {}
        self._loads: list[LoadRequest] = []
        self._upcoming: dict[str, None] = {}  # ordered set of chunk keys queued requests hit
        self._reused: dict[str, None] = {}  # ordered set of stored entry keys new requests found
        self._hurry = False  # a request waits for saves in flight: the workers write at once
        # Requests the last step ran that are not finished: while there are none, loads from
        # any tier run before the forward pass (nothing to stall).
        self._running: set[str] = set()
        shared = [v.shared for v in self.views if v.shared is not None]
        self.explain = Explainer(
            self.chain, self.chunk, self.tier_names[0] if self.tier_names else "none", lambda: all(t.up for t in shared)
        )

    # -- chunking --------------------------------------------------------------
    def _state(self, request: "Request") -> RequestState:
        st = self.requests.get(request.request_id)
        if st is None:
            st = self.requests[request.request_id] = RequestState(request)
        tokens = request.prompt_token_ids or []
        if st.n_tokens != len(tokens):
            st.chunks, st.n_tokens = self._cut(tokens, request), len(tokens)
            if self.popularity is not None:
                self.popularity.observe(st.chunks)
            if self.layout.windows:
                st.checkpoints = checkpoints(
                    [(c.start, c.end) for c in st.chunks], st.n_tokens, self.chunk, self.retention_interval
                )
                self._plan_window_saves(st)
        return st

    def _plan_window_saves(self, st: RequestState) -> None:
        bounds = [(c.start, c.end) for c in st.chunks]
        st.window_saves = {
            i: window_chunks(k, bounds, st.checkpoints, self.block_size)
            for i, k in enumerate(self.layout.kinds)
            if not k.full
        }

    def _cut(self, tokens, request) -> list[Chunk]:
        """The prompt's chunks, for lookups and for saves alike."""
        cut, kinds = prompt_chunks(self.chain, tokens, self.chunk, self.salt(request)), self.layout.kinds
        return [
            Chunk(k, cut[i - 1][0] if i else None, s, e, tuple(kind.key(k) for kind in kinds))
            for i, (k, s, e) in enumerate(cut)
        ]

    def _cacheable(self, request: "Request") -> bool:
        # Multimodal inputs and prompt embeddings change the KV, not the token ids: never cached.
        return not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None

    # -- vLLM hooks ------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        if not self._cacheable(request):
            return 0, False
        st = self._state(request)
        st.pending_load = None
        if self.pinner is not None:
            self.pinner.offer(request, st.chunks, st.n_tokens)
        if not request_wants(request, LOAD) or getattr(request, "skip_reading_prefix_cache", False):  # prompt_logprobs
            st.why = self._looked_up(st, num_computed_tokens, [], load=False)
            return 0, False
        # The longest hit every entry kind can serve, and the keys that would make it longer.
        plan, missing, found = find_hit(self.layout, self.views, st.chunks, st.n_tokens, num_computed_tokens)
        if (
            missing
            and st.chunks[-1].end > num_computed_tokens
            and (any(self.saves.awaiting(st, k) for k in missing) or self._awaiting_shared(st, missing))
        ):
            self._hurry = True  # the workers write what they hold back (cache.store.idle_gate)
            return None, False  # ask again at the next step
        tail = None
        if self.tails is not None and len(found) < len(st.chunks) and (plan is None or plan.chunks == len(found)):
            c, parent = st.chunks[len(found)], st.chunks[len(found) - 1].key if found else None
            tokens, salt = (request.prompt_token_ids or [])[c.start : c.end], self.salt(request)
            saving = lambda key: self.saves.awaiting(st, key)  # noqa: E731
            tail = self.tails.find(self.views, self.chain, parent, tokens, c.start, num_computed_tokens, salt, saving)
            if tail is not None and tail[2] is None:  # an earlier prompt's tail, still being saved
                self._hurry = True
                return None, False
        st.why = self._looked_up(st, num_computed_tokens, [t.name for t in found])
        chunks = st.chunks
        if tail is not None and (tier := tail[2]) is not None:  # the hit may go on into an earlier prompt's tail
            key, end = tail[0], tail[1]
            longer = st.chunks[: len(found)] + [Chunk(key, parent, c.start, end, (key,))]
            extended = full_hit(self.layout, longer, st.n_tokens, num_computed_tokens, found + [tier])
            if extended is not None:
                chunks, plan, st.why.partial = longer, extended, (key, end, tier.name)
        if not st.reuse_noted:  # what was stored before it came is used again: the workers
            st.reuse_noted = True  # copy it to disk too (a preempted request's own chunks are not)
            loads = [chunks[x.chunk].keys[x.kind] for x in (plan.loads if plan else ())]
            self._reused.update(dict.fromkeys([c.keys[0] for c in st.chunks[: len(found)]] + loads))
        if plan is not None and plan.junction is not None and plan.junction not in st.checkpoints:
            st.checkpoints.add(plan.junction)  # store the window there for the next request
            self._plan_window_saves(st)
        if plan is None or plan.hit_end <= num_computed_tokens:
            return 0, False
        # DRAM loads run before the forward pass; a chunk from another tier makes the load
        # asynchronous, unless no other request runs (then it stalls nobody, and waiting
        # would only add engine steps). Hybrid models' loads are always asynchronous:
        # vLLM takes only request-level load failures for them (``LoadPlanner.plan``).
        inline = not self.layout.hybrid and not (self._running - {request.request_id})
        plan, cost = self._cost_cut(request.request_id, st, plan, chunks, num_computed_tokens, inline)
        if plan is None:
            return 0, False
        hit_end = plan.hit_end
        self._upcoming.update(dict.fromkeys(chunks[x.chunk].keys[x.kind] for x in plan.loads))
        asynchronous = self.layout.hybrid or (not inline and any(x.tier not in self.sync_tiers for x in plan.loads))
        st.planned, ios = plan_loads(self.layout, plan, chunks, num_computed_tokens)
        st.hit = chunks
        st.pending_load = LoadRequest(
            request.request_id,
            ios,
            asynchronous,
            hit_end,  # then computes the rest
            cost.estimate_s,
            cost.deadline_s,
            st.n_tokens - hit_end,
        )
        return hit_end - num_computed_tokens, asynchronous

    def _cost_cut(self, req_id: str, st: RequestState, plan: HitPlan, chunks: list, computed: int, inline: bool):
        """The part of ``plan`` (over the hit's ``chunks``) worth loading (``cache.cost``):
        all of it, a prefix of its chunks, or nothing (None: recompute); and the cost
        model's plan. A hybrid model's hit loads whole or not at all (``hits.load_spans``)."""
        spans, sizes = load_spans(self.layout, plan, chunks, self.planner.kind_bytes)
        cost = self.planner.plan(req_id, spans, st.n_tokens, computed, inline, entry_bytes=sizes)
        if cost.chunks >= len(plan.loads):
            return plan, cost
        if cost.chunks == 0:  # (a hybrid hit's plan: all or nothing)
            cut = None
        else:
            last = plan.loads[cost.chunks - 1].chunk
            cut = HitPlan(last + 1, min(chunks[last].end, st.n_tokens - 1), plan.loads[: cost.chunks])
        self.explain.chose_recompute(st.why, min(x.chunk for x in plan.loads[cost.chunks :]))
        return cut, cost

    def _looked_up(self, st: RequestState, l0: int, found: list[str], load: bool = True) -> Lookup:
        return self.explain.looked_up(
            st.request.prompt_token_ids or [],
            l0,
            [(c.key, c.start, c.end) for c in st.chunks],
            found,
            self.saves.in_flight,
            self.salt(st.request),
            load,
            request_wants(st.request, SAVE),
        )

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

    def saves_settled(self, keys: list[str]) -> None:
        """Workers settled these saves (one entry per rank). A shared tier's view asks
        about them again (this engine may just have published them)."""
        for view in self.views:
            view.recheck_shared(keys)
        self.saves.settled(keys)

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        st = self.requests.get(request.request_id)
        if num_external_tokens == 0 or st is None or st.pending_load is None:
            return
        block_ids = blocks.get_block_ids()  # one list per KV cache group
        load, st.pending_load = st.pending_load, None
        for name, n in st.planned.items():
            st.loaded_tokens[name] = st.loaded_tokens.get(name, 0) + n
        by_key = {key: c for c in st.hit for key in c.keys}
        for chunk in load.chunks:
            c = by_key[chunk.key]
            # the last token is computed, not loaded (hit_end <= n_tokens - 1)
            chunk.block_ids = self.layout.kinds[chunk.kind].load_blocks(
                c.start, c.end, chunk.skip_blocks, load.hit_end, block_ids, self.block_size
            )
        self._loads.append(load)
        st.issued.extend(load.chunks)
        self.planner.issued(request.request_id)

    def planned_tokens(self, req_id: str) -> dict[str, int]:
        """Tokens per tier of the request's last planned load (vLLM's hit sources)."""
        return dict(self.requests[req_id].planned) if req_id in self.requests else {}

    def build_connector_meta(self, out: "SchedulerOutput") -> TieredKVMetadata:
        meta = TieredKVMetadata(
            loads=self._loads,
            upcoming=list(self._upcoming),
            reused=list(self._reused),
            publish=self.pinner.take_publish() if self.pinner else [],
            hurry=self._hurry,
        )
        self._loads, self._upcoming, self._reused, self._hurry = [], {}, {}, False
        scheduled = [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs]
        scheduled += list(zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.num_computed_tokens))
        self._running = {r for r, _ in scheduled}
        self.planner.ran(self._running)  # (the wait of asynchronous loads, measured)
        meta.compute = self.planner.step_compute([(c, out.num_scheduled_tokens.get(r, 0)) for r, c in scheduled])
        meta.saves = self.saves.step(scheduled, out.num_scheduled_tokens, self.requests)
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
            self.explain.load_failed(st.why, bad.key)
            for view in self.views:
                view.reject_shared(bad.key)

    def requests_failed(self, req_ids: set[str]) -> None:
        """Hybrid models report load failures per request (vLLM recomputes them whole):
        the shared tier's view forgets what those requests loaded, to ask again."""
        for req_id in req_ids:
            st = self.requests.get(req_id)
            if st is None:
                continue
            issued = {c.key for c in st.issued}
            first = next((c for c in st.chunks if issued.intersection(c.keys)), None)
            if first is not None:  # the whole request is computed again from its first load
                self.explain.load_failed(st.why, first.key)
            for view in self.views:
                for c in st.issued:
                    view.reject_shared(c.key)

    def get_stats(self) -> Optional[TieredKVStats]:
        """Since the last report: prompt tokens computed by cause (``cache.explain``), requests
        by the cost model's path (``cache.vllm.planner``), miss-ratio curves (``cache.curves``),
        pin requests by outcome (``cache.vllm.pinning``). The workers report the tiers'."""
        counts = {
            **self.explain.take_counts(),
            **self.planner.stats(),
            **self.curves.stats(),
            **(self.pinner.stats() if self.pinner else {}),
        }
        return TieredKVStats(data=counts) if counts else None

    def explain_finished(self, request: "Request") -> list[dict]:
        """Where the request's KV came from, or why it was computed (``cache.explain``);
        call before ``request_finished``."""
        st = self.requests.get(request.request_id)
        if st is None:
            return []
        ranges = self.explain.finished(st.why)
        if ranges and st.why is not None and (st.why.failed is not None or st.why.moved):
            # What was loaded, and from where: after a failed load only the ranges before
            # it (vLLM computed the rest); a chunk from the tier that served it.
            st.loaded_tokens = {}
            for r in ranges:
                if r.get("from") in self.tier_names:
                    st.loaded_tokens[r["from"]] = st.loaded_tokens.get(r["from"], 0) + r["tokens"][1] - r["tokens"][0]
        return ranges

    def request_finished(self, request: "Request") -> dict:
        """Forget the request; returns the tokens it loaded per tier (for its output;
        after a failed load, as ``explain_finished`` recounted them)."""
        st = self.requests.pop(request.request_id, None)
        if st is not None:  # the miss-ratio curves (about 1 ms a request on a loaded 2-core host)
            self.curves.observe(st.chunks)  # count it once it is served, off its first token's path
        self.planner.finished(request.request_id)
        self._running.discard(request.request_id)
        return dict(st.loaded_tokens) if st else {}
