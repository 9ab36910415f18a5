"""Tiers: one class per kind of storage behind the protocol in ``base``."""

from __future__ import annotations

from cache.config import CacheConfig
from cache.tiers.base import Tier
from cache.tiers.files import FileTier
from cache.tiers.memory import MemoryTier

__all__ = ["Tier", "FileTier", "MemoryTier", "make_tiers"]


def make_tiers(config: CacheConfig, namespace_id: str) -> list[Tier]:
    """The tiers a config enables, fastest first; a size of 0 disables a local tier, an
    empty ``remote_url`` the shared one (always last)."""
    tiers: list[Tier] = []
    if config.cpu_bytes:
        tiers.append(FileTier(config.cpu_path, namespace_id, config.cpu_bytes, "dram", use_mmap=True))
    if config.disk_bytes:
        tiers.append(FileTier(config.disk_path, namespace_id, config.disk_bytes, "disk"))
    if config.remote_url:
        from cache.tiers.remote import make_remote_tier  # fsspec (and Curvine's SDK) only when used

        tiers.append(make_remote_tier(config, namespace_id))
    return tiers
