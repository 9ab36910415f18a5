"""The vLLM adapter: the connector vLLM loads, and what it runs on each side.

``connector`` (thin ``KVConnectorBase_V1``) hands every call to ``scheduler``
(engine-core process: decides what loads and saves, never blocks) or ``worker`` (each
worker process: copies KV with ``kv_copy``); ``metadata`` is what they send each other
per step, ``namespace`` derives an engine's cache namespace, ``metrics`` feeds vLLM's
Prometheus pipeline, ``plugin`` is a vLLM general plugin (AMX permission on CPUs),
``warm_rpc`` the worker methods a server calls to warm the DRAM tier (``WORKER_EXTENSION``).

Only this package imports vLLM; the rest of ``cache`` is engine-agnostic. This file
imports no vLLM: ``kv_transfer_config`` is what a server or tool passes to vLLM.
"""

from __future__ import annotations

from cache.config import CacheConfig, connector_extra

CONNECTOR_CLASS = "TieredKVConnector"
CONNECTOR_MODULE = "cache.vllm.connector"
# vLLM's --worker-extension-cls for the DRAM warm-up's worker methods (KVCACHE_WARM_DRAM)
WORKER_EXTENSION = "cache.vllm.warm_rpc.KVCacheWorkerExtension"


def kv_transfer_config(config: CacheConfig) -> dict:
    """vLLM's ``--kv-transfer-config`` for our connector, carrying ``config`` resolved."""
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": connector_extra(config),
    }
