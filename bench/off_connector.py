"""Ours with parts switched off, to split a gap under load into its causes (issue 31 item 2).

Each class loads instead of ours (``kv_connector=<class>``,
``kv_connector_module_path="bench.off_connector"``, same extra config) and runs in vLLM's
processes like the real connector; ``bench.timed_server`` swaps one in
(``KVBENCH_CONNECTOR``), ``bench.low_load`` names them as configurations:

- ``OffTieredKVConnector`` (``ours-off``): the cache off (``cache.vllm.off.CacheOff``, what
  the connector itself uses for a model it cannot store): no lookup, load or save, no tier
  opened, no thread started. vLLM still runs every connector hook of every step (the
  scheduler's ``build_connector_meta``, the worker's bind / start-load / wait-for-save, the
  connector output carried back): against vLLM alone at the same L0 it measures what that
  plumbing costs.
- ``NoSaveTieredKVConnector`` (``ours-nosave``): ours, but every save's copy is refused as
  when no staging slot is free, so the save settles at once, neither copied nor written
  (lookups, planning and loads as ours).
- ``CopyOnlyTieredKVConnector`` (``ours-copyonly``): each save's blocks are copied to
  staging on the forward thread, as ours does, then settled without a write: the copy's
  share apart from the writer thread's.
- ``NoCopyDownTieredKVConnector`` (``ours-nocopydown``): ours, saves written, but chunks
  found stored are not copied down to disk (``TieredStore.persist``, durability): the
  writer thread's share that is copies, apart from new entries.

Not part of the product: entries are never written, so nothing saved is ever found.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from cache.config import config_from_connector
from cache.vllm.connector import TieredKVConnector
from cache.vllm.off import CacheOff
from cache.vllm.worker import WorkerSide


class OffTieredKVConnector(TieredKVConnector):
    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        KVConnectorBase_V1.__init__(self, vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = config_from_connector(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.scheduler_side = self.worker_side = CacheOff(config)
        self._fence_after_save = False
        self.kv_events = None
        self.popularity = None


class NoSaveTieredKVConnector(TieredKVConnector):
    """Every save's copy refused (as with no staging slot free): settled at once, nothing
    copied or written."""

    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        if isinstance(self.worker_side, WorkerSide):
            for copier in self.worker_side.copiers:
                copier.gather_async = lambda block_ids: None


class CopyOnlyTieredKVConnector(TieredKVConnector):
    """Every save copied to staging on the forward thread as ours does; the store then
    settles it at once (slot released) instead of queueing it for the writer."""

    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        if isinstance(self.worker_side, WorkerSide):
            self.worker_side.store.put = _settled_at_once


class NoCopyDownTieredKVConnector(TieredKVConnector):
    """Ours, but what requests find stored is not queued to be copied down to disk."""

    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        if isinstance(self.worker_side, WorkerSide):
            self.worker_side.store.persist = lambda keys: None


def _settled_at_once(key, parent, dtype, shape, payload, shared=False, on_done=None, ready=None, borrowed=False):
    """``TieredStore.put``'s signature; waits for the copy, settles, stores nothing."""
    if ready is not None:
        ready()
    if on_done is not None:
        on_done(key)
    return True
