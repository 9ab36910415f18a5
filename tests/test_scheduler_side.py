"""Scheduler-side decisions with stand-in requests: chunk cuts, hits, partial hits, saves."""

from types import SimpleNamespace

import numpy as np
import pytest

from cache.assembly import build_tiers
from cache.config import build_cache_config
from cache.keys import Namespace
from cache.policy import LRUPolicy
from cache.store import TieredStore
from cache.vllm.scheduler import SchedulerSide

BLOCK, CHUNK = 128, 256


class Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


@pytest.fixture
def setup(tmp_path):
    cfg = build_cache_config(
        {
            "KVCACHE_DRAM_PATH": str(tmp_path / "shm"),
            "KVCACHE_DRAM_SIZE": "16MiB",
            "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
            "KVCACHE_DISK_SIZE": "16MiB",
        }
    )
    ns = Namespace("m", "d", "bfloat16", "x", chunk_tokens=CHUNK)
    manager = SimpleNamespace(get_block_ids=lambda req_id: (list(range(100, 200)),))
    side = SchedulerSide(cfg, [ns], BLOCK, lambda: manager)
    writer = TieredStore(build_tiers(cfg, ns.id), ns.digest, [LRUPolicy(), LRUPolicy()])
    return side, writer


def request(req_id, n, seed=0):
    toks = list(np.random.default_rng(seed).integers(0, 250, n))
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=toks,
        all_token_ids=toks,
        lora_request=None,
        mm_features=None,
        prompt_embeds=None,
    )


def output(new=(), cached=(), scheduled=None):
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached], num_computed_tokens=[c for _, c in cached]
        ),
        num_scheduled_tokens=scheduled or {},
    )


def state(side, req):
    """The scheduler's state of ``req`` (its chunks), made as a lookup makes it."""
    return side._state(req)  # noqa: SLF001 (issue 29 items 1-3 reshape SchedulerSide; chunking has no public seam yet)


def write_to(writer, i, c):
    """Write chunk ``c`` straight into local tier ``i`` (the store's own placement step)."""
    writer.writer.store(i, c.key, c.parent, [b"x" * 10])  # straight into tier i


def store_saves(writer, meta):
    for c in meta.saves:
        writer.put(c.key, c.parent, "uint8", (4,), np.zeros(4, np.uint8))
    writer.flush(10)


def test_cuts_whole_chunks_and_an_exact_tail(setup):
    side, _ = setup
    st = state(side, request("a", 1500))
    assert [(c.start, c.end) for c in st.chunks] == [
        (0, 256),
        (256, 512),
        (512, 768),
        (768, 1024),
        (1024, 1280),
        (1280, 1500),
    ]
    # a prompt that ends exactly on a chunk boundary: whole chunks only
    st = state(side, request("b", 1024))
    assert [(c.start, c.end) for c in st.chunks][-1] == (768, 1024)
    # a one-token tail would load nothing: left out
    assert [(c.start, c.end) for c in state(side, request("c", 1025)).chunks][-1] == (768, 1024)
    # shorter than a block: one tail chunk
    assert [(c.start, c.end) for c in state(side, request("d", 100)).chunks] == [(0, 100)]
    assert state(side, request("e", 1)).chunks == []
    # the tail is keyed by exactly its tokens: a longer prompt shares the whole chunks only
    a, longer = state(side, request("a", 1500)).chunks, state(side, request("f", 1600)).chunks
    assert [c.key for c in a[:5]] == [c.key for c in longer[:5]] and a[5].key != longer[5].key


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
    assert meta.saves[-1].block_ids == list(range(110, 112))  # [1280, 1500): blocks 10 and 11 (partly)
    store_saves(writer, meta)
    assert side.request_finished(req) == {}

    again = request("b", 1500)
    assert side.get_num_new_matched_tokens(again, 0) == (1499, False)  # all in DRAM: sync
    # vLLM's own prefix cache already had the first 384 tokens: load only the rest
    assert side.get_num_new_matched_tokens(again, 384) == (1499 - 384, False)
    side.update_state_after_alloc(again, Blocks(list(range(12))), 1499 - 384)
    meta = side.build_connector_meta(output())
    (load,) = meta.loads
    assert meta.upcoming == [c.key for c in side.requests["b"].chunks]  # protected until loaded
    assert load.chunks[0].skip_blocks == 1 and load.chunks[0].block_ids == [3]
    assert [b for c in load.chunks for b in c.block_ids] == list(range(3, 12))
    assert side.request_finished(again) == {"dram": 1499 - 384}

    # the last token is computed, not loaded: a block holding only it is not loaded into
    edge = request("e", 1409, seed=2)
    side.get_num_new_matched_tokens(edge, 0)
    store_saves(writer, side.build_connector_meta(output(new=[("e", 0)], scheduled={"e": 1409})))
    side.request_finished(edge)
    again = request("f", 1409, seed=2)
    assert side.get_num_new_matched_tokens(again, 0) == (1408, False)
    side.update_state_after_alloc(again, Blocks(list(range(11))), 1408)
    (load,) = side.build_connector_meta(output()).loads
    assert load.chunks[-1].block_ids == [10]
    assert load.compute_tokens == 1  # what the forward pass computes after it (cache.vllm.layered)

    other = request("c", 1500, seed=1)
    other.prompt_token_ids = req.prompt_token_ids[:520] + other.prompt_token_ids[520:]
    assert side.get_num_new_matched_tokens(other, 0) == (512, False)  # the whole chunks it shares


def test_a_longer_prompt_continues_from_the_tail_an_earlier_one_saved(setup):
    """The next turn of a conversation (the last prompt and more) loads the last prompt
    whole, its tail too (``cache.vllm.tails``), not only its whole chunks; the rest of
    that chunk is computed and then saved whole, under the chunk's own key."""
    side, writer = setup
    first = request("a", 1500)  # five whole chunks and a 220-token tail
    side.get_num_new_matched_tokens(first, 0)
    store_saves(writer, saved := side.build_connector_meta(output(new=[("a", 0)], scheduled={"a": 1500})))
    side.saves_settled([c.key for c in saved.saves])
    side.request_finished(first)

    turn = request("b", 1900, seed=7)
    turn.prompt_token_ids = first.prompt_token_ids + turn.prompt_token_ids[1500:]
    assert side.get_num_new_matched_tokens(turn, 0) == (1500, False)  # not 1280
    side.update_state_after_alloc(turn, Blocks(list(range(15))), 1500)
    meta = side.build_connector_meta(output(new=[("b", 1500)], scheduled={"b": 400}))
    (load,) = meta.loads
    assert load.chunks[-1].key == state(side, first).chunks[-1].key  # the tail's own entry
    assert load.chunks[-1].block_ids == [10, 11]  # [1280, 1500): block 11 partly
    assert load.compute_tokens == 400
    assert [c.key for c in meta.saves] == [c.key for c in side.requests["b"].chunks[5:]]  # own keys
    explained = side.explain_finished(turn)
    assert explained[0] == {"tokens": [0, 1500], "from": "dram"} and explained[1]["tokens"] == [1500, 1899]
    assert side.request_finished(turn) == {"dram": 1500}
    # the tail's load fails: the explanation says so of the tail's tokens, and loaded counts only the rest
    side.saves_settled([c.key for c in meta.saves])  # (refused: not stored)
    again = request("e", 1900)
    again.prompt_token_ids = turn.prompt_token_ids
    assert side.get_num_new_matched_tokens(again, 0) == (1500, False)
    side.update_state_after_alloc(again, Blocks(list(range(15))), 1500)
    side.build_connector_meta(output())
    side.loads_failed({11})
    explained = side.explain_finished(again)
    assert explained[0] == {"tokens": [0, 1280], "from": "dram"}
    assert explained[1]["tokens"] == [1280, 1500] and "computed" in explained[1], explained
    assert side.request_finished(again) == {"dram": 1280}

    # a prompt that repeats the tail's first tokens but not all of it: the candidate misses
    other = request("c", 1900, seed=8)
    other.prompt_token_ids = first.prompt_token_ids[:1400] + other.prompt_token_ids[1400:]
    assert side.get_num_new_matched_tokens(other, 0) == (1280, False)
    # another salt's prompt with the same tokens: its keys differ, nothing found
    salted = request("d", 1900, seed=7)
    salted.prompt_token_ids, salted.cache_salt = turn.prompt_token_ids, "tenant-b"
    assert side.get_num_new_matched_tokens(salted, 0) == (0, False)


def test_a_longer_prompt_waits_for_the_tail_an_earlier_one_is_still_saving(setup):
    """The next turn sent as soon as the last one's answer came: the last prompt's whole
    chunks are stored, its tail still being written. The turn waits for the tail, as for
    any chunk in flight, then loads it, instead of computing it again."""
    side, writer = setup
    first = request("a", 1500)
    side.get_num_new_matched_tokens(first, 0)
    meta = side.build_connector_meta(output(new=[("a", 0)], scheduled={"a": 1500}))
    *whole, tail = meta.saves
    store_saves(writer, SimpleNamespace(saves=whole))
    side.saves_settled([c.key for c in whole])
    side.request_finished(first)

    turn = request("b", 1900, seed=7)
    turn.prompt_token_ids = first.prompt_token_ids + turn.prompt_token_ids[1500:]
    assert side.get_num_new_matched_tokens(turn, 0) == (None, False)  # not (1280, False)
    store_saves(writer, SimpleNamespace(saves=[tail]))
    side.saves_settled([tail.key])
    assert side.get_num_new_matched_tokens(turn, 0) == (1500, False)


def test_disk_only_hits_load_asynchronously(setup):
    side, writer = setup
    req = request("a", 700)
    side.get_num_new_matched_tokens(req, 0)
    meta = side.build_connector_meta(output(new=[("a", 0)], scheduled={"a": 700}))
    for c in meta.saves:  # written straight to disk
        write_to(writer, 1, c)
    assert side.get_num_new_matched_tokens(request("b", 700), 0) == (699, True)


def test_nothing_saved_twice(setup):
    side, writer = setup
    side.get_num_new_matched_tokens(request("a", 600), 0)
    meta = side.build_connector_meta(output(new=[("a", 0)], scheduled={"a": 600}))
    store_saves(writer, meta)
    side.get_num_new_matched_tokens(request("b", 600), 0)
    meta = side.build_connector_meta(output(new=[("b", 0)], scheduled={"b": 600}))
    assert meta.saves == []


def test_waits_for_saves_in_flight_until_every_rank_settles_them(tmp_path, monkeypatch):
    """The same prompt again before write-behind stored its chunks (the warm tool's second
    pass): deferred until every rank reports the saves settled, not served half."""
    cfg = build_cache_config(
        {
            "KVCACHE_DRAM_PATH": str(tmp_path / "shm"),
            "KVCACHE_DRAM_SIZE": "16MiB",
            "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
            "KVCACHE_DISK_SIZE": "16MiB",
        }
    )
    ranks = [Namespace("m", "d", "bfloat16", "x", chunk_tokens=CHUNK, rank=r) for r in range(2)]
    manager = SimpleNamespace(get_block_ids=lambda req_id: (list(range(100, 200)),))
    side = SchedulerSide(cfg, ranks, BLOCK, lambda: manager)
    writers = [TieredStore(build_tiers(cfg, ns.id), ns.digest, [LRUPolicy(), LRUPolicy()]) for ns in ranks]

    side.get_num_new_matched_tokens(request("a", 700), 0)
    meta = side.build_connector_meta(output(new=[("a", 0)], scheduled={"a": 700}))
    keys = [c.key for c in meta.saves]
    assert len(keys) == 3
    assert side.get_num_new_matched_tokens(request("b", 700), 0) == (None, False)  # nothing stored yet
    for w in writers:
        store_saves(w, meta)
    side.saves_settled(keys)  # rank 0 only: rank 1's report is still to come
    assert side.get_num_new_matched_tokens(request("b", 700), 0) == (699, False)  # both stored: found
    side.saves_settled(keys)

    # a save that settles without being stored (refused, dropped): no more waiting
    side.get_num_new_matched_tokens(request("c", 700, seed=3), 0)
    meta = side.build_connector_meta(output(new=[("c", 0)], scheduled={"c": 700}))
    assert side.get_num_new_matched_tokens(request("d", 700, seed=3), 0) == (None, False)
    side.saves_settled([c.key for c in meta.saves] * 2)
    assert side.get_num_new_matched_tokens(request("d", 700, seed=3), 0) == (0, False)

    # the wait counts from the waiting request, not from the save: a save sent before a
    # forward pass longer than the wait still defers a request that arrives after it
    import cache.vllm.saves as sched

    clock = [sched.time.monotonic()]
    monkeypatch.setattr(sched.time, "monotonic", lambda: clock[0])
    side.get_num_new_matched_tokens(request("e", 700, seed=4), 0)
    side.build_connector_meta(output(new=[("e", 0)], scheduled={"e": 700}))
    clock[0] += sched.SAVE_WAIT_MAX_S + 1
    f = request("f", 700, seed=4)
    assert side.get_num_new_matched_tokens(f, 0) == (None, False)
    # a report that never comes: the request's wait ends at its deadline
    clock[0] += sched.SAVE_WAIT_MAX_S / 2
    assert side.get_num_new_matched_tokens(f, 0) == (None, False)
    clock[0] += sched.SAVE_WAIT_MAX_S / 2 + 0.01
    assert side.get_num_new_matched_tokens(f, 0) == (0, False)
    # and the lost report is forgotten in the end
    clock[0] += sched.SAVE_REPORT_LOST_S
    side.build_connector_meta(output())
    assert side.saves.in_flight == {}


def test_a_request_can_opt_out_of_loading_or_saving(setup):
    side, writer = setup
    quiet = request("a", 700)
    quiet.kv_transfer_params = {"kvcache_save": False}
    side.get_num_new_matched_tokens(quiet, 0)
    assert side.build_connector_meta(output(new=[("a", 0)], scheduled={"a": 700})).saves == []
    side.get_num_new_matched_tokens(request("b", 700), 0)
    store_saves(writer, side.build_connector_meta(output(new=[("b", 0)], scheduled={"b": 700})))
    assert side.get_num_new_matched_tokens(request("c", 700), 0) == (699, False)
    no_load = request("d", 700)
    no_load.kv_transfer_params = {"kvcache_load": False}
    assert side.get_num_new_matched_tokens(no_load, 0) == (0, False)
