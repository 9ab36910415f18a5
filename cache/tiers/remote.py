"""The shared tier (L3): one folder of entries on a filesystem that every node sees.

Backends, chosen by ``KVCACHE_REMOTE_URL`` (``make_remote_tier``):
- ``curvine://PATH``: a Curvine cluster through its Python SDK (``curvinefs``), set up by
  the cluster's client file ``KVCACHE_CURVINE_CONF``; no FUSE mount needed, so it works on
  plain SageMaker endpoints. The SDK is imported only for this scheme.
- ``file:///mnt/curvine/PATH``: Curvine mounted as a POSIX path (FUSE, or the CSI
  driver's PVC on HyperPod).
- any other fsspec URL whose filesystem is installed (``memory://``, ``s3://`` ...).

Layout, the same as the local tiers': ``ROOT/<namespace>/<key[:2]>/<key>``.

Rules of a shared namespace:
- Entries are write-once and content-addressed (a key names one token prefix of one
  model/layout/rank). A write is published atomically: the bytes go to a unique
  temporary name in the key's folder, then are renamed into place. A POSIX rename (a
  Curvine FUSE/CSI mount) and Curvine's native rename are atomic. Backends without an
  atomic rename implement it as copy + delete (object stores: the copy still lands as a
  whole object); where even that could expose a short file, the entry header's length and
  checksum reject it on read.
- Two nodes writing one key at once is harmless: both entries are whole and valid, the
  last rename wins.
- Nothing read here is trusted: the store decodes every entry (namespace, key, checksum,
  HMAC signature). A rejected entry is never deleted from the shared folder (a node with
  another signing key, or a write in flight on a non-atomic backend, looks the same); it
  is only ignored by this process for a while (``reject``).
- Space is Curvine's to manage (quota, TTL): ``capacity`` is None.

Never blocking serving:
- ``contains`` answers from memory: a set of keys known to be present, learnt from a
  background listing (every ``refresh_s``), from this process's writes and reads, and
  from existence checks that ``probe`` starts in the background for keys the scheduler
  asks about. ``probe`` says whether answers are still pending, so the scheduler can
  defer a request (bounded) instead of waiting in its loop.
- Every filesystem call runs on this tier's own daemon threads with a deadline
  (``timeout_s``; writes get a size allowance on top). A call past it raises
  ``TimeoutError``; its thread finishes in the background.
- A circuit breaker: after ``failure_threshold`` consecutive failures the tier is down.
  That is logged once; while down, ``contains`` and ``probe`` say no and calls fail fast
  with ``RemoteUnavailable`` (so writes are skipped); one call is let through after a
  backoff that doubles up to ``max_backoff_s``, and its success brings the tier back
  (logged once).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import socket
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

from cache.config import CacheConfig, ConfigError
from cache.tiers.base import Buffer, Tier

log = logging.getLogger(__name__)

TMP_MARK = ".tmp-"
STALE_TMP_SECONDS = 3600     # a temporary file this old is a crashed writer's debris
WAVE = 16                    # existence checks sent at once for one chain
ABSENT_TTL_SECONDS = 5.0     # a key found absent is not asked about again for this long
REJECT_SECONDS = 600.0       # a rejected (bad or foreign) entry is ignored this long
MAX_KNOWN = 2_000_000        # bound on the in-memory key set (~200 MB at most)
MAX_REMEMBERED = 100_000     # bound on the absent/rejected maps
WRITE_BYTES_PER_SECOND = 50e6  # a write's deadline grows by its size at this rate
CURVINE_WRITE_CHUNK = 4 << 20  # the SDK's write buffer size, and bytes copied per call
_KEY = re.compile(r"[0-9a-f]{32}")


class RemoteUnavailable(ConnectionError):
    """The shared tier is down (breaker open), or a call to it failed."""


@dataclass
class RemoteHealth:
    """Counters of this tier's own calls (the store counts hits and writes)."""

    failures: int = 0   # calls that raised or ran past their deadline
    timeouts: int = 0   # of which past the deadline
    outages: int = 0    # times the tier went down
    skipped: int = 0    # calls refused while down


class _Breaker:
    """Consecutive failures open it; one trial per backoff window; a success closes it."""

    def __init__(self, label: str, health: RemoteHealth, clock, threshold: int,
                 backoff_s: float, max_backoff_s: float) -> None:
        self.label, self.health, self.clock = label, health, clock
        self.threshold, self.base, self.cap = threshold, backoff_s, max_backoff_s
        self._lock = threading.Lock()
        self._streak = 0
        self._down_since: Optional[float] = None
        self._backoff = backoff_s
        self._retry_at = 0.0
        self._trial = False  # a call was let through since the last backoff began

    @property
    def up(self) -> bool:
        return self._down_since is None

    def waiting(self) -> bool:
        """Down, and the next trial is not due yet."""
        return self._down_since is not None and self.clock() < self._retry_at

    def allow(self) -> bool:
        with self._lock:
            if self._down_since is None:
                return True
            now = self.clock()
            if now < self._retry_at:
                return False
            self._retry_at = now + self._backoff  # one trial per window
            self._trial = True
            return True

    def success(self) -> None:
        with self._lock:
            self._streak = 0
            if self._down_since is None:
                return
            down_for = self.clock() - self._down_since
            self._down_since, self._backoff = None, self.base
        log.warning("kvcache: shared tier %s is reachable again (down %.0f s)", self.label, down_for)

    def failure(self, err: BaseException) -> None:
        with self._lock:
            self.health.failures += 1
            self._streak += 1
            now = self.clock()
            if self._down_since is not None:
                if self._trial:  # the trial failed: wait longer (calls begun earlier do not count)
                    self._trial = False
                    self._backoff = min(self.cap, self._backoff * 2)
                    self._retry_at = now + self._backoff
                return
            if self._streak < self.threshold:
                log.debug("kvcache: shared tier %s: %s", self.label, err)
                return
            self._down_since, self._backoff, self._retry_at = now, self.base, now + self.base
            self._trial = False
            self.health.outages += 1
        log.warning("kvcache: shared tier %s unreachable (%s: %s); serving from the local tiers "
                    "and retrying with backoff (%.0f s to %.0f s)",
                    self.label, type(err).__name__, err, self.base, self.cap)


class _DaemonPool:
    """A fixed set of daemon threads: a call stuck in the network never holds up exit."""

    def __init__(self, n: int, name: str) -> None:
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._closed = False
        for i in range(n):
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True).start()
        self._n = n

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        if self._closed:
            fut.set_exception(RemoteUnavailable("tier closed"))
        else:
            self._q.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the waiter
                fut.set_exception(e)

    def shutdown(self) -> None:
        self._closed = True
        for _ in range(self._n):
            self._q.put(None)


class Pacer:
    """Holds transfers to ``rate`` bytes per second, as one link would: each transfer
    ends no sooner than ``nbytes / rate`` after the previous one ended (or after it
    started, when the link was idle). Called on the tier's I/O threads, after the bytes
    moved; it sleeps out the difference (within the call's deadline)."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate = float(rate)
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the link has sent everything handed to it so far

    def take(self, nbytes: int, started: Optional[float] = None) -> None:
        now = self._clock()
        with self._lock:
            begin = max(self._free_at, now if started is None else started)
            self._free_at = begin + nbytes / self.rate
            wait = self._free_at - now
        if wait > 0:
            self._sleep(wait)


class RemoteTier(Tier):
    shared = True      # the store publishes to it by rule and never evicts from it
    capacity = None    # space is the backend's to manage (Curvine quota and TTL)

    def __init__(
        self,
        opener: Callable[[], object],
        root: str,
        namespace: str,
        *,
        name: str = "remote",
        timeout_s: float = 2.0,
        refresh_s: float = 30.0,
        io_threads: int = 8,
        failure_threshold: int = 3,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        label: Optional[str] = None,
        bandwidth: int = 0,
    ) -> None:
        """``opener`` returns the fsspec filesystem; it is called lazily, on an I/O
        thread, so an unreachable cluster never stalls start-up. ``bandwidth`` (bytes
        per second, 0: none) paces entry reads and writes (``Pacer``)."""
        self.name = name
        self.root = root.rstrip("/")
        self.folder = f"{self.root}/{namespace}"
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        self.health = RemoteHealth()
        self._opener = opener
        self._ops: Optional[_FsOps] = None
        self._open_lock = threading.Lock()
        self._clock = clock
        self._breaker = _Breaker(label or self.root, self.health, clock, failure_threshold,
                                 backoff_s, max_backoff_s)
        self._pool = _DaemonPool(io_threads, f"kvcache-{name}")
        self._prober = _DaemonPool(1, f"kvcache-{name}-probe")
        self._lock = threading.Lock()
        self._known: set[str] = set()
        self._absent: OrderedDict[str, float] = OrderedDict()  # key -> ask again after
        self._rejected: dict[str, float] = {}                    # key -> ignore until
        self._checking: set[str] = set()
        self._delta: Optional[tuple[set, set]] = None  # (added, removed) during a listing
        self._dirs: set[str] = set()
        self._used = 0
        self._host = socket.gethostname()
        self._stop = threading.Event()
        self._refresher: Optional[threading.Thread] = None
        self._pacer = Pacer(bandwidth) if bandwidth > 0 else None

    # -- calls with a deadline and the breaker ----------------------------------
    def _fs(self) -> "_FsOps":
        if self._ops is None:
            with self._open_lock:
                if self._ops is None:
                    self._ops = _ops_for(self._opener())
        return self._ops

    def _do(self, op: str, *args):
        if self._pacer is None or op not in ("read", "write"):
            return getattr(self._fs(), op)(*args)
        started = self._clock()
        result = getattr(self._fs(), op)(*args)
        self._pacer.take(len(result) if op == "read" else sum(memoryview(p).nbytes for p in args[1]), started)
        return result

    def _submit(self, op: str, *args) -> Future:
        if not self._breaker.allow():
            self.health.skipped += 1
            raise RemoteUnavailable(f"shared tier {self._breaker.label} is down")
        return self._pool.submit(self._do, op, *args)

    def _wait(self, fut: Future, op: str, timeout: float):
        try:
            result = fut.result(timeout=max(0.0, timeout))
        except FutureTimeout:
            fut.cancel()  # not started yet: never start it
            self.health.timeouts += 1
            err = TimeoutError(f"{self.name}: {op} took longer than {timeout:.3g} s")
            self._breaker.failure(err)
            raise err from None
        except FileNotFoundError:
            self._breaker.success()  # the backend answered: the entry is not there
            raise
        except Exception as e:
            self._breaker.failure(e)
            raise RemoteUnavailable(f"{self.name}: {op} failed: {type(e).__name__}: {e}") from e
        self._breaker.success()
        return result

    def _call(self, op: str, *args, timeout: Optional[float] = None):
        fut = self._submit(op, *args)
        return self._wait(fut, op, self.timeout_s if timeout is None else timeout)

    # -- what this process knows -----------------------------------------------
    def _path(self, key: str) -> str:
        return f"{self.folder}/{key[:2]}/{key}"

    def _learn(self, key: str) -> None:
        with self._lock:
            if len(self._known) < MAX_KNOWN:
                self._known.add(key)
            self._absent.pop(key, None)
            if self._delta is not None:
                self._delta[0].add(key)
                self._delta[1].discard(key)

    def _forget(self, key: str) -> None:
        with self._lock:
            self._known.discard(key)
            if self._delta is not None:
                self._delta[1].add(key)
                self._delta[0].discard(key)

    def _is_rejected(self, key: str) -> bool:
        until = self._rejected.get(key)
        return until is not None and until > self._clock()

    def reject(self, key: str) -> None:
        """Ignore ``key`` for a while: its entry failed verification here. The entry is
        left in place (it may be valid for a node with another signing key)."""
        with self._lock:
            if len(self._rejected) >= MAX_REMEMBERED:
                now = self._clock()
                self._rejected = {k: t for k, t in self._rejected.items() if t > now}
            self._rejected[key] = self._clock() + REJECT_SECONDS
            self._known.discard(key)

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
        return key in self._known and self._breaker.up and not (
            self._rejected and self._is_rejected(key))

    def probe(self, keys: Sequence[str]) -> bool:
        """Start background existence checks for the chain ``keys`` (in order) and say
        whether answers are still pending. Cheap; called on the scheduler path."""
        self._start_refresh()
        if self._breaker.waiting():
            return False  # down: nothing will come
        batch, pending = [], False
        now = self._clock()
        with self._lock:
            for k in keys:
                if k in self._known:
                    continue
                if self._absent.get(k, 0.0) > now or (self._rejected and self._is_rejected(k)):
                    break  # the chain stops here
                if k in self._checking:
                    pending = True
                    continue
                batch.append(k)
            self._checking.update(batch)
        if batch:
            self._prober.submit(self._check_chain, batch)
        return pending or bool(batch)

    def _check_chain(self, keys: list[str]) -> None:
        """Existence checks, ``WAVE`` at a time, up to the first absent key."""
        try:
            for start in range(0, len(keys), WAVE):
                wave = keys[start:start + WAVE]
                futures = [self._submit("exists", self._path(k)) for k in wave]
                deadline = time.monotonic() + self.timeout_s
                present = [bool(self._wait(f, "exists", deadline - time.monotonic())) for f in futures]
                for k, p in zip(wave, present):
                    if p:
                        self._learn(k)
                    else:
                        self._note_absent(k)
                if not all(present):
                    return
        except (RemoteUnavailable, TimeoutError):
            return  # counted by the breaker; the scheduler answers with what is known
        finally:
            with self._lock:
                self._checking.difference_update(keys)

    def recheck(self, keys: Sequence[str]) -> None:
        with self._lock:
            for k in keys:
                self._absent.pop(k, None)

    def _note_absent(self, key: str) -> None:
        with self._lock:
            self._absent[key] = self._clock() + ABSENT_TTL_SECONDS
            self._absent.move_to_end(key)
            while len(self._absent) > MAX_REMEMBERED:
                self._absent.popitem(last=False)

    def read(self, key: str) -> Buffer:
        try:
            data = self._call("read", self._path(key))
        except FileNotFoundError:
            self._forget(key)
            raise KeyError(key) from None
        self._learn(key)
        return data

    def write(self, key: str, parts: Sequence[Buffer], nbytes: int) -> bool:
        final = self._path(key)
        if self._call("exists", final):
            self._learn(key)
            return False
        shard = final.rsplit("/", 1)[0]
        if shard not in self._dirs:
            self._call("makedirs", shard)
            self._dirs.add(shard)
        tmp = f"{final}{TMP_MARK}{self._host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self._call("write", tmp, list(parts), timeout=self.timeout_s + nbytes / WRITE_BYTES_PER_SECOND)
            try:
                self._call("rename", tmp, final)
            except RemoteUnavailable:
                if not self._call("exists", final):
                    raise
                self._learn(key)  # another node published it first: harmless
                self._discard(tmp)
                return False
        except BaseException:
            self._discard(tmp)
            raise
        self._learn(key)
        with self._lock:
            self._used += nbytes
        return True

    def _discard(self, tmp: str) -> None:
        """Remove a temporary file in the background; ``scan`` catches what is left."""
        self._pool.submit(_quietly, self._do, "remove", tmp)

    def delete(self, key: str) -> int:
        path = self._path(key)
        try:
            size = self._call("size", path)
            self._call("remove", path)
        except FileNotFoundError:
            size = 0
        self._forget(key)
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
            listing = self._call("list_tree", self.folder, timeout=max(30.0, 10 * self.timeout_s))
        except FileNotFoundError:
            return []
        entries, now = [], time.time()
        for name, size, mtime in listing:
            if _KEY.fullmatch(name):
                entries.append((name, size))
            elif TMP_MARK in name and mtime and now - mtime > STALE_TMP_SECONDS:
                self._discard(f"{self.folder}/{name[:2]}/{name}")
        return entries

    # -- background listing -------------------------------------------------------
    def _start_refresh(self) -> None:
        if self._refresher is None and self.refresh_s > 0:
            with self._lock:
                if self._refresher is None:
                    self._refresher = threading.Thread(target=self._refresh_loop, daemon=True,
                                                       name=f"kvcache-{self.name}-list")
                    self._refresher.start()

    def _refresh_loop(self) -> None:
        delay = 0.0
        while not self._stop.wait(delay):
            delay = self.refresh_s
            if self._breaker.waiting():
                continue
            with self._lock:
                self._delta = (set(), set())
            try:
                names = {key for key, _size in self._entries()}
            except (RemoteUnavailable, TimeoutError):
                names = None
            with self._lock:
                added, removed = self._delta
                self._delta = None
                if names is not None:
                    fresh = (names - removed) | added
                    if len(fresh) > MAX_KNOWN:
                        fresh = set(list(fresh)[:MAX_KNOWN])
                    self._known = fresh

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown()
        self._prober.shutdown()


def _quietly(fn, *args):
    try:
        fn(*args)
    except Exception:
        pass


def _mtime(info: dict) -> float:
    """Seconds since the epoch from an fsspec info dict (0 when unknown)."""
    for field in ("mtime", "created", "LastModified", "last_modified"):
        value = info.get(field)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return value.timestamp()
        try:
            value = float(value)
        except (TypeError, ValueError):
            continue
        return value / 1000 if value > 1e11 else value  # Curvine reports milliseconds
    return 0.0


class _FsOps:
    """The few calls the tier makes, over a filesystem that implements fsspec fully."""

    def __init__(self, fs) -> None:
        self.fs = fs

    def read(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def write(self, path: str, parts: list) -> None:
        with self.fs.open(path, "wb") as f:
            for p in parts:
                f.write(memoryview(p).cast("B"))

    def rename(self, src: str, dst: str) -> None:
        self.fs.mv(src, dst)

    def remove(self, path: str) -> None:
        self.fs.rm_file(path)

    def ls(self, path: str) -> list[dict]:
        try:
            return self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []

    def list_tree(self, folder: str) -> list[tuple[str, int, float]]:
        """``(name, size, mtime)`` of every file one folder below ``folder``."""
        out = []
        for shard in self.ls(folder):
            if shard.get("type") != "directory":
                continue
            for e in self.ls(shard["name"]):
                if e.get("type") != "directory":
                    out.append((e["name"].rstrip("/").rsplit("/", 1)[-1], int(e.get("size") or 0), _mtime(e)))
        return out


class _CurvineOps(_FsOps):
    """Curvine's ``CurvineFileSystem`` implements part of fsspec: no ``open(..., "wb")``,
    ``makedirs`` or ``pipe``, and ``exists``/``cat_file`` report an unreachable cluster
    as a missing file. It offers ``create``/``mkdir``/``rename``/``rm`` instead."""

    def exists(self, path: str) -> bool:
        return self.fs.get_file_status(path) is not None

    def size(self, path: str) -> int:
        status = self.fs.get_file_status(path)
        if status is None:
            raise FileNotFoundError(path)
        return int(status["len"])

    def makedirs(self, path: str) -> None:
        try:
            self.fs.mkdir(path, True)
        except OSError:
            if self.fs.get_file_status(path) is None:
                raise

    def write(self, path: str, parts: list) -> None:
        writer = self.fs.create(path, True)
        try:
            for p in parts:
                view = memoryview(p).cast("B")
                for off in range(0, len(view), CURVINE_WRITE_CHUNK):
                    writer.write(bytes(view[off:off + CURVINE_WRITE_CHUNK]))
        finally:
            writer.close()

    def rename(self, src: str, dst: str) -> None:
        self.fs.rename(src, dst)

    def remove(self, path: str) -> None:
        if self.fs.get_file_status(path) is None:
            raise FileNotFoundError(path)
        self.fs.rm(path)


def _ops_for(fs) -> _FsOps:
    return _CurvineOps(fs) if type(fs).__name__ == "CurvineFileSystem" else _FsOps(fs)


# -- from the configuration ------------------------------------------------------
def make_remote_tier(config: CacheConfig, namespace_id: str) -> RemoteTier:
    """The shared tier ``KVCACHE_REMOTE_URL`` names. Raises ``ConfigError`` for a URL
    whose filesystem is missing or unknown; never touches the network."""
    url = config.remote_url
    if config.remote_timeout_ms <= 0:
        raise ConfigError(f"KVCACHE_REMOTE_TIMEOUT_MS={config.remote_timeout_ms} must be above 0")
    if url.startswith("curvine://"):
        opener, root = _curvine(url, config.curvine_conf)
    else:
        opener, root = _fsspec(url)
    return RemoteTier(opener, root, namespace_id, timeout_s=config.remote_timeout_ms / 1000, label=url,
                      bandwidth=config.remote_bandwidth)


def _curvine(url: str, conf: str):
    if not conf:
        raise ConfigError(f"KVCACHE_REMOTE_URL={url!r} needs KVCACHE_CURVINE_CONF: the path of the "
                          "Curvine cluster's client configuration (curvine-cluster.toml)")
    if not os.path.isfile(conf):
        raise ConfigError(f"KVCACHE_CURVINE_CONF={conf!r} is not a file")
    try:
        from curvinefs import CurvineFileSystem
    except ImportError as e:
        raise ConfigError(
            f"KVCACHE_REMOTE_URL={url!r} needs Curvine's Python SDK (package curvinefs, built "
            f"from the Curvine sources with maturin), which this image lacks ({e}); install it, "
            "or mount Curvine (FUSE/CSI) and use file:///MOUNT/PATH") from None
    root = "/" + url[len("curvine://"):].strip("/")
    return (lambda: CurvineFileSystem(config_path=conf, write_chunk_size=CURVINE_WRITE_CHUNK,
                                      write_chunk_num=2)), root


def _fsspec(url: str):
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url)
    except ImportError as e:
        raise ConfigError(f"KVCACHE_REMOTE_URL={url!r}: the filesystem for this URL is not "
                          f"installed ({e})") from None
    except ValueError as e:
        raise ConfigError(f"KVCACHE_REMOTE_URL={url!r} is not a URL fsspec knows ({e}); use "
                          "curvine://PATH, file:///MOUNT/PATH or another fsspec URL") from None
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "file" in protocols or "local" in protocols:
        parent = os.path.dirname(root.rstrip("/")) or "/"
        if not os.path.isdir(parent):
            raise ConfigError(f"KVCACHE_REMOTE_URL={url!r}: {parent} does not exist; is the shared "
                              "volume (Curvine FUSE/CSI mount) mounted there?")
    return (lambda: fs), root
