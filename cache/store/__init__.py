"""The tiered store: ``TieredStore`` (``tiered``) and its parts, one module per
responsibility (``reads``, ``placement``, ``writer``, ``publisher``, ``accounting``,
``background``). Engine-agnostic: no vLLM, no torch."""

from cache.store.accounting import StoreStats, TierStats
from cache.store.reads import ELSEWHERE, Entry, EntryRead
from cache.store.tiered import TieredStore

__all__ = ["ELSEWHERE", "Entry", "EntryRead", "StoreStats", "TierStats", "TieredStore"]
