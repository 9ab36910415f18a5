"""The store's threads and the background work it waits for.

A writer store runs reads on a pool of ``io_threads`` threads, local writes (and the
evictions, demotions and promotions they cause) on one writer thread, in submission order,
so a chain's parent is always stored before its child, and publishes to the shared tier on
one publisher thread. ``thread_setup(role)`` runs first on each thread ("read", "write",
"publish"; ``cache.threads``). Background work never raises into the engine: an exception
is logged and the work is dropped. New entries wait for the writer thread within a bound
on their bytes (``write_bounded``): past it an entry is dropped, never queued without
limit (memory) nor waited for (the engine's step). ``flush`` waits for the writer and publisher work (and
what it submits in turn); reads are the caller's to wait for. With an ``IdleGate``
(``cache.store.idle_gate``; the engine's worker gives one), writer and publisher work
waits for a quiet moment of the engine, briefly, before it runs; ``flush`` lets it go at once.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

from cache.store.idle_gate import IdleGate

log = logging.getLogger("cache.store")


class Background:
    """The pools of one writer store and its pending writer/publisher work."""

    def __init__(
        self,
        io_threads: int,
        publisher: bool,
        thread_setup: Optional[Callable[[str], None]] = None,
        max_pending_bytes: int = 1 << 30,
        gate: Optional[IdleGate] = None,
    ) -> None:
        def pool(n: int, role: str) -> ThreadPoolExecutor:
            def setup() -> None:
                if thread_setup is not None:
                    thread_setup(role)

            return ThreadPoolExecutor(n, thread_name_prefix=f"kvcache-{role}", initializer=setup)

        self._io = pool(io_threads, "read")
        self._writer = pool(1, "write")
        self._publisher = pool(1, "publish") if publisher else None
        self._pending: set[Future] = set()
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._max_pending_bytes = max_pending_bytes
        self.gate = gate
        if gate is not None:  # a queue half full: holding writes would drop new entries
            gate.pressures.append(self.pressed)

    def read(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on a read thread (not waited for by ``flush``)."""
        return self._io.submit(fn, *args)

    def write(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on the writer thread, after what was submitted before."""
        return self._track(self._writer.submit(self._run, self._queued(), fn, *args))

    def write_bounded(self, nbytes: int, settled: Callable[[], None], fn: Callable, *args) -> bool:
        """``write(fn, *args)`` for ``nbytes`` of new data, unless the writes queued so far
        hold more than ``max_pending_bytes`` with it: then nothing is queued and False is
        returned. ``settled()`` runs once the write is done (on the writer thread)."""
        with self._lock:
            if self._pending_bytes + nbytes > self._max_pending_bytes:
                return False
            self._pending_bytes += nbytes

        def done(_f: Future) -> None:
            with self._lock:
                self._pending_bytes -= nbytes
            settled()

        self.write(fn, *args).add_done_callback(done)
        return True

    def publish(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on the publisher thread."""
        assert self._publisher is not None, "no shared tier"
        return self._track(self._publisher.submit(self._run, self._queued(), fn, *args))

    def _queued(self) -> Optional[tuple[int, float]]:
        return (self.gate.ticket(), time.monotonic()) if self.gate is not None else None

    def _run(self, queued: Optional[tuple[int, float]], fn: Callable, *args):
        if queued is not None:  # (given by the gate, ``_queued``)
            assert self.gate is not None
            self.gate.wait(*queued)
        return _guard(fn, *args)

    def pressed(self) -> bool:
        """Whether the queued writes hold more than half their byte bound (``IdleGate``)."""
        return self._pending_bytes * 2 > self._max_pending_bytes

    def _track(self, fut: Future) -> Future:
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until the writer and publisher work (and the work it submits) is done;
        False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.gate is not None:
                self.gate.hurry()  # (again each round: what the work queued meanwhile)
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

    def shutdown(self) -> None:
        """Stop every thread; queued work is cancelled."""
        for pool in (self._io, self._writer, self._publisher):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)


def _guard(fn: Callable, *args):
    try:
        return fn(*args)
    except Exception:  # background work must never take the engine down
        log.exception("kvcache: background %s failed", getattr(fn, "__name__", fn))
        return None
