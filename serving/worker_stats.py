"""A vLLM worker extension that reports the tier counters of the worker's cache store.

vLLM mixes this class into its worker (``--worker-extension-cls``), so it runs in each
worker process, where the store's counters live. The server asks for them with
``AsyncLLM.collective_rpc("kvcache_stats")``, which the engine answers between steps:
the call must stay cheap (a copy of a few integers) and never block on I/O.
"""

from __future__ import annotations

from dataclasses import asdict


class CacheStatsExtension:
    def kvcache_stats(self) -> dict:
        """``{"tiers": {name: TierStats as dict}, "dropped_writes": n}``; {} without a cache."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return {}
        store = getattr(getattr(get_kv_transfer_group(), "worker_side", None), "store", None)
        if store is None:
            return {}
        stats = store.stats
        return {"tiers": {name: asdict(st) for name, st in stats.tiers.items()},
                "dropped_writes": stats.dropped_writes}
