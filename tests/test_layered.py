"""Layer-wise loads (cache.vllm.layered, cache.placed.PartRead): each layer of every chunk
is in place when the forward pass asks for it, byte for byte; layers are read in layer
order across chunks; a damaged, replaced or late chunk fails its blocks and every later
one (vLLM recomputes them and drops the step's output), and nothing is written after the
load has ended."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from cache.codec import CorruptEntry, encode_header
from cache.config import build_cache_config
from cache.keys import Namespace
from cache.placed import BytesReader, PartRead, read_placed
from cache.store import EntryRead
from cache.vllm.layered import MIN_COMPUTE_TOKENS, LayeredLoad
from cache.vllm.metadata import ChunkIO, LoadRequest, TieredKVMetadata
from cache.vllm.worker import WorkerSide
from tests.test_placed import NS
from tests.test_scheduler_side import BLOCK, CHUNK

LAYERS = 4
PER_CHUNK = CHUNK // BLOCK  # blocks per chunk
KEYS = [f"{i:02x}" * 16 for i in range(1, 4)]
SOURCE = [list(range(c * PER_CHUNK, (c + 1) * PER_CHUNK)) for c in range(3)]  # blocks saved
TARGET = [list(range(8 + c * PER_CHUNK, 8 + (c + 1) * PER_CHUNK)) for c in range(3)]  # blocks loaded


def worker(tmp_path, tier):
    env = {
        "KVCACHE_DRAM_PATH": str(tmp_path / "shm"),
        "KVCACHE_DRAM_SIZE": "16MiB" if tier == "dram" else "0",
        "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
        "KVCACHE_DISK_SIZE": "0" if tier == "dram" else "16MiB",
    }
    if tier == "shared":
        env["KVCACHE_SHARED_URL"] = f"file://{tmp_path}/l3"
    side = WorkerSide(
        build_cache_config(env),
        Namespace("m", "d", "bfloat16", "x", chunk_tokens=CHUNK),
        num_blocks=16,
        block_size=BLOCK,
    )
    torch.manual_seed(0)
    caches = {f"layer.{i}": torch.randn(16, 2, BLOCK, 2, 8).to(torch.bfloat16) for i in range(LAYERS)}
    side.register_kv_caches(caches)
    saves = [ChunkIO(k, KEYS[c - 1] if c else None, SOURCE[c], shared=tier == "shared") for c, k in enumerate(KEYS)]
    side.wait_for_save(TieredKVMetadata(saves=saves))
    side.store.flush(10)
    if tier == "shared":
        for tier_ in side.store.tiers[: side.store.n_local]:
            for k in KEYS:
                tier_.delete(k)
        assert all(side.store.tiers[-1].contains(k) for k in KEYS)
    return side, caches


def load(deadline_s=None, hit_end=3 * CHUNK, compute_tokens=MIN_COMPUTE_TOKENS):
    chunks = [ChunkIO(k, KEYS[c - 1] if c else None, TARGET[c]) for c, k in enumerate(KEYS)]
    return TieredKVMetadata(
        loads=[LoadRequest("r", chunks, False, hit_end, deadline_s=deadline_s, compute_tokens=compute_tokens)]
    )


def in_place(caches, layer, chunks=range(3)):
    t = caches[f"layer.{layer}"]
    return all(torch.equal(t[TARGET[c]], t[SOURCE[c]]) for c in chunks)


@pytest.mark.parametrize("tier", ["dram", "disk", "shared"])
def test_each_layer_is_in_place_when_the_forward_pass_asks_for_it(tmp_path, tier):
    side, caches = worker(tmp_path, tier)
    side.start_load_kv(load())
    for layer in range(LAYERS):
        side.wait_for_layer_load(f"layer.{layer}")
        assert all(in_place(caches, i) for i in range(layer + 1))  # byte for byte, every chunk
    side.wait_for_save(TieredKVMetadata())
    assert side.get_block_ids_with_load_errors() == set()
    samples = side.take_settled().samples
    source = {"dram": "dram", "disk": "disk"}.get(tier, "shared")
    assert [s[:2] for s in samples if s[0] == "load"] == [("load", source)]
    assert side.store.stats.tiers[side.store.tier_names[-1 if tier == "shared" else 0]].hits == 3
    side.shutdown()


def test_layers_are_read_in_layer_order_across_chunks(tmp_path, monkeypatch):
    """The read threads never start (their tasks stay queued): the forward thread takes
    the queued layers itself, in queue order, which is layer i of every chunk, then
    layer i+1."""
    from concurrent.futures import Future

    side, caches = worker(tmp_path, "disk")
    started, step = [], EntryRead.step

    def recorded(self):
        started.append((self.read.next_part, self.key))
        return step(self)

    monkeypatch.setattr(EntryRead, "step", recorded)
    monkeypatch.setattr(side.store, "run_read", lambda fn, *args: Future())
    side.start_load_kv(load())
    side.wait_for_layer_load(f"layer.{LAYERS - 1}")
    side.wait_for_save(TieredKVMetadata())
    assert side.get_block_ids_with_load_errors() == set()
    # (layer 0 of each chunk comes with its lookup)
    assert started == [(layer, k) for layer in range(1, LAYERS) for k in KEYS]
    assert all(in_place(caches, i) for i in range(LAYERS))
    side.shutdown()


@pytest.mark.parametrize("tier", ["disk", "shared"])
def test_a_damaged_layer_fails_its_chunk_and_every_later_one(tmp_path, tier):
    side, caches = worker(tmp_path, tier)
    bad = side.store.tiers[-1 if tier == "shared" else 0]
    path = bad.path(KEYS[1]) if tier == "shared" else bad.path(KEYS[1])
    with open(path, "r+b") as f:  # one byte of the last layer: found only once the whole entry is read
        f.seek(-3, 2)
        byte = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    events = []
    side.store.account.on_event = lambda key, event, tier_: events.append((key, event))
    side.start_load_kv(load())
    for layer in range(LAYERS):
        side.wait_for_layer_load(f"layer.{layer}")
    side.wait_for_save(TieredKVMetadata())
    assert side.get_block_ids_with_load_errors() == set(TARGET[1] + TARGET[2])
    assert (KEYS[1], "damaged") in events
    assert all(in_place(caches, i, [0]) for i in range(LAYERS))
    assert side.store.stats.tiers[bad.name].corrupt == 1
    side.shutdown()


def test_a_load_past_its_deadline_writes_nothing_after_it_ended(tmp_path, monkeypatch):
    side, caches = worker(tmp_path, "disk")
    before = {n: t[TARGET[2]].clone() for n, t in caches.items()}
    release, step = threading.Event(), EntryRead.step
    late = []

    def slow_last_chunk(self):
        if self.key == KEYS[2]:
            release.wait(10)
            late.append(self.read.next_part)
        return step(self)

    monkeypatch.setattr(EntryRead, "step", slow_last_chunk)
    monkeypatch.setattr(LayeredLoad, "_steal", lambda self: None)  # the late read is on a read thread
    side.start_load_kv(load(deadline_s=2.0))  # the two other chunks are whole long before
    for layer in range(LAYERS):
        side.wait_for_layer_load(f"layer.{layer}")  # the last chunk is late: cut at the deadline
    side.wait_for_save(TieredKVMetadata())
    assert side.get_block_ids_with_load_errors() == set(TARGET[2])
    assert side.get_stats().data["load:layered.cut_short"] == 1
    release.set()
    side.store.run_read(lambda: None).result(5)  # the late read has run on the read threads
    side.store.flush(5)
    assert late == [1] or late == []
    for n, t in caches.items():  # its layers 1.. were never written (layer 0 came with the lookup)
        if n != "layer.0":
            assert torch.equal(t[TARGET[2]], before[n])
    assert all(in_place(caches, i, [0, 1]) for i in range(LAYERS))
    side.shutdown()


@pytest.mark.parametrize("tier", ["disk", "shared"])
def test_a_last_block_filled_in_part_is_whole_before_the_forward_pass(tmp_path, monkeypatch, tier):
    """The forward pass writes the new tokens' KV into the hit's last block before it
    waits for the layer: that block must not be written by the load afterwards, so its
    chunk is whole when ``start_load_kv`` returns (a shared one read on a read thread).
    On disk the read threads never start here: the forward thread reads the rest itself."""
    from concurrent.futures import Future

    side, caches = worker(tmp_path, tier)
    if tier == "disk":  # nothing else is read: only the forward thread's own read counts
        monkeypatch.setattr(side.store, "run_read", lambda fn, *args: Future())
    side.start_load_kv(load(hit_end=3 * CHUNK - 5))
    assert all(in_place(caches, i, [2]) for i in range(LAYERS))
    if tier == "disk":
        assert not in_place(caches, 1, [0])
    for layer in range(LAYERS):
        side.wait_for_layer_load(f"layer.{layer}")
    side.wait_for_save(TieredKVMetadata())
    assert side.get_block_ids_with_load_errors() == set()
    assert all(in_place(caches, i) for i in range(LAYERS))
    side.shutdown()


def test_a_load_beside_little_compute_is_whole_before_the_forward_pass(tmp_path):
    """A full hit computes one token: nothing to overlap, the load is whole at once."""
    side, caches = worker(tmp_path, "disk")
    side.start_load_kv(load(compute_tokens=MIN_COMPUTE_TOKENS - 1))
    assert not side.layered.loads and all(in_place(caches, i) for i in range(LAYERS))
    assert side.get_block_ids_with_load_errors() == set()
    side.shutdown()


def test_a_layered_load_is_timed_until_it_is_whole_not_until_the_forward_pass_ends(tmp_path):
    """The cost model learns the tier's rate from a load's time: the forward pass beside a
    layer-wise load may go on long after the load is whole, and that is not the tier's."""
    import time

    side, caches = worker(tmp_path, "disk")
    side.start_load_kv(load())
    for layer in range(LAYERS):
        side.wait_for_layer_load(f"layer.{layer}")
    time.sleep(1.0)  # the rest of the forward pass
    side.wait_for_save(TieredKVMetadata())
    (sample,) = [s for s in side.take_settled().samples if s[0] == "load"]
    assert sample[:2] == ("load", "disk") and sample[3] < 1.0
    side.shutdown()


def test_a_layer_this_load_does_not_know_waits_for_all_of_it(tmp_path):
    side, caches = worker(tmp_path, "disk")
    side.start_load_kv(load())
    side.wait_for_layer_load("not.a.kv.layer")
    assert all(in_place(caches, i) for i in range(LAYERS))
    side.wait_for_save(TieredKVMetadata())
    assert side.get_block_ids_with_load_errors() == set()
    side.shutdown()


def _entry(shape, signing_key=b""):
    data = np.random.default_rng(1).integers(0, 256, int(np.prod(shape)), dtype=np.uint8)
    key = "cd" * 16
    return key, data, encode_header(NS, key, "uint8", shape, data, signing_key) + data.tobytes()


@pytest.mark.parametrize("signing_key", [b"", b"k" * 32])
def test_a_part_read_fills_odd_buffers_and_verifies_only_the_whole_payload(signing_key):
    key, data, raw = _entry((3, 5, 7), signing_key)
    buf = bytearray(len(data))
    views = [memoryview(buf)[:11], memoryview(buf)[11:60], memoryview(buf)[60:]]  # not on part bounds
    read = PartRead(NS, key, lambda info: views, signing_key)
    read.open(BytesReader(raw))
    assert len(read.parts) == 3
    for part in range(3):
        read.read_part(BytesReader(raw))
        assert buf[: 35 * (part + 1)] == data.tobytes()[: 35 * (part + 1)]
    assert read.done
    bad = bytearray(raw)
    bad[-1] ^= 1
    read = PartRead(NS, key, lambda info: [memoryview(bytearray(len(data)))], signing_key)
    read.open(BytesReader(bad))
    read.read_part(BytesReader(bad))
    read.read_part(BytesReader(bad))
    with pytest.raises(CorruptEntry):
        read.read_part(BytesReader(bad))
    with pytest.raises(CorruptEntry):  # the same through a whole read
        read_placed(BytesReader(bad), NS, key, lambda info: [memoryview(bytearray(len(data)))], signing_key)


def test_an_entry_replaced_between_parts_is_refused():
    key, data, raw = _entry((2, 64))
    read = PartRead(NS, key, lambda info: [memoryview(bytearray(len(data)))])
    read.open(BytesReader(raw))
    read.read_part(BytesReader(raw))
    # the same key, another payload (another checksum in the header)
    replaced = encode_header(NS, key, "uint8", (2, 64), data[::-1].copy()) + data[::-1].tobytes()
    with pytest.raises(CorruptEntry):
        read.same_entry(BytesReader(replaced))
    read.same_entry(BytesReader(raw))


def test_a_transport_that_reads_whole_files_reads_each_entry_once(tmp_path, monkeypatch):
    """Curvine's SDK reads whole files only: a layer-wise load takes every layer of such
    an entry from its one read (not one whole-file read per layer)."""
    from cache.tiers.transport import CurvineOps

    side, caches = worker(tmp_path, "shared")
    ops, reads = side.store.tiers[-1].ops(), []

    def whole_file(path, use):
        reads.append(path)
        return CurvineOps.read_with(ops, path, use)

    monkeypatch.setattr(ops, "read_with", whole_file)
    side.start_load_kv(load())
    for layer in range(LAYERS):
        side.wait_for_layer_load(f"layer.{layer}")
    side.wait_for_save(TieredKVMetadata())
    assert side.get_block_ids_with_load_errors() == set()
    assert all(in_place(caches, i) for i in range(LAYERS)) and len(reads) == 3
    side.shutdown()
