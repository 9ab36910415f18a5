"""The shared tier (L3): one folder of entries on a filesystem that every node sees.

The filesystem comes from ``cache.tiers.transport`` (Curvine's SDK, a Curvine FUSE/CSI
mount, any fsspec URL); every call to it goes through ``cache.tiers.resilience`` (own
daemon threads, a deadline, a circuit breaker, an optional bandwidth cap). The folder
layout is the local tiers' (``cache.tiers.layout``): ``ROOT/<namespace>/<key[:2]>/<key>``.

Rules of a shared namespace (docs/curvine.md, "How it behaves"): entries are write-once
and content-addressed, published atomically (a unique temporary name, then a rename);
two nodes writing one key at once is harmless; nothing read here is trusted (the store
decodes and verifies every entry; a rejected one is ignored for a while, never deleted);
space is Curvine's to manage (quota, TTL): ``capacity`` is None.

Never blocking serving: ``contains`` answers from memory (``cache.tiers.shared_index``),
the keys known to be present, learnt from a background listing (every ``refresh_s``), from this process's
writes and reads, and from existence checks that ``probe`` starts in the background for
keys the scheduler asks about. ``probe`` says whether answers are still pending, so the
scheduler can defer a request (bounded) instead of waiting in its loop; ``knows_contents``
says whether a listing has completed (before, ``contains`` misses what others wrote).
While the tier is down (breaker open) ``contains`` and ``probe`` say no and calls fail
fast with ``SharedUnavailable`` (writes are skipped).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator, Optional, Sequence

from cache.codec import CorruptEntry
from cache.placed import LoadEnded
from cache.tiers.base import Buffer, Tier
from cache.tiers.layout import TMP_MARK, entry_path, is_key, temp_path
from cache.tiers.resilience import DaemonPool, Guard, Pacer, SharedUnavailable
from cache.tiers.shared_index import SharedIndex
from cache.tiers.transport import FsOps, ops_for

STALE_TMP_SECONDS = 3600  # a temporary file this old is a crashed writer's debris
WAVE = 16  # existence checks sent at once for one chain
WRITE_BYTES_PER_SECOND = 50e6  # a write's deadline grows by its size at this rate


class SharedTier(Tier):
    shared = True  # the store publishes to it by rule and never evicts from it
    capacity = None  # space is the backend's to manage (Curvine quota and TTL)

    def __init__(
        self,
        opener: Callable[[], object],
        root: str,
        namespace: str,
        *,
        name: str = "shared",
        timeout_s: float = 2.0,
        refresh_s: float = 30.0,
        io_threads: int = 8,
        failure_threshold: int = 3,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        label: Optional[str] = None,
        pacer: Optional[Pacer] = None,
        thread_setup: Optional[Callable[[str], None]] = None,
    ) -> None:
        """``opener`` returns the filesystem (fsspec's or Curvine's); it is called
        lazily, on an I/O thread, so an unreachable cluster never stalls start-up.
        ``pacer``, if given, holds entry reads and writes to its byte rate.
        ``thread_setup(role)`` runs first on each of the tier's threads (role "shared"):
        in a vLLM CPU worker it moves them off the compute cores, which they would
        otherwise inherit from the thread that builds the tier."""
        self.name = name
        self.root = root.rstrip("/")
        self.folder = f"{self.root}/{namespace}"
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        self._opener = opener
        self._ops: Optional[FsOps] = None
        self._open_lock = threading.Lock()
        self._clock = clock
        self._setup = (lambda: thread_setup("shared")) if thread_setup is not None else None
        self._guard = Guard(
            name,
            label or self.root,
            timeout_s=timeout_s,
            io_threads=io_threads,
            failure_threshold=failure_threshold,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            clock=clock,
            setup=self._setup,
        )
        self.health = self._guard.health
        self._breaker = self._guard.breaker
        self._prober = DaemonPool(1, f"kvcache-{name}-probe", self._setup)
        self._lock = threading.Lock()
        self.index = SharedIndex(clock)  # what this process knows the tier holds
        self._dirs: set[str] = set()
        self._used = 0
        self._stop = threading.Event()
        self._refresher: Optional[threading.Thread] = None
        self._listed = threading.Event()  # a background listing completed
        self._pacer = pacer

    # -- calls (on the guard's threads) ---------------------------------------------
    def ops(self) -> FsOps:
        """The backend's filesystem operations, opened on first use (on the guard's threads)."""
        if self._ops is None:
            with self._open_lock:
                if self._ops is None:
                    self._ops = ops_for(self._opener())
        return self._ops

    def _do(self, op: str, *args):
        if op == "read_with":
            return self._read_with(*args)
        if self._pacer is None or op not in ("read", "write"):
            return getattr(self.ops(), op)(*args)
        started = self._clock()
        result = getattr(self.ops(), op)(*args)
        self._pacer.take(len(result) if op == "read" else sum(memoryview(p).nbytes for p in args[1]), started)
        return result

    def call(self, op: str, *args, timeout: Optional[float] = None):
        """One filesystem call (``FsOps``) through the guard: deadline, breaker, pacer."""
        return self._guard.call(op, self._do, op, *args, timeout=timeout)

    # -- what this process knows -----------------------------------------------
    def path(self, key: str) -> str:
        return entry_path(self.folder, key)

    def reject(self, key: str) -> None:
        """Ignore ``key`` for a while: its entry failed verification here. The entry is
        left in place (it may be valid for a node with another signing key)."""
        self.index.reject(key)

    @property
    def up(self) -> bool:
        return self._breaker.up

    @property
    def available(self) -> bool:
        """Up, or down with a retry due: worth handing a write (a failed trial only
        lengthens the backoff)."""
        return not self._breaker.waiting()

    # -- Tier protocol ------------------------------------------------------------
    def contains(self, key: str) -> bool:
        """From memory only (never I/O): known present, tier up, not rejected."""
        return self._breaker.up and self.index.contains(key)

    def knows_contents(self) -> bool:
        """True once a background listing completed (it starts one now)."""
        self._start_refresh()
        return self._listed.is_set()

    def probe(self, keys: Sequence[str]) -> bool:
        """Start background existence checks for the chain ``keys`` (in order) and say
        whether answers are still pending. Cheap; called on the scheduler path."""
        self._start_refresh()
        if self._breaker.waiting():
            return False  # down: nothing will come
        batch, pending = self.index.to_check(keys)
        if batch:
            self._prober.submit(self._check_chain, batch)
        return pending or bool(batch)

    def _check_chain(self, keys: list[str]) -> None:
        """Existence checks, ``WAVE`` at a time, up to the first absent key."""
        try:
            for start in range(0, len(keys), WAVE):
                wave = keys[start : start + WAVE]
                futures = [self._guard.submit(self._do, "exists", self.path(k)) for k in wave]
                deadline = time.monotonic() + self.timeout_s
                present = [bool(self._guard.wait(f, "exists", deadline - time.monotonic())) for f in futures]
                for k, p in zip(wave, present):
                    if p:
                        self.index.learn(k)
                    else:
                        self.index.absent(k)
                if not all(present):
                    return
        except (SharedUnavailable, TimeoutError):
            return  # counted by the breaker; the scheduler answers with what is known
        finally:
            self.index.checked(keys)

    def recheck(self, keys: Sequence[str]) -> None:
        self.index.recheck(keys)

    def read(self, key: str) -> Buffer:
        try:
            data = self.call("read", self.path(key))
        except FileNotFoundError:
            self.index.forget(key)
            raise KeyError(key) from None
        self.index.learn(key)
        return data

    reads_in_place = True

    def read_with(self, key: str, use):
        """``use(reader)`` on one of the tier's I/O threads, within its deadline (past it:
        ``TimeoutError``, and ``use`` may still be running there). What ``use`` raises
        about the entry or its caller (``CorruptEntry``, ``ValueError``, ``LoadEnded``)
        is raised here and does not count against the tier."""
        try:
            result, refused = self.call("read_with", self.path(key), use)
        except FileNotFoundError:
            self.index.forget(key)
            raise KeyError(key) from None
        self.index.learn(key)
        if refused is not None:
            raise refused
        return result

    def _read_with(self, path: str, use):
        readers = []

        def counted(reader):
            readers.append(reader)
            try:
                return use(reader), None
            except (CorruptEntry, ValueError, LoadEnded) as e:
                return None, e

        started = self._clock()
        try:
            return self.ops().read_with(path, counted)
        finally:
            if self._pacer is not None and readers:
                self._pacer.take(readers[0].nread, started)

    def write(self, key: str, parts: Sequence[Buffer], nbytes: int) -> bool:
        final = self.path(key)
        if self.call("exists", final):
            self.index.learn(key)
            return False
        shard = final.rsplit("/", 1)[0]
        if shard not in self._dirs:
            self.call("makedirs", shard)
            self._dirs.add(shard)
        tmp = temp_path(final)
        timeout = self.timeout_s + nbytes / WRITE_BYTES_PER_SECOND
        try:
            try:
                self.call("write", tmp, list(parts), timeout=timeout)
            except FileNotFoundError:  # the folder was removed behind our back: make it again
                self._dirs.clear()
                self.call("makedirs", shard)
                self._dirs.add(shard)
                self.call("write", tmp, list(parts), timeout=timeout)
            try:
                self.call("rename", tmp, final)
            except SharedUnavailable:
                if not self.call("exists", final):
                    raise
                self.index.learn(key)  # another node published it first: harmless
                self._discard(tmp)
                return False
        except BaseException:
            self._discard(tmp)
            raise
        self.index.learn(key)
        with self._lock:
            self._used += nbytes
        return True

    def _discard(self, tmp: str) -> None:
        """Remove a temporary file in the background; ``scan`` catches what is left."""
        self._guard.background(self._do, "remove", tmp)

    def delete(self, key: str) -> int:
        path = self.path(key)
        try:
            size = self.call("size", path)
            self.call("remove", path)
        except FileNotFoundError:
            size = 0
        self.index.forget(key)
        with self._lock:
            self._used = max(0, self._used - size)
        return size

    def reserve(self, nbytes: int, key: Optional[str] = None) -> bool:
        return True  # the backend enforces its quota

    def release(self, nbytes: int) -> None:
        return

    def used_bytes(self) -> int:
        """Bytes this process published (and did not delete); the cluster's total is
        Curvine's business (``cv fs du``)."""
        return self._used

    def scan(self) -> Iterator[tuple[str, int]]:
        """Every entry of this namespace, as ``(key, size)``. Lists the whole folder (so
        does the background refresh): not for the request path."""
        return iter(self._entries())

    def _entries(self) -> list[tuple[str, int]]:
        """List the namespace folder; remove temporary files that crashed writers left."""
        try:
            listing = self.call("list_tree", self.folder, timeout=max(30.0, 10 * self.timeout_s))
        except FileNotFoundError:
            return []
        entries, now = [], time.time()
        for name, size, mtime in listing:
            if is_key(name):
                entries.append((name, size))
            elif TMP_MARK in name and mtime and now - mtime > STALE_TMP_SECONDS:
                self._discard(self.path(name))
        return entries

    # -- background listing -------------------------------------------------------
    def _start_refresh(self) -> None:
        if self._refresher is None and self.refresh_s > 0:
            with self._lock:
                if self._refresher is None:
                    self._refresher = threading.Thread(
                        target=self._refresh_loop, daemon=True, name=f"kvcache-{self.name}-list"
                    )
                    self._refresher.start()

    def _refresh_loop(self) -> None:
        if self._setup is not None:
            self._setup()
        delay = 0.0
        while not self._stop.wait(delay):
            delay = self.refresh_s
            if self._breaker.waiting():
                continue
            self.index.listing_started()
            try:
                names: Optional[set[str]] = {key for key, _size in self._entries()}
            except (SharedUnavailable, TimeoutError):
                names = None
            self.index.listing_done(names)
            if names is not None:
                self._listed.set()

    def close(self) -> None:
        self._stop.set()
        self._guard.shutdown()
        self._prober.shutdown()
