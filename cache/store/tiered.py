"""TieredStore: longest-prefix lookup over tiers, promote on hit, demote on evict, write-behind.

Engine-agnostic (no vLLM, no torch). ``cache.assembly`` builds one store per role:
- in the vLLM scheduler, a *lookup-only* view per rank answers ``lookup`` (cheap
  ``contains`` checks, no I/O threads, no policy) and ``probe`` (starts background
  existence checks on the shared tier);
- in each vLLM worker (and the tools), a *writer* store runs ``get``/``get_async`` and
  ``put``; it owns the I/O threads and one eviction policy per local tier.

Local tiers (DRAM, disk) form a hierarchy: writes go to the top (the first tier that
can hold the entry at all), evictions demote down, hits promote back to the top.
A *shared* tier (``tier.shared``, L3 on Curvine; at most
one, last) is not part of that hierarchy: its space is the backend's, nothing is evicted
from it, and chunks are *published* to it by ``SharedAdmission``: by default a chunk
used a second time (hit in a local tier, computed again, or evicted after a hit), or one
marked shared (``put(..., shared=True)``). Publishing runs on its own thread, in
batches, so the network never delays local writes or requests.

All tiers hold the same encoded bytes for a key (``cache.codec``, signed when a signing
key is set), so promotion, demotion and publishing copy bytes without re-encoding. Every
entry read is verified before it is returned; a damaged or foreign entry is a miss:
deleted from a local tier, ignored (never deleted) on the shared one.

Threads: ``put`` and ``get_async`` return at once; reads run on ``io_threads``
threads, local writes on one writer thread in submission order, publishes on one
publisher thread. The policy structures are guarded by one lock, held only for policy
calls (microseconds), never across I/O. Tier failures never escape: they are counted in
``stats`` and logged at most once a minute per tier (the shared tier logs its own
outages, once each); a failed write is counted by cause and logged once per episode
(``cache.faults``).

Durability (``cache.durability``): chunks used again (``persist``) are also copied down
to the last local tier in the background, so a new container finds them on disk.
``close`` flushes what it can within its budget.

The parts, one module each: ``reads`` (verified reads, what a hit sets going),
``placement`` (a policy's decision turned into a plan, pure), ``writer`` (the writer
thread carries plans out), ``publisher`` (the shared tier's queue), ``accounting``
(statistics, failures, chunk events), ``background`` (the threads). This module wires
them and is what callers use.

Callers use the operations below, never the tiers: ``counters``/``levels`` for metrics,
``note_loaded`` for tokens served, ``recheck_shared``/``reject_shared`` for what the
scheduler learns, ``describe`` for logs. ``timer``, if set, is called as
``timer(step, seconds)`` for each tier read (``"read"``) and entry check (``"decode"``)
of ``get``, on the thread that ran them (benchmarks: ``bench/timed_connector.py``).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Callable, Optional, Sequence

from cache.admission import SharedAdmission
from cache.durability import CopyQueue
from cache.pins import PinBook
from cache.placed import BlockWriters, Place
from cache.policy import EvictionPolicy
from cache.store.accounting import Accounting, EventSink, StoreStats
from cache.store.background import Background
from cache.store.idle_gate import IdleGate
from cache.store.placement import Layout
from cache.store.publisher import Publisher
from cache.store.reads import ELSEWHERE, Entry, Reads, Timer
from cache.store.writer import TierWriter
from cache.tiers.base import Buffer, Tier
from cache.tiers.identity import TierId

log = logging.getLogger("cache.store")


class TieredStore:
    def __init__(
        self,
        tiers: Sequence[Tier],
        namespace: bytes,
        policies: Optional[Sequence[EvictionPolicy]] = None,
        signing_key: bytes = b"",
        io_threads: int = 2,
        max_pending_bytes: int = 1 << 30,
        shared_admission: str = "reused",
        max_publish_bytes: int = 256 << 20,
        max_persist_keys: int = 4096,
        thread_setup: Optional[Callable[[str], None]] = None,
        timer: Optional[Timer] = None,
        on_event: Optional[EventSink] = None,
        pins: Optional[PinBook] = None,
        gate: Optional[IdleGate] = None,
    ) -> None:
        """``policies`` given (one per tier; the shared tier's, if any, is not used) makes
        a writer store; None a lookup-only one. ``thread_setup(role)`` runs first on each
        of its threads ("read", "write", "publish"; see ``cache.threads``). ``on_event(key,
        event, tier)``: what happened to a chunk (``cache.explain``); ``pins``: pinned
        prefixes eviction passes over (``cache.pins``), ``gate`` (``cache.store.idle_gate``)."""
        self.tiers = list(tiers)
        shared = [i for i, t in enumerate(self.tiers) if t.shared]
        if shared and shared != [len(self.tiers) - 1]:
            raise ValueError("at most one shared tier, and it must be the last")
        self.shared: Optional[Tier] = self.tiers[-1] if shared else None
        self.n_local = len(self.tiers) - len(shared)
        self._by_id = [(t, t.id) for t in self.tiers]  # each tier and its identity, for lookups
        self.layout = Layout(tuple(t.capacity for t in self.tiers[: self.n_local]), self.shared is not None)
        self.namespace = namespace
        self.signing_key = signing_key
        self.policies = list(policies) if policies is not None else None
        if self.policies is not None and len(self.policies) not in (len(self.tiers), self.n_local):
            raise ValueError("one policy per tier")
        self.admission = SharedAdmission(shared_admission)
        self.account = Accounting([t.name for t in self.tiers], on_event)
        self._lock = threading.Lock()  # the policies and the admission rule
        self._closing = False  # close() began: copy_up copies nothing more
        self._background: Optional[Background] = None
        self.writer: Optional[TierWriter] = None
        if self.policies is not None:
            bg = Background(io_threads, self.shared is not None, thread_setup, max_pending_bytes, gate)
            self._background = bg
            publisher = (
                Publisher(self.shared, self.account, bg.publish, max_publish_bytes) if self.shared is not None else None
            )
            self.writer = TierWriter(
                self.tiers,
                self.layout,
                self.policies,
                self._lock,
                self.admission,
                self.account,
                publisher,
                bg,
                namespace,
                signing_key,
                pins,
            )
            for i in range(self.n_local):
                self.writer.adopt(i)
        self.reads = Reads(
            self.tiers,
            self.layout,
            namespace,
            signing_key,
            self.account,
            self._lock,
            self.admission,
            self.writer,
            self._background,
            timer,
        )
        # Keys used again, to copy down to the last local tier (none with one local tier).
        self._copies = (
            CopyQueue(max_persist_keys, self._background.write, self.writer.copy_down)
            if self.writer is not None and self._background is not None and self.n_local >= 2
            else None
        )

    # -- collaborators -----------------------------------------------------------
    @property
    def stats(self) -> StoreStats:
        return self.account.stats

    # ``on_event`` and ``timer`` are given to the constructor; a benchmark's timer comes once
    # the engine built the store (``WorkerSide.set_timer``).
    def set_timer(self, timer: Optional[Timer]) -> None:
        self.reads.timer = timer

    @property
    def pins(self) -> Optional[PinBook]:
        return self.writer.pins if self.writer is not None else None

    # -- lookup (scheduler path: cheap, never reads payloads) -----------------
    def lookup(self, keys: Sequence[str], local_only: bool = False) -> list[TierId]:
        """The first tier (its ``TierId``) holding each leading chunk found, stopping at the
        first miss. The shared tier answers from memory (what it knows so far; see ``probe``)."""
        tiers = self._by_id[: self.n_local] if local_only else self._by_id
        found: list[TierId] = []
        for key in keys:
            for tier, tier_id in tiers:
                if tier.contains(key):
                    found.append(tier_id)
                    break
            else:
                break
        return found

    def probe(self, keys: Sequence[str]) -> bool:
        """Ask the shared tier, in the background, whether it holds the chain ``keys``;
        True while answers are pending (``lookup`` will know more later). Never blocks."""
        return self.shared.probe(keys) if self.shared is not None else False

    # -- reads (``cache.store.reads``) ---------------------------------------------
    def get(self, key: str, promote: bool = True) -> Optional[Entry]:
        """The verified entry from the highest tier holding it, or None. Blocks on I/O
        (a shared-tier read at most its deadline)."""
        return self.reads.get(key, promote)

    def get_async(self, key: str) -> Future:
        """``get`` on an I/O thread."""
        return self._bg().read(self.get, key)

    def get_into(self, key: str, place: Place, writers: Optional[BlockWriters] = None, local_only: bool = False):
        """Like ``get``, for tiers that read entries in place (files, local or shared):
        the payload is read straight into the buffers ``place(info)`` returns and
        verified there (``cache.placed``). Returns ``(tier, info)``, ``tier`` the ``TierId``
        read from; None when no tier holds a sound entry (a miss, counted; after a damaged
        entry the buffers hold garbage); ``ELSEWHERE`` when a tier that cannot (or, ``local_only``, the
        shared tier) may hold it: the caller then uses ``get`` or another thread.
        ``writers``: the load's ``BlockWriters``; once closed, nothing more is written
        into its buffers (``LoadEnded``). An entry that does not fit the caller
        (``place`` raised ``ValueError``) raises ``Misfit``; it is kept. Blocks on
        file I/O, and on the shared tier's reads (within its deadline; a shared read
        writes into the buffers only a piece at a time, while ``writers`` admits it)."""
        found = self.reads.find_in_place(key, place, writers, local_only, whole=True)
        return found if found is None or found is ELSEWHERE else (found.tier, found.read.info)

    def read_layers(self, key: str, place: Place, writers: BlockWriters, local_only: bool = False):
        """``get_into`` a part at a time (``PartRead``: an entry's layers), for a load
        that hands each layer over while the next is read: finds the entry and reads its
        first part into ``place(info)``; ``EntryRead.step`` reads each next one, the last
        verifies the whole entry. Returns an ``EntryRead``, None (a miss) or ``ELSEWHERE``
        (as ``get_into``); raises ``LoadEnded`` and ``Misfit`` as ``get_into`` does."""
        return self.reads.find_in_place(key, place, writers, local_only, whole=False)

    def run_read(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on an I/O thread (work that calls ``get``/``get_into``)."""
        return self._bg().read(fn, *args)

    # -- writes (write-behind; ``cache.store.writer``) ---------------------------------
    def put(
        self,
        key: str,
        parent: Optional[str],
        dtype: str,
        shape: Sequence[int],
        payload: Buffer,
        shared: bool = False,
        on_done: Optional[Callable[[str], None]] = None,
        ready: Optional[Callable[[], None]] = None,
        borrowed: bool = False,
    ) -> bool:
        """Queue ``payload`` for the top tier; returns at once. The caller must not
        change ``payload`` afterwards. ``shared`` publishes it to the shared tier too,
        whatever the admission rule (a prefix marked shared, e.g. by the warm tool).
        False when the queue is full (the entry is dropped: a future miss, never a
        stall). ``on_done(key)`` runs once the write is settled (stored, refused by
        the policy, failed or dropped), on the writer thread or, when dropped, here.
        ``ready()``, if given, returns once ``payload`` holds its bytes (a device copy
        still in flight); the writer thread calls it before reading them. ``borrowed``:
        the caller reuses ``payload`` once ``on_done`` ran (a staging slot), so a publish
        to the shared tier, queued past the write, takes a copy."""
        writer = self.writer
        assert writer is not None, "lookup-only store"
        settled = (lambda: on_done(key)) if on_done is not None else (lambda: None)
        args = (key, parent, dtype, tuple(shape), payload, shared, ready, borrowed)
        if self._bg().write_bounded(memoryview(payload).nbytes, settled, writer.write_new, *args):
            return True
        with self._lock:
            self.stats.dropped_writes += 1
        self.account.note(key, "not_admitted", "all")
        settled()
        return False

    def share(self, key: str) -> None:
        """Publish ``key``'s local entry to the shared tier now, whatever the admission rule
        (a pinned prefix; ``cache.pins``). Returns at once; nothing if no local tier has it."""
        if self.shared is not None and self.writer is not None and self._background is not None:
            self._background.write(self.writer.share_local, key)

    def persist(self, keys: Sequence[str]) -> None:
        """``keys`` were used again (a later request found them stored): each one that only
        an upper local tier holds is copied down to the last local tier in the background.
        Returns at once; keys beyond the queue's bound are dropped (counted)."""
        if self._copies is not None:
            self._copies.add(keys)

    def copy_up(self, key: str, fits: Callable[[int], bool] = lambda nbytes: True) -> tuple[str, int]:
        """Make the top local tier hold ``key`` (a warm-up: ``cache.dram_warm``): the entry of
        the highest tier below that holds a sound one, verified in full (checksum, namespace,
        key, signature) and stored through the top tier's policy on the writer thread, as a
        promotion (admitted whatever the policy says; evicting and demoting to make room).
        ``fits(bytes)`` may decline it first. Returns ``(outcome, bytes)``: ``held`` (a sound
        entry there already; a damaged one is dropped and copied again), ``copied``,
        ``absent`` (no sound entry below), ``declined`` (``fits`` said no) or ``refused`` (no
        room, the write failed, or the store is closing). Blocks on the reads and the
        write: never call it from the scheduler loop or a forward pass."""
        assert self.writer is not None and self.n_local, "a writer store with a local tier"
        return ("refused", 0) if self._closing else self.reads.copy_up(key, fits)

    def hint_upcoming(self, keys: Sequence[str]) -> None:
        """Queued requests will load ``keys`` soon: every local tier's policy protects them."""
        if self.policies is None:
            return
        with self._lock:
            for policy in self.policies[: self.n_local]:
                policy.hint_upcoming(keys)

    def _bg(self) -> Background:
        assert self._background is not None, "lookup-only store"
        return self._background

    # -- what callers need to know -------------------------------------------------
    @property
    def has_local(self) -> bool:
        return self.n_local > 0

    def holds(self, tier: str, key: str) -> Optional[bool]:
        """Whether the tier named ``tier`` holds ``key`` now (one ``contains``); None while
        the tier cannot say yet (a shared tier before its first listing). Never I/O."""
        for t in self.tiers:
            if t.name == tier:
                return t.contains(key) if t.knows_contents() else None
        return False

    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self.tiers]

    def note_loaded(self, tier: TierId, tokens: int, key: str = "", planned: str = "") -> None:
        """``tokens`` prompt tokens were served from ``tier`` (an ``Entry.tier``); when the load
        of ``key`` was planned from another tier (``planned``, by name), the scheduler is told
        which served it (``served``: a bad copy above was passed over)."""
        self.stats.tiers[tier.name].tokens_loaded += tokens
        if planned and planned != tier.name:
            self.account.note(key, "served", tier.name)

    def recheck_shared(self, keys: Sequence[str]) -> None:
        """``keys`` were just stored by this engine: the shared tier asks about them again."""
        if self.shared is not None:
            self.shared.recheck(keys)

    def reject_shared(self, key: str) -> None:
        """``key`` failed to load from the shared tier: it stops offering it for a while."""
        if self.shared is not None:
            self.shared.reject(key)

    def counters(self) -> dict[str, float]:
        """Running totals, flat: ``{"<tier>.<counter>": n, "all.dropped_writes": n, ...,
        "write_failure:<cause>:<tier>": n}``."""
        return self.account.counters(self._copies.dropped if self._copies is not None else 0)

    def levels(self) -> dict[str, int]:
        """Bytes held and capacity of each bounded tier: ``{"<tier>.used_bytes": n, ...}``."""
        out = {}
        for t in self.tiers:
            if t.capacity is not None:
                out[f"{t.name}.capacity_bytes"] = t.capacity
                out[f"{t.name}.used_bytes"] = t.used_bytes()
        return out

    def describe(self) -> str:
        """``dram=1,048,576B, disk=..., shared=shared``: the tiers, for a log line."""
        return (
            ", ".join(f"{t.name}={t.capacity:,}B" if t.capacity is not None else f"{t.name}=shared" for t in self.tiers)
            or "none"
        )

    # -- lifecycle -------------------------------------------------------------
    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until queued writes (and the promotions, demotions, publishes and copies
        down they cause) are done; False if ``timeout`` passed first."""
        return self._background.flush(timeout) if self._background is not None else True

    def close(self, timeout: Optional[float] = 10.0) -> bool:
        """Flush within ``timeout`` (what is left then is dropped: a future miss, never a
        damaged entry), stop the threads, close the tiers. Returns whether all was flushed."""
        flushed, self._closing = True, True
        if self._background is not None:
            flushed = self._background.flush(timeout)
            if not flushed:
                left, copies = self._background.pending(), len(self._copies or ())
                log.warning(
                    "kvcache: closing with %d background writes and %d copies to disk left "
                    "after %.1f s; they are dropped (future misses)",
                    left,
                    copies,
                    timeout or 0,
                )
            self._background.shutdown()
        for t in self.tiers:
            t.close()
        return flushed

    @property
    def closing(self) -> bool:
        """``close`` has begun (a warm-up stops: ``copy_up`` copies nothing more)."""
        return self._closing

    def check(self) -> None:
        """Invariants, for tests: bounds hold and every tracked key is present (local
        tiers; the shared tier's space is the backend's)."""
        for i, tier in enumerate(self.tiers[: self.n_local]):
            used = tier.used_bytes()
            if tier.capacity is not None:
                assert used <= tier.capacity, f"{tier.name}: {used} > {tier.capacity}"
            present = dict(tier.scan())
            assert sum(present.values()) <= (tier.capacity or float("inf"))
            if self.policies is not None:
                with self._lock:
                    tracked = [k for k in present if k in self.policies[i]]
                assert len(tracked) == len(present), f"{tier.name}: untracked entries"
