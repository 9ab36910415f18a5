"""The experts ``prefix-adaptive`` chooses between: compact policies over integer keys.

Each expert is an ordinary policy (``EvictionPolicy``, driven through ``offer``), kept
small enough that ``prefix-adaptive`` can simulate several of them at the tier's full
capacity (``cache.policy.slots``: a few tens of bytes per chunk, no key objects). They run
inside ``prefix-adaptive``, under the store's lock: every call is O(1) amortized.

- ``PrefixLRU``: least recently used, in prefix order (a chunk is evicted before its
  parent; a request's chain is kept as a whole and cut from its tail). With a frequency
  ``history`` it also refuses, once the tier is full, a chunk seen for the first time in
  the history's window (TinyLFU's doorkeeper), and the rest of a chain refused with it.
- ``S3FIFO``: S3-FIFO exactly as ``cache.policy.classic.S3FIFOPolicy`` (same decisions on
  every trace; a test checks it), in compact storage.

Keys are non-negative integers (``prefix-adaptive`` passes fingerprints); ``KEY_BITS``
low bits of each are stored, so two keys that share them are one key here (one chance in
about a billion per lookup, for a 10-million-chunk tier: a shadow's estimate is off by
one hit, nothing is served wrongly).
"""

from __future__ import annotations

from array import array
from typing import List, Optional

from .base import EvictionPolicy
from .sketch import FrequencySketch
from .slots import Slots

KEY_BITS = 62
_MASK = (1 << KEY_BITS) - 1


def _k(key: int) -> int:
    return (key & _MASK) + 1  # 0 is "no key" in ``Slots``


class Compact(EvictionPolicy[int]):
    """An expert in compact storage (``self._s``) that can shed keys in small steps
    (``thin``: what a miniature simulation does when its sampling rate drops)."""

    _s: Slots  # set by each expert
    history: Optional[FrequencySketch]  # the admission filter's (``PrefixLRU``) only
    capacity: int

    def rescale(self, factor: float) -> None:
        """The key space it sees shrank by ``factor``: scale what it learned in entries
        (default: nothing)."""

    def forget(self, key: int) -> None:
        """Drop ``key`` entirely (ghost entries too): no trace of it is left."""
        self.remove(key)

    def slot_keys(self) -> array:
        """Each slot's key + 1 (0: a free slot), as stored."""
        return self._s.key

    def thin(self, limit: int, start: int, steps: int) -> int:
        """Forget every key ``>= limit`` among slots ``start .. start + steps``; returns
        the slot to continue from, or 0 once past the last slot."""
        keys = self._s.key
        end = min(len(keys), start + steps)
        for slot in range(start, end):
            k = keys[slot]
            if k > limit:  # stored as key + 1
                self.forget(k - 1)
        return 0 if end >= len(keys) else end


class PrefixLRU(Compact):
    """Prefix-ordered LRU; with ``history``, first sightings are refused once full.

    ``capacity`` (entries) says when the tier is full for the admission rule; 0 means
    unknown (take everything). ``count=True`` makes the expert count accesses into its
    ``history`` itself (used alone); inside ``prefix-adaptive`` the owner counts every
    access once for all experts.
    """

    name = "prefix-lru"
    _LIST = 1  # the recency list's sentinel
    _PARKED = 1  # tag: out of the list while it has children

    def __init__(
        self,
        *,
        last_tier: bool = True,
        history: Optional[FrequencySketch] = None,
        capacity: int = 0,
        count: bool = False,
    ) -> None:
        super().__init__(last_tier=last_tier)
        self.history = history
        self.capacity = capacity
        self._count = count and history is not None
        self._s = Slots(lists=1, extra="iib", keycode="q")
        self._parent, self._nchild, self._tag = self._s.extra
        self._refused = 0  # last key refused with its chain (internal form)
        self._evicted: list = []  # keys removed since the last admit
        self._orphan = 0  # last key stored after its parent went for it

    def _place(self, slot: int) -> None:
        s = self._s
        p = self._parent[slot]
        s.link_before(slot, p if p and s.linked(p) else self._LIST)

    def admit(self, key: int, parent: Optional[int], size: int) -> bool:
        self._evicted.clear()
        if not self.last_tier:
            return True
        k = _k(key)
        hist = self.history
        if self._count and hist is not None:  # (counting needs a history)
            hist.add(key)
        if parent is not None:
            pk = _k(parent)
            if pk == self._refused or (pk == self._orphan and not self._s.find(pk)):
                self._refused = k  # the rest of a chain that cannot be hit here
                return False
        if hist is None:
            return True
        if not self.capacity or len(self) < self.capacity or hist.estimate(key) >= 2:
            return True
        self._refused = k  # a first sighting while full
        return False

    def insert(self, key: int, parent: Optional[int], size: int) -> None:
        s = self._s
        k = _k(key)
        slot = s.add(k)
        p = s.find(_k(parent)) if parent is not None else 0
        self._parent[slot] = p
        if p:
            self._nchild[p] += 1
            self._place(slot)
        elif parent is not None and self.last_tier and _k(parent) in self._evicted:
            s.link_head(slot, self._LIST)  # its parent went to make room for it:
            self._orphan = k  # worthless here, first in line
        else:
            self._place(slot)

    def touch(self, key: int) -> None:
        s = self._s
        if self._count and self.history is not None:
            self.history.add(key)
        slot = s.find(_k(key))
        if slot:
            s.unlink(slot)
            self._tag[slot] = 0
            self._place(slot)

    def remove(self, key: int) -> None:
        s = self._s
        slot = s.find(_k(key))
        if not slot:
            return
        nchild, parent = self._nchild, self._parent
        p = parent[slot]
        if self.last_tier:
            self._evicted.append(s.key[slot])
        s.drop(slot, release=nchild[slot] == 0)  # a parent's slot outlives it
        if p:
            nchild[p] -= 1
            if nchild[p] == 0:
                if not s.key[p]:
                    s.release(p)  # its last child went
                elif self._tag[p] == self._PARKED:
                    self._tag[p] = 0
                    s.link_head(p, self._LIST)  # a leaf again: next in line

    def victim(self) -> Optional[int]:
        s = self._s
        nchild = self._nchild
        while True:
            slot = s.first(self._LIST)
            if not slot:
                return None
            if nchild[slot] == 0:
                return s.key[slot] - 1
            s.unlink(slot)  # a parent goes after its children
            self._tag[slot] = self._PARKED

    def forget(self, key: int) -> None:
        self.remove(key)
        self._evicted.clear()  # not an eviction: no orphan rule for it

    def __contains__(self, key: int) -> bool:
        return self._s.find(_k(key)) > 0

    def __len__(self) -> int:
        return self._s.count


class _ListedSlots(Compact):
    """A policy whose slots sit in numbered lists (``self._s``), with each slot's list in
    ``self._where`` and each list's length in ``self._n``."""

    _where: array
    _n: List[int]

    def _move(self, slot: int, to: int) -> None:
        s, where, n = self._s, self._where, self._n
        s.unlink(slot)
        n[where[slot]] -= 1
        where[slot] = to
        n[to] += 1
        s.link_before(slot, to)

    def forget(self, key: int) -> None:
        slot = self._s.find(_k(key))
        if slot:
            self._n[self._where[slot]] -= 1
            self._s.drop(slot)


class S3FIFO(_ListedSlots):
    """S3-FIFO (Yang et al., SOSP'23) in compact storage; see ``classic.S3FIFOPolicy``."""

    name = "s3fifo-compact"
    SMALL_RATIO = 0.10
    GHOST_RATIO = 0.90
    _SMALL, _MAIN, _GHOST = 1, 2, 3  # sentinels, and the ``where`` tag of a slot

    def __init__(self, *, last_tier: bool = True) -> None:
        super().__init__(last_tier=last_tier)
        self._s = Slots(lists=3, extra="bb", keycode="q")
        self._freq, self._where = self._s.extra
        self._n = [0, 0, 0, 0]  # slots per list

    def insert(self, key: int, parent: Optional[int], size: int) -> None:
        s = self._s
        k = _k(key)
        slot = s.find(k)
        if slot:  # a ghost: straight to main
            self._move(slot, self._MAIN)
        else:
            slot = s.add(k)
            self._where[slot] = self._SMALL
            self._n[self._SMALL] += 1
            s.link_before(slot, self._SMALL)
        self._freq[slot] = 0

    def touch(self, key: int) -> None:
        slot = self._s.find(_k(key))
        if slot and self._where[slot] != self._GHOST and self._freq[slot] < 3:
            self._freq[slot] += 1

    def remove(self, key: int) -> None:
        s, n = self._s, self._n
        slot = s.find(_k(key))
        if not slot or self._where[slot] == self._GHOST:
            return
        if self._where[slot] == self._MAIN:
            n[self._MAIN] -= 1
            s.drop(slot)
            return
        self._move(slot, self._GHOST)
        limit = max(1, int(self.GHOST_RATIO * len(self)))
        while n[self._GHOST] > limit:
            n[self._GHOST] -= 1
            s.drop(s.first(self._GHOST))

    def victim(self) -> Optional[int]:
        s, n, freq = self._s, self._n, self._freq
        small, main = self._SMALL, self._MAIN
        while n[small] or n[main]:
            if n[small] and (not n[main] or n[small] >= self.SMALL_RATIO * (n[small] + n[main])):
                slot = s.first(small)
                if freq[slot] == 0:
                    return s.key[slot] - 1
                self._move(slot, main)
                freq[slot] = 0
            else:
                slot = s.first(main)
                if freq[slot] == 0:
                    return s.key[slot] - 1
                s.unlink(slot)
                s.link_before(slot, main)
                freq[slot] -= 1
        return None

    def __contains__(self, key: int) -> bool:
        slot = self._s.find(_k(key))
        return slot > 0 and self._where[slot] != self._GHOST

    def __len__(self) -> int:
        return self._n[self._SMALL] + self._n[self._MAIN]


class ARC(_ListedSlots):
    """ARC (Megiddo & Modha, FAST'03) in compact storage; see ``classic.ARCPolicy``
    (same decisions on every trace; a test checks it)."""

    name = "arc-compact"
    _T1, _T2, _B1, _B2 = 1, 2, 3, 4  # sentinels, and the ``where`` tag of a slot

    def __init__(self, *, last_tier: bool = True) -> None:
        super().__init__(last_tier=last_tier)
        self._s = Slots(lists=4, extra="b", keycode="q")
        (self._where,) = self._s.extra
        self._n = [0, 0, 0, 0, 0]  # slots per list
        self._p = 0.0
        self._c = 1
        self._incoming_in_b2 = False

    def rescale(self, factor: float) -> None:
        """The key space it sees shrank by ``factor`` (a lower sampling rate): so do its
        learned capacity and target, in entries."""
        self._c = max(1, int(self._c * factor))
        self._p = min(float(self._c), self._p * factor)

    def _drop_first(self, lst: int) -> None:
        self._n[lst] -= 1
        self._s.drop(self._s.first(lst))

    def admit(self, key: int, parent: Optional[int], size: int) -> bool:
        n = self._n
        b1, b2 = n[self._B1], n[self._B2]
        self._incoming_in_b2 = False
        slot = self._s.find(_k(key))
        if slot:
            w = self._where[slot]
            if w == self._B1:
                self._p = min(float(self._c), self._p + max(b2 / b1, 1.0))
            elif w == self._B2:
                self._p = max(0.0, self._p - max(b1 / b2, 1.0))
                self._incoming_in_b2 = True
        return True

    def insert(self, key: int, parent: Optional[int], size: int) -> None:
        s, n = self._s, self._n
        k = _k(key)
        slot = s.find(k)
        if slot:  # a ghost (B1 or B2): to T2
            self._move(slot, self._T2)
        else:
            slot = s.add(k)
            self._where[slot] = self._T1
            n[self._T1] += 1
            s.link_before(slot, self._T1)
        self._c = max(self._c, n[self._T1] + n[self._T2])
        self._trim_ghosts()

    def touch(self, key: int) -> None:
        slot = self._s.find(_k(key))
        if slot and self._where[slot] in (self._T1, self._T2):
            self._move(slot, self._T2)

    def remove(self, key: int) -> None:
        slot = self._s.find(_k(key))
        if not slot:
            return
        w = self._where[slot]
        if w == self._T1:
            self._move(slot, self._B1)
        elif w == self._T2:
            self._move(slot, self._B2)
        else:
            return
        self._trim_ghosts()

    def victim(self) -> Optional[int]:
        n, s = self._n, self._s
        t1 = n[self._T1]
        if t1 and (t1 > self._p or (self._incoming_in_b2 and t1 == int(self._p)) or not n[self._T2]):
            return s.key[s.first(self._T1)] - 1
        slot = s.first(self._T2)
        return s.key[slot] - 1 if slot else None

    def _trim_ghosts(self) -> None:
        n, c = self._n, self._c
        T1, T2, B1, B2 = self._T1, self._T2, self._B1, self._B2
        while n[B1] and n[T1] + n[B1] > c:
            self._drop_first(B1)
        while n[B2] and n[T1] + n[T2] + n[B1] + n[B2] > 2 * c:
            self._drop_first(B2)

    def __contains__(self, key: int) -> bool:
        slot = self._s.find(_k(key))
        return slot > 0 and self._where[slot] in (self._T1, self._T2)

    def __len__(self) -> int:
        return self._n[self._T1] + self._n[self._T2]
