"""Read an entry file straight into the caller's buffers and verify it there.

Runs on the store's read threads or a load's own thread (``TieredStore.get_into``);
it blocks on file I/O. Engine-agnostic: no torch, no vLLM. ``BlockWriters`` lets a load
that ends early wait for the reads still writing into its buffers.

``get`` reads an entry into memory of its own (a mapping of the DRAM file, a new buffer
for disk), checks it, and the KV copy then copies it again into vLLM's blocks. Here the
payload goes from the file into the blocks in one copy (``preadv`` into the buffers the
caller ``place``\\s), a piece at a time, and each piece is hashed right after it lands,
while it is still in the CPU's cache: one pass over memory instead of three, and no page
faults on a fresh mapping or buffer. Every byte is still verified (``PayloadCheck``:
checksum and, with a signing key, signature) before the caller may use it; when the
check fails the buffers hold garbage and the caller must treat them as not loaded.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Optional, Sequence

from cache.codec import HEADER_SIZE, CorruptEntry, EntryInfo, PayloadCheck, open_header

# Bytes read and hashed at a time: small enough to stay in a core's L2 cache between the
# copy and the hash, large enough that the system calls cost nothing next to the copy.
PIECE_BYTES = 256 << 10

class Misfit(ValueError):
    """A sound entry that does not fit the caller's buffers (``place`` refused it)."""

    def __init__(self, tier: str, message: str) -> None:
        super().__init__(message)
        self.tier = tier


# ``place(info)``: the writable buffers the payload goes to, in payload order, together
# exactly ``info.payload_len`` bytes; raises ``ValueError`` when the entry does not fit.
Place = Callable[[EntryInfo], Sequence[memoryview]]


def read_placed(fd: int, namespace: bytes, key: str, place: Place, signing_key: bytes = b"",
                timer: Optional[Callable[[str, float], None]] = None) -> EntryInfo:
    """Check the header of the entry open at ``fd``, read its payload into ``place(info)``
    and verify it. Raises ``CorruptEntry`` (truncated, damaged, foreign, unsigned) or
    ``ValueError`` (from ``place``); ``timer("read"|"decode", seconds)`` gets the time
    spent copying and checking."""
    head = os.pread(fd, HEADER_SIZE, 0)
    info, seal = open_header(head, namespace, key)
    size = os.fstat(fd).st_size
    if size != HEADER_SIZE + info.payload_len:
        raise CorruptEntry(f"entry is {size} bytes, header says {HEADER_SIZE + info.payload_len}")
    views = [memoryview(v).cast("B") for v in place(info)]
    total = sum(len(v) for v in views)
    if total != info.payload_len:
        raise ValueError(f"buffers of {total} bytes for a payload of {info.payload_len}")
    check = PayloadCheck(seal, signing_key)
    offset, reading, hashing = HEADER_SIZE, 0.0, 0.0
    for view in views:
        for start in range(0, len(view), PIECE_BYTES):
            piece = view[start:start + PIECE_BYTES]
            t0 = time.perf_counter()
            got = _pread_full(fd, piece, offset)
            t1 = time.perf_counter()
            if got != len(piece):
                raise CorruptEntry(f"entry ended at byte {offset + got}, header says {size}")
            check.update(piece)
            hashing += time.perf_counter() - t1
            reading += t1 - t0
            offset += got
    t1 = time.perf_counter()
    check.verify()
    if timer is not None:
        timer("read", reading)
        timer("decode", hashing + time.perf_counter() - t1)
    return info


def _pread_full(fd: int, view: memoryview, offset: int) -> int:
    """Read at ``offset`` until ``view`` is full or the file ends; bytes read."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


class BlockWriters:
    """The reads of one load that may be writing into its blocks. ``close`` waits for
    them to end and makes later ``enter`` calls refuse (those reads write nothing)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._n = 0
        self._closed = False

    def enter(self) -> bool:
        with self._cond:
            if self._closed:
                return False
            self._n += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._n -= 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: self._n == 0)
