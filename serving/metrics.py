"""Our Prometheus metrics, next to vLLM's on ``GET /metrics``: only what vLLM and the
connector do not report themselves.

Runs in the server process. Already on vLLM's registry, so not repeated here: prompt
tokens by source (``vllm:prompt_tokens_by_source``: computed, vLLM's prefix cache, our
connector), generated tokens, TTFT over all requests, and the cache's own counters per
tier, which ``TieredKVConnector`` reports through vLLM's connector-stats pipeline
(``kvcache:tier_hits_total``, ``kvcache:tier_tokens_loaded_total``,
``kvcache:tier_used_bytes`` ... see ``cache/vllm/metrics.py``).

Ours, from two sources, neither of which blocks a request:
- request outcomes, recorded on the event loop when a request finishes (``observe``):
  requests and time to first token by the slowest tier that served part of the prefix
  (from the request's ``kv_transfer_params``), KV bytes per request, and time to first
  token by the requests in flight when the request arrived (the live capacity curve);
- on a GPU, the energy counters of NVML (``pynvml``), when it is importable, read at
  scrape time;
- pins (``cache.pins``), read at scrape time from the pin file of the tier that keeps
  them (one ``stat``; parsed again only when it changed): bytes pinned, live pins, the
  tier's pin allowance and one tenant's budget. Every tenant together: no series tells
  tenants apart (pin requests by outcome are the connector's ``kvcache:pin_requests_total``);
- the DRAM warm-up of a new instance (``KVCACHE_WARM_DRAM``, ``serving.dram_warm``), read at
  scrape time: its state, and per set (warm prompts, hottest shared entries) the entries
  planned, the entries and bytes in DRAM, every rank together.
Plus the SageMaker invocations by request shape and status, counted by ``serving.app``.

A metric with no source is absent, never zero-filled: no energy metric without NVML.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from cache.pins import PinBook

log = logging.getLogger(__name__)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 2.5, 5, 10, 30, 60)


@dataclass
class RequestOutcome:
    """What one finished request tells about the cache (built from its last output)."""

    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int  # vLLM's num_cached_tokens (its prefix cache + ours)
    loaded: Mapping[str, int] = field(default_factory=dict)  # tokens per tier of ours
    ttft_s: Optional[float] = None
    in_flight: int = 0  # engine requests in flight at its arrival, itself included

    def slowest_source(self, tier_order: tuple[str, ...]) -> str:
        """The slowest of our tiers that served part of the prompt; else ``vllm`` (the
        engine's own prefix cache) or ``none`` (all computed)."""
        for name in reversed(tier_order):
            if self.loaded.get(name):
                return name
        for name, n in self.loaded.items():  # a tier not in the plan
            if n:
                return name
        return "vllm" if self.cached_tokens else "none"


# Bands of requests in flight (powers of two): the live capacity curve's x axis.
_BAND_TOPS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def in_flight_band(n: int) -> str:
    """The band label of ``n`` requests in flight (``n`` >= 1): ``1``, ``2``, ``3-4``,
    ``5-8`` ... ``129-256``, then ``257+``."""
    if n < 1:
        raise ValueError(f"requests in flight must be >= 1, got {n}")
    low = 1
    for top in _BAND_TOPS:
        if n <= top:
            return str(top) if low == top else f"{low}-{top}"
        low = top + 1
    return f"{low}+"


class _EnergyCollector:
    """At scrape time: GPU energy from NVML, and per generated token."""

    def __init__(self, metrics: "ServingMetrics") -> None:
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        energy = self.m.energy
        if energy is None:
            return
        joules = energy.joules()
        if joules is None:
            return
        yield CounterMetricFamily(
            "kvcache_gpu_energy_joules", "GPU energy used since the server started (NVML), all GPUs", value=joules
        )
        tokens = self.m.generated_total
        if tokens:
            yield GaugeMetricFamily(
                "kvcache_energy_per_generated_token_joules",
                "GPU energy since start divided by tokens generated since start (idle time included)",
                value=joules / tokens,
            )


class _PinCollector:
    """At scrape time: what live pins hold in the tier that keeps them."""

    def __init__(self, book: "PinBook", tier: str) -> None:
        self.book, self.tier = book, tier

    def describe(self):
        return []

    def collect(self):
        try:
            used, count = self.book.usage()
        except OSError as e:  # the folder went away: no pin series this scrape
            log.debug("pin metrics: %s", e)
            return
        for name, doc, value in (
            ("kvcache_pinned_bytes", "Bytes the live pins hold in the tier, every tenant together", used),
            ("kvcache_pins", "Live pins in the tier, every tenant together", count),
            ("kvcache_pin_limit_bytes", "Bytes pins may hold in the tier (KVCACHE_PIN_MAX)", self.book.limit),
            (
                "kvcache_pin_tenant_limit_bytes",
                "Bytes one tenant's pins may hold in the tier (KVCACHE_PIN_TENANT_MAX of the allowance)",
                self.book.tenant_limit,
            ),
        ):
            family = GaugeMetricFamily(name, doc, labels=["tier"])
            family.add_metric([self.tier], value)
            yield family


class _DramWarmCollector:
    """At scrape time: the DRAM warm-up's state and progress (``serving.dram_warm``)."""

    def __init__(self, source: Callable[[], object]) -> None:
        self.source = source  # the engine's DramWarm, None until the engine is ready

    def describe(self):
        return []

    def collect(self):
        from serving.dram_warm import STATES

        warm = self.source()
        state = GaugeMetricFamily(
            "kvcache_dram_warm_state",
            "The DRAM warm-up of KVCACHE_WARM_DRAM: 1 for its state (starting: the engine is not ready yet)",
            labels=["state"],
        )
        for name in ("starting",) + STATES:
            state.add_metric([name], 1.0 if (warm.state if warm is not None else "starting") == name else 0.0)
        yield state
        if warm is None:
            return
        progress = warm.progress()
        for name, doc, key in (
            ("kvcache_dram_warm_planned_entries", "Entries the DRAM warm-up means to have in DRAM", "planned"),
            ("kvcache_dram_warm_entries", "Entries the DRAM warm-up has in DRAM (copied or there already)", "warm"),
            ("kvcache_dram_warm_bytes", "Bytes of the entries the DRAM warm-up has in DRAM", "bytes"),
        ):
            family = GaugeMetricFamily(
                name,
                doc + ", every rank together, by set (prompts: the warm prompts' "
                "chunks; hot: the hottest shared entries)",
                labels=["set"],
            )
            for s, values in progress.items():
                family.add_metric([s], values[key])
            yield family


class NvmlEnergy:
    """Total GPU energy from NVML since construction. Scrape-time reads only."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
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
    """Our metrics, in their own registry (rendered after vLLM's).

    ``tier_order``: our tier names, fastest first (``dram``, ``disk``, ``shared``), to
    name the slowest tier that served a request. ``pins``: ``(PinBook, tier name)`` of the
    tier that keeps pins, None without one.
    """

    def __init__(
        self,
        kv_bytes_per_token: Optional[int],
        tier_order: tuple[str, ...] = (),
        energy: Optional[NvmlEnergy] = None,
        kv_bytes_of: Optional[Callable[[int], int]] = None,
        pins: Optional[tuple["PinBook", str]] = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.kv_bytes_per_token = kv_bytes_per_token
        # KV bytes of a request of n tokens (hybrid models: windows and state count once)
        self.kv_bytes_of = kv_bytes_of or (lambda n: n * (kv_bytes_per_token or 0))
        self.tier_order = tier_order
        self.energy = energy
        self.generated_total = 0  # for energy per token (vLLM counts them on its registry)
        r = self.registry
        self.requests = Counter(
            "kvcache_requests",
            "Finished requests by the slowest tier that served part of their prefix",
            ["prefix_source"],
            registry=r,
        )
        self.request_kv_bytes = Histogram(
            "kvcache_request_kv_bytes",
            "KV bytes of one request (prompt + generated tokens)",
            buckets=[2.0**p for p in range(16, 38, 2)],
            registry=r,
        )
        self.ttft = Histogram(
            "kvcache_time_to_first_token_seconds",
            "Time to first token by the slowest tier that served part of the prefix",
            ["prefix_source"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.ttft_by_load = Histogram(
            "kvcache_time_to_first_token_by_load_seconds",
            "Time to first token by the requests in "
            "flight in the engine when the request arrived, itself included (bands: 1, 2, 3-4, 5-8 ...)",
            ["in_flight"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        if kv_bytes_per_token:
            Gauge("kvcache_kv_bytes_per_token", "KV bytes per token of the served model", registry=r).set(
                kv_bytes_per_token
            )
        self.in_flight = Gauge("sagemaker_invocations_in_flight", "Invocations being served", registry=r)
        self.invocations = Counter(
            "sagemaker_invocations", "Invocations by request shape and HTTP status", ["shape", "status"], registry=r
        )
        r.register(_EnergyCollector(self))
        if pins is not None:
            r.register(_PinCollector(*pins))

    def watch_dram_warm(self, source: Callable[[], object]) -> None:
        """Export the DRAM warm-up that ``source()`` returns (None until the engine is ready)."""
        self.registry.register(_DramWarmCollector(source))

    def observe(self, outcome: RequestOutcome) -> None:
        """Record one finished request. Event loop; microseconds."""
        self.generated_total += outcome.generated_tokens
        slowest = outcome.slowest_source(self.tier_order)
        self.requests.labels(slowest).inc()
        if outcome.ttft_s is not None:
            self.ttft.labels(slowest).observe(outcome.ttft_s)
            if outcome.in_flight >= 1:
                self.ttft_by_load.labels(in_flight_band(outcome.in_flight)).observe(outcome.ttft_s)
        if self.kv_bytes_per_token:
            self.request_kv_bytes.observe(self.kv_bytes_of(outcome.prompt_tokens + outcome.generated_tokens))


def outcome_from_output(out, generated: int, ttft_s: Optional[float], in_flight: int = 0) -> RequestOutcome:
    """Build a ``RequestOutcome`` from vLLM's final ``RequestOutput`` of a request;
    ``in_flight``: the engine's requests in flight when it arrived (0: not known)."""
    params = getattr(out, "kv_transfer_params", None) or {}
    loaded = params.get("kvcache_loaded_tokens") or {}
    return RequestOutcome(
        prompt_tokens=len(getattr(out, "prompt_token_ids", None) or ()),
        generated_tokens=generated,
        cached_tokens=int(getattr(out, "num_cached_tokens", None) or 0),
        loaded={str(k): int(v) for k, v in loaded.items()} if isinstance(loaded, dict) else {},
        ttft_s=ttft_s,
        in_flight=in_flight,
    )


def now() -> float:
    return time.perf_counter()
