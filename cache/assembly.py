"""The one place that builds tiers, policies and stores from a ``CacheConfig``, per role.

- ``lookup_view``: the vLLM scheduler's lookup-only view of one rank's tiers (no threads,
  no policies);
- ``writer_store``: a vLLM worker's store (also the benchmarks' and tools'): I/O threads
  and one policy per local tier, the last local tier's policy judging admission, and the
  pins of the last local tier's folder (``pin_book``, ``cache.pins``);
- ``validate``: what the configuration cannot check itself, because the names live in
  registries here (policies, shared admission modes) and the shared URL's filesystem in
  ``cache.tiers.transport``. The server calls it at start-up (a bad setting exits 2
  before any engine starts), the connector in each engine process.

Tier roles (which tier loads synchronously, which is the admission tier, which is
shared) come from ``CacheConfig.tiers()``, in that order. Runs at start-up in every
process that opens the cache; never touches the network.
"""

from __future__ import annotations

from typing import Callable, Optional

from cache.admission import SharedAdmission
from cache.config import CacheConfig
from cache.errors import ConfigError
from cache.keys import Namespace
from cache.pins import PinBook
from cache.policy import POLICIES, make_policy
from cache.store import TieredStore
from cache.store.idle_gate import IdleGate
from cache.tiers.base import Tier
from cache.tiers.files import FileTier
from cache.tiers.resilience import Pacer
from cache.tiers.shared import SharedTier
from cache.tiers.transport import open_transport


def validate(config: CacheConfig) -> None:
    """Raise ``ConfigError`` for a policy or admission mode nobody knows, or a shared URL
    whose filesystem is unknown, missing or broken (unknown scheme, no Curvine SDK, no
    mount)."""
    if config.policy not in POLICIES:
        raise ConfigError(f"KVCACHE_POLICY={config.policy!r} is unknown; choose one of {sorted(POLICIES)}")
    if config.shared_admission not in SharedAdmission.MODES:
        raise ConfigError(
            f"KVCACHE_SHARED_ADMISSION={config.shared_admission!r} is unknown; choose one "
            f"of {', '.join(SharedAdmission.MODES)}"
        )
    if config.shared_url:
        open_transport(config.shared_url, config.curvine_conf, config.curvine_masters)


def build_tiers(
    config: CacheConfig, namespace_id: str, thread_setup: Optional[Callable[[str], None]] = None
) -> list[Tier]:
    """The tiers ``config.tiers()`` names, in its order (fastest first, shared last);
    ``thread_setup(role)`` runs first on the threads of a tier that has its own."""
    tiers: list[Tier] = []
    for spec in config.tiers():
        if spec.shared:
            tiers.append(shared_tier(config, namespace_id, thread_setup))
        else:
            assert spec.capacity is not None  # (only the shared tier has none)
            tiers.append(
                FileTier(
                    spec.location,
                    namespace_id,
                    spec.capacity,
                    spec.name,
                    use_mmap=spec.mapped,
                    direct_reads=spec.direct_reads,
                    medium=spec.id.medium,
                )
            )
    return tiers


def shared_tier(
    config: CacheConfig, namespace_id: str, thread_setup: Optional[Callable[[str], None]] = None
) -> SharedTier:
    """The shared tier ``config.shared_url`` names. Raises ``ConfigError`` for a URL whose
    filesystem is missing or unknown; never touches the network."""
    transport = open_transport(config.shared_url, config.curvine_conf, config.curvine_masters)
    pacer = Pacer(config.shared_bandwidth) if config.shared_bandwidth > 0 else None
    return SharedTier(
        transport.opener,
        transport.root,
        namespace_id,
        timeout_s=config.shared_timeout_ms / 1000,
        label=config.shared_url,
        pacer=pacer,
        thread_setup=thread_setup,
    )


def lookup_view(config: CacheConfig, namespace: Namespace) -> TieredStore:
    """The scheduler's view of one rank's tiers: ``lookup`` and ``probe`` only."""
    return TieredStore(build_tiers(config, namespace.id), namespace.digest)


def writer_store(
    config: CacheConfig,
    namespace: Namespace,
    *,
    thread_setup: Optional[Callable[[str], None]] = None,
    timer: Optional[Callable[[str, float], None]] = None,
    on_event: Optional[Callable[[str, str, str], None]] = None,
    gate: Optional[IdleGate] = None,
) -> TieredStore:
    """A store that reads and writes: one policy per local tier; upper tiers demote what
    they evict, so their policy takes every chunk, and the last local tier's evictions
    are final, so its policy also judges admission. Eviction passes over the pins of the
    last local tier's folder; ``on_event(key, event, tier)`` hears what happens to chunks;
    background writes wait at ``gate`` (``cache.store.idle_gate``) for the engine to go quiet."""
    specs = config.tiers()
    policies = [make_policy(config.policy, last_tier=spec.last_local) for spec in specs if not spec.shared]
    return TieredStore(
        build_tiers(config, namespace.id, thread_setup),
        namespace.digest,
        policies,
        signing_key=config.signing_key.encode(),
        io_threads=config.io_threads,
        shared_admission=config.shared_admission,
        thread_setup=thread_setup,
        timer=timer,
        on_event=on_event,
        pins=pin_book(config, namespace.id),
        gate=gate,
    )


def pin_book(config: CacheConfig, namespace_id: str = "") -> Optional[PinBook]:
    """The pins of the last local tier's folder (``cache.pins``), None without a local tier;
    ``namespace_id``: the namespace whose pins ``held`` answers for."""
    last = [s for s in config.tiers() if s.last_local]
    if not last or last[0].capacity is None:
        return None
    return PinBook(last[0].location, last[0].capacity, config.pin_max, namespace_id, tenant_share=config.pin_tenant_max)
