"""The model weights' fingerprint in the cache namespace, taken once by the server.

Runs in the server process, on the engine's start-up thread (``serving.engine``), after
an S3 model's files are fetched and before vLLM starts (``/ping`` answers 503 meanwhile):
it reads a few MiB of the model (``cache.weights``; every byte with
``KVCACHE_WEIGHTS_HASH=full``). The value goes into the connector's one serialized
configuration (``weights_fingerprint`` in ``kvcache_config``), so the scheduler, every
worker and the warm-up engine use this one value and read no weights for it themselves.
A model vLLM downloads itself (a hub id) is not on disk yet: its processes each take the
fingerprint once the model is loaded (``cache.vllm.namespace``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace

from cache.config import CONNECTOR_KEY
from cache.errors import ConfigError
from cache.weights import fingerprint
from serving.config import EngineSettings

log = logging.getLogger(__name__)

TRANSFER_FLAG = "--kv-transfer-config"


def with_weights_fingerprint(settings: EngineSettings) -> EngineSettings:
    """``settings`` with the fingerprint of the weights ``--model`` names in our
    connector's configuration; unchanged when the cache is off, another connector is
    configured, or the model is not a local folder or file. Blocks while it reads."""
    args = list(settings.vllm_args)
    if not settings.kvcache_enabled or TRANSFER_FLAG not in args or "--model" not in args:
        return settings
    model = args[args.index("--model") + 1]
    at = args.index(TRANSFER_FLAG) + 1
    try:
        transfer = json.loads(args[at])
        cache = transfer["kv_connector_extra_config"][CONNECTOR_KEY]
    except (ValueError, KeyError, TypeError):
        return settings  # not our connector's configuration
    if not isinstance(cache, dict) or not os.path.exists(model):
        return settings
    try:
        fp = fingerprint(model, cache.get("weights_hash") or "sampled")
    except OSError as e:
        raise ConfigError(
            f"cannot read the weights of {model} (the cache namespace holds their fingerprint): {e}"
        ) from None
    log.info("kvcache: weights of %s: %s", model, fp.describe())
    cache["weights_fingerprint"] = fp.digest
    args[at] = json.dumps(transfer)
    return replace(settings, vllm_args=tuple(args))
