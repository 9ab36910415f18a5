"""Pre-warming: compute the KV of given prompt prefixes once and publish it to the shared
tier (L3), so every endpoint of the model starts warm.

    python -m cache.tools.warm PROMPTS.jsonl --model /opt/ml/model [--max-model-len N] [--batch N]

``PROMPTS.jsonl`` holds one JSON object per line with ``"prompt"`` (text),
``"prompt_token_ids"`` (a list of ints) or ``"messages"`` (a chat, rendered with the
model's chat template and the generation prompt, as the chat route renders it); it is
read by ``cache.prompts.read_prompt_file``, as in the server's start-up check. Cache settings
come from the ``KVCACHE_*`` environment, as for serving (or, from the server, the
connector configuration it resolved); ``KVCACHE_SHARED_URL`` must name the shared tier.

How: a vLLM engine with ``TieredKVConnector`` runs each batch of prompts twice with
``max_tokens=1``. The first pass computes the chunks and stores them in the local tiers;
the second, after vLLM's own prefix cache is reset, reads them back from the local tiers:
a second use, which the store's admission rule publishes to the shared tier (chunks that
were already shared load from it and are left alone). Shutting the engine down flushes
the publish queue. A batch must fit the local tiers (DRAM + disk) to be read back.

Runs in its own process (it starts an engine). At start-up the server runs ``warm`` before
starting its own engine when ``KVCACHE_WARM_PROMPTS`` is set.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from cache.config import config_from_connector, read_prompt_file
from cache.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class WarmReport:
    prompts: int = 0
    tokens: int = 0
    seconds: float = 0.0
    # Tokens the second pass loaded, per tier: "dram"/"disk" were published now,
    # "shared" were shared already.
    reloaded: dict[str, int] = field(default_factory=dict)


def read_prompts(path: str, tokenizer) -> list[list[int]]:
    """Token ids of every prompt in the JSON-lines file ``path``."""
    return tokenize(path, read_prompt_file(path), tokenizer)


def tokenize(path: str, prompts: list[dict], tokenizer) -> list[list[int]]:
    out = []
    for n, obj in enumerate(prompts, 1):
        try:
            out.append(prompt_tokens(obj, tokenizer))
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"{path!r}, prompt {n}: {e}") from None
    return out


def prompt_tokens(obj: dict, tokenizer) -> list[int]:
    if "prompt_token_ids" in obj:
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        return ids
    if "messages" in obj:
        ids = tokenizer.apply_chat_template(obj["messages"], tokenize=True, add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # newer transformers: a dict
    if "prompt" in obj:
        return list(tokenizer.encode(obj["prompt"]))
    raise ValueError('each line needs "prompt", "prompt_token_ids" or "messages"')


def warm_engine(llm, prompts: list[list[int]], batch_size: int = 16) -> WarmReport:
    """Run ``prompts`` through ``llm`` (a ``vllm.LLM`` with ``TieredKVConnector``) so
    their chunks are published to the shared tier. Publishing completes in the
    background; ``shutdown_engine`` waits for it."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0)
    report = WarmReport(prompts=len(prompts), tokens=sum(map(len, prompts)))
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        batch = [{"prompt_token_ids": p} for p in prompts[start : start + batch_size]]
        llm.generate(batch, params, use_tqdm=False)  # compute; the chunks are stored locally
        llm.reset_prefix_cache()  # so the next pass reads them back
        for out in llm.generate(batch, params, use_tqdm=False):
            loaded = (out.kv_transfer_params or {}).get("kvcache_loaded_tokens", {})
            for tier, n in loaded.items():
                report.reloaded[tier] = report.reloaded.get(tier, 0) + n
        llm.reset_prefix_cache()
    report.seconds = time.perf_counter() - t0
    return report


def shutdown_engine(llm, timeout: float = 60.0) -> None:
    """Shut the engine down; its workers flush the cache's queues (writes, publishes)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown(timeout=timeout)


def warm(
    prompts_path: str, model: str, *, batch_size: int = 16, cache: Optional[dict[str, Any]] = None, **engine_args
) -> WarmReport:
    """Publish the KV of the prompts in ``prompts_path`` to the shared tier.

    ``cache``: the connector's ``kv_connector_extra_config`` (the configuration the server
    resolved), or None: the ``KVCACHE_*`` environment; ``engine_args``: more ``vllm.LLM``
    arguments (``max_model_len``, ``dtype`` ...). Raises ``ConfigError`` when no shared
    tier is configured or the prompts file is bad."""
    config = config_from_connector(cache or {})
    if not config.has_shared:
        raise ConfigError("warming needs a shared tier: set KVCACHE_SHARED_URL")
    objs = read_prompt_file(prompts_path)  # before an engine starts
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from cache.vllm import kv_transfer_config

    transfer = KVTransferConfig(**kv_transfer_config(config))
    llm = LLM(model, kv_transfer_config=transfer, enable_prefix_caching=True, **engine_args)
    try:
        prompts = tokenize(prompts_path, objs, llm.get_tokenizer())
        report = warm_engine(llm, prompts, batch_size)
    finally:
        shutdown_engine(llm)
    published = sum(n for tier, n in report.reloaded.items() if tier != "shared")
    log.info(
        "kvcache: warmed %d prompts (%d tokens) in %.1f s: %d tokens published now, %d already shared",
        report.prompts,
        report.tokens,
        report.seconds,
        published,
        report.reloaded.get("shared", 0),
    )
    if report.prompts and not report.reloaded:
        log.warning(
            "kvcache: warm-up reloaded nothing: are the local tiers large enough for one "
            "batch (KVCACHE_DRAM_SIZE, KVCACHE_DISK_SIZE, --batch)?"
        )
    return report


def main(argv: Optional[Iterable[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cache.tools.warm", description=__doc__.split("\n\n")[0])
    parser.add_argument("prompts", help="JSON-lines file of prompts")
    parser.add_argument("--model", default="/opt/ml/model", help="model path or id (default /opt/ml/model)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--batch", type=int, default=16, help="prompts per batch (must fit the local tiers)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_args = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    try:
        report = warm(args.prompts, args.model, batch_size=args.batch, **engine_args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        json.dumps(
            {
                "prompts": report.prompts,
                "tokens": report.tokens,
                "seconds": round(report.seconds, 2),
                "reloaded": report.reloaded,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
