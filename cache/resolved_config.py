"""The resolved cache configuration: ``CacheConfig`` and the ``TierSpec`` of each enabled tier.

Plain frozen data, built by ``cache.config.build_cache_config`` (the one reader of
``KVCACHE_*``) and serialized to the connector with ``to_dict``/``from_dict``; this module
reads no environment. Runs anywhere (server, scheduler, workers); nothing here blocks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from cache.dram import DEFAULT_DRAM_PATH, WRITE_BEHIND_BYTES
from cache.errors import ConfigError
from cache.tiers.identity import DISK, DRAM, SHARED, TierId

DEFAULT_DISK_PATH = "/tmp/kvcache"
CONNECTOR_KEY = "kvcache_config"  # the one key of kv_connector_extra_config we read


@dataclass(frozen=True)
class TierSpec:
    """One enabled tier and its role, as the configuration decides it."""

    id: TierId  # name ("dram", "disk", "shared": its label in logs and metrics),
    # medium, locality (cache.tiers.identity)
    location: str  # folder, or the shared tier's URL
    capacity: Optional[int]  # bytes; None: the backend manages its space (shared)
    synchronous: bool  # loaded into vLLM's blocks before the forward pass (a memory
    # copy); other tiers load on I/O threads while requests run
    mapped: bool  # entries read by mapping the file (tmpfs pages: zero copy)
    direct_reads: bool  # entries not in the page cache read with O_DIRECT (disk)
    last_local: bool  # the last local tier: its evictions are final, so its policy
    # also judges admission

    @property
    def name(self) -> str:
        return self.id.name

    @property
    def shared(self) -> bool:
        """Published to by rule, never evicted from by us (``TierId.shared``)."""
        return self.id.shared

    @property
    def level(self) -> str:
        """``"L1"``, ``"L2"``, ``"L3"``: its place in the speed order (``TierId.level``)."""
        return f"L{self.id.level}"


@dataclass(frozen=True)
class CacheConfig:
    """The resolved cache configuration; every size in bytes. Defaults are the settings'."""

    # Tokens per chunk, the unit of lookup and storage. A multiple of vLLM's block size.
    chunk_tokens: int = 256
    # dram (L1): a tmpfs folder, so every process of the engine and every engine of the
    # node sees the same entries. 0 bytes disables the tier.
    dram_path: str = DEFAULT_DRAM_PATH
    dram_bytes: int = 0
    # disk (L2): a local folder. 0 bytes disables the tier.
    disk_path: str = DEFAULT_DISK_PATH
    disk_bytes: int = 0
    # Entries not in the page cache are read from the disk tier with O_DIRECT
    # (cache.tiers.direct): no readahead, no kernel copy. False: every read is buffered.
    disk_direct_reads: bool = True
    # shared (L3): an fsspec URL (curvine://..., file:///mnt/curvine/...). Empty: no L3.
    shared_url: str = ""
    # Curvine client for curvine:// URLs: its configuration file (absolute), or the
    # master addresses ("host:port") a minimal client file is made from.
    curvine_conf: str = ""
    curvine_masters: tuple[str, ...] = ()
    # Deadline of one call to the shared tier.
    shared_timeout_ms: int = 2000
    # Cap on this process's shared-tier transfer rate, bytes per second (0: none): keeps
    # the cache's share of the node's network bounded (and emulates a link in benchmarks).
    shared_bandwidth: int = 0
    # What the store publishes to the shared tier (cache.admission.SharedAdmission): "reused"
    # (a chunk used a second time), "all" (every chunk stored), "none" (only read).
    shared_admission: str = "reused"
    # Eviction/admission policy name (cache.policy.POLICIES; a test keeps this default
    # equal to cache.policy.DEFAULT_POLICY).
    policy: str = "prefix-adaptive"
    # Background threads that load misses from the slower tiers.
    io_threads: int = 2
    # Share (0..1) of the last local tier that pinned prefixes may hold (cache.pins); a pin
    # past it is refused. 0: pins are refused.
    pin_max: float = 0.5
    # Share (0..1] of that allowance one tenant (a cache_salt; "unsalted" for requests
    # without one) may hold, so no tenant can deny pins to the others.
    pin_tenant_max: float = 0.25
    # What a hit loads: "cost" (what the online cost model expects to reach the first token
    # sooner than computing it; cache.cost) or "always" (everything found).
    load_decision: str = "cost"
    # A load the forward pass waits for hands over each layer as it lands
    # (cache.vllm.layered): the forward pass computes layer i while layer i+1 loads.
    # False: the whole load first (CPU blocks only; other loads always are whole).
    layered_loads: bool = True
    # What identifies the model's weights in the namespace (cache.weights): "sampled" (file
    # sizes, safetensors headers, a piece of every tensor: a few MiB read) or "full" (every byte).
    weights_hash: str = "sampled"
    # That fingerprint, taken once by the server for every process ("": each process takes it).
    weights_fingerprint: str = ""
    # Host memory per worker (one per GPU) that copies between the KV cache and the tiers
    # go through (cache.vllm.staging): pinned on GPUs, allocated once at start-up, counted
    # in the DRAM sizing. A save that finds it full is skipped (a future miss).
    staging_bytes: int = WRITE_BEHIND_BYTES
    # HMAC key for entries; when set, unsigned or wrongly signed entries are rejected.
    # Never serialized: each process reads it from KVCACHE_SIGNING_KEY.
    signing_key: str = field(default="", repr=False)
    # What start-up should tell the operator (deprecated names, capped sizes). Not serialized.
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def has_shared(self) -> bool:
        return bool(self.shared_url)

    def tiers(self) -> tuple[TierSpec, ...]:
        """The enabled tiers, fastest first; the shared tier, if any, last."""
        local = [
            (DRAM, self.dram_path, self.dram_bytes, True),
            (DISK, self.disk_path, self.disk_bytes, False),
        ]
        local = [t for t in local if t[2]]
        specs = [
            TierSpec(
                tier,
                path,
                size,
                synchronous=memory,
                mapped=memory,
                direct_reads=not memory and self.disk_direct_reads,
                last_local=i == len(local) - 1,
            )
            for i, (tier, path, size, memory) in enumerate(local)
        ]
        if self.shared_url:
            specs.append(
                TierSpec(
                    SHARED,
                    self.shared_url,
                    None,
                    synchronous=False,
                    mapped=False,
                    direct_reads=False,
                    last_local=False,
                )
            )
        return tuple(specs)

    def to_dict(self) -> dict[str, Any]:
        """The serialized value the connector receives (plain JSON types), without the
        signing key."""
        data = asdict(self)
        for private in ("signing_key", "notes"):
            data.pop(private)
        data["curvine_masters"] = list(self.curvine_masters)
        return data

    @classmethod
    def from_dict(cls, value: Any, signing_key: str = "") -> "CacheConfig":
        """A config serialized by ``to_dict`` (or that as a JSON string); the signing key,
        never serialized, is the caller's (``cache.config`` reads it from the environment)."""
        try:
            data = json.loads(value) if isinstance(value, str) else dict(value)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{CONNECTOR_KEY} in kv_connector_extra_config is not a JSON object: {e}") from None
        known = {f.name for f in fields(cls)} - {"signing_key", "notes"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{CONNECTOR_KEY} has fields this version does not know: {unknown}")
        data["curvine_masters"] = tuple(data.get("curvine_masters", ()))
        return cls(**data, signing_key=signing_key)
