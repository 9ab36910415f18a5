"""Read an entry file straight into the caller's buffers and verify it there.

Runs on the store's read threads, a load's own thread or (shared tier) the tier's I/O
threads (``TieredStore.get_into``); it blocks on file or network I/O. Engine-agnostic:
no torch, no vLLM. ``BlockWriters`` lets a load that ends early wait for the reads still
writing into its buffers.

``get`` reads an entry into memory of its own (a mapping of the DRAM file, a new buffer
for disk), checks it, and the KV copy then copies it again into vLLM's blocks. Here the
payload goes from the file into the blocks in one copy (``preadv`` into the buffers the
caller ``place``\\s), a piece at a time, and each piece is hashed right after it lands,
while it is still in the CPU's cache: one pass over memory instead of three, and no page
faults on a fresh mapping or buffer. Every byte is still verified (``PayloadCheck``:
checksum and, with a signing key, signature) before the caller may use it; when the
check fails the buffers hold garbage and the caller must treat them as not loaded.

An entry is read through a ``Reader``: ``FdReader`` (a local file), ``FileReader`` (a
file object of a remote filesystem) or ``BytesReader`` (a transport that only reads
whole files). A remote read goes through ``Staged``: each piece lands in a buffer of its
own and is copied into the caller's buffers (while still in cache) only if the load
still wants it, so a network read that hangs past the load's deadline never holds up
the load's end nor writes into blocks vLLM recomputes.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Optional, Protocol, Sequence

import numpy as np

from cache.codec import HEADER_SIZE, CorruptEntry, EntryInfo, PayloadCheck, open_header

# Bytes read and hashed at a time: small enough to stay in a core's L2 cache between the
# copy and the hash, large enough that the system calls cost nothing next to the copy.
PIECE_BYTES = 256 << 10


def copy_into(dst: memoryview, src) -> None:
    """``dst[:] = src`` with the GIL released during the copy (numpy's copy; a memoryview
    assignment holds it): a load's copies never hold up the Python of a forward pass
    running on another thread."""
    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


class LoadEnded(Exception):
    """The load this read belongs to has ended (failed or past its deadline): the read
    stops and writes nothing more into its buffers."""


class Misfit(ValueError):
    """A sound entry that does not fit the caller's buffers (``place`` refused it)."""

    def __init__(self, tier: str, message: str) -> None:
        super().__init__(message)
        self.tier = tier


# ``place(info)``: the writable buffers the payload goes to, in payload order, together
# exactly ``info.payload_len`` bytes; raises ``ValueError`` when the entry does not fit.
Place = Callable[[EntryInfo], Sequence[memoryview]]


class Reader(Protocol):
    """An entry's bytes at given offsets (``FdReader``, ``FileReader``, ``BytesReader``,
    ``Staged``); ``nread`` counts the bytes that came through the reader."""

    def size(self) -> int: ...

    def pread(self, n: int, offset: int) -> bytes: ...

    def readinto(self, view: memoryview, offset: int) -> int:
        """Fill ``view`` from ``offset`` (less only where the entry ends); bytes read."""


def read_placed(
    reader: Reader,
    namespace: bytes,
    key: str,
    place: Place,
    signing_key: bytes = b"",
    timer: Optional[Callable[[str, float], None]] = None,
) -> EntryInfo:
    """Check the header of the entry ``reader`` reads, read its payload into
    ``place(info)`` and verify it. Raises ``CorruptEntry`` (truncated, damaged, foreign,
    unsigned), ``ValueError`` (from ``place``), ``LoadEnded`` (``Staged``) or the
    reader's I/O errors; ``timer("read"|"decode", seconds)`` gets the time spent copying
    and checking."""
    read = PartRead(namespace, key, place, signing_key, timer)
    info = read.open(reader)
    while not read.done:
        read.read_part(reader, rest=True)
    return info


def _split(views: Sequence[memoryview], part_bytes: int) -> list[list[memoryview]]:
    """``views`` (payload order) cut into runs of ``part_bytes`` bytes each."""
    parts: list[list[memoryview]] = [[]]
    room = part_bytes
    for view in views:
        while len(view):
            if not room:
                parts.append([])
                room = part_bytes
            take = view[:room]
            parts[-1].append(take)
            room -= len(take)
            view = view[len(take) :]
    return parts


class PartRead:
    """An entry read into the caller's buffers a part at a time: its payload's leading
    dimension (an entry's layers, ``[layers, blocks, ...]``), in order, so that a load can
    hand each layer over while the next is read (``cache.vllm.layered``). ``open`` checks
    the header and places the payload; each ``read_part`` reads the next part (a later
    call may come through another reader of the same entry: ``same_entry`` first); the
    last one verifies the whole payload (``PayloadCheck``, fed in payload order).
    Until then the parts read are unverified: the caller must not let them be used
    unless the last part verifies (a forward pass that ran on them is discarded)."""

    def __init__(
        self,
        namespace: bytes,
        key: str,
        place: Place,
        signing_key: bytes = b"",
        timer: Optional[Callable[[str, float], None]] = None,
    ) -> None:
        self.namespace, self.key, self.place = namespace, key, place
        self.signing_key, self.timer = signing_key, timer
        self.info: Optional[EntryInfo] = None
        self.parts: list[list[memoryview]] = []
        self.next_part = 0
        self._head = b""
        self._check: Optional[PayloadCheck] = None
        self._part_bytes = 0
        self._reading = self._hashing = 0.0

    @property
    def done(self) -> bool:
        return self.info is not None and self.next_part == len(self.parts)

    def open(self, reader: Reader) -> EntryInfo:
        head = reader.pread(HEADER_SIZE, 0)
        info, seal = open_header(head, self.namespace, self.key)
        size = reader.size()
        if size != HEADER_SIZE + info.payload_len:
            raise CorruptEntry(f"entry is {size} bytes, header says {HEADER_SIZE + info.payload_len}")
        views = [memoryview(v).cast("B") for v in self.place(info)]
        total = sum(len(v) for v in views)
        if total != info.payload_len:
            raise ValueError(f"buffers of {total} bytes for a payload of {info.payload_len}")
        n = info.shape[0] if len(info.shape) > 1 and info.shape[0] and info.payload_len % info.shape[0] == 0 else 1
        self._part_bytes = info.payload_len // n
        self.parts = _split(views, self._part_bytes) if info.payload_len else []
        self._check = PayloadCheck(seal, self.signing_key)
        self._head, self.info = bytes(head), info
        if not self.parts:
            self._verify()
        return info

    def same_entry(self, reader: Reader) -> None:
        """``CorruptEntry`` unless ``reader`` reads the entry ``open`` checked (a file
        replaced between two parts; a shorter one fails its next part's read)."""
        if reader.pread(HEADER_SIZE, 0) != self._head:
            raise CorruptEntry("entry replaced while it was being read")

    def read_part(self, reader: Reader, rest: bool = False) -> None:
        """Read the next part into its buffers and hash it; after the last, verify.
        ``rest``: the caller reads every part left, one after the other (a whole read;
        ``DirectReader`` reads those through the page cache)."""
        check, info = self._check, self.info
        assert check is not None and info is not None, "read_part before the header was read"
        offset = HEADER_SIZE + self.next_part * self._part_bytes
        expect = getattr(reader, "expect", None)
        if expect is not None:
            expect(offset, self._part_bytes, rest)
        for view in self.parts[self.next_part]:
            for start in range(0, len(view), PIECE_BYTES):
                piece = view[start : start + PIECE_BYTES]
                t0 = time.perf_counter()
                got = reader.readinto(piece, offset)
                t1 = time.perf_counter()
                if got != len(piece):
                    raise CorruptEntry(
                        f"entry ended at byte {offset + got}, header says {HEADER_SIZE + info.payload_len}"
                    )
                check.update(piece)
                self._hashing += time.perf_counter() - t1
                self._reading += t1 - t0
                offset += got
        self.next_part += 1
        if self.next_part == len(self.parts):
            self._verify()

    def _verify(self) -> None:
        t1 = time.perf_counter()
        assert self._check is not None  # (set with the header)
        self._check.verify()
        if self.timer is not None:
            self.timer("read", self._reading)
            self.timer("decode", self._hashing + time.perf_counter() - t1)


class FdReader:
    """An entry file open at ``fd`` (the caller closes it); ``readinto`` is the kernel's
    one copy into the caller's buffer."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.nread = 0

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def pread(self, n: int, offset: int) -> bytes:
        data = os.pread(self.fd, n, offset)
        self.nread += len(data)
        return data

    def readinto(self, view: memoryview, offset: int) -> int:
        """Read at ``offset`` until ``view`` is full or the file ends; bytes read."""
        got = 0
        while got < len(view):
            n = os.preadv(self.fd, [view[got:]], offset + got)
            if n == 0:
                break
            got += n
        self.nread += got
        return got


class FileReader:
    """An entry through a file object open for reading (fsspec's ``open``), ``size``
    bytes long."""

    def __init__(self, f, size: int) -> None:
        self.f, self._size = f, size
        self.nread = 0

    def size(self) -> int:
        return self._size

    def pread(self, n: int, offset: int) -> bytes:
        self.f.seek(offset)
        data = self.f.read(n)
        self.nread += len(data)
        return data

    def readinto(self, view: memoryview, offset: int) -> int:
        self.f.seek(offset)
        got = 0
        while got < len(view):
            n = self.f.readinto(view[got:])
            if not n:
                break
            got += n
        self.nread += got
        return got


class BytesReader:
    """An entry already read whole (a transport without reads at an offset)."""

    def __init__(self, data) -> None:
        self.data = memoryview(data).cast("B")
        self.nread = len(self.data)

    def size(self) -> int:
        return len(self.data)

    def pread(self, n: int, offset: int) -> bytes:
        return bytes(self.data[offset : offset + n])

    def view(self, offset: int, n: int) -> memoryview:
        return self.data[offset : offset + n]

    def readinto(self, view: memoryview, offset: int) -> int:
        got = self.view(offset, len(view))
        copy_into(view[: len(got)], got)
        return len(got)


class Staged:
    """A remote entry's reader for ``read_placed``: each piece is read into a buffer of
    this reader's own, then copied into the caller's buffer while ``writers`` still
    admits writes (``LoadEnded`` once the load has ended). ``keep``: that buffer is the
    whole entry, which ``entry`` then returns (for promotion to a local tier); otherwise
    one piece's buffer, reused (it stays in cache)."""

    def __init__(self, reader, writers: "BlockWriters", keep: bool) -> None:
        self.reader, self.writers, self.keep = reader, writers, keep
        self.in_memory = isinstance(reader, BytesReader)  # pieces are views of it: no buffer
        self._buf: Optional[memoryview] = None

    def size(self) -> int:
        return self.reader.size()

    def pread(self, n: int, offset: int) -> bytes:
        data = self.reader.pread(n, offset)
        if self.keep and not self.in_memory:
            self._buffer(offset, len(data))[:] = data
        return data

    def _buffer(self, offset: int, n: int) -> memoryview:
        if self._buf is None:
            self._buf = memoryview(bytearray(self.reader.size() if self.keep else PIECE_BYTES))
        return self._buf[offset : offset + n] if self.keep else self._buf[:n]

    def readinto(self, view: memoryview, offset: int) -> int:
        if self.in_memory:
            got = self.reader.view(offset, len(view))
        else:
            got = self._buffer(offset, len(view))
            got = got[: self.reader.readinto(got, offset)]
        if not self.writers.enter():
            raise LoadEnded()
        try:
            copy_into(view[: len(got)], got)
        finally:
            self.writers.leave()
        return len(got)

    def entry(self):
        """The whole entry (``keep``), or None."""
        if not self.keep:
            return None
        return self.reader.data if self.in_memory else self._buf


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
