"""Tier sizing: how many bytes, and so how many tokens of KV, each cache tier gets.

Runs once at start-up in the server process (``serving.config.build_serving_config``),
before vLLM starts. The ``KVCACHE_*`` variables always win; where one is unset, this
module picks a default from the machine:

- L1 DRAM (``KVCACHE_CPU_SIZE``): 20% of the RAM the container may use, but never more
  than what the model weights, vLLM's own CPU KV pool (CPU machines) and a 4 GiB
  margin leave, nor more than the free space of the shared-memory folder it lives in.
- L2 disk (``KVCACHE_DISK_SIZE``): 50% of the free space under ``KVCACHE_DISK_PATH``.

Every size is resolved by ``cache.config.build_cache_config`` (the one parser of
``KVCACHE_*``), and the resolved byte counts are handed to the connector through
``kv_connector_extra_config``, so the scheduler, the workers and this plan agree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from cache.config import CacheConfig, build_cache_config
from cache.footprint import KVFootprint, human_bytes
from serving.machine import Machine

GiB = 1 << 30
DRAM_SHARE = 0.20          # default L1 size: share of the container's RAM
DRAM_MARGIN = 4 * GiB      # RAM kept for the server, tokenizer, Python heaps
DISK_SHARE = "50%"         # default L2 size: share of the free space under the disk path
SMALL_SHM = 1 * GiB        # below this, the DRAM folder is probably Docker's 64 MiB /dev/shm


@dataclass(frozen=True)
class TierPlan:
    """Resolved tier settings plus what they mean in tokens for this model."""

    cache: CacheConfig                    # exactly what the connector will build
    footprint: Optional[KVFootprint]      # None when the model's config could not be read
    context_tokens: Optional[int]         # the engine's max model length, if known
    engine_kv_bytes: Optional[int]        # vLLM's own KV pool (L0), estimated
    engine_kv_where: str                  # "GPU HBM" or "CPU (VLLM_CPU_KVCACHE_SPACE)"
    notes: tuple[str, ...] = ()

    def tokens(self, nbytes: Optional[int]) -> Optional[int]:
        if nbytes is None or self.footprint is None:
            return None
        return self.footprint.tokens_in(nbytes, self.context_tokens)  # hybrids: windows, state per request

    def connector_extra(self) -> dict[str, str]:
        """``kv_connector_extra_config`` for ``TieredKVConnector`` (sizes in bytes).

        The signing key stays in the environment: vLLM logs its whole config.
        """
        c = self.cache
        extra = {
            "kvcache_chunk_tokens": str(c.chunk_tokens),
            "kvcache_cpu_path": c.cpu_path,
            "kvcache_cpu_size": str(c.cpu_bytes),
            "kvcache_disk_path": c.disk_path,
            "kvcache_disk_size": str(c.disk_bytes),
            "kvcache_remote_timeout_ms": str(c.remote_timeout_ms),
            "kvcache_policy": c.policy,
            "kvcache_io_threads": str(c.io_threads),
        }
        if c.remote_url:
            extra["kvcache_remote_url"] = c.remote_url
            extra["kvcache_shared_admission"] = c.shared_admission
        if c.curvine_conf:
            extra["kvcache_curvine_conf"] = c.curvine_conf
        return extra

    def format(self, model: str) -> str:
        """The plan as one readable block, for the start-up log."""
        fp, ctx = self.footprint, self.context_tokens
        lines = [f"KV cache plan for {model}"]
        if fp is not None:
            lines.append(f"  KV per token: {fp.describe()}")
            if ctx:
                lines.append(f"  KV per request at {ctx:,} tokens (max model length): "
                             f"{human_bytes(fp.bytes_per_request(ctx))}")
        else:
            lines.append("  KV per token: unknown (model config not readable); sizes in bytes only")

        def row(tier: str, where: str, nbytes: Optional[int], extra: str = "") -> str:
            size = "off" if nbytes == 0 else ("?" if nbytes is None else human_bytes(nbytes))
            toks = self.tokens(nbytes)
            held = ""
            if toks is not None and nbytes:
                held = f"~{toks:,} tokens"
                if ctx and fp is not None:
                    held += f" = {fp.requests_in(nbytes, ctx):,} full-length requests"
            return f"  {tier:<9} {where:<34} {size:>11}  {held}{extra}"

        c = self.cache
        lines.append(row("L0 engine", self.engine_kv_where, self.engine_kv_bytes, " (vLLM prefix cache)"))
        lines.append(row("L1 DRAM", c.cpu_path, c.cpu_bytes))
        lines.append(row("L2 disk", c.disk_path, c.disk_bytes))
        lines.append(f"  {'L3 remote':<9} {(c.remote_url or 'off'):<34} "
                     f"{'shared' if c.remote_url else '':>11}"
                     + (f"  publishes: {c.shared_admission}" if c.remote_url else ""))
        lines.append(f"  chunks of {c.chunk_tokens} tokens, policy {c.policy}, "
                     f"{c.io_threads} I/O threads"
                     + (", entries signed" if c.signing_key else ""))
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def dram_default(machine: Machine, ceiling: int, weights_bytes: Optional[int],
                 engine_cpu_kv_bytes: int) -> tuple[int, list[str]]:
    """Default L1 bytes (see the module docstring) and notes explaining any cap."""
    notes = []
    share = int(machine.ram_bytes * DRAM_SHARE)
    reserve = (weights_bytes or 0) + engine_cpu_kv_bytes + DRAM_MARGIN
    left = max(0, machine.ram_bytes - reserve)
    size = min(share, left, ceiling)
    if size < share:
        why = (f"the free space of the DRAM folder ({human_bytes(ceiling)})" if ceiling < left
               else f"RAM left after weights, engine KV and margin ({human_bytes(left)})")
        notes.append(f"DRAM tier capped by {why}")
    if ceiling < SMALL_SHM:
        notes.append(f"the DRAM folder's filesystem has only {human_bytes(ceiling)} free; under "
                     "Docker pass --shm-size, or point KVCACHE_CPU_PATH at a larger tmpfs")
    return size, notes


def plan_tiers(
    env: Mapping[str, str],
    machine: Machine,
    footprint: Optional[KVFootprint],
    *,
    weights_bytes: Optional[int] = None,
    engine_cpu_kv_bytes: int = 0,
    engine_kv_bytes: Optional[int] = None,
    context_tokens: Optional[int] = None,
) -> TierPlan:
    """Resolve every tier size. Raises ``cache.config.ConfigError`` on a bad setting."""
    # The most each tier could take, measured exactly as the connector will measure it.
    ceiling = build_cache_config(env, {"kvcache_cpu_size": "100%", "kvcache_disk_size": "100%"})
    defaults: dict[str, str] = {}
    notes: list[str] = []
    if not env.get("KVCACHE_CPU_SIZE"):
        dram, notes = dram_default(machine, ceiling.cpu_bytes, weights_bytes, engine_cpu_kv_bytes)
        defaults["kvcache_cpu_size"] = str(dram)
    if not env.get("KVCACHE_DISK_SIZE"):
        defaults["kvcache_disk_size"] = DISK_SHARE
    cache = build_cache_config(env, defaults)
    where = (f"GPU HBM ({len(machine.gpus)} x {human_bytes(machine.gpus[0].total_bytes)})"
             if machine.has_gpu else "CPU (VLLM_CPU_KVCACHE_SPACE)")
    if footprint is not None and footprint.state_layers:  # cache.connector.groups decides at start-up
        notes.append("Mamba / linear-attention layers: the tiered cache turns itself off for this "
                     "model (vLLM serves it without; see the connector's start-up line)")
    return TierPlan(cache, footprint, context_tokens, engine_kv_bytes, where, tuple(notes))


def weights_bytes(model_dir: Optional[str]) -> Optional[int]:
    """Bytes of weight files in a local model folder (None if not local)."""
    if not model_dir or not os.path.isdir(model_dir):
        return None
    total = 0
    for root, _dirs, files in os.walk(model_dir):
        for f in files:
            if f.endswith((".safetensors", ".bin", ".pt", ".gguf")):
                try:
                    total += os.path.getsize(os.path.join(root, f))
                except OSError:
                    pass
    return total
