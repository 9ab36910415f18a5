"""How the shared tier keeps a slow or dead network from reaching serving.

``Guard`` runs each filesystem call of the shared tier on the tier's own daemon threads
with a deadline, behind a circuit breaker:

- deadline: a call past its timeout raises ``TimeoutError`` to the caller; its thread
  finishes in the background (a daemon: a call stuck in the network never holds up exit);
- breaker: after ``failure_threshold`` consecutive failures the tier is down, logged
  once; while down, calls fail fast with ``SharedUnavailable``; one call is let through
  after a backoff that doubles up to ``max_backoff_s``, and its success brings the tier
  back (logged once).

``Pacer`` holds transfers to a byte rate (``KVCACHE_SHARED_BANDWIDTH``), as one link
would. Everything here is thread-safe; nothing blocks beyond a short lock except
``Guard.wait`` (at most the deadline) and ``Pacer.take`` (the time the link needs).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable, Optional

log = logging.getLogger(__name__)


class SharedUnavailable(ConnectionError):
    """The shared tier is down (breaker open), or a call to it failed."""


@dataclass
class Health:
    """Counters of the shared tier's own calls (the store counts hits and writes)."""

    failures: int = 0  # calls that raised or ran past their deadline
    timeouts: int = 0  # of which past the deadline
    outages: int = 0  # times the tier went down
    skipped: int = 0  # calls refused while down


class Breaker:
    """Consecutive failures open it; one trial per backoff window; a success closes it."""

    def __init__(
        self, label: str, health: Health, clock, threshold: int, backoff_s: float, max_backoff_s: float
    ) -> None:
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
        log.warning(
            "kvcache: shared tier %s unreachable (%s: %s); serving from the local tiers "
            "and retrying with backoff (%.0f s to %.0f s)",
            self.label,
            type(err).__name__,
            err,
            self.base,
            self.cap,
        )


class DaemonPool:
    """A fixed set of daemon threads: a call stuck in the network never holds up exit.
    ``setup()``, if given, runs first on each thread (``cache.threads``: off the compute
    cores of the process that builds the pool)."""

    def __init__(self, n: int, name: str, setup: Optional[Callable[[], None]] = None) -> None:
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._closed = False
        self._setup = setup
        for i in range(n):
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True).start()
        self._n = n

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        if self._closed:
            fut.set_exception(SharedUnavailable("tier closed"))
        else:
            self._q.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        if self._setup is not None:
            self._setup()
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

    def __init__(
        self, rate: float, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep
    ) -> None:
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


class Guard:
    """Calls with a deadline, on ``io_threads`` daemon threads, behind a ``Breaker``."""

    def __init__(
        self,
        name: str,
        label: str,
        *,
        timeout_s: float,
        io_threads: int,
        failure_threshold: int,
        backoff_s: float,
        max_backoff_s: float,
        clock: Callable[[], float],
        setup: Optional[Callable[[], None]] = None,
    ) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.health = Health()
        self.breaker = Breaker(label, self.health, clock, failure_threshold, backoff_s, max_backoff_s)
        self._pool = DaemonPool(io_threads, f"kvcache-{name}", setup)

    def submit(self, fn, *args) -> Future:
        """Start ``fn(*args)`` on a tier thread; ``SharedUnavailable`` while the tier is down."""
        if not self.breaker.allow():
            self.health.skipped += 1
            raise SharedUnavailable(f"shared tier {self.breaker.label} is down")
        return self._pool.submit(fn, *args)

    def wait(self, fut: Future, what: str, timeout: float):
        """The call's result within ``timeout`` seconds. ``FileNotFoundError`` passes
        through (the backend answered); any other failure, or the deadline, counts
        against the breaker and raises ``SharedUnavailable`` or ``TimeoutError``."""
        try:
            result = fut.result(timeout=max(0.0, timeout))
        except FutureTimeout:
            fut.cancel()  # not started yet: never start it
            self.health.timeouts += 1
            err = TimeoutError(f"{self.name}: {what} took longer than {timeout:.3g} s")
            self.breaker.failure(err)
            raise err from None
        except FileNotFoundError:
            self.breaker.success()
            raise
        except Exception as e:
            self.breaker.failure(e)
            raise SharedUnavailable(f"{self.name}: {what} failed: {type(e).__name__}: {e}") from e
        self.breaker.success()
        return result

    def call(self, what: str, fn, *args, timeout: Optional[float] = None):
        return self.wait(self.submit(fn, *args), what, self.timeout_s if timeout is None else timeout)

    def background(self, fn, *args) -> None:
        """Run ``fn(*args)`` on a tier thread, outside the breaker, ignoring failures
        (clean-up whose failure changes nothing)."""
        self._pool.submit(_quietly, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown()


def _quietly(fn, *args):
    try:
        fn(*args)
    except Exception:
        pass
