"""The cache namespace of one vLLM engine and rank, derived from its configuration, and
the salt of one request's prefix (``prefix_salt``).

Runs in the scheduler and in every worker at start-up; both must derive the same
namespace from the same configuration, so it is built only from ``VllmConfig`` and
``KVCacheConfig`` (never from tensors). It holds the KV cache spec, not the physical
layout vLLM cuts the cache in, nor its kernel block size: entries hold one canonical
order whatever those are (``cache.vllm.kv_layout``), so engines that differ only there
share entries.
"""

from __future__ import annotations

import hashlib
import json

from cache.keys import Namespace


def engine_namespace(vllm_config, kv_cache_config, chunk_tokens: int, rank: int) -> Namespace:
    """The namespace of parallel rank ``rank`` (tensor x pipeline) of this engine."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    groups = kv_cache_config.kv_cache_groups
    if len(groups) == 1:
        kv_layout = repr(groups[0].kv_cache_spec)
    else:  # hybrid: every group's layers and spec (cache.vllm.groups)
        kv_layout = ";".join(f"{list(g.layer_names)}={g.kv_cache_spec!r}" for g in groups)
    hf = model.hf_config.to_json_string(use_diff=False) if hasattr(model.hf_config, "to_json_string") else repr(model.hf_config)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(hf.encode())
    digest.update(f"revision={model.revision};quant={model.quantization}".encode())
    world = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    return Namespace(
        model=str(model.model),
        model_digest=digest.hexdigest(),
        kv_dtype=str(vllm_config.cache_config.cache_dtype),
        kv_layout=kv_layout,
        rank=rank,
        world_size=world,
        chunk_tokens=chunk_tokens,
    )


def prefix_salt(request) -> str:
    """What besides the tokens changes a prefix's KV or who may see it, folded into the
    first key of its chain: the LoRA adapter, and vLLM's per-request ``cache_salt`` (a
    tenant's secret against prefix-cache timing attacks). A prompt without either keeps
    the plain chain, so it never meets a salted entry, and salted prompts meet only
    entries of the same salt, in every tier."""
    lora = getattr(request, "lora_request", None)
    parts = {"lora": lora.lora_name if lora else None, "cache_salt": getattr(request, "cache_salt", None)}
    if not any(parts.values()):
        return ""
    return json.dumps(parts, sort_keys=True)
