"""Miss-ratio curves of the traffic seen so far: the share of prompt tokens each tier
would serve at 1/4, 1/2, 1, 2, 4 and 8 times its configured size.

Runs in vLLM's scheduler (engine-core process), fed once per request when it finishes
(``request_finished``: off the path of its first token, which the lookup is on), and
offline in ``cache.tools.advise`` over a recorded trace. Nothing here blocks:
no I/O, no lock, no thread. A request costs one fingerprint per chunk, plus one policy
step in each of six miniature caches for the chunks in the sample: O(1) amortised per
chunk (``bench/results/curves.md``: 4-110 us per chunk and tier with the default policy
on a loaded 2-core machine, the most at the highest rate, 1/4), and memory bounded by
``SLOTS`` whatever the tier's size (six caches holding 2 x ``SLOTS`` chunks together).

How (miniature simulation: Waldspurger et al., "Cache Modeling and Optimization using
Miniature Simulations", USENIX ATC'17; the same spatial sampling as
``cache.policy.panel``). A chunk is in a tier's sample when its 62-bit fingerprint falls
below a threshold: a uniform sample at rate ``2**-shift``, fixed from the tier's capacity
so that the largest miniature cache (8x) holds at most ``SLOTS`` chunks, and never above
``2**-MIN_SHIFT`` (what bounds the cost per chunk of a small tier). Each size has a cache
of the tier's own policy (``KVCACHE_POLICY``, in its role in the store) at that size
times the rate, fed the sampled chunks of every request through the loop
``cache.tools.replay`` runs (``serve``): the leading run of chunks present is a hit, the
rest is offered (admit, evict, insert) or reported ``seen``. A sampled chunk's parent is
the request's previous sampled chunk (the contracted chain, as in the panel).

The estimate at each size is the sampled hit tokens over the tokens the rate leads one to
expect, corrected for the sample's excess (SHARDS-adj, same paper): a prefix every request
shares (a system prompt) is one chunk that is either in the sample or not, and would
otherwise make the whole curve swing with it. The correction is phased in over the first
``ADJUST_AFTER`` sampled chunks (before, it would be mostly noise: a first request with
no chunk in the sample would read as all hits); until then the estimate leans on the plain
ratio, hit tokens over sampled tokens. Measured error against exact replays of the
shared trace and the synthetic workloads: ``bench/results/curves.md``.

Each tier is simulated as if it were the only cache: the curve of ``disk`` says what a
disk tier of that size would serve of this traffic by itself (DRAM's evictions go down to
disk and reused chunks are copied there, so a disk tier holds roughly what a cache of its
size would). The shared tier has no configured size (its backend manages its space) and
no curve.

Metrics (``stats``, through the connector's: ``cache.vllm.metrics``):
``curve:<tier>:<size>.hit_ratio`` (``kvcache:curve_hit_ratio{tier,size}``, a level),
``curve:<tier>.tokens`` (``kvcache:curve_tokens_total{tier}``: prompt tokens the curve has
seen) and ``curve:<tier>.sample_rate`` (``kvcache:curve_sample_rate{tier}``).
"""

from __future__ import annotations

from typing import Callable, Hashable, Optional, Sequence

from cache.config import CacheConfig
from cache.policy import EvictionPolicy, make_policy
from cache.policy.slots import fingerprint

# Size multipliers and their label values (a fixed set: Prometheus labels).
MULTIPLIERS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
SIZES = ("0.25", "0.5", "1", "2", "4", "8")
SLOTS = 4096  # the largest miniature cache holds at most this many chunks ...
MIN_SHIFT = 2  # ... and a tier's sample is at most 1 chunk in 2**MIN_SHIFT
ADJUST_AFTER = 256  # sampled chunks before the SHARDS-adj correction applies in full
KEY_SPACE = 1 << 62


def chunk_fingerprint(key: Hashable) -> int:
    """A uniform 62-bit integer for a chunk key: the leading bits of a hex digest (the
    store's keys, ``cache.keys``), else ``cache.policy.slots.fingerprint`` (a trace's ids)."""
    if isinstance(key, str):
        try:
            return int(key[:16], 16) >> 2
        except ValueError:
            pass
    return fingerprint(key)


def serve(policy: EvictionPolicy, keys: Sequence[Hashable], reserve: Callable[[], bool]) -> int:
    """One request through one tier, as ``cache.tools.replay`` and the miniature caches
    run it: the leading run of ``keys`` present is a hit (each ``touch``ed); every later
    key absent is offered (parent: the key before it), every later key present is
    reported ``seen`` (computed again: an earlier one missed). Returns the hits."""
    hits = 0
    for key in keys:
        if key not in policy:
            break
        policy.touch(key)
        hits += 1
    parent = keys[hits - 1] if hits else None
    offer = policy.offer
    for key in keys[hits:]:
        if key not in policy:
            offer(key, parent, 1, reserve)
        else:
            policy.seen(key, parent)
        parent = key
    return hits


class TierCurve:
    """One tier's miniature caches, one per size of ``MULTIPLIERS``."""

    def __init__(
        self,
        tier: str,
        capacity_chunks: int,
        policy: str,
        *,
        last_tier: bool = True,
        slots: int = SLOTS,
        min_shift: int = MIN_SHIFT,
    ) -> None:
        if capacity_chunks < 1:
            raise ValueError(f"{tier}: a curve needs a capacity of at least one chunk")
        self.tier = tier
        self.capacity = capacity_chunks
        shift = min_shift
        while MULTIPLIERS[-1] * capacity_chunks > slots << shift:
            shift += 1
        self.shift = shift
        self.limit = KEY_SPACE >> shift
        self.caps = [max(1, round(m * capacity_chunks / (1 << shift))) for m in MULTIPLIERS]
        self.caches = [make_policy(policy, last_tier=last_tier) for _ in MULTIPLIERS]
        self._room = [self._room_for(c, cap) for c, cap in zip(self.caches, self.caps)]
        self.all_tokens = 0  # prompt tokens of every chunk
        self.tokens = 0  # ... of the sampled ones
        self.sampled = 0  # sampled chunk accesses
        self.hit_tokens = [0] * len(MULTIPLIERS)  # ... and of those, hits at each size

    @staticmethod
    def _room_for(cache: EvictionPolicy, cap: int) -> Callable[[], bool]:
        return lambda: len(cache) < cap

    @property
    def rate(self) -> float:
        """The share of chunks simulated."""
        return 1.0 / (1 << self.shift)

    def request(self, fingerprints: Sequence[int], tokens: Sequence[int]) -> None:
        """One request's chunks, in prompt order: their fingerprints and token counts."""
        self.all_tokens += sum(tokens)
        limit = self.limit
        picked = [i for i, k in enumerate(fingerprints) if k < limit]
        if not picked:
            return
        keys = [fingerprints[i] for i in picked]
        weights = [tokens[i] for i in picked]
        self.tokens += sum(weights)
        self.sampled += len(keys)
        for j, cache in enumerate(self.caches):
            hits = serve(cache, keys, self._room[j])
            if hits:
                self.hit_tokens[j] += sum(weights[:hits])

    def ratios(self) -> dict[str, float]:
        """The estimated token hit ratio at each size label (module docstring; 0 before
        any traffic)."""
        # SHARDS-adj: what the sample holds beyond its share, phased in as the sample grows
        excess = (self.tokens - self.all_tokens * self.rate) * min(1.0, self.sampled / ADJUST_AFTER)
        base = self.tokens - excess  # the expected sampled tokens once phased in
        if base <= 0:
            return {size: 0.0 for size in SIZES}
        return {size: min(1.0, max(0.0, (h - excess) / base)) for size, h in zip(SIZES, self.hit_tokens)}


class Curves:
    """Every sized tier's curve; ``observe`` once per request (when the scheduler forgets it)."""

    def __init__(
        self,
        capacities: dict[str, int],
        policy: str,
        *,
        last_local: Optional[str] = None,
        slots: int = SLOTS,
        min_shift: int = MIN_SHIFT,
    ) -> None:
        """``capacities``: chunks each tier holds at its configured size (tiers under
        one chunk are left out); ``last_local``: the tier whose policy also judges
        admission (the others take every chunk, as in the store; None: every tier)."""
        self.tiers = [
            TierCurve(name, cap, policy, last_tier=last_local in (None, name), slots=slots, min_shift=min_shift)
            for name, cap in capacities.items()
            if cap >= 1
        ]
        self._reported: dict[str, int] = {}

    def observe(self, chunks: Sequence) -> None:
        """One request's chunks in prompt order (objects with ``key``, ``start``, ``end``:
        ``cache.vllm.request_state.Chunk``)."""
        if not self.tiers or not chunks:
            return
        fps = [chunk_fingerprint(c.key) for c in chunks]
        tokens = [c.end - c.start for c in chunks]
        for tier in self.tiers:
            tier.request(fps, tokens)

    def stats(self) -> dict[str, float]:
        """Since the last call, for each tier that saw traffic: the prompt tokens it saw
        (a delta), its curve and its sample rate (levels); flat (module docstring)."""
        out: dict[str, float] = {}
        for t in self.tiers:
            grown = t.all_tokens - self._reported.get(t.tier, 0)
            if not grown:
                continue
            self._reported[t.tier] = t.all_tokens
            out[f"curve:{t.tier}.tokens"] = grown
            out[f"curve:{t.tier}.sample_rate"] = t.rate
            for size, ratio in t.ratios().items():
                out[f"curve:{t.tier}:{size}.hit_ratio"] = ratio
        return out


def tier_curves(config: CacheConfig, chunk_bytes: int, **kwargs) -> Curves:
    """The curves of ``config``'s sized tiers; ``chunk_bytes``: what one chunk takes in
    a tier (every rank's entry). No tier is sized when ``chunk_bytes`` is unknown (0)."""
    specs = config.tiers()
    capacities = {s.name: s.capacity // chunk_bytes for s in specs if s.capacity and chunk_bytes > 0}
    last = next((s.name for s in specs if s.last_local), None)
    return Curves(capacities, config.policy, last_local=last, **kwargs)
