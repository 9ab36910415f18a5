"""Entries read straight into the caller's buffers and verified there (cache.placed,
TieredStore.get_into, BlockCopier.place): same bytes as get + scatter, damage detected,
the entry dropped and the next tier read, promotion and publishing still happen."""

import os
import threading
import time

import numpy as np
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from cache.codec import HEADER_SIZE
from cache.keys import Namespace, chunk_keys
from cache.placed import PIECE_BYTES, BlockWriters, BytesReader, LoadEnded, Misfit, Staged
from cache.policy import LRUPolicy
from cache.store import ELSEWHERE, TieredStore
from cache.tiers.files import FileTier
from cache.tiers.memory import MemoryTier
from cache.tiers.resilience import Pacer
from cache.tiers.shared import SharedTier
from cache.tiers.transport import CurvineOps
from cache.vllm.kv_copy import BlockCopier, KVLayout

NS = Namespace("m", "d", "uint8", "x").digest


def store(tmp_path, signing_key=b"", shared=False, dram=True):
    tiers = [FileTier(str(tmp_path / "shm"), "ns", 1 << 24, "dram", use_mmap=True)] if dram else []
    tiers.append(FileTier(str(tmp_path / "disk"), "ns", 1 << 24, "disk"))
    if shared:
        tiers.append(MemoryTier(None, "shared"))
        tiers[-1].shared = True
    return TieredStore(tiers, NS, [LRUPolicy() for _ in tiers], signing_key=signing_key)


def into(n):
    """A place function filling one new buffer of ``n`` bytes, in two pieces."""
    buf = bytearray(n)
    return buf, lambda info: [memoryview(buf)[: n // 3], memoryview(buf)[n // 3 :]]


@pytest.mark.parametrize("n", [1000, PIECE_BYTES * 2 + 77])
@pytest.mark.parametrize("signing_key", [b"", b"k" * 32])
def test_placed_read_gives_the_stored_bytes(tmp_path, n, signing_key):
    s = store(tmp_path, signing_key)
    key = chunk_keys(NS, list(range(16)), 16)[0]
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert s.put(key, None, "uint8", (n,), data) and s.flush(10)
    buf, place = into(n)
    tier, info = s.get_into(key, place)
    assert tier == s.tiers[0].id and info.shape == (n,) and bytes(buf) == data.tobytes()
    assert s.stats.tiers["dram"].hits == 1
    s.close()


def test_damage_is_detected_dropped_and_the_next_tier_read(tmp_path):
    s = store(tmp_path)
    key = chunk_keys(NS, list(range(16)), 16)[0]
    data = np.arange(5000, dtype=np.uint32).view(np.uint8)
    assert s.put(key, None, "uint8", (data.size,), data) and s.flush(10)
    with open(s.tiers[0].path(key), "rb") as f:
        raw = f.read()
    s.tiers[1].reserve(len(raw))
    s.tiers[1].write(key, [raw], len(raw))  # a sound copy on disk
    with open(s.tiers[0].path(key), "r+b") as f:  # one flipped bit in DRAM
        f.seek(HEADER_SIZE + 4321)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 4321)
        f.write(bytes([byte[0] ^ 0x10]))
    buf, place = into(data.size)
    tier, _ = s.get_into(key, place)
    assert tier == s.tiers[1].id and bytes(buf) == data.tobytes()
    assert s.stats.tiers["dram"].corrupt == 1
    s.flush(10)
    assert s.tiers[0].contains(key)  # promoted again from disk, re-read there
    buf2, place2 = into(data.size)
    assert s.get_into(key, place2)[0] == s.tiers[0].id and bytes(buf2) == data.tobytes()
    s.close()


@pytest.mark.parametrize("cut", [HEADER_SIZE - 1, HEADER_SIZE + 10, -1])
def test_truncated_entries_are_misses(tmp_path, cut):
    s = store(tmp_path, dram=False)
    key = chunk_keys(NS, list(range(16)), 16)[0]
    data = np.ones(3000, dtype=np.uint8)
    assert s.put(key, None, "uint8", (3000,), data) and s.flush(10)
    path = s.tiers[0].path(key)
    size = HEADER_SIZE + 3000
    with open(path, "r+b") as f:
        f.truncate(size + cut if cut < 0 else cut)
    assert s.get_into(key, into(3000)[1]) is None
    assert s.stats.tiers["disk"].corrupt == 1 and not s.tiers[0].contains(key)
    s.close()


def test_unsigned_entry_is_refused_with_a_signing_key(tmp_path):
    key = chunk_keys(NS, list(range(16)), 16)[0]
    plain = store(tmp_path)
    assert plain.put(key, None, "uint8", (100,), np.ones(100, np.uint8)) and plain.flush(10)
    plain.close()
    signed = store(tmp_path, b"s" * 32)
    assert signed.get_into(key, into(100)[1]) is None
    assert signed.stats.tiers["dram"].corrupt == 1
    signed.close()


def test_an_entry_that_does_not_fit_is_kept_and_named(tmp_path):
    s = store(tmp_path)
    key = chunk_keys(NS, list(range(16)), 16)[0]
    assert s.put(key, None, "uint8", (100,), np.ones(100, np.uint8)) and s.flush(10)

    def refuse(info):
        raise ValueError("not this shape")

    with pytest.raises(Misfit) as e:
        s.get_into(key, refuse)
    assert e.value.tier == "dram" and s.tiers[0].contains(key)
    s.close()


def test_a_key_only_in_a_tier_without_files_is_left_to_get(tmp_path):
    s = store(tmp_path, shared=True)
    key = chunk_keys(NS, list(range(16)), 16)[0]
    assert s.put(key, None, "uint8", (100,), np.ones(100, np.uint8), shared=True) and s.flush(10)
    for tier in s.tiers[:2]:
        tier.delete(key)
    assert s.get_into(key, into(100)[1]) is ELSEWHERE
    assert s.get(key).tier == s.tiers[2].id
    s.close()


def test_a_miss_is_none_and_counted(tmp_path):
    s = store(tmp_path)
    assert s.get_into(chunk_keys(NS, list(range(16)), 16)[0], into(100)[1]) is None
    assert s.stats.tiers["dram"].misses == 1
    s.close()


def test_a_reused_placed_hit_is_published(tmp_path):
    s = store(tmp_path, shared=True)
    key = chunk_keys(NS, list(range(16)), 16)[0]
    assert s.put(key, None, "uint8", (100,), np.ones(100, np.uint8)) and s.flush(10)
    assert not s.tiers[2].contains(key)
    assert s.get_into(key, into(100)[1])[0] == s.tiers[0].id  # used a second time: published
    s.flush(10)
    assert s.tiers[2].contains(key)
    s.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "block_ids,skip,held", [([3, 4, 5], 0, 3), ([9, 2, 5, 6], 1, 5), ([7], 2, 4), ([1, 8, 3, 10, 5, 0], 0, 6)]
)
def test_place_puts_each_byte_where_scatter_does(tmp_path, dtype, block_ids, skip, held):
    caches = {f"l{i}": torch.randn(12, 2, 4, 8).to(dtype) for i in range(3)}
    layout = KVLayout.of(caches, 12)
    copier = BlockCopier(caches, layout)
    assert copier.placeable
    entry = torch.randn(layout.entry_shape(held)).to(dtype)
    expect = {n: t.clone() for n, t in caches.items()}
    BlockCopier(expect, layout).scatter(block_ids, entry, skip_blocks=skip)
    views = copier.place(block_ids, skip, layout.dtype_name, tuple(entry.shape))
    flat = entry.view(torch.uint8).reshape(-1).numpy()
    assert sum(len(v) for v in views) == flat.size
    at = 0
    for v in views:  # what read_placed does: fill the views in payload order
        assert not v.readonly
        v[:] = flat[at : at + len(v)].tobytes()
        at += len(v)
    for n in caches:
        assert torch.equal(caches[n], expect[n])


def test_place_refuses_a_foreign_entry_shape():
    caches = {"l0": torch.zeros(6, 2, 3)}
    copier = BlockCopier(caches, KVLayout.of(caches, 6))
    with pytest.raises(ValueError):
        copier.place([0, 1], 0, "float32", (1, 1, 2, 3))  # one block held, two asked for
    with pytest.raises(ValueError):
        copier.place([0], 0, "float32", (1, 1, 2, 4))  # foreign block shape
    with pytest.raises(ValueError):
        copier.place([0], 0, "bfloat16", (1, 1, 2, 3))  # foreign dtype


def test_only_cpu_single_group_contiguous_unsplit_caches_are_placeable():
    split = {"l0": torch.zeros(12, 2, 4, 8)}  # two kernel blocks per block
    assert not BlockCopier(split, KVLayout.of(split, 6)).placeable
    caches = {"l0": torch.zeros(6, 2, 3), "l1": torch.zeros(6, 2, 3)}
    assert not BlockCopier(caches, KVLayout.of(caches, 6), layer_groups=[0, 1]).placeable
    strided = {"l0": torch.zeros(6, 4, 3)[:, ::2]}
    assert not BlockCopier(strided, KVLayout.of(strided, 6)).placeable


# -- the shared tier: read a piece at a time into the caller's buffers ------------------
class SubclassedFS(LocalFileSystem):
    """A filesystem other than the plain local one: read through its file objects."""

    protocol = ("subclassed",)
    cachable = False


def shared_store(tmp_path, fs=None, dram=True, **kw):
    fs = fs if fs is not None else LocalFileSystem()
    l3 = SharedTier(lambda: fs, str(tmp_path / "l3"), "ns", refresh_s=0, **kw)
    tiers = ([FileTier(str(tmp_path / "shm"), "ns", 1 << 24, "dram", use_mmap=True)] if dram else []) + [l3]
    return TieredStore(tiers, NS, [LRUPolicy() for _ in tiers], shared_admission="all")


def only_in_shared(s, n, seed=0):
    key = chunk_keys(NS, list(range(seed, seed + 16)), 16)[0]
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    assert s.put(key, None, "uint8", (n,), data, shared=True) and s.flush(10)
    for tier in s.tiers[: s.n_local]:
        tier.delete(key)
    assert s.tiers[-1].contains(key)
    return key, data


@pytest.mark.parametrize("transport", ["mount", "file-object", "whole-file"])
@pytest.mark.parametrize("dram", [True, False])
def test_shared_entries_are_read_in_place_and_promoted_without_a_second_read(tmp_path, monkeypatch, transport, dram):
    fs = SubclassedFS() if transport == "file-object" else None
    s = shared_store(tmp_path, fs, dram)
    n = PIECE_BYTES * 3 + 5
    key, data = only_in_shared(s, n)
    ops = s.tiers[-1].ops()
    if transport == "whole-file":  # Curvine's SDK: whole files only
        monkeypatch.setattr(ops, "read_with", lambda path, use: CurvineOps.read_with(ops, path, use))
    whole_reads = []
    monkeypatch.setattr(s.tiers[-1], "read", lambda k: whole_reads.append(k))
    buf, place = into(n)
    tier, info = s.get_into(key, place)
    assert tier == s.tiers[s.n_local].id and tier.shared and info.shape == (n,) and bytes(buf) == data.tobytes()
    assert s.stats.tiers["shared"].hits == 1
    s.flush(10)
    if dram:  # promoted from the bytes this read kept, not read from the shared tier again
        assert s.tiers[0].contains(key)
        buf2, place2 = into(n)
        assert s.get_into(key, place2)[0] == s.tiers[0].id and bytes(buf2) == data.tobytes()
    assert whole_reads == []
    s.close()


def test_a_damaged_shared_entry_is_ignored_not_deleted(tmp_path):
    s = shared_store(tmp_path)
    key, data = only_in_shared(s, 5000)
    path = s.tiers[-1].path(key)
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 4000)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 4000)
        f.write(bytes([byte[0] ^ 1]))
    assert s.get_into(key, into(5000)[1]) is None
    assert s.stats.tiers["shared"].corrupt == 1 and os.path.exists(path)
    assert not s.tiers[-1].contains(key)  # rejected here for a while
    assert s.tiers[-1].health.failures == 0  # the entry's fault, not the tier's
    s.close()


def test_shared_reads_are_charged_to_the_link(tmp_path):
    class Charged(Pacer):
        seen = []

        def take(self, nbytes, started=None):
            self.seen.append(nbytes)

    s = shared_store(tmp_path, pacer=Charged(1e9))
    key, _ = only_in_shared(s, 3000)
    Charged.seen.clear()
    assert s.get_into(key, into(3000)[1])[0] == s.tiers[1].id
    assert Charged.seen == [HEADER_SIZE + 3000]
    s.close()


class Blocking:
    """A reader whose payload reads wait for ``go`` (a network read that hangs)."""

    def __init__(self, data):
        self.inner, self.go, self.waiting = BytesReader(data), threading.Event(), threading.Event()
        self.nread = 0

    def size(self):
        return self.inner.size()

    def pread(self, n, offset):
        return self.inner.pread(n, offset)

    def readinto(self, view, offset):
        self.waiting.set()
        self.go.wait(10)
        return self.inner.readinto(view, offset)


def test_a_shared_read_writes_nothing_once_its_load_has_ended():
    data = bytes(range(256)) * 4096
    writers, reader = BlockWriters(), Blocking(data)
    staged = Staged(reader, writers, keep=False)
    view = memoryview(bytearray(PIECE_BYTES))
    done = []
    t = threading.Thread(target=lambda: done.append(_catch(lambda: staged.readinto(view, 0))))
    t.start()
    assert reader.waiting.wait(10)
    writers.close()  # returns at once: the hung read holds no writer slot
    reader.go.set()
    t.join(10)
    assert isinstance(done[0], LoadEnded) and not any(view)


def test_a_shared_read_past_the_tier_deadline_is_a_miss_and_writes_nothing_after(tmp_path, monkeypatch):
    s = shared_store(tmp_path, dram=False, timeout_s=0.2)
    key, data = only_in_shared(s, PIECE_BYTES * 2)
    ops = s.tiers[-1].ops()
    blocking, finished = [], threading.Event()

    def slow(path, use):
        with open(path, "rb") as f:
            blocking.append(Blocking(f.read()))
        try:
            return use(blocking[0])
        finally:
            finished.set()

    monkeypatch.setattr(ops, "read_with", slow)
    writers = BlockWriters()
    buf, place = into(len(data))
    t0 = time.monotonic()
    assert s.get_into(key, place, writers) is None
    assert time.monotonic() - t0 < 5 and s.stats.tiers["shared"].timeouts == 1
    writers.close()  # the load ends (its blocks are recomputed)
    blocking[0].go.set()  # the read wakes up, too late
    assert finished.wait(10)  # and ends on the tier's thread
    assert not any(buf)
    s.close()


def _catch(fn):
    try:
        return fn()
    except Exception as e:
        return e
