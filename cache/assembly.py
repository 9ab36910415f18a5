"""The one place that builds tiers, policies and stores from a ``CacheConfig``.

Runs at start-up in every process that opens the cache (the vLLM scheduler, each
worker, the tools). Nothing here touches the network.
"""

from __future__ import annotations

from cache.config import CacheConfig, ConfigError
from cache.tiers.base import Tier
from cache.tiers.files import FileTier
from cache.tiers.resilience import Pacer
from cache.tiers.shared import SharedTier
from cache.tiers.transport import open_transport


def build_tiers(config: CacheConfig, namespace_id: str) -> list[Tier]:
    """The tiers a config enables, fastest first; a size of 0 disables a local tier, an
    empty ``remote_url`` the shared one (always last)."""
    tiers: list[Tier] = []
    if config.cpu_bytes:
        tiers.append(FileTier(config.cpu_path, namespace_id, config.cpu_bytes, "dram", use_mmap=True))
    if config.disk_bytes:
        tiers.append(FileTier(config.disk_path, namespace_id, config.disk_bytes, "disk"))
    if config.remote_url:
        tiers.append(shared_tier(config, namespace_id))
    return tiers


def shared_tier(config: CacheConfig, namespace_id: str) -> SharedTier:
    """The shared tier the config names. Raises ``ConfigError`` for a URL whose
    filesystem is missing or unknown; never touches the network."""
    if config.remote_timeout_ms <= 0:
        raise ConfigError(f"KVCACHE_REMOTE_TIMEOUT_MS={config.remote_timeout_ms} must be above 0")
    transport = open_transport(config.remote_url, config.curvine_conf)
    pacer = Pacer(config.remote_bandwidth) if config.remote_bandwidth > 0 else None
    return SharedTier(transport.opener, transport.root, namespace_id, timeout_s=config.remote_timeout_ms / 1000,
                      label=config.remote_url, pacer=pacer)
