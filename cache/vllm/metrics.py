"""Cache metrics through vLLM's own connector-stats pipeline.

Workers report deltas of their store counters (``get_kv_connector_stats``, once per
engine step, cheap); vLLM aggregates them across workers, ships them to the front-end
process and calls ``TieredKVPromMetrics.observe`` there, which feeds Prometheus. So
``/metrics`` of any vLLM front end (ours or ``vllm serve``) carries per-tier hits, misses,
bytes, load time, usage, and prefix tokens served from each tier.

Data format: a flat dict ``{"<tier>.<field>": number}``. Counters are deltas and add
up over ranks (each rank's own reads and writes), except those counting requests
(``counts_requests``: tokens loaded, loads by mode), which only rank 0 reports; fields
in ``LEVELS`` are levels (bytes in use) and aggregate by max (ranks share their tiers'
folders). ``all.enabled`` (``kvcache:enabled``) is 1 while the cache serves
the model, 0 when the model runs without it (``cache.vllm.off``, reported once,
with every tier's capacity 0). The scheduler adds ``{"miss:<cause>:<tier>": tokens}``:
prompt tokens computed since its last report, by the reason they were not loaded
(``cache.explain``), exported as ``kvcache:misses_total{tier,cause}``, and
``{"plan:<path>.requests": n}``: requests by what the cost model chose (``load``,
``partial``, ``recompute``; ``cache.vllm.planner``). The workers add
``{"write_failure:<cause>:<tier>": n}``: failed tier writes by cause (``cache.faults``),
exported as ``kvcache:tier_write_failures_total{tier,cause}``, and
``{"load:<mode>.<field>": n}`` per load mode (``sync``, ``layered``, ``async``): loads, their
seconds, the cost model's estimate against the measured seconds of the loads it
estimated, and loads cut short at their deadline (``PLAN_COUNTERS``;
``cache.vllm.load_costs``). The scheduler also reports the tiers' miss-ratio curves
(``cache.curves``): ``{"curve:<tier>:<size>.hit_ratio": r}`` (a level,
``kvcache:curve_hit_ratio{tier,size}``), ``{"curve:<tier>.sample_rate": r}`` (a level) and
``{"curve:<tier>.tokens": n}`` (``kvcache:curve_tokens_total{tier}``), and the cost
model's fitted rates, ``{"cost:<tier>.<rate>": x}`` and ``{"cost:prefill.<rate>": x}``
(levels, ``COST_RATES``). The scheduler's ``{"pin:<outcome>.requests": n}`` counts pin
requests by outcome (``cache.vllm.pinning``); no label ever comes from a request's content.
"""

from __future__ import annotations

from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

LEVELS = (
    "used_bytes",
    "capacity_bytes",
    "enabled",
    "hit_ratio",
    "sample_rate",
    "load_latency_seconds",
    "load_seconds_per_token",
    "seconds_per_token",
    "seconds_per_pair",
)
# The cost model's fitted rates (``cache.vllm.planner.LoadPlanner.rates``): field -> (metric,
# documentation); a tier's carry the label ``tier``, the engine's prefill none.
COST_RATES = {
    "load_latency_seconds": (
        "kvcache:cost_load_latency_seconds",
        "The cost model's fitted latency of a load from the tier",
    ),
    "load_seconds_per_token": (
        "kvcache:cost_load_seconds_per_token",
        "The cost model's fitted seconds per token loaded from the tier (one rank's share of the token's KV)",
    ),
    "seconds_per_token": (
        "kvcache:cost_prefill_seconds_per_token",
        "The cost model's fitted prefill seconds per token computed",
    ),
    "seconds_per_pair": (
        "kvcache:cost_prefill_seconds_per_pair",
        "The cost model's fitted prefill seconds per attention pair (query token x earlier token)",
    ),
}

COUNTERS = {
    "hits": "Chunk reads served by the tier",
    "misses": "Chunk reads that no tier could serve",
    "bytes_read": "Bytes read from the tier",
    "bytes_written": "Bytes written to the tier",
    "writes": "Entries written to the tier",
    "evictions": "Entries evicted from the tier",
    "demotions": "Evicted entries written down to the next tier",
    "promotions": "Entries copied up into the tier after a hit below",
    "rejected": "Writes the tier's admission policy refused",
    "corrupt": "Damaged or foreign entries found and dropped",
    "errors": "Tier I/O errors (never fail a request)",
    "timeouts": "Reads from the tier that passed their deadline (recomputed)",
    "unavailable": "Operations skipped while the tier was unreachable",
    "load_seconds": "Seconds spent reading and verifying entries",
    "dropped_writes": "Saves dropped because the write-behind queue was full (tier=all)",
    "dropped_publishes": "Shared-tier publishes dropped because their queue was full (tier=all)",
    "tokens_loaded": "Prompt tokens whose KV was loaded from the tier instead of recomputed",
    "persisted": "Reused entries copied down into the tier in the background, so a restart finds them",
    "dropped_persists": "Copies to disk of reused entries dropped because their queue was full (tier=all)",
    "dropped_staging": "Saves skipped because no staging buffer was free (KVCACHE_STAGING_SIZE; tier=all)",
    "unstaged_loads": "GPU loads copied from pageable memory because no staging buffer was free (tier=all)",
}

# ("<prefix>", "<field>") of keys "<prefix>:<label>.<field>" -> (metric name, label name, documentation)
PLAN_COUNTERS = {
    ("plan", "requests"): (
        "kvcache:requests_by_path",
        "path",
        "Requests that found a prefix in the tiers, by what the cost model chose: load "
        "(everything found), partial (a prefix of it, the rest recomputed), recompute",
    ),
    ("load", "loads"): (
        "kvcache:loads",
        "mode",
        "Loads by mode: sync (whole, before the forward pass), layered (layer by layer, "
        "during the forward pass), async (the request waits, others run)",
    ),
    ("load", "seconds"): ("kvcache:load_seconds", "mode", "Measured wall time of loads"),
    ("load", "estimated_seconds"): (
        "kvcache:load_estimated_seconds",
        "mode",
        "The cost model's estimate of the loads it estimated",
    ),
    ("load", "estimated_actual_seconds"): (
        "kvcache:load_estimated_actual_seconds",
        "mode",
        "Measured wall time of the loads the cost model estimated",
    ),
    ("load", "cut_short"): (
        "kvcache:loads_cut_short",
        "mode",
        "Loads that ran past their deadline; the rest of the prompt was recomputed",
    ),
    ("pin", "requests"): (
        "kvcache:pin_requests",
        "outcome",
        "Requests that asked for a pin, by outcome: pinned, or why not (tenant_budget, "
        "tier_budget, pins_off, bad_request, no_local_tier, no_whole_chunk, write_error)",
    ),
}


class TieredKVStats(KVConnectorStats):
    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> "TieredKVStats":
        for k, v in other.data.items():
            if k.rsplit(".", 1)[-1] in LEVELS:
                self.data[k] = max(self.data.get(k, 0), v)
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        # levels alone ride along with counters, except the cache-off report and the cost
        # model's rates (sent when first fitted, then now and then)
        return "all.enabled" not in self.data and not any(
            v for k, v in self.data.items() if k.rsplit(".", 1)[-1] not in LEVELS or k.startswith("cost:")
        )


def counts_requests(key: str) -> bool:
    """Whether counter ``key`` counts requests rather than one rank's I/O: every rank
    loads its own part of each request's KV, and vLLM sums the workers' stats, so these
    would count each request once per rank (tensor x pipeline parallel)."""
    return key.startswith("load:") or key.endswith(".tokens_loaded")


class StatsDelta:
    """Turns the store's running totals into per-interval deltas (worker side).
    ``per_request``: this rank reports the counters of requests (rank 0 only)."""

    def __init__(self, per_request: bool = True) -> None:
        self.per_request = per_request
        self._last: dict[str, float] = {}
        self._levels: dict[str, float] = {}

    def take(self, now: dict[str, float], levels: dict[str, float]) -> Optional[TieredKVStats]:
        """``now``: the store's running totals (``TieredStore.counters``); ``levels``: its
        usage (``TieredStore.levels``), passed through as they are. None when neither
        changed since the last report (every decode step, mostly)."""
        if not self.per_request:
            now = {k: v for k, v in now.items() if not counts_requests(k)}
        if now == self._last and levels == self._levels:  # most steps: nothing moved (compared in C)
            return None
        delta = {k: v - self._last.get(k, 0) for k, v in now.items() if v != self._last.get(k, 0)}
        self._last, self._levels = now, dict(levels)
        return TieredKVStats(data={**delta, **levels})


class TieredKVPromMetrics(KVConnectorPromMetrics):
    """Runs in the front-end process; ``observe`` is called on vLLM's logging path."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = labelnames + ["tier"]
        self._counters = {
            field: self._counter_cls(name=f"kvcache:tier_{field}", documentation=doc, labelnames=names)
            for field, doc in COUNTERS.items()
        }
        self._misses = self._counter_cls(
            name="kvcache:misses",
            labelnames=labelnames + ["tier", "cause"],
            documentation="Prompt tokens whose KV was computed, by why it was not loaded "
            "(cause) and the tier concerned (none: no one tier)",
        )
        self._write_failures = self._counter_cls(
            name="kvcache:tier_write_failures",
            labelnames=names + ["cause"],
            documentation="Failed writes to the tier, by cause (no_space, read_only, io_error, missing, "
            "unavailable, timeout ...); the entry is not stored there",
        )
        self._gauges = {
            "used_bytes": self._gauge_cls(
                name="kvcache:tier_used_bytes", documentation="Bytes held by the tier", labelnames=names
            ),
            "capacity_bytes": self._gauge_cls(
                name="kvcache:tier_capacity_bytes", documentation="Byte bound of the tier", labelnames=names
            ),
        }
        self._plan = {
            key: self._counter_cls(name=name, documentation=doc, labelnames=labelnames + [label])
            for key, (name, label, doc) in PLAN_COUNTERS.items()
        }
        self._curve = {
            "hit_ratio": self._gauge_cls(
                name="kvcache:curve_hit_ratio",
                labelnames=names + ["size"],
                documentation="Token hit ratio the traffic seen so far would get from the tier at this "
                "multiple of its configured size (sampled simulation: cache/curves.py)",
            ),
            "sample_rate": self._gauge_cls(
                name="kvcache:curve_sample_rate",
                labelnames=names,
                documentation="Share of chunks the tier's curve simulates",
            ),
            "tokens": self._counter_cls(
                name="kvcache:curve_tokens", labelnames=names, documentation="Prompt tokens the tier's curve has seen"
            ),
        }
        self._rates = {
            field: self._gauge_cls(
                name=name, documentation=doc, labelnames=labelnames + (["tier"] if field.startswith("load") else [])
            )
            for field, (name, doc) in COST_RATES.items()
        }
        self._enabled = self._gauge_cls(
            name="kvcache:enabled",
            labelnames=labelnames,
            documentation="1 while the tiered KV cache serves the model; 0 when vLLM serves it "
            "without the cache (the connector's start-up log line says why)",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for key, value in transfer_stats_data.items():
            prefix, colon, rest = key.partition(":")
            if colon and (prefix, rest.rpartition(".")[2]) in self._plan:
                label, _, field = rest.rpartition(".")
                if value > 0:
                    self._plan[(prefix, field)].labels(*labels, label).inc(value)
                continue
            if prefix == "curve":  # "curve:<tier>.tokens", "curve:<tier>[:<size>].<level>"
                label, _, field = rest.rpartition(".")
                if field == "tokens":
                    if value > 0:
                        self._curve[field].labels(*labels, label).inc(value)
                elif field in self._curve:
                    self._curve[field].labels(*labels, *label.split(":", 1)).set(value)
                continue
            if prefix == "cost":  # "cost:<tier>.load_<rate>", "cost:prefill.<rate>"
                label, _, field = rest.rpartition(".")
                if field in self._rates:
                    self._rates[field].labels(*labels, *([label] if field.startswith("load") else [])).set(value)
                continue
            if key.startswith(("miss:", "write_failure:")):
                kind, cause, tier = key.split(":", 2)
                if value > 0:
                    counter = self._misses if kind == "miss" else self._write_failures
                    counter.labels(*labels, tier, cause).inc(value)
                continue
            tier, _, field = key.rpartition(".")
            if field == "enabled":
                self._enabled.labels(*labels).set(value)
            elif field in self._gauges:
                self._gauges[field].labels(*labels, tier).set(value)
            elif field in self._counters and value > 0:
                self._counters[field].labels(*labels, tier).inc(value)
