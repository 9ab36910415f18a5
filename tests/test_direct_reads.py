"""Disk-tier entries not in the page cache are read a layer at a time with O_DIRECT
(cache.tiers.direct): the same bytes as a buffered read over every window and alignment
edge, none of the payload left in the page cache; damage still detected; whole reads,
entries in the page cache and a filesystem that refuses O_DIRECT read through it."""

import errno
import fcntl
import logging
import os

import numpy as np
import pytest

from cache.keys import Namespace, chunk_keys
from cache.placed import BlockWriters
from cache.policy import LRUPolicy
from cache.store import TieredStore
from cache.tiers import direct
from cache.tiers.direct import WINDOW_BYTES, DirectReader, resident
from cache.tiers.files import FileTier

NS = Namespace("m", "d", "uint8", "x").digest


def _drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _resident(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        return resident(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


class Disk:
    """A direct-reading disk tier in ``tmp_path``, its store, and the readers it used."""

    def __init__(self, tmp_path, direct_reads=True):
        self.tier = FileTier(str(tmp_path / "disk"), "ns", 1 << 30, "disk", direct_reads=direct_reads)
        self.store = TieredStore([self.tier], NS, [LRUPolicy()])
        self.readers: list[str] = []
        make = self.tier.direct.open_reader

        def spy(fd, path):
            reader = make(fd, path)
            self.readers.append(type(reader).__name__)
            return reader

        self.tier.direct.open_reader = spy

    def put(self, i: int, shape: tuple[int, ...]):
        """A stored entry of random bytes, dropped from the page cache (the test is
        skipped where that is not possible: a filesystem that is all memory)."""
        key = chunk_keys(NS, list(range(16 * (i + 1))), 16)[-1]
        data = np.random.default_rng(i).integers(0, 256, int(np.prod(shape)), dtype=np.uint8)
        assert self.store.put(key, None, "uint8", shape, data) and self.store.flush(10)
        _drop(self.tier.path(key))
        if _resident(self.tier.path(key)) is not False:
            pytest.skip("this filesystem keeps its files in the page cache")
        return key, data

    def layers(self, key, n: int):
        """Read ``key`` a layer at a time into a new buffer of ``n`` bytes: (buffer, whether
        every layer read and the entry verified)."""
        buf = bytearray(n)
        read = self.store.read_layers(
            key, lambda info: [memoryview(buf)[: n // 3], memoryview(buf)[n // 3 :]], BlockWriters()
        )
        if read is None:
            return buf, False
        while not read.read.done:
            if not read.step():
                return buf, False
        return buf, True


@pytest.fixture
def disk(tmp_path):
    d = Disk(tmp_path)
    yield d
    d.store.close()


# Payloads that end inside a block, span several windows, and have layers that start and end
# off the 4 KiB grid (an entry's payload starts at byte 256).
SHAPES = [(1000,), (6, 786432), (3, 3000007), (2, WINDOW_BYTES + 4095), (5, 12345)]


@pytest.mark.parametrize("shape", SHAPES)
def test_a_cold_entry_read_layer_by_layer_past_the_page_cache_gives_its_bytes(disk, shape):
    key, data = disk.put(1, shape)
    buf, ok = disk.layers(key, data.size)
    assert ok and bytes(buf) == data.tobytes() and disk.store.stats.tiers["disk"].hits == 1
    assert set(disk.readers) == {"DirectReader"} and len(disk.readers) == (shape[0] if len(shape) > 1 else 1)
    if data.size > 4 * 4096:  # only the header's first pages went through the page cache
        assert _resident(disk.tier.path(key)) is False


@pytest.mark.parametrize("shape", SHAPES)
def test_a_cold_entry_read_whole_goes_through_the_page_cache(disk, shape):
    """The kernel's readahead overlaps a whole read's disk time with its copy."""
    key, data = disk.put(0, shape)
    buf = bytearray(data.size)
    third = data.size // 3
    tier, info = disk.store.get_into(key, lambda info: [memoryview(buf)[:third], memoryview(buf)[third:]])
    assert (tier.name, info.shape) == ("disk", shape) and bytes(buf) == data.tobytes()
    assert disk.readers == ["DirectReader"] and _resident(disk.tier.path(key)) is True


def test_a_damaged_cold_entry_is_detected_and_dropped(disk):
    key, data = disk.put(2, (6, 786432))
    path = disk.tier.path(key)
    with open(path, "r+b") as f:  # one byte of the last layer, well inside a block
        f.seek(os.path.getsize(path) - 70000)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    _drop(path)
    assert disk.layers(key, data.size)[1] is False
    assert set(disk.readers) == {"DirectReader"} and len(disk.readers) == 6 and not os.path.exists(path)
    assert disk.store.stats.tiers["disk"].corrupt == 1


def test_an_entry_in_the_page_cache_is_read_through_it(disk):
    key, data = disk.put(3, (4, 65536))
    with open(disk.tier.path(key), "rb") as f:
        f.read()  # now wholly in the page cache
    buf, ok = disk.layers(key, data.size)
    assert ok and bytes(buf) == data.tobytes() and disk.readers == ["FdReader"] * 4


def test_buffered_when_turned_off(tmp_path):
    d = Disk(tmp_path, direct_reads=False)
    key, data = d.put(4, (4, 65536))
    buf, ok = d.layers(key, data.size)
    assert ok and bytes(buf) == data.tobytes() and d.readers == ["FdReader"] * 4
    d.store.close()


@pytest.mark.parametrize("where", ["open", "read"])
def test_a_filesystem_that_refuses_direct_reads_is_read_through_the_page_cache(disk, monkeypatch, caplog, where):
    key, data = disk.put(5, (6, 786432))
    refusal = OSError(errno.EINVAL, "Invalid argument")
    if where == "open":
        real_open = os.open

        def open_(path, flags, *a):
            if flags & direct.O_DIRECT:
                raise refusal
            return real_open(path, flags, *a)

        monkeypatch.setattr(direct.os, "open", open_)
    else:
        real_preadv = os.preadv

        def preadv(fd, buffers, offset, *a):
            if fcntl.fcntl(fd, fcntl.F_GETFL) & direct.O_DIRECT:
                raise refusal
            return real_preadv(fd, buffers, offset, *a)

        monkeypatch.setattr(direct.os, "preadv", preadv)
    with caplog.at_level(logging.WARNING, logger="cache.tiers.direct"):
        buf, ok = disk.layers(key, data.size)
    assert ok and bytes(buf) == data.tobytes()
    assert disk.readers == (["FdReader"] if where == "open" else ["DirectReader"]) + ["FdReader"] * 5
    assert not disk.tier.direct.enabled and caplog.text.count("refuses direct reads") == 1


def test_a_reader_sharing_its_thread_window_rereads_after_another_used_it(disk):
    """Two direct readers on one thread take turns with the thread's window."""
    (k1, d1), (k2, d2) = disk.put(6, (2, 65536)), disk.put(7, (2, 65536))
    fds = [os.open(disk.tier.path(k), os.O_RDONLY) for k in (k1, k2)]
    try:
        readers = [disk.tier.direct.open_reader(fd, disk.tier.path(k)) for fd, k in zip(fds, (k1, k2))]
        assert all(isinstance(r, DirectReader) for r in readers)
        out = [bytearray(1000) for _ in range(4)]
        readers[0].readinto(memoryview(out[0]), 256)
        readers[1].readinto(memoryview(out[1]), 256)
        readers[0].readinto(memoryview(out[2]), 1256)
        readers[1].readinto(memoryview(out[3]), 1256)
        assert bytes(out[0]) + bytes(out[2]) == d1.tobytes()[:2000]
        assert bytes(out[1]) + bytes(out[3]) == d2.tobytes()[:2000]
        for r in readers:
            r.close()
    finally:
        for fd in fds:
            os.close(fd)
