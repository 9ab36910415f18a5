"""``prefix-adaptive``: the recommended eviction and admission policy for KV-chunk tiers.

Runs wherever a tier runs (the vLLM worker's store, or ``cache.replay``), always under the
store's lock. Nothing here blocks: every call is O(1) amortized (a few list splices,
four sketch counters, one bounded probe of the ghost table), with no I/O, no sleeping
and no pass over all entries; sketch ageing is spread over calls, 256 bytes at a time.

What it does, and why:

1. **Prefix order for free.** A chunk is worth nothing without its ancestors, so every
   ordering it keeps is a doubly linked list that holds the invariant *a child sits on
   the eviction side of its parent*. A touched or inserted chunk is spliced in right
   behind its parent (or at the protected end when it has no parent in the tier). The
   eviction end of such a list is therefore always a leaf: chains are cut from the tail,
   shared roots (whose many children all sit behind them) go last, and no descendant
   outlives its ancestor. The children are never scanned, so this costs O(1).
2. **Two experts, weights learned online.** A recency expert (the list above) and a
   frequency expert (one such list per log2-frequency level, levels clamped so a child's
   level never exceeds its parent's) each name a victim. Which one evicts is decided by
   weights learned from regret, as in LeCaR (Vietri et al., HotStorage'18): an evicted
   key enters a ghost table tagged with the expert that chose it; when it is asked for
   again, that expert's weight shrinks (by more the sooner it came back). A
   deterministic stride turns the weights into decisions, so runs are reproducible.
3. **Learned admission.** A count-min sketch (one byte per counter, halved on a rolling
   basis every ~10x capacity accesses, as in TinyLFU) remembers keys beyond residency.
   When the tier is full, a chunk seen for the first time is a *first sighting*; a
   second pair of weights learns whether to take first sightings or refuse them: a
   refused key that comes back blames "refuse", a victim evicted to make room for an
   admitted first sighting that comes back blames "admit". One decision covers a whole
   new chain (its later blocks follow their parent), and a chunk whose parent is absent
   is always refused, since it could never be hit.
4. **Queue hints.** ``hint_upcoming`` protects present keys for about one cache
   turnover (``capacity`` accesses) or until touched; a protected victim candidate is
   parked out of the lists instead of evicted, and so are ancestors of parked chunks.

Nothing is fitted to a trace: the only constants are the published defaults of the
mechanisms above (LeCaR's learning rate 0.45 and discount 0.005 over one cache size,
TinyLFU's sample size of 10x capacity) and a 1 % exploration floor so neither expert
is ever starved of evidence.

The capacity is not given: it is learned as the largest resident count seen, which is
what the store holds when it starts asking for victims. ``size`` is ignored (a tier's
chunks have one size per model). Memory: a dict entry plus 28 bytes of arrays per
resident chunk, and a byte-per-counter sketch and 8-byte ghost slots sized to the
capacity; ``tests/test_policy.py`` measures it.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from typing import Deque, Dict, Hashable, Iterable, List, Optional, Tuple

from .policy import EvictionPolicy, Key

_M64 = (1 << 64) - 1
_MULS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
_HALVE = bytes(v >> 1 for v in range(256))  # translate table: halve every counter

_R = 16                       # level sentinels (live levels span at most 9)
_LRU = 0                      # slot of the recency list's sentinel
_FIRST = 1 + _R               # first slot for a chunk

_NONE, _BY_LRU, _BY_LFU, _REFUSED = 0, 1, 2, 3   # ghost codes, bit 2 = "admit" blamed
_BLAME = 4


def _mix(key: Key) -> int:
    """64-bit mixed hash (``hash`` of small ints is the int itself)."""
    h = (hash(key) * 0x9E3779B97F4A7C15) & _M64
    h ^= h >> 31
    return (h * 0xBF58476D1CE4E5B9) & _M64


class _Sketch:
    """TinyLFU frequency history: a doorkeeper Bloom filter in front of a count-min sketch.

    The first sighting of a key only sets its 4 doorkeeper bits; later sightings bump
    4 saturating byte counters (conservative update). ``estimate`` = counters + door bit.
    Ageing is TinyLFU's reset spread over time: every ``period / chunks`` increments one
    chunk of the counters is halved and the matching chunk of the doorkeeper cleared, so
    the whole history ages once per ``period`` increments without a pause. ``sweeps``
    counts completed passes (the policy's ageing epochs).
    """

    DOOR_BYTES_PER_COUNTER = 2   # 16 doorkeeper bits per counter row entry

    def __init__(self, width: int, period: int) -> None:
        bits = max(10, (width - 1).bit_length())
        self.bits = bits
        self.width = 1 << bits
        self.table = bytearray(4 * self.width)
        self.door = bytearray(self.DOOR_BYTES_PER_COUNTER * len(self.table))
        self.dbits = (8 * len(self.door) - 1).bit_length()
        self.period = max(1, period)
        self.count = 0
        self.sweeps = 0

    def _slots(self, h: int) -> Tuple[int, int, int, int]:
        s, w = 64 - self.bits, self.width
        return (
            ((h * _MULS[0]) & _M64) >> s,
            w + (((h * _MULS[1]) & _M64) >> s),
            2 * w + (((h * _MULS[2]) & _M64) >> s),
            3 * w + (((h * _MULS[3]) & _M64) >> s),
        )

    def _door_bits(self, h: int) -> List[int]:
        s = 64 - self.dbits
        g = h ^ (h >> 29)
        return [((g * m) & _M64) >> s for m in _MULS]

    def _in_door(self, bits: List[int]) -> bool:
        d = self.door
        for b in bits:
            if not d[b >> 3] & (1 << (b & 7)):
                return False
        return True

    def estimate(self, h: int) -> int:
        t = self.table
        a, b, c, d = self._slots(h)
        return min(t[a], t[b], t[c], t[d]) + (1 if self._in_door(self._door_bits(h)) else 0)

    def add(self, h: int) -> int:
        """Count one access of ``h``; returns the new estimate. May finish a sweep."""
        t = self.table
        idx = self._slots(h)
        m = min(t[i] for i in idx)
        bits = self._door_bits(h)
        if self._in_door(bits):
            if m < 255:
                for i in idx:
                    if t[i] == m:
                        t[i] = m + 1
                m += 1
        else:
            d = self.door
            for b in bits:
                d[b >> 3] |= 1 << (b & 7)
        self.count += 1
        if self.count >= self.period:
            self._age()
        return m + 1

    def _age(self) -> None:
        """TinyLFU reset: halve every counter, clear the doorkeeper (two C-level passes
        over ~12 bytes per tracked chunk; once per ``period`` increments)."""
        self.count = 0
        self.table = self.table.translate(_HALVE)
        self.door = bytearray(len(self.door))
        self.sweeps += 1


class _Ghost:
    """Lossy history of recently evicted/refused keys: fingerprint, code and tick packed
    into one int64 per slot, bounded linear probing, entries expire after ``horizon``
    ticks. Holds no reference to the key (a store's keys may be large strings)."""

    PROBE = 8

    def __init__(self, size: int, horizon: int) -> None:
        bits = max(10, (size - 1).bit_length())
        self.mask = (1 << bits) - 1
        self.slots = array("q", bytes(8 << bits))
        self.horizon = max(1, horizon)

    @staticmethod
    def _fp(h: int) -> int:
        return ((h >> 40) & 0xFFFFFF) | 1

    def put(self, h: int, code: int, now: int) -> None:
        slots, mask, fp = self.slots, self.mask, self._fp(h)
        i = h & mask
        best, best_tick = i, None
        for k in range(self.PROBE):
            j = (i + k) & mask
            v = slots[j]
            tick = v >> 27
            if v == 0 or ((v >> 3) & 0xFFFFFF) == fp or now - tick > self.horizon:
                best = j
                break
            if best_tick is None or tick < best_tick:
                best, best_tick = j, tick
        slots[best] = (now << 27) | (fp << 3) | code

    def pop(self, h: int, now: int) -> Optional[Tuple[int, int]]:
        """``(code, age)`` of a live entry for ``h`` (removed), else ``None``."""
        slots, mask, fp = self.slots, self.mask, self._fp(h)
        i = h & mask
        for k in range(self.PROBE):
            j = (i + k) & mask
            v = slots[j]
            if v == 0:
                return None
            if ((v >> 3) & 0xFFFFFF) == fp:
                age = now - (v >> 27)
                slots[j] = (1 << 27) | (fp << 3) | _NONE  # tick 1: expired, keeps probing
                return (v & 7, age) if age <= self.horizon else None
        return None


class PrefixAdaptivePolicy(EvictionPolicy):
    """Prefix-ordered recency/frequency experts with learned weights and admission."""

    name = "prefix-adaptive"
    LEARNING_RATE = 0.45      # LeCaR's default
    DISCOUNT = 0.005          # regret left after one cache size of ticks (LeCaR)
    SAMPLE_FACTOR = 10        # sketch ageing period, in capacities (TinyLFU)
    EXPLORE = 0.01            # floor on each arm's share

    def __init__(self) -> None:
        self._index: Dict[Key, int] = {}
        self._keys: List[Optional[Key]] = [None] * _FIRST
        n = _FIRST
        self._parent = array("i", [-1] * n)
        self._nchild = array("i", [0] * n)
        self._level = array("i", [0] * n)
        # Sentinels are their own neighbours (empty circular lists).
        self._lprev = array("i", range(n))
        self._lnext = array("i", range(n))
        self._fprev = array("i", range(n))
        self._fnext = array("i", range(n))
        self._free: List[int] = []
        self._cap = 0               # learned capacity (largest resident count seen)
        self._tick = 0
        self._epoch = 0             # completed sketch sweeps
        self._sketch = _Sketch(1024, self.SAMPLE_FACTOR * 1024)
        self._ghost = _Ghost(1024, 1024)
        self._w = [0.5, 0.5]        # eviction experts: recency, frequency
        self._g = [0.5, 0.5]        # first sightings: admit, refuse
        self._acc = [0.0, 0.0]      # stride accumulators for the two choices
        self._last_miss: Optional[int] = None
        self._gate_last: Optional[Key] = None   # last key admitted on a gate "admit"
        self._blame = False         # next eviction is for an admitted first sighting
        self._full = False          # the store has asked for a victim at least once
        self._victim = -1           # cached victim slot (valid until the next change)
        self._victim_code = _NONE
        self._protect: Dict[int, int] = {}      # slot -> expiry tick
        self._parked: Deque[Tuple[int, int]] = deque()  # (expiry tick, slot)

    # ----------------------------------------------------------- sizing and history
    def _grow_history(self) -> None:
        """Size sketch and ghost to the learned capacity (only while it doubles)."""
        cap = self._cap
        if cap > self._sketch.width:
            self._sketch = _Sketch(cap, self.SAMPLE_FACTOR * cap)
            self._epoch_base = self._epoch
        if cap > self._ghost.mask + 1:
            self._ghost = _Ghost(cap, cap)
        self._ghost.horizon = max(1, cap)

    _epoch_base = 0

    def _count(self, h: int) -> int:
        """Record one access of hash ``h``; returns its sketch estimate."""
        self._tick += 1
        sk = self._sketch
        est = sk.add(h)
        epoch = self._epoch_base + sk.sweeps
        if epoch != self._epoch:
            self._age_levels(epoch)
        return est

    def _level_of(self, est: int, pslot: int) -> int:
        lvl = self._epoch + (est.bit_length() - 1 if est > 0 else 0)
        if pslot >= 0:
            plvl = self._level[pslot]
            if plvl < self._epoch:
                plvl = self._epoch
            if plvl < lvl:
                lvl = plvl
        return lvl

    def _age_levels(self, epoch: int) -> None:
        """Counters were halved: fold each level list below the new floor into it."""
        fp, fn = self._fprev, self._fnext
        while self._epoch < epoch:
            src = 1 + self._epoch % _R
            self._epoch += 1
            dst = 1 + self._epoch % _R
            if fn[src] == src:
                continue
            a, b, first = fn[src], fp[src], fn[dst]
            # src's whole list goes on dst's eviction side, order kept.
            fn[dst], fp[a] = a, dst
            fn[b], fp[first] = first, b
            fn[src] = fp[src] = src

    # ----------------------------------------------------------------- list splicing
    def _unlink(self, slot: int) -> None:
        lp, ln, fp, fn = self._lprev, self._lnext, self._fprev, self._fnext
        a, b = lp[slot], ln[slot]
        if a < 0:
            return
        ln[a], lp[b] = b, a
        a, b = fp[slot], fn[slot]
        fn[a], fp[b] = b, a
        lp[slot] = ln[slot] = fp[slot] = fn[slot] = -1

    # ---------------------------------------------------------------- learning
    def _pick(self, which: int) -> int:
        """Stride scheduling over the learned weights: 0 or 1, deterministic."""
        w = self._w if which == 0 else self._g
        p = (1.0 - self.EXPLORE) * w[0] + self.EXPLORE / 2
        acc = self._acc[which] + p
        if acc >= 1.0:
            self._acc[which] = acc - 1.0
            return 0
        self._acc[which] = acc
        return 1

    def _penalise(self, w: List[float], arm: int, age: int) -> None:
        r = math.exp(math.log(self.DISCOUNT) * age / max(1, self._cap))
        w[arm] *= math.exp(-self.LEARNING_RATE * r)
        s = w[0] + w[1]
        w[0] /= s
        w[1] /= s

    def _regret(self, h: int) -> None:
        hit = self._ghost.pop(h, self._tick)
        if hit is None:
            return
        code, age = hit
        expert = code & 3
        if expert == _BY_LRU or expert == _BY_LFU:
            self._penalise(self._w, expert - 1, age)
        elif expert == _REFUSED:
            self._penalise(self._g, 1, age)
        if code & _BLAME:
            self._penalise(self._g, 0, age)

    # -------------------------------------------------------------------- API
    def miss(self, key: Key, parent: Optional[Key]) -> None:
        h = _mix(key)
        self._count(h)
        self._regret(h)
        self._last_miss = h

    def admit(self, key: Key, parent: Optional[Key], size: int) -> bool:
        h = _mix(key)
        if h == self._last_miss:
            est = self._sketch.estimate(h)
        else:
            est = self._count(h)
            self._regret(h)
        self._last_miss = None
        if parent is not None and parent not in self._index:
            return False                    # could never be hit: its prefix is gone
        if not self._full or len(self._index) < self._cap:
            return True                     # room to spare
        if parent is not None and parent == self._gate_last:
            self._gate_last = key           # rest of a chain the gate already let in
            return True
        if est >= 2:
            return True                     # seen before: not a first sighting
        if self._pick(1) == 1:
            self._ghost.put(h, _REFUSED, self._tick)
            self._gate_last = None
            return False
        self._blame = True
        self._gate_last = key
        return True

    def insert(self, key: Key, parent: Optional[Key], size: int) -> None:
        if key in self._index:
            return
        slot = self._alloc()
        self._index[key] = slot
        self._keys[slot] = key
        pslot = self._index.get(parent, -1) if parent is not None else -1
        self._parent[slot] = pslot
        self._nchild[slot] = 0
        if pslot >= 0:
            self._nchild[pslot] += 1
        h = _mix(key)
        self._level[slot] = self._level_of(self._sketch.estimate(h), pslot)
        self._place(slot, orphan=parent is not None and pslot < 0)
        if len(self._index) > self._cap:
            self._cap = len(self._index)
            if self._cap > self._sketch.width or self._cap > self._ghost.mask + 1:
                self._grow_history()
        self._victim = -1

    def touch(self, key: Key) -> None:
        slot = self._index.get(key)
        if slot is None:
            return
        est = self._count(_mix(key))
        self._protect.pop(slot, None)
        self._unlink(slot)
        self._level[slot] = self._level_of(est, self._parent[slot])
        self._place(slot)
        self._victim = -1

    def remove(self, key: Key) -> None:
        slot = self._index.pop(key, None)
        if slot is None:
            return
        if slot == self._victim:
            code = self._victim_code | (_BLAME if self._blame else 0)
            if code:
                self._ghost.put(_mix(key), code, self._tick)
            self._blame = False
        self._victim = -1
        self._protect.pop(slot, None)
        self._unlink(slot)
        self._keys[slot] = None
        p = self._parent[slot]
        self._parent[slot] = -1
        if self._nchild[slot] == 0:
            self._free.append(slot)
        # else: its children are orphans now; the slot is freed with the last of them
        if p >= 0:
            self._nchild[p] -= 1
            if self._keys[p] is None and self._nchild[p] == 0:
                self._free.append(p)

    def victim(self) -> Optional[Key]:
        if self._victim >= 0:
            return self._keys[self._victim]
        if not self._index:
            return None
        self._full = True
        self._unpark_expired()
        expert = self._pick(0)
        slot = -1
        for _ in range(len(self._index) + 1):
            a = self._lnext[_LRU]
            b = self._lowest_level_head()
            cand = a if expert == 0 else b
            if cand < _FIRST:
                cand = b if expert == 0 else a
            if cand < _FIRST:
                break
            if self._nchild[cand] > 0 or self._protect.get(cand, -1) > self._tick:
                self._park(cand)
                continue
            slot = cand
            self._victim_code = _NONE if a == b else (_BY_LRU if expert == 0 else _BY_LFU)
            break
        if slot < 0:
            slot = self._unpark_oldest()
            self._victim_code = _NONE
        self._victim = slot
        return self._keys[slot] if slot >= 0 else None

    def hint_upcoming(self, keys: Iterable[Key]) -> None:
        """Protect present ``keys`` for about one cache turnover, or until touched."""
        limit = max(1, self._cap // 2)
        until = self._tick + max(1, self._cap)
        index, protect = self._index, self._protect
        for key in keys:
            slot = index.get(key)
            if slot is not None and (slot in protect or len(protect) < limit):
                protect[slot] = until
        self._victim = -1

    def __contains__(self, key: Key) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    # ------------------------------------------------------------------ helpers
    def _place(self, slot: int, orphan: bool = False) -> None:
        """Link ``slot``: behind its parent, at the protected end, or (orphan) first out."""
        lp, ln, fp, fn = self._lprev, self._lnext, self._fprev, self._fnext
        p = self._parent[slot]
        p_linked = p >= 0 and lp[p] >= 0
        if orphan:
            at = ln[_LRU]
        else:
            at = p if p_linked else _LRU
        prev = lp[at]
        lp[slot], ln[slot], ln[prev], lp[at] = prev, at, slot, slot
        epoch = self._epoch
        lvl = self._level[slot]
        eff = lvl if lvl > epoch else epoch
        sent = 1 + eff % _R
        if orphan:
            at = fn[sent]
        elif p_linked and max(self._level[p], epoch) == eff:
            at = p
        else:
            at = sent
        prev = fp[at]
        fp[slot], fn[slot], fn[prev], fp[at] = prev, at, slot, slot

    def _lowest_level_head(self) -> int:
        fn = self._fnext
        base = self._epoch
        for lvl in range(base, base + 9):
            sent = 1 + lvl % _R
            head = fn[sent]
            if head != sent:
                return head
        return -1

    def _alloc(self) -> int:
        if self._free:
            return self._free.pop()
        slot = len(self._keys)
        self._keys.append(None)
        for arr, fill in (
            (self._parent, -1), (self._nchild, 0), (self._level, 0),
            (self._lprev, -1), (self._lnext, -1), (self._fprev, -1), (self._fnext, -1),
        ):
            arr.append(fill)
        return slot

    def _park(self, slot: int) -> None:
        """Take a protected chunk (or an ancestor of one) out of both lists for a while."""
        self._unlink(slot)
        until = self._protect.get(slot, self._tick + max(1, self._cap))
        self._parked.append((until, slot))

    def _unpark_expired(self) -> None:
        parked, tick = self._parked, self._tick
        while parked and parked[0][0] <= tick:
            _, slot = parked.popleft()
            self._relink(slot)

    def _unpark_oldest(self) -> int:
        """Everything left is protected: give up the oldest protected leaf."""
        while self._parked:
            _, slot = self._parked.popleft()
            if self._keys[slot] is not None and self._lprev[slot] < 0:
                self._protect.pop(slot, None)
                self._place(slot)
                if self._nchild[slot] == 0:
                    return slot
        head = self._lnext[_LRU]
        return head if head >= _FIRST and self._nchild[head] == 0 else -1

    def _relink(self, slot: int) -> None:
        if self._keys[slot] is not None and self._lprev[slot] < 0:
            self._protect.pop(slot, None)
            self._place(slot)

    # Statistics for benches and tests (cheap, read-only).
    @property
    def weights(self) -> Dict[str, float]:
        return {
            "recency": self._w[0], "frequency": self._w[1],
            "admit_first_sighting": self._g[0], "refuse_first_sighting": self._g[1],
        }
