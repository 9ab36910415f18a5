"""TieredStore: longest-prefix lookup over tiers, promote on hit, demote on evict, write-behind.

Engine-agnostic (no vLLM, no torch). One store per process that opens the cache:
- in the vLLM scheduler, a *lookup-only* store answers ``lookup`` (cheap ``contains``
  checks, no I/O threads, no policy);
- in each vLLM worker, a *writer* store runs ``get``/``get_async`` and ``put``; it owns
  the I/O threads and one eviction policy per tier.

All tiers hold the same encoded bytes for a key (``cache.codec``), so promotion and
demotion copy bytes without re-encoding. Every entry read is verified before it is
returned; a damaged or foreign entry is deleted and reported as a miss.

Threads: ``put`` and ``get_async`` return at once; reads run on ``io_threads``
threads, writes on one writer thread in submission order. The policy structures are guarded by one lock, held only for policy calls
(microseconds), never across I/O.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Sequence

from cache.codec import CorruptEntry, EntryInfo, HEADER_SIZE, decode, encode_header, read_header
from cache.policy import EvictionPolicy
from cache.tiers.base import Buffer, Tier

log = logging.getLogger(__name__)


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
    load_seconds: float = 0.0


@dataclass
class StoreStats:
    tiers: dict[str, TierStats] = field(default_factory=dict)
    dropped_writes: int = 0    # write-behind queue full: dropped rather than block


class TieredStore:
    def __init__(
        self,
        tiers: Sequence[Tier],
        namespace: bytes,
        policies: Optional[Sequence[EvictionPolicy]] = None,
        signing_key: bytes = b"",
        io_threads: int = 2,
        max_pending_bytes: int = 1 << 30,
    ) -> None:
        """``policies`` given (one per tier) makes a writer store; None a lookup-only one."""
        self.tiers = list(tiers)
        self.namespace = namespace
        self.signing_key = signing_key
        self.policies = list(policies) if policies is not None else None
        if self.policies is not None and len(self.policies) != len(self.tiers):
            raise ValueError("one policy per tier")
        self.stats = StoreStats({t.name: TierStats() for t in self.tiers})
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._max_pending = max_pending_bytes
        self._pending: set[Future] = set()
        # Reads run on a pool; writes (and the evictions and demotions they cause) on one
        # thread, in order, so a chain's parent is always stored before its child.
        self._io = self._writer = None
        if self.policies is not None:
            self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="kvcache-read")
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvcache-write")
        if self.policies is not None:
            for i in range(len(self.tiers)):
                self._adopt(i)

    # -- lookup (scheduler path: cheap, never reads payloads) -----------------
    def lookup(self, keys: Sequence[str]) -> list[int]:
        """Tier index of each leading chunk found, stopping at the first miss."""
        found = []
        for key in keys:
            for i, tier in enumerate(self.tiers):
                if tier.contains(key):
                    found.append(i)
                    break
            else:
                break
        return found

    # -- reads -----------------------------------------------------------------
    def get(self, key: str, promote: bool = True) -> Optional[Entry]:
        """The verified entry from the highest tier holding it, or None. Blocks on I/O."""
        for i, tier in enumerate(self.tiers):
            st = self.stats.tiers[tier.name]
            t0 = time.perf_counter()
            try:
                raw = tier.read(key)
            except KeyError:
                continue
            except Exception as e:  # a tier failing must not fail the request
                st.errors += 1
                log.warning("kvcache: reading %s from %s failed: %s", key, tier.name, e)
                continue
            try:
                info, payload = decode(raw, self.namespace, key, self.signing_key)
            except CorruptEntry as e:
                st.corrupt += 1
                log.warning("kvcache: dropping bad entry %s in %s: %s", key, tier.name, e)
                self._forget(i, key)
                tier.delete(key)
                continue
            st.hits += 1
            st.bytes_read += len(payload) + HEADER_SIZE
            st.load_seconds += time.perf_counter() - t0
            if self.policies is not None:
                with self._lock:
                    self.policies[i].touch(key)
                if promote and i > 0:
                    self._submit(self._promote, key, raw, info.parent)
            return Entry(key, info, payload, i, raw)
        if self.tiers:
            self.stats.tiers[self.tiers[0].name].misses += 1
        return None

    def get_async(self, key: str) -> Future:
        """``get`` on an I/O thread."""
        assert self._io is not None, "lookup-only store"
        return self._io.submit(self.get, key)

    # -- writes (write-behind) -------------------------------------------------
    def put(self, key: str, parent: Optional[str], dtype: str, shape: Sequence[int], payload: Buffer) -> bool:
        """Queue ``payload`` for the top tier; returns at once. The caller must not
        change ``payload`` afterwards. False when the queue is full (the entry is
        dropped: a future miss, never a stall)."""
        assert self._io is not None, "lookup-only store"
        nbytes = memoryview(payload).nbytes
        with self._lock:
            if self._pending_bytes + nbytes > self._max_pending:
                self.stats.dropped_writes += 1
                return False
            self._pending_bytes += nbytes
        fut = self._submit(self._write_new, key, parent, dtype, tuple(shape), payload)
        fut.add_done_callback(lambda _f: self._unpend(nbytes))
        return True

    def _unpend(self, nbytes: int) -> None:
        with self._lock:
            self._pending_bytes -= nbytes

    def _submit(self, fn, *args) -> Future:
        fut = self._writer.submit(self._guard, fn, *args)
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

    def _write_new(self, key, parent, dtype, shape, payload) -> None:
        if any(t.contains(key) for t in self.tiers):
            return
        header = encode_header(self.namespace, key, dtype, shape, payload, self.signing_key, parent)
        self._store(0, key, parent, [header, payload])

    def _promote(self, key, raw, parent) -> None:
        if not self.tiers[0].contains(key):
            self._store(0, key, parent, [raw])
            self.stats.tiers[self.tiers[0].name].promotions += 1

    def _store(self, i: int, key: str, parent: Optional[str], parts: list) -> bool:
        """Write into tier ``i`` if its policy admits it, evicting (and demoting) to make room."""
        tier, policy = self.tiers[i], self.policies[i]
        st = self.stats.tiers[tier.name]
        nbytes = sum(memoryview(p).nbytes for p in parts)
        if tier.capacity is not None and nbytes > tier.capacity:
            st.rejected += 1
            return False
        with self._lock:
            admitted = policy.admit(key, parent, nbytes)
        if not admitted:
            st.rejected += 1
            return False
        rescanned = False
        while not tier.reserve(nbytes):
            with self._lock:
                victim = policy.victim()
                if victim is not None:
                    policy.remove(victim)
            if victim is None:
                if rescanned:   # still full of entries we cannot evict: skip this write
                    st.rejected += 1
                    return False
                self._adopt(i)
                rescanned = True
                continue
            self._evict(i, victim)
        try:
            published = tier.write(key, parts, nbytes)
        except Exception as e:
            st.errors += 1
            log.warning("kvcache: writing %s to %s failed: %s", key, tier.name, e)
            return False
        if published:
            st.writes += 1
            st.bytes_written += nbytes
            with self._lock:
                policy.insert(key, parent, nbytes)
        return published

    def _evict(self, i: int, victim: str) -> None:
        """Remove ``victim`` from tier ``i``; hand its bytes to the next tier down."""
        tier = self.tiers[i]
        raw = None
        if i + 1 < len(self.tiers) and not self.tiers[i + 1].contains(victim):
            try:
                raw = tier.read(victim)  # (an mmap stays valid after the unlink below)
            except KeyError:
                raw = None
        tier.delete(victim)
        self.stats.tiers[tier.name].evictions += 1
        if raw is not None:
            try:
                parent = read_header(raw, self.namespace, victim).parent
            except CorruptEntry:
                return
            if self._store(i + 1, victim, parent, [raw]):
                self.stats.tiers[tier.name].demotions += 1

    def _forget(self, i: int, key: str) -> None:
        if self.policies is not None:
            with self._lock:
                self.policies[i].remove(key)

    def _adopt(self, i: int) -> None:
        """Teach tier ``i``'s policy the entries already there (restart, other engines)."""
        for key, size in self.tiers[i].scan():
            with self._lock:
                if key not in self.policies[i]:
                    self.policies[i].insert(key, None, size)

    # -- lifecycle -------------------------------------------------------------
    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until queued writes (and the promotions/demotions they cause) are done."""
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

    def close(self, timeout: Optional[float] = 10.0) -> None:
        if self._io is not None:
            self.flush(timeout)
            self._io.shutdown(wait=False, cancel_futures=True)
            self._writer.shutdown(wait=False, cancel_futures=True)
        for t in self.tiers:
            t.close()

    def check(self) -> None:
        """Invariants, for tests: bounds hold and every tracked key is present."""
        for i, tier in enumerate(self.tiers):
            used = tier.used_bytes()
            if tier.capacity is not None:
                assert used <= tier.capacity, f"{tier.name}: {used} > {tier.capacity}"
            present = dict(tier.scan())
            assert sum(present.values()) <= (tier.capacity or float("inf"))
            if self.policies is not None:
                with self._lock:
                    tracked = [k for k in present if k in self.policies[i]]
                assert len(tracked) == len(present), f"{tier.name}: untracked entries"
