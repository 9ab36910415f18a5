"""``TieredKVConnector``: vLLM's KV connector API in front of the tiered store.

Load it with::

    --kv-transfer-config '{"kv_connector":"TieredKVConnector",
                           "kv_connector_module_path":"cache.vllm.connector",
                           "kv_role":"kv_both"}'

vLLM builds one instance with the scheduler role (engine-core process) and one per
worker. This file is thin: each call goes to ``SchedulerSide`` or ``WorkerSide``.

Configuration: the one serialized value the server resolved (``kvcache_config`` in
``kv_connector_extra_config``; ``cache.config.connector_extra``), read back as it is.
Under plain ``vllm serve`` without it, each process builds the configuration from its
``KVCACHE_*`` environment (``cache.config.build_cache_config``). Either way a bad setting
stops start-up with one ``ConfigError`` message naming the variable.

Hybrid models: the connector implements vLLM's ``SupportsHMA``, so vLLM keeps its hybrid
KV cache manager on (sliding-window layers hold only their window); what is stored per KV
cache group is in ``cache.vllm.groups``. A model whose groups the cache cannot serve
(Mamba / linear attention ...) runs without the cache (``cache.vllm.off``): one log line
says so, never a refusal.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from cache.assembly import validate
from cache.config import check_block_size, config_from_connector
from cache.vllm.groups import group_layout
from cache.vllm.metadata import TieredKVMetadata, TieredKVWorkerMetadata
from cache.vllm.namespace import engine_namespace, weights_id
from cache.vllm.off import CacheOff
from cache.vllm.planner import bytes_per_block

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("cache.vllm.connector")


class TieredKVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        config = config_from_connector(transfer.kv_connector_extra_config or {})
        validate(config)  # a plain `vllm serve` had no start-up check of these
        for note in config.notes:  # (built from the environment here: said once per process)
            log.warning("kvcache: %s", note)
        block_size = vllm_config.cache_config.block_size
        check_block_size(config, block_size)
        parallel = vllm_config.parallel_config
        world = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        self.scheduler_side = self.worker_side = None
        # Which KV cache groups are stored how (groups.py), the same in every process.
        layout = group_layout(kv_cache_config, block_size)
        if layout.off_reason:
            self.scheduler_side = self.worker_side = CacheOff(config)
            if role == KVConnectorRole.SCHEDULER:
                log.warning("kvcache: OFF for model %s: %s; vLLM serves it without the tiered KV "
                            "cache", vllm_config.model_config.model, layout.off_reason)
            return
        weights = weights_id(vllm_config, config)  # the weights' fingerprint, in every namespace
        if role == KVConnectorRole.SCHEDULER:
            from cache.vllm.scheduler import SchedulerSide

            # A cache never fails a request: a chunk that cannot be loaded is recomputed.
            if transfer.kv_load_failure_policy != "recompute":
                transfer.kv_load_failure_policy = "recompute"
            from cache.vllm.pinning import Pinner, chunk_entry_bytes

            namespaces = [engine_namespace(vllm_config, kv_cache_config, config.chunk_tokens, r, weights=weights)
                          for r in range(world)]
            pinner = Pinner(config, [ns.id for ns in namespaces],
                            chunk_entry_bytes(kv_cache_config, config.chunk_tokens))
            self.scheduler_side = SchedulerSide(config, namespaces, block_size,
                                                lambda: self._kv_cache_manager, layout,
                                                vllm_config.cache_config.prefix_cache_retention_interval,
                                                bytes_per_block(kv_cache_config), pinner)
            log.info("kvcache: chunk %d tokens (%d-token blocks); dram %s (%s bytes), "
                     "disk %s (%s bytes), shared %s; policy %s", config.chunk_tokens, block_size,
                     config.dram_path, f"{config.dram_bytes:,}", config.disk_path,
                     f"{config.disk_bytes:,}", config.shared_url or "off", config.policy)
            if layout.hybrid:
                log.info("kvcache: hybrid KV cache groups: %s", layout.describe())
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            from cache.vllm.worker import WorkerSide

            # This worker's parallel rank: tensor-parallel rank within its pipeline stage.
            rank = get_tp_group().rank_in_group + parallel.tensor_parallel_size * get_pp_group().rank_in_group
            ns = engine_namespace(vllm_config, kv_cache_config, config.chunk_tokens, rank, weights=weights)
            self.worker_side = WorkerSide(config, ns, kv_cache_config.num_blocks, block_size, layout)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # best-effort cache: a dropped save is a future miss

    # -- worker role -------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker_side is not None:
            self.worker_side.step_begins(connector_metadata if isinstance(connector_metadata, TieredKVMetadata)
                                         else None)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredKVMetadata)
        self.worker_side.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Layer-wise loads (cache.vllm.layered); other loads finished in start_load_kv
        # (sync) or before the request runs (async).
        if self.worker_side is not None:
            self.worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata, **kwargs: Any) -> None:
        return  # saves are gathered once per step, in wait_for_save

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, TieredKVMetadata)
            self.worker_side.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        done = self.worker_side.get_finished()
        return None, (done or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Hybrid models' load failures are per request (vLLM recomputes those requests).
        failed = self.worker_side.take_failed_requests()
        done = self.worker_side.get_finished() | failed
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self):
        return self.worker_side.take_settled()

    def get_kv_connector_stats(self):
        side = self.worker_side if self.worker_side is not None else self.scheduler_side
        return side.get_stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None):
        from cache.vllm.metrics import TieredKVStats

        return TieredKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from cache.vllm.metrics import TieredKVPromMetrics

        return TieredKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()

    # -- scheduler role ----------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        # The chunk events first: a failed load is explained by what its step reported.
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(worker_meta, TieredKVWorkerMetadata):
            self.scheduler_side.explain.worker_events(worker_meta.events)
        if connector_output.invalid_block_ids:
            self.scheduler_side.loads_failed(set(connector_output.invalid_block_ids))
        if getattr(connector_output, "failed_recving", None):
            self.scheduler_side.requests_failed(set(connector_output.failed_recving))
        if isinstance(worker_meta, TieredKVWorkerMetadata):
            self.scheduler_side.saves_settled(worker_meta.settled)
            self.scheduler_side.planner.observe(worker_meta.samples)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        why = self.scheduler_side.explain_finished(request)
        loaded = self.scheduler_side.request_finished(request)
        pinner = getattr(self.scheduler_side, "pinner", None)
        pin = pinner.finished(request) if pinner is not None else None
        # Shown in the request's output (kv_transfer_params): tokens loaded per tier,
        # where each prompt token's KV came from or why it was computed, and its pin.
        params = {"kvcache_explain": why} if why else {}
        if loaded:
            params["kvcache_loaded_tokens"] = loaded
        if pin:
            params["kvcache_pin"] = pin
        return False, (params or None)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self.request_finished(request, block_ids[0] if block_ids else [])
