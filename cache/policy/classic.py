"""Classic online policies to compare against: ARC and S3-FIFO.

They run wherever a tier runs (called under the store's lock, O(1) amortized per call, no
I/O, never block). Neither is told the tier's capacity, so each sizes its ghost lists and
queues from the number of entries resident. Entries are counted, not bytes (``size`` is
ignored), as in their papers' object mode. Both are registered by name
(``cache.policy.registry``) and selectable with ``KVCACHE_POLICY``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from .base import EvictionPolicy, Key


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03).

    T1 holds keys seen once recently, T2 keys seen at least twice; B1/B2 are their ghost
    lists. A ghost hit in B1 grows the target size ``p`` of T1, one in B2 shrinks it. The
    cache size ``c`` is learned as the largest resident count seen. Adaptation happens in
    ``admit`` because the store asks ``admit`` for the incoming key before ``victim``.
    """

    name = "arc"

    def __init__(self, *, last_tier: bool = True) -> None:
        super().__init__(last_tier=last_tier)
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

    def __init__(self, *, last_tier: bool = True) -> None:
        super().__init__(last_tier=last_tier)
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
