"""Warm scale-out (``KVCACHE_WARM_DRAM``) without an engine: a worker's warm-up of its DRAM
tier on real tiers (``cache.dram_warm``: which entries, in which order, within which
bounds, verified)."""

from __future__ import annotations

import os
import time

import pytest

from cache.codec import decode, encode_header
from cache.dram_warm import DramWarm
from cache.keys import prompt_chunks
from cache.popularity import Popularity, Publisher
from cache.policy import LRUPolicy
from cache.store import TieredStore
from cache.tiers.files import FileTier
from tests.test_popularity import Clock, chain
from tests.test_shared_tier import remote
from tests.test_tiers_store import NS, payload

ENTRY = 1000 + 256       # one chunk's entry: payload + header
CHUNK = 16               # tokens per chunk


def entry(key: str, parent, i: int) -> list:
    data = payload(i)
    return [encode_header(NS, key, "uint8", (1000,), data, b"", parent), data]


def put(tier, key: str, parent, i: int = 0) -> None:
    assert tier.reserve(ENTRY, key) and tier.write(key, entry(key, parent, i), ENTRY)


def node(tmp_path, dram_entries: int):
    """A worker's store: DRAM (tmpfs-like folder), disk, and the shared tier."""
    l3 = remote(tmp_path / "l3")
    tiers = [FileTier(str(tmp_path / "dram"), "ns", dram_entries * ENTRY, "dram", use_mmap=True),
             FileTier(str(tmp_path / "disk"), "ns", 100 * ENTRY, "disk"), l3]
    return TieredStore(tiers, NS, [LRUPolicy(), LRUPolicy()]), l3


def dram_keys(store) -> set[str]:
    return {k for k, _size in store.tiers[0].scan()}


def publish_note(l3, node_name: str, uses: list[tuple[list, int]]) -> None:
    clock = Clock(time.time())
    pop = Popularity(clock=clock)
    for c, n in uses:
        for _ in range(n):
            pop.observe(c)
    assert Publisher(pop, [l3], node=node_name, clock=clock).publish()


# -- the worker's warm-up -----------------------------------------------------------------
@pytest.fixture
def fleet(tmp_path):
    """A shared tier two nodes have used: chains a (4 chunks, used 10 times), b (3, 5 times;
    its second entry damaged), c (2, once); two prompts of the warm-prompt set."""
    p_tokens, q_tokens = list(range(100, 140)), list(range(200, 248))   # 2 chunks + tail; 3 chunks
    p = [k for k, _s, _e in prompt_chunks(NS, p_tokens, CHUNK)]
    q = [k for k, _s, _e in prompt_chunks(NS, q_tokens, CHUNK)]
    put(FileTier(str(tmp_path / "disk"), "ns", 100 * ENTRY, "disk"), q[0], None)  # on this node's disk
    store, l3 = node(tmp_path, dram_entries=12)
    a, b, c = chain(4, 0), chain(3, 5000), chain(2, 9000)
    for i, x in enumerate(a + b + c):
        put(l3, x.key, x.parent, i)
    damaged = os.path.join(l3.folder, b[1].key[:2], b[1].key)
    raw = bytearray(open(damaged, "rb").read())
    raw[-1] ^= 0xFF
    open(damaged, "wb").write(raw)
    publish_note(l3, "node-1", [(a, 6), (b, 5)])
    publish_note(l3, "node-2", [(a, 4), (c, 1)])
    for i, k in enumerate(p):
        put(l3, k, p[i - 1] if i else None, i)
    put(l3, q[2], q[1])   # q[1] is nowhere
    return store, (a, b, c), (p_tokens, q_tokens), (p, q)


def test_prompts_then_the_hottest_entries_in_order_within_the_budget(fleet):
    store, (a, b, c), prompts, (p, q) = fleet
    warm = DramWarm(store, NS, CHUNK)
    warm.run(prompts, budget=6 * ENTRY + ENTRY // 2)
    s = warm.status()
    assert s["state"] == "done" and s["notes"] == 2
    # prompts: p whole; q's first chunk (from disk), then the one no tier holds, so not q[2]
    assert s["prompts"] == {"planned": 6, "warm": 4, "copied": 4, "bytes": 4 * ENTRY, "absent": 1, "skipped": 1}
    # hot, most used first: a (4) and b's first; b[1] fails verification (no sound entry),
    # b[2] cannot load without it; c[0]; c[1] would pass the budget
    assert s["hot"] == {"planned": 9, "warm": 6, "copied": 6, "bytes": 6 * ENTRY, "absent": 1, "skipped": 2}
    assert dram_keys(store) == set(p) | {q[0]} | {x.key for x in a} | {b[0].key, c[0].key}
    for key in dram_keys(store):   # what was installed is sound, and the policy tracks it
        decode(store.tiers[0].read(key), NS, key, b"")
    store.check()
    assert store.counters()["dram.promotions"] == 10 and store.counters()["shared.corrupt"] == 1
    store.close()


def test_dram_capacity_bounds_the_warm_up_and_entries_there_count_without_a_copy(tmp_path):
    store, l3 = node(tmp_path, dram_entries=3)
    a = chain(5, 0)
    for i, x in enumerate(a):
        put(l3, x.key, x.parent, i)
    store.close()
    put(FileTier(str(tmp_path / "dram"), "ns", 3 * ENTRY, "dram"), a[0].key, None)  # DRAM holds the first
    store, l3 = node(tmp_path, dram_entries=3)
    publish_note(l3, "node-1", [(a, 3)])
    warm = DramWarm(store, NS, CHUNK)
    warm.run([], budget=100 * ENTRY)
    hot = warm.status()["hot"]
    assert hot["warm"] == 3 and hot["copied"] == 2 and hot["skipped"] == 2   # DRAM holds 3 entries
    assert dram_keys(store) == {x.key for x in a[:3]}
    store.check()
    store.close()


def test_dram_capacity_bounds_the_warm_prompts(tmp_path):
    store, l3 = node(tmp_path, dram_entries=3)
    tokens = list(range(300, 380))   # 5 whole chunks
    keys = [k for k, _s, _e in prompt_chunks(NS, tokens, CHUNK)]
    for i, k in enumerate(keys):
        put(l3, k, keys[i - 1] if i else None, i)
    warm = DramWarm(store, NS, CHUNK)
    warm.run([tokens], budget=0)
    assert warm.status()["prompts"] == {"planned": 5, "warm": 3, "copied": 3, "bytes": 3 * ENTRY, "absent": 0,
                                        "skipped": 2}
    assert dram_keys(store) == set(keys[:3])   # the first three, none evicted for a later one
    store.close()


def test_a_stopped_warm_up_copies_nothing_more(fleet):
    store = fleet[0]
    warm = DramWarm(store, NS, CHUNK)
    warm.stop()
    warm.run(fleet[2], budget=100 * ENTRY)
    assert warm.status()["state"] == "stopped" and dram_keys(store) == set()
    store.close()


def test_a_damaged_entry_in_dram_is_replaced_by_a_sound_copy_never_counted_warm(tmp_path):
    store, l3 = node(tmp_path, dram_entries=3)
    a = chain(1, 0)
    put(l3, a[0].key, None)
    store.close()
    dram = FileTier(str(tmp_path / "dram"), "ns", 3 * ENTRY, "dram")
    put(dram, a[0].key, None)
    path = os.path.join(dram.folder, a[0].key[:2], a[0].key)
    raw = bytearray(open(path, "rb").read())
    raw[-1] ^= 0xFF
    open(path, "wb").write(raw)
    store, _l3 = node(tmp_path, dram_entries=3)
    assert store.copy_up(a[0].key) == ("copied", ENTRY)
    decode(store.tiers[0].read(a[0].key), NS, a[0].key, b"")   # sound now
    assert store.counters()["dram.corrupt"] == 1
    assert store.copy_up(a[0].key) == ("held", ENTRY)
    store.close()


def test_a_warm_up_stops_when_its_store_closes(fleet):
    store = fleet[0]
    store.close()
    assert store.copy_up(fleet[1][0][0].key) == ("refused", 0)
    warm = DramWarm(store, NS, CHUNK)
    warm.run(fleet[2], budget=100 * ENTRY)
    s = warm.status()
    assert s["state"] == "stopped" and s["error"] == "" and dram_keys(store) == set()
