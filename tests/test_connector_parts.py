"""What the connector reports to vLLM, checked with vLLM's own receiving code where it has
some: transfer results taken in one piece, counters of requests reported by one rank
(``KVOutputAggregator`` sums the workers'), hit sources vLLM's prefix-cache stats take,
and the cache off under context parallelism."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from cache.assembly import build_tiers
from cache.policy import LRUPolicy
from cache.store import TieredStore
from cache.vllm.connector import hit_sources
from cache.vllm.metadata import ChunkIO, LoadRequest, TieredKVMetadata
from cache.vllm.namespace import engine_namespace, weights_id
from cache.vllm.off import CacheOff
from tests.test_load_costs import stored
from tests.test_scheduler_side import Blocks, request
from tests.vllm_harness import (
    CHUNK,
    NUM_BLOCKS,
    connector,
    engine_config,
    full_attention,
    kv_caches,
    sliding_and_full,
)

WORKER, SCHEDULER = KVConnectorRole.WORKER, KVConnectorRole.SCHEDULER
KEY = "ef" * 16


class InterleavingLock:
    """A lock that runs ``then`` once, right after ``thread`` first releases it: another
    thread's work lands exactly between two of that thread's lock acquisitions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.thread, self.then = None, None

    def __enter__(self):
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()
        if self.then is not None and threading.current_thread() is self.thread:
            then, self.then = self.then, None
            then()


def test_a_load_failing_while_results_are_collected_is_reported_failed(tmp_path, monkeypatch):
    """A hybrid model's load fails as a whole (vLLM then recomputes the request); if it
    ends while vLLM collects the step's transfer results, it must be reported failed in
    the same results that report it finished, never finished alone (vLLM would compute on
    the blocks it left unfilled)."""
    conn = connector(monkeypatch, engine_config(tmp_path), WORKER, sliding_and_full())
    conn.register_kv_caches(kv_caches(sliding_and_full()))
    side = conn.worker_side
    assert side.layout.hybrid
    entry, placed = Future(), Future()  # the chunk's read, in flight, by either load path
    monkeypatch.setattr(side.store, "get_async", lambda key: entry)
    monkeypatch.setattr(side.store, "run_read", lambda fn, *args: placed)
    lock = InterleavingLock()
    monkeypatch.setattr(side, "_lock", lock)

    def the_load_fails_now():
        entry.set_result(None)  # gone from the tier
        placed.set_result(("failed", None))
        for t in threading.enumerate():
            if t.name == "kvcache-load-h":
                t.join(30)
                assert not t.is_alive()

    conn.bind_connector_metadata(TieredKVMetadata(loads=[LoadRequest("h", [ChunkIO(KEY, None, [3])], True)]))
    conn.start_load_kv(None)
    lock.thread, lock.then = threading.current_thread(), the_load_fails_now
    reports = [conn.get_transfer_results(set()) for _ in range(2)]
    assert lock.then is None  # the load ended inside the first call
    assert [(r.finished_recving, r.failed_recving) for r in reports if r.finished_recving] == [({"h"}, {"h"})]
    conn.shutdown()


def test_counters_of_requests_are_reported_once_whatever_the_ranks(tmp_path, monkeypatch):
    """Two tensor-parallel ranks each save and load their part of one chunk; vLLM sums
    the workers' stats (``KVOutputAggregator``): each rank's reads and writes count, the
    request's loaded tokens and its load once."""
    outputs, conns = [], []
    for rank in (0, 1):
        conn = connector(monkeypatch, engine_config(tmp_path, tp=2), WORKER, full_attention(), rank=rank)
        conns.append(conn)
        conn.register_kv_caches(kv_caches(full_attention(), seed=rank))
        conn.bind_connector_metadata(TieredKVMetadata(saves=[ChunkIO(KEY, None, [0, 1])]))
        conn.wait_for_save()
        conn.worker_side.store.flush(10)
        conn.bind_connector_metadata(
            TieredKVMetadata(loads=[LoadRequest("r", [ChunkIO(KEY, None, [4, 5], tokens=31)], False)])
        )
        conn.start_load_kv(None)
        conn.wait_for_save()
        assert conn.get_block_ids_with_load_errors() == set()
        kv = KVConnectorOutput(kv_connector_stats=conn.get_kv_connector_stats())
        outputs.append(ModelRunnerOutput.with_kv_conn_output_only(kv))
    data = KVOutputAggregator(2).aggregate(outputs).kv_connector_output.kv_connector_stats.data
    assert data["dram.tokens_loaded"] == 31 and data["load:sync.loads"] == 1
    assert data["dram.hits"] == 2 and data["dram.writes"] == 2
    for conn in conns:
        conn.shutdown()


@pytest.mark.parametrize("dcp, pcp", [(2, 1), (1, 2)])
def test_context_parallelism_turns_the_cache_off_with_one_log_line(tmp_path, monkeypatch, caplog, dcp, pcp):
    with caplog.at_level(logging.INFO, logger="cache.vllm.connector"):
        scheduler = connector(monkeypatch, engine_config(tmp_path, dcp=dcp, pcp=pcp, tp=2), SCHEDULER, full_attention())
        worker = connector(monkeypatch, engine_config(tmp_path, dcp=dcp, pcp=pcp, tp=2), WORKER, full_attention())
    assert isinstance(scheduler.scheduler_side, CacheOff) and isinstance(worker.worker_side, CacheOff)
    (line,) = [r.getMessage() for r in caplog.records if "OFF" in r.getMessage()]
    assert line.startswith(f"kvcache: OFF for model test-model: context parallelism (decode {dcp}, prefill {pcp})")
    assert f"{16 * dcp}-token blocks" in line and line.endswith("vLLM serves it without the tiered KV cache")
    assert scheduler.get_num_new_matched_tokens(request("a", 100), 0) == (0, False)
    assert worker.get_kv_connector_stats().data["all.enabled"] == 0
    served = connector(monkeypatch, engine_config(tmp_path, tp=2), SCHEDULER, full_attention())
    assert not isinstance(served.scheduler_side, CacheOff)


def test_hits_are_labelled_by_the_tier_that_serves_them(tmp_path, monkeypatch):
    """``vllm:prompt_tokens_cached_by_source``: vLLM asks the connector after planning a
    load, and takes its answer when the counts add up to the hit."""
    vllm_config = engine_config(tmp_path)
    conn = connector(monkeypatch, vllm_config, SCHEDULER, full_attention())
    conn.bind_kv_cache_manager(
        SimpleNamespace(block_pool=None, get_block_ids=lambda req_id: (list(range(NUM_BLOCKS)),))
    )
    side = conn.scheduler_side
    ns = engine_namespace(vllm_config, full_attention(), CHUNK, 0, weights=weights_id(vllm_config, side.config))
    writer = TieredStore(build_tiers(side.config, ns.id), ns.digest, [LRUPolicy(), LRUPolicy()])
    n = 3 * CHUNK + 5
    stored(side, writer, n, lambda i: 0 if i == 0 else 1)  # the first chunk in DRAM, the rest on disk
    req = request("b", n)
    hit, _ = conn.get_num_new_matched_tokens(req, 0)
    assert hit == n - 1
    conn.update_state_after_alloc(req, Blocks(list(range(NUM_BLOCKS))), hit)
    sources = conn.get_external_cache_hit_sources(req, hit)
    assert sources == {CacheHitSource.HOST: CHUNK, CacheHitSource.DISK: hit - CHUNK}
    stats = PrefixCacheStats()
    stats.record(num_tokens=n, num_hits=hit, preempted=False, hits_by_source=sources)
    assert stats.hits_by_source == sources  # taken as it is, not relabelled external_unspecified
    assert conn.get_external_cache_hit_sources(request("nothing", 10), 0) == {}


def test_a_remote_tier_or_a_count_that_does_not_add_up_is_unspecified():
    unspecified = CacheHitSource.EXTERNAL_UNSPECIFIED
    assert hit_sources({"dram": 5, "shared": 10}, 15) == {CacheHitSource.HOST: 5, unspecified: 10}
    assert hit_sources({"dram": 5}, 7) == {unspecified: 7}
    assert hit_sources({}, 0) == {}
