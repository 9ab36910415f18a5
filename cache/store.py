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

Callers use the operations below, never the tiers: ``counters``/``levels`` for metrics,
``note_loaded`` for tokens served, ``recheck_shared``/``reject_shared`` for what the
scheduler learns, ``describe`` for logs. ``timer``, if set, is called as
``timer(step, seconds)`` for each tier read (``"read"``) and entry check (``"decode"``)
of ``get``, on the thread that ran them (benchmarks: ``bench/timed_connector.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from cache.admission import SharedAdmission
from cache.codec import HEADER_SIZE, CorruptEntry, EntryInfo, UnsignedEntry, decode, encode_header, read_header
from cache.durability import CopyQueue
from cache.faults import WriteFaults
from cache.pins import PinBook
from cache.placed import BlockWriters, LoadEnded, Misfit, PartRead, Place, Staged
from cache.policy import EvictionPolicy, Offer
from cache.tiers.base import Buffer, Tier

log = logging.getLogger(__name__)

# ``get_into``'s answer when the entry may be in a tier it does not read in place.
ELSEWHERE = "elsewhere"


@dataclass
class Entry:
    """A verified entry: tensor metadata and a zero-copy view of its payload."""

    key: str
    info: EntryInfo
    payload: memoryview
    tier: int                 # index of the tier it was read from
    raw: Buffer = None        # the whole encoded entry (keeps mmaps alive; used to promote)


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    rejected: int = 0          # refused by admission
    corrupt: int = 0
    errors: int = 0
    timeouts: int = 0          # reads/writes past the tier's deadline (also in errors)
    unavailable: int = 0       # calls refused or failed while the tier is unreachable
    load_seconds: float = 0.0
    tokens_loaded: int = 0     # counted by the connector: prompt tokens served from here
    persisted: int = 0         # reused entries copied down into this tier (durability)


@dataclass
class StoreStats:
    tiers: dict[str, TierStats] = field(default_factory=dict)
    dropped_writes: int = 0    # write-behind queue full: dropped rather than block
    dropped_publishes: int = 0  # shared-tier queue full: dropped rather than block


WARN_INTERVAL_S = 60.0


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
        timer: Optional[Callable[[str, float], None]] = None,
    ) -> None:
        """``policies`` given (one per tier; the shared tier's, if any, is not used) makes
        a writer store; None a lookup-only one. ``thread_setup(role)`` runs first on each
        of its threads ("read", "write", "publish"; see ``cache.threads``)."""
        self.timer = timer
        # ``on_event(key, event, tier)``: what happened to a chunk (stored, evicted,
        # not_admitted, damaged, ...; ``cache.explain``), on the thread it happened on.
        self.on_event: Optional[Callable[[str, str, str], None]] = None
        # Pinned prefixes (a ``cache.pins.PinBook``; ``held(key)``): eviction passes them over.
        self.pins: Optional[PinBook] = None
        self.tiers = list(tiers)
        shared = [i for i, t in enumerate(self.tiers) if t.shared]
        if shared and shared != [len(self.tiers) - 1]:
            raise ValueError("at most one shared tier, and it must be the last")
        self.shared: Optional[Tier] = self.tiers[-1] if shared else None
        self.n_local = len(self.tiers) - len(shared)
        self.namespace = namespace
        self.signing_key = signing_key
        self.policies = list(policies) if policies is not None else None
        if self.policies is not None and len(self.policies) not in (len(self.tiers), self.n_local):
            raise ValueError("one policy per tier")
        self.admission = SharedAdmission(shared_admission)
        self.stats = StoreStats({t.name: TierStats() for t in self.tiers})
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._max_pending = max_pending_bytes
        self._pending: set[Future] = set()
        self._warned: dict[str, tuple[float, int]] = {}
        # Shared-tier publishing: a queue drained in batches by one thread.
        self._publish_queue: list[tuple[str, list, int]] = []
        self._publishing: set[str] = set()
        self._publish_bytes = 0
        self._max_publish = max_publish_bytes
        self._draining = False
        self.faults = WriteFaults()
        self._closing = False   # close() began: copy_up copies nothing more
        # Reads run on a pool; writes (and the evictions and demotions they cause) on one
        # thread, in order, so a chain's parent is always stored before its child.
        self._io = self._writer = self._publisher = None
        if self.policies is not None:
            def pool(n: int, role: str) -> ThreadPoolExecutor:
                return ThreadPoolExecutor(n, thread_name_prefix=f"kvcache-{role}",
                                          initializer=thread_setup, initargs=(role,))

            self._io = pool(io_threads, "read")
            self._writer = pool(1, "write")
            if self.shared is not None:
                self._publisher = pool(1, "publish")
            for i in range(self.n_local):
                self._adopt(i)
        # Keys used again, to copy down to the last local tier (none with one local tier).
        self._copies = (CopyQueue(max_persist_keys, self._submit, self._copy_down)
                        if self._writer is not None and self.n_local >= 2 else None)

    # -- lookup (scheduler path: cheap, never reads payloads) -----------------
    def lookup(self, keys: Sequence[str], local_only: bool = False) -> list[int]:
        """Tier index of each leading chunk found, stopping at the first miss. The shared
        tier answers from memory (what it knows so far; see ``probe``)."""
        tiers = self.tiers[: self.n_local] if local_only else self.tiers
        found = []
        for key in keys:
            for i, tier in enumerate(tiers):
                if tier.contains(key):
                    found.append(i)
                    break
            else:
                break
        return found

    def probe(self, keys: Sequence[str]) -> bool:
        """Ask the shared tier, in the background, whether it holds the chain ``keys``;
        True while answers are pending (``lookup`` will know more later). Never blocks."""
        return self.shared.probe(keys) if self.shared is not None else False

    # -- reads -----------------------------------------------------------------
    def get(self, key: str, promote: bool = True) -> Optional[Entry]:
        """The verified entry from the highest tier holding it, or None. Blocks on I/O
        (a shared-tier read at most its deadline)."""
        for i, tier in enumerate(self.tiers):
            st = self.stats.tiers[tier.name]
            t0 = time.perf_counter()
            try:
                raw = tier.read(key)
            except KeyError:
                continue
            except Exception as e:  # a tier failing must not fail the request
                self._failed(tier, "reading", key, e)
                continue
            t1 = time.perf_counter()
            try:
                info, payload = decode(raw, self.namespace, key, self.signing_key)
            except CorruptEntry as e:
                st.corrupt += 1
                self._drop_bad(i, key, e)
                continue
            t2 = time.perf_counter()
            if self.timer is not None:
                self.timer("read", t1 - t0)
                self.timer("decode", t2 - t1)
            self._hit(i, key, info, t2 - t0, raw, promote)
            return Entry(key, info, payload, i, raw)
        if self.tiers:
            self.stats.tiers[self.tiers[0].name].misses += 1
        return None

    def get_async(self, key: str) -> Future:
        """``get`` on an I/O thread."""
        assert self._io is not None, "lookup-only store"
        return self._io.submit(self.get, key)

    def get_into(self, key: str, place: Place, writers: Optional[BlockWriters] = None,
                 local_only: bool = False):
        """Like ``get``, for tiers that read entries in place (files, local or shared):
        the payload is read straight into the buffers ``place(info)`` returns and
        verified there (``cache.placed``). Returns ``(tier index, info)``; None when no
        tier holds a sound entry (a miss, counted; after a damaged entry the buffers
        hold garbage); ``ELSEWHERE`` when a tier that cannot (or, ``local_only``, the
        shared tier) may hold it: the caller then uses ``get`` or another thread.
        ``writers``: the load's ``BlockWriters``; once closed, nothing more is written
        into its buffers (``LoadEnded``). An entry that does not fit the caller
        (``place`` raised ``ValueError``) raises ``Misfit``; it is kept. Blocks on
        file I/O, and on the shared tier's reads (within its deadline; a shared read
        writes into the buffers only a piece at a time, while ``writers`` admits it)."""
        found = self._find_in_place(key, place, writers, local_only, whole=True)
        return found if found is None or found is ELSEWHERE else (found.tier, found.read.info)

    def read_layers(self, key: str, place: Place, writers: BlockWriters, local_only: bool = False):
        """``get_into`` a part at a time (``PartRead``: an entry's layers), for a load
        that hands each layer over while the next is read: finds the entry and reads its
        first part into ``place(info)``; ``EntryRead.step`` reads each next one, the last
        verifies the whole entry. Returns an ``EntryRead``, None (a miss) or ``ELSEWHERE``
        (as ``get_into``); raises ``LoadEnded`` and ``Misfit`` as ``get_into`` does."""
        return self._find_in_place(key, place, writers, local_only, whole=False)

    def _find_in_place(self, key: str, place: Place, writers: Optional[BlockWriters], local_only: bool,
                       whole: bool):
        writers = writers if writers is not None else BlockWriters()
        for i, tier in enumerate(self.tiers):
            remote = i >= self.n_local
            if not tier.reads_in_place or (remote and local_only):
                return ELSEWHERE
            # A whole shared entry is kept to promote it (a layered read lets the writer read it again).
            keep = whole and remote and self.n_local > 0 and self.policies is not None
            read = EntryRead(self, i, key, PartRead(self.namespace, key, place, self.signing_key, self.timer),
                             writers, keep)
            t0 = time.perf_counter()
            try:
                raw = tier.read_with(key, lambda reader: read.use(reader, whole))  # noqa: B023 (called at once)
            except KeyError:
                continue
            except CorruptEntry as e:
                self.stats.tiers[tier.name].corrupt += 1
                self._drop_bad(i, key, e)
                continue
            except LoadEnded:
                raise
            except ValueError as e:
                raise Misfit(tier.name, str(e)) from e
            except Exception as e:  # a tier failing must not fail the request
                self._failed(tier, "reading", key, e)
                continue
            read.seconds = time.perf_counter() - t0
            if read.read.done:
                self._hit(i, key, read.read.info, read.seconds, raw, True)
            return read
        if self.tiers:
            self.stats.tiers[self.tiers[0].name].misses += 1
        return None

    def run_read(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on an I/O thread (work that calls ``get``/``get_into``)."""
        assert self._io is not None, "lookup-only store"
        return self._io.submit(fn, *args)

    def _hit(self, i: int, key: str, info: EntryInfo, seconds: float, raw: Buffer, promote: bool) -> None:
        """Count a verified read from tier ``i``; touch its policy; publish the entry if
        it is now reused, promote it if an upper tier can hold it. ``raw`` is the whole
        entry when the caller has it; otherwise the writer thread reads it again."""
        st = self.stats.tiers[self.tiers[i].name]
        st.hits += 1
        st.bytes_read += info.payload_len + HEADER_SIZE
        st.load_seconds += seconds
        if self.policies is None:
            return
        if i < self.n_local:
            with self._lock:
                self.policies[i].touch(key)
                reused = self.admission.on_hit(key)
            if reused:
                if raw is not None:
                    self._publish(key, [raw])
                elif self.shared is not None:
                    self._submit(self._share_from, i, key)
        top = self._top_for(HEADER_SIZE + info.payload_len) if promote else None
        if top is not None and top < i:
            self._submit(self._promote, top, key, raw, info.parent, i)

    # -- writes (write-behind) -------------------------------------------------
    def put(self, key: str, parent: Optional[str], dtype: str, shape: Sequence[int], payload: Buffer,
            shared: bool = False, on_done: Optional[Callable[[str], None]] = None,
            ready: Optional[Callable[[], None]] = None, borrowed: bool = False) -> bool:
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
        assert self._io is not None, "lookup-only store"
        nbytes = memoryview(payload).nbytes
        with self._lock:
            dropped = self._pending_bytes + nbytes > self._max_pending
            if dropped:
                self.stats.dropped_writes += 1
                self._note(key, "not_admitted", "all")
            else:
                self._pending_bytes += nbytes
        if dropped:
            if on_done is not None:
                on_done(key)
            return False

        def settled(_f: Future) -> None:
            self._unpend(nbytes)
            if on_done is not None:
                on_done(key)

        self._submit(self._write_new, key, parent, dtype, tuple(shape), payload, shared,
                     ready, borrowed).add_done_callback(settled)
        return True

    def _unpend(self, nbytes: int) -> None:
        with self._lock:
            self._pending_bytes -= nbytes

    def _submit(self, fn, *args, executor: Optional[ThreadPoolExecutor] = None) -> Future:
        fut = (executor or self._writer).submit(self._guard, fn, *args)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)

    @staticmethod
    def _guard(fn, *args):
        try:
            return fn(*args)
        except Exception:  # background work must never take the engine down
            log.exception("kvcache: background %s failed", getattr(fn, "__name__", fn))

    def _write_new(self, key, parent, dtype, shape, payload, shared=False, ready=None, borrowed=False) -> None:
        if ready is not None:
            ready()
        header = encode_header(self.namespace, key, dtype, shape, payload, self.signing_key, parent)
        local = self.tiers[: self.n_local]
        top = self._top_for(len(header) + memoryview(payload).nbytes)
        holder = next((i for i, t in enumerate(local) if t.contains(key)), None)
        if top is not None and holder is None:
            self._store(top, key, parent, [header, payload])
        elif holder is not None:
            with self._lock:        # stored, but computed again: an access that missed
                self.policies[holder].seen(key, parent)
        elif top is None and local:
            self._note(key, "not_admitted", local[-1].name)  # larger than every local tier
        with self._lock:
            admitted = self.admission.on_put(key)
        if shared or admitted or not local:
            self._publish(key, [header, bytes(memoryview(payload).cast("B")) if borrowed else payload])

    # -- the shared tier -------------------------------------------------------
    def _publish(self, key: str, parts: list) -> None:
        """Queue an encoded entry for the shared tier; returns at once. Skipped when the
        tier already has it, is down, or the queue is full."""
        tier = self.shared
        if tier is None or self._publisher is None or tier.contains(key):
            return
        if not tier.available:  # down: skip without queueing
            self.stats.tiers[tier.name].unavailable += 1
            self._note(key, "shared_unreachable", tier.name)
            return
        nbytes = sum(memoryview(p).nbytes for p in parts)
        with self._lock:
            if key in self._publishing:
                return
            if self._publish_bytes + nbytes > self._max_publish:
                self.stats.dropped_publishes += 1
                return
            self._publishing.add(key)
            self._publish_bytes += nbytes
            self._publish_queue.append((key, parts, nbytes))
            start, self._draining = not self._draining, True
        self._note(key, "publishing", tier.name)
        if start:
            self._submit(self._drain_publishes, executor=self._publisher)

    def share(self, key: str) -> None:
        """Publish ``key``'s local entry to the shared tier now, whatever the admission rule
        (a pinned prefix; ``cache.pins``). Returns at once; nothing if no local tier has it."""
        if self.shared is not None and self._writer is not None:
            self._submit(self._share_local, key)

    def _share_from(self, i: int, key: str) -> None:
        """Publish the entry local tier ``i`` holds (just verified by a placed read)."""
        raw = self._read_local(i, key)
        if raw is not None:
            self._publish(key, [raw])

    def _read_local(self, i: int, key: str) -> Buffer:
        """Local tier ``i``'s whole entry for ``key``, or None (gone, or the read failed)."""
        try:
            return self.tiers[i].read(key)
        except KeyError:
            return None
        except Exception as e:
            self._failed(self.tiers[i], "reading", key, e)
            return None

    def _share_local(self, key: str) -> None:
        for tier in self.tiers[: self.n_local]:
            try:
                raw = tier.read(key)
                decode(raw, self.namespace, key, self.signing_key)  # others will trust it
            except (KeyError, CorruptEntry):
                continue
            self._publish(key, [raw])
            return

    def _drain_publishes(self) -> None:
        """Write queued entries to the shared tier, a batch at a time, in queue order
        (parents before children)."""
        while True:
            with self._lock:
                batch, self._publish_queue = self._publish_queue, []
                if not batch:
                    self._draining = False
                    return
            for key, parts, nbytes in batch:
                try:
                    self._write_shared(key, parts, nbytes)
                finally:
                    with self._lock:
                        self._publishing.discard(key)
                        self._publish_bytes -= nbytes

    def _write_shared(self, key: str, parts: list, nbytes: int) -> None:
        tier = self.shared
        st = self.stats.tiers[tier.name]
        if not tier.reserve(nbytes):
            st.rejected += 1
            self._note(key, "not_admitted", tier.name)
            return
        try:
            published = tier.write(key, parts, nbytes)
        except Exception as e:
            self._failed(tier, "writing", key, e)
            return
        self.faults.succeeded(tier.name)
        self._note(key, "stored", tier.name)  # by this call or, first, by another node
        if published:
            st.writes += 1
            st.bytes_written += nbytes

    # -- durability: what is used again also goes to disk (``cache.durability``) -----
    def persist(self, keys: Sequence[str]) -> None:
        """``keys`` were used again (a later request found them stored): each one that only
        an upper local tier holds is copied down to the last local tier in the background.
        Returns at once; keys beyond the queue's bound are dropped (counted)."""
        if self._copies is not None:
            self._copies.add(keys)

    def _copy_down(self, key: str) -> None:
        last = self.n_local - 1
        if self.tiers[last].contains(key):
            return
        for i in range(last):
            raw = self._read_local(i, key)
            if raw is None:
                continue
            try:  # the header only: every read verifies the whole entry anyway
                parent = read_header(raw, self.namespace, key).parent
            except CorruptEntry:
                return  # the next read drops it
            if self._store(last, key, parent, [raw]):
                self.stats.tiers[self.tiers[last].name].persisted += 1
            return

    def _failed(self, tier: Tier, doing: str, key: str, e: Exception) -> None:
        """Count a tier failure; log it (at most once a minute per tier; a write: once per
        episode, with its cause). Connection trouble and deadlines are the shared tier's
        to report (once per outage)."""
        st = self.stats.tiers[tier.name]
        reading = doing == "reading"
        if doing == "writing":
            self.faults.failed(tier.name, e)
        if isinstance(e, ConnectionError):
            st.unavailable += 1
            self._note(key, "shared_unreachable", tier.name)
            return
        st.errors += 1
        if isinstance(e, TimeoutError):
            st.timeouts += 1
            self._note(key, "load_timeout" if reading else "shared_unreachable", tier.name)
            return
        self._note(key, "damaged" if reading else "not_admitted", tier.name)
        if doing == "writing":
            return  # logged by ``faults`` once per episode
        self._warn(tier.name, "kvcache: %s %s in %s failed: %s", doing, key, tier.name, e)

    def _warn(self, tier_name: str, fmt: str, *args) -> None:
        now = time.monotonic()
        with self._lock:
            last, suppressed = self._warned.get(tier_name, (-WARN_INTERVAL_S, 0))
            if now - last < WARN_INTERVAL_S:
                self._warned[tier_name] = (last, suppressed + 1)
                return
            self._warned[tier_name] = (now, 0)
        if suppressed:
            fmt += " (%d more since the last message)"
            args += (suppressed,)
        log.warning(fmt, *args)

    def _drop_bad(self, i: int, key: str, e: CorruptEntry) -> None:
        """A local tier deletes a bad entry; the shared tier's is only ignored here."""
        tier = self.tiers[i]
        self._warn(tier.name, "kvcache: ignoring bad entry %s in %s: %s", key, tier.name, e)
        self._note(key, "unsigned" if isinstance(e, UnsignedEntry) else "damaged", tier.name)
        if i >= self.n_local:
            tier.reject(key)
            return
        self._forget(i, key)
        tier.delete(key)

    def _top_for(self, nbytes: int) -> Optional[int]:
        """The first local tier that can hold an entry of ``nbytes`` at all: new entries
        and promotions go there (a DRAM tier smaller than one entry is passed over)."""
        for i in range(self.n_local):
            capacity = self.tiers[i].capacity
            if capacity is None or nbytes <= capacity:
                return i
        return None

    def _promote(self, top, key, raw, parent, source: int) -> None:
        if not self.tiers[top].contains(key):
            if raw is None:  # read into the caller's buffers: read the file again
                raw = self._read_local(source, key)
                if raw is None:
                    return
            self._store(top, key, parent, [raw])
            self.stats.tiers[self.tiers[top].name].promotions += 1

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
        assert self._writer is not None and self.n_local, "a writer store with a local tier"
        if self._closing:
            return "refused", 0
        if self.tiers[0].contains(key):
            raw = self._read_local(0, key)
            if raw is not None:
                try:   # a damaged entry there is dropped, and copied again from below
                    decode(raw, self.namespace, key, self.signing_key)
                    return "held", memoryview(raw).nbytes
                except CorruptEntry as e:
                    self.stats.tiers[self.tiers[0].name].corrupt += 1
                    self._drop_bad(0, key, e)
        for i in range(1, len(self.tiers)):
            tier = self.tiers[i]
            try:
                raw = tier.read(key)
            except KeyError:
                continue
            except Exception as e:  # a tier failing: try the next one
                self._failed(tier, "reading", key, e)
                continue
            nbytes = memoryview(raw).nbytes
            if not fits(nbytes):
                return "declined", nbytes
            try:
                info = decode(raw, self.namespace, key, self.signing_key)[0]
            except CorruptEntry as e:
                self.stats.tiers[tier.name].corrupt += 1
                self._drop_bad(i, key, e)
                continue
            try:
                stored = self._submit(self._store, 0, key, info.parent, [raw], True).result()
            except RuntimeError:   # the store closed meanwhile (its writer shut down)
                return "refused", nbytes
            if stored:
                self.stats.tiers[self.tiers[0].name].promotions += 1
            return ("copied" if stored else "refused"), nbytes
        return "absent", 0

    def _store(self, i: int, key: str, parent: Optional[str], parts: list, force: bool = False) -> bool:
        """Write into local tier ``i`` if its policy admits it (``force``: whatever it says),
        evicting (and demoting) to make room."""
        tier, policy = self.tiers[i], self.policies[i]
        st = self.stats.tiers[tier.name]
        nbytes = sum(memoryview(p).nbytes for p in parts)
        if tier.capacity is not None and nbytes > tier.capacity:
            st.rejected += 1
            self._note(key, "not_admitted", tier.name)
            return False

        def write() -> bool:
            restore_kept()  # before the new entry, which the policy inserts after the write
            try:
                published = tier.write(key, parts, nbytes)
            except Exception as e:
                self._failed(tier, "writing", key, e)
                return False
            self.faults.succeeded(tier.name)
            return published

        kept: list[str] = []  # pinned victims passed over (cache.pins), back in the policy after

        def restore_kept() -> None:
            with self._lock:
                for k in kept:
                    if k not in policy:
                        policy.insert(k, None, nbytes)

        def evict(victim: str) -> None:
            if self._pinned(victim):
                kept.append(victim)
            else:
                self._evict(i, victim)

        def exhausted() -> bool:  # only pinned entries were left: the oldest goes down a tier
            if kept and i + 1 < self.n_local and self._demote_pinned(i, kept[0]):
                kept.pop(0)
                return True
            return False

        try:
            outcome = policy.offer(key, parent, nbytes, reserve=lambda: tier.reserve(nbytes, key),
                                   evict=evict, write=write, lock=self._lock,
                                   rescan=lambda: self._adopt(i, skip=kept), force=force or self._pinned(key),
                                   exhausted=exhausted)
        except Exception as e:  # the folder unusable (read-only, I/O error ...): a failed write
            self._failed(tier, "writing", key, e)
            return False
        finally:
            restore_kept()
        if outcome in (Offer.REFUSED, Offer.NO_ROOM):
            st.rejected += 1
            self._note(key, "not_admitted", tier.name)
        elif outcome is Offer.STORED:
            st.writes += 1
            st.bytes_written += nbytes
            self._note(key, "stored", tier.name)
        return outcome is Offer.STORED

    def _evict(self, i: int, victim: str) -> None:
        """Remove ``victim`` from local tier ``i``; hand its bytes to the next local tier
        down, or, from the last one, to the shared tier when the admission rule says so."""
        tier = self.tiers[i]
        to_local = i + 1 < self.n_local and not self.tiers[i + 1].contains(victim)
        with self._lock:
            to_shared = (i + 1 == self.n_local and self.shared is not None
                         and self.admission.on_evict(victim))
        to_shared = to_shared and not self.shared.contains(victim)
        raw = None
        if to_local or to_shared:
            try:
                raw = tier.read(victim)  # (an mmap stays valid after the unlink below)
            except KeyError:
                raw = None
        tier.delete(victim)
        self.stats.tiers[tier.name].evictions += 1
        self._note(victim, "evicted", tier.name)  # (a demotion below then notes "stored")
        if raw is None:
            return
        try:  # a shared entry is verified in full: other nodes will trust its checksum
            info = (decode(raw, self.namespace, victim, self.signing_key)[0] if to_shared
                    else read_header(raw, self.namespace, victim))
        except CorruptEntry:
            return
        if to_shared:
            self._publish(victim, [raw])
            self.stats.tiers[tier.name].demotions += 1
        elif self._store(i + 1, victim, info.parent, [raw]):
            self.stats.tiers[tier.name].demotions += 1

    def _pinned(self, key: str) -> bool:
        """Whether ``key`` is pinned now (``cache.pins``): never evicted, only demoted."""
        return self.pins is not None and self.pins.held(key)

    def _demote_pinned(self, i: int, key: str) -> bool:
        """Move a pinned entry from local tier ``i`` to the next one: stored there first,
        removed here only then (a pinned entry is never dropped)."""
        tier, below = self.tiers[i], self.tiers[i + 1]
        try:
            raw = tier.read(key)
            parent = read_header(raw, self.namespace, key).parent
        except (KeyError, CorruptEntry):
            return True   # gone meanwhile, or damaged: nothing to keep
        if not (below.contains(key) or self._store(i + 1, key, parent, [raw])):
            return False
        tier.delete(key)
        self.stats.tiers[tier.name].demotions += 1
        self._note(key, "evicted", tier.name)  # (moved: stored below first)
        return True

    def _note(self, key: str, event: str, tier: str) -> None:
        if self.on_event is not None:
            self.on_event(key, event, tier)

    def _forget(self, i: int, key: str) -> None:
        if self.policies is not None:
            with self._lock:
                self.policies[i].remove(key)

    def _adopt(self, i: int, skip: Sequence[str] = ()) -> None:
        """Teach tier ``i``'s policy the entries already there (restart, other engines),
        but those in ``skip``."""
        for key, size in self.tiers[i].scan():
            with self._lock:
                if key not in self.policies[i] and key not in skip:
                    self.policies[i].insert(key, None, size)

    def hint_upcoming(self, keys: Sequence[str]) -> None:
        """Queued requests will load ``keys`` soon: every local tier's policy protects them."""
        if self.policies is None:
            return
        with self._lock:
            for policy in self.policies[: self.n_local]:
                policy.hint_upcoming(keys)

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

    def note_loaded(self, tier: int, tokens: int, key: str = "", planned: str = "") -> None:
        """``tokens`` prompt tokens were served from tier ``tier`` (an ``Entry.tier``); when
        the load of ``key`` was planned from another tier (``planned``, by name), the
        scheduler is told which served it (``served``: a bad copy above was passed over)."""
        name = self.tiers[tier].name
        self.stats.tiers[name].tokens_loaded += tokens
        if planned and planned != name:
            self._note(key, "served", name)

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
        # (vars, not dataclasses.asdict: this runs every engine step, and asdict's deep copy is 9x slower)
        out = {f"{name}.{k}": v for name, st in self.stats.tiers.items() for k, v in vars(st).items()}
        out["all.dropped_writes"] = self.stats.dropped_writes
        out["all.dropped_publishes"] = self.stats.dropped_publishes
        out["all.dropped_persists"] = self._copies.dropped if self._copies is not None else 0
        out.update(self.faults.counters())
        return out

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
        return ", ".join(f"{t.name}={t.capacity:,}B" if t.capacity is not None else f"{t.name}=shared"
                         for t in self.tiers) or "none"

    # -- lifecycle -------------------------------------------------------------
    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until queued writes (and the promotions, demotions, publishes and copies
        down they cause) are done; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                return True
            for fut in pending:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    fut.result(timeout=left)
                except Exception:
                    if deadline is not None and time.monotonic() >= deadline:
                        return False

    def close(self, timeout: Optional[float] = 10.0) -> bool:
        """Flush within ``timeout`` (what is left then is dropped: a future miss, never a
        damaged entry), stop the threads, close the tiers. Returns whether all was flushed."""
        flushed, self._closing = True, True
        if self._io is not None:
            flushed = self.flush(timeout)
            if not flushed:
                with self._lock:
                    left, copies = len(self._pending), len(self._copies or ())
                log.warning("kvcache: closing with %d background writes and %d copies to disk left "
                            "after %.1f s; they are dropped (future misses)", left, copies, timeout or 0)
            for pool in (self._io, self._writer, self._publisher):
                if pool is not None:
                    pool.shutdown(wait=False, cancel_futures=True)
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


class EntryRead:
    """An entry being read in place from tier ``tier`` of ``store``, a part at a time
    (``TieredStore.read_layers``). Runs on the thread that calls ``step``: a read thread,
    or a load's own thread for a local tier; it blocks on that part's I/O (a shared
    tier's read: within the tier's deadline)."""

    def __init__(self, store: TieredStore, tier: int, key: str, read: PartRead, writers: BlockWriters,
                 keep: bool) -> None:
        self.store, self.tier, self.key, self.read, self.writers = store, tier, key, read, writers
        self.keep = keep
        self.seconds = 0.0  # time spent reading, for the tier's statistics

    @property
    def remote(self) -> bool:
        return self.tier >= self.store.n_local

    def use(self, reader, whole: bool):
        """Inside the tier's ``read_with``: open the entry (the first call) or check it is
        still the same, then read the next part (``whole``: every part left). A local
        file is read straight into the buffers while ``writers`` admits it; a shared-tier
        entry through ``Staged`` (a piece at a time); one a transport read whole
        (Curvine's SDK) all at once. The whole entry when ``keep`` or read whole."""
        staged = Staged(reader, self.writers, self.keep) if self.remote else None
        if staged is None and not self.writers.enter():
            raise LoadEnded()
        try:
            reader = staged or reader
            if self.read.info is None:
                self.read.open(reader)
            else:
                self.read.same_entry(reader)
            whole = whole or (staged is not None and staged.in_memory)  # read whole already: use it all
            while not self.read.done:
                self.read.read_part(reader, rest=whole)
                if not whole:
                    break
        finally:
            if staged is None:
                self.writers.leave()
        if staged is None:
            return None
        return staged.reader.data if staged.in_memory else staged.entry()

    def step(self) -> bool:
        """Read the next part; False when the entry could not be read (gone, damaged,
        replaced, or the tier failed: counted, and the chunk's event sent). Once
        ``read.done`` the entry is whole and verified, and counted as a hit. Raises
        ``LoadEnded``."""
        store, tier = self.store, self.store.tiers[self.tier]
        t0 = time.perf_counter()
        try:
            raw = tier.read_with(self.key, lambda reader: self.use(reader, False))
        except LoadEnded:
            raise
        except KeyError:
            store._note(self.key, "missing", "none")
            return False
        except CorruptEntry as e:
            store.stats.tiers[tier.name].corrupt += 1
            store._drop_bad(self.tier, self.key, e)
            return False
        except Exception as e:  # a tier failing must not fail the request
            store._failed(tier, "reading", self.key, e)
            return False
        self.seconds += time.perf_counter() - t0
        if self.read.done:
            store._hit(self.tier, self.key, self.read.info, self.seconds, raw, True)
        return True
