"""``prefix-adaptive``: the recommended eviction and admission policy for KV-chunk tiers.

Runs wherever a tier runs (the vLLM worker's store, or ``cache.tools.replay``), always
under the store's lock. Nothing here blocks: every call is O(1) amortized (a fingerprint,
a few index probes and list splices per policy; see ``cache.policy.slots``), with no
I/O and no sleeping.

Robust by construction: it never bets on one rule. A panel of *experts*
(``cache.policy.panel``), each a complete policy with its own content, is simulated on
every access, and the tier *mirrors* the expert that has been serving the most prefix
hits lately (the leader): it admits what the leader admits and evicts what the leader
evicted, so its content, and with it its hit ratio, is the leader's.

- ``prefix-lru``: LRU in prefix order (a chain is cut from its tail, a shared root goes
  last). Best when reuse follows recency: multi-turn chat, whose next turn extends
  blocks seen once.
- ``arc`` and ``s3fifo``: ARC and S3-FIFO exactly as the classic policies (a test checks
  that they decide the same). Best when popularity is skewed and stable (RAG over a
  Zipf-popular document pool, a hot set under scans).
- ``prefix-lru+admission``: prefix LRU refusing first sightings once full (TinyLFU's
  doorkeeper over a window of 10 capacities), with the rest of a refused chain. Best when
  one-off suffixes would flush the reused prefixes. Last tier only.

Each expert's hits are counted as a request would see them, from the full access stream:
hits (``touch``), misses (``admit``), and present chunks recomputed after an earlier miss
(``seen``); the panel switches leaders on a one-standard-error test with hysteresis.

Up to ``ExpertPanel.SAMPLED_SLOTS`` chunks of capacity the experts are simulated exactly
and at full scale, and the leader expert *is* the tier's policy: after a switch the tier
keeps the chunks it holds and the new leader does not in one list, in the order the
leader dropped them (``_extra``), evicts from it first, and rebuilds that list
incrementally (``REBUILD`` slots per access), so it converges to the new leader's
content within one turnover without an O(n) pass. Beyond that capacity the experts are
miniature simulations over a spatial sample of the chunks (SHARDS; see
``cache.policy.panel``), and the tier runs a full-scale twin of the leader (``_actor``)
on every access: its own admission and eviction. After a switch a fresh full-scale policy
of the new leader's kind takes over; the former one drains as it fills, in its own
eviction order, a new chunk displacing the colder (by the frequency sketch) of the
former's next victim and the new one's own. A new policy starts cold, so a switch costs
more here than between exact experts (``cache.policy.panel`` has the measured cost).

Nothing is fitted to a trace: the experts are published policies with their published
constants, the switch rule is a standard-error test (the tier's worst case is
bounded by the best expert less the turnovers its switches cost, not by a fitted
threshold; ``cache.policy.panel`` says why half a standard error while exact), and a
last tier starts with ``prefix-lru+admission`` (an upper tier with ``prefix-lru``). The capacity
is not given: it is learned as the largest resident count seen once the store first
asks for a victim.

Queue hints (``hint_upcoming``) protect present chunks that waiting requests will load,
and let absent ones in past admission. ``last_tier=False`` (a store's upper tiers, whose
victims are demoted) takes every chunk and follows only the experts without admission.

Memory per tracked chunk: the tier's own index (a key reference, its fingerprint and its
parent's, a list link), one full-scale policy (about a capacity of 8-byte keys, links and
index; ARC's and S3-FIFO's ghosts add about one more) and the frequency sketch, plus the
experts' fixed cost (about ``SAMPLED_SLOTS`` entries each, whatever the tier's size):
about 100 bytes per tracked chunk plus 34 MiB, i.e. about 1 GiB for 10 million chunks
(``tests/test_policy.py`` and ``bench/bench_policy.py`` measure it). While exact, the
four experts hold every chunk: about 190 bytes per tracked chunk, at most about 24 MiB.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

from .base import EvictionPolicy, Key
from .experts import Compact
from .panel import ExpertPanel
from .sketch import FrequencySketch
from .slots import Slots, fingerprint


class PrefixAdaptivePolicy(EvictionPolicy):
    """Mirrors whichever of its experts serves the most prefix hits (module docstring)."""

    name = "prefix-adaptive"
    SKETCH_SAMPLE = 10  # TinyLFU: counters halve every 10 widths of accesses
    REBUILD = 8  # tier slots re-checked per access after a switch
    _EXTRA = 1  # the list of chunks the leader does not hold (sentinel)

    def __init__(self, *, last_tier: bool = True) -> None:
        super().__init__(last_tier=last_tier)
        self._s = Slots(lists=1, extra="q")  # per slot: the parent's fingerprint
        (self._pkey,) = self._s.extra
        self._keys: List[Optional[Key]] = [None, None]  # the store's key objects, by slot
        self._hist = FrequencySketch(64, self.SKETCH_SAMPLE * 64)
        self.panel = ExpertPanel(last_tier=last_tier, history=self._hist)
        self._actor: Optional[Compact] = None  # the leader at full scale, once sampled
        self._ahit = False  # its verdict on the last access
        self._olds: List[Compact] = []  # former actors, drained first
        self._cap = 0
        self._full = False
        self._tick = 0
        self._admitted = 0  # fingerprint of the last admit
        self._rebuild = 0  # next slot to re-check after a switch
        self._victim = 0
        self._protect: Dict[int, int] = {}  # slot -> tick until which it stays
        self._expect: Dict[int, int] = {}  # absent hinted fingerprint -> tick

    @property
    def switches(self) -> int:
        return self.panel.switches

    @property
    def leader(self) -> str:
        """The expert the tier mirrors now (for benches, logs and tests)."""
        return self.panel.names[self.panel.lead]

    # ------------------------------------------------------------------ experts
    def _lead_policy(self) -> EvictionPolicy:
        """The policy whose content the tier mirrors: the leading expert itself while
        the experts are exact, its full-scale twin (``_actor``) once they are sampled."""
        a = self._actor
        return a if a is not None else self.panel.experts[self.panel.lead]

    def _on_leader_evict(self, k: int) -> None:
        """The leader dropped ``k``: if the tier holds it, it is next in line."""
        slot = self._s.find(k)
        if slot and not self._s.linked(slot):
            self._s.link_before(slot, self._EXTRA)

    def _access(self, k: int, pk: int) -> None:
        """The experts, and the full-scale leader once they are sampled, serve one access
        of fingerprint ``k`` (parent ``pk``, 0: none)."""
        self._tick += 1
        self._hist.add(k)
        panel, a = self.panel, self._actor
        if a is None:
            panel.access(k, pk, self._on_leader_evict)
            a = panel.experts[panel.lead]
        else:
            held = k in a
            if not held:
                migrate = bool(self._olds) and any(k in o for o in self._olds)
                a.offer(k, pk or None, 1, self._actor_room, evict=self._on_leader_evict)
                held = migrate and k in a  # a former leader's chunk, used again:
            if held:  # the new one learns it as a reuse
                h = not pk or (self._ahit if pk == panel.last else pk in a)
                if h:
                    a.touch(k)
            else:
                h = False
            self._ahit = h
            if self._olds and k in a:
                self._forget_old(k)  # the new leader holds it now
            panel.access(k, pk)
        slot = self._s.find(k)
        if slot and self._s.linked(slot) and k in a:
            self._s.unlink(slot)  # the leader holds it again
        if self._rebuild:
            self._rebuild_step()
        if panel.nacc >= panel.BATCH and panel.weigh():
            self._switched()

    def _actor_room(self) -> bool:
        """Whether the full-scale leader may grow without evicting. While former
        leaders still hold part of a full tier, a new chunk displaces the colder (by
        the frequency sketch, as TinyLFU's duel) of their next victim and its own."""
        a = self._actor
        assert a is not None  # (the reserve of the full-scale leader's own offers)
        if not self._full or len(a) >= self._cap:
            return not self._full
        if not self._olds or self._s.count < self._cap:
            return True
        mine, theirs = a.victim(), self._olds[0].victim()
        if mine is None or theirs is None:
            return mine is None
        return self._hist.estimate(theirs) <= self._hist.estimate(mine)

    def _switched(self) -> None:
        """The panel named a new leader. Exact experts: the tier re-checks its chunks
        against it (``REBUILD`` a step). Sampled: a fresh full-scale policy of the new
        leader's kind takes every chunk accessed from now on (a chunk of the former one
        used again comes over as a reuse), and the former one drains as the new one
        fills (``_actor_room``), in its own eviction order, so the tier turns over to the
        new policy within about a turnover and without an O(n) pass."""
        if self._actor is None:
            self._rebuild = 2  # slot 1 is the list's sentinel
        else:
            self._olds.append(self._actor)
            self._actor = self.panel.make(self.panel.lead)
            self._size_actor()
        self._victim = 0

    def _forget_old(self, k: int) -> None:
        for o in self._olds:
            o.forget(k)
        if not all(len(o) for o in self._olds):
            self._drop_empty_olds()

    def _drop_empty_olds(self) -> None:
        self._olds = [o for o in self._olds if len(o)]
        if not self._olds:
            self._size_actor()  # drained: the usual capacity again

    def _rebuild_step(self, steps: int = 0) -> None:
        """Re-check ``REBUILD`` tier slots against the new leader: a chunk it does not
        hold (nor a former leader being drained) joins the eviction list, one it holds
        leaves it."""
        s, keys, lead, olds = self._s, self._keys, self._lead_policy(), self._olds
        i, n = self._rebuild, len(keys)
        end = min(n, i + (steps or self.REBUILD))
        for slot in range(i, end):
            if keys[slot] is None:
                continue
            k = s.key[slot]
            held = k in lead or any(k in o for o in olds)
            if held and s.linked(slot):
                s.unlink(slot)
            elif not held and not s.linked(slot):
                s.link_before(slot, self._EXTRA)
        self._rebuild = 0 if end >= n else end

    def _resize(self, fresh: bool = False) -> None:
        """The capacity grew, or the tier is first full (``fresh``): tell the panel,
        and once full size the frequency sketch as TinyLFU does (a power of two of
        counters at least the capacity, halved every 10 capacities of accesses): when
        the tier is first full, then only when the capacity outgrows it. The sketch
        counts every access; the sampled admission expert reads its sampled keys there."""
        panel = self.panel
        sampled = panel.shift
        panel.resize(self._cap, self._full)
        if panel.shift and not sampled:
            self._actor = panel.detach_leader(self._hist)
        if not self._full:
            return
        if fresh or self._cap > self._hist.w:
            w = 1 << max(6, (self._cap - 1).bit_length())
            self._hist = FrequencySketch(w, self.SKETCH_SAMPLE * self._cap)
        if panel.admission is not None:
            adm = panel.experts[panel.admission]
            adm.history, adm.capacity = self._hist, panel.scap
        self._size_actor()

    def _size_actor(self) -> None:
        """The full-scale leader's admission filter (if it has one) reads the tier's
        sketch and applies once the tier is full: at once while it starts empty next to
        former leaders still holding the tier (a capacity of one), else at capacity."""
        a = self._actor
        if a is not None and getattr(a, "history", None) is not None and self._full:
            a.history, a.capacity = self._hist, 1 if self._olds else self._cap

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
            return True  # a queued request needs it
        return k in self._lead_policy()

    def insert(self, key: Key, parent: Optional[Key], size: int) -> None:
        k = fingerprint(key)
        if self._slot(key, k):
            return
        pk = fingerprint(parent) if parent is not None else 0
        if k != self._admitted:
            self._access(k, pk)  # taught without an admit (restart)
        self._admitted = 0
        s = self._s
        slot = s.add(k)
        if slot == len(self._keys):
            self._keys.append(key)
        else:
            self._keys[slot] = key
        self._pkey[slot] = pk
        if k not in self._lead_policy():
            s.link_before(slot, self._EXTRA)  # stored against the leader's advice
        if self._expect:
            until = self._expect.pop(k, -1)
            if until >= self._tick:
                self._protect[slot] = until
        if s.count > self._cap:
            self._cap = s.count
            self._resize()
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
            self._lead_policy().remove(k)  # the leader holds it: stay in step
            if self._olds:
                self._forget_old(k)
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
            self._resize(fresh=True)
        self._victim = slot = self._find_victim()
        return self._keys[slot] if slot else None

    def _find_victim(self) -> int:
        """The oldest chunk the leader dropped (or never held), else the leader's own
        victim; protected chunks only when nothing else is left."""
        s, protect, tick = self._s, self._protect, self._tick
        if self._rebuild and not s.first(self._EXTRA):
            self._rebuild_step(len(self._keys))  # nothing listed yet: finish now
        slot = s.first(self._EXTRA)
        while slot:
            if not protect or protect.get(slot, -1) < tick:
                return slot
            slot = s.next[slot] if s.next[slot] != self._EXTRA else 0
        while self._olds:  # then a former leader's, in its order
            old = self._olds[0]
            v = old.victim()
            if v is None:
                self._olds[0:1] = []
                self._drop_empty_olds()
                continue
            slot = s.find(v)
            if not slot or s.linked(slot) or (self._actor is not None and v in self._actor):
                old.forget(v)  # not the tier's to drain here
                continue
            if not protect or protect.get(slot, -1) < tick:
                return slot
            break
        v = self._lead_policy().victim()
        lead_slot = s.find(v) if v is not None else 0
        if lead_slot and (not protect or protect.get(lead_slot, -1) < tick):
            return lead_slot  # the tier holds what the leader does
        keys = self._keys
        for slot in range(2, len(keys)):  # some are protected: any other
            if keys[slot] is not None and protect.get(slot, -1) < tick:
                return slot
        if lead_slot:  # everything is: the leader's pick
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
