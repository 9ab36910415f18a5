"""Offline reference policies: Belady and the rate oracles (replay only).

They are built with the whole access sequence and used by ``cache.tools.replay`` and the
bench as bounds; they are not in the registry (a tier cannot know the future). Belady
knows *when* every chunk is used next. A rate oracle knows only *how often* a chunk is
used (its whole-trace use count, and where its uses start and end): what a policy
estimating popularity from access history could win at most. The distance between the
two is what knowing the timing is worth on a trace.

The replay calls ``begin_request(keys)`` before each request so an offline policy knows
where "now" is; every other call follows the contract of ``cache.policy.base``.
"""

from __future__ import annotations

import heapq
from abc import abstractmethod
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from .base import EvictionPolicy, Key


class OfflinePolicy(EvictionPolicy):
    """A policy built with the future: the sequence of key sequences the replay plays."""

    @abstractmethod
    def begin_request(self, keys: Iterable[Key]) -> None:
        """Advance "now" to the next request of the sequence given at construction."""


_NEVER = float("inf")


class BeladyPolicy(OfflinePolicy):
    """Offline optimum (Belady/MIN): evict the block whose next use is farthest away.

    Built with the future: ``requests`` is the sequence of key sequences the replay will
    play, in order; the replay calls ``begin_request(keys)`` before each one so the policy
    knows where "now" is. Ties (same next request) evict the block that sits later in that
    request, so a prefix is never cut before its tail. With ``capacity`` given it also
    bypasses (refuses) a block whose next use is no sooner than the current victim's when
    the tier is full, which is what MIN does. Max-heap with lazy deletion: O(log n).
    """

    name = "belady"

    def __init__(self, requests: Sequence[Sequence[Key]], capacity: Optional[int] = None) -> None:
        super().__init__()
        # For every (request i, position p) the next (request, position) using that key.
        last: Dict[Key, Tuple[int, int]] = {}
        nxt: List[List[Tuple[float, int]]] = [[] for _ in requests]
        for i in range(len(requests) - 1, -1, -1):
            row = nxt[i]
            for key in requests[i]:
                row.append(last.get(key, (_NEVER, 0)))
            for p, key in enumerate(requests[i]):
                last[key] = (i, p)
        self._nxt = nxt
        self._req = -1
        self._capacity = capacity
        self._next: Dict[Key, Tuple[float, int]] = {}
        self._present: Dict[Key, Tuple[float, int]] = {}
        self._heap: List[Tuple[float, int, Key]] = []

    def begin_request(self, keys: Iterable[Key]) -> None:
        self._req += 1
        row = self._nxt[self._req]
        for p, key in enumerate(keys):
            self._next[key] = row[p]
            if key in self._present:
                self._push(key)

    def _push(self, key: Key) -> None:
        when = self._next.get(key, (_NEVER, 0))
        self._present[key] = when
        heapq.heappush(self._heap, (-when[0], -when[1], key))

    def admit(self, key: Key, parent: Optional[Key], size: int) -> bool:
        if self._capacity is None or len(self._present) < self._capacity:
            return True
        v = self.victim()
        if v is None:
            return True
        return self._next.get(key, (_NEVER, 0)) < self._present[v]

    def insert(self, key: Key, parent: Optional[Key], size: int) -> None:
        self._push(key)

    def touch(self, key: Key) -> None:
        pass  # its next use was set by begin_request

    def remove(self, key: Key) -> None:
        self._present.pop(key, None)

    def victim(self) -> Optional[Key]:
        heap, present = self._heap, self._present
        while heap:
            neg_req, neg_pos, key = heap[0]
            if present.get(key) == (-neg_req, -neg_pos):
                return key
            heapq.heappop(heap)
        return None

    def __contains__(self, key: Key) -> bool:
        return key in self._present

    def __len__(self) -> int:
        return len(self._present)


class RateOraclePolicy(OfflinePolicy):
    """Offline: keep the chunks reused most often per request, knowing every chunk's
    whole-trace use count but not when the uses come.

    Built with the sequence of key sequences the replay will play (``begin_request(keys)``
    before each, as for Belady). A chunk's *rate* is its reuses (uses - 1) divided by the
    requests from its first use to the end of the trace, or with ``span=True`` to its last
    use; with ``span`` it also knows when a chunk is dead (its last use is behind) and
    evicts dead chunks first. A chunk's rate is capped by its parent's (the parent of its
    first use), so ancestors never rank below their descendants; ties evict the chunk that
    sits later in its request. With ``capacity`` it refuses a chunk that ranks no higher
    than the current victim, as Belady does. Static ranks in heaps with lazy deletion:
    O(log n) per call.
    """

    def __init__(
        self,
        requests: Sequence[Sequence[Key]],
        capacity: Optional[int] = None,
        span: bool = False,
    ) -> None:
        super().__init__()
        self.name = "span-oracle" if span else "rate-oracle"
        n = len(requests)
        first: Dict[Key, int] = {}
        last: Dict[Key, int] = {}
        uses: Dict[Key, int] = {}
        depth: Dict[Key, int] = {}
        parent: Dict[Key, Optional[Key]] = {}
        for i, keys in enumerate(requests):
            prev: Optional[Key] = None
            for p, key in enumerate(keys):
                if key not in first:
                    first[key] = i
                    depth[key] = p
                    parent[key] = prev
                last[key] = i
                uses[key] = uses.get(key, 0) + 1
                prev = key
        self._rank: Dict[Key, Tuple[float, int]] = {}
        for key in first:  # dicts keep first-use order: parents come first
            until = last[key] if span else n
            rate = (uses[key] - 1) / max(1, until - first[key])
            par = parent[key]
            if par is not None and self._rank[par][0] < rate:
                rate = self._rank[par][0]
            self._rank[key] = (rate, -depth[key])
        self._last = last if span else None
        self._now = -1
        self._capacity = capacity
        self._present: Dict[Key, None] = {}
        self._by_rank: List[Tuple[float, int, Key]] = []
        self._by_last: List[Tuple[int, int, Key]] = []

    def begin_request(self, keys: Iterable[Key]) -> None:
        self._now += 1

    def _dead(self, key: Key) -> bool:
        return self._last is not None and self._last.get(key, -1) <= self._now

    def admit(self, key: Key, parent: Optional[Key], size: int) -> bool:
        if self._capacity is None or len(self._present) < self._capacity:
            return True
        if self._dead(key):
            return False
        v = self.victim()
        if v is None or self._dead(v):
            return True
        return self._rank.get(key, (0.0, 0)) > self._rank[v]

    def insert(self, key: Key, parent: Optional[Key], size: int) -> None:
        self._present[key] = None
        rate, neg_depth = self._rank.get(key, (0.0, 0))
        heapq.heappush(self._by_rank, (rate, neg_depth, key))
        if self._last is not None:
            heapq.heappush(self._by_last, (self._last.get(key, -1), neg_depth, key))

    def touch(self, key: Key) -> None:
        pass  # ranks are static

    def remove(self, key: Key) -> None:
        self._present.pop(key, None)

    def _top(self, heap: list) -> Optional[tuple]:
        """The heap's first entry for a present key (stale ones popped), or None."""
        while heap and heap[0][2] not in self._present:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def victim(self) -> Optional[Key]:
        if self._last is not None:  # a dead chunk first
            top = self._top(self._by_last)
            if top is not None and top[0] <= self._now:
                return top[2]
        top = self._top(self._by_rank)
        return None if top is None else top[2]

    def __contains__(self, key: Key) -> bool:
        return key in self._present

    def __len__(self) -> int:
        return len(self._present)
