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
says so, never a refusal. So does an engine with decode or prefill context parallelism.

Model runners: vLLM 0.32 calls the worker hooks from its V1 model runner (the CPU build
always; the engine tests) or its V2 one (the GPU default). Both bind the step's metadata,
start synchronous loads before the forward pass and asynchronous ones after it, then call
``wait_for_save`` and ``get_transfer_results`` (V2 after sampling); V2 calls
``handle_preemptions`` only after the step's own writes to KV blocks (zeroing,
copy-on-write copies), so there the fence that orders those writes after earlier saves'
copies runs at the end of the step before. ``tests/test_runner_hooks.py`` drives this
connector through vLLM's own hook code of both runners.
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
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from cache.assembly import validate
from cache.config import check_block_size, config_from_connector
from cache.vllm.groups import group_layout, kind_block_bytes
from cache.vllm.metadata import TieredKVMetadata, TieredKVWorkerMetadata
from cache.vllm.namespace import engine_namespace, weights_id
from cache.vllm.off import CacheOff, context_parallel_reason
from cache.vllm.planner import bytes_per_block

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from cache.popularity import Publisher
    from cache.vllm.events import TierEvents
    from cache.vllm.scheduler import SchedulerSide
    from cache.vllm.worker import WorkerSide

log = logging.getLogger("cache.vllm.connector")


# vLLM's label of a hit's source (vllm:prompt_tokens_cached_by_source) per tier: the shared
# tier is a remote store, which vLLM 0.32 labels external_unspecified.
HIT_SOURCES = {"dram": CacheHitSource.HOST, "disk": CacheHitSource.DISK}


def hit_sources(tokens_by_tier: dict[str, int], n: int) -> dict[CacheHitSource, int]:
    """``n`` hit tokens by vLLM's source label, from the tokens the load takes per tier
    (all external_unspecified when those do not add up to ``n``)."""
    if sum(tokens_by_tier.values()) != n:
        return {CacheHitSource.EXTERNAL_UNSPECIFIED: n} if n else {}
    out: dict[CacheHitSource, int] = {}
    for tier, tokens in tokens_by_tier.items():
        source = HIT_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
        out[source] = out.get(source, 0) + tokens
    return {source: tokens for source, tokens in out.items() if tokens}


class TieredKVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
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
        # The role's side: one of the two, or CacheOff for both when the cache is off.
        self.scheduler_side: Optional[SchedulerSide | CacheOff] = None
        self.worker_side: Optional[WorkerSide | CacheOff] = None
        self._fence_after_save = False
        # The tiers' KV events for routers (cache.vllm.events), when vLLM publishes them.
        self.kv_events: Optional[TierEvents] = None
        self.popularity: Optional[Publisher] = None  # this node's popularity note's publisher
        # Which KV cache groups are stored how (groups.py), the same in every process.
        layout = group_layout(kv_cache_config, block_size)
        off_reason = context_parallel_reason(parallel, block_size) or layout.off_reason
        if off_reason:
            self.scheduler_side = self.worker_side = CacheOff(config)
            if role == KVConnectorRole.SCHEDULER:
                log.warning(
                    "kvcache: OFF for model %s: %s; vLLM serves it without the tiered KV cache",
                    vllm_config.model_config.model,
                    off_reason,
                )
            return
        weights = weights_id(vllm_config, config)  # the weights' fingerprint, in every namespace
        if role == KVConnectorRole.SCHEDULER:
            from cache.vllm.scheduler import SchedulerSide

            # A cache never fails a request: a chunk that cannot be loaded is recomputed.
            if transfer.kv_load_failure_policy != "recompute":
                transfer.kv_load_failure_policy = "recompute"
            from cache.curves import tier_curves
            from cache.popularity import Popularity, Publisher
            from cache.vllm.pinning import Pinner, chunk_entry_bytes

            namespaces = [
                engine_namespace(vllm_config, kv_cache_config, config.chunk_tokens, r, weights=weights)
                for r in range(world)
            ]
            entry_bytes = chunk_entry_bytes(kv_cache_config, config.chunk_tokens)
            pinner = Pinner(config, [ns.id for ns in namespaces], entry_bytes)
            popularity = Popularity() if config.has_shared else None
            self.scheduler_side = side = SchedulerSide(
                config,
                namespaces,
                block_size,
                lambda: self._kv_cache_manager,
                layout,
                vllm_config.cache_config.prefix_cache_retention_interval,
                bytes_per_block(kv_cache_config),
                pinner,
                tier_curves(config, entry_bytes * world),
                popularity,
                kind_block_bytes(kv_cache_config, layout),
            )
            if popularity is not None:  # this node's popularity note, in every rank's shared folder
                self.popularity = Publisher(popularity, [v.shared for v in side.views])
                self.popularity.start()
            log.info(
                "kvcache: chunk %d tokens (%d-token blocks); dram %s (%s bytes), "
                "disk %s (%s bytes), shared %s; policy %s",
                config.chunk_tokens,
                block_size,
                config.dram_path,
                f"{config.dram_bytes:,}",
                config.disk_path,
                f"{config.disk_bytes:,}",
                config.shared_url or "off",
                config.policy,
            )
            if layout.hybrid:
                log.info("kvcache: hybrid KV cache groups: %s", layout.describe())
            from cache.vllm.events import tier_events

            self.kv_events = tier_events(vllm_config, config, namespaces[0].id, world, layout.hybrid, side.views[0])
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            from cache.vllm.worker import WorkerSide

            # This worker's parallel rank: tensor-parallel rank within its pipeline stage.
            rank = get_tp_group().rank_in_group + parallel.tensor_parallel_size * get_pp_group().rank_in_group
            ns = engine_namespace(vllm_config, kv_cache_config, config.chunk_tokens, rank, weights=weights)
            self.worker_side = WorkerSide(config, ns, kv_cache_config.num_blocks, block_size, layout)
            # Model runner V2 (vLLM's GPU default) calls handle_preemptions after this step's
            # writes to KV blocks (zeroing, copy-on-write), V1 before them: under V2 the fence
            # goes at the end of the step before (wait_for_save), after its sampling.
            self._fence_after_save = bool(getattr(vllm_config, "use_v2_model_runner", False))
            if rank == 0:
                log.info("kvcache: vLLM model runner %s", "V2" if self._fence_after_save else "V1")

    @property
    def _worker(self) -> WorkerSide | CacheOff:
        if self.worker_side is None:
            raise RuntimeError("kvcache: a worker hook was called on the scheduler's connector")
        return self.worker_side

    @property
    def _scheduler(self) -> SchedulerSide | CacheOff:
        if self.scheduler_side is None:
            raise RuntimeError("kvcache: a scheduler hook was called on a worker's connector")
        return self.scheduler_side

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # best-effort cache: a dropped save is a future miss

    # -- worker role -------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # V1: first in the step, before vLLM writes KV blocks (zeroing, copy-on-write
        # copies); earlier saves' copies must be done reading blocks it may reuse.
        self._worker.fence()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker_side is not None:
            self.worker_side.step_begins(
                connector_metadata if isinstance(connector_metadata, TieredKVMetadata) else None
            )

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredKVMetadata)
        self._worker.start_load_kv(meta)

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
            self._worker.wait_for_save(meta)
        if self._fence_after_save:  # V2: the last hook before the next step writes KV blocks
            self._worker.fence()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # What vLLM 0.32 asks (both model runners; never get_finished). Hybrid models' load
        # failures are per request (vLLM recomputes those requests), reported finished too.
        done, failed = self._worker.take_transfer_results()
        return KVConnectorTransferResults(finished_recving=done | failed, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self):
        return self._worker.take_settled()

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
        if self.kv_events is not None:
            self.kv_events.close()
        if self.popularity is not None:  # the counts since the last note, before the engine goes
            self.popularity.close()

    def take_events(self):
        return self.kv_events.take() if self.kv_events is not None else ()

    # -- scheduler role ----------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        side = self._scheduler
        found = side.get_num_new_matched_tokens(request, num_computed_tokens)
        if self.kv_events is not None and not isinstance(side, CacheOff):
            state = side.requests.get(request.request_id)
            if state:  # the request's chunks, for the events of the tiers that will store them
                self.kv_events.seen(request, state.chunks)
        return found

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        # vllm:prompt_tokens_cached_by_source: where the tokens of the load just planned come from
        return hit_sources(self._scheduler.planned_tokens(request.request_id), num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        # The chunk events first: a failed load is explained by what its step reported.
        side = self._scheduler
        if isinstance(side, CacheOff):
            return  # nothing was loaded or saved
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(worker_meta, TieredKVWorkerMetadata):
            worker_meta = None
        if worker_meta is not None:
            side.explain.worker_events(worker_meta.events)
        if connector_output.invalid_block_ids:
            side.loads_failed(set(connector_output.invalid_block_ids))
        if getattr(connector_output, "failed_recving", None):
            side.requests_failed(set(connector_output.failed_recving))
        if worker_meta is not None:
            side.saves_settled(worker_meta.settled)
            side.planner.observe(worker_meta.samples)
            if self.kv_events is not None:
                self.kv_events.apply(worker_meta.events)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        why = self._scheduler.explain_finished(request)
        if self.kv_events is not None:
            self.kv_events.finished(request.request_id)
        loaded = self._scheduler.request_finished(request)
        pinner = getattr(self.scheduler_side, "pinner", None)
        pin = pinner.finished(request) if pinner is not None else None
        # Shown in the request's output (kv_transfer_params): tokens loaded per tier,
        # where each prompt token's KV came from or why it was computed, and its pin.
        params: dict[str, Any] = {"kvcache_explain": why} if why else {}
        if loaded:
            params["kvcache_loaded_tokens"] = loaded
        if pin:
            params["kvcache_pin"] = pin
        return False, (params or None)

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, Optional[dict[str, Any]]]:
        return self.request_finished(request, block_ids[0] if block_ids else [])
