"""Entries read straight into the caller's buffers and verified there (cache.placed,
TieredStore.get_into, BlockCopier.place): same bytes as get + scatter, damage detected,
the entry dropped and the next tier read, promotion and publishing still happen."""

import numpy as np
import pytest
import torch

from cache.codec import HEADER_SIZE
from cache.keys import Namespace, chunk_keys
from cache.placed import PIECE_BYTES, Misfit
from cache.policy import LRUPolicy
from cache.store import TieredStore
from cache.tiers.files import FileTier
from cache.tiers.memory import MemoryTier
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
    return buf, lambda info: [memoryview(buf)[: n // 3], memoryview(buf)[n // 3:]]


@pytest.mark.parametrize("n", [1000, PIECE_BYTES * 2 + 77])
@pytest.mark.parametrize("signing_key", [b"", b"k" * 32])
def test_placed_read_gives_the_stored_bytes(tmp_path, n, signing_key):
    s = store(tmp_path, signing_key)
    key = chunk_keys(NS, list(range(16)), 16)[0]
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert s.put(key, None, "uint8", (n,), data) and s.flush(10)
    buf, place = into(n)
    tier, info = s.get_into(key, place)
    assert tier == 0 and info.shape == (n,) and bytes(buf) == data.tobytes()
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
    assert tier == 1 and bytes(buf) == data.tobytes()
    assert s.stats.tiers["dram"].corrupt == 1
    s.flush(10)
    assert s.tiers[0].contains(key)  # promoted again from disk, re-read there
    buf2, place2 = into(data.size)
    assert s.get_into(key, place2)[0] == 0 and bytes(buf2) == data.tobytes()
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


def test_a_key_only_in_the_shared_tier_is_left_to_get(tmp_path):
    s = store(tmp_path, shared=True)
    key = chunk_keys(NS, list(range(16)), 16)[0]
    assert s.put(key, None, "uint8", (100,), np.ones(100, np.uint8), shared=True) and s.flush(10)
    for tier in s.tiers[:2]:
        tier.delete(key)
    assert s.get_into(key, into(100)[1]) is None
    assert s.get(key).tier == 2
    s.close()


def test_a_reused_placed_hit_is_published(tmp_path):
    s = store(tmp_path, shared=True)
    key = chunk_keys(NS, list(range(16)), 16)[0]
    assert s.put(key, None, "uint8", (100,), np.ones(100, np.uint8)) and s.flush(10)
    assert not s.tiers[2].contains(key)
    assert s.get_into(key, into(100)[1])[0] == 0  # used a second time: published
    s.flush(10)
    assert s.tiers[2].contains(key)
    s.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_ids,skip,held", [
    ([3, 4, 5], 0, 3), ([9, 2, 5, 6], 1, 5), ([7], 2, 4), ([1, 8, 3, 10, 5, 0], 0, 6)])
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
        v[:] = flat[at:at + len(v)].tobytes()
        at += len(v)
    for n in caches:
        assert torch.equal(caches[n], expect[n])


def test_place_refuses_a_foreign_entry_shape():
    caches = {"l0": torch.zeros(6, 2, 3)}
    copier = BlockCopier(caches, KVLayout.of(caches, 6))
    with pytest.raises(ValueError):
        copier.place([0, 1], 0, "float32", (1, 1, 2, 3))   # one block held, two asked for
    with pytest.raises(ValueError):
        copier.place([0], 0, "float32", (1, 1, 2, 4))      # foreign block shape
    with pytest.raises(ValueError):
        copier.place([0], 0, "bfloat16", (1, 1, 2, 3))     # foreign dtype


def test_only_cpu_single_group_dim0_contiguous_caches_are_placeable():
    flash = {"l0": torch.zeros(2, 6, 4)}  # blocks along dimension 1
    assert not BlockCopier(flash, KVLayout.of(flash, 6)).placeable
    caches = {"l0": torch.zeros(6, 2, 3), "l1": torch.zeros(6, 2, 3)}
    assert not BlockCopier(caches, KVLayout.of(caches, 6), layer_groups=[0, 1]).placeable
    strided = {"l0": torch.zeros(6, 4, 3)[:, ::2]}
    assert not BlockCopier(strided, KVLayout.of(strided, 6)).placeable
