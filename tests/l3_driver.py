"""Runs one real vLLM engine (CPU build) with TieredKVConnector for the shared-tier tests.

A subprocess per engine. The engine runs in this one process (no engine-core or worker
processes: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uni executor), which spares two Python
start-ups per engine; the connector's scheduler and worker sides are still separate
objects with separate stores, as in a multi-process engine. Reads a JSON spec from
argv[1]; writes one JSON line per step to stdout, prefixed with ``RESULT ``.

The configuration is resolved once here from ``spec["cache"]`` (``KVCACHE_*`` settings,
also set in the environment, where the signing key is read) and handed to the
connector as one serialized value, as the server does.

Spec: {"model": PATH, "cache": {KVCACHE_* settings},
       "steps": [{"prompt_token_ids": [...]} | {"reset_prefix_cache": true} |
                 {"warm": [[token ids], ...]} | {"shutdown": true}]}

``warm`` runs ``cache.tools.warm.warm_engine`` (what ``python -m cache.tools.warm`` does);
``shutdown`` shuts the engine down the way the warm tool does, which flushes the
cache's write and publish queues.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.update(spec["cache"])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from cache.config import build_cache_config
    from cache.tools.warm import shutdown_engine, warm_engine
    from cache.vllm import kv_transfer_config

    transfer = KVTransferConfig(**kv_transfer_config(build_cache_config()))
    llm = LLM(
        spec["model"],
        kv_transfer_config=transfer,
        max_model_len=4096,
        enforce_eager=True,
        enable_prefix_caching=True,
        seed=0,
        distributed_executor_backend="uni",
    )
    params = SamplingParams(max_tokens=3, logprobs=5, temperature=0)
    for step in spec["steps"]:
        if step.get("reset_prefix_cache"):
            assert llm.reset_prefix_cache()
            continue
        if "warm" in step:
            report = warm_engine(llm, step["warm"])
            result = {"warmed": report.prompts, "reloaded": report.reloaded}
        elif step.get("shutdown"):
            t0 = time.perf_counter()
            shutdown_engine(llm)
            result = {"shutdown_seconds": time.perf_counter() - t0}
        else:
            t0 = time.perf_counter()
            out = llm.generate({"prompt_token_ids": step["prompt_token_ids"]}, params, use_tqdm=False)[0]
            comp = out.outputs[0]
            result = {
                "seconds": time.perf_counter() - t0,
                "token_ids": list(comp.token_ids),
                "logprobs": [{str(k): v.logprob for k, v in d.items()} for d in comp.logprobs],
                "num_cached_tokens": out.num_cached_tokens,
                "loaded": (out.kv_transfer_params or {}).get("kvcache_loaded_tokens", {}),
            }
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
