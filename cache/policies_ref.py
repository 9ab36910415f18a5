"""Reference policies to compare against: ARC, S3-FIFO (online), Belady and the rate
oracles (offline).

ARC and S3-FIFO run wherever a tier runs (same rules as ``cache.policy``: called under the
store's lock, O(1) amortized per call, no I/O, never block). Neither is told the tier's
capacity, so each sizes its ghost lists and queues from the number of entries resident.
Entries are counted, not bytes (``size`` is ignored), as in their papers' object mode.

Belady and the rate oracles are offline only: they are built with the whole access sequence
and are used by ``cache.replay`` / the bench as bounds; they are not in the ``POLICIES``
registry. Belady knows *when* every chunk is used next. A rate oracle knows only *how
often* a chunk is used (its whole-trace use count, and where its uses start and end): what
a policy estimating popularity from access history could win at most. The distance
between the two is what knowing the timing is worth on a trace.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from .policy import POLICIES, EvictionPolicy, Key


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03).

    T1 holds keys seen once recently, T2 keys seen at least twice; B1/B2 are their ghost
    lists. A ghost hit in B1 grows the target size ``p`` of T1, one in B2 shrinks it. The
    cache size ``c`` is learned as the largest resident count seen. Adaptation happens in
    ``admit`` because the store asks ``admit`` for the incoming key before ``victim``.
    """

    name = "arc"

    def __init__(self) -> None:
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self._p = 0.0
        self._c = 1
        self._incoming_in_b2 = False

    def admit(self, key: Key, parent: Optional[Key], size: int) -> bool:
        b1, b2 = len(self._b1), len(self._b2)
        self._incoming_in_b2 = False
        if key in self._b1:
            self._p = min(float(self._c), self._p + max(b2 / b1, 1.0))
        elif key in self._b2:
            self._p = max(0.0, self._p - max(b1 / b2, 1.0))
            self._incoming_in_b2 = True
        return True

    def insert(self, key: Key, parent: Optional[Key], size: int) -> None:
        if key in self._b1:
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._c = max(self._c, len(self._t1) + len(self._t2))
        self._trim_ghosts()

    def touch(self, key: Key) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            self._b2[key] = None
        else:
            return
        self._trim_ghosts()

    def victim(self) -> Optional[Key]:
        t1 = len(self._t1)
        if t1 and (t1 > self._p or (self._incoming_in_b2 and t1 == int(self._p)) or not self._t2):
            return next(iter(self._t1))
        return next(iter(self._t2), None)

    def _trim_ghosts(self) -> None:
        c = self._c
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)

    def __contains__(self, key: Key) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP'23): small FIFO (10 %), main FIFO, ghost FIFO.

    New keys enter the small queue unless the ghost remembers them (then main). A hit
    bumps a 2-bit counter. Evicting from small moves accessed keys to main and ghosts the
    rest; main is FIFO-reinsertion with the counter decremented on each pass. ``victim``
    performs those internal moves (policy state only) until the head is evictable.
    """

    name = "s3fifo"
    SMALL_RATIO = 0.10  # from the paper; not tuned here
    GHOST_RATIO = 0.90

    def __init__(self) -> None:
        self._small: OrderedDict[Key, int] = OrderedDict()
        self._main: OrderedDict[Key, int] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, parent: Optional[Key], size: int) -> None:
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = 0
        else:
            self._small[key] = 0

    def touch(self, key: Key) -> None:
        if key in self._small:
            self._small[key] = min(self._small[key] + 1, 3)
        elif key in self._main:
            self._main[key] = min(self._main[key] + 1, 3)

    def remove(self, key: Key) -> None:
        if key in self._small:
            del self._small[key]
            self._ghost[key] = None
            limit = max(1, int(self.GHOST_RATIO * len(self)))
            while len(self._ghost) > limit:
                self._ghost.popitem(last=False)
        else:
            self._main.pop(key, None)

    def victim(self) -> Optional[Key]:
        small, main = self._small, self._main
        while small or main:
            if small and (not main or len(small) >= self.SMALL_RATIO * (len(small) + len(main))):
                key, freq = next(iter(small.items()))
                if freq == 0:
                    return key
                del small[key]
                main[key] = 0
            else:
                key, freq = next(iter(main.items()))
                if freq == 0:
                    return key
                main.move_to_end(key)
                main[key] = freq - 1
        return None

    def __contains__(self, key: Key) -> bool:
        return key in self._small or key in self._main

    def __len__(self) -> int:
        return len(self._small) + len(self._main)


_NEVER = float("inf")


class BeladyPolicy(EvictionPolicy):
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
        # For every (request i, position p) the next (request, position) using that key.
        last: Dict[Key, Tuple[int, int]] = {}
        nxt: List[List[Tuple[float, int]]] = [[] for _ in requests]
        for i in range(len(requests) - 1, -1, -1):
            row = nxt[i]
            for p, key in enumerate(requests[i]):
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
        """Advance "now" to the next request of the sequence given at construction."""
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


class RateOraclePolicy(EvictionPolicy):
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
        for key in first:               # dicts keep first-use order: parents come first
            until = last[key] if span else n
            rate = (uses[key] - 1) / max(1, until - first[key])
            p = parent[key]
            if p is not None and self._rank[p][0] < rate:
                rate = self._rank[p][0]
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
        if self._last is not None:             # a dead chunk first
            top = self._top(self._by_last)
            if top is not None and top[0] <= self._now:
                return top[2]
        top = self._top(self._by_rank)
        return None if top is None else top[2]

    def __contains__(self, key: Key) -> bool:
        return key in self._present

    def __len__(self) -> int:
        return len(self._present)


POLICIES["arc"] = ARCPolicy
POLICIES["s3fifo"] = S3FIFOPolicy
