"""Placement as data: a local tier's policy decides (``cache.policy.Decision``: admit or not,
which victims leave), and the functions here turn that decision into a ``Plan`` ("write to
tier j; demote these to k; publish those; drop these") that the store's writer thread
executes (``cache.store.writer``).

Pure: no I/O, no lock, no tier. What the plan depends on beyond the decision comes in as
arguments: the local tiers' capacities (``Layout``) and small predicates that the caller
answers from its tiers and its ``SharedAdmission`` (whether a victim is pinned, whether
the tier below holds it already, whether the shared tier should get it). Runs on the
writer thread (and the read threads, for a hit); every call is O(victims).

Local tiers are numbered top-down from 0 (DRAM, disk); the shared tier, if any, is not a
target here: entries go to it only as ``publish``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from cache.policy import Decision


@dataclass(frozen=True)
class Layout:
    """The local tiers as placement sees them: each one's capacity in bytes (None:
    unbounded), top-down, and whether a shared tier sits below them."""

    capacities: tuple[Optional[int], ...]
    shared: bool = False

    @property
    def n_local(self) -> int:
        return len(self.capacities)

    def top_for(self, nbytes: int) -> Optional[int]:
        """The first local tier that can hold an entry of ``nbytes`` at all: new entries and
        promotions go there (a DRAM tier smaller than one entry is passed over)."""
        for i, capacity in enumerate(self.capacities):
            if capacity is None or nbytes <= capacity:
                return i
        return None


@dataclass(frozen=True)
class Plan:
    """What the writer thread does. Every field may be empty; ``Plan()`` does nothing."""

    write: Optional[int] = None  # local tier the entry is written into (through its policy)
    refuse: Optional[int] = None  # local tier that cannot take it (noted ``not_admitted``)
    seen: Optional[int] = None  # local tier that holds it already: its policy is told
    demote: tuple[tuple[str, int], ...] = ()  # (victim, local tier it moves down into)
    publish: tuple[str, ...] = ()  # keys sent to the shared tier
    drop: tuple[str, ...] = ()  # victims deleted, kept nowhere
    keep: tuple[str, ...] = ()  # pinned victims passed over (back in the policy after)


def place_new(layout: Layout, key: str, nbytes: int, holder: Optional[int], publish: bool) -> Plan:
    """A newly computed entry of ``nbytes``: written to the top tier that can hold it, unless
    local tier ``holder`` has it already (computed again: an access that missed); published
    when ``publish`` (marked shared, admitted by the shared rule) or no local tier exists."""
    shared = (key,) if layout.shared and (publish or not layout.n_local) else ()
    if holder is not None:
        return Plan(seen=holder, publish=shared)
    top = layout.top_for(nbytes)
    if top is None and layout.n_local:
        return Plan(refuse=layout.n_local - 1, publish=shared)  # larger than every local tier
    return Plan(write=top, publish=shared)


def place_hit(layout: Layout, tier: int, key: str, nbytes: int, reused: bool, promote: bool) -> Plan:
    """An entry of ``nbytes`` just read from tier ``tier`` (local, or the shared one at
    ``n_local``): promoted to the top tier that can hold it when that is higher, published
    when a local copy is now ``reused`` (the shared rule said so)."""
    shared = (key,) if layout.shared and reused and tier < layout.n_local else ()
    top = layout.top_for(nbytes) if promote else None
    return Plan(write=top if top is not None and top < tier else None, publish=shared)


def place_victims(
    layout: Layout,
    tier: int,
    decision: Decision,
    pinned: Callable[[str], bool],
    below_holds: Callable[[str], bool],
    to_shared: Callable[[str], bool],
) -> Plan:
    """Where the victims ``decision`` names leave local tier ``tier`` for: a pinned one is
    kept (passed over); otherwise it moves down to the next local tier (dropped here when
    that tier has it already); from the last local tier it is published when
    ``to_shared(victim)`` (asked only there, only when a shared tier exists), else dropped."""
    keep, demote, publish, drop = [], [], [], []
    last = tier + 1 == layout.n_local
    for victim in decision.victims:
        if pinned(victim):
            keep.append(victim)
        elif not last and below_holds(victim):
            drop.append(victim)
        elif not last:
            demote.append((victim, tier + 1))
        elif layout.shared and to_shared(victim):
            publish.append(victim)
        else:
            drop.append(victim)
    return Plan(demote=tuple(demote), publish=tuple(publish), drop=tuple(drop), keep=tuple(keep))


def place_pinned(layout: Layout, tier: int, kept: Sequence[str]) -> Plan:
    """The policy of local tier ``tier`` has no victim left and only pinned entries were
    passed over: the oldest of them moves down a tier (stored there before it leaves), if
    there is a tier below; otherwise nothing (no room)."""
    if kept and tier + 1 < layout.n_local:
        return Plan(demote=((kept[0], tier + 1),))
    return Plan()
