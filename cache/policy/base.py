"""The policy contract: a small base class that owns the admit -> evict -> insert loop.

Runs in whichever process writes a tier (the vLLM worker's store, or the replay tool).
Every method of a policy is called with the store's lock held and must not block: O(1)
amortized or O(log n), no I/O, no sleeping. ``offer`` itself takes the lock only around
policy calls and runs the caller's I/O (reserve, evict, write) outside it.

A policy tracks *chunk keys* (any hashable: the store passes ``str`` digests, the replay
tool passes ``int`` block ids). Each chunk has an optional ``parent``: the key of the
chunk before it in the same token sequence. A chunk is worth nothing without its
ancestors, which is what prefix-aware policies exploit.

In the style of cachetools, a policy overrides decisions and bookkeeping; ``offer`` here
combines them for ``cache.tools.replay`` and the experts of ``prefix_adaptive``, and the
store's writer thread combines the same ``decide``/``evict_next`` calls with the I/O each
decision plans (``cache.store.writer``):

- decisions: ``admit`` (default: take everything) and ``victim``, returned to a store as a
  ``Decision`` (``decide``: admit or not; ``evict_next``: the next victim, forgotten), which
  ``cache.store.placement`` turns into a plan for the store's writer thread;
- bookkeeping: ``insert``, ``touch``, ``remove``, ``__contains__``, ``__len__``, and
  optionally ``seen`` and ``hint_upcoming`` (default: ignore).

Every chunk a request uses reaches the tier's policy once, in request order: ``touch``
when it was read from the tier (a hit), ``offer`` when it was absent, ``seen`` when it
was present but computed again (an earlier chunk of the request missed).

Contract (``tests/test_policy.py`` runs one mixin of checks against every policy):
- ``insert`` is only called for keys not present, and only after ``admit`` said yes;
- ``victim()`` names a present key (or ``None`` when empty) and does not remove it; the
  caller removes it with ``remove`` once the entry is gone from the tier;
- ``remove`` of an absent key is a no-op (entries may vanish behind our back when
  another process shares the tier); ``touch`` of an absent key is a no-op.

A policy's role in a store is given to its constructor: ``last_tier=False`` means its
victims are demoted to a slower tier rather than dropped (a store's upper tiers); a
policy that judges admission should then take every chunk. Policies that do not care
ignore it. Names map to classes in ``cache.policy.registry``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Generic, Hashable, Iterable, Optional, TypeVar

Key = Hashable
# A policy's key type: the store's chunk keys (str); the compact experts' int fingerprints.
K = TypeVar("K", bound=Hashable)

_UNLOCKED = nullcontext()


class Offer(enum.Enum):
    """What became of a chunk offered to a tier through ``EvictionPolicy.offer``."""

    STORED = "stored"
    REFUSED = "refused"  # the policy's admission said no
    NO_ROOM = "no room"  # nothing left to evict and still no room
    NOT_WRITTEN = "not written"  # the caller's write failed or did not publish


@dataclass(frozen=True)
class Decision(Generic[K]):
    """A policy's answer, as data: whether an entry gets in (``admit``), and which entries of
    the tier leave to make room (``victims``, already forgotten by the policy)."""

    admit: bool = True
    victims: tuple = ()


class EvictionPolicy(ABC, Generic[K]):
    """Decides which entry of one tier goes first, and whether a new one gets in."""

    name: str = "abstract"  # the registry's key (a class attribute; the rate oracle names each instance)

    def __init__(self, *, last_tier: bool = True) -> None:
        """``last_tier``: what this tier evicts or refuses is gone (a single tier, the last
        local tier of a store, the replay tool). ``False``: victims are demoted to a
        tier below, which judges what is worth keeping."""
        self.last_tier = last_tier

    # ------------------------------------------------------------------ decisions
    def admit(self, key: K, parent: Optional[K], size: int) -> bool:
        """Whether the tier should store ``key`` at all. Default: take everything."""
        return True

    @abstractmethod
    def victim(self) -> Optional[K]:
        """The present key to evict next, or ``None`` when nothing is tracked."""

    # ---------------------------------------------------------------- bookkeeping
    @abstractmethod
    def insert(self, key: K, parent: Optional[K], size: int) -> None:
        """``key`` is now stored in the tier."""

    @abstractmethod
    def touch(self, key: K) -> None:
        """``key`` was read (a hit)."""

    @abstractmethod
    def remove(self, key: K) -> None:
        """``key`` is no longer stored (evicted or deleted elsewhere)."""

    def seen(self, key: K, parent: Optional[K]) -> None:
        """``key`` is stored, but its request computed it again because an earlier chunk
        missed: an access that was not a hit (history only). Default: ignore."""

    def hint_upcoming(self, keys: Iterable[K]) -> None:
        """Keys that queued requests will need soon (protect them). Default: ignore.

        Call it with the keys of the requests waiting *now*; a call supersedes the
        previous one (a request that left the queue needs no protection any more)."""

    @abstractmethod
    def __contains__(self, key: K) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    # ------------------------------------------------------- decisions, as data
    def decide(self, key: K, parent: Optional[K], size: int, force: bool = False) -> Decision:
        """Whether ``key`` gets in (``force``: whatever ``admit`` says, e.g. a pinned prefix)."""
        return Decision(admit=force or self.admit(key, parent, size))

    def evict_next(self) -> Decision:
        """The next victim, forgotten here (``victim`` + ``remove``); no victims when nothing
        is tracked. The caller takes it out of the tier."""
        victim = self.victim()
        if victim is None:
            return Decision(victims=())
        self.remove(victim)
        return Decision(victims=(victim,))

    # ------------------------------------------------------------------- the loop
    def offer(
        self,
        key: K,
        parent: Optional[K],
        size: int,
        reserve: Callable[[], bool],
        evict: Optional[Callable[[K], None]] = None,
        write: Optional[Callable[[], bool]] = None,
        lock: ContextManager = _UNLOCKED,
        rescan: Optional[Callable[[], None]] = None,
        force: bool = False,
        exhausted: Optional[Callable[[], bool]] = None,
    ) -> Offer:
        """Store ``key`` in the tier if admitted: admit -> evict until room -> insert.

        ``reserve()`` claims room for the entry (False: the tier is full); ``evict(v)``
        takes victim ``v`` out of the tier (delete, demote) after the policy forgot it;
        ``write()`` stores the entry (True once published); ``rescan()`` is called once
        when the policy has no victim left but the tier is still full (entries it never
        saw, e.g. written by another process), so it can be taught them. ``force``: the
        caller admits the entry whatever the policy says (a pinned prefix); ``exhausted()``
        is asked first when the policy has no victim left, True when it made room some
        other way (the loop then tries again). Policy calls run under ``lock``; the
        callbacks outside it.
        """
        with lock:
            if not self.decide(key, parent, size, force).admit:
                return Offer.REFUSED
        rescanned = rescan is None
        while not reserve():
            with lock:
                victims = self.evict_next().victims
            victim = victims[0] if victims else None
            if victim is None and exhausted is not None and exhausted():
                continue
            if victim is None:
                if rescanned or rescan is None:
                    return Offer.NO_ROOM
                rescan()
                rescanned = True
                continue
            if evict is not None:
                evict(victim)
        if write is not None and not write():
            return Offer.NOT_WRITTEN
        with lock:
            self.insert(key, parent, size)
        return Offer.STORED
