"""``TieredKVConnector`` built as vLLM builds it, without an engine: a stand-in for the few
``VllmConfig`` fields the connector reads, vLLM's own ``KVCacheConfig``, and the worker's
tensor / pipeline ranks (vLLM's distributed groups do not exist outside an engine).
Used by the tests of the connector's hooks (tests/test_runner_hooks.py,
tests/test_connector_parts.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

from cache.config import build_cache_config, connector_extra

BLOCK, CHUNK, NUM_BLOCKS = 16, 32, 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def cache_config(tmp_path, **extra):
    return build_cache_config(
        {
            "KVCACHE_DRAM_PATH": str(tmp_path / "shm"),
            "KVCACHE_DRAM_SIZE": "16MiB",
            "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
            "KVCACHE_DISK_SIZE": "16MiB",
            "KVCACHE_CHUNK_TOKENS": str(CHUNK),
            **extra,
        }
    )


def engine_config(tmp_path, v2: bool = False, dcp: int = 1, pcp: int = 1, tp: int = 1, **extra):
    """What the connector reads of ``VllmConfig``; ``v2``: vLLM's ``use_v2_model_runner``."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config=connector_extra(cache_config(tmp_path, **extra)),
            kv_load_failure_policy="recompute",
            is_kv_producer=True,
        ),
        cache_config=SimpleNamespace(block_size=BLOCK, prefix_cache_retention_interval=None, cache_dtype="auto"),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp,
            pipeline_parallel_size=1,
            decode_context_parallel_size=dcp,
            prefill_context_parallel_size=pcp,
        ),
        model_config=SimpleNamespace(model="test-model", hf_config="{}", revision=None, quantization=None),
        use_v2_model_runner=v2,
    )


def spec_kw() -> dict:
    return dict(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)


def full_attention() -> KVCacheConfig:
    return KVCacheConfig(NUM_BLOCKS, [], [KVCacheGroupSpec(list(LAYERS), FullAttentionSpec(**spec_kw()))])


def sliding_and_full() -> KVCacheConfig:
    """A hybrid model: layer 0 slides over a 32-token window, layer 1 keeps every token."""
    return KVCacheConfig(
        NUM_BLOCKS,
        [],
        [
            KVCacheGroupSpec([LAYERS[0]], SlidingWindowSpec(sliding_window=2 * BLOCK, **spec_kw())),
            KVCacheGroupSpec([LAYERS[1]], FullAttentionSpec(**spec_kw())),
        ],
    )


def kv_caches(kv_cache_config: KVCacheConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """One CPU tensor per layer, laid out as vLLM's CPU backend does: [blocks, 2, block, heads, dim]."""
    g = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(NUM_BLOCKS, 2, BLOCK, 2, 8, generator=g).to(torch.bfloat16)
        for group in kv_cache_config.kv_cache_groups
        for name in group.layer_names
    }


def connector(monkeypatch, vllm_config, role: KVConnectorRole, kv_cache_config: KVCacheConfig, rank: int = 0):
    """The connector in ``role``; a worker at tensor-parallel rank ``rank``."""
    import vllm.distributed.parallel_state as parallel_state

    from cache.vllm.connector import TieredKVConnector

    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: SimpleNamespace(rank_in_group=rank))
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: SimpleNamespace(rank_in_group=0))
    return TieredKVConnector(vllm_config, role, kv_cache_config)
