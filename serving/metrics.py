"""Our Prometheus metrics, next to vLLM's on ``GET /metrics``.

Runs in the server process. Three sources, none of which blocks a request:
- request outcomes, recorded on the event loop when a request finishes (``observe``):
  prompt tokens by where their KV came from (vLLM's own prefix cache, each of our
  tiers via the request's ``kv_transfer_params``, or computed), KV bytes per request,
  time to first token by the slowest tier that served part of the prefix;
- per-tier counters of the worker's store (hits, misses, bytes, load time ...), copied
  from the worker by ``Engine.cache_stats`` before a scrape and rendered by a collector,
  and tier usage read from each tier folder's shared ``.usage`` file. When the connector
  reports these itself through vLLM's connector stats (``kvcache:tier_*`` on vLLM's
  registry), ours stay quiet so nothing is counted twice;
- on a GPU, the energy counters of NVML (``pynvml``), when it is importable.

A metric with no source is absent, never zero-filled: no energy metric without NVML.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

# Tier counters copied from the worker store (cache.store.TierStats field -> metric).
TIER_COUNTERS = {
    "hits": ("kvcache_tier_hits", "Chunks read from the tier"),
    "misses": ("kvcache_tier_misses", "Chunk reads that found the chunk in no tier (counted on the top tier)"),
    "bytes_read": ("kvcache_tier_read_bytes", "Bytes loaded from the tier"),
    "bytes_written": ("kvcache_tier_written_bytes", "Bytes stored into the tier"),
    "load_seconds": ("kvcache_tier_load_seconds", "Time spent reading and verifying chunks from the tier"),
    "writes": ("kvcache_tier_writes", "Chunks stored into the tier"),
    "evictions": ("kvcache_tier_evictions", "Chunks evicted from the tier"),
    "demotions": ("kvcache_tier_demotions", "Evicted chunks handed down to the next tier"),
    "promotions": ("kvcache_tier_promotions", "Chunks copied up into the tier after a hit below"),
    "rejected": ("kvcache_tier_rejected", "Chunks the tier's admission policy or capacity refused"),
    "corrupt": ("kvcache_tier_corrupt", "Damaged or foreign entries found and dropped"),
    "errors": ("kvcache_tier_errors", "I/O errors of the tier"),
}
PREFIX_SOURCES = ("vllm", "computed")  # plus one per tier name


@dataclass
class RequestOutcome:
    """What one finished request tells about the cache (built from its last output)."""

    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int                    # vLLM's num_cached_tokens (its prefix cache + ours)
    loaded: Mapping[str, int] = field(default_factory=dict)  # tokens per tier of ours
    ttft_s: Optional[float] = None

    @property
    def from_tiers(self) -> int:
        return sum(self.loaded.values())

    def by_source(self) -> dict[str, int]:
        ours = self.from_tiers
        vllm_hit = max(0, self.cached_tokens - ours)
        counts = {"vllm": vllm_hit, "computed": max(0, self.prompt_tokens - vllm_hit - ours)}
        counts.update({k: int(v) for k, v in self.loaded.items()})
        return counts

    def slowest_source(self, tier_order: tuple[str, ...]) -> str:
        for name in reversed(tier_order):
            if self.loaded.get(name):
                return name
        for name, n in self.loaded.items():  # a tier not in the plan
            if n:
                return name
        return "vllm" if self.cached_tokens else "none"


class _TierCollector:
    """At scrape time: NVML energy, and, unless vLLM's registry already has them, the
    last worker snapshot of tier counters and the tier folders' usage."""

    def __init__(self, metrics: "ServingMetrics") -> None:
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        yield from self._energy()
        if self.m.tier_metrics_elsewhere:
            return
        snap = self.m.worker_snapshot
        if snap:
            for key, (name, doc) in TIER_COUNTERS.items():
                fam = CounterMetricFamily(name, doc, labels=["tier"])
                for tier, stats in snap.get("tiers", {}).items():
                    fam.add_metric([tier], float(stats.get(key, 0)))
                yield fam
            yield CounterMetricFamily("kvcache_dropped_writes", "Writes dropped because the "
                                      "write-behind queue was full", value=snap.get("dropped_writes", 0))
        usage = GaugeMetricFamily("kvcache_tier_usage_bytes", "Bytes held in the tier folder "
                                  "(all engines sharing it)", labels=["tier"])
        cap = GaugeMetricFamily("kvcache_tier_capacity_bytes", "Configured tier size", labels=["tier"])
        for name, (capacity, reader) in self.m.tier_usage.items():
            cap.add_metric([name], float(capacity))
            try:
                usage.add_metric([name], float(reader()))
            except OSError as e:
                log.debug("usage of tier %s unreadable: %s", name, e)
        yield usage
        yield cap

    def _energy(self):
        energy = self.m.energy
        if energy is None:
            return
        joules = energy.joules()
        if joules is None:
            return
        yield CounterMetricFamily("kvcache_gpu_energy_joules", "GPU energy used since the server "
                                  "started (NVML), all GPUs", value=joules)
        tokens = self.m.generated_total
        if tokens:
            yield GaugeMetricFamily("kvcache_energy_per_generated_token_joules", "GPU energy since "
                                    "start divided by tokens generated since start (idle time "
                                    "included)", value=joules / tokens)


class NvmlEnergy:
    """Total GPU energy from NVML since construction. Scrape-time reads only."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                         for i in range(pynvml.nvmlDeviceGetCount())]
        if not self._handles:
            raise RuntimeError("no GPU")
        self._start = self._millijoules()

    def _millijoules(self) -> int:
        return sum(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self._handles)

    def joules(self) -> Optional[float]:
        try:
            return (self._millijoules() - self._start) / 1000.0
        except Exception as e:  # NVML went away (driver reset)
            log.debug("NVML energy read failed: %s", e)
            return None

    @classmethod
    def try_create(cls) -> Optional["NvmlEnergy"]:
        try:
            return cls()
        except Exception as e:  # no pynvml, no GPU, or energy counters unsupported
            log.info("GPU energy metrics off: %s", e)
            return None


class ServingMetrics:
    """Our metrics, in their own registry (rendered after vLLM's)."""

    def __init__(self, kv_bytes_per_token: Optional[int], tier_order: tuple[str, ...] = (),
                 tier_usage: Optional[Mapping[str, tuple[int, object]]] = None,
                 energy: Optional[NvmlEnergy] = None) -> None:
        self.registry = CollectorRegistry()
        self.kv_bytes_per_token = kv_bytes_per_token
        self.tier_order = tier_order
        self.tier_usage = dict(tier_usage or {})   # name -> (capacity, callable returning used bytes)
        self.energy = energy
        self.worker_snapshot: dict = {}
        # Set when vLLM's registry already carries the tier metrics (kvcache:tier_*,
        # from the connector's own stats): the tier collector then stays quiet.
        self.tier_metrics_elsewhere = False
        self.generated_total = 0
        r = self.registry
        self.prefix_tokens = Counter(
            "kvcache_prefix_tokens", "Prompt tokens by where their KV came from: vllm (the "
            "engine's own prefix cache), a tier of ours (dram, disk, remote), or computed",
            ["source"], registry=r)
        for source in PREFIX_SOURCES + tier_order:
            self.prefix_tokens.labels(source)
        self.generated_tokens = Counter("kvcache_generated_tokens", "Tokens generated", registry=r)
        self.requests = Counter("kvcache_requests", "Finished requests by the slowest tier that "
                                "served part of their prefix", ["prefix_source"], registry=r)
        self.request_kv_bytes = Histogram(
            "kvcache_request_kv_bytes", "KV bytes of one request (prompt + generated tokens)",
            buckets=[2.0 ** p for p in range(16, 38, 2)], registry=r)
        self.ttft = Histogram(
            "kvcache_time_to_first_token_seconds", "Time to first token by the slowest tier "
            "that served part of the prefix", ["prefix_source"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        if kv_bytes_per_token:
            Gauge("kvcache_kv_bytes_per_token", "KV bytes per token of the served model",
                  registry=r).set(kv_bytes_per_token)
        self.in_flight = Gauge("sagemaker_invocations_in_flight", "Invocations being served", registry=r)
        self.invocations = Counter("sagemaker_invocations", "Invocations by request shape and "
                                   "HTTP status", ["shape", "status"], registry=r)
        r.register(_TierCollector(self))

    def observe(self, outcome: RequestOutcome) -> None:
        """Record one finished request. Event loop; microseconds."""
        for source, n in outcome.by_source().items():
            if n:
                self.prefix_tokens.labels(source).inc(n)
        self.generated_tokens.inc(outcome.generated_tokens)
        self.generated_total += outcome.generated_tokens
        slowest = outcome.slowest_source(self.tier_order)
        self.requests.labels(slowest).inc()
        if outcome.ttft_s is not None:
            self.ttft.labels(slowest).observe(outcome.ttft_s)
        if self.kv_bytes_per_token:
            self.request_kv_bytes.observe(
                (outcome.prompt_tokens + outcome.generated_tokens) * self.kv_bytes_per_token)


def outcome_from_output(out, generated: int, ttft_s: Optional[float]) -> RequestOutcome:
    """Build a ``RequestOutcome`` from vLLM's final ``RequestOutput`` of a request."""
    params = getattr(out, "kv_transfer_params", None) or {}
    loaded = params.get("kvcache_loaded_tokens") or {}
    return RequestOutcome(
        prompt_tokens=len(getattr(out, "prompt_token_ids", None) or ()),
        generated_tokens=generated,
        cached_tokens=int(getattr(out, "num_cached_tokens", None) or 0),
        loaded={str(k): int(v) for k, v in loaded.items()} if isinstance(loaded, dict) else {},
        ttft_s=ttft_s,
    )


def now() -> float:
    return time.perf_counter()
