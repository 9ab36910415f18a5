"""Cache settings: the one module that reads ``KVCACHE_*``, into one frozen ``CacheConfig``.

Tiers, one vocabulary everywhere (settings, logs, metrics, ``kv_transfer_params``):

    dram    L1  host DRAM: a shared-memory (tmpfs) folder, loaded before the forward pass
    disk    L2  local disk (NVMe; /tmp on SageMaker hosts), survives an engine restart
    shared  L3  a folder every node sees (Curvine: SDK, or its FUSE/CSI mount)

Flow: ``build_cache_config(env)`` is the only function that turns the environment into a
``CacheConfig``: it resolves sizes such as ``8GiB`` or ``20%`` against the machine, and
rejects bad settings with one ``ConfigError`` naming the variable. The server calls it
once at start-up (``serving.sizing``) and hands the resolved value to the vLLM connector
as one serialized value (``connector_extra``: the key ``kvcache_config`` of
``kv_connector_extra_config``); the scheduler and every worker read it back
(``config_from_connector``) and re-derive nothing. The signing key never goes into that
value (vLLM logs its whole config): each process reads it from the environment here.
Under plain ``vllm serve`` without ``kvcache_config``, each process builds the config
from its own environment (same variables, same machine: the same answer, except that a
percentage is resolved against the free space each process sees).

Also read here: ``KVCACHE_ENABLED`` (``cache_enabled``), ``KVCACHE_WARM_PROMPTS``
(``warm_prompts``), whose prompts file is parsed by ``cache.prompts.read_prompt_file``
for the start-up check and for the warm tool alike, and ``KVCACHE_WARM_DRAM`` (``warm_dram``).
Names that belong to a registry (policies, shared admission modes) and the shared URL's filesystem are checked by
``cache.assembly.validate``, where those live. The DRAM tier's size and folder follow
one rule, in ``cache.dram``.

Old names (``KVCACHE_CPU_*``, ``KVCACHE_REMOTE_*``) are accepted as deprecated aliases
(``DEPRECATED``) with one note each; an old and a new name set to different values is
an error. True/false values are read by ``cache.flags.parse_bool``, the one parser of
them. Imports nothing from ``cache`` but the leaves ``cache.errors`` (``ConfigError``,
re-exported here), ``cache.flags``, ``cache.sizes``, ``cache.dram``, ``cache.curvine``,
``cache.prompts``, ``cache.weights``, ``cache.resolved_config`` (the ``CacheConfig``
and ``TierSpec`` it builds, re-exported here) and ``cache.tiers.layout``.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from cache.curvine import curvine_client
from cache.dram import DRAM_MARGIN, GiB, dram_tier, staging_bytes
from cache.errors import ConfigError
from cache.flags import parse_bool
from cache.prompts import read_prompt_file
from cache.resolved_config import CONNECTOR_KEY, DEFAULT_DISK_PATH, CacheConfig, TierSpec
from cache.sizes import disk_tier_bytes, memory_limit, parse_size
from cache.weights import MODES as WEIGHTS_HASHES

__all__ = [
    "CONNECTOR_KEY",
    "DEFAULT_DISK_PATH",
    "DRAM_MARGIN",
    "GiB",
    "CacheConfig",
    "ConfigError",
    "TierSpec",
    "build_cache_config",
    "cache_enabled",
    "check_block_size",
    "config_from_connector",
    "connector_extra",
    "memory_limit",
    "parse_size",
    "read_prompt_file",
    "warm_dram",
    "warm_prompts",
]

DISK_SHARE = "50%"  # default L2 size: share of the free space under the disk path
ENTRY_OVERHEAD = 256  # bytes of an entry besides its KV (cache.codec.HEADER_SIZE; a test keeps them equal)

# Every setting this module reads, and its deprecated aliases (old name -> new name).
SETTINGS = (
    "KVCACHE_ENABLED",
    "KVCACHE_DRAM_PATH",
    "KVCACHE_DRAM_SIZE",
    "KVCACHE_DISK_PATH",
    "KVCACHE_DISK_SIZE",
    "KVCACHE_SHARED_URL",
    "KVCACHE_SHARED_TIMEOUT_MS",
    "KVCACHE_SHARED_BANDWIDTH",
    "KVCACHE_SHARED_ADMISSION",
    "KVCACHE_CURVINE_CONF",
    "KVCACHE_CURVINE_MASTERS",
    "KVCACHE_CHUNK_TOKENS",
    "KVCACHE_SIGNING_KEY",
    "KVCACHE_POLICY",
    "KVCACHE_IO_THREADS",
    "KVCACHE_WARM_PROMPTS",
    "KVCACHE_PIN_MAX",
    "KVCACHE_PIN_TENANT_MAX",
    "KVCACHE_LOAD_DECISION",
    "KVCACHE_LAYERED_LOADS",
    "KVCACHE_DISK_DIRECT_READS",
    "KVCACHE_WEIGHTS_HASH",
    "KVCACHE_STAGING_SIZE",
    "KVCACHE_WARM_DRAM",
)
LOAD_DECISIONS = ("cost", "always")
DEPRECATED = {
    "KVCACHE_CPU_PATH": "KVCACHE_DRAM_PATH",
    "KVCACHE_CPU_SIZE": "KVCACHE_DRAM_SIZE",
    "KVCACHE_REMOTE_URL": "KVCACHE_SHARED_URL",
    "KVCACHE_REMOTE_TIMEOUT_MS": "KVCACHE_SHARED_TIMEOUT_MS",
    "KVCACHE_REMOTE_BANDWIDTH": "KVCACHE_SHARED_BANDWIDTH",
}


def connector_extra(config: CacheConfig) -> dict[str, Any]:
    """``kv_connector_extra_config`` for the connector: the one serialized value."""
    return {CONNECTOR_KEY: config.to_dict()}


def config_from_connector(extra: Mapping[str, Any], env: Optional[Mapping[str, str]] = None) -> CacheConfig:
    """The connector's configuration: the serialized value the server resolved, or
    (plain ``vllm serve``) the environment of this process."""
    value = (extra or {}).get(CONNECTOR_KEY)
    if value is not None:
        key = _Reader(os.environ if env is None else env).get("KVCACHE_SIGNING_KEY") or ""
        return CacheConfig.from_dict(value, key)
    stray = sorted(k for k in (extra or {}) if k.lower().startswith("kvcache_"))
    if stray:
        raise ConfigError(
            f"kv_connector_extra_config keys {stray} are not read: set the KVCACHE_* "
            f"environment variables, or pass {CONNECTOR_KEY} (cache.config.connector_extra)"
        )
    return build_cache_config(env)


class _Reader:
    """``KVCACHE_*`` values from one environment, deprecated aliases resolved."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.notes: list[str] = []

    def raw(self, name: str) -> Optional[str]:
        value = self.env.get(name)
        return None if value is None or str(value).strip() == "" else str(value).strip()

    def get(self, name: str) -> Optional[str]:
        value = self.raw(name)
        for old in (o for o, new in DEPRECATED.items() if new == name):
            old_value = self.raw(old)
            if old_value is None:
                continue
            if value is not None and value != old_value:
                raise ConfigError(
                    f"{old}={old_value!r} and {name}={value!r} disagree; {old} is the old "
                    f"name of {name}: set only {name}"
                )
            self.notes.append(f"{old} is deprecated: use {name}")
            value = old_value
        return value

    def unknown(self) -> list[str]:
        return sorted(k for k in self.env if k.startswith("KVCACHE_") and k not in SETTINGS and k not in DEPRECATED)


def _positive_int(r: _Reader, name: str, default: int) -> int:
    text = r.get(name)
    if text is None:
        return default
    if not text.isdigit() or int(text) <= 0:
        raise ConfigError(f"{name}={text!r} must be a positive integer")
    return int(text)


def _fraction(r: _Reader, name: str, default: float) -> float:
    """A share between 0 and 1: ``0.5`` or ``50%``."""
    text = r.get(name)
    if text is None:
        return default
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"{name}={text!r} must be a share between 0 and 1 (0.5, or 50%)")
    return value


def build_cache_config(
    env: Optional[Mapping[str, str]] = None,
    *,
    ram_bytes: Optional[int] = None,
    reserved_ram_bytes: int = 0,
    kv_bytes_per_token: Optional[int] = None,
    workers: int = 1,
) -> CacheConfig:
    """The one place that turns the environment into a ``CacheConfig``.

    ``ram_bytes``: the RAM the container may use (default: measured); percentages of
    ``KVCACHE_DRAM_SIZE`` and its default are taken of it. ``reserved_ram_bytes``: RAM the
    DRAM default must leave to others (the model weights, vLLM's CPU KV pool), and
    ``kv_bytes_per_token``: the model's, both known to the server; ``workers``: the
    engine's worker processes (GPUs), whose staging memory the DRAM default leaves too.
    Raises ``ConfigError``."""
    r = _Reader(os.environ if env is None else env)
    ram = memory_limit() if ram_bytes is None else ram_bytes
    d = CacheConfig()
    notes: list[str] = []
    chunk_tokens = _positive_int(r, "KVCACHE_CHUNK_TOKENS", d.chunk_tokens)
    entry = chunk_tokens * kv_bytes_per_token + ENTRY_OVERHEAD if kv_bytes_per_token else None
    staging = staging_bytes(r.get("KVCACHE_STAGING_SIZE"), entry, notes)
    dram_path, dram_bytes = dram_tier(
        r.get("KVCACHE_DRAM_SIZE"),
        r.get("KVCACHE_DRAM_PATH"),
        ram,
        reserved_ram_bytes + staging * max(1, workers),
        entry,
        notes,
    )
    disk_path = r.get("KVCACHE_DISK_PATH") or d.disk_path
    disk_bytes = disk_tier_bytes(r.get("KVCACHE_DISK_SIZE") or DISK_SHARE, disk_path)
    disk_direct_reads = parse_bool(r, "KVCACHE_DISK_DIRECT_READS", d.disk_direct_reads)
    url = r.get("KVCACHE_SHARED_URL") or ""
    conf, masters = curvine_client(
        r.get("KVCACHE_CURVINE_CONF") or "", r.get("KVCACHE_CURVINE_MASTERS") or "", url, r.raw("SAGEMAKER_BASE_DIR")
    )
    timeout_ms = _positive_int(r, "KVCACHE_SHARED_TIMEOUT_MS", d.shared_timeout_ms)
    bandwidth = parse_size(r.get("KVCACHE_SHARED_BANDWIDTH") or "0", None, "KVCACHE_SHARED_BANDWIDTH")
    admission = (r.get("KVCACHE_SHARED_ADMISSION") or d.shared_admission).lower()
    io_threads = _positive_int(r, "KVCACHE_IO_THREADS", d.io_threads)
    policy = r.get("KVCACHE_POLICY") or d.policy
    pin_max = _fraction(r, "KVCACHE_PIN_MAX", d.pin_max)
    pin_tenant_max = _fraction(r, "KVCACHE_PIN_TENANT_MAX", d.pin_tenant_max)
    if pin_tenant_max == 0:
        raise ConfigError("KVCACHE_PIN_TENANT_MAX=0 would refuse every pin (KVCACHE_PIN_MAX=0 turns pins off)")
    load_decision = (r.get("KVCACHE_LOAD_DECISION") or d.load_decision).lower()
    if load_decision not in LOAD_DECISIONS:
        raise ConfigError(f"KVCACHE_LOAD_DECISION={load_decision!r} must be one of {', '.join(LOAD_DECISIONS)}")
    layered_loads = parse_bool(r, "KVCACHE_LAYERED_LOADS", d.layered_loads)
    weights_hash = (r.get("KVCACHE_WEIGHTS_HASH") or d.weights_hash).lower()
    if weights_hash not in WEIGHTS_HASHES:
        raise ConfigError(f"KVCACHE_WEIGHTS_HASH={weights_hash!r} must be one of {', '.join(WEIGHTS_HASHES)}")
    signing_key = r.get("KVCACHE_SIGNING_KEY") or ""
    notes = list(dict.fromkeys(r.notes)) + notes
    notes += [f"{name} is not a setting of this cache; ignored" for name in r.unknown()]
    return CacheConfig(
        chunk_tokens=chunk_tokens,
        dram_path=dram_path,
        dram_bytes=dram_bytes,
        disk_path=disk_path,
        disk_bytes=disk_bytes,
        disk_direct_reads=disk_direct_reads,
        shared_url=url,
        curvine_conf=conf,
        curvine_masters=masters,
        shared_timeout_ms=timeout_ms,
        shared_bandwidth=bandwidth,
        shared_admission=admission,
        policy=policy,
        io_threads=io_threads,
        pin_max=pin_max,
        pin_tenant_max=pin_tenant_max,
        load_decision=load_decision,
        layered_loads=layered_loads,
        weights_hash=weights_hash,
        staging_bytes=staging,
        signing_key=signing_key,
        notes=tuple(notes),
    )


def check_block_size(config: CacheConfig, block_size: int) -> None:
    """Chunks are whole vLLM blocks; anything else is a configuration error."""
    if config.chunk_tokens % block_size:
        raise ConfigError(
            f"KVCACHE_CHUNK_TOKENS={config.chunk_tokens} is not a multiple of vLLM's "
            f"block size ({block_size}); use e.g. {max(1, round(config.chunk_tokens / block_size)) * block_size}"
        )


# -- start-up settings: the cache on or off, pre-warming ----------------------------------


def cache_enabled(env: Optional[Mapping[str, str]] = None) -> bool:
    """``KVCACHE_ENABLED`` (default true): false serves with vLLM alone."""
    return parse_bool(_Reader(os.environ if env is None else env), "KVCACHE_ENABLED", True)


def warm_prompts(env: Optional[Mapping[str, str]] = None, config: Optional[CacheConfig] = None) -> Optional[str]:
    """``KVCACHE_WARM_PROMPTS`` (absolute), or None when unset. ``config`` is the cache
    that will run (None when it is off). The file is checked now, so a bad one stops
    start-up before any engine runs: readable, one JSON object per line
    (``read_prompt_file``), and a cache that can publish (warming fills the shared tier)."""
    path = _Reader(os.environ if env is None else env).get("KVCACHE_WARM_PROMPTS")
    if not path:
        return None
    name = f"KVCACHE_WARM_PROMPTS={path!r}"
    if config is None:
        raise ConfigError(
            f"{name} needs the tiered cache, which is off (KVCACHE_ENABLED=false "
            "or a KV connector of your own in SM_VLLM_KV_TRANSFER_CONFIG)"
        )
    if not config.has_shared:
        raise ConfigError(f"{name}: warming publishes prompts to the shared tier; set KVCACHE_SHARED_URL too")
    if config.shared_admission == "none":
        raise ConfigError(
            f"{name}: KVCACHE_SHARED_ADMISSION=none publishes nothing to the "
            "shared tier; use reused or all, or unset KVCACHE_WARM_PROMPTS"
        )
    read_prompt_file(path, name)
    return os.path.abspath(path)


def warm_dram(env: Optional[Mapping[str, str]] = None, config: Optional[CacheConfig] = None) -> int:
    """``KVCACHE_WARM_DRAM``: bytes of the hottest shared entries a new instance copies into
    its DRAM tier, with the warm-prompt set, before ``/ping`` reports healthy
    (``cache.dram_warm``); 0 when unset. A size or a share of the DRAM tier (``50%``), at
    most the tier. ``config``: the cache that will run (None when it is off)."""
    text = _Reader(os.environ if env is None else env).get("KVCACHE_WARM_DRAM")
    if not text:
        return 0
    if config is None or not config.has_shared or not config.dram_bytes:
        raise ConfigError(
            f"KVCACHE_WARM_DRAM={text!r} copies entries of the shared tier into the DRAM "
            "tier: it needs the tiered cache on, KVCACHE_SHARED_URL and a DRAM tier"
        )
    return min(parse_size(text, config.dram_bytes, "KVCACHE_WARM_DRAM"), config.dram_bytes)
