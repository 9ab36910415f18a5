"""The fleet's popularity signal: aged use counts per chunk (``cache.popularity``), each
node's note in the shared tier (``cache.tiers.notes``, on a real ``file://`` folder), and
the merge a new instance ranks its warm-up by (``hottest``)."""

from __future__ import annotations

import json
import os
import time
from collections import namedtuple

import pytest

from cache.keys import chunk_keys
from cache.popularity import (
    HALF_LIFE_S,
    NOTE_MAX_AGE_S,
    Hot,
    Note,
    Popularity,
    Publisher,
    decode_note,
    encode_note,
    hottest,
)
from cache.tiers.notes import list_notes, read_note, write_note
from tests.test_shared_tier import remote
from tests.test_tiers_store import NS

C = namedtuple("C", "key parent")


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def chain(n: int, seed: int) -> list[C]:
    keys = chunk_keys(NS, list(range(seed, seed + 16 * n)), 16)
    return [C(k, keys[i - 1] if i else None) for i, k in enumerate(keys)]


def scores(entries) -> dict[str, float]:
    return {h.key: h.score for h in entries}


# -- counting -----------------------------------------------------------------------------
def test_counts_age_by_half_each_half_life_and_parents_count_at_least_their_children():
    clock = Clock()
    pop = Popularity(clock=clock)
    a, b = chain(3, 0), chain(2, 1000)
    for _ in range(4):
        pop.observe(a)
    pop.observe(a[:1])  # a shorter prompt: only the first chunk
    clock.t += HALF_LIFE_S
    pop.observe(b)
    got = scores(pop.top())
    assert got[a[0].key] == pytest.approx(2.5) and got[a[1].key] == pytest.approx(2.0)
    assert got[b[0].key] == pytest.approx(1.0)
    # most used first, a parent before its child when they tie
    assert [h.key for h in pop.top()] == [a[0].key, a[1].key, a[2].key, b[0].key, b[1].key]
    top = pop.top()
    assert top[1].parent == a[0].key and top[1].depth == 1 and top[0].parent is None


def test_counting_is_bounded_and_forgets_the_least_used_first():
    clock = Clock()
    pop = Popularity(max_tracked=4, clock=clock)
    hot = chain(2, 0)
    for _ in range(3):
        pop.observe(hot)
    for seed in range(1, 20):  # one-off prompts, one chunk each
        pop.observe(chain(1, seed * 100))
    assert len(pop) <= 2 * 4
    kept = {h.key for h in pop.top()}
    assert {c.key for c in hot} <= kept  # the reused chain survives the churn, parent included


def test_weights_are_rebased_without_changing_the_counts():
    clock = Clock()
    pop = Popularity(half_life_s=1.0, clock=clock)
    a = chain(1, 0)
    pop.observe(a)
    clock.t += 50  # 2**50: past the rebase point
    pop.observe(a)
    assert scores(pop.top())[a[0].key] == pytest.approx(1.0 + 2.0**-50)


# -- the note format ----------------------------------------------------------------------
def test_a_note_round_trips_and_damaged_ones_are_refused():
    a = chain(2, 0)
    entries = [Hot(a[0].key, None, 3.5, 0), Hot(a[1].key, a[0].key, 2.0, 1)]
    note = decode_note(encode_note(entries, "node-a", 123.0))
    assert note == Note("node-a", 123.0, tuple(entries))
    good = json.loads(encode_note(entries, "node-a", 123.0))
    for bad in (
        b"not json",
        b"[]",
        json.dumps({**good, "format": 2}).encode(),
        json.dumps({**good, "written": "yesterday"}).encode(),
        json.dumps({**good, "entries": [["xyz", "", 1.0, 0]]}).encode(),
        json.dumps({**good, "entries": [[a[0].key, "", -1.0, 0]]}).encode(),
        json.dumps({**good, "entries": [[a[0].key, "", 1.0, True]]}).encode(),
        json.dumps({**good, "entries": [[a[0].key, "", 1.0]]}).encode(),
        json.dumps({**good, "entries": [[a[0].key, "", 1.0, 0]] * 20000}).encode(),
    ):
        with pytest.raises(ValueError):
            decode_note(bad)


# -- merging ------------------------------------------------------------------------------
def note(node: str, written: float, counts: list[tuple[C, int, float]]) -> Note:
    return Note(node, written, tuple(Hot(c.key, c.parent, s, d) for c, d, s in counts))


def test_hottest_sums_the_nodes_ages_their_notes_and_keeps_prefixes_whole():
    now = 10_000_000.0
    a, b, c = chain(2, 0), chain(2, 500), chain(2, 900)
    notes = [
        note("n1", now, [(a[0], 0, 3.0), (a[1], 1, 3.0), (b[0], 0, 4.0), (b[1], 1, 1.0)]),
        # an hour old: its counts weigh half
        note("n2", now - HALF_LIFE_S, [(a[0], 0, 4.0), (a[1], 1, 4.0)]),
        # a week and more: ignored
        note("n3", now - NOTE_MAX_AGE_S - 1, [(c[0], 0, 100.0), (c[1], 1, 100.0)]),
        # a child that one node ranks above its parent, and a chunk whose parent is in no note
        note("n4", now, [(c[1], 1, 9.0), (c[0], 0, 0.5), (C("ab" * 16, "cd" * 16), 1, 50.0)]),
    ]
    ranked = hottest(notes, now)
    got = [h.key for h in ranked]
    assert scores(ranked)[a[0].key] == pytest.approx(5.0) and scores(ranked)[b[0].key] == pytest.approx(4.0)
    assert "ab" * 16 not in got  # its prefix is nowhere: never warmable
    assert got.index(c[0].key) < got.index(c[1].key)  # the parent first, whatever the counts
    assert got == [c[0].key, c[1].key, a[0].key, a[1].key, b[0].key, b[1].key]


# -- publishing through the shared tier ---------------------------------------------------
def test_the_publisher_writes_one_note_per_rank_only_when_counts_change(tmp_path):
    clock = Clock(time.time())
    ranks = [remote(tmp_path / "l3", namespace=ns) for ns in ("ns0", "ns1")]
    pop = Popularity(clock=clock)
    pub = Publisher(pop, ranks, node="node/a", clock=clock)
    assert not pub.publish()  # nothing counted yet
    a = chain(2, 0)
    pop.observe(a)
    assert pub.publish()
    for tier in ranks:
        assert [n for n, _s, _m in list_notes(tier)] == ["node_a.json"]
        got = decode_note(read_note(tier, "node_a.json"))
        assert got.node == "node/a" and [h.key for h in got.entries] == [c.key for c in a]
    assert not pub.publish()  # unchanged
    # the entries' listing of the tier is not confused by the note folder
    assert list(ranks[0].scan()) == []


def test_a_restarted_node_takes_over_its_earlier_note_and_expired_notes_are_removed(tmp_path):
    clock = Clock(time.time())
    tier = remote(tmp_path / "l3")
    first = Popularity(clock=clock)
    a = chain(2, 0)
    for _ in range(3):
        first.observe(a)
    Publisher(first, [tier], node="node-a", clock=clock).publish()
    write_note(tier, "gone.json", encode_note([Hot(a[0].key, None, 1.0, 0)], "gone", clock.t))
    write_note(tier, "other.json", encode_note([Hot(a[0].key, None, 1.0, 0)], "other", clock.t))
    old = os.path.join(tier.folder, ".hot", "gone.json")
    os.utime(old, (clock.t - NOTE_MAX_AGE_S - 60,) * 2)

    clock.t += HALF_LIFE_S
    again = Popularity(clock=clock)
    pub = Publisher(again, [tier], node="node-a", clock=clock)
    pub.seed()
    assert scores(again.top())[a[0].key] == pytest.approx(1.5)  # 3 uses, an hour ago
    b = chain(1, 700)
    again.observe(b)
    assert pub.publish()
    names = {n for n, _s, _m in list_notes(tier)}
    assert names == {"node-a.json", "other.json"}
    kept = decode_note(read_note(tier, "node-a.json"))
    assert {h.key for h in kept.entries} == {a[0].key, a[1].key, b[0].key}
