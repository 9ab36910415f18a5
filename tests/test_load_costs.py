"""The cost model in the connector's two roles, without an engine: the scheduler side
loads what pays (all, a prefix, nothing) once it has measurements; the worker side
cuts a load short at its deadline (the rest is recomputed) and sends its timings back.
The real engine's side of it is in ``tests/test_engine_cost.py``."""

import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cache.assembly import build_tiers
from cache.codec import HEADER_SIZE
from cache.config import build_cache_config
from cache.cost import attention_pairs
from cache.keys import Namespace
from cache.policy import LRUPolicy
from cache.store import TieredStore
from cache.vllm.kv_copy import BlockCopier
from cache.vllm.layered import MIN_COMPUTE_TOKENS
from cache.vllm.metadata import ChunkIO, LoadRequest, TieredKVMetadata
from cache.vllm.metrics import TieredKVPromMetrics
from cache.vllm.scheduler import SchedulerSide
from cache.vllm.worker import WorkerSide
from tests.test_scheduler_side import BLOCK, CHUNK, Blocks, output, request

BYTES_PER_BLOCK = 1 << 20  # a made-up model: 1 MiB of KV per 128-token block
KEY = "ab" * 16


def config(tmp_path, **extra):
    return build_cache_config(
        {
            "KVCACHE_DRAM_PATH": str(tmp_path / "shm"),
            "KVCACHE_DRAM_SIZE": "16MiB",
            "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
            "KVCACHE_DISK_SIZE": "16MiB",
            **extra,
        }
    )


@pytest.fixture
def setup(tmp_path):
    return scheduler_and_writer(config(tmp_path))


def scheduler_and_writer(cfg):
    ns = Namespace("m", "d", "bfloat16", "x", chunk_tokens=CHUNK)
    manager = SimpleNamespace(get_block_ids=lambda req_id: (list(range(100, 200)),))
    side = SchedulerSide(cfg, [ns], BLOCK, lambda: manager, bytes_per_block=BYTES_PER_BLOCK)
    writer = TieredStore(build_tiers(cfg, ns.id), ns.digest, [LRUPolicy(), LRUPolicy()])
    return side, writer


def stored(side, writer, n, tier_of_chunk):
    """Store an ``n``-token prompt's chunks, chunk i in tier ``tier_of_chunk(i)``."""
    req = request("first", n)
    side.get_num_new_matched_tokens(req, 0)
    meta = side.build_connector_meta(output(new=[("first", 0)], scheduled={"first": n}))
    for i, c in enumerate(meta.saves):
        writer.writer.store(tier_of_chunk(i), c.key, c.parent, [b"x" * 10])  # straight into that tier
    side.request_finished(req)


def measured(side, disk_bytes_per_s, s_per_token=1e-4):
    """Samples as workers send them: disk loads at this bandwidth, a prefill rate."""
    side.planner.observe(
        [
            ("load", t, int(n), 0.001 + n / bw)
            for n in (1e6, 1e7, 1e8)
            for t, bw in (("disk", disk_bytes_per_s), ("dram", 20e9))
        ]
    )
    side.planner.observe(
        [
            ("step", n, attention_pairs(n, c), 0.002 + s_per_token * n)
            for n, c in ((1, 2000), (64, 0), (512, 512), (2048, 0), (1024, 1024))
        ]
    )


def busy(side):
    """Another request ran in the last step: loads below DRAM are asynchronous again."""
    side.build_connector_meta(output(new=[("other", 0)], scheduled={"other": 1}))


def ask(side, req_id, n):
    req = request(req_id, n)
    got = side.get_num_new_matched_tokens(req, 0)
    if got[0]:
        side.update_state_after_alloc(req, Blocks(list(range(20))), got[0])
    return req, got


def test_before_measurements_every_hit_loads(setup):
    side, writer = setup
    stored(side, writer, 1500, lambda i: 1)
    busy(side)
    _, got = ask(side, "b", 1500)
    assert got == (1499, True)
    (load,) = side.build_connector_meta(output()).loads
    assert load.estimate_s is None and load.deadline_s is None


def test_a_disk_hit_loads_before_the_forward_pass_while_nothing_else_runs(setup):
    """Nothing else running: an asynchronous load would stall nobody, only add steps."""
    side, writer = setup
    stored(side, writer, 1500, lambda i: 1)
    measured(side, disk_bytes_per_s=5e12)
    req, got = ask(side, "idle", 1500)
    assert got == (1499, False)
    meta = side.build_connector_meta(output(new=[("idle", 0)], scheduled={"idle": 1}))
    (load,) = meta.loads
    assert not load.asynchronous and 0 < load.estimate_s < load.deadline_s  # still cut short if late
    side.request_finished(req)  # ran, then finished: idle again
    assert ask(side, "next", 1500)[1] == (1499, False)
    busy(side)
    assert ask(side, "busy", 1500)[1] == (1499, True)
    assert side.get_stats().data["plan:load.requests"] == 3


def counts(stats) -> dict:
    """The counts of a scheduler report, without the cost model's rates riding along."""
    return {k: v for k, v in stats.data.items() if not k.startswith("cost:")}


def test_a_slow_tier_is_recomputed_and_a_fast_one_loaded_with_a_deadline(setup):
    side, writer = setup
    stored(side, writer, 1500, lambda i: 1)
    measured(side, disk_bytes_per_s=50e6)  # 12 MiB at 50 MB/s: far slower than 0.15 s of compute
    req, got = ask(side, "slow", 1500)
    assert got == (0, False)
    why = side.explain_finished(req)
    assert [(r["tokens"], r.get("computed")) for r in why] == [([0, 1499], "recompute")]
    side.request_finished(req)
    measured(side, disk_bytes_per_s=5e12)  # the disk got fast: its newer samples dominate
    busy(side)
    req, got = ask(side, "fast", 1500)
    assert got == (1499, True)
    (load,) = side.build_connector_meta(output()).loads
    assert 0 < load.estimate_s < load.deadline_s
    side.request_finished(req)
    assert counts(side.get_stats()) == {
        "plan:recompute.requests": 1,
        "plan:load.requests": 1,
        "miss:recompute:none": 1499,
    }


def test_load_decision_always_loads_what_the_cost_model_would_recompute(tmp_path):
    side, writer = scheduler_and_writer(config(tmp_path, KVCACHE_LOAD_DECISION="always"))
    stored(side, writer, 1500, lambda i: 1)
    measured(side, disk_bytes_per_s=50e6)  # what the cost model recomputes (test above)
    busy(side)
    _, got = ask(side, "slow", 1500)
    assert got == (1499, True)


def test_a_fast_tier_prefix_loads_and_the_slow_rest_is_recomputed(setup):
    side, writer = setup
    stored(side, writer, 1500, lambda i: 0 if i < 2 else 1)  # DRAM holds the first 512 tokens
    measured(side, disk_bytes_per_s=50e6)
    req, got = ask(side, "b", 1500)
    assert got == (512, False)  # a memory copy, before the forward pass
    (load,) = side.build_connector_meta(output()).loads
    assert len(load.chunks) == 2 and load.deadline_s is None
    why = side.explain_finished(req)
    assert [(r["tokens"], r.get("from") or r.get("computed")) for r in why] == [
        ([0, 512], "dram"),
        ([512, 1499], "recompute"),
    ]
    side.request_finished(req)
    assert counts(side.get_stats()) == {"plan:partial.requests": 1, "miss:recompute:none": 1499 - 512}


def test_step_compute_goes_to_the_workers(setup):
    side, _ = setup
    meta = side.build_connector_meta(output(new=[("a", 0)], cached=[("b", 100)], scheduled={"a": 64, "b": 1}))
    assert meta.compute == (65, attention_pairs(64, 0) + attention_pairs(1, 100))
    meta = side.build_connector_meta(output(cached=[("a", 64), ("b", 101)], scheduled={"a": 1, "b": 1}))
    assert meta.compute is None  # decode steps are not timed


# -- worker side ---------------------------------------------------------------------
@pytest.fixture(params=["placed", "copied"])
def worker(tmp_path, request, monkeypatch):
    """A worker with one stored chunk (blocks 0-1); "placed": loads read entries straight
    into the CPU blocks (the CPU build's path), "copied": read, then copied (CUDA, hybrid)."""
    if request.param == "copied":
        monkeypatch.setattr(BlockCopier, "placeable", property(lambda self: False))
    side = WorkerSide(
        config(tmp_path), Namespace("m", "d", "bfloat16", "x", chunk_tokens=CHUNK), num_blocks=8, block_size=BLOCK
    )
    torch.manual_seed(0)
    caches = {f"layer.{i}": torch.randn(8, 2, BLOCK, 2, 8).to(torch.bfloat16) for i in range(2)}
    side.register_kv_caches(caches)
    side.wait_for_save(TieredKVMetadata(saves=[ChunkIO(KEY, None, [0, 1])]))
    side.store.flush(10)
    yield side, caches
    side.shutdown()


def finish(side, timeout=10.0):
    end = time.monotonic() + timeout
    while not side.take_transfer_results()[0]:
        assert time.monotonic() < end
        time.sleep(0.01)
    return side.get_block_ids_with_load_errors()


def test_worker_loads_and_reports_its_time(worker):
    side, caches = worker
    side.start_load_kv(
        TieredKVMetadata(loads=[LoadRequest("r", [ChunkIO(KEY, None, [4, 5])], True, estimate_s=0.5, deadline_s=5.0)])
    )
    assert finish(side) == set()
    for t in caches.values():
        assert torch.equal(t[4:6], t[0:2])  # byte for byte
    (sample,) = side.take_settled().samples
    assert sample[:3] == ("load", "dram", HEADER_SIZE + 2 * 2 * (2 * BLOCK * 2 * 8) * 2)  # 2 layers, 2 blocks
    stats = side.get_stats().data
    assert stats["load:async.loads"] == 1 and stats["load:async.estimated_seconds"] == 0.5
    assert "load:async.cut_short" not in stats


def test_a_synchronous_load_reads_what_no_read_thread_has_started(worker, monkeypatch):
    """The read threads are busy (their futures never start): a synchronous load reads
    and verifies the chunk on its own thread, byte for byte, instead of waiting."""
    from concurrent.futures import Future

    side, caches = worker
    monkeypatch.setattr(side.store, "get_async", lambda key: Future())
    monkeypatch.setattr(side.store, "run_read", lambda fn, *args: Future())
    side.start_load_kv(TieredKVMetadata(loads=[LoadRequest("r", [ChunkIO(KEY, None, [4, 5])], False)]))
    assert side.get_block_ids_with_load_errors() == set()
    for t in caches.values():
        assert torch.equal(t[4:6], t[0:2])
    assert side.take_settled().samples[0][:2] == ("load", "dram")


@pytest.mark.parametrize("layered", [True, False])
def test_a_synchronous_load_leaves_shared_tier_reads_to_the_read_threads(tmp_path, monkeypatch, layered):
    """The loading thread reads local files itself, never a shared-tier chunk (a network
    read it could not stop at the deadline): that one goes to a read thread. Layer-wise
    (``cache.vllm.layered``) the forward thread takes no shared-tier layer either."""
    import threading

    side = WorkerSide(
        config(tmp_path, KVCACHE_SHARED_URL=f"file://{tmp_path}/l3", KVCACHE_LAYERED_LOADS=str(layered).lower()),
        Namespace("m", "d", "bfloat16", "x", chunk_tokens=CHUNK),
        num_blocks=8,
        block_size=BLOCK,
    )
    caches = {f"layer.{i}": torch.randn(8, 2, BLOCK, 2, 8).to(torch.bfloat16) for i in range(2)}
    side.register_kv_caches(caches)
    side.wait_for_save(TieredKVMetadata(saves=[ChunkIO(KEY, None, [0, 1], shared=True)]))
    side.store.flush(10)
    for tier in side.store.tiers[: side.store.n_local]:
        tier.delete(KEY)
    assert side.store.tiers[-1].contains(KEY)
    shared = side.store.tiers[-1]
    readers, read_with, run_read, submitted = [], shared.read_with, side.store.run_read, []
    monkeypatch.setattr(
        shared, "read_with", lambda key, use: (readers.append(threading.current_thread().name), read_with(key, use))[1]
    )

    def first_never_starts(fn, *args):
        # The read threads never start the chunk's first read: the loading thread takes
        # it, and must hand its shared-tier read back to them.
        submitted.append(fn)
        return Future() if len(submitted) == 1 else run_read(fn, *args)

    monkeypatch.setattr(side.store, "run_read", first_never_starts)
    side.start_load_kv(
        TieredKVMetadata(
            loads=[LoadRequest("r", [ChunkIO(KEY, None, [4, 5])], False, compute_tokens=MIN_COMPUTE_TOKENS)]
        )
    )
    assert side.get_block_ids_with_load_errors() == set()
    for t in caches.values():
        assert torch.equal(t[4:6], t[0:2])  # read in place from the shared tier's file
    if layered:  # the never-started first layer, handed back, then the second layer
        side.wait_for_layer_load("layer.1")
    assert len(submitted) == 2 + layered and readers and all(name.startswith("kvcache-read") for name in readers)
    assert side.take_settled().samples[0][:2] == ("load", "shared")
    side.shutdown()


def test_a_load_past_its_deadline_is_cut_short(worker, monkeypatch):
    side, caches = worker
    before = {n: t[4:6].clone() for n, t in caches.items()}
    slow = ThreadPoolExecutor(1)

    def slow_get(key):  # a tier far slower than its estimate
        return slow.submit(lambda: (time.sleep(0.5), side.store.get(key))[1])

    def slow_read(fn, *args):
        return slow.submit(lambda: (time.sleep(0.5), fn(*args))[1])

    monkeypatch.setattr(side.store, "get_async", slow_get)
    monkeypatch.setattr(side.store, "run_read", slow_read)
    side.start_load_kv(
        TieredKVMetadata(loads=[LoadRequest("r", [ChunkIO(KEY, None, [4, 5])], True, estimate_s=0.01, deadline_s=0.05)])
    )
    assert finish(side) == {4, 5}  # vLLM recomputes them
    for n, t in caches.items():
        assert torch.equal(t[4:6], before[n])  # nothing written into them
    meta = side.take_settled()
    assert (KEY, "recompute", "none") in meta.events and not meta.samples  # no rate from a cut load
    assert side.get_stats().data["load:async.cut_short"] == 1
    slow.shutdown(wait=True)  # the late read has run by now, and wrote nothing
    for n, t in caches.items():
        assert torch.equal(t[4:6], before[n])


def test_forward_passes_are_timed_less_the_loads(worker):
    side, _ = worker
    side.step_begins(TieredKVMetadata(compute=(64, 2048.0)))
    time.sleep(0.02)
    side.wait_for_save(TieredKVMetadata())
    (sample,) = side.take_settled().samples
    assert sample[:3] == ("step", 64, 2048.0) and sample[3] >= 0.02
    side.step_begins(TieredKVMetadata())  # nothing scheduled: nothing timed
    side.wait_for_save(TieredKVMetadata())
    assert side.take_settled() is None


def test_prometheus_names_for_paths_and_modes():
    registry = CollectorRegistry()
    kinds = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    metrics = TieredKVPromMetrics(SimpleNamespace(kv_transfer_config=None), kinds, ["model_name"], {0: ["m"]})
    metrics.observe(
        {
            "plan:partial.requests": 2,
            "load:async.cut_short": 1,
            "load:async.estimated_seconds": 0.5,
            "miss:recompute:none": 700,
        }
    )
    value = registry.get_sample_value
    assert value("kvcache:requests_by_path_total", {"model_name": "m", "path": "partial"}) == 2
    assert value("kvcache:loads_cut_short_total", {"model_name": "m", "mode": "async"}) == 1
    assert value("kvcache:load_estimated_seconds_total", {"model_name": "m", "mode": "async"}) == 0.5
    assert value("kvcache:misses_total", {"model_name": "m", "tier": "none", "cause": "recompute"}) == 700
