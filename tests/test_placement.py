"""Placement as data (issue 29 item 1): a policy's ``Decision`` turned into a ``Plan`` by the
pure functions of ``cache.store.placement``, checked without a tier, a thread or I/O."""

from __future__ import annotations

from cache.policy import Decision, LRUPolicy
from cache.store.placement import Layout, Plan, place_hit, place_new, place_pinned, place_victims

DRAM_DISK_SHARED = Layout((100, 1000), shared=True)
DRAM_DISK = Layout((100, 1000))


def victims(layout, tier, *keys, pinned=(), below=(), shared=()):
    return place_victims(
        layout,
        tier,
        Decision(victims=keys),
        pinned=lambda k: k in pinned,
        below_holds=lambda k: k in below,
        to_shared=lambda k: k in shared,
    )


def test_a_policy_returns_its_decisions_as_data():
    p = LRUPolicy()
    assert p.decide("a", None, 1) == Decision(admit=True)
    for k in "abc":
        p.insert(k, None, 1)
    p.touch("a")
    assert p.evict_next() == Decision(victims=("b",)) and "b" not in p  # forgotten by the policy
    assert p.evict_next().victims == ("c",) and p.evict_next().victims == ("a",)
    assert p.evict_next() == Decision(victims=())  # nothing left


class Refusing(LRUPolicy):
    def admit(self, key, parent, size):
        return False


def test_a_refusal_is_a_decision_that_force_overrides():
    assert Refusing().decide("a", None, 1) == Decision(admit=False)
    assert Refusing().decide("a", None, 1, force=True) == Decision(admit=True)


def test_victims_of_an_upper_tier_move_down_unless_pinned_or_held_below():
    plan = victims(DRAM_DISK_SHARED, 0, "a", "b", "c", pinned={"b"}, below={"c"}, shared={"a"})
    assert plan == Plan(demote=(("a", 1),), drop=("c",), keep=("b",))  # the shared rule not asked above


def test_victims_of_the_last_local_tier_are_published_or_dropped():
    plan = victims(DRAM_DISK_SHARED, 1, "a", "b", "c", pinned={"c"}, shared={"a"})
    assert plan == Plan(publish=("a",), drop=("b",), keep=("c",))
    assert victims(DRAM_DISK, 1, "a", shared={"a"}) == Plan(drop=("a",))  # no shared tier: dropped
    assert victims(Layout((100,), shared=True), 0, "a", shared={"a"}) == Plan(publish=("a",))


def test_a_new_entry_goes_to_the_top_tier_that_can_hold_it():
    assert place_new(DRAM_DISK, "k", 50, holder=None, publish=False) == Plan(write=0)
    assert place_new(DRAM_DISK, "k", 500, holder=None, publish=False) == Plan(write=1)  # too big for DRAM
    assert place_new(DRAM_DISK, "k", 5000, holder=None, publish=False) == Plan(refuse=1)  # too big for all
    assert place_new(DRAM_DISK, "k", 50, holder=1, publish=False) == Plan(seen=1)  # computed again
    assert place_new(DRAM_DISK_SHARED, "k", 50, holder=None, publish=True) == Plan(write=0, publish=("k",))
    assert place_new(DRAM_DISK, "k", 50, holder=None, publish=True) == Plan(write=0)  # nowhere to publish
    assert place_new(Layout((), shared=True), "k", 50, holder=None, publish=False) == Plan(publish=("k",))


def test_a_hit_promotes_to_a_higher_tier_and_publishes_what_is_reused():
    assert place_hit(DRAM_DISK_SHARED, 1, "k", 50, reused=False, promote=True) == Plan(write=0)
    assert place_hit(DRAM_DISK_SHARED, 1, "k", 500, reused=False, promote=True) == Plan()  # DRAM too small
    assert place_hit(DRAM_DISK_SHARED, 0, "k", 50, reused=True, promote=True) == Plan(publish=("k",))
    assert place_hit(DRAM_DISK_SHARED, 2, "k", 50, reused=True, promote=True) == Plan(write=0)  # from shared
    assert place_hit(DRAM_DISK_SHARED, 1, "k", 50, reused=False, promote=False) == Plan()


def test_when_only_pinned_entries_are_left_the_oldest_moves_down():
    assert place_pinned(DRAM_DISK, 0, ["p", "q"]) == Plan(demote=(("p", 1),))
    assert place_pinned(DRAM_DISK, 1, ["p"]) == Plan()  # the last local tier: no room
    assert place_pinned(DRAM_DISK, 0, []) == Plan()
