"""The worker methods a server calls to warm the DRAM tier (``KVCACHE_WARM_DRAM``).

vLLM mixes ``KVCacheWorkerExtension`` into its worker class when the engine runs with
``--worker-extension-cls cache.vllm.warm_rpc.KVCacheWorkerExtension``
(``cache.vllm.WORKER_EXTENSION``; the server adds it when the setting is on), so that
``AsyncLLM.collective_rpc("kvcache_warm_dram", args=(job,))`` runs the method in every
worker and returns each rank's answer (``serving.dram_warm`` is the caller).

Runs in each worker process, on its main thread, between engine steps: every method
returns at once (the copying runs on the warm-up's own thread, ``cache.dram_warm``).
Answers are plain dicts (vLLM sends them back with msgpack).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from cache.dram_warm import DramWarm
from cache.threads import spare_cpus, thread_setup

log = logging.getLogger(__name__)

_warm: Optional[DramWarm] = None  # this worker's one warm-up


def _worker_side() -> Any:
    """Our connector's worker side, when the cache runs in this worker (None when it is off)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    side = getattr(get_kv_transfer_group(), "worker_side", None)
    return side if getattr(side, "store", None) is not None else None


def _off(why: str) -> dict:
    return {"state": "off", "error": why}


class KVCacheWorkerExtension:
    """Methods vLLM adds to its worker (``collective_rpc`` calls them by name)."""

    def kvcache_warm_dram(self, job: dict) -> dict:
        """Start this rank's warm-up: ``job`` is ``{"prompts": [[token ids], ...], "budget":
        bytes}``. A second call answers the status of the first."""
        global _warm
        if _warm is None:
            side = _worker_side()
            if side is None:
                return _off("the tiered KV cache does not run in this worker")
            if not side.config.dram_bytes:
                return _off("there is no DRAM tier")
            setup = thread_setup(spare_cpus())  # off this worker's compute cores, niced
            _warm = DramWarm(
                side.store, side.namespace.chain_digest, side.config.chunk_tokens, setup=lambda: setup("write")
            )
            _warm.start(job.get("prompts") or [], int(job.get("budget") or 0))
        return _warm.status()

    def kvcache_warm_status(self) -> dict:
        return _warm.status() if _warm is not None else _off("no warm-up was started")

    def kvcache_warm_stop(self) -> dict:
        """Stop the warm-up after the entry being copied; answers its status."""
        if _warm is None:
            return _off("no warm-up was started")
        _warm.stop()
        return _warm.status()
