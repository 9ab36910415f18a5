"""Admission and eviction policies: pure logic, no I/O, clock-free.

Runs in whichever process writes a tier (the vLLM worker, or the replay tool). Every
method is called with the store's lock held and must not block: O(1) amortized or
O(log n), no I/O, no sleeping.

A policy tracks *chunk keys* (any hashable: the store passes ``str`` digests, the replay
tool passes ``int`` block ids). Each chunk has an optional ``parent``: the key of the
chunk before it in the same token sequence. A chunk is worth nothing without its
ancestors, which is what prefix-aware policies exploit.

Modules: this one holds the contract (``EvictionPolicy``), ``LRUPolicy``, the
``POLICIES`` registry and ``DEFAULT_POLICY``; ``cache/policy_prefix.py`` holds the
recommended ``prefix-adaptive`` policy; ``cache/policies_ref.py`` holds the reference
points ARC, S3-FIFO and the offline optimum Belady (replay only, not registered).
``python -m cache.replay`` and ``bench/bench_policy.py`` compare them on a trace.

Contract (checked by ``tests/test_policy.py`` against every policy):
- ``insert`` is only called for keys not present, and only after ``admit`` said yes;
- ``victim()`` names a present key (or ``None`` when empty) and does not remove it; the
  store removes it with ``remove`` once the entry is gone from the tier;
- ``remove`` of an absent key is a no-op (entries may vanish behind our back when
  another process shares the tier);
- ``touch`` of an absent key is a no-op.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Hashable, Iterable, Optional

Key = Hashable


class EvictionPolicy(ABC):
    """Decides which entry of one tier goes first, and whether a new one gets in."""

    name: str = "abstract"

    def admit(self, key: Key, parent: Optional[Key], size: int) -> bool:
        """Whether the tier should store ``key`` at all. Default: take everything."""
        return True

    @abstractmethod
    def insert(self, key: Key, parent: Optional[Key], size: int) -> None:
        """``key`` is now stored in the tier."""

    @abstractmethod
    def touch(self, key: Key) -> None:
        """``key`` was read (a hit)."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """``key`` is no longer stored (evicted or deleted elsewhere)."""

    @abstractmethod
    def victim(self) -> Optional[Key]:
        """The present key to evict next, or ``None`` when nothing is tracked."""

    def miss(self, key: Key, parent: Optional[Key]) -> None:
        """``key`` was looked up and not found (history for admission). Default: ignore."""

    def hint_upcoming(self, keys: Iterable[Key]) -> None:
        """Keys that queued requests will need soon (protect them). Default: ignore.

        Call it with the keys of the requests waiting *now*; a call supersedes the
        previous one (a request that left the queue needs no protection any more)."""

    @abstractmethod
    def __contains__(self, key: Key) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used: the reference every other policy must beat."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, parent: Optional[Key], size: int) -> None:
        self._order[key] = None

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self) -> Optional[Key]:
        return next(iter(self._order), None)

    def __contains__(self, key: Key) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy}
# Recommended default: see ``cache/policy_prefix.py`` and ``bench/results/policy.md``.
DEFAULT_POLICY = "prefix-adaptive"

# The other policies subclass the ABC above and add themselves to ``POLICIES`` when
# their module loads (so importing any of these modules first works too).
from . import policies_ref, policy_prefix  # noqa: E402,F401


def make_policy(name: str, *, last_tier: bool = True) -> EvictionPolicy:
    """Build a policy by its configured name (``KVCACHE_POLICY``).

    ``last_tier=False`` tells a policy that declares ``tier_aware`` that its victims are
    demoted to a slower tier rather than dropped (a store's upper tiers); others ignore
    it. The default suits a single tier, the last tier of a store, and the replay tool.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
    if getattr(cls, "tier_aware", False):
        return cls(last_tier=last_tier)
    return cls()
