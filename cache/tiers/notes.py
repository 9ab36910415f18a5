"""Notes: small files that the nodes of a deployment leave for each other in the shared tier.

    ROOT/<namespace>/.hot/<node>.json    one node's popularity note (``cache.popularity``)

A note is not an entry: the tier's listing and ``cache.tools.inspect`` pass over the
``.hot`` folder (no file in it has an entry's name). Each node writes only its own note,
whole: the bytes go to a temporary name beside it (``<name>.part-RAND``, never an entry's
temporary name, which the tier's clean-up would look for in a shard folder), then are
renamed over it, as entries are published, so a reader sees a whole note or the previous
one. Nothing here trusts what it reads: the caller parses and checks every note.

Every call goes through the tier's guard (``SharedTier.call``: its deadline, its circuit
breaker) and may block that long: call these from a background thread (the scheduler's
note publisher, a worker's DRAM warm-up), never from the scheduler loop or a forward pass.
"""

from __future__ import annotations

import uuid

from cache.tiers.shared import SharedTier

NOTES_DIR = ".hot"
NOTE_SUFFIX = ".json"
PART_MARK = ".part-"
MAX_NOTE_BYTES = 4 << 20  # a larger file is not read (no note is this large)


def notes_folder(tier: SharedTier) -> str:
    return f"{tier.folder}/{NOTES_DIR}"


def write_note(tier: SharedTier, name: str, data: bytes) -> None:
    """Publish ``data`` as the note ``name``, replacing the one there."""
    folder = notes_folder(tier)
    tier.call("makedirs", folder)
    tmp = f"{folder}/{name}{PART_MARK}{uuid.uuid4().hex[:8]}"
    try:
        tier.call("write", tmp, [data])
        tier.call("rename", tmp, f"{folder}/{name}")
    except BaseException:
        try:
            tier.call("remove", tmp)
        except Exception:  # never written, or the tier is down: nothing more to do
            pass
        raise


def list_notes(tier: SharedTier) -> list[tuple[str, int, float]]:
    """``(name, bytes, mtime)`` of each note (none when the folder is missing)."""
    return [
        e for e in tier.call("list_dir", notes_folder(tier)) if e[0].endswith(NOTE_SUFFIX) and PART_MARK not in e[0]
    ]


def read_notes(tier: SharedTier) -> list[tuple[str, bytes]]:
    """``(name, bytes)`` of every note no larger than ``MAX_NOTE_BYTES``; one that went
    away meanwhile is left out."""
    out = []
    for name, size, _mtime in list_notes(tier):
        if size > MAX_NOTE_BYTES:
            continue
        try:
            out.append((name, bytes(tier.call("read", f"{notes_folder(tier)}/{name}"))))
        except FileNotFoundError:
            continue
    return out


def read_note(tier: SharedTier, name: str) -> bytes:
    """The note ``name``; ``FileNotFoundError`` when there is none."""
    return bytes(tier.call("read", f"{notes_folder(tier)}/{name}"))


def remove_note(tier: SharedTier, name: str) -> None:
    try:
        tier.call("remove", f"{notes_folder(tier)}/{name}")
    except FileNotFoundError:
        pass
