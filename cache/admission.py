"""Which chunks the store publishes to the shared tier (L3): ``KVCACHE_SHARED_ADMISSION``.

Pure bookkeeping, no I/O: called by ``cache.store.TieredStore`` under its lock, O(1) per
call, bounded memory (``history`` keys).
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["SharedAdmission"]


class SharedAdmission:
    """Which chunks go to the shared tier (L3): the store's publishing rule.

    ``"reused"`` (default): a chunk is published when it is used a second time: read
    back from a local tier (a hit), computed and stored again after it had left the
    local tiers, or evicted from the last local tier after a hit. One-off prompts never
    cost network bandwidth or shared space. ``"all"``: every chunk stored. ``"none"``:
    read-only use of the shared tier. Explicit marks (``put(..., shared=True)``) always
    publish, whatever the mode. Called under the store lock; O(1).
    """

    MODES = ("reused", "all", "none")

    def __init__(self, mode: str = "reused", history: int = 200_000) -> None:
        if mode not in self.MODES:
            raise ValueError(f"shared admission {mode!r}: choose one of {self.MODES}")
        self.mode = mode
        self._uses: OrderedDict[str, int] = OrderedDict()  # key -> uses seen (bounded)
        self._history = history

    def _use(self, key: str) -> int:
        n = self._uses.pop(key, 0) + 1
        self._uses[key] = n
        if len(self._uses) > self._history:
            self._uses.popitem(last=False)
        return n

    def on_put(self, key: str) -> bool:
        """A chunk was computed and is being stored."""
        return self.mode == "all" or (self._use(key) > 1 and self.mode == "reused")

    def on_hit(self, key: str) -> bool:
        """A chunk was read back from a local tier."""
        self._use(key)
        return self.mode != "none"

    def on_evict(self, key: str) -> bool:
        """A chunk leaves the last local tier: keep it shared if it was ever reused."""
        return self.mode == "all" or (self.mode == "reused" and self._uses.get(key, 0) > 1)
