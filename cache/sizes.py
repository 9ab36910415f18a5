"""Byte sizes and what the machine offers for them: a leaf helper of ``cache.config``.

``parse_size`` reads ``8GiB``, ``500MB``, ``1073741824`` or ``20%``; ``memory_limit`` is
the RAM this container may use (the cgroup limit if lower than physical RAM);
``room_for_tier`` is the space a tier folder may take (its filesystem's free space plus
what the tier already holds there), ``disk_tier_bytes`` the disk tier's size against it;
``human_bytes`` prints a size. Raises ``cache.errors.ConfigError`` (a leaf below it,
re-exported by ``cache.config``). Runs at start-up; reads a few small files.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Optional

import psutil

from cache.errors import ConfigError
from cache.tiers.layout import folder_usage

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str, whole: Optional[int], name: str) -> int:
    """``"8GiB"``, ``"500MB"``, ``"1073741824"`` or ``"20%"`` (of ``whole``) in bytes."""
    s = str(text).strip().lower().replace(" ", "")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(%|[a-z]*)", s)
    if not m or (m.group(2) not in _SIZE_UNITS and m.group(2) != "%"):
        raise ConfigError(f"{name}={text!r} is not a size; write e.g. 8GiB, 500MB, 1073741824 or 20%")
    number, unit = float(m.group(1)), m.group(2)
    if unit == "%":
        if whole is None:
            raise ConfigError(f"{name}={text!r}: a percentage is not allowed here")
        if number > 100:
            raise ConfigError(f"{name}={text!r}: a percentage above 100% is not a size")
        return int(whole * number / 100)
    return int(number * _SIZE_UNITS[unit])


CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_limit(limit_files: tuple[str, ...] = CGROUP_MEMORY_LIMITS) -> int:
    """Bytes of RAM this container may use: physical RAM, or the cgroup limit if lower."""
    limit = psutil.virtual_memory().total
    for path in limit_files:
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit():  # "max" (cgroup v2) means no limit
            limit = min(limit, int(raw))
    return limit


def _existing_dir(path: str) -> str:
    """The deepest existing folder at or above ``path`` (to measure free space)."""
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        p = os.path.dirname(p)
    return p


def check_writable(path: str, name: str) -> None:
    """Create the folder ``path`` if needed and write a probe file in it, or raise a
    ``ConfigError`` naming the setting ``name``."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".probe-{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"x")
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{name}={path!r} is not a writable folder: {e.strerror}") from None


SYSTEM_MOUNTS = ("/proc", "/sys", "/run", "/dev")  # the system's own memory filesystems


def memory_folders(mounts: str = "/proc/mounts") -> list[str]:
    """Mount points of writable memory filesystems (tmpfs) that a user mounted: where a
    DRAM tier may live when the usual folder (``/dev/shm``) is too small. ``/dev/shm``
    itself and the system's own (``/run``, ``/sys`` ...) are left out."""
    try:
        with open(mounts) as f:
            rows = [line.split() for line in f]
    except OSError:
        return []
    out = []
    for row in rows:
        if len(row) < 4 or row[2] != "tmpfs" or "rw" not in row[3].split(","):
            continue
        point = row[1].replace("\\040", " ")
        if not any(point == m or point.startswith(m + "/") for m in SYSTEM_MOUNTS) and point != "/":
            out.append(point)
    return out


def room_for_tier(path: str) -> int:
    """Bytes a tier folder may hold: the free space of its filesystem plus the entries
    the tier already keeps there (they are its own, not a competitor's)."""
    return shutil.disk_usage(_existing_dir(path)).free + folder_usage(path)


def disk_tier_bytes(size_text: str, path: str) -> int:
    """The disk tier's size (``KVCACHE_DISK_SIZE``) against the room its folder
    (``KVCACHE_DISK_PATH``) has; 0 disables the tier, whose folder is then never touched."""
    name = "KVCACHE_DISK_SIZE"
    if parse_size(size_text, 100, name) == 0:
        return 0
    check_writable(path, "KVCACHE_DISK_PATH")
    room = room_for_tier(path)
    nbytes = parse_size(size_text, room, name)
    if nbytes > room:
        raise ConfigError(
            f"{name}={size_text} ({nbytes:,} bytes) is above the free space under "
            f"{path!r} ({room:,} bytes); lower it or give a percentage"
        )
    return nbytes


def human_bytes(n: float) -> str:
    """``1.5 GiB``: binary units, one decimal (bytes as a whole number)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover
