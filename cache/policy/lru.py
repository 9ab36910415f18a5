"""``lru``: least recently used, the reference every other policy must beat.

Runs wherever a tier runs, under the store's lock; every call is O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from .base import EvictionPolicy, Key


class LRUPolicy(EvictionPolicy):
    """Least recently used: the reference every other policy must beat."""

    name = "lru"

    def __init__(self, *, last_tier: bool = True) -> None:
        super().__init__(last_tier=last_tier)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, parent: Optional[Key], size: int) -> None:
        self._order[key] = None

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self) -> Optional[Key]:
        return next(iter(self._order), None)

    def __contains__(self, key: Key) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)
