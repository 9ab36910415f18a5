"""Where entries live in a tier folder, local or shared: one layout for every tier.

    ROOT/.usage                      bytes held by the whole folder (local tiers; 8 bytes, LE)
    ROOT/.lock                       the folder lock that guards ``.usage`` and ``.pins`` (local tiers)
    ROOT/.pins                       pinned prefixes (``cache.pins``; the last local tier), JSON
    ROOT/<namespace>/<key[:2]>/<key> one entry (``cache.codec``), write-once
    ROOT/<namespace>/<key[:2]>/<key>.tmp-HOST-PID-CLAIMED-RAND
                                     an entry being written, published by a link or rename
    ROOT/<namespace>/.hot/<node>.json one node's popularity note (shared tier; ``cache.tiers.notes``)

Pure names and one small read: no locks, no state. ``FileTier`` (DRAM, disk) and
``SharedTier`` (L3) build their paths here, so a Curvine mount and the SDK see the same
folders the local tiers use, and ``folder_usage`` lets the configuration measure a
local tier's own bytes without knowing how they are stored.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import uuid
from typing import Optional

USAGE_FILE = ".usage"
LOCK_FILE = ".lock"
PINS_FILE = ".pins"
USAGE = struct.Struct("<q")
TMP_MARK = ".tmp-"
_KEY = re.compile(r"[0-9a-f]{32}")
_HOST = socket.gethostname()


def entry_path(folder: str, key: str) -> str:
    """The entry of ``key`` under a namespace folder (``/``-separated: POSIX paths and
    fsspec paths alike)."""
    return f"{folder}/{key[:2]}/{key}"


def is_key(name: str) -> bool:
    """Whether a file name is an entry's (a 128-bit hex key), not a temporary file."""
    return _KEY.fullmatch(name) is not None


def temp_path(final: str, claimed: int = 0) -> str:
    """A new temporary name beside ``final``: unique per host, process and call, and
    carrying the bytes it claims against a capacity (``parse_temp`` reads them back)."""
    return f"{final}{TMP_MARK}{_HOST}-{os.getpid()}-{claimed}-{uuid.uuid4().hex[:8]}"


def parse_temp(name: str) -> Optional[tuple[str, int, int]]:
    """``(host, pid, claimed bytes)`` of a temporary file name; None if ``name`` is not one
    or is not readable (a temporary file of an older format)."""
    if TMP_MARK not in name:
        return None
    try:
        host, pid, claimed = name.split(TMP_MARK, 1)[1].rsplit("-", 3)[:3]
        return host, int(pid), int(claimed)
    except ValueError:
        return None


def this_host() -> str:
    return _HOST


def folder_usage(root: str) -> int:
    """Bytes a local tier folder holds by its own account (``ROOT/.usage``; 0 when there
    is none): instant, where walking a large disk tier would take minutes."""
    try:
        with open(os.path.join(root, USAGE_FILE), "rb") as f:
            raw = f.read(USAGE.size)
    except OSError:
        return 0
    return USAGE.unpack(raw)[0] if len(raw) == USAGE.size else 0
