"""The writer thread's work: new entries, promotions, demotions and copies down to disk.

Runs on the store's one writer thread (``cache.store.background``), in submission order, so
a chain's parent is always stored before its child; ``copy_up`` is the one entry point
called from another thread (it waits for the writer). It blocks on tier I/O. The policies
and the ``SharedAdmission`` are touched under the store's ``lock``, held for policy calls
only (microseconds), never across I/O.

To store an entry in local tier ``i``, the tier's policy decides (``decide``: admit or
not; ``evict_next``: the next victim while the tier lacks room), ``cache.store.placement``
turns each decision into a ``Plan`` (demote this victim to the tier below, publish that
one, drop, keep a pinned one) and ``run`` carries the plan out. Tier failures never
escape: they are counted by ``Accounting``.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence

from cache.admission import SharedAdmission
from cache.codec import CorruptEntry, decode, encode_header, read_header
from cache.pins import PinBook
from cache.policy import Decision, EvictionPolicy
from cache.store.accounting import Accounting
from cache.store.background import Background
from cache.store.placement import Layout, Plan, place_new, place_pinned, place_victims
from cache.store.publisher import Publisher
from cache.tiers.base import Buffer, Tier


class TierWriter:
    """Carries out placement plans over the local tiers of one writer store."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        layout: Layout,
        policies: Sequence[EvictionPolicy],
        lock: threading.Lock,
        admission: SharedAdmission,
        account: Accounting,
        publisher: Optional[Publisher],
        background: Background,
        namespace: bytes,
        signing_key: bytes,
        pins: Optional[PinBook] = None,
    ) -> None:
        self.tiers, self.layout, self.policies = list(tiers), layout, list(policies)
        self.lock, self.admission, self.account = lock, admission, account
        self.publisher, self.background = publisher, background
        self.namespace, self.signing_key = namespace, signing_key
        self.pins = pins  # pinned prefixes (``held(key)``): eviction passes them over

    # -- what the writer thread is given ----------------------------------------------
    def write_new(
        self,
        key: str,
        parent: Optional[str],
        dtype: str,
        shape: tuple,
        payload: Buffer,
        shared: bool = False,
        ready: Optional[Callable[[], None]] = None,
        borrowed: bool = False,
    ) -> None:
        """A newly computed entry (``TieredStore.put``): encoded, placed, published."""
        if ready is not None:
            ready()
        header = encode_header(self.namespace, key, dtype, shape, payload, self.signing_key, parent)
        n_local = self.layout.n_local
        holder = next((i for i in range(n_local) if self.tiers[i].contains(key)), None)
        nbytes = len(header) + memoryview(payload).nbytes
        plan_local = place_new(self.layout, key, nbytes, holder, publish=False)
        if plan_local.write is not None:
            self.store(plan_local.write, key, parent, [header, payload])
        elif plan_local.seen is not None:
            with self.lock:  # stored, but computed again: an access that missed
                self.policies[plan_local.seen].seen(key, parent)
        elif plan_local.refuse is not None:
            self.account.note(key, "not_admitted", self.tiers[plan_local.refuse].name)
        with self.lock:
            admitted = self.admission.on_put(key)
        if place_new(self.layout, key, nbytes, holder, publish=shared or admitted).publish:
            self.publish(key, [header, bytes(memoryview(payload).cast("B")) if borrowed else payload])

    def promote(self, top: int, key: str, raw: Optional[Buffer], parent: Optional[str], source: int) -> None:
        """Copy ``key`` up into local tier ``top`` from tier ``source`` (``raw``: its whole
        entry, or None to read it there again)."""
        if not self.tiers[top].contains(key):
            if raw is None:  # read into the caller's buffers: read the file again
                raw = self.read_local(source, key)
                if raw is None:
                    return
            self.store(top, key, parent, [raw])
            self.account.tier(self.tiers[top].name).promotions += 1

    def share_from(self, i: int, key: str) -> None:
        """Publish the entry local tier ``i`` holds (just verified by a placed read)."""
        raw = self.read_local(i, key)
        if raw is not None:
            self.publish(key, [raw])

    def share_local(self, key: str) -> None:
        """Publish the first sound local copy of ``key`` (a pinned prefix; ``cache.pins``)."""
        for tier in self.tiers[: self.layout.n_local]:
            try:
                raw = tier.read(key)
                decode(raw, self.namespace, key, self.signing_key)  # others will trust it
            except (KeyError, CorruptEntry):
                continue
            self.publish(key, [raw])
            return

    def copy_down(self, key: str) -> None:
        """Durability: copy ``key`` from an upper local tier into the last one."""
        last = self.layout.n_local - 1
        if self.tiers[last].contains(key):
            return
        for i in range(last):
            raw = self.read_local(i, key)
            if raw is None:
                continue
            try:  # the header only: every read verifies the whole entry anyway
                parent = read_header(raw, self.namespace, key).parent
            except CorruptEntry:
                return  # the next read drops it
            if self.store(last, key, parent, [raw]):
                self.account.tier(self.tiers[last].name).persisted += 1
            return

    def publish(self, key: str, parts: list) -> None:
        if self.publisher is not None:
            self.publisher.publish(key, parts)

    # -- one local tier ------------------------------------------------------------------
    def store(self, i: int, key: str, parent: Optional[str], parts: list, force: bool = False) -> bool:
        """Write into local tier ``i`` if its policy admits it (``force``: whatever it says),
        evicting (and demoting) to make room. True once stored."""
        tier = self.tiers[i]
        st = self.account.tier(tier.name)
        nbytes = sum(memoryview(p).nbytes for p in parts)
        if tier.capacity is not None and nbytes > tier.capacity:
            st.rejected += 1
            self.account.note(key, "not_admitted", tier.name)
            return False
        kept: list[str] = []  # pinned victims passed over, back in the policy after
        try:
            outcome = self._place(i, key, parent, parts, nbytes, force or self.pinned(key), kept)
        except Exception as e:  # the folder unusable (read-only, I/O error ...): a failed write
            self.account.failed(tier, "writing", key, e)
            return False
        finally:
            self._restore(i, kept, nbytes)
        if outcome == "stored":
            st.writes += 1
            st.bytes_written += nbytes
            self.account.note(key, "stored", tier.name)
        elif outcome != "not written":
            st.rejected += 1
            self.account.note(key, "not_admitted", tier.name)
        return outcome == "stored"

    def _place(
        self, i: int, key: str, parent: Optional[str], parts: list, nbytes: int, force: bool, kept: list[str]
    ) -> str:
        """admit -> make room (a plan per victim) -> write -> insert: ``stored``, ``refused``,
        ``no room`` or ``not written`` (the write failed or found the key present)."""
        tier, policy = self.tiers[i], self.policies[i]
        with self.lock:
            if not policy.decide(key, parent, nbytes, force).admit:
                return "refused"
        rescanned = False
        while not tier.reserve(nbytes, key):
            with self.lock:
                decision = policy.evict_next()
            if decision.victims:
                self.run(i, self.plan_victims(i, decision), kept)
                continue
            pinned_plan = place_pinned(self.layout, i, kept)  # only pinned entries were left
            if pinned_plan.demote and self.demote_pinned(i, pinned_plan.demote[0][0]):
                kept.pop(0)
                continue
            if rescanned:
                return "no room"
            self.adopt(i, skip=kept)  # entries the policy never saw (another process wrote them)
            rescanned = True
        self._restore(i, kept, nbytes)  # before the new entry, which the policy inserts after the write
        try:
            published = tier.write(key, parts, nbytes)
        except Exception as e:
            self.account.failed(tier, "writing", key, e)
            return "not written"
        self.account.succeeded(tier.name)
        if not published:
            return "not written"
        with self.lock:
            policy.insert(key, parent, nbytes)
        return "stored"

    def plan_victims(self, i: int, decision: Decision) -> Plan:
        """Local tier ``i``'s eviction decision as a plan, asking the tiers and the admission rule."""
        return place_victims(
            self.layout,
            i,
            decision,
            self.pinned,
            below_holds=lambda v: self.tiers[i + 1].contains(v),
            to_shared=self._to_shared,
        )

    def evict(self, i: int, key: str) -> None:
        """Evict ``key`` from local tier ``i`` now, as if its policy had chosen it (a pinned
        entry stays). Blocks on I/O: the writer thread, or a test."""
        plan = self.plan_victims(i, Decision(victims=(key,)))
        if not plan.keep:
            self.forget(i, key)
            self.run(i, plan, [])

    def run(self, i: int, plan: Plan, kept: list[str]) -> None:
        """Carry out an eviction plan of local tier ``i``: victims leave it (``kept`` gains
        the pinned ones, restored into the policy once the write is done)."""
        kept.extend(plan.keep)
        for victim in plan.drop:
            self._evict(i, victim, None)
        for victim, below in plan.demote:
            self._evict(i, victim, below)
        for victim in plan.publish:
            self._evict(i, victim, -1)

    def _evict(self, i: int, victim: str, to: Optional[int]) -> None:
        """Remove ``victim`` from local tier ``i``; hand its bytes to local tier ``to``, or
        (``to`` -1) to the shared tier, or (None) nowhere."""
        tier = self.tiers[i]
        raw = None
        if to is not None:
            try:
                raw = tier.read(victim)  # (an mmap stays valid after the unlink below)
            except KeyError:
                raw = None
        tier.delete(victim)
        self.account.tier(tier.name).evictions += 1
        self.account.note(victim, "evicted", tier.name)  # (a demotion below then notes "stored")
        if raw is None:
            return
        try:  # a shared entry is verified in full: other nodes will trust its checksum
            info = (
                decode(raw, self.namespace, victim, self.signing_key)[0]
                if to == -1
                else read_header(raw, self.namespace, victim)
            )
        except CorruptEntry:
            return
        if to == -1:
            self.publish(victim, [raw])
            self.account.tier(tier.name).demotions += 1
        elif to is not None and self.store(to, victim, info.parent, [raw]):
            self.account.tier(tier.name).demotions += 1

    def _to_shared(self, victim: str) -> bool:
        """Whether a victim of the last local tier goes to the shared tier (the admission rule)."""
        with self.lock:
            wanted = self.admission.on_evict(victim)
        return wanted and self.publisher is not None and not self.publisher.tier.contains(victim)

    def _restore(self, i: int, kept: Sequence[str], nbytes: int) -> None:
        with self.lock:
            for k in kept:
                if k not in self.policies[i]:
                    self.policies[i].insert(k, None, nbytes)

    def pinned(self, key: str) -> bool:
        """Whether ``key`` is pinned now (``cache.pins``): never evicted, only demoted."""
        return self.pins is not None and self.pins.held(key)

    def demote_pinned(self, i: int, key: str) -> bool:
        """Move a pinned entry from local tier ``i`` to the next one: stored there first,
        removed here only then (a pinned entry is never dropped)."""
        tier, below = self.tiers[i], self.tiers[i + 1]
        try:
            raw = tier.read(key)
            parent = read_header(raw, self.namespace, key).parent
        except (KeyError, CorruptEntry):
            return True  # gone meanwhile, or damaged: nothing to keep
        if not (below.contains(key) or self.store(i + 1, key, parent, [raw])):
            return False
        tier.delete(key)
        self.account.tier(tier.name).demotions += 1
        self.account.note(key, "evicted", tier.name)  # (moved: stored below first)
        return True

    def read_local(self, i: int, key: str) -> Optional[Buffer]:
        """Local tier ``i``'s whole entry for ``key``, or None (gone, or the read failed)."""
        try:
            return self.tiers[i].read(key)
        except KeyError:
            return None
        except Exception as e:
            self.account.failed(self.tiers[i], "reading", key, e)
            return None

    def forget(self, i: int, key: str) -> None:
        with self.lock:
            self.policies[i].remove(key)

    def adopt(self, i: int, skip: Sequence[str] = ()) -> None:
        """Teach tier ``i``'s policy the entries already there (restart, other engines),
        but those in ``skip``."""
        for key, size in self.tiers[i].scan():
            with self.lock:
                if key not in self.policies[i] and key not in skip:
                    self.policies[i].insert(key, None, size)
