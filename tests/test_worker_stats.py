"""The worker's stats of each engine step (issue 31 item 3): what the forward thread calls
every step waits for no tier's file lock, and the tiers' usage still reaches the metrics."""

import fcntl
import threading
import time

import pytest
import torch

import cache.vllm.worker as worker_module
from cache.config import build_cache_config
from cache.keys import Namespace
from cache.tiers.layout import LOCK_FILE
from cache.vllm.metadata import ChunkIO, TieredKVMetadata
from cache.vllm.worker import WorkerSide

BLOCK, CHUNK = 128, 256
KEY = "ab" * 16


@pytest.fixture
def side(tmp_path):
    cfg = build_cache_config(
        {
            "KVCACHE_DRAM_PATH": str(tmp_path / "shm"),
            "KVCACHE_DRAM_SIZE": "16MiB",
            "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
            "KVCACHE_DISK_SIZE": "16MiB",
        }
    )
    side = WorkerSide(cfg, Namespace("m", "d", "bfloat16", "x", chunk_tokens=CHUNK), num_blocks=8, block_size=BLOCK)
    side.register_kv_caches({f"layer.{i}": torch.randn(8, 2, BLOCK, 2, 8).to(torch.bfloat16) for i in range(2)})
    yield side
    side.shutdown()


def test_step_stats_never_wait_for_a_tier_lock(side, tmp_path, monkeypatch):
    """The writer thread holds a tier's folder lock while it writes (and, niced on a busy
    core, may be preempted holding it): the forward thread's stats do not wait for it.
    Usage every step is stale here, so each call asks a read thread for it."""
    side.get_stats()  # the first usage read, at start-up
    monkeypatch.setattr(worker_module, "LEVELS_MAX_AGE_S", 0.0)
    done = threading.Event()
    with open(tmp_path / "shm" / LOCK_FILE, "ab") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            t = threading.Thread(target=lambda: (side.get_stats(), side.get_stats(), done.set()), daemon=True)
            t.start()
            finished = done.wait(60)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    assert finished, "the step's stats waited for the tier's file lock"


def test_usage_after_a_save_reaches_the_stats(side):
    """A settled save changes the tier's usage: a later step's stats carry it (read on a
    read thread), even when no counter moved since."""
    side.get_stats()  # the first usage read (empty tiers), at start-up
    side.wait_for_save(TieredKVMetadata(saves=[ChunkIO(KEY, None, [0, 1])]))
    assert side.store.flush(60)
    used, deadline = 0, time.monotonic() + 60
    while used == 0 and time.monotonic() < deadline:
        stats = side.get_stats()
        if stats is not None:
            used = stats.data.get("dram.used_bytes", 0)
        time.sleep(0.01)
    assert used > 0
    assert side.get_stats() is None  # nothing moved since: no report
