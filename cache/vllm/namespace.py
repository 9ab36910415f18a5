"""The cache namespace of one vLLM engine and rank, derived from its configuration and
its weights, and the salt of one request's prefix (``Salts``).

``engine_namespace`` runs in the scheduler and in every worker at start-up; all must
derive the same namespace, so it is built from ``VllmConfig``, ``KVCacheConfig`` and the
weights' fingerprint (``cache.weights``), never from tensors. The fingerprint is the
server's, taken once before vLLM started (``CacheConfig.weights_fingerprint``); without
it (plain ``vllm serve``) each process takes it itself (``weights_id``, once per
process: a few MiB read, or the whole model with ``KVCACHE_WEIGHTS_HASH=full``).

``Salts`` runs in the scheduler, on its loop: a LoRA adapter is told apart by the
content of its files (``cache.weights``), fingerprinted the first time a request names
it (a few MiB read, once per adapter) and remembered.

The namespace holds the KV cache spec, not the physical layout vLLM cuts the cache in,
nor its kernel block size: entries hold one canonical order whatever those are
(``cache.vllm.kv_layout``), so engines that differ only there share entries.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from typing import Optional

from cache.config import CacheConfig
from cache.keys import Namespace
from cache.weights import fingerprint

log = logging.getLogger(__name__)


def engine_namespace(vllm_config, kv_cache_config, chunk_tokens: int, rank: int, *, weights: str) -> Namespace:
    """The namespace of parallel rank ``rank`` (tensor x pipeline) of this engine, whose
    weights have the fingerprint ``weights`` (``weights_id``)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    groups = kv_cache_config.kv_cache_groups
    if len(groups) == 1:
        kv_layout = repr(groups[0].kv_cache_spec)
    else:  # hybrid: every group's layers and spec (cache.vllm.groups)
        kv_layout = ";".join(f"{list(g.layer_names)}={g.kv_cache_spec!r}" for g in groups)
    hf_config = model.hf_config
    hf = hf_config.to_json_string(use_diff=False) if hasattr(hf_config, "to_json_string") else repr(hf_config)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(hf.encode())
    digest.update(f"revision={model.revision};quant={model.quantization};weights={weights}".encode())
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


def weights_id(vllm_config, config: CacheConfig) -> str:
    """The fingerprint of this engine's weights: the server's, or taken here."""
    if config.weights_fingerprint:
        return config.weights_fingerprint
    model = vllm_config.model_config
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    return _weights_of(str(model.model), model.revision, download_dir, config.weights_hash)


@functools.lru_cache(maxsize=8)
def _weights_of(model: str, revision: Optional[str], download_dir: Optional[str], mode: str) -> str:
    folder = local_copy(model, revision, download_dir, "config.json")
    if folder is None:
        log.warning(
            "kvcache: the weights of %s are not in a local folder: the namespace knows them "
            "only by name and revision (%s); two different models of that name would share "
            "entries",
            model,
            revision or "default",
        )
        return f"unread:{model}@{revision}"
    fp = fingerprint(folder, mode)
    log.info("kvcache: weights of %s: %s", model, fp.describe())
    return fp.digest


def local_copy(name: str, revision: Optional[str], cache_dir: Optional[str], marker: str) -> Optional[str]:
    """``name`` if it is a local folder or file, else the local snapshot of the Hugging
    Face repository ``name`` that holds ``marker`` (nothing is downloaded); None if none."""
    if os.path.exists(name):
        return name
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, marker, cache_dir=cache_dir, revision=revision)
    except Exception:  # not a repository id, no cache: not found
        return None
    return os.path.dirname(found) if isinstance(found, str) else None


class Salts:
    """What besides the tokens changes a prefix's KV or who may see it, folded into the
    first key of its chain: the LoRA adapter (by content) and vLLM's per-request
    ``cache_salt`` (a tenant's secret against prefix-cache timing attacks). A prompt
    without either keeps the plain chain, so it never meets a salted entry, and salted
    prompts meet only entries of the same salt, in every tier."""

    def __init__(self, mode: str = "sampled") -> None:
        self.mode = mode
        self._adapters: dict[tuple[int, str], str] = {}  # (lora_int_id, lora_path) -> fingerprint

    def __call__(self, request) -> str:
        lora = getattr(request, "lora_request", None)
        parts = {"lora": self.adapter(lora) if lora else None, "cache_salt": getattr(request, "cache_salt", None)}
        if not any(parts.values()):
            return ""
        return json.dumps(parts, sort_keys=True)

    def adapter(self, lora) -> str:
        """The fingerprint of a LoRA adapter's files, taken once per adapter (again when
        vLLM is told to reload it in place)."""
        key = (lora.lora_int_id, lora.lora_path)
        if key not in self._adapters or getattr(lora, "load_inplace", False):
            folder = local_copy(lora.lora_path, None, None, "adapter_config.json")
            try:
                fp = fingerprint(folder, self.mode).digest if folder else None
            except OSError as e:
                log.warning("kvcache: cannot read LoRA adapter %s at %s (%s)", lora.lora_name, folder, e)
                fp = None
            if fp is None:  # vLLM will not load it either, or finds it elsewhere: by name
                fp = f"unread:{lora.lora_name}:{lora.lora_path}"
            else:
                log.info("kvcache: LoRA adapter %s (%s): weights %s", lora.lora_name, lora.lora_path, fp)
            self._adapters[key] = fp
        return self._adapters[key]
