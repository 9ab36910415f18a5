"""Page-cache control and the physical floors of the TTFT benchmark.

Runs in the benchmark's parent process, between requests (never while one is timed).
- ``drop(folder)``: ``os.sync()``, then ``posix_fadvise(DONTNEED)`` on every file, so the
  next read of those files comes from the device. (In a VM the host may still cache the
  virtual disk; the disk floor is measured the same way, so the two stay comparable.)
- ``resident_bytes(folder)``: how much of the files is in the page cache, by
  ``mmap`` + ``mincore`` without touching a page (what ``fincore`` reports).
- ``dram_bandwidth`` / ``disk_bandwidth``: bytes per second of a memory copy and of a
  cold sequential file read, each of a buffer the size of the prompt's KV.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import statistics
import time

import numpy as np

from cache.tiers.files import read_into

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_PAGE = mmap.PAGESIZE
_MAP_FAILED = ctypes.c_void_p(-1).value


def files_under(folder: str) -> list[str]:
    out = []
    for root, _dirs, names in os.walk(folder):
        out += [os.path.join(root, n) for n in names]
    return out


def drop(folder: str) -> tuple[int, int]:
    """Evict ``folder``'s files from the page cache; returns (files, bytes)."""
    os.sync()  # DONTNEED leaves dirty pages alone
    files = total = 0
    for path in files_under(folder):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
            files += 1
        finally:
            os.close(fd)
    return files, total


def _resident(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), "mmap failed", path)
        try:
            pages = (size + _PAGE - 1) // _PAGE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed", path)
            return sum(v & 1 for v in bytes(vec)) * _PAGE
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def resident_bytes(folder: str) -> int:
    total = 0
    for path in files_under(folder):
        try:
            total += _resident(path)
        except FileNotFoundError:
            pass
    return total


def drop_checked(folder: str) -> dict:
    """``drop`` and verify: returns files, bytes and what is still resident after it."""
    files, nbytes = drop(folder)
    return {"files": files, "bytes": nbytes, "resident_after": resident_bytes(folder)}


def dram_bandwidth(nbytes: int, repeats: int = 5) -> dict:
    """Memory-copy bandwidth (bytes/s, fastest of ``repeats``) for a buffer of ``nbytes``:
    numpy (one thread) and torch ``copy_`` (its thread pool); ``best`` is the floor's."""
    import torch

    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    result = {}
    for name, copy in (
        ("numpy", lambda: np.copyto(dst, src)),
        ("torch", lambda: torch.from_numpy(dst).copy_(torch.from_numpy(src))),
    ):
        copy()  # fault the pages in
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            copy()
            times.append(time.perf_counter() - t0)
        result[name] = nbytes / min(times)  # a floor: the best this machine did
    result["best"] = max(result.values())
    return result


def disk_bandwidth(nbytes: int, folder: str, repeats: int = 3) -> dict:
    """Cold sequential read bandwidth (bytes/s, fastest of ``repeats``) of one ``nbytes``
    file in ``folder``, page cache dropped (and checked) before each read."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"bandwidth-{nbytes}.bin")
    data = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    with open(path, "wb") as f:
        f.write(memoryview(data))
        f.flush()
        os.fsync(f.fileno())
    buf = np.empty(nbytes, dtype=np.uint8)
    times, resident = [], []
    try:
        for _ in range(repeats):
            drop(folder)
            resident.append(_resident(path))
            fd = os.open(path, os.O_RDONLY)
            try:
                t0 = time.perf_counter()
                read_into(fd, memoryview(buf))  # as the disk tier reads an entry
                times.append(time.perf_counter() - t0)
            finally:
                os.close(fd)
    finally:
        os.unlink(path)
    return {
        "bytes_per_s": nbytes / min(times),
        "median_bytes_per_s": nbytes / statistics.median(times),
        "resident_before_read": max(resident),
    }
