"""Bounded staging memory (``cache.vllm.staging``): a burst of saves never takes more host
memory than the pool allocated at start-up; a save that finds it full is skipped,
counted and reported settled; a slot goes back once its entry is written, and what the
shared tier is still to publish keeps its own copy. The CPU path; the GPU suite
(``bench.gpu_conformance``) reports the pinned high-water mark on a device."""

import threading
import time

import torch

from cache.codec import decode
from cache.config import build_cache_config
from cache.keys import Namespace, chunk_keys
from cache.vllm.metadata import ChunkIO, TieredKVMetadata
from cache.vllm.worker import WorkerSide

BLOCK, CHUNK, LAYERS = 16, 32, 2  # a chunk is two blocks
NS = Namespace("m", "d", "bfloat16", "x", chunk_tokens=CHUNK)
KEYS = chunk_keys(NS.digest, list(range(CHUNK * 12)), CHUNK)


def until(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def worker(tmp_path, slots: int, **extra) -> tuple[WorkerSide, dict]:
    entry = LAYERS * 2 * BLOCK * 2 * 8 * 2  # bytes of one chunk: 2 blocks of [16 tokens, 2 heads, 8] bf16
    env = {
        "KVCACHE_DRAM_PATH": str(tmp_path / "shm"),
        "KVCACHE_DRAM_SIZE": "16MiB",
        "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
        "KVCACHE_DISK_SIZE": "0",
        "KVCACHE_CHUNK_TOKENS": str(CHUNK),
        "KVCACHE_STAGING_SIZE": str(entry * slots),
        **extra,
    }
    side = WorkerSide(build_cache_config(env), NS, num_blocks=32, block_size=BLOCK)
    torch.manual_seed(0)
    caches = {f"layer.{i}": torch.randn(32, BLOCK, 2, 8).to(torch.bfloat16) for i in range(LAYERS)}
    side.register_kv_caches(caches)
    assert side.staging.slots == slots and not side.staging.pinned
    return side, caches


def blocked(tier):
    """Make ``tier``'s writes wait for the returned event (the writer thread is busy)."""
    go, write = threading.Event(), tier.write

    def slow(*args, **kwargs):
        go.wait(30)
        return write(*args, **kwargs)

    tier.write = slow
    return go


def test_a_burst_of_saves_stays_within_the_staging_pool(tmp_path, monkeypatch):
    side, caches = worker(tmp_path, slots=3)
    go = blocked(side.store.tiers[0])
    events = []
    side.store.account.on_event = lambda key, event, tier: events.append((key, event, tier))
    big = []  # host allocations of a block or more while the burst is saved
    empty = torch.empty

    def counted(*size, **kwargs):
        t = empty(*size, **kwargs)
        big.append(t.nbytes) if t.nbytes >= BLOCK * 2 * 8 * 2 else None
        return t

    monkeypatch.setattr(torch, "empty", counted)
    saves = [ChunkIO(k, KEYS[i - 1] if i else None, [2 * i, 2 * i + 1]) for i, k in enumerate(KEYS[:10])]
    side.wait_for_save(TieredKVMetadata(saves=saves))  # one step's burst: 10 chunks
    monkeypatch.undo()
    pool = side.staging
    assert big == [] and pool.taken == 3 and pool.high_water == 3 and pool.dropped_saves == 7
    # every save is settled for the scheduler (none will come later); skipped ones explained
    meta = side.take_settled()
    assert set(KEYS[3:10]) <= set(meta.settled)
    assert {(k, "not_admitted", "all") for k in KEYS[3:10]} <= set(meta.events)
    assert side.get_stats().data["all.dropped_staging"] == 7
    go.set()
    assert side.store.flush(20) and until(lambda: pool.in_use() == 0)
    assert [side.store.tiers[0].contains(k) for k in KEYS[:4]] == [True, True, True, False]
    # the slots are reused: the next saves take no new memory and are stored exactly
    side.wait_for_save(TieredKVMetadata(saves=[ChunkIO(KEYS[10], None, [20, 21])]))
    assert side.store.flush(20) and pool.taken == 4 and pool.high_water == 3
    info, payload = decode(side.store.tiers[0].read(KEYS[10]), NS.digest, KEYS[10])
    entry = torch.frombuffer(bytearray(payload), dtype=torch.bfloat16).view(info.shape)
    assert torch.equal(entry[1, 1], caches["layer.1"][21])
    side.shutdown()


def test_a_publish_queued_past_the_write_keeps_its_own_copy_of_a_reused_slot(tmp_path):
    """One slot: save A is written locally and queued for the shared tier (whose writes
    wait); its slot goes back and save B overwrites it; A is still published as A."""
    side, caches = worker(tmp_path, slots=1, KVCACHE_SHARED_URL=f"file://{tmp_path}/l3", KVCACHE_SHARED_ADMISSION="all")
    go = blocked(side.store.tiers[-1])
    side.wait_for_save(TieredKVMetadata(saves=[ChunkIO(KEYS[0], None, [0, 1])]))
    assert until(lambda: side.staging.in_use() == 0)  # written locally; its publish waits
    side.wait_for_save(TieredKVMetadata(saves=[ChunkIO(KEYS[1], KEYS[0], [6, 7])]))
    assert side.staging.taken == 2 and side.staging.dropped_saves == 0
    go.set()
    assert side.store.flush(20)
    info, payload = decode(side.store.tiers[-1].read(KEYS[0]), NS.digest, KEYS[0])
    entry = torch.frombuffer(bytearray(payload), dtype=torch.bfloat16).view(info.shape)
    assert torch.equal(entry[0, 1], caches["layer.0"][1]) and torch.equal(entry[1, 0], caches["layer.1"][0])
    side.shutdown()


def test_the_slot_freed_last_is_taken_first():
    """A pool cycling through every slot in turn would write, on each save, memory not
    touched for a long time (unmapped pages at first, then lines long out of the CPU's
    caches): the slot just given back is the one handed out next."""
    from cache.vllm.staging import StagingPool

    pool = StagingPool(64, 8)
    a, b = pool.take(64), pool.take(64)
    pool.release(a)
    pool.release(b)
    assert pool.take(64) is b
    assert pool.take(64) is a
    c = pool.take(64)
    pool.release(c)
    assert pool.take(64) is c
