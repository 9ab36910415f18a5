"""Hybrid models without an engine: which KV cache groups are stored how, what a hit
needs (cache.vllm.groups, cache.vllm.hits), the scheduler's plans for a sliding-window +
full model, copies across groups, and the cache-off report."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cache.assembly import build_tiers
from cache.config import build_cache_config
from cache.keys import Namespace
from cache.policy import LRUPolicy
from cache.store import TieredStore
from cache.tiers.identity import DISK, DRAM, Medium
from cache.tiers.memory import MemoryTier
from cache.vllm.groups import (
    EntryKind,
    GroupLayout,
    checkpoints,
    group_layout,
    plan_hit,
    window_chunks,
)
from cache.vllm.hits import find_hit, plan_loads
from cache.vllm.kv_copy import BlockCopier, KVLayout
from cache.vllm.metrics import TieredKVStats
from cache.vllm.off import CacheOff
from cache.vllm.scheduler import SchedulerSide

B, C = 128, 256
FULL = EntryKind("", (3,), ("l3",), (0,))
SWA = EntryKind("swa255", (0, 1, 2), ("l0", "l1", "l2"), (0, 1, 2), reach=255)
LAYOUT = GroupLayout((FULL, SWA), B)


def cut(n, chunk=C):
    full, tail = divmod(n, chunk)
    return [(i * chunk, (i + 1) * chunk) for i in range(full)] + ([(full * chunk, n)] if tail >= 2 else [])


@pytest.mark.parametrize("reach", [1, 100, 127, 128, 255, 300, 511, 1000])
@pytest.mark.parametrize("chunk", [128, 256, 512])
def test_a_window_entry_holds_whatever_a_hit_needs_of_its_chunk(reach, chunk):
    kind = EntryKind("w", (0,), ("l",), (0,), reach=reach)
    for n in range(2, 3 * chunk + 3, 7):
        bounds = cut(n, chunk)
        hits = {min(e, n - 1) for _s, e in bounds}
        for h in hits:
            lo = kind.needed_from(h, B)
            assert lo % B == 0 and lo <= max(0, h - reach)  # vLLM keeps [h - reach, h)
            for s, e in bounds:
                if e > lo and s < h:  # the chunk overlaps what the hit needs
                    first, last = kind.blocks(s, e, B)
                    assert first * B <= max(lo, s) and last * B >= min(e, h)


def test_full_attention_entries_hold_the_whole_chunk_under_the_chunk_key():
    assert FULL.blocks(256, 512, B) == (2, 4) and FULL.key("abc") == "abc"
    assert SWA.blocks(256, 512, B) == (2, 4)  # window 256 spans the whole chunk
    assert SWA.blocks(1280, 1500, B) == (10, 12)  # the tail: [1244, 1500) rounded out
    assert EntryKind("w", (0,), (), (), reach=127).blocks(0, 1024, B) == (7, 8)  # [896, 1024)
    assert SWA.key("abc") != "abc" and SWA.key("abc") == SWA.key("abc")


def test_checkpoints_are_the_prompt_end_its_last_whole_chunk_and_the_interval():
    bounds = cut(1500)
    assert checkpoints(bounds, 1500, C, 0) == {1499, 1280}
    assert checkpoints(bounds, 1500, C, 1024) == {1499, 1280, 1024}
    assert checkpoints(bounds, 1500, C, None) == {256, 512, 768, 1024, 1280, 1499}
    assert window_chunks(SWA, bounds, {1499, 1280}, B) == {4, 5}


def plan(present_full, present_swa, n=1500, computed=0):
    bounds = cut(n)
    return plan_hit(
        LAYOUT,
        bounds,
        n,
        computed,
        present_full,
        lambda kind, i: DRAM if i in present_swa else None,
        [DRAM] * present_full,
    )


def test_a_hit_needs_every_full_entry_and_the_window_before_its_end():
    whole = plan(6, {4, 5})
    assert (whole.chunks, whole.hit_end, whole.junction) == (6, 1499, None)
    swa = sorted((x.chunk, x.first_block) for x in whole.loads if x.kind == 1)
    assert swa == [(4, 9), (5, 10)]  # the window before 1499: tokens [1152, 1499)
    assert sorted(x.chunk for x in whole.loads if x.kind == 0) == [0, 1, 2, 3, 4, 5]
    # only the window at 1280 is there: a shorter hit, and the missing one is a junction
    shorter = plan(6, {4})
    assert (shorter.hit_end, shorter.junction) == (1280, 1499)
    # no window anywhere: nothing to load, but the junction is remembered
    none = plan(5, set())
    assert (none.chunks, none.loads, none.junction) == (0, [], 1280)
    # vLLM's own prefix cache holds the first 1408 tokens: only what is past them loads
    topped = plan(6, {4, 5}, computed=1408)
    assert sorted((x.kind, x.chunk, x.first_block) for x in topped.loads) == [(0, 5, 11), (1, 5, 11)]


def rank(held):
    """One rank's lookup view (a lookup-only store: DRAM over disk) holding ``held``:
    ``{key: "dram" or "disk"}``."""
    dram, disk = MemoryTier(1 << 20, "dram"), MemoryTier(1 << 20, "disk")
    dram.medium = Medium.CPU  # as the configured DRAM tier (cache.assembly.build_tiers)
    for key, name in held.items():
        tier = dram if name == "dram" else disk
        assert tier.reserve(1) and tier.write(key, [b"x"], 1)
    return TieredStore([dram, disk], b"ns")


def test_an_entry_loads_from_the_slowest_tier_any_rank_holds_it_in():
    """Ranks hold one entry in different tiers: it counts under the slower (``TierId``
    orders by speed), and so does its chunk's tokens when any of its entries is slower."""
    chunks = [
        SimpleNamespace(key=f"c{i}", start=s, end=e, keys=(f"c{i}", f"w{i}")) for i, (s, e) in enumerate(cut(1500))
    ]
    full = {c.key: "dram" for c in chunks}
    ranks = [
        rank({**full, "w4": "disk", "w5": "disk"}),  # the windows on disk here...
        rank({**full, "c0": "disk", "w4": "dram", "w5": "dram"}),  # ...the first chunk there
    ]
    hit, missing, found = find_hit(LAYOUT, ranks, chunks, 1500, 0)
    assert (hit.chunks, hit.hit_end, missing) == (6, 1499, [])
    assert found == [DISK] + [DRAM] * 5
    assert sorted((x.kind, x.chunk, x.tier.name) for x in hit.loads if x.chunk in (0, 4)) == [
        (0, 0, "disk"),
        (0, 4, "dram"),
        (1, 4, "disk"),
    ]
    planned, ios = plan_loads(LAYOUT, hit, chunks, 0)
    assert planned == {"disk": 256 + 256 + 219, "dram": 3 * 256}  # chunks 0, 4, 5 wait for disk
    assert [io.tier for io in ios if io.kind == 1] == ["disk", "disk"]


class Blocks:
    def __init__(self, groups):
        self.groups = groups

    def get_block_ids(self):
        return self.groups


def req(req_id, toks):
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=toks,
        all_token_ids=toks,
        lora_request=None,
        mm_features=None,
        prompt_embeds=None,
    )


def tokens(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 250, n)]


@pytest.fixture
def hybrid(tmp_path):
    return hybrid_side(tmp_path)


def hybrid_side(tmp_path, **side_kw):
    """A scheduler side of the hybrid ``LAYOUT`` on a DRAM tier, the store that writes
    it, and the four groups' block ids; ``side_kw`` go to ``SchedulerSide``."""
    cfg = build_cache_config(
        {"KVCACHE_DRAM_PATH": str(tmp_path / "shm"), "KVCACHE_DRAM_SIZE": "16MiB", "KVCACHE_DISK_SIZE": "0"}
    )
    ns = Namespace("m", "d", "bfloat16", "hybrid", chunk_tokens=C)
    # four groups, 20 blocks each: group g's block j is 1000 * (g + 1) + j
    blocks = tuple([1000 * (g + 1) + j for j in range(20)] for g in range(4))
    manager = SimpleNamespace(get_block_ids=lambda req_id: blocks)
    side = SchedulerSide(cfg, [ns], B, lambda: manager, LAYOUT, **side_kw)
    writer = TieredStore(build_tiers(cfg, ns.id), ns.digest, [LRUPolicy()])
    return side, writer, blocks


def run_cold(side, writer, r):
    n = len(r.prompt_token_ids)
    assert side.get_num_new_matched_tokens(r, 0) == (0, False)
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={r.request_id: n},
    )
    meta = side.build_connector_meta(out)
    for c in meta.saves:
        writer.put(c.key, c.parent, "uint8", (4,), np.zeros(4, np.uint8))
    writer.flush(10)
    side.request_finished(r)
    return meta


def test_scheduler_saves_every_full_chunk_and_the_windows_at_checkpoints(hybrid):
    side, writer, blocks = hybrid
    p1 = tokens(1, 1500)
    meta = run_cold(side, writer, req("a", p1))
    full = [c for c in meta.saves if c.kind == 0]
    swa = [c for c in meta.saves if c.kind == 1]
    assert len(full) == 6 and full[1].block_ids == [4002, 4003]  # group 3's blocks 2, 3
    assert len(swa) == 2  # chunks 4 and 5: the windows before 1280 and 1499
    assert swa[0].block_ids == [1008, 1009, 2008, 2009, 3008, 3009]  # three groups back to back
    assert swa[0].parent == full[4].key  # hangs off its chunk's full-attention entry

    # the same prompt again, from the tiers: all but its last token, asynchronously
    r = req("b", p1)
    assert side.get_num_new_matched_tokens(r, 0) == (1499, True)
    side.update_state_after_alloc(r, Blocks(blocks), 1499)
    load = side.build_connector_meta(
        SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={},
        )
    ).loads[0]
    assert sum(c.tokens for c in load.chunks) == 1499
    tail = [c for c in load.chunks if c.kind == 1][-1]
    assert tail.block_ids == [1010, 1011, 2010, 2011, 3010, 3011]
    side.request_finished(r)

    # a later turn of the conversation: hits the last whole chunk of the first prompt
    assert side.get_num_new_matched_tokens(req("c", p1 + tokens(2, 300)), 0) == (1280, True)


def test_a_new_question_on_a_shared_document_stores_the_window_at_the_junction(hybrid):
    side, writer, _ = hybrid
    doc = tokens(3, 1000)
    run_cold(side, writer, req("q1", doc + tokens(4, 200)))
    second = req("q2", doc + tokens(5, 200))
    meta = run_cold(side, writer, second)  # no window at 768 yet: nothing loads
    assert {c.kind for c in meta.saves} == {0, 1}
    third = req("q3", doc + tokens(6, 150))
    assert side.get_num_new_matched_tokens(third, 0) == (768, True)


def test_group_layout_from_vllm_specs():
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    spec = dict(block_size=B, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec([f"l{i}"], SlidingWindowSpec(sliding_window=256, **spec)) for i in range(3)]
    groups.append(KVCacheGroupSpec(["l3"], FullAttentionSpec(**spec)))
    layout = group_layout(KVCacheConfig(100, [], groups), B)
    assert layout.off_reason is None and layout.hybrid
    assert [(k.tag, k.group_ids, k.layer_names, k.reach) for k in layout.kinds] == [
        ("", (3,), ("l3",), None),
        ("swa255", (0, 1, 2), ("l0", "l1", "l2"), 255),
    ]
    single = group_layout(KVCacheConfig(100, [], [KVCacheGroupSpec(["a", "b"], FullAttentionSpec(**spec))]), B)
    assert not single.hybrid and single.kinds[0].layer_names == ("a", "b")
    mamba = MambaSpec(block_size=B, shapes=((3, 4), (2, 4, 4)), dtypes=(torch.bfloat16, torch.float32))
    ssm = group_layout(KVCacheConfig(100, [], [KVCacheGroupSpec(["m"], mamba), groups[3]]), B)
    assert "Mamba" in ssm.off_reason and not ssm.kinds
    other_block = group_layout(KVCacheConfig(100, [], [KVCacheGroupSpec(["a"], FullAttentionSpec(**spec))]), 64)
    assert "128-token blocks" in other_block.off_reason


def test_copies_span_groups_each_with_its_own_blocks():
    pool = torch.randn(12, 2, 4, 8).to(torch.bfloat16)
    caches = {"l0": pool, "l1": pool}  # vLLM's hybrid allocator: layers of two groups share memory
    copier = BlockCopier(caches, KVLayout.of(caches, 12), layer_groups=(0, 1))
    entry = copier.gather([1, 2, 7, 8])  # group 0: blocks 1, 2; group 1: blocks 7, 8
    assert tuple(entry.shape) == (2, 2, 2, 4, 8)
    assert torch.equal(entry[0, 1], pool[2]) and torch.equal(entry[1, 0], pool[7])
    copier.scatter([4, 10], entry, skip_blocks=1)  # each group's second block into block 4 and 10
    assert torch.equal(pool[4], pool[2]) and torch.equal(pool[10], pool[8])
    with pytest.raises(ValueError):
        copier.gather([1, 2, 3])


def test_the_cache_off_answers_everything_the_connector_asks_of_either_side():
    import re
    from pathlib import Path

    import cache.vllm.connector as connector

    source = Path(connector.__file__).read_text()
    asked = set(re.findall(r"(?:scheduler|worker)_side\.(\w+)\(", source))
    assert asked and {name for name in asked if not callable(getattr(CacheOff, name, None))} == set()


def test_a_model_the_cache_cannot_serve_reports_the_tiers_off_once(tmp_path):
    cfg = build_cache_config(
        {
            "KVCACHE_DRAM_PATH": str(tmp_path / "shm"),
            "KVCACHE_DRAM_SIZE": "1MiB",
            "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
            "KVCACHE_DISK_SIZE": "1MiB",
        }
    )
    off = CacheOff(cfg)
    assert off.get_num_new_matched_tokens(req("a", [1, 2, 3]), 0) == (0, False)
    assert off.build_connector_meta(None).saves == []
    stats = off.get_stats()
    assert stats.data == {"all.enabled": 0, "dram.capacity_bytes": 0, "disk.capacity_bytes": 0}
    assert not stats.is_empty() and off.get_stats() is None
    assert TieredKVStats(data={"dram.used_bytes": 5}).is_empty()
