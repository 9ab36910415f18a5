"""``prefix-adaptive``: the recommended eviction and admission policy for KV-chunk tiers.

Runs wherever a tier runs (the vLLM worker's store, or ``cache.tools.replay``), always under the
store's lock. Nothing here blocks: every call is O(1) amortized (a few list splices, a
hash-table probe, eight sketch/doorkeeper bytes, a bounded ghost-table probe), with no
I/O and no sleeping. Growth of the key index is incremental (16 buckets moved per
insert). The one periodic pass is TinyLFU's ageing of the sketch: two C-level passes
(``bytes.translate`` and a fresh zeroed buffer) over 8-12 bytes per chunk of capacity,
once every 10 sketch widths of accesses (tens of ms for a 10-million-chunk tier, i.e.
amortized O(1)); the sketch and ghost are rebuilt empty (C-level allocations) when the
learned capacity outgrows them, which only happens while the tier first fills.

What it does, and why:

1. **Prefix order for free.** A chunk is worth nothing without its ancestors, so every
   ordering it keeps is a doubly linked list that holds the invariant *a child sits on
   the eviction side of its parent*. A touched or inserted chunk is spliced in right
   behind its parent (or at the protected end when it has no parent in the tier). The
   eviction end of such a list is therefore a leaf: chains are cut from the tail,
   shared roots (whose many children all sit behind them) go last, and no descendant
   outlives its ancestor. Children are never scanned, so this costs O(1). (``victim``
   still checks the child count and parks a non-leaf, so the rule holds even when the
   store removes inner chunks behind our back.)
2. **Two experts, weights learned online.** A recency expert (the list above) and a
   frequency expert (one such list per half-octave of estimated frequency; a child's
   level is clamped to its parent's, so that order is prefix-safe too) each name a
   victim. Which one evicts is learned from regret, as in LeCaR (Vietri et al.,
   HotStorage'18): an evicted
   key enters a ghost table tagged with the expert that chose it; when it is asked for
   again, that expert's weight shrinks (by more the sooner it came back). A
   deterministic stride turns weights into decisions, so runs are reproducible.
3. **Learned admission.** TinyLFU's history (a doorkeeper Bloom filter in front of a
   count-min sketch of byte counters, halved every 10 sketch widths of accesses, the
   width being 1-1.5x the capacity) remembers
   keys beyond residency. When the tier is full, a chunk not seen before in that window
   is a *first sighting*; a second pair of weights learns whether to take first
   sightings or refuse them. One decision covers a whole new chain (its later blocks
   follow their parent) and is judged block by block: every refused block that comes
   back blames "refuse", every victim evicted to make room for an admitted first
   sighting that comes back blames "admit". The rest of a refused chain is refused
   with it, and a chunk whose parent had to be evicted to make room for it is stored
   at the eviction end and ends its chain: neither could be hit here. A chunk whose
   parent was simply never here is judged like any other: in a tiered store the parent
   may sit in a faster tier (leaf-first eviction demotes tails before roots).
   A store's upper tiers (``last_tier=False``) skip all of this and take every chunk:
   what they evict is demoted, and admission is the business of the tier below.
4. **Queue hints.** ``hint_upcoming`` states what the waiting requests will look up:
   present keys are protected (a protected victim candidate, and any ancestor of one,
   is parked out of the lists instead of evicted), absent ones pass the admission gate
   and are protected once stored.

Nothing is fitted to a trace: the constants are the published defaults of the
mechanisms above (LeCaR's learning rate 0.45 and discount 0.005 over one cache size,
TinyLFU's sample size of 10x its width), a 1 % share of decisions spread evenly over
the arms so neither is starved of evidence, and table load factors. Weights start
even (no prior favouring either arm).

The capacity is not given: it is learned as the largest resident count seen (what the
store holds when it starts asking for victims). ``size`` is ignored: a tier's chunks
have one size per model. Memory per resident chunk: 32 bytes of per-slot arrays and an
8-byte list slot, 8-16 bytes of key index (open addressing, load <= 1/2), 8-12 of
sketch and doorkeeper, 16-24 of ghost table, and no key object of its own (the store
owns keys; evicted keys are remembered by fingerprint): about 86 bytes in all, i.e.
under 1 GiB for 10 million chunks. ``tests/test_policy.py`` measures it.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from typing import Deque, Dict, Iterable, List, Optional, Tuple

from .base import EvictionPolicy, Key

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
_HALVE = bytes(v >> 1 for v in range(256))  # translate table: halve every counter

_R = 32                       # level sentinels (live levels span at most 18)
_SPAN = 18                    # half-octave levels of an estimate in 1..256
_LRU = 0                      # slot of the recency list's sentinel
_FIRST = 1 + _R               # first slot for a chunk; slot 0 also means "none"

_NONE, _BY_LRU, _BY_LFU, _REFUSED = 0, 1, 2, 3   # ghost codes; bit 2 = "admit" blamed
_BLAME = 4


def _mix(key: Key) -> int:
    """64-bit mixed hash (``hash`` of an int is the int itself)."""
    h = (hash(key) * 0x9E3779B97F4A7C15) & _M64
    h ^= h >> 31
    return (h * 0xBF58476D1CE4E5B9) & _M64


class _History:
    """TinyLFU frequency history: doorkeeper Bloom filter + count-min sketch.

    The first sighting of a key only sets its two doorkeeper bits; later sightings bump
    four saturating byte counters (conservative update). Estimate = counters + door.
    Every ``period`` additions all counters are halved and the doorkeeper is cleared
    (``resets`` counts those; they are the policy's ageing epochs). Indexes use
    multiply-shift range reduction, so ``width`` need not be a power of two.
    """

    def __init__(self, width: int, period: int) -> None:
        w = max(64, width)
        self.w = w
        self.table = bytearray(4 * w)
        self.door = bytearray(4 * w)        # 32 doorkeeper bits per counter column
        self.dbits = 32 * w
        self.period = max(1, period)
        self.count = 0
        self.resets = 0

    def estimate(self, h: int) -> int:
        w, t = self.w, self.table
        g = (h * 0xD6E8FEB86659FD93) & _M64
        m = t[((h & _M32) * w) >> 32]
        x = t[w + (((h >> 32) * w) >> 32)]
        if x < m:
            m = x
        x = t[2 * w + (((g & _M32) * w) >> 32)]
        if x < m:
            m = x
        x = t[3 * w + (((g >> 32) * w) >> 32)]
        if x < m:
            m = x
        d, db = self.door, self.dbits
        g = (h * 0x165667B19E3779F9) & _M64
        b0 = ((g & _M32) * db) >> 32
        b1 = ((g >> 32) * db) >> 32
        if d[b0 >> 3] & (1 << (b0 & 7)) and d[b1 >> 3] & (1 << (b1 & 7)):
            m += 1
        return m

    def add(self, h: int) -> int:
        """Count one access of ``h``; returns the new estimate."""
        d, db = self.door, self.dbits
        g = (h * 0x165667B19E3779F9) & _M64
        b0 = ((g & _M32) * db) >> 32
        b1 = ((g >> 32) * db) >> 32
        w, t = self.w, self.table
        g = (h * 0xD6E8FEB86659FD93) & _M64
        i0 = ((h & _M32) * w) >> 32
        i1 = w + (((h >> 32) * w) >> 32)
        i2 = 2 * w + (((g & _M32) * w) >> 32)
        i3 = 3 * w + (((g >> 32) * w) >> 32)
        m = t[i0]
        x = t[i1]
        if x < m:
            m = x
        x = t[i2]
        if x < m:
            m = x
        x = t[i3]
        if x < m:
            m = x
        if d[b0 >> 3] & (1 << (b0 & 7)) and d[b1 >> 3] & (1 << (b1 & 7)):
            if m < 255:
                for i in (i0, i1, i2, i3):
                    if t[i] == m:
                        t[i] = m + 1
                m += 1
        else:
            d[b0 >> 3] |= 1 << (b0 & 7)
            d[b1 >> 3] |= 1 << (b1 & 7)
        self.count += 1
        if self.count >= self.period:
            self.count = 0
            self.table = t.translate(_HALVE)
            self.door = bytearray(len(d))
            self.resets += 1
        return m + 1


class _Ghost:
    """Lossy history of recently evicted/refused keys: fingerprint, code and tick packed
    in one int64 per slot, bounded linear probing, entries expire after ``horizon``
    ticks. It keeps no reference to keys (a store's keys may be large strings)."""

    PROBE = 8

    def __init__(self, size: int, horizon: int) -> None:
        self.size = max(64, size)
        self.slots = array("q", bytes(8 * self.size))
        self.horizon = max(1, horizon)

    def put(self, h: int, code: int, now: int) -> None:
        slots, size, horizon = self.slots, self.size, self.horizon
        fp = (h & 0xFFFFFF) | 1
        j = ((h >> 32) * size) >> 32
        best, best_tick = j, now + 1
        for _ in range(self.PROBE):
            v = slots[j]
            if v == 0 or ((v >> 3) & 0xFFFFFF) == fp or now - (v >> 27) > horizon:
                best = j
                break
            if (v >> 27) < best_tick:
                best, best_tick = j, v >> 27
            j += 1
            if j == size:
                j = 0
        slots[best] = (now << 27) | (fp << 3) | code

    def pop(self, h: int, now: int) -> Optional[Tuple[int, int]]:
        """``(code, age)`` of a live entry for ``h`` (consumed), else ``None``."""
        slots, size = self.slots, self.size
        fp = (h & 0xFFFFFF) | 1
        j = ((h >> 32) * size) >> 32
        for _ in range(self.PROBE):
            v = slots[j]
            if v == 0:
                return None
            if ((v >> 3) & 0xFFFFFF) == fp:
                slots[j] = (1 << 27) | (fp << 3)    # expired, keeps later probes going
                age = now - (v >> 27)
                return (v & 7, age) if age <= self.horizon else None
            j += 1
            if j == size:
                j = 0
        return None


class PrefixAdaptivePolicy(EvictionPolicy):
    """Prefix-ordered recency/frequency experts with learned weights and admission."""

    name = "prefix-adaptive"
    LEARNING_RATE = 0.45      # LeCaR's default
    DISCOUNT = 0.005          # regret left after one cache size of ticks (LeCaR)
    SAMPLE_FACTOR = 10        # history ageing period, in capacities (TinyLFU)
    EXPLORE = 0.01            # share of decisions spread evenly over the arms
    MIGRATE = 16              # index buckets moved per insert while the index grows

    def __init__(self, *, last_tier: bool = True) -> None:
        """``last_tier``: chunks this tier evicts or refuses are gone (a single tier, the
        last tier of a store, the replay tool). With ``False`` its victims are demoted to
        a slower tier, so it stores every chunk it is offered (the tier below decides
        what is worth keeping) and keeps a chunk whose parent it demoted: the parent
        still serves from below."""
        super().__init__(last_tier=last_tier)
        n = _FIRST
        self._keys: List[Optional[Key]] = [None] * n
        self._h32 = array("I", [0] * n)
        self._parent = array("i", [0] * n)       # 0 = no parent in the tier
        self._nchild = array("i", [0] * n)
        self._level = array("i", [0] * n)
        # Sentinels are their own neighbours (empty circular lists); -1 = unlinked.
        self._lprev = array("i", range(n))
        self._lnext = array("i", range(n))
        self._fprev = array("i", range(n))
        self._fnext = array("i", range(n))
        self._free: List[int] = []
        self._n = 0                 # resident chunks
        # Key index: open addressing over slot numbers (0 = empty, -1 = tombstone in
        # the old table while it is being migrated).
        self._tbl = array("i", bytes(4 * 64))
        self._tmask = 63
        self._otbl: Optional[array] = None
        self._omask = 0
        self._ocur = 0
        self._mk: object = None     # memo: last two keys looked up, hash and slot
        self._mh = 0
        self._ms = 0
        self._pk: object = None
        self._ph = 0
        self._ps = 0
        self._cap = 0               # learned capacity (largest resident count seen)
        self._tick = 0
        self._epoch = 0             # history resets so far (frequency-level floor)
        self._epoch_base = 0
        self._hist = _History(64, self.SAMPLE_FACTOR * 64)
        self._ghost = _Ghost(128, 64)
        self._w = [0.5, 0.5]        # eviction experts: recency, frequency
        self._g = [0.5, 0.5]        # first sightings: admit, refuse
        self._acc = [0.0, 0.0]      # stride accumulators for the two choices
        self._last_est = (-1, 0)    # (hash, estimate) from the last admit()
        self._gate_last: Optional[Key] = None     # last key let in by a gate "admit"
        self._gate_refused: Optional[Key] = None  # last key refused with its chain
        self._refused_by_gate = False             # ... by the gate (not by an eviction)
        self._evicted: List[int] = []             # slots evicted since the last admit
        self._orphan: Optional[Key] = None        # last chunk stored after its parent went
        self._blame = False         # next eviction makes room for a first sighting
        self._full = False          # the store has asked for a victim at least once
        self._victim = 0            # cached victim slot (valid until the next change)
        self._victim_code = _NONE
        self._protect: Dict[int, int] = {}        # slot -> expiry tick
        self._expect: Dict[int, int] = {}         # hash of an absent hinted key -> expiry
        self._hinted: List[int] = []              # slots protected by the last hint
        self._parked: Deque[Tuple[int, int]] = deque()  # (expiry tick, slot)

    # ------------------------------------------------------------------- key index
    def _lookup(self, key: Key) -> Tuple[int, int]:
        """``(hash, slot)`` of ``key``; slot 0 when absent. Memoised for the last two
        keys (a store asks about a key, its parent, then the key again)."""
        if key is self._mk:
            return self._mh, self._ms
        if key is self._pk:
            return self._ph, self._ps
        h = _mix(key)
        h32 = h & _M32
        keys, hs = self._keys, self._h32
        tbl, mask = self._tbl, self._tmask
        i = h32 & mask
        s = tbl[i]
        while s:
            if hs[s] == h32 and keys[s] == key:
                break
            i = (i + 1) & mask
            s = tbl[i]
        if not s and self._otbl is not None:
            tbl, mask = self._otbl, self._omask
            i = h32 & mask
            s = tbl[i]
            while s:
                if s > 0 and hs[s] == h32 and keys[s] == key:
                    break
                i = (i + 1) & mask
                s = tbl[i]
        self._pk, self._ph, self._ps = self._mk, self._mh, self._ms
        self._mk, self._mh, self._ms = key, h, s
        return h, s

    def _memo_insert(self, key: Key, h: int, slot: int) -> None:
        if self._ps == 0 and self._pk is not None and self._pk == key:
            self._ps = slot                 # an equal key object memoised as absent
        if self._ms == 0 and self._mk is not None and self._mk == key and self._mk is not key:
            self._ms = slot
        self._pk, self._ph, self._ps = self._mk, self._mh, self._ms
        self._mk, self._mh, self._ms = key, h, slot

    def _memo_remove(self, slot: int) -> None:
        if self._ms == slot:
            self._ms = 0
        if self._ps == slot:
            self._ps = 0

    def _slot_of(self, key: Key) -> int:
        return self._lookup(key)[1]

    def _tput(self, tbl: array, mask: int, slot: int) -> None:
        i = self._h32[slot] & mask
        while tbl[i] > 0:
            i = (i + 1) & mask
        tbl[i] = slot

    def _index_add(self, slot: int) -> None:
        if self._otbl is not None:
            self._migrate(self.MIGRATE)
        if 2 * (self._n + 1) > self._tmask + 1:
            if self._otbl is not None:
                self._migrate(self._omask + 1)
            self._otbl, self._omask, self._ocur = self._tbl, self._tmask, 0
            self._tmask = 2 * (self._tmask + 1) - 1
            self._tbl = array("i", bytes(4 * (self._tmask + 1)))
        self._tput(self._tbl, self._tmask, slot)

    def _migrate(self, steps: int) -> None:
        otbl, cur = self._otbl, self._ocur
        end = min(len(otbl), cur + steps)
        tbl, mask = self._tbl, self._tmask
        for i in range(cur, end):
            s = otbl[i]
            if s > 0:
                self._tput(tbl, mask, s)
        self._ocur = end
        if end >= len(otbl):
            self._otbl = None

    def _index_del(self, slot: int) -> None:
        h32 = self._h32[slot]
        tbl, mask, hs = self._tbl, self._tmask, self._h32
        i = h32 & mask
        s = tbl[i]
        while s and s != slot:
            i = (i + 1) & mask
            s = tbl[i]
        if s == slot:               # backward-shift deletion keeps probes tombstone-free
            j = i
            while True:
                j = (j + 1) & mask
                s = tbl[j]
                if not s:
                    break
                k = hs[s] & mask
                if (i < j and (k <= i or k > j)) or (j < i and i >= k > j):
                    tbl[i] = s
                    i = j
            tbl[i] = 0
        if self._otbl is not None:
            otbl, omask = self._otbl, self._omask
            i = h32 & omask
            s = otbl[i]
            while s and s != slot:
                i = (i + 1) & omask
                s = otbl[i]
            if s == slot:
                otbl[i] = -1

    # ---------------------------------------------------------------- history, levels
    def _count(self, h: int) -> int:
        """Record one access of hash ``h``; returns its frequency estimate."""
        self._tick += 1
        hist = self._hist
        est = hist.add(h)
        if self._epoch_base + 2 * hist.resets != self._epoch:
            self._age_levels(self._epoch_base + 2 * hist.resets)   # halving = 2 levels
        return est

    def _level_of(self, est: int, pslot: int) -> int:
        """Absolute frequency level: floor(2 log2 est) above the current floor, clamped
        to the parent's level so the frequency order stays prefix-safe."""
        lvl = self._epoch
        if est > 1:
            b = est.bit_length() - 1
            lvl += 2 * b + (1 if est * est >= 1 << (2 * b + 1) else 0)
        if pslot:
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
            fn[dst], fp[a] = a, dst        # src's list goes on dst's eviction side
            fn[b], fp[first] = first, b
            fn[src] = fp[src] = src

    def _grow_history(self) -> None:
        """Size history and ghost to the learned capacity (with 1.5x headroom, so only
        O(log capacity) times, while the tier first fills)."""
        cap = self._cap
        if cap > self._hist.w:
            w = cap + cap // 2
            self._hist = _History(w, self.SAMPLE_FACTOR * w)
            self._epoch_base = self._epoch
        if 2 * cap > self._ghost.size:
            # at most one event (eviction or refusal) per tick, horizon = cap ticks:
            # 2-3x that many slots keeps the table at most half full.
            self._ghost = _Ghost(3 * cap, cap)

    # ----------------------------------------------------------------- list splicing
    def _place(self, slot: int, orphan: bool = False) -> None:
        """Link ``slot`` right behind its parent, or at the protected end without one;
        an orphan goes to the eviction end."""
        lp, ln, fp, fn = self._lprev, self._lnext, self._fprev, self._fnext
        p = self._parent[slot]
        p_linked = p > 0 and lp[p] >= 0
        if orphan:
            at = ln[_LRU]
        else:
            at = p if p_linked else _LRU
        prev = lp[at]
        lp[slot] = prev
        ln[slot] = at
        ln[prev] = slot
        lp[at] = slot
        epoch = self._epoch
        lvl = self._level[slot]
        eff = lvl if lvl > epoch else epoch
        sent = 1 + eff % _R
        if orphan:
            at = fn[sent]
        elif p_linked and (self._level[p] if self._level[p] > epoch else epoch) == eff:
            at = p
        else:
            at = sent
        prev = fp[at]
        fp[slot] = prev
        fn[slot] = at
        fn[prev] = slot
        fp[at] = slot

    def _unlink(self, slot: int) -> None:
        lp, ln, fp, fn = self._lprev, self._lnext, self._fprev, self._fnext
        a = lp[slot]
        if a < 0:
            return
        b = ln[slot]
        ln[a] = b
        lp[b] = a
        a = fp[slot]
        b = fn[slot]
        fn[a] = b
        fp[b] = a
        lp[slot] = ln[slot] = fp[slot] = fn[slot] = -1

    def _lowest_level_head(self) -> int:
        fn = self._fnext
        base = self._epoch
        for lvl in range(base, base + _SPAN):
            sent = 1 + lvl % _R
            head = fn[sent]
            if head != sent:
                return head
        return 0

    # ---------------------------------------------------------------- learning
    def _pick(self, which: int) -> int:
        """Stride scheduling over the learned weights: arm 0 or 1, deterministic."""
        w = self._w if which == 0 else self._g
        acc = self._acc[which] + (1.0 - self.EXPLORE) * w[0] + self.EXPLORE / 2
        if acc >= 1.0:
            self._acc[which] = acc - 1.0
            return 0
        self._acc[which] = acc
        return 1

    def _penalise(self, w: List[float], arm: int, age: int) -> None:
        """LeCaR's update: shrink the arm that erred, by more the sooner its victim (or
        refused key) came back; ``age`` is in ticks, the discount spans one capacity."""
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
    def admit(self, key: Key, parent: Optional[Key], size: int) -> bool:
        h = self._lookup(key)[0]
        est = self._count(h)
        self._regret(h)
        self._last_est = (h, est)
        if parent is not None:
            if parent == self._gate_refused:
                # the rest of a chain refused here: it could never be hit here
                if self._refused_by_gate:
                    self._ghost.put(h, _REFUSED, self._tick)
                self._gate_refused = key
                return False
            if parent == self._orphan and not self._slot_of(parent):
                # its parent lost its own parent to an eviction here and went first
                self._gate_refused = key
                self._refused_by_gate = False
                return False
        self._evicted = []
        if not self._full or self._n < self._cap or not self.last_tier:
            return True                     # room to spare, or a tier below to decide
        if parent is not None and parent == self._gate_last:
            self._gate_last = key           # rest of a chain the gate let in
            self._blame = True
            return True
        if est >= 2:
            return True                     # seen before: not a first sighting
        if self._expect and self._expect.get(h, -1) > self._tick:
            return True                     # a queued request needs it
        if self._pick(1) == 1:
            self._ghost.put(h, _REFUSED, self._tick)
            self._gate_last = None
            self._gate_refused = key
            self._refused_by_gate = True
            return False
        self._blame = True
        self._gate_last = key
        return True

    def insert(self, key: Key, parent: Optional[Key], size: int) -> None:
        h, slot = self._lookup(key)
        if slot:
            return
        pslot = self._slot_of(parent) if parent is not None else 0
        # Its parent was evicted to make room for it: it can never be hit here, so it
        # goes first and its chain stops here. (A parent that was never here may sit in
        # a faster tier: then it is stored as a root.)
        orphan = (parent is not None and not pslot and self._evicted
                  and self.last_tier and self._evicted_parent(parent))
        slot = self._free.pop() if self._free else self._new_slot()
        self._keys[slot] = key
        self._h32[slot] = h & _M32
        self._index_add(slot)
        self._memo_insert(key, h, slot)
        self._n += 1
        self._parent[slot] = pslot
        self._nchild[slot] = 0
        if pslot:
            self._nchild[pslot] += 1
        le = self._last_est
        est = le[1] if le[0] == h else self._hist.estimate(h)
        self._level[slot] = self._level_of(est, pslot)
        self._place(slot, orphan)
        if orphan:
            self._orphan = key
        if self._expect:
            until = self._expect.pop(h, -1)
            if until > self._tick:
                self._protect[slot] = until
                self._hinted.append(slot)
        if self._n > self._cap:
            self._cap = self._n
            self._ghost.horizon = self._cap
            if self._cap > self._hist.w or 2 * self._cap > self._ghost.size:
                self._grow_history()
        self._victim = 0

    def touch(self, key: Key) -> None:
        h, slot = self._lookup(key)
        if not slot:
            return
        est = self._count(h)
        if self._protect:
            self._protect.pop(slot, None)
        self._unlink(slot)
        self._level[slot] = self._level_of(est, self._parent[slot])
        self._place(slot)
        self._victim = 0

    def remove(self, key: Key) -> None:
        h, slot = self._lookup(key)
        if not slot:
            return
        if slot == self._victim:
            code = self._victim_code | (_BLAME if self._blame else 0)
            if code:
                self._ghost.put(h, code, self._tick)
            self._blame = False
            self._evicted.append(slot)
        self._victim = 0
        self._index_del(slot)
        self._memo_remove(slot)
        self._n -= 1
        if self._protect:
            self._protect.pop(slot, None)
        self._unlink(slot)
        self._keys[slot] = None
        p = self._parent[slot]
        self._parent[slot] = 0
        if self._nchild[slot] == 0:
            self._free.append(slot)
        # else its children are orphans now; the slot is freed with the last of them
        if p:
            self._nchild[p] -= 1
            if self._keys[p] is None and self._nchild[p] == 0:
                self._free.append(p)

    def victim(self) -> Optional[Key]:
        if self._victim:
            return self._keys[self._victim]
        if not self._n:
            return None
        self._full = True
        if self._parked:
            self._unpark_expired()
        expert = self._pick(0)
        slot = 0
        nchild, protect = self._nchild, self._protect
        for _ in range(self._n + 1):
            a = self._lnext[_LRU]
            b = self._lowest_level_head()
            cand = a if expert == 0 else b
            if cand < _FIRST:
                cand = b if expert == 0 else a
            if cand < _FIRST:
                break
            if nchild[cand] > 0 or (protect and protect.get(cand, -1) > self._tick):
                self._park(cand)
                continue
            slot = cand
            self._victim_code = _NONE if a == b else (_BY_LRU if expert == 0 else _BY_LFU)
            break
        if not slot:
            slot = self._unpark_oldest()
            self._victim_code = _NONE
        self._victim = slot
        if not slot:
            return None
        key = self._keys[slot]
        self._pk, self._ph, self._ps = self._mk, self._mh, self._ms
        self._mk, self._mh, self._ms = key, _mix(key), slot   # remove(key) comes next
        return key

    def hint_upcoming(self, keys: Iterable[Key]) -> None:
        """``keys`` are what the requests waiting *now* will look up.

        Each call replaces the previous one (a request that left the queue no longer
        needs protecting). Present keys are protected from eviction; absent ones are let
        past the first-sighting gate when stored, and protected from then on. Protection
        ends when the key is touched, at the next call, or after about one cache
        turnover (``capacity`` accesses); at most half the capacity is protected.
        """
        protect = self._protect
        for slot in self._hinted:
            if protect.pop(slot, None) is not None:
                self._relink(slot)          # parked for a hint that is gone
        self._hinted = []
        self._expect.clear()
        limit = max(1, self._cap // 2)
        until = self._tick + max(1, self._cap)
        expect, hinted = self._expect, self._hinted
        for key in keys:
            h, slot = self._lookup(key)
            if slot:
                if len(protect) < limit and slot not in protect:
                    protect[slot] = until
                    hinted.append(slot)
            elif len(expect) < limit:
                expect[h] = until
        self._victim = 0

    def __contains__(self, key: Key) -> bool:
        return self._lookup(key)[1] > 0

    def __len__(self) -> int:
        return self._n

    # ------------------------------------------------------------------ helpers
    def _evicted_parent(self, parent: Key) -> bool:
        """Whether ``parent`` was one of the chunks just evicted for this insert (their
        slots are free but still hold nothing else yet)."""
        h32 = _mix(parent) & _M32
        hs = self._h32
        return any(hs[s] == h32 for s in self._evicted)

    def _new_slot(self) -> int:
        slot = len(self._keys)
        self._keys.append(None)
        self._h32.append(0)
        for arr in (self._parent, self._nchild, self._level):
            arr.append(0)
        for arr in (self._lprev, self._lnext, self._fprev, self._fnext):
            arr.append(-1)
        return slot

    def _park(self, slot: int) -> None:
        """Take a protected chunk (or an ancestor of one) out of both lists for a while."""
        self._unlink(slot)
        until = self._protect.get(slot, self._tick + max(1, self._cap))
        self._parked.append((until, slot))

    def _unpark_expired(self) -> None:
        parked, tick = self._parked, self._tick
        while parked and parked[0][0] <= tick:
            self._relink(parked.popleft()[1])

    def _unpark_oldest(self) -> int:
        """Everything left is protected: give up the oldest protected leaf."""
        while self._parked:
            slot = self._parked.popleft()[1]
            if self._keys[slot] is not None and self._lprev[slot] < 0:
                self._protect.pop(slot, None)
                self._place(slot)
                if self._nchild[slot] == 0:
                    return slot
        head = self._lnext[_LRU]
        return head if head >= _FIRST and self._nchild[head] == 0 else 0

    def _relink(self, slot: int) -> None:
        if self._keys[slot] is not None and self._lprev[slot] < 0:
            self._protect.pop(slot, None)
            self._place(slot)

    @property
    def weights(self) -> Dict[str, float]:
        """Learned weights (for benches, logs and tests)."""
        return {
            "recency": self._w[0], "frequency": self._w[1],
            "admit_first_sighting": self._g[0], "refuse_first_sighting": self._g[1],
        }

