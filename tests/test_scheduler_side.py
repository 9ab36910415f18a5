"""Scheduler-side decisions with stand-in requests: chunk cuts, hits, partial hits, saves."""

from types import SimpleNamespace

import numpy as np
import pytest

from cache.config import build_cache_config
from cache.connector.scheduler import SchedulerSide
from cache.keys import Namespace
from cache.store import TieredStore
from cache.policy import LRUPolicy
from cache.tiers import make_tiers

BLOCK, CHUNK = 128, 256


class Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


@pytest.fixture
def setup(tmp_path):
    cfg = build_cache_config({"KVCACHE_CPU_PATH": str(tmp_path / "shm"), "KVCACHE_CPU_SIZE": "16MiB",
                              "KVCACHE_DISK_PATH": str(tmp_path / "disk"), "KVCACHE_DISK_SIZE": "16MiB"})
    ns = Namespace("m", "d", "bfloat16", "x", chunk_tokens=CHUNK)
    manager = SimpleNamespace(get_block_ids=lambda req_id: (list(range(100, 200)),))
    side = SchedulerSide(cfg, [ns], BLOCK, lambda: manager)
    writer = TieredStore(make_tiers(cfg, ns.id), ns.digest, [LRUPolicy(), LRUPolicy()])
    return side, writer


def request(req_id, n, seed=0):
    toks = list(np.random.default_rng(seed).integers(0, 250, n))
    return SimpleNamespace(request_id=req_id, prompt_token_ids=toks, all_token_ids=toks,
                           lora_request=None, mm_features=None, prompt_embeds=None)


def output(new=(), cached=(), scheduled=None):
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                              num_computed_tokens=[c for _, c in cached]),
        num_scheduled_tokens=scheduled or {})


def store_saves(writer, meta):
    for c in meta.saves:
        writer.put(c.key, c.parent, "uint8", (4,), np.zeros(4, np.uint8))
    writer.flush(10)


def test_cuts_whole_chunks_and_a_block_aligned_tail(setup):
    side, _ = setup
    st = side._state(request("a", 1500))
    assert [(c.start, c.end) for c in st.lookup] == [(0, 256), (256, 512), (512, 768), (768, 1024),
                                                     (1024, 1280), (1280, 1408)]
    assert [(c.start, c.end) for c in st.saves][-1] == (1280, 1408)
    # a prompt that ends exactly on a chunk boundary also saves that whole chunk
    st = side._state(request("b", 1024))
    assert [(c.start, c.end) for c in st.lookup][-1] == (768, 896)
    assert (768, 1024) in [(c.start, c.end) for c in st.saves]
    # shorter than a block: nothing to look up or save
    st = side._state(request("c", 100))
    assert st.lookup == [] and st.saves == []


def test_miss_save_then_hit_and_partial_hit(setup):
    side, writer = setup
    req = request("a", 1500)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    # prefill in two steps (chunked prefill): saves follow the computed tokens
    meta = side.build_connector_meta(output(new=[("a", 0)], scheduled={"a": 600}))
    assert [len(c.block_ids) for c in meta.saves] == [2, 2]
    store_saves(writer, meta)
    meta = side.build_connector_meta(output(cached=[("a", 600)], scheduled={"a": 900}))
    assert len(meta.saves) == 4  # chunks 2-4 and the tail
    store_saves(writer, meta)
    assert side.request_finished(req) == {}

    again = request("b", 1500)
    assert side.get_num_new_matched_tokens(again, 0) == (1408, False)  # all in DRAM: sync
    # vLLM's own prefix cache already had the first 384 tokens: load only the rest
    assert side.get_num_new_matched_tokens(again, 384) == (1408 - 384, False)
    side.update_state_after_alloc(again, Blocks(list(range(12))), 1408 - 384)
    meta = side.build_connector_meta(output())
    (load,) = meta.loads
    assert meta.upcoming == [c.key for c in side.requests["b"].lookup]  # protected until loaded
    assert load.chunks[0].first == 1 and load.chunks[0].block_ids == [3]
    assert [b for c in load.chunks for b in c.block_ids] == list(range(3, 11))
    assert side.request_finished(again) == {"dram": 1408 - 384}

    other = request("c", 1500, seed=1)
    other.prompt_token_ids = req.prompt_token_ids[:520] + other.prompt_token_ids[520:]
    assert side.get_num_new_matched_tokens(other, 0) == (512, False)


def test_disk_only_hits_load_asynchronously(setup):
    side, writer = setup
    req = request("a", 700)
    side.get_num_new_matched_tokens(req, 0)
    meta = side.build_connector_meta(output(new=[("a", 0)], scheduled={"a": 700}))
    for c in meta.saves:  # written straight to disk
        writer._store(1, c.key, c.parent, [b"x" * 10])
    assert side.get_num_new_matched_tokens(request("b", 700), 0) == (640, True)


def test_nothing_saved_twice(setup):
    side, writer = setup
    side.get_num_new_matched_tokens(request("a", 600), 0)
    meta = side.build_connector_meta(output(new=[("a", 0)], scheduled={"a": 600}))
    store_saves(writer, meta)
    side.get_num_new_matched_tokens(request("b", 600), 0)
    meta = side.build_connector_meta(output(new=[("b", 0)], scheduled={"b": 600}))
    assert meta.saves == []
