"""Disk-tier reads past the page cache (``O_DIRECT``) for entries that are not in it.

Runs on the threads that read entries in place (the store's read threads, a load's
forward thread); blocks on disk I/O. Linux only; elsewhere every read is buffered.

Why: a buffered read of a cold entry costs the kernel a copy out of the page cache for
every 4 KiB page, and the disk's readahead (``read_ahead_kb``, 8 MiB on some VMs) turns
a read of an entry's first layer into a read of most of the file, so a layer-wise load
(``cache.vllm.layered``) gets its first layer only when most of the load is done. A
direct read moves exactly the range asked for from the disk into a buffer of the
reading thread by DMA; ``DirectReader`` then copies each piece into the caller's buffer
(where the caller hashes it while it is still in cache): one copy per byte, as before,
but in user space and without readahead.

Only reads a part at a time go direct. A whole entry's read goes through the page cache,
whose readahead overlaps the disk with the copy (faster than one direct read after
another on one thread); so does every read of an entry wholly in the page cache (written
or read lately): a direct read would go to the disk again (and first write back its
dirty pages). ``resident`` asks the kernel (``mincore`` on a mapping of the file: no
page is read).

``O_DIRECT`` needs the buffer, the offset and the length aligned to the device's
logical block; a ``DirectReader`` reads whole ``ALIGN``-byte blocks around each range
into a page-aligned buffer (an entry's payload starts at byte 256). A filesystem that
refuses ``O_DIRECT`` (tmpfs before Linux 6.6, some FUSE mounts) fails the open or the
read with ``EINVAL``; the read is then done through the page cache, and the tier stops
trying (``DirectReads.refused``).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

from cache.placed import FdReader, copy_into

log = logging.getLogger(__name__)

ALIGN = 4096  # covers every device's logical block (512 or 4096 bytes)
WINDOW_BYTES = 4 << 20  # the most one direct read asks for (a thread's buffer)
O_DIRECT = getattr(os, "O_DIRECT", 0)


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc() if O_DIRECT else None
_MAP_FAILED = ctypes.c_void_p(-1).value
# mincore's bytes: bit 0 says resident, the others are reserved; keep bit 0 only.
_LOW_BIT = bytes(b & 1 for b in range(256))


def resident(fd: int, size: int) -> Optional[bool]:
    """Whether every page of the first ``size`` bytes of the file at ``fd`` is in the page
    cache (True), some are not (False), or the kernel cannot say (None). Touches no page."""
    if _LIBC is None or size <= 0:
        return None
    addr = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        return None
    try:
        vec = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
        if _LIBC.mincore(addr, size, vec) != 0:
            return None
        return b"\0" not in vec.raw.translate(_LOW_BIT)
    finally:
        _LIBC.munmap(addr, size)


class _Window:
    """One thread's page-aligned buffer for direct reads, and the reader using it."""

    def __init__(self) -> None:
        self.buf = memoryview(mmap.mmap(-1, WINDOW_BYTES))
        self.owner: Optional[DirectReader] = None


_windows = threading.local()


def _window() -> _Window:
    w = getattr(_windows, "w", None)
    if w is None:
        w = _windows.w = _Window()
    return w


class DirectReads:
    """A tier's switch for direct reads: on until a filesystem refuses them."""

    def __init__(self, enabled: bool, label: str) -> None:
        self.enabled = enabled and bool(O_DIRECT) and _LIBC is not None
        self.label = label

    def refused(self, e: OSError) -> None:
        if self.enabled:
            self.enabled = False
            log.warning(
                "kvcache: the %s tier's filesystem refuses direct reads (%s); reading through the page cache",
                self.label,
                e,
            )

    @contextmanager
    def reader(self, fd: int, path: str) -> Iterator[FdReader]:
        """The reader for the entry open at ``fd`` (``path``), for the ``with`` block: direct
        when enabled and the entry is not wholly in the page cache, else buffered. The
        caller closes ``fd``; the direct reader's own descriptor is closed on leaving."""
        reader = self.open_reader(fd, path)
        try:
            yield reader
        finally:
            if isinstance(reader, DirectReader):
                reader.close()

    def open_reader(self, fd: int, path: str) -> FdReader:
        """The reader ``reader`` yields, left open: the caller closes a ``DirectReader``."""
        if not self.enabled:
            return FdReader(fd)
        st = os.fstat(fd)
        if resident(fd, st.st_size) is not False:
            return FdReader(fd)
        try:
            dfd = os.open(path, os.O_RDONLY | O_DIRECT)
        except FileNotFoundError:  # deleted since: read what ``fd`` holds
            return FdReader(fd)
        except OSError as e:
            if e.errno == errno.EINVAL:
                self.refused(e)
            return FdReader(fd)
        dst = os.fstat(dfd)
        if (dst.st_dev, dst.st_ino) != (st.st_dev, st.st_ino):  # replaced between the opens
            os.close(dfd)
            return FdReader(fd)
        return DirectReader(fd, dfd, self)


class DirectReader(FdReader):
    """``FdReader`` whose ``readinto`` reads past the page cache: whole aligned blocks from
    ``dfd`` (the same file opened with ``O_DIRECT``) into this thread's window, then a copy
    into the caller's buffer. ``expect(offset, n, rest)`` says what the caller reads next:
    a part of ``n`` bytes at ``offset`` (an entry's layer), read in one direct read (up to
    ``WINDOW_BYTES``); with ``rest``, every part left (a whole read), which goes through
    the page cache: there the kernel's readahead overlaps the disk with the copy, and
    whole loads were slower read directly (4K-token full hits 68 vs 63 ms here)."""

    def __init__(self, fd: int, dfd: int, switch: DirectReads) -> None:
        super().__init__(fd)
        self.dfd, self.switch = dfd, switch
        self._start = self._len = 0
        self._until = 0
        self._buffered = False

    def close(self) -> None:
        if self.dfd >= 0:
            os.close(self.dfd)
            self.dfd = -1

    def expect(self, offset: int, n: int, rest: bool = False) -> None:
        self._until, self._buffered = offset + n, rest

    def readinto(self, view: memoryview, offset: int) -> int:
        if self.dfd < 0 or self._buffered:
            return super().readinto(view, offset)
        got = 0
        w = _window()
        while got < len(view):
            at = offset + got
            if w.owner is not self or not self._start <= at < self._start + self._len:
                try:
                    self._fill(w, at, len(view) - got)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self.switch.refused(e)
                    self.close()
                    self.nread += got
                    return got + super().readinto(view[got:], at)
                if not self._start <= at < self._start + self._len:
                    break  # the file ends before ``at``
            n = min(len(view) - got, self._start + self._len - at)
            copy_into(view[got : got + n], w.buf[at - self._start : at - self._start + n])
            got += n
        self.nread += got
        return got

    def _fill(self, w: _Window, at: int, want: int) -> None:
        start = at - at % ALIGN
        end = max(at + want, self._until)
        end = min(-(-end // ALIGN) * ALIGN, start + WINDOW_BYTES)
        w.owner = None
        n = os.preadv(self.dfd, [w.buf[: end - start]], start)
        w.owner, self._start, self._len = self, start, n
