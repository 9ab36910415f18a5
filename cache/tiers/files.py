"""A tier of one file per entry in a local folder: host DRAM (tmpfs) and local disk.

The DRAM tier (L1) is this class on a shared-memory folder (``/dev/shm``), the disk tier
(L2) on an NVMe folder. Both are shared by every process of an engine (scheduler and
workers) and by every engine of the node, and the disk tier survives restarts.

Layout (``cache.tiers.layout``, shared with the shared tier): ``ROOT/.usage`` and
``ROOT/.lock`` account the bytes of the whole folder; entries live in
``ROOT/<namespace>/<key[:2]>/<key>``.

Publishing follows diskcache's rule: the payload is written to a temporary file first,
then linked into place atomically (``os.link`` fails if another process already
published the key: write-once, first writer wins), then the temporary name is removed.
A crash leaves at most a temporary file, which ``scan`` removes, and a reservation that
``scan`` recounts. Damaged files are caught by the entry checksum on read.

Capacity is shared by every process using the folder: ``reserve`` and ``delete`` update
``ROOT/.usage`` under an exclusive ``flock`` (microseconds; the lock and usage files stay
open, so a write costs no ``open`` of them, and the threads of one process take turns on a
``threading.Lock`` first, since they share the one open lock file), and every step that changes
what ``scan`` would count (a claim's temporary file appearing, the link into place, an
unlink) happens under that lock with its ``.usage`` update, so a recount by any process
at any moment agrees with the counter. An entry's bytes leave the counter as they were
counted (its size when published, or when a ``scan`` last counted it, remembered per
key), so an entry truncated from outside afterwards does not leave the difference behind.
Methods that touch the disk block; the store calls them from I/O threads. ``contains``
is one ``stat``.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence, cast

import numpy as np

from cache.tiers.base import Buffer, Tier
from cache.tiers.direct import DirectReads
from cache.tiers.identity import Medium
from cache.tiers.layout import LOCK_FILE, TMP_MARK, USAGE, USAGE_FILE, entry_path, parse_temp, temp_path, this_host

_STALE_TMP_SECONDS = 600  # no entry write takes this long; older temp files are debris


class FileTier(Tier):
    capacity: int  # a local folder's bound, always set

    def __init__(
        self,
        root: str,
        namespace: str,
        capacity: int,
        name: str = "disk",
        use_mmap: bool = False,
        direct_reads: bool = False,
        medium: Medium = Medium.STORAGE,
    ) -> None:
        self.name = name
        self.medium = medium  # CPU for the DRAM tier's tmpfs folder
        self.capacity = capacity
        self.root = root
        self.folder = os.path.join(root, namespace)
        self.use_mmap = use_mmap
        self.direct = DirectReads(direct_reads, name)  # cold entries read past the page cache
        os.makedirs(self.folder, exist_ok=True)
        self._claims: dict[str, tuple[str, int]] = {}  # key -> its claim's temporary file, open fd
        # key -> bytes its entry holds in ``.usage`` (counted at publish or scan); what
        # ``delete`` takes off, whatever size the file has by then (cut short from outside).
        self._counted: dict[str, int] = {}
        self._lock_path = os.path.join(root, LOCK_FILE)
        self._usage_path = os.path.join(root, USAGE_FILE)
        self._files: Optional[_FolderFiles] = None  # opened at the first use, in each process
        self._guard, self._guard_pid = threading.Lock(), os.getpid()
        with self._guard:
            self._open_files()  # both files exist from now on, for every process of the folder

    # -- paths ---------------------------------------------------------------
    def path(self, key: str) -> str:
        return entry_path(self.folder, key)

    # -- shared accounting ---------------------------------------------------
    @contextmanager
    def _locked_usage(self) -> Iterator["_FolderFiles"]:
        """The folder's usage file, with the folder lock held. A folder removed behind our
        back is started again (empty), rather than failing every call."""
        if self._guard_pid != os.getpid():  # a forked child: the parent's threads are not here
            self._guard, self._guard_pid = threading.Lock(), os.getpid()
        with self._guard:
            files = self._open_files()
            fcntl.flock(files.lock, fcntl.LOCK_EX)
            try:
                yield files
            finally:
                fcntl.flock(files.lock, fcntl.LOCK_UN)

    def _open_files(self) -> "_FolderFiles":
        """The open lock and usage files (under ``_guard``): opened again in a forked child
        (an inherited lock file would be the parent's lock too) or once either was unlinked
        (the folder removed: a lock nobody else opens would exclude nobody)."""
        files = self._files
        if files is not None:
            if files.pid == os.getpid() and files.linked():
                return files
            self._files = None
            files.close()
        try:
            self._files = _FolderFiles.open(self._lock_path, self._usage_path)
        except FileNotFoundError:
            os.makedirs(self.folder, exist_ok=True)
            self._files = _FolderFiles.open(self._lock_path, self._usage_path)
        return self._files

    def close(self) -> None:
        """Close the lock and usage files (a later call opens them again)."""
        with self._guard:
            files, self._files = self._files, None
        if files is not None:
            files.close()

    @staticmethod
    def _get(usage: "_FolderFiles") -> int:
        return usage.get()

    @staticmethod
    def _put(usage: "_FolderFiles", value: int) -> None:
        usage.set(value)

    def reserve(self, nbytes: int, key: Optional[str] = None) -> bool:
        """With ``key``, the claim is also a temporary file named after it, created under
        the folder lock: a ``scan`` by another process at any moment counts it (a claim
        only in ``.usage`` would be lost to that recount). ``write`` fills that file."""
        with self._locked_usage() as usage:
            used = self._get(usage)
            if used + nbytes > self.capacity:
                return False
            if key is not None:
                try:
                    self._claims[key] = self._open_tmp(key, nbytes)
                except OSError:  # (full, read-only ...) ``write`` tries again and raises it
                    pass
            self._put(usage, used + nbytes)
            return True

    def _open_tmp(self, key: str, nbytes: int) -> tuple[str, int]:
        """A new temporary file beside ``key``'s path, named with the bytes it claims
        (``scan`` reads them back): its path and an open write descriptor."""
        final = self.path(key)
        tmp = temp_path(final, nbytes)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            return tmp, os.open(tmp, flags, 0o644)
        except FileNotFoundError:  # the key's shard folder does not exist yet
            os.makedirs(os.path.dirname(final), exist_ok=True)
            return tmp, os.open(tmp, flags, 0o644)

    def release(self, nbytes: int) -> None:
        with self._locked_usage() as usage:
            self._put(usage, self._get(usage) - nbytes)

    def used_bytes(self) -> int:
        with self._locked_usage() as usage:
            return self._get(usage)

    # -- entries -------------------------------------------------------------
    def contains(self, key: str) -> bool:
        return os.path.exists(self.path(key))

    def read(self, key: str) -> Buffer:
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except FileNotFoundError:
            raise KeyError(key) from None
        try:
            size = os.fstat(fd).st_size
            if self.use_mmap and size:
                # Read-only, prefaulted, shared mapping: zero-copy from tmpfs pages (a
                # private writable one would copy them). Entries are never modified in
                # place and the mapping stays valid if the file is unlinked meanwhile.
                return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
            buf = np.empty(size, dtype=np.uint8)
            # (numpy's stubs give arrays the buffer protocol from Python 3.12 on only)
            return cast(Buffer, buf[: read_into(fd, buf.data)])
        finally:
            os.close(fd)

    reads_in_place = True

    def read_with(self, key: str, use):
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise KeyError(key) from None
        try:
            with self.direct.reader(fd, path) as reader:
                return use(reader)
        finally:
            os.close(fd)

    def write(self, key: str, parts: Sequence[Buffer], nbytes: int) -> bool:
        final = self.path(key)
        tmp = None
        try:
            # The claim's file from ``reserve``, or (reserved without a key) a new one.
            claim = self._claims.pop(key, None)
            tmp, fd = claim if claim is not None else self._open_tmp(key, nbytes)
            try:
                views = [memoryview(p).cast("B") for p in parts]
                while views:
                    n = os.writev(fd, views)
                    while views and n >= len(views[0]):
                        n -= len(views[0])
                        views.pop(0)
                    if views and n:
                        views[0] = views[0][n:]
            finally:
                os.close(fd)
        except OSError:  # full, read-only, I/O error ...: the claim goes back, the caller counts it
            self._settle(tmp, final, nbytes, publish=False)
            raise
        published = self._settle(tmp, final, nbytes, publish=True)
        if published:
            self._counted[key] = nbytes
        return published

    def _settle(self, tmp: Optional[str], final: str, nbytes: int, publish: bool) -> bool:
        """Under the folder lock: link ``tmp`` into place (if ``publish``), remove it, and
        give the claim back unless published; a recount never sees a half-done step."""
        published = False
        with self._locked_usage() as usage:
            if publish and tmp is not None:
                try:
                    os.link(tmp, final)
                    published = True
                except FileExistsError:
                    pass
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
            if not published:
                self._put(usage, self._get(usage) - nbytes)
        return published

    def delete(self, key: str) -> int:
        """Remove ``key``'s entry; the bytes it held in the account (the larger of its
        size when counted and its size now: a copy another process wrote again after a
        truncated one is whole)."""
        path = self.path(key)
        counted = self._counted.pop(key, 0)
        with self._locked_usage() as usage:  # unlink and recount as one step for ``scan``
            try:
                size = max(os.stat(path).st_size, counted)
                os.unlink(path)
            except FileNotFoundError:
                return 0
            self._put(usage, self._get(usage) - size)
        return size

    def scan(self) -> Iterator[tuple[str, int]]:
        """List entries, drop debris, and recount the whole folder's usage under the lock."""
        entries: list[tuple[str, int]] = []
        with self._locked_usage() as usage:
            total = 0
            for ns in os.scandir(self.root):
                if not ns.is_dir():
                    continue
                for shard in os.scandir(ns.path):
                    if not shard.is_dir():
                        continue
                    for f in os.scandir(shard.path):
                        size = self._account(f, ns.path == self.folder, entries)
                        total += size
            self._put(usage, total)
            # What the recount holds for each entry. (Where another process recounts an
            # entry cut short after we counted it, our delete takes off the bytes it had:
            # the account is low by the bytes cut until the next recount.)
            self._counted = dict(entries)
        return iter(entries)

    def _account(self, f: os.DirEntry, ours: bool, entries: list) -> int:
        """Bytes that file ``f`` holds against the capacity (0 if it was removed)."""
        try:
            st = f.stat()
        except FileNotFoundError:
            return 0
        if TMP_MARK not in f.name:
            if ours:
                entries.append((f.name, st.st_size))
            return st.st_size
        if is_debris(f.name, st.st_mtime):
            try:
                os.unlink(f.path)
            except FileNotFoundError:
                pass
            return 0
        return (parse_temp(f.name) or ("", -1, st.st_size))[2]

    def discard(self, path: str, inode: int) -> bool:
        """Remove the file at ``path`` (a damaged entry, an orphan) if it is still the one
        seen (``inode``), under the folder lock like every change ``scan`` counts; the
        next ``scan`` recounts the usage. For repair tools; True if removed."""
        with self._locked_usage():
            try:
                if os.stat(path).st_ino != inode:
                    return False
                os.unlink(path)
            except FileNotFoundError:
                return False
        return True


class _FolderFiles:
    """A folder's ``.lock`` and ``.usage``, open for as long as the tier: the descriptors
    and the process that opened them."""

    def __init__(self, lock: int, usage: int) -> None:
        self.lock, self.usage, self.pid = lock, usage, os.getpid()

    @classmethod
    def open(cls, lock_path: str, usage_path: str) -> "_FolderFiles":
        lock = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            return cls(lock, os.open(usage_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))
        except BaseException:
            os.close(lock)
            raise

    def linked(self) -> bool:
        """Whether both files are still in the folder (not unlinked meanwhile)."""
        try:
            return os.fstat(self.lock).st_nlink > 0 and os.fstat(self.usage).st_nlink > 0
        except OSError:
            return False

    def get(self) -> int:
        raw = os.pread(self.usage, USAGE.size, 0)
        return USAGE.unpack(raw)[0] if len(raw) == USAGE.size else 0

    def set(self, value: int) -> None:
        os.pwrite(self.usage, USAGE.pack(max(0, value)), 0)

    def close(self) -> None:
        """Close both (in a forked child, its copies only: the parent's stay open, and a
        lock the parent holds stays held). Also when the tier is garbage-collected."""
        fds, self.lock, self.usage = (self.lock, self.usage), -1, -1
        for fd in fds:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass

    __del__ = close


def is_debris(name: str, mtime: float) -> bool:
    """Whether a temporary file is a crashed writer's: its process is gone (this host),
    or it is older than any write takes."""
    host, pid, _claimed = parse_temp(name) or ("", -1, 0)
    dead = host == this_host() and pid > 0 and not _alive(pid)
    return dead or time.time() - mtime > _STALE_TMP_SECONDS


def read_into(fd: int, view: memoryview) -> int:
    """Read from ``fd`` into ``view`` until it is full or the file ends; bytes read."""
    got = 0
    while got < len(view):
        n = os.readv(fd, [view[got:]])
        if n == 0:
            break
        got += n
    return got


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
