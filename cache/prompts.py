"""The prompts file of pre-warming (``KVCACHE_WARM_PROMPTS``, ``python -m cache.tools.warm``).

One JSON object per line with ``prompt`` (text), ``prompt_token_ids`` (a list of ints) or
``messages`` (a chat). ``read_prompt_file`` is the one parser: the server's start-up check
(``cache.config.warm_prompts``) and the warm tool both call it. A leaf: reads one file.
"""

from __future__ import annotations

import json
from typing import Optional

from cache.errors import ConfigError

WARM_KEYS = ("prompt", "prompt_token_ids", "messages")


def read_prompt_file(path: str, source: Optional[str] = None) -> list[dict]:
    """The prompts of a JSON-lines file: one object per line with ``prompt`` (text),
    ``prompt_token_ids`` (a list of ints) or ``messages`` (a chat). Raises ``ConfigError``
    naming ``source`` (default: the path) and the line."""
    source = source or repr(path)
    prompts = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise ConfigError(f"{source}, line {n}: not JSON ({e})") from None
                if not isinstance(obj, dict) or not any(k in obj for k in WARM_KEYS):
                    raise ConfigError(
                        f"{source}, line {n}: each line must be a JSON object with one of {', '.join(WARM_KEYS)}"
                    )
                ids = obj.get("prompt_token_ids")
                if ids is not None and not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
                    raise ConfigError(f"{source}, line {n}: prompt_token_ids must be a list of integers")
                prompts.append(obj)
    except OSError as e:
        raise ConfigError(f"{source} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{source} is not UTF-8 text: {e}") from None
    if not prompts:
        raise ConfigError(f"{source} holds no prompts")
    return prompts
