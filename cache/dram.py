"""Where the DRAM tier (L1) lives and how large it is: the one rule, used by ``cache.config``.

Given ``KVCACHE_DRAM_SIZE`` and ``KVCACHE_DRAM_PATH`` (their texts; ``cache.config`` reads
them) and the machine: the wanted size is the setting (bytes, or a share of the RAM the
container may use), else ``DRAM_SHARE`` of that RAM less what the model weights, vLLM's
CPU KV pool, the workers' staging memory (``staging_bytes``, also decided here) and
``DRAM_MARGIN`` need. The folder's filesystem must hold it: a pod's
``/dev/shm`` is 64 MiB, Docker's too, and a tier that cannot hold one chunk caches
nothing. What a user expects, and what this does: never silently. Each decision is a
note for the start-up log and plan. Runs at start-up; reads ``/proc/mounts`` and a few
folders' free space.
"""

from __future__ import annotations

import os
from typing import Optional

from cache.errors import ConfigError
from cache.sizes import check_writable, human_bytes, memory_folders, parse_size, room_for_tier

GiB = 1 << 30
DEFAULT_DRAM_PATH = "/dev/shm/kvcache"
DRAM_SHARE = 0.20  # default L1 size: share of the RAM the container may use ...
DRAM_MARGIN = 4 * GiB  # ... leaving this much (server, tokenizer, Python heaps) beyond
# the model weights, vLLM's CPU KV pool and the workers' staging memory
WRITE_BEHIND_BYTES = 1 << 30  # saves queued per worker at most (cache.store's max_pending_bytes)
STAGING_CHUNKS = 64  # default staging memory per worker: this many chunks of the model,
# at most WRITE_BEHIND_BYTES (that, when the model is not known)


def dram_tier(
    text: Optional[str], given_path: Optional[str], ram: int, reserved: int, entry: Optional[int], notes: list[str]
) -> tuple[str, int]:
    """The DRAM tier's folder and bytes. Wanted: ``KVCACHE_DRAM_SIZE`` (bytes, or a share
    of the RAM), else ``DRAM_SHARE`` of the RAM less what the reserved RAM and
    ``DRAM_MARGIN`` need. A folder that cannot hold that is never taken silently: without
    ``KVCACHE_DRAM_PATH``, a memory filesystem the user mounted that can hold it is used
    instead; else a byte size is an error and a share is capped by the folder's room.
    A tier smaller than one entry (``entry`` bytes, when the model is known) is off."""
    name = "KVCACHE_DRAM_SIZE"
    path = given_path or DEFAULT_DRAM_PATH
    if text is not None:
        if parse_size(text, 100, name) == 0:
            return path, 0  # off: its folder is never touched
        want = parse_size(text, ram, name)
        if want > ram:
            raise ConfigError(
                f"{name}={text} ({want:,} bytes) is above the memory this container may use "
                f"({ram:,} bytes); lower it or give a percentage such as 20%"
            )
    else:
        share = int(ram * DRAM_SHARE)
        want = min(share, max(0, ram - reserved - DRAM_MARGIN))
        if want < share:
            notes.append(f"DRAM tier capped by RAM left after weights, engine KV and margin ({human_bytes(want)})")
    check_writable(path, "KVCACHE_DRAM_PATH")
    room = room_for_tier(path)
    if room < want and not given_path:
        other = _roomier_memory_folder(want)
        if other is not None:
            notes.append(
                f"WARNING: the DRAM tier wants {human_bytes(want)} but {path}'s filesystem has "
                f"{human_bytes(room)} free; using {other[1]} (tmpfs, {human_bytes(other[0])} free) "
                "instead; set KVCACHE_DRAM_PATH to choose"
            )
            room, path = other
    if room < want:
        fix = (
            "give the container more shared memory (docker run --shm-size; on Kubernetes an emptyDir "
            "with medium: Memory mounted at /dev/shm) or point KVCACHE_DRAM_PATH at a larger tmpfs"
        )
        if text is not None and not text.strip().endswith("%"):
            raise ConfigError(
                f"{name}={text} ({want:,} bytes) is above the free space under {path!r} "
                f"({room:,} bytes); lower it, or {fix}"
            )
        shown = f"{name}={text}" if text is not None else "the DRAM tier"
        notes.append(
            f"WARNING: {shown} wants {human_bytes(want)} but {path}'s filesystem has only "
            f"{human_bytes(room)} free: the tier is capped there; {fix}"
        )
        want = room if text is None else parse_size(text, min(room, ram), name)
    if entry is not None and 0 < want < entry:
        notes.append(
            f"WARNING: DRAM tier off: {human_bytes(want)} at {path} cannot hold one chunk of this "
            f"model ({human_bytes(entry)}); chunks go to the disk tier"
        )
        return path, 0
    return path, want


def _roomier_memory_folder(want: int) -> Optional[tuple[int, str]]:
    """``(room, folder)``: a ``kvcache`` folder on the user-mounted memory filesystem with
    the most room, if it can hold ``want`` bytes and is writable. Not the disk: a folder
    there would be a second disk tier, not DRAM."""
    for _room, mount in sorted(((room_for_tier(m), m) for m in memory_folders()), reverse=True):
        folder = os.path.join(mount, "kvcache")
        room = room_for_tier(folder)
        if room < want:
            return None
        try:
            check_writable(folder, "KVCACHE_DRAM_PATH")
        except ConfigError:
            continue
        return room, folder
    return None


def staging_bytes(text: Optional[str], entry: Optional[int], notes: list[str]) -> int:
    """Host staging memory per worker (``cache.vllm.staging``; pinned on GPUs):
    ``KVCACHE_STAGING_SIZE`` in bytes (no percentage: it is memory per worker), or the
    default: ``STAGING_CHUNKS`` entries of the model (``entry`` bytes each, when known),
    at most ``WRITE_BEHIND_BYTES``."""
    name = "KVCACHE_STAGING_SIZE"
    if text is None:
        return min(WRITE_BEHIND_BYTES, STAGING_CHUNKS * entry) if entry else WRITE_BEHIND_BYTES
    nbytes = parse_size(text, None, name)
    if nbytes <= 0:
        raise ConfigError(f"{name}={text!r} must be above 0: every save and GPU load is copied through it")
    if entry and nbytes < entry:
        notes.append(
            f"WARNING: {name}={text} holds less than one chunk of this model ({entry:,} bytes "
            "on one GPU): each worker stages one chunk at a time, and skips saves meanwhile"
        )
    return nbytes
