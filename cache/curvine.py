"""The Curvine client's settings, checked: its configuration file or its master addresses.

A leaf under ``cache.config``, which reads ``KVCACHE_CURVINE_CONF`` and
``KVCACHE_CURVINE_MASTERS`` and hands their values to ``curvine_client``; runs once per
process that builds the cache configuration (one ``isfile``, no network).
"""

from __future__ import annotations

import os
import re
from typing import Optional

from cache.errors import ConfigError

CURVINE_MASTER_PORT = 8995  # Curvine's default master RPC port
_HOST_PORT = re.compile(r"([A-Za-z0-9._-]+)(?::(\d{1,5}))?")


def curvine_client(conf: str, masters_text: str, url: str, base_dir: Optional[str]) -> tuple[str, tuple[str, ...]]:
    """``KVCACHE_CURVINE_CONF`` (``conf``: absolute; a relative path is inside the model
    folder, ``base_dir``/model, ``SAGEMAKER_BASE_DIR``'s) and ``KVCACHE_CURVINE_MASTERS``
    (``masters_text``: ``host:port`` each), checked for the shared tier's ``url``."""
    if conf and masters_text:
        raise ConfigError(
            f"KVCACHE_CURVINE_CONF={conf!r} and KVCACHE_CURVINE_MASTERS={masters_text!r} "
            "are both set; give the Curvine client one of them"
        )
    masters = []
    for item in filter(None, (m.strip() for m in masters_text.split(","))):
        m = _HOST_PORT.fullmatch(item)
        port = int(m.group(2) or CURVINE_MASTER_PORT) if m else 0
        if not m or not 0 < port < 65536:
            raise ConfigError(f"KVCACHE_CURVINE_MASTERS={masters_text!r}: {item!r} is not host:port")
        masters.append(f"{m.group(1)}:{port}")
    if conf and not os.path.isabs(conf):
        conf = os.path.join(base_dir or "/opt/ml", "model", conf)
    if conf and url.startswith("curvine://") and not os.path.isfile(conf):
        raise ConfigError(
            f"KVCACHE_CURVINE_CONF={conf!r} is not a file (a relative path is read inside the model folder)"
        )
    return conf, tuple(masters)
