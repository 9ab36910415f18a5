"""KV cache groups under vLLM's hybrid KV cache manager: what the cache stores for each
group, and what a hit needs from each.

Runs in the scheduler and in every worker: ``group_layout`` once at start-up, from
``KVCacheConfig`` alone (never from tensors), so every process derives the same
layout; the rest is per-request arithmetic in the scheduler loop (no I/O, must not
block).

vLLM gives each kind of attention its own KV cache groups (one block table each). Full
attention keeps every token. A sliding window of W tokens keeps only what the next
token attends to: its blocks before ``n - (W - 1)`` are freed and show as the null block.
Mamba / linear attention keeps a state per request.

Entries. Groups that follow the same rule form one *entry kind*, stored as one entry
per chunk holding all their layers:

- full attention (tag ``""``): the chunk's blocks, keyed by the chunk key itself, so a
  model with only full attention stores and finds exactly what it always did;
- sliding window (tag ``"swa<reach>"``, reach = W - 1 plus vLLM's extra retained
  tokens): only the chunk's blocks that some hit ending in or after the chunk can
  need (its last ``reach + 1`` tokens, rounded out to blocks), keyed by the chunk key
  and the tag.

A hit ending at token *h* needs every full-attention entry of the chunks before *h*
(a chain from the first chunk), and for each window kind the entries of the chunks
that overlap ``[floor((h - reach) / B) * B, h)``, the blocks vLLM allocates for it
(B = block size).

Checkpoints. Window entries are stored only for the chunks under the window before a
*checkpoint*, the hit ends worth serving, as vLLM's own prefix cache does for these
groups (``prefix_cache_retention_interval``):
- the prompt's end (the same prompt again) and its last whole chunk (a later turn of
  the conversation extends the prompt past it);
- a junction: where a request found full-attention entries but no window, e.g. a new
  question after a shared document; that request stores the window there, so the
  next one sharing the prefix loads it;
- every chunk boundary at or after each multiple of vLLM's
  ``prefix_cache_retention_interval`` when it is set (every boundary when it is None).

Models with any other kind of group (Mamba / linear attention, chunked local or cross
attention, draft-model groups) are served without the cache: ``off_reason`` says why.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from cache.tiers.identity import TierId

FULL_TAG = ""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class EntryKind:
    """KV cache groups stored together, one entry per chunk."""

    tag: str  # "" (full attention) or "swa<reach>"
    group_ids: tuple[int, ...]  # vLLM's KV cache group indexes
    layer_names: tuple[str, ...]  # every layer of those groups, in entry order
    layer_groups: tuple[int, ...]  # for each layer, its position in group_ids
    reach: Optional[int] = None  # tokens before a new token that it reads; None: all

    @property
    def full(self) -> bool:
        return self.reach is None

    def key(self, chunk_key: str) -> str:
        """This kind's entry key for a chunk (the chunk key itself for full attention)."""
        if self.full:
            return chunk_key
        return hashlib.blake2b(f"{chunk_key}/{self.tag}".encode(), digest_size=16).hexdigest()

    def blocks(self, start: int, end: int, block_size: int) -> tuple[int, int]:
        """The block range ``[first, last)`` an entry holds for the chunk ``[start, end)``.

        A window entry holds the blocks a hit ending at ``end - 1`` or later needs
        of the chunk; vLLM still holds them when the chunk is saved (it frees blocks
        by the tokens processed before the step that completes the chunk)."""
        first, last = start // block_size, cdiv(end, block_size)
        if self.reach is not None:
            first = max(first, max(0, end - 1 - self.reach) // block_size)
        return first, last

    def load_blocks(
        self, start: int, end: int, skip: int, hit_end: int, block_ids: Sequence[Sequence[int]], block_size: int
    ) -> list[int]:
        """The blocks a load of this kind's entry of chunk ``[start, end)`` fills, for a
        hit ending at ``hit_end``: past the entry's first ``skip`` blocks, one run per
        group of the kind, back to back (``block_ids``: vLLM's, one list per group)."""
        first = self.blocks(start, end, block_size)[0] + skip
        last = cdiv(min(end, hit_end), block_size)
        return [b for g in self.group_ids for b in block_ids[g][first:last]]

    def save_blocks(
        self, start: int, end: int, block_ids: Sequence[Sequence[int]], null: int, block_size: int
    ) -> Optional[list[int]]:
        """The blocks a save of chunk ``[start, end)`` copies into this kind's entry, one
        run per group back to back; None when vLLM already freed part of a window
        (``null``: its null block id)."""
        first, last = self.blocks(start, end, block_size)
        runs = [block_ids[g][first:last] for g in self.group_ids]
        if not self.full and any(len(r) != last - first or null in r for r in runs):
            return None
        return [b for r in runs for b in r]

    def needed_from(self, hit_end: int, block_size: int) -> int:
        """First token (block aligned) of this kind that a hit ending at ``hit_end``
        needs: vLLM allocates (and so expects loaded) the blocks from there."""
        if self.reach is None:
            return 0
        return max(0, hit_end - self.reach) // block_size * block_size


@dataclass(frozen=True)
class GroupLayout:
    kinds: tuple[EntryKind, ...]  # full attention first
    block_size: int
    off_reason: Optional[str] = None  # why the cache cannot serve this model; None: it can

    @classmethod
    def single(cls, block_size: int) -> "GroupLayout":
        """One full-attention group (layer names unknown: scheduler-side use only)."""
        return cls((EntryKind(FULL_TAG, (0,), (), ()),), block_size)

    @property
    def hybrid(self) -> bool:
        return len(self.kinds) > 1 or any(not k.full for k in self.kinds)

    @property
    def windows(self) -> tuple[EntryKind, ...]:
        return tuple(k for k in self.kinds if not k.full)

    def describe(self) -> str:
        if self.off_reason:
            return f"off ({self.off_reason})"
        parts = []
        for k in self.kinds:
            what = "full attention" if k.full or k.reach is None else f"sliding window {k.reach + 1}"
            parts.append(f"{len(k.layer_names)} layers {what} ({len(k.group_ids)} groups)")
        return "; ".join(parts)


def group_layout(kv_cache_config, block_size: int) -> GroupLayout:
    """The entry kinds of a model from vLLM's ``KVCacheConfig``, or why it cannot be cached."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    groups = kv_cache_config.kv_cache_groups
    by_tag: dict[str, list[int]] = {}
    shapes: dict[str, set] = {}
    reaches: dict[str, Optional[int]] = {}
    for gid, group in enumerate(groups):
        spec = group.kv_cache_spec
        if not getattr(group, "enable_kv_transfer", True):
            continue  # a replica vLLM rebuilds from another group after a load
        why = None
        if type(spec) in (FullAttentionSpec, MLAAttentionSpec) or (
            len(groups) == 1 and isinstance(spec, FullAttentionSpec)
        ):  # one group: as ever
            reach = None
        elif type(spec) in (SlidingWindowSpec, SlidingWindowMLASpec):
            reach = spec.sliding_window - 1 + spec.extra_retained_tokens
        elif isinstance(spec, MambaSpec):
            why = "its Mamba / linear-attention state is kept per request, not per token"
        else:
            why = f"its {type(spec).__name__} KV cache group is not supported"
        if why is None and len(groups) > 1 and getattr(group, "is_eagle_group", False):
            why = "a draft model's KV cache group (speculative decoding) is not supported"
        if why is None and spec.block_size != block_size:
            why = f"KV cache group {gid} has {spec.block_size}-token blocks, not {block_size}"
        if why is not None:
            return GroupLayout((), block_size, why)
        tag = FULL_TAG if reach is None else f"swa{reach}"
        by_tag.setdefault(tag, []).append(gid)
        reaches[tag] = reach
        shapes.setdefault(tag, set()).add(
            (
                type(spec),
                spec.page_size_bytes,
                getattr(spec, "num_kv_heads", None),
                getattr(spec, "head_size", None),
                str(spec.dtype),
            )
        )
    if not by_tag:
        return GroupLayout((), block_size, "no KV cache group can be transferred")
    kinds = []
    for tag in sorted(by_tag, key=lambda t: (t != FULL_TAG, reaches[t] or 0)):
        if len(shapes[tag]) != 1:
            return GroupLayout((), block_size, f"its {tag or 'full'} attention layers differ in KV shape")
        gids = tuple(by_tag[tag])
        names, owners = [], []
        for i, gid in enumerate(gids):
            names += groups[gid].layer_names
            owners += [i] * len(groups[gid].layer_names)
        kinds.append(EntryKind(tag, gids, tuple(names), tuple(owners), reaches[tag]))
    return GroupLayout(tuple(kinds), block_size)


def kind_block_bytes(kv_cache_config, layout: GroupLayout) -> tuple[int, ...]:
    """KV bytes of one block of each entry kind on one rank (every layer of its groups),
    from vLLM's ``KVCacheConfig``: what the scheduler's cost model prices a load with.
    Empty when the cache is off for the model."""
    groups = kv_cache_config.kv_cache_groups
    return tuple(
        sum(int(groups[g].kv_cache_spec.page_size_bytes) * len(groups[g].layer_names) for g in kind.group_ids)
        for kind in layout.kinds
    )


def null_block(kv_cache_manager) -> int:
    """vLLM's null block id: what a sliding-window group's freed blocks show as."""
    pool = getattr(kv_cache_manager, "block_pool", None)
    return pool.null_block.block_id if pool is not None else 0


# -- per request (scheduler) ---------------------------------------------------------


@dataclass(frozen=True)
class EntryLoad:
    kind: int  # index into GroupLayout.kinds
    chunk: int  # chunk index
    first_block: int  # first block (absolute) to load; the entry's earlier ones are skipped
    tier: TierId  # slowest tier any rank holds the entry in


@dataclass
class HitPlan:
    chunks: int  # the hit covers chunks [0, chunks)
    hit_end: int  # tokens computed once loaded
    loads: list[EntryLoad] = field(default_factory=list)
    junction: Optional[int] = None  # a longer full-attention hit whose window is missing


def plan_hit(
    layout: GroupLayout,
    bounds: Sequence[tuple[int, int]],
    n_tokens: int,
    computed: int,
    full_run: int,
    tiers_of: Callable[[int, int], Optional[TierId]],
    full_tiers: Sequence[TierId],
) -> Optional[HitPlan]:
    """The longest hit past ``computed`` tokens for which every kind has what it needs.

    ``bounds``: the prompt's chunks ``(start, end)``; ``full_run``: leading chunks whose
    full-attention entries every rank holds (all chunks when the model has none), with
    ``full_tiers`` their tiers; ``tiers_of(kind, chunk)``: the tier of a window entry,
    None when some rank lacks it. A hit ends at a chunk end, or at ``n_tokens - 1``
    (vLLM computes the last token). Returns None when nothing past ``computed`` hits.
    """
    B = layout.block_size
    fulls = [i for i, k in enumerate(layout.kinds) if k.full]
    windows = [i for i, k in enumerate(layout.kinds) if not k.full]
    junction = None
    for j in range(full_run - 1, -1, -1):
        hit_end = min(bounds[j][1], n_tokens - 1)
        if hit_end <= computed:
            break
        loads: list[EntryLoad] = []
        for w in windows:
            kind = layout.kinds[w]
            lo = max(computed, kind.needed_from(hit_end, B))
            for c in range(j + 1):
                start, end = bounds[c]
                if end <= lo:
                    continue
                first = max(lo, start) // B
                tier = tiers_of(w, c)
                if tier is None or first < kind.blocks(start, end, B)[0]:
                    break
                loads.append(EntryLoad(w, c, first, tier))
            else:
                continue
            break  # a window entry is missing: try a shorter hit
        else:
            for f in fulls:
                loads += [
                    EntryLoad(f, c, max(computed // B, bounds[c][0] // B), full_tiers[c])
                    for c in range(j + 1)
                    if bounds[c][1] > computed
                ]
            plan = HitPlan(j + 1, hit_end, loads)
            if fulls and j < full_run - 1:
                plan.junction = min(bounds[full_run - 1][1], n_tokens - 1)
            return plan
        if fulls and junction is None:
            junction = min(bounds[full_run - 1][1], n_tokens - 1)
    if junction is not None:
        return HitPlan(0, computed, [], junction)
    return None


def checkpoints(
    bounds: Sequence[tuple[int, int]], n_tokens: int, chunk_tokens: int, interval: Optional[int]
) -> set[int]:
    """Hit ends whose windows a request stores: its end, its last whole chunk, and the
    periodic ones (``interval``: vLLM's ``prefix_cache_retention_interval``)."""
    if not bounds:
        return set()
    ends = {min(bounds[-1][1], n_tokens - 1)}
    whole = [e for _s, e in bounds if e - _s == chunk_tokens]
    if whole:
        ends.add(whole[-1])
    for _s, e in bounds:
        if interval is None or (interval > 0 and e // interval > (e - chunk_tokens) // interval):
            ends.add(min(e, n_tokens - 1))
    return ends


def window_chunks(kind: EntryKind, bounds: Sequence[tuple[int, int]], ends: set[int], block_size: int) -> set[int]:
    """Chunks whose ``kind`` entries the hits ending at ``ends`` need."""
    out: set[int] = set()
    for h in ends:
        lo = kind.needed_from(h, block_size)
        out.update(c for c, (s, e) in enumerate(bounds) if e > lo and s < h)
    return out
