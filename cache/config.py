"""Cache settings: one frozen dataclass, built in exactly one function from the outside world.

``build_cache_config`` is the only place that reads ``KVCACHE_*`` variables (or their
lower-case twins in vLLM's ``kv_connector_extra_config``), resolves sizes such as
``8GiB`` or ``20%`` against the machine, and rejects bad settings with one clear
message. It runs at start-up, in every process that opens the store (the vLLM
scheduler and each worker), and must give every process the same answer.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from typing import Mapping, Optional

import psutil

DEFAULT_CHUNK_TOKENS = 256
DEFAULT_CPU_PATH = "/dev/shm/kvcache"
DEFAULT_DISK_PATH = "/tmp/kvcache"


class ConfigError(ValueError):
    """A bad setting; the message names the variable and what would fix it."""


@dataclass(frozen=True)
class CacheConfig:
    # Tokens per chunk, the unit of lookup and storage. A multiple of vLLM's block size.
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    # L1, host DRAM: a shared-memory (tmpfs) folder, so every process of the engine and
    # every engine of the node sees the same entries. 0 bytes disables the tier.
    cpu_path: str = DEFAULT_CPU_PATH
    cpu_bytes: int = 0
    # L2, local disk (NVMe; /tmp on SageMaker hosts). Survives an engine restart.
    disk_path: str = DEFAULT_DISK_PATH
    disk_bytes: int = 0
    # L3, a shared fsspec URL (curvine://..., file:///mnt/curvine/...). Empty: no L3.
    remote_url: str = ""
    curvine_conf: str = ""
    remote_timeout_ms: int = 2000
    # Cap on this process's L3 transfer rate, bytes per second (0: none): keeps the cache's
    # share of the node's network bounded (and emulates a slower link in the benchmark).
    remote_bandwidth: int = 0
    # What the store publishes to L3 (cache.store.SharedAdmission): "reused" (a chunk used a
    # second time), "all" (every chunk stored), "none" (L3 is only read).
    shared_admission: str = "reused"
    # HMAC key for entries; when set, unsigned or wrongly signed entries are rejected.
    signing_key: str = ""
    # Eviction/admission policy name (see cache.policy.POLICIES); the default is
    # cache.policy.DEFAULT_POLICY (a test keeps the two equal).
    policy: str = "prefix-adaptive"
    # Background threads that write entries down and load misses from slow tiers.
    io_threads: int = 2

    @property
    def has_remote(self) -> bool:
        return bool(self.remote_url)


_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_size(text: str, whole: Optional[int], name: str) -> int:
    """``"8GiB"``, ``"500MB"``, ``"1073741824"`` or ``"20%"`` (of ``whole``) in bytes."""
    s = str(text).strip().lower().replace(" ", "")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(%|[a-z]*)", s)
    if not m or (m.group(2) not in _SIZE_UNITS and m.group(2) != "%"):
        raise ConfigError(
            f"{name}={text!r} is not a size; write e.g. 8GiB, 500MB, 1073741824 or 20%"
        )
    number, unit = float(m.group(1)), m.group(2)
    if unit == "%":
        if whole is None:
            raise ConfigError(f"{name}={text!r}: a percentage is not allowed here")
        if number > 100:
            raise ConfigError(f"{name}={text!r}: a percentage above 100% is not a size")
        return int(whole * number / 100)
    return int(number * _SIZE_UNITS[unit])


def _setting(env: Mapping[str, str], extra: Mapping[str, object], name: str):
    """Value of ``KVCACHE_<NAME>``: the connector's extra config wins over the env."""
    key = f"kvcache_{name}"
    if key in extra and extra[key] not in (None, ""):
        return str(extra[key])
    value = env.get(key.upper())
    return value if value not in (None, "") else None


CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_limit(limit_files: tuple[str, ...] = CGROUP_MEMORY_LIMITS) -> int:
    """Bytes of RAM this container may use: physical RAM, or the cgroup limit if lower."""
    limit = psutil.virtual_memory().total
    for path in limit_files:
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit():  # "max" (cgroup v2) means no limit
            limit = min(limit, int(raw))
    return limit


def _existing_dir(path: str) -> str:
    """The deepest existing folder at or above ``path`` (to measure free space)."""
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        p = os.path.dirname(p)
    return p


def _check_writable(path: str, name: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".probe-{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"x")
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{name}={path!r} is not a writable folder: {e.strerror}") from None


def _tier_usage(path: str) -> int:
    """Bytes a tier folder already holds, from its own accounting (``.usage``, kept by
    ``cache.tiers.files``): instant, where walking a large disk tier would take minutes."""
    try:
        with open(os.path.join(path, ".usage"), "rb") as f:
            raw = f.read(8)
    except OSError:
        return 0
    return int.from_bytes(raw, "little", signed=True) if len(raw) == 8 else 0


def _tier_bytes(size_text: str, name: str, path: str, ram_cap: Optional[int]) -> int:
    """Resolve a tier size against the free space of its filesystem (and RAM for L1)."""
    if parse_size(size_text, 100, name) == 0:
        return 0  # tier disabled: its folder is never touched
    _check_writable(path, name.replace("_SIZE", "_PATH"))
    fs_free = shutil.disk_usage(_existing_dir(path)).free + _tier_usage(path)
    whole = fs_free if ram_cap is None else min(fs_free, ram_cap)
    nbytes = parse_size(size_text, whole, name)
    if ram_cap is not None and nbytes > ram_cap:
        raise ConfigError(
            f"{name}={size_text} ({nbytes:,} bytes) is above the memory this container "
            f"may use ({ram_cap:,} bytes); lower it or give a percentage such as 20%"
        )
    if nbytes > fs_free:
        raise ConfigError(
            f"{name}={size_text} ({nbytes:,} bytes) is above the free space under "
            f"{path!r} ({fs_free:,} bytes); lower it or give a percentage"
        )
    return nbytes


def build_cache_config(
    env: Optional[Mapping[str, str]] = None, extra: Optional[Mapping[str, object]] = None
) -> CacheConfig:
    """The one place that turns the environment into a ``CacheConfig``.

    ``extra`` is vLLM's ``kv_connector_extra_config`` (keys ``kvcache_cpu_size`` ...),
    which wins over ``env`` (``KVCACHE_CPU_SIZE`` ...). Raises ``ConfigError``.
    """
    env = os.environ if env is None else env
    extra = extra or {}
    get = lambda name: _setting(env, extra, name)  # noqa: E731

    chunk_text = get("chunk_tokens") or str(DEFAULT_CHUNK_TOKENS)
    if not chunk_text.isdigit() or int(chunk_text) <= 0:
        raise ConfigError(f"KVCACHE_CHUNK_TOKENS={chunk_text!r} must be a positive integer")

    cpu_path = get("cpu_path") or DEFAULT_CPU_PATH
    disk_path = get("disk_path") or DEFAULT_DISK_PATH
    cpu_bytes = _tier_bytes(get("cpu_size") or "10%", "KVCACHE_CPU_SIZE", cpu_path, memory_limit())
    disk_bytes = _tier_bytes(get("disk_size") or "50%", "KVCACHE_DISK_SIZE", disk_path, None)

    timeout_text = get("remote_timeout_ms") or "2000"
    if not timeout_text.isdigit():
        raise ConfigError(f"KVCACHE_REMOTE_TIMEOUT_MS={timeout_text!r} must be an integer")
    bandwidth = parse_size(get("remote_bandwidth") or "0", None, "KVCACHE_REMOTE_BANDWIDTH")
    threads_text = get("io_threads") or "2"
    if not threads_text.isdigit() or int(threads_text) < 1:
        raise ConfigError(f"KVCACHE_IO_THREADS={threads_text!r} must be a positive integer")

    from cache.policy import POLICIES
    from cache.store import SharedAdmission

    admission = (get("shared_admission") or CacheConfig.shared_admission).strip().lower()
    if admission not in SharedAdmission.MODES:
        raise ConfigError(f"KVCACHE_SHARED_ADMISSION={admission!r} is unknown; choose one of "
                          f"{', '.join(SharedAdmission.MODES)}")

    policy = get("policy") or CacheConfig.policy
    if policy not in POLICIES:
        raise ConfigError(f"KVCACHE_POLICY={policy!r} is unknown; choose one of {sorted(POLICIES)}")

    return CacheConfig(
        chunk_tokens=int(chunk_text),
        cpu_path=cpu_path,
        cpu_bytes=cpu_bytes,
        disk_path=disk_path,
        disk_bytes=disk_bytes,
        remote_url=get("remote_url") or "",
        curvine_conf=get("curvine_conf") or "",
        remote_timeout_ms=int(timeout_text),
        remote_bandwidth=bandwidth,
        shared_admission=admission,
        signing_key=get("signing_key") or "",
        policy=policy,
        io_threads=int(threads_text),
    )


def check_block_size(config: CacheConfig, block_size: int) -> None:
    """Chunks are whole vLLM blocks; anything else is a configuration error."""
    if config.chunk_tokens % block_size:
        raise ConfigError(
            f"KVCACHE_CHUNK_TOKENS={config.chunk_tokens} is not a multiple of vLLM's "
            f"block size ({block_size}); use e.g. {max(1, round(config.chunk_tokens / block_size)) * block_size}"
        )

