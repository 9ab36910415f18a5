"""Compact storage for policies that track millions of chunks: integer keys in slots,
an open-addressing index, and intrusive doubly linked lists.

Runs under the store's lock, like every policy: no call blocks, every call is O(1)
amortized. The index grows by doubling, and the move to the bigger table is spread over
later insertions (``MIGRATE`` buckets each), so no call ever rehashes a whole table.

Keys are non-negative 62-bit integers (``fingerprint`` turns any hashable into one; 0 is
reserved). Memory per slot: 8 bytes of key, 8 of list links, 8-16 of index at a load of
at most one half, plus whatever per-slot arrays a policy adds (``Slots.extra``).

Lists: slots ``1..lists`` are sentinels. A list runs from its *head* (``first``, the
eviction end) to its tail; ``link_before(slot, at)`` puts ``slot`` right on the eviction
side of ``at`` (``at`` = the list's sentinel appends at the tail).
"""

from __future__ import annotations

from array import array
from typing import Hashable, List, Optional

_M64 = (1 << 64) - 1
_M62 = (1 << 62) - 1


def fingerprint(key: Hashable) -> int:
    """A well-mixed non-zero 62-bit integer (the experts add one to it) for ``key`` (``hash`` of an int is the int)."""
    h = (hash(key) * 0x9E3779B97F4A7C15) & _M64
    h ^= h >> 31
    h = (h * 0xBF58476D1CE4E5B9) & _M64
    h ^= h >> 29
    return (h & _M62) or 1


class Slots:
    """Integer keys in numbered slots, found through an open-addressing index."""

    MIGRATE = 16  # old-index buckets moved per insertion while the index grows

    def __init__(self, lists: int = 0, extra: str = "", keycode: str = "q", links: bool = True) -> None:
        """``lists`` sentinels; one more per-slot array for each type code in ``extra``
        (``array`` codes, e.g. ``"ib"``: a 4-byte and a 1-byte field, zero when new);
        ``keycode`` stores keys in 8 bytes (``"q"``) or 4 (``"i"``: keys below 2**31);
        ``links=False`` leaves out the list links (no lists then)."""
        n = 1 + lists
        self.key = array(keycode, bytes(array(keycode).itemsize * n))
        self.prev = array("i", range(n) if links else ())
        self.next = array("i", range(n) if links else ())
        self._links = links
        self.extra: List[array] = [array(code, bytes(array(code).itemsize * n)) for code in extra]
        self._free: List[int] = []
        self.count = 0
        self._tbl = array("i", bytes(4 * 64))
        self._mask = 63
        self._old: Optional[array] = None
        self._omask = 0
        self._ocur = 0

    # ------------------------------------------------------------------ the index
    def find(self, key: int) -> int:
        """The slot holding ``key``, or 0."""
        keys = self.key
        tbl, mask = self._tbl, self._mask
        i = key & mask
        s = tbl[i]
        while s:
            if keys[s] == key:
                return s
            i = (i + 1) & mask
            s = tbl[i]
        old = self._old
        if old is not None:
            mask = self._omask
            i = key & mask
            s = old[i]
            while s:
                if s > 0 and keys[s] == key:
                    return s
                i = (i + 1) & mask
                s = old[i]
        return 0

    def add(self, key: int) -> int:
        """A new slot for ``key`` (not present), unlinked from every list."""
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self.key)
            self.key.append(0)
            if self._links:
                self.prev.append(-1)
                self.next.append(-1)
            for arr in self.extra:
                arr.append(0)
        self.key[slot] = key
        if self._links:
            self.prev[slot] = self.next[slot] = -1
        for arr in self.extra:
            arr[slot] = 0
        if self._old is not None:
            self._migrate(self.MIGRATE)
        if 2 * (self.count + 1) > self._mask + 1:
            if self._old is not None:
                self._migrate(self._omask + 1)
            self._old, self._omask, self._ocur = self._tbl, self._mask, 0
            self._mask = 2 * (self._mask + 1) - 1
            self._tbl = array("i", bytes(4 * (self._mask + 1)))
        self._put(slot)
        self.count += 1
        return slot

    def drop(self, slot: int, release: bool = True, keep_key: bool = False) -> None:
        """Forget ``slot``'s key: out of its list and the index. The slot is reused later;
        with ``release=False`` only after ``release(slot)`` (while other slots still
        point at it, e.g. children at their parent). Its key reads 0 until then, or
        still reads the old key with ``keep_key``."""
        if self._links:
            self.unlink(slot)
        key = self.key[slot]
        tbl, mask, keys = self._tbl, self._mask, self.key
        i = key & mask
        s = tbl[i]
        while s and s != slot:
            i = (i + 1) & mask
            s = tbl[i]
        if s == slot:  # backward-shift deletion: no tombstones
            j = i
            while True:
                j = (j + 1) & mask
                s = tbl[j]
                if not s:
                    break
                k = keys[s] & mask
                if (i < j and (k <= i or k > j)) or (j < i and i >= k > j):
                    tbl[i] = s
                    i = j
            tbl[i] = 0
        old = self._old
        if old is not None:
            mask = self._omask
            i = key & mask
            s = old[i]
            while s and s != slot:
                i = (i + 1) & mask
                s = old[i]
            if s == slot:
                old[i] = -1  # a tombstone in the table being emptied
        if not keep_key:
            keys[slot] = 0
        if release:
            self._free.append(slot)
        self.count -= 1

    def release(self, slot: int) -> None:
        """Make a slot dropped with ``release=False`` reusable."""
        self._free.append(slot)

    def _put(self, slot: int) -> None:
        tbl, mask = self._tbl, self._mask
        i = self.key[slot] & mask
        while tbl[i] > 0:
            i = (i + 1) & mask
        tbl[i] = slot

    def _migrate(self, steps: int) -> None:
        old, cur = self._old, self._ocur
        if old is None:
            return
        end = min(len(old), cur + steps)
        for i in range(cur, end):
            s = old[i]
            if s > 0:
                self._put(s)
        self._ocur = end
        if end >= len(old):
            self._old = None

    # ------------------------------------------------------------------- lists
    def link_before(self, slot: int, at: int) -> None:
        """Link ``slot`` right on the eviction side of ``at`` (a slot or a sentinel)."""
        prev, nxt = self.prev, self.next
        p = prev[at]
        prev[slot] = p
        nxt[slot] = at
        nxt[p] = slot
        prev[at] = slot

    def link_head(self, slot: int, sentinel: int) -> None:
        """Link ``slot`` at the eviction end of ``sentinel``'s list."""
        self.link_before(slot, self.next[sentinel])

    def unlink(self, slot: int) -> None:
        prev, nxt = self.prev, self.next
        p = prev[slot]
        if p < 0:
            return
        n = nxt[slot]
        nxt[p] = n
        prev[n] = p
        prev[slot] = nxt[slot] = -1

    def linked(self, slot: int) -> bool:
        return self.prev[slot] >= 0

    def first(self, sentinel: int) -> int:
        """The head (eviction end) of ``sentinel``'s list, or 0 when it is empty."""
        s = self.next[sentinel]
        return 0 if s == sentinel else s
