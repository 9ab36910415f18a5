"""``prefix-adaptive``: the recommended eviction and admission policy for KV-chunk tiers.

Runs wherever a tier runs (the vLLM worker's store, or ``cache.tools.replay``), always
under the store's lock. Nothing here blocks: every call is O(1) amortized (a fingerprint,
a few index probes and list splices per expert; see ``cache.policy.slots``), with no
I/O and no sleeping.

Robust by construction: it never bets on one rule. It simulates, on every access and at
the tier's full capacity, a few *experts* (``cache.policy.experts``), each a complete
policy with its own content, and the tier *mirrors* the expert that has been serving the
most prefix hits lately (the leader): it admits what the leader admits and evicts what the
leader evicted, so its content, and with it its hit ratio, is the leader's.

- ``prefix-lru``: LRU in prefix order (a chain is cut from its tail, a shared root goes
  last). Best when reuse follows recency: multi-turn chat, whose next turn extends
  blocks seen once.
- ``arc`` and ``s3fifo``: ARC and S3-FIFO exactly as the classic policies (a test checks
  that they decide the same). Best when popularity is skewed and stable (RAG over a
  Zipf-popular document pool, a hot set under scans).
- ``prefix-lru+admission``: prefix LRU refusing first sightings once full (TinyLFU's
  doorkeeper over a window of 10 capacities), with the rest of a refused chain. Best when
  one-off suffixes would flush the reused prefixes. Last tier only.

Each expert's hits are counted as a request would see them (a chunk counts only when its
whole prefix is present in that expert), from the full access stream: hits (``touch``),
misses (``admit``), and present chunks recomputed after an earlier miss (``seen``). The
tier switches to a challenger when the challenger's lead over the current leader (hits
summed in batches of ``BATCH`` accesses, decayed over ``HORIZON`` capacities and at least
64 batches) exceeds ``Z`` = one standard error of their batch-by-batch difference, plus
one hit. Evidence is never reset, so after a switch the old leader has to win the lead
back: near-ties do not make the tier flap. The tier
keeps the chunks it holds and the leader does not in one list, in the order the leader
dropped them (``_extra``), and evicts from it first; after a switch that list is rebuilt
incrementally (``REBUILD`` slots per access), so the tier converges to the new leader's
content within one turnover without an O(n) pass.

Nothing is fitted to a trace: the experts are published policies with their published
constants, the switch rule is a one-standard-error test (the tier's worst case is
bounded by the best expert less the turnovers its switches cost, not by a fitted
threshold), and the tier starts with the plainest expert (``prefix-lru``). The capacity is not given: it is learned as the largest resident
count seen once the store first asks for a victim.

Queue hints (``hint_upcoming``) protect present chunks that waiting requests will load,
and let absent ones in past admission. ``last_tier=False`` (a store's upper tiers, whose
victims are demoted) takes every chunk and follows only the experts without admission.

Memory per tracked chunk: the tier's own index (a key reference, its fingerprint and its
parent's, a list link) and the four experts' compact tables (each about a capacity of
8-byte keys, links and index; ARC's and S3-FIFO's ghosts add about one more) and the
shared frequency sketch: about 220-240 bytes (``tests/test_policy.py`` and
``bench/bench_policy.py`` measure it), i.e. about 2.1 GiB for 10 million chunks.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

from .base import EvictionPolicy, Key
from .experts import ARC, PrefixLRU, S3FIFO
from .sketch import FrequencySketch
from .slots import Slots, fingerprint


class PrefixAdaptivePolicy(EvictionPolicy):
    """Mirrors whichever of its experts serves the most prefix hits (module docstring)."""

    name = "prefix-adaptive"
    Z = 1.0                 # standard errors a challenger must lead by to take over
    BATCH = 64              # accesses per evidence sample (a chain's hits come together)
    HORIZON = 16            # evidence decays over this many capacities of accesses ...
    MIN_WINDOW = 64 * BATCH  # ... and never over fewer than 64 batches
    SKETCH_SAMPLE = 10      # TinyLFU: counters halve every 10 widths of accesses
    REBUILD = 8             # tier slots re-checked per access after a switch
    _EXTRA = 1              # the list of chunks the leader does not hold (sentinel)

    def __init__(self, *, last_tier: bool = True) -> None:
        super().__init__(last_tier=last_tier)
        self._s = Slots(lists=1, extra="q")        # per slot: the parent's fingerprint
        self._pkey, = self._s.extra
        self._keys: List[Optional[Key]] = [None, None]   # the store's key objects, by slot
        self._hist = FrequencySketch(64, self.SKETCH_SAMPLE * 64)
        self.experts: List[EvictionPolicy] = [PrefixLRU(last_tier=last_tier), ARC(), S3FIFO()]
        self.expert_names = ["prefix-lru", "arc", "s3fifo"]
        if last_tier:
            self.experts.append(PrefixLRU(history=self._hist))
            self.expert_names.append("prefix-lru+admission")
        k = len(self.experts)
        self._lead = 0
        self._hit = [False] * k                    # each expert's verdict on the last access
        self._batch = [0] * k                      # this batch's hits, per expert
        self._score = [0.0] * k                    # decayed sums of batch hits ...
        self._sq = [[0.0] * k for _ in range(k)]   # ... and of squared pairwise differences
        self._nacc = 0
        self.switches = 0
        self._cap = 0
        self._full = False
        self._tick = 0
        self._last = 0                             # fingerprint of the last access
        self._admitted = 0                         # fingerprint of the last admit
        self._rebuild = 0                          # next slot to re-check after a switch
        self._victim = 0
        self._protect: Dict[int, int] = {}         # slot -> tick until which it stays
        self._expect: Dict[int, int] = {}          # absent hinted fingerprint -> tick

        def room(e: EvictionPolicy) -> "callable":
            return lambda: not self._full or len(e) < self._cap

        self._room = [room(e) for e in self.experts]

    # ------------------------------------------------------------------ experts
    def _on_leader_evict(self, k: int) -> None:
        """The leader dropped ``k``: if the tier holds it, it is next in line."""
        slot = self._s.find(k)
        if slot and not self._s.linked(slot):
            self._s.link_before(slot, self._EXTRA)

    def _access(self, k: int, pk: int) -> None:
        """Every expert serves one access of fingerprint ``k`` (parent ``pk``, 0: none)."""
        self._tick += 1
        self._hist.add(k)
        last, hit, experts = self._last, self._hit, self.experts
        parent = pk or None
        for i, e in enumerate(experts):
            if k in e:
                h = not pk or (hit[i] if pk == last else pk in e)
                if h:
                    e.touch(k)                     # a hit there (else recomputed: no touch)
            else:
                h = False
                e.offer(k, parent, 1, self._room[i],
                        evict=self._on_leader_evict if i == self._lead else None)
            hit[i] = h
        self._last = k
        slot = self._s.find(k)
        if slot and self._s.linked(slot) and k in experts[self._lead]:
            self._s.unlink(slot)                   # the leader holds it again
        if self._rebuild:
            self._rebuild_step()
        batch = self._batch
        for i in range(len(experts)):
            batch[i] += hit[i]
        self._nacc += 1
        if self._nacc >= self.BATCH:
            self._weigh()

    def _weigh(self) -> None:
        """One batch of evidence; switch to the challenger that leads the leader by more
        than ``Z`` standard errors of their difference. Evidence is never reset: after a
        switch the old leader must win the lead back (hysteresis against flapping)."""
        self._nacc = 0
        decay = (1.0 - 1.0 / max(self.MIN_WINDOW, self.HORIZON * max(self._cap, 64))) ** self.BATCH
        b, score, sq = self._batch, self._score, self._sq
        k = len(b)
        for i in range(k):
            score[i] = score[i] * decay + b[i]
            row = sq[i]
            for j in range(i + 1, k):
                d = b[i] - b[j]
                row[j] = sq[j][i] = row[j] * decay + d * d
        self._batch = [0] * k
        lead = self._lead
        best, best_by = -1, 0.0
        for i in range(k):
            by = score[i] - score[lead]
            if i != lead and by > self.Z * sq[i][lead] ** 0.5 + 1.0 and by > best_by:
                best, best_by = i, by
        if best >= 0:
            self._lead = best
            self.switches += 1
            self._rebuild = 2                      # slot 1 is the list's sentinel
            self._victim = 0

    def _rebuild_step(self, steps: int = 0) -> None:
        """Re-check ``REBUILD`` tier slots against the new leader: a chunk it does not
        hold joins the eviction list, one it holds leaves it."""
        s, keys, lead = self._s, self._keys, self.experts[self._lead]
        i, n = self._rebuild, len(keys)
        end = min(n, i + (steps or self.REBUILD))
        for slot in range(i, end):
            if keys[slot] is None:
                continue
            held = s.key[slot] in lead
            if held and s.linked(slot):
                s.unlink(slot)
            elif not held and not s.linked(slot):
                s.link_before(slot, self._EXTRA)
        self._rebuild = 0 if end >= n else end

    def _size_sketch(self, fresh: bool = False) -> None:
        """Size the frequency sketch to the learned capacity, as TinyLFU does (a power of
        two of counters at least the capacity, halved every 10 capacities of accesses):
        when the tier is first full, then only when the capacity outgrows it."""
        if fresh or self._cap > self._hist.w:
            w = 1 << max(6, (self._cap - 1).bit_length())
            self._hist = FrequencySketch(w, self.SKETCH_SAMPLE * self._cap)
        if self.last_tier:
            self.experts[-1].history = self._hist
            self.experts[-1].capacity = self._cap

    # -------------------------------------------------------------------- tier
    def _slot(self, key: Key, k: int) -> int:
        slot = self._s.find(k)
        return slot if slot and self._keys[slot] == key else 0

    def admit(self, key: Key, parent: Optional[Key], size: int) -> bool:
        k = fingerprint(key)
        self._access(k, fingerprint(parent) if parent is not None else 0)
        self._admitted = k
        self._victim = 0
        if not self._full or not self.last_tier:
            return True
        if self._expect and self._expect.get(k, -1) >= self._tick:
            return True                                 # a queued request needs it
        return k in self.experts[self._lead]

    def insert(self, key: Key, parent: Optional[Key], size: int) -> None:
        k = fingerprint(key)
        if self._slot(key, k):
            return
        pk = fingerprint(parent) if parent is not None else 0
        if k != self._admitted:
            self._access(k, pk)                         # taught without an admit (restart)
        self._admitted = 0
        s = self._s
        slot = s.add(k)
        if slot == len(self._keys):
            self._keys.append(key)
        else:
            self._keys[slot] = key
        self._pkey[slot] = pk
        if k not in self.experts[self._lead]:
            s.link_before(slot, self._EXTRA)            # stored against the leader's advice
        if self._expect:
            until = self._expect.pop(k, -1)
            if until >= self._tick:
                self._protect[slot] = until
        if s.count > self._cap:
            self._cap = s.count
            if self._full:
                self._size_sketch()
        self._victim = 0

    def touch(self, key: Key) -> None:
        k = fingerprint(key)
        slot = self._slot(key, k)
        if not slot:
            return
        if self._protect:
            self._protect.pop(slot, None)
        self._access(k, self._pkey[slot])
        self._victim = 0

    def seen(self, key: Key, parent: Optional[Key]) -> None:
        self._access(fingerprint(key), fingerprint(parent) if parent is not None else 0)
        self._victim = 0

    def remove(self, key: Key) -> None:
        k = fingerprint(key)
        slot = self._slot(key, k)
        if not slot:
            return
        if not self._s.linked(slot):
            self.experts[self._lead].remove(k)          # the leader holds it: stay in step
        self._s.drop(slot)
        self._keys[slot] = None
        if self._protect:
            self._protect.pop(slot, None)
        self._victim = 0

    def victim(self) -> Optional[Key]:
        if self._victim and self._keys[self._victim] is not None:
            return self._keys[self._victim]
        if not self._s.count:
            return None
        if not self._full:
            self._full = True
            self._size_sketch(fresh=True)
        self._victim = slot = self._find_victim()
        return self._keys[slot] if slot else None

    def _find_victim(self) -> int:
        """The oldest chunk the leader dropped (or never held), else the leader's own
        victim; protected chunks only when nothing else is left."""
        s, protect, tick = self._s, self._protect, self._tick
        if self._rebuild and not s.first(self._EXTRA):
            self._rebuild_step(len(self._keys))         # nothing listed yet: finish now
        slot = s.first(self._EXTRA)
        while slot:
            if not protect or protect.get(slot, -1) < tick:
                return slot
            slot = s.next[slot] if s.next[slot] != self._EXTRA else 0
        v = self.experts[self._lead].victim()
        lead_slot = s.find(v) if v is not None else 0
        if lead_slot and (not protect or protect.get(lead_slot, -1) < tick):
            return lead_slot                            # the tier holds what the leader does
        keys = self._keys
        for slot in range(2, len(keys)):                # some are protected: any other
            if keys[slot] is not None and protect.get(slot, -1) < tick:
                return slot
        if lead_slot:                                   # everything is: the leader's pick
            protect.pop(lead_slot, None)
            return lead_slot
        for slot in range(2, len(keys)):
            if keys[slot] is not None:
                protect.pop(slot, None)
                return slot
        return 0

    def hint_upcoming(self, keys: Iterable[Key]) -> None:
        """``keys`` are what the requests waiting *now* will look up.

        Each call replaces the previous one. Present keys are protected from eviction
        until touched, the next call, or about one capacity of accesses; absent ones
        pass admission and are protected once stored. At most half the capacity is."""
        self._protect.clear()
        self._expect.clear()
        limit = max(1, self._cap // 2)
        until = self._tick + max(1, self._cap)
        for key in keys:
            k = fingerprint(key)
            slot = self._slot(key, k)
            if slot:
                if len(self._protect) < limit:
                    self._protect[slot] = until
            elif len(self._expect) < limit:
                self._expect[k] = until
        self._victim = 0

    def __contains__(self, key: Key) -> bool:
        return self._slot(key, fingerprint(key)) > 0

    def __len__(self) -> int:
        return self._s.count

    @property
    def leader(self) -> str:
        """The expert the tier mirrors now (for benches, logs and tests)."""
        return self.expert_names[self._lead]
