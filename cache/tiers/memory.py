"""The in-memory reference tier: a dict behind a lock.

Plays the part httpx's ``MockTransport`` plays for clients: the store and its contract
tests run against it without I/O. Thread-safe; nothing blocks beyond the lock.
"""

from __future__ import annotations

import threading
from typing import Iterator, Optional, Sequence

from cache.tiers.base import Buffer, Tier


class MemoryTier(Tier):
    name = "memory"

    def __init__(self, capacity: Optional[int], name: str = "memory") -> None:
        self.capacity = capacity
        self.name = name
        self._entries: dict[str, bytes] = {}
        self._used = 0
        self._lock = threading.Lock()

    def contains(self, key: str) -> bool:
        return key in self._entries

    def read(self, key: str) -> Buffer:
        return self._entries[key]

    def write(self, key: str, parts: Sequence[Buffer], nbytes: int) -> bool:
        data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        if len(data) != nbytes:
            raise ValueError(f"write of {len(data)} bytes, {nbytes} reserved")
        with self._lock:
            if key in self._entries:
                self._used -= nbytes
                return False
            self._entries[key] = data
            return True

    def delete(self, key: str) -> int:
        with self._lock:
            data = self._entries.pop(key, None)
            if data is None:
                return 0
            self._used -= len(data)
            return len(data)

    def reserve(self, nbytes: int, key: Optional[str] = None) -> bool:
        with self._lock:
            if self.capacity is not None and self._used + nbytes > self.capacity:
                return False
            self._used += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes

    def used_bytes(self) -> int:
        return self._used

    def scan(self) -> Iterator[tuple[str, int]]:
        with self._lock:
            items = [(k, len(v)) for k, v in self._entries.items()]
        return iter(items)
