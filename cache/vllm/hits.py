"""Scheduler side, per request: the hit every entry kind can serve and the loads it takes.

Runs in vLLM's engine-core process, inside the scheduler loop (``SchedulerSide``): nothing
here may block. Lookups are the views' ``lookup`` (``contains`` on local tiers, the shared
tier's memory); no payload is read. The arithmetic of what a hit needs of each entry kind
is in ``cache.vllm.groups``; a model with one full-attention group has one kind, whose
entries are the chunks themselves, so it finds and loads exactly what it always did.

``chunks`` are the request's ``request_state.Chunk`` objects (``key``, ``start``, ``end``,
``keys``: one entry key per kind).
"""

from __future__ import annotations

from typing import Optional, Sequence

from cache.tiers.identity import TierId
from cache.vllm.groups import GroupLayout, HitPlan, plan_hit, window_chunks
from cache.vllm.metadata import ChunkIO


def entry(chunks: Sequence, kind: int, i: int) -> tuple[str, Optional[str]]:
    """Key and parent of chunk ``i``'s entry of ``kind``: full attention chains chunk to
    chunk; a window entry hangs off its chunk's first-kind entry, so prefix-aware
    policies drop it before the chunk it serves."""
    c = chunks[i]
    if kind == 0:
        return c.keys[0], (chunks[i - 1].keys[0] if i else None)
    return c.keys[kind], c.keys[0]


def find_hit(
    layout: GroupLayout, views: Sequence, chunks: Sequence, n_tokens: int, computed: int
) -> tuple[Optional[HitPlan], list[str], list[TierId]]:
    """The longest hit every entry kind can serve (``groups.plan_hit``) with one lookup
    view per rank, the keys that would make it longer but are missing (to wait for
    saves in flight or the shared tier), and the tier of each leading full-attention
    entry every rank holds (for ``cache.explain``; for a hybrid model only those inside
    the hit, which its windows bound). An entry counts when every rank has it, and it
    loads from the slowest tier any rank holds it in (``TierId`` orders by speed)."""
    kinds = layout.kinds
    memo: dict[str, Optional[TierId]] = {}

    def tier_of(key: str) -> Optional[TierId]:
        if key not in memo:
            found = [v.lookup([key]) for v in views]
            memo[key] = max(f[0] for f in found) if all(found) else None
        return memo[key]

    full = next((i for i, k in enumerate(kinds) if k.full), None)
    if full is not None:
        keys = [c.keys[full] for c in chunks]
        per_view = [v.lookup(keys) for v in views]
        run = min(map(len, per_view)) if per_view else 0
        full_tiers = [max(tiers_of[i] for tiers_of in per_view) for i in range(run)]
        missing = keys[run:]
    else:
        run, full_tiers, missing = len(chunks), [], []
    bounds = [(c.start, c.end) for c in chunks]
    plan = plan_hit(layout, bounds, n_tokens, computed, run, lambda kind, i: tier_of(chunks[i].keys[kind]), full_tiers)
    if chunks and layout.windows:  # the windows the whole prompt's hit needs
        longest = min(chunks[-1].end, n_tokens - 1)
        for w, kind in enumerate(kinds):
            if not kind.full:
                need = window_chunks(kind, bounds, {longest}, layout.block_size)
                missing += [
                    chunks[i].keys[w]
                    for i in sorted(need)
                    if chunks[i].end > computed and tier_of(chunks[i].keys[w]) is None
                ]
    if layout.hybrid:
        full_tiers = full_tiers[: plan.chunks if plan is not None else 0]
    return plan, missing, full_tiers


def full_hit(
    layout: GroupLayout, chunks: Sequence, n_tokens: int, computed: int, tiers: Sequence[TierId]
) -> Optional[HitPlan]:
    """The hit of a full-attention model whose ``chunks`` every rank holds, in ``tiers``
    (the scheduler's, when it goes on into an earlier prompt's tail: ``cache.vllm.tails``);
    None when it serves nothing past ``computed``."""
    bounds = [(c.start, c.end) for c in chunks]
    return plan_hit(layout, bounds, n_tokens, computed, len(chunks), lambda kind, i: None, tiers)


def plan_loads(
    layout: GroupLayout, plan: HitPlan, chunks: Sequence, computed: int
) -> tuple[dict[str, int], list[ChunkIO]]:
    """The prompt tokens the hit serves per tier name (a chunk counts under the slowest
    tier of its entries) and one ``ChunkIO`` per entry to load (block ids filled in once vLLM
    allocates them). Each token is counted once, on the first entry of its chunk; those
    of chunks with no entry to load (outside every window) on the first entry of all."""
    B = layout.block_size
    slowest: dict[int, TierId] = {}
    for x in plan.loads:  # (compared only when a chunk has several entries: hybrid models)
        held = slowest.get(x.chunk)
        slowest[x.chunk] = x.tier if held is None or x.tier > held else held
    planned: dict[str, int] = {}
    tokens: dict[int, int] = {}  # per chunk: its tokens in the hit
    for i in range(plan.chunks):
        c = chunks[i]
        if c.end > computed:
            tokens[i] = min(c.end, plan.hit_end) - max(c.start, computed)
            tier = slowest.get(i)
            if tier is None:  # no entry of it to load: the slowest tier of all
                tier = max(slowest.values())
            planned[tier.name] = planned.get(tier.name, 0) + tokens[i]
    rest = sum(n for i, n in tokens.items() if i not in slowest)
    out: list[ChunkIO] = []
    for x in plan.loads:
        key, parent = entry(chunks, x.kind, x.chunk)
        c = chunks[x.chunk]
        held_from = layout.kinds[x.kind].blocks(c.start, c.end, B)[0]
        n = tokens.pop(x.chunk, 0) + (rest if not out else 0)
        out.append(ChunkIO(key, parent, [], x.first_block - held_from, kind=x.kind, tokens=n, tier=x.tier.name))
    return planned, out


def load_spans(
    layout: GroupLayout, plan: HitPlan, chunks: Sequence, kind_bytes: Sequence[int]
) -> tuple[list[tuple[int, int, str]], Optional[list[int]]]:
    """A hit's loads for the cost model (``LoadPlanner.plan``): per chunk to load, its
    tokens in the hit and its tier's name, in order (bytes: None, the planner's per block).

    A hybrid model's hit serves only whole (its full-attention chain and the windows
    before its end): per entry to load, its chunk's tokens in the hit and its tier,
    ordered by end (the last ends where the hit does), and the bytes it reads (a load
    reads whole entries: a window entry holds only its chunk's blocks under the window;
    ``kind_bytes``: per block of each kind, empty when unknown)."""
    if not layout.hybrid:
        return [(chunks[x.chunk].start, min(chunks[x.chunk].end, plan.hit_end), x.tier.name) for x in plan.loads], None
    B = layout.block_size
    spans, sizes = [], []
    for x in sorted(plan.loads, key=lambda x: (min(chunks[x.chunk].end, plan.hit_end), x.kind)):
        c = chunks[x.chunk]
        first, last = layout.kinds[x.kind].blocks(c.start, c.end, B)
        spans.append((c.start, min(c.end, plan.hit_end), x.tier.name))
        sizes.append((last - first) * (kind_bytes[x.kind] if kind_bytes else 0))
    return spans, sizes
