"""The cache turned off for one model: vLLM serves it without the tiers, never refuses it.

Chosen by the connector at start-up when ``groups.group_layout`` finds KV cache groups the
cache cannot store and load correctly (e.g. Mamba / linear-attention state), or the
engine runs with context parallelism (``context_parallel_reason``). Stands in for
``SchedulerSide`` in the scheduler and ``WorkerSide`` in each worker: it loads nothing,
saves nothing, opens no tier, and reports once, through vLLM's connector-stats
pipeline, that the cache is off (``kvcache:enabled`` 0, every tier's capacity 0 on
``/metrics``). Nothing here blocks.
"""

from __future__ import annotations

from typing import Optional

from cache.config import CacheConfig
from cache.vllm.metadata import TieredKVMetadata
from cache.vllm.metrics import TieredKVStats


def context_parallel_reason(parallel_config, block_size: int) -> Optional[str]:
    """Why the cache is off for an engine with decode (DCP) or prefill (PCP) context
    parallelism, None without: vLLM then spreads each block's tokens over the ranks, and
    its KV cache manager counts blocks of ``block_size`` x DCP tokens, which the chunk
    arithmetic (tokens to blocks, one rank's entry per chunk) does not follow."""
    dcp = getattr(parallel_config, "decode_context_parallel_size", 1) or 1
    pcp = getattr(parallel_config, "prefill_context_parallel_size", 1) or 1
    if dcp == 1 and pcp == 1:
        return None
    return (
        f"context parallelism (decode {dcp}, prefill {pcp}) spreads each block's tokens over "
        f"ranks ({block_size * dcp}-token blocks in vLLM's KV cache manager), which the "
        f"cache's chunks do not follow"
    )


class CacheOff:
    def __init__(self, config: CacheConfig) -> None:
        self._report: Optional[dict] = {"all.enabled": 0, **{f"{t.name}.capacity_bytes": 0 for t in config.tiers()}}

    # -- scheduler role ----------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, out) -> TieredKVMetadata:
        return TieredKVMetadata()

    def loads_failed(self, invalid_block_ids: set[int]) -> None:
        return None

    def requests_failed(self, req_ids: set[str]) -> None:
        return None

    def saves_settled(self, keys: list[str]) -> None:
        return None

    def explain_finished(self, request) -> list[dict]:
        return []  # nothing looked up: the model runs without the tiers (said once at start-up)

    def request_finished(self, request) -> dict:
        return {}

    def planned_tokens(self, req_id: str) -> dict[str, int]:
        return {}

    # -- worker role -------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        return None

    def step_begins(self, meta=None) -> None:
        return None

    def fence(self) -> None:
        return None

    def start_load_kv(self, meta) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def wait_for_save(self, meta) -> None:
        return None

    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def take_settled(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def set_timer(self, timer) -> None:
        return None  # nothing to time (bench/timed_connector.py)

    # -- both ----------------------------------------------------------------------
    def get_stats(self) -> Optional[TieredKVStats]:
        """The cache is off: once, then nothing."""
        report, self._report = self._report, None
        return TieredKVStats(data=report) if report else None
