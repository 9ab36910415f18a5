"""The one chunk reader (cache.vllm.load_path.ChunkLoader): what each read answers, as a
typed result, and the event each failure sends; a load's deadline."""

from __future__ import annotations

import logging

import pytest
import torch

from cache.placed import BlockWriters
from cache.vllm.load_path import FAILED, REMOTE, Deadline, Fetched, Partial, Placed, failed_from
from cache.vllm.metadata import ChunkIO, LoadRequest
from tests.test_layered import KEYS, LAYERS, TARGET, in_place, worker


def events_of(side) -> list[tuple[str, str, str]]:
    """Chunk events since the last call, but the saves' of the setup (``stored``)."""
    got = side.take_settled()
    return [e for e in got.events if e[1] != "stored"] if got is not None else []


@pytest.mark.parametrize("tier", ["dram", "disk"])
def test_a_local_chunk_is_placed_in_its_blocks_and_counted(tmp_path, tier):
    side, caches = worker(tmp_path, tier)
    chunk = ChunkIO(KEYS[0], None, TARGET[0])
    result = side.loader.read(chunk, BlockWriters())
    assert isinstance(result, Placed) and result.tier.name == tier
    assert all(in_place(caches, i, [0]) for i in range(LAYERS))
    read: dict[str, int] = {}
    assert side.loader.settle(chunk, result, read) and read == {tier: result.nbytes}
    side.shutdown()


def test_a_shared_chunk_read_locally_only_is_remote_then_placed_on_a_read_thread(tmp_path):
    side, caches = worker(tmp_path, "shared")
    chunk = ChunkIO(KEYS[0], None, TARGET[0])
    writers = BlockWriters()
    assert side.loader.read(chunk, writers, local_only=True) is REMOTE
    assert side.loader.read_layer(chunk, None, writers, local_only=True) is REMOTE
    result = side.store.run_read(side.loader.read, chunk, writers).result(10)
    assert isinstance(result, Placed) and result.tier == side.store.tiers[-1].id and result.tier.shared
    assert all(in_place(caches, i, [0]) for i in range(LAYERS))
    side.shutdown()


def test_layers_are_partial_until_the_last_verifies_the_entry(tmp_path):
    side, caches = worker(tmp_path, "disk")
    chunk, writers = ChunkIO(KEYS[1], KEYS[0], TARGET[1]), BlockWriters()
    result = side.loader.read_layer(chunk, None, writers)
    parts = []
    while isinstance(result, Partial):
        parts.append(result.read.read.next_part)
        result = side.loader.read_layer(chunk, result.read, writers)
    assert parts == list(range(1, LAYERS)) and isinstance(result, Placed)
    assert all(in_place(caches, i, [1]) for i in range(LAYERS))
    side.shutdown()


def test_a_missing_chunk_fails_and_says_so(tmp_path):
    side, _ = worker(tmp_path, "disk")
    chunk = ChunkIO("ff" * 16, None, TARGET[0])
    assert side.loader.read(chunk, BlockWriters()) is FAILED
    assert side.loader.read_layer(chunk, None, BlockWriters()) is FAILED
    assert side.loader.place(chunk, Fetched(None)) is FAILED
    assert events_of(side) == [(chunk.key, "missing", "none")] * 3
    side.shutdown()


def test_an_entry_that_does_not_fit_fails_as_damaged(tmp_path, caplog):
    side, _ = worker(tmp_path, "disk")
    chunk = ChunkIO(KEYS[0], None, TARGET[0] + [14])  # more blocks than the entry holds
    with caplog.at_level(logging.WARNING, "cache.vllm.load_path"):
        assert side.loader.read(chunk, BlockWriters()) is FAILED
    assert events_of(side) == [(chunk.key, "damaged", "disk")]
    assert "does not fit this engine" in caplog.text
    side.shutdown()


def test_a_chunk_of_an_ended_load_fails_without_an_event(tmp_path):
    side, caches = worker(tmp_path, "disk")
    before = caches["layer.0"][TARGET[0]].clone()
    writers = BlockWriters()
    writers.close()  # the load has ended: nothing more is written into its blocks
    assert side.loader.read(ChunkIO(KEYS[0], None, TARGET[0]), writers) is FAILED
    assert torch.equal(caches["layer.0"][TARGET[0]], before) and events_of(side) == []
    side.shutdown()


def test_a_read_that_raises_fails_its_chunk_as_damaged_and_is_logged(tmp_path, monkeypatch, caplog):
    side, _ = worker(tmp_path, "disk")

    def broken(*args, **kwargs):
        raise OSError("the disk went away")

    monkeypatch.setattr(side.store, "get_into", broken)
    with caplog.at_level(logging.ERROR, "cache.vllm.load_path"):
        assert side.loader.read(ChunkIO(KEYS[0], None, TARGET[0]), BlockWriters()) is FAILED
    assert events_of(side) == [(KEYS[0], "damaged", "none")] and "the disk went away" in caplog.text
    side.shutdown()


def test_a_load_past_its_deadline_is_logged_once_and_its_rest_fails(tmp_path, caplog):
    side, _ = worker(tmp_path, "disk")
    load = LoadRequest("r", [ChunkIO(k, None, TARGET[c]) for c, k in enumerate(KEYS)], False, deadline_s=0.5)
    with caplog.at_level(logging.INFO, "cache.vllm.load_path"):
        side.loader.passed_deadline(load, 1)
    assert "load of request r passed its 0.500 s deadline at chunk 1 of 3" in caplog.text
    assert events_of(side) == [(KEYS[1], "recompute", "none")]
    assert failed_from(load, 1) == set(TARGET[1] + TARGET[2])
    side.shutdown()


def test_a_deadline():
    assert Deadline(None).timeout() is None and not Deadline(None).passed()
    assert Deadline(None).poll(0.05) == 0.05
    assert Deadline(0).passed() and Deadline(0).timeout() == 0.0 and Deadline(0).poll(0.05) == 0.0
    late = Deadline(3600)
    assert not late.passed() and 3500 < late.timeout() <= 3600 and late.poll(0.05) == 0.05
