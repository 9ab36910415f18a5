"""The tier plan: the cache configuration resolved once, and what it means for this model.

Runs once at start-up in the server process (``serving.config.build_serving_config``),
before vLLM starts. ``cache.config.build_cache_config`` (the one reader of
``KVCACHE_*``, where the defaults live) resolves every size against this machine, given
the RAM the model weights and vLLM's CPU KV pool need; ``cache.assembly.validate``
checks the names and the shared URL. The resolved ``CacheConfig`` goes to the connector
as one serialized value (``cache.vllm.kv_transfer_config``), so the scheduler, the
workers and this plan agree. Here it is only shown: bytes, tokens and requests per tier.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Mapping, Optional

from cache.assembly import validate
from cache.config import DRAM_MARGIN, CacheConfig, GiB, build_cache_config
from cache.footprint import KVFootprint
from cache.sizes import human_bytes
from serving.machine import Machine

__all__ = ["DRAM_MARGIN", "GiB", "TierPlan", "plan_tiers", "weights_bytes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierPlan:
    """Resolved tier settings plus what they mean in tokens for this model."""

    cache: CacheConfig  # exactly what the connector will build
    footprint: Optional[KVFootprint]  # None when the model's config could not be read
    context_tokens: Optional[int]  # the engine's max model length, if known
    engine_kv_bytes: Optional[int]  # vLLM's own KV pool (L0), estimated
    engine_kv_where: str  # "GPU HBM" or "CPU (VLLM_CPU_KVCACHE_SPACE)"
    notes: tuple[str, ...] = ()
    workers: int = 1  # engine workers (GPUs), each with its staging memory

    def tokens(self, nbytes: Optional[int]) -> Optional[int]:
        if nbytes is None or self.footprint is None:
            return None
        return self.footprint.tokens_in(nbytes, self.context_tokens)  # hybrids: windows, state per request

    def format(self, model: str) -> str:
        """The plan as one readable block, for the start-up log."""
        fp, ctx = self.footprint, self.context_tokens
        lines = [f"KV cache plan for {model}"]
        if fp is not None:
            lines.append(f"  KV per token: {fp.describe()}")
            if ctx:
                lines.append(
                    f"  KV per request at {ctx:,} tokens (max model length): {human_bytes(fp.bytes_per_request(ctx))}"
                )
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
        lines.append(row("L1 dram", c.dram_path, c.dram_bytes))
        lines.append(row("L2 disk", c.disk_path, c.disk_bytes))
        lines.append(
            f"  {'L3 shared':<9} {(c.shared_url or 'off'):<34} "
            f"{'shared' if c.shared_url else '':>11}" + (f"  publishes: {c.shared_admission}" if c.shared_url else "")
        )
        staged = "pinned host memory" if self.engine_kv_where.startswith("GPU") else "host memory"
        lines.append(
            f"  {'staging':<9} {f'{self.workers} worker(s) x {human_bytes(c.staging_bytes)}':<34} "
            f"{human_bytes(c.staging_bytes * self.workers):>11}  {staged} for copies to and from "
            "the tiers (KVCACHE_STAGING_SIZE), left out of L1"
        )
        lines.append(
            f"  chunks of {c.chunk_tokens} tokens, policy {c.policy}, "
            f"{c.io_threads} I/O threads" + (", entries signed" if c.signing_key else "")
        )
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def plan_tiers(
    env: Mapping[str, str],
    machine: Machine,
    footprint: Optional[KVFootprint],
    *,
    weights_bytes: Optional[int] = None,
    engine_cpu_kv_bytes: int = 0,
    engine_kv_bytes: Optional[int] = None,
    engine_kv_blocks: Optional[str] = None,
    reserved_cpus: Optional[int] = None,
    context_tokens: Optional[int] = None,
) -> TierPlan:
    """Resolve the cache configuration once. Raises ``cache.config.ConfigError``."""
    workers = max(1, len(machine.gpus))  # tensor parallel over every GPU by default: a worker each
    cache = build_cache_config(
        env,
        ram_bytes=machine.ram_bytes,
        reserved_ram_bytes=(weights_bytes or 0) + engine_cpu_kv_bytes,
        kv_bytes_per_token=footprint.bytes_per_token if footprint else None,
        workers=workers,
    )
    validate(cache)
    for note in cache.notes:  # also in the plan; said at once, where an operator looks
        log.warning("kvcache: %s", note)
    where = (
        f"GPU HBM ({len(machine.gpus)} x {human_bytes(machine.gpus[0].total_bytes)})"
        if machine.has_gpu
        else "CPU (VLLM_CPU_KVCACHE_SPACE)"
    )
    if engine_kv_blocks:
        where = f"{where.split(' (')[0]}, {engine_kv_blocks} blocks (override)"
    notes = cache.notes
    if reserved_cpus is not None:
        compute = max(0, machine.cpus - reserved_cpus)
        notes += (
            f"CPU binding: VLLM_CPU_NUM_OF_RESERVED_CPU={reserved_cpus}, as vLLM reserves "
            "without a KV connector (it would add one per rank for any connector): "
            + (
                f"the model computes on {compute} of {machine.cpus} cores; the engine-core, "
                "the API and the cache's I/O threads share the other "
                f"{reserved_cpus}"
                if compute
                else f"{machine.cpus} cores leave none to reserve; vLLM binds the model to all "
                "of them and the cache's I/O threads share them"
            ),
        )
    if footprint is not None and footprint.state_layers:  # cache.vllm.groups decides at start-up
        notes += (
            "Mamba / linear-attention layers: the tiered cache turns itself off for this "
            "model (vLLM serves it without; see the connector's start-up line)",
        )
    return TierPlan(cache, footprint, context_tokens, engine_kv_bytes, where, notes, workers)


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
