"""Scheduler side: decides what each hit loads, and how, from the costs measured online.

Runs in vLLM's engine-core process, inside the scheduler loop (``plan`` once per lookup
that hits: microseconds, no I/O). Learns from what the workers measure and send back
with each step's output (``observe``): each finished load (tier, bytes, seconds) feeds
that tier's ``cache.cost.TierRate``; each forward pass (tokens, attention pairs,
seconds) feeds the engine's ``cache.cost.PrefillRate``. ``cache.cost.choose`` then picks,
per request, how many of the chunks found to load (every one, a prefix, or none); a
load from a memory tier runs before the forward pass, any other asynchronously while
other requests run, with a deadline past which the rest is recomputed.

Counts what it chose, per request and path, and the estimated and measured load times
(the workers report the latter), for the connector's metrics (``stats``), with the rates
it fitted (when a tier or the prefill is first fitted, then every ``RATES_EVERY_S``: what
``cache.tools.advise`` prices tokens with).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Optional, Sequence

from cache.cost import ASYNC_ROUND_TRIP_S, ChunkCost, Fit, Plan, PrefillRate, TierRate, attention_pairs, choose

RATES_EVERY_S = 10.0  # how often the fitted rates ride along with the counts


class LoadPlanner:
    def __init__(
        self,
        tier_names: Sequence[str],
        synchronous: set[str],
        block_size: int,
        bytes_per_block: int = 0,
        decide: bool = True,
        clock: Callable[[], float] = time.monotonic,
        kind_bytes: Sequence[int] = (),
    ) -> None:
        """``bytes_per_block``: KV bytes of one block, every layer, on one rank (0:
        unknown, then every hit loads everything: no cost can be estimated); ``decide``
        False: every hit loads everything (``KVCACHE_LOAD_DECISION=always``). ``kind_bytes``:
        a hybrid model's bytes of a block of each entry kind (``groups.kind_block_bytes``,
        full attention first: a token's bytes, in the rates reported; ``plan`` is given each
        entry's bytes); empty, or one missing: unknown, every hit loads everything."""
        self.kind_bytes = tuple(kind_bytes) if all(kind_bytes) else ()
        if kind_bytes:
            bytes_per_block = self.kind_bytes[0] if self.kind_bytes else 0
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.decide = decide and bytes_per_block > 0
        self.synchronous = set(synchronous)
        self.tiers = {name: TierRate(clock) for name in tier_names}
        self.prefill = PrefillRate(clock)
        self._decided: dict[str, Plan] = {}
        self._issued: set[str] = set()
        # asynchronous loads issued, until their request runs: when, and their estimate
        self._waiting: dict[str, tuple[float, float]] = {}
        self.round_trip = Fit(1, clock)  # seconds an asynchronous load adds past its estimate
        self._counts: dict[str, float] = {}
        self._lock = threading.Lock()
        self._clock = clock
        self._rates_at = 0.0
        self._fitted: set[str] = set()  # what the last rates reported had fitted

    # -- deciding ------------------------------------------------------------------
    def plan(
        self,
        req_id: str,
        spans: Sequence[tuple[int, int, str]],
        n_tokens: int,
        computed: int,
        inline: bool = False,
        entry_bytes: Optional[Sequence[int]] = None,
    ) -> Plan:
        """The plan for request ``req_id``: ``spans`` are the chunks found, in order,
        as (first token, end token, tier name), ``end`` at most ``n_tokens - 1``.
        ``inline``: no other request is running: every load runs before the forward
        pass (``cache.cost.choose``).

        ``entry_bytes``: a hybrid model's hit (``cache.vllm.hits``): ``spans`` are its
        entries, ordered by end, the last ending where the hit does, with their bytes;
        they serve the hit only together, so the plan loads all of them or none, and
        always asynchronously (vLLM 0.32 takes a load failure of a model with several KV
        cache groups only for a request waiting on an asynchronous load)."""
        b = self.block_size
        synchronous, whole = (set(), True) if entry_bytes is not None else (self.synchronous, False)
        inline = inline and not whole
        if not self.decide:  # load everything
            sync = inline or all(t in synchronous for _, _, t in spans)
            plan = Plan(len(spans), len(spans), "sync" if sync else "async")
        else:
            # a load reads whole entries (the blocks of vLLM's own hit too)
            sizes = entry_bytes or [(-(-e // b) - s // b) * self.bytes_per_block for s, e, _ in spans]
            chunks = [ChunkCost(s, e, tier, n) for (s, e, tier), n in zip(spans, sizes)]
            trip = (self.round_trip.predict((1.0,)) if whole else None) or ASYNC_ROUND_TRIP_S
            plan = choose(
                chunks, n_tokens, computed, self.tiers, self.prefill, synchronous, inline, whole, round_trip=trip
            )
        with self._lock:
            self._decided[req_id] = plan  # vLLM may ask again; counted once, when it runs
        return plan

    def issued(self, req_id: str) -> None:
        """The request's load was sent to the workers: count its plan."""
        with self._lock:
            plan = self._decided.get(req_id)
            if plan is None or req_id in self._issued:
                return
            self._issued.add(req_id)
            self._count(plan)
            if plan.mode == "async" and plan.estimate_s is not None:
                self._waiting[req_id] = (self._clock(), plan.estimate_s)

    def ran(self, req_ids: Iterable[str]) -> None:
        """These requests run in this step: for those that waited on an asynchronous load
        the cost model priced, the wait beyond its estimate is a sample of what such a
        load adds to a request's first token (engine steps, the load thread's share of
        the cores); a hybrid hit, always asynchronous, is priced with it."""
        now = self._clock()
        with self._lock:
            for req_id in self._waiting.keys() & set(req_ids):
                issued, estimate = self._waiting.pop(req_id)
                self.round_trip.add((1.0,), max(0.0, now - issued - estimate))

    def finished(self, req_id: str) -> None:
        """The request is gone; a plan that loaded nothing is counted now."""
        with self._lock:
            plan = self._decided.pop(req_id, None)
            if plan is not None and req_id not in self._issued and plan.path == "recompute":
                self._count(plan)
            self._issued.discard(req_id)
            self._waiting.pop(req_id, None)

    def _count(self, plan: Plan) -> None:
        key = f"{plan.path}.requests"
        self._counts[key] = self._counts.get(key, 0) + 1

    # -- learning --------------------------------------------------------------------
    def step_compute(self, scheduled: Sequence[tuple[int, int]]) -> Optional[tuple[int, float]]:
        """This step's compute from (tokens computed before, tokens scheduled) per
        request: total tokens and attention pairs, for the workers to time; None for a
        step without prefill (decode steps alone would crowd the fit's window out and
        say little about a prefill's per-token cost)."""
        if not any(n > 1 for _, n in scheduled):
            return None
        return (sum(n for _, n in scheduled), sum(attention_pairs(n, done) for done, n in scheduled))

    def observe(self, samples: Sequence[tuple]) -> None:
        """Measurements from the workers (``TieredKVWorkerMetadata.samples``)."""
        for sample in samples:
            if sample[0] == "load" and sample[1] in self.tiers:
                _, tier, nbytes, seconds = sample[:4]
                self.tiers[tier].observe(nbytes, seconds)
            elif sample[0] == "step":
                _, tokens, pairs, seconds = sample[:4]
                self.prefill.observe(tokens, pairs, seconds)

    # -- metrics ---------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Counts since the last call, flat (``cache.vllm.metrics``: label ``plan``), and
        every ``RATES_EVERY_S`` the fitted rates (``rates``)."""
        with self._lock:
            out, self._counts = self._counts, {}
        stats = {f"plan:{k}": v for k, v in out.items()}
        fitted = {name for name, rate in self.tiers.items() if rate.fit.samples}
        if self.prefill.fit.samples:
            fitted.add("prefill")
        now = self._clock()
        if fitted and (fitted != self._fitted or now - self._rates_at >= RATES_EVERY_S):
            self._rates_at, self._fitted = now, fitted
            stats.update(self.rates())
        return stats

    def rates(self) -> dict[str, float]:
        """What the cost model has fitted so far (levels; none before a fit): per tier, a
        load's latency and seconds per token loaded (``cost:<tier>.load_latency_seconds``,
        ``.load_seconds_per_token``: one rank's bytes of a token, as loads are timed), and
        the engine's prefill seconds per token and per attention pair
        (``cost:prefill.seconds_per_token``, ``.seconds_per_pair``; ``cache.cost``)."""
        out: dict[str, float] = {}
        for name, rate in self.tiers.items():
            w = rate.fit.weights()
            if w is not None and self.bytes_per_block:
                out[f"cost:{name}.load_latency_seconds"] = float(w[0])
                out[f"cost:{name}.load_seconds_per_token"] = float(w[1]) * self.bytes_per_block / self.block_size
        w = self.prefill.fit.weights()
        if w is not None:
            out["cost:prefill.seconds_per_token"] = float(w[1])
            out["cost:prefill.seconds_per_pair"] = float(w[2])
        return out


def bytes_per_block(kv_cache_config) -> int:
    """KV bytes of one block of every layer on one rank (vLLM's ``KVCacheConfig``, one
    KV cache group); 0 when it cannot be told (the planner then loads every hit)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) != 1:
        return 0
    page = getattr(groups[0].kv_cache_spec, "page_size_bytes", 0) or 0
    return int(page) * len(groups[0].layer_names)
