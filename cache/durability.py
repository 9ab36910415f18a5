"""Durability: chunks used again are copied down to the last local tier (disk).

DRAM is a tmpfs that a new container (or an engine given an empty DRAM folder) starts
without, and evictions alone would leave on disk only what was cold. So when a request
finds chunks stored (a second use, in the scheduler's words ``reused``; the warm tool's
second pass is one), the store also copies them down to disk in the background; the
disk tier's admission policy decides, as for any write.

``CopyQueue`` is the bounded queue of keys waiting for that copy. ``add`` runs on the
caller's thread (a worker's ``start_load_kv``, inside the forward step) and never
blocks: a key beyond the bound is dropped and counted. The copies run one at a time on
the store's writer thread, each queued behind the writes submitted meanwhile, so a
burst of copies never holds up new entries for long; ``TieredStore.flush`` (and so
``close``, on engine shutdown) waits for them like for any write.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Iterable


class CopyQueue:
    """Keys waiting to be copied down, oldest first, at most ``max_keys``.

    ``submit(fn)`` queues ``fn`` on the writer thread (raises ``RuntimeError`` once the
    store is closed); ``copy(key)`` copies one key down (on that thread)."""

    def __init__(
        self, max_keys: int, submit: Callable[[Callable[[], None]], object], copy: Callable[[str], None]
    ) -> None:
        self._max = max_keys
        self._submit = submit
        self._copy = copy
        self._lock = threading.Lock()
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._running = False
        self.dropped = 0  # keys refused because the queue was full

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, keys: Iterable[str]) -> None:
        """Queue ``keys`` (those already queued once); returns at once."""
        with self._lock:
            for key in keys:
                if key in self._keys:
                    continue
                if len(self._keys) >= self._max:
                    self.dropped += 1
                    continue
                self._keys[key] = None
            start = bool(self._keys) and not self._running
            self._running = self._running or start
        if start:
            self._submit(self._next)

    def _next(self) -> None:
        """Copy the oldest key (writer thread), then queue the next copy behind whatever
        was submitted meanwhile."""
        with self._lock:
            if not self._keys:
                self._running = False
                return
            key = self._keys.popitem(last=False)[0]
        try:
            self._copy(key)
        finally:
            try:
                self._submit(self._next)
            except RuntimeError:  # the store is closed: the writer takes no more work
                with self._lock:
                    self._running = False
