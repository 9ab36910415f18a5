"""Publishing to the shared tier (L3): a bounded queue drained in batches by one thread.

``publish`` runs on whichever store thread decided it (writer, read threads) and returns at
once: it skips an entry the shared tier has already, one queued already, and everything
while the tier is down (counted as ``unavailable``); beyond ``max_bytes`` queued it drops
(``dropped_publishes``). The publisher thread writes queued entries in queue order
(parents before children), so the network never delays local writes or requests.
"""

from __future__ import annotations

import threading
from typing import Callable

from cache.store.accounting import Accounting
from cache.tiers.base import Tier


class Publisher:
    """The shared tier's write queue. ``start(drain)`` runs ``drain`` on the publisher thread."""

    def __init__(
        self, tier: Tier, account: Accounting, start: Callable[[Callable[[], None]], object], max_bytes: int
    ) -> None:
        self.tier = tier
        self._account = account
        self._start = start
        self._max = max_bytes
        self._lock = threading.Lock()
        self._queue: list[tuple[str, list, int]] = []
        self._queued: set[str] = set()
        self._bytes = 0
        self._draining = False

    def publish(self, key: str, parts: list) -> None:
        """Queue an encoded entry (``parts``, concatenated) for the shared tier; returns at once."""
        tier = self.tier
        if tier.contains(key):
            return
        if not tier.available:  # down: skip without queueing
            self._account.tier(tier.name).unavailable += 1
            self._account.note(key, "shared_unreachable", tier.name)
            return
        nbytes = sum(memoryview(p).nbytes for p in parts)
        with self._lock:
            if key in self._queued:
                return
            if self._bytes + nbytes > self._max:
                self._account.stats.dropped_publishes += 1
                return
            self._queued.add(key)
            self._bytes += nbytes
            self._queue.append((key, parts, nbytes))
            start, self._draining = not self._draining, True
        self._account.note(key, "publishing", tier.name)
        if start:
            self._start(self._drain)

    def _drain(self) -> None:
        """Write queued entries, a batch at a time, in queue order."""
        while True:
            with self._lock:
                batch, self._queue = self._queue, []
                if not batch:
                    self._draining = False
                    return
            for key, parts, nbytes in batch:
                try:
                    self._write(key, parts, nbytes)
                finally:
                    with self._lock:
                        self._queued.discard(key)
                        self._bytes -= nbytes

    def _write(self, key: str, parts: list, nbytes: int) -> None:
        tier, account = self.tier, self._account
        st = account.tier(tier.name)
        if not tier.reserve(nbytes):
            st.rejected += 1
            account.note(key, "not_admitted", tier.name)
            return
        try:
            published = tier.write(key, parts, nbytes)
        except Exception as e:
            account.failed(tier, "writing", key, e)
            return
        account.succeeded(tier.name)
        account.note(key, "stored", tier.name)  # by this call or, first, by another node
        if published:
            st.writes += 1
            st.bytes_written += nbytes
