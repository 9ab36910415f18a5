"""``prefix-adaptive``: the recommended eviction and admission policy for KV-chunk tiers.

Runs wherever a tier runs (the vLLM worker's store, or ``cache.tools.replay``), always
under the store's lock. Nothing here blocks: every call is O(1) amortized (a fingerprint,
a few index probes and list splices per expert; see ``cache.policy.slots``), with no
I/O and no sleeping.

Robust by construction: it never bets on one rule. It simulates, on every access and at
the tier's full capacity, a few *experts* (``cache.policy.experts``), each a complete
policy with its own content, and the tier follows the expert that has been serving the
most prefix hits lately:

- ``prefix-lru``: LRU in prefix order (a chain is cut from its tail, a shared root goes
  last). Best when reuse follows recency: multi-turn chat, whose next turn extends
  blocks seen once.
- ``prefix-lru+admission``: the same, refusing first sightings once full (TinyLFU's
  doorkeeper over a window of 10 capacities), with the rest of a refused chain. Best when
  one-off suffixes and scans would flush the reused prefixes. Last tier only.
- ``s3fifo``: S3-FIFO, exactly as the classic policy. Best when popularity is skewed
  and stable (RAG over a Zipf-popular document pool).

Each expert's hits are counted as a request would see them (a chunk counts only when its
whole prefix is present in that expert), from the full access stream: hits (``touch``),
misses (``admit``), and present chunks recomputed after an earlier miss (``seen``). The
tier switches to a challenger when the challenger's lead over the current expert,
sampled in batches of ``BATCH`` accesses and decayed over ``HORIZON`` capacities, exceeds
``Z`` standard errors: a switch needs evidence, so a tie never makes it flap. After a
switch the tier evicts first what the new expert does not hold, so it converges to that
expert's content within one turnover, and its hit ratio to that expert's.

Nothing is fitted to a trace: the experts are published policies with their published
constants, the switch rule is a three-sigma test, and the tier starts with the plainest
expert (``prefix-lru``). The capacity is not given: it is learned as the largest resident
count seen once the store first asks for a victim.

Queue hints (``hint_upcoming``) protect present chunks that waiting requests will load,
and let absent ones in past admission. ``last_tier=False`` (a store's upper tiers, whose
victims are demoted) takes every chunk and follows only the experts without admission.

Memory per tracked chunk: the tier's own index (a key reference, its fingerprint and its
parent's) and the experts' compact tables (each about a capacity of 8-byte keys, links
and index; S3-FIFO's ghosts add 0.9 of one) and the shared frequency sketch: measured by
``tests/test_policy.py`` and ``bench/bench_policy.py`` (10 million chunks in about
1.5 GiB).
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, Iterable, List, Optional

from .base import EvictionPolicy, Key, Offer
from .experts import PrefixLRU, S3FIFO
from .sketch import FrequencySketch
from .slots import Slots, fingerprint


class PrefixAdaptivePolicy(EvictionPolicy):
    """Follows whichever of its experts serves the most prefix hits (module docstring)."""

    name = "prefix-adaptive"
    Z = 3.0                 # standard errors a challenger must lead by to take over
    BATCH = 64              # accesses per evidence sample (a chain's hits come together)
    HORIZON = 16            # evidence decays over this many capacities of accesses
    SKETCH_SAMPLE = 10      # TinyLFU: counters halve every 10 widths of accesses
    PROBES = 64             # slots a victim search looks at before falling back

    def __init__(self, *, last_tier: bool = True) -> None:
        super().__init__(last_tier=last_tier)
        self._s = Slots(extra="ii", links=False)   # per slot: parent slot, children here
        self._parent, self._nchild = self._s.extra
        self._keys: List[Optional[Key]] = [None]   # the store's key objects, by slot
        self._hist = FrequencySketch(64, self.SKETCH_SAMPLE * 64)
        self.experts: List[EvictionPolicy] = [PrefixLRU(last_tier=last_tier), S3FIFO()]
        self.expert_names = ["prefix-lru", "s3fifo"]
        if last_tier:
            self.experts.append(PrefixLRU(history=self._hist))
            self.expert_names.append("prefix-lru+admission")
        k = len(self.experts)
        self._lead = 0
        self._hit = [False] * k                    # each expert's verdict on the last access
        self._acc = [0.0] * k                      # this batch: hits minus the leader's
        self._lead_by = [0.0] * k                  # decayed sums of batch leads ...
        self._lead_sq = [0.0] * k                  # ... and of their squares
        self._nacc = 0
        self.switches = 0
        self._cap = 0
        self._full = False
        self._tick = 0
        self._last = 0                             # fingerprint of the last access
        self._admitted = 0                         # fingerprint of the last admit
        self._gone: Deque[int] = deque()           # fingerprints the leader evicted
        self._cursor = 1
        self._victim = 0
        self._protect: Dict[int, int] = {}         # slot -> tick until which it stays
        self._expect: Dict[int, int] = {}          # absent hinted fingerprint -> tick

        def room(e: EvictionPolicy) -> "callable":
            return lambda: not self._full or len(e) < self._cap

        self._room = [room(e) for e in self.experts]

    # ------------------------------------------------------------------ experts
    def _on_leader_evict(self, k: int) -> None:
        self._gone.append(k)
        if len(self._gone) > 4096:
            self._gone.popleft()

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
                    e.touch(k)
            else:
                h = False
                e.offer(k, parent, 1, self._room[i],
                        evict=self._on_leader_evict if i == self._lead else None)
            hit[i] = h
        self._last = k
        lead = hit[self._lead]
        acc = self._acc
        for i in range(len(experts)):
            acc[i] += hit[i] - lead
        self._nacc += 1
        if self._nacc >= self.BATCH:
            self._weigh()

    def _weigh(self) -> None:
        """One batch of evidence; switch to a challenger that leads by ``Z`` sigmas."""
        self._nacc = 0
        decay = (1.0 - 1.0 / max(1, self.HORIZON * max(self._cap, 64))) ** self.BATCH
        best, best_by = -1, 0.0
        for i, d in enumerate(self._acc):
            self._acc[i] = 0.0
            if i == self._lead:
                continue
            by = self._lead_by[i] = self._lead_by[i] * decay + d
            sq = self._lead_sq[i] = self._lead_sq[i] * decay + d * d
            if by > self.Z * sq ** 0.5 + 1.0 and by > best_by:
                best, best_by = i, by
        if best >= 0:
            self._lead = best
            self.switches += 1
            self._lead_by = [0.0] * len(self.experts)
            self._lead_sq = [0.0] * len(self.experts)
            self._gone.clear()
            self._victim = 0

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
        ps = self._slot(parent, pk) if parent is not None else 0
        slot = s.add(k)
        if slot == len(self._keys):
            self._keys.append(key)
        else:
            self._keys[slot] = key
        self._parent[slot] = ps
        if ps:
            self._nchild[ps] += 1
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
        p = self._parent[slot]
        self._access(k, self._s.key[p] if p else 0)
        self._victim = 0

    def seen(self, key: Key, parent: Optional[Key]) -> None:
        self._access(fingerprint(key), fingerprint(parent) if parent is not None else 0)
        self._victim = 0

    def remove(self, key: Key) -> None:
        k = fingerprint(key)
        slot = self._slot(key, k)
        if not slot:
            return
        s, nchild = self._s, self._nchild
        s.drop(slot, release=nchild[slot] == 0, keep_key=True)  # children still point here
        self._keys[slot] = None
        p = self._parent[slot]
        if p:
            nchild[p] -= 1
            if nchild[p] == 0 and self._keys[p] is None:
                s.release(p)
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
        """A chunk the leading expert does not hold (what it just evicted first), else
        the leader's own victim, else any chunk. A chunk with children here goes after
        them, and protected chunks only when nothing else is left."""
        s, lead, protect, tick = self._s, self.experts[self._lead], self._protect, self._tick
        nchild, gone = self._nchild, self._gone
        while gone:
            k = gone.popleft()
            slot = s.find(k)
            if slot and not nchild[slot] and k not in lead and protect.get(slot, -1) < tick:
                return slot
        keys, n = self._keys, len(self._keys)
        cur, fallback = self._cursor, 0
        for _ in range(min(self.PROBES, n)):
            cur = cur + 1 if cur + 1 < n else 1
            if keys[cur] is None or nchild[cur] or protect.get(cur, -1) >= tick:
                continue
            if s.key[cur] not in lead:
                self._cursor = cur
                return cur
            fallback = fallback or cur
        self._cursor = cur
        v = lead.victim()
        if v is not None:
            slot = s.find(v)
            if slot and not nchild[slot] and protect.get(slot, -1) < tick:
                return slot
        if fallback:
            return fallback
        live = 0
        for _ in range(min(n, 64 * self.PROBES)):       # rare: a longer, bounded look
            cur = cur + 1 if cur + 1 < n else 1
            if keys[cur] is not None:
                live = live or cur
                if not nchild[cur]:
                    self._cursor = cur
                    protect.pop(cur, None)              # everything near is protected
                    return cur
        return live

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
        """The expert the tier follows now (for benches, logs and tests)."""
        return self.expert_names[self._lead]
