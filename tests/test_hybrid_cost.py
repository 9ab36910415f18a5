"""A hybrid model's loads decided by the cost model, without an engine: a sliding-window
hit loads whole or is recomputed (never a prefix its windows cannot serve), priced by
the bytes of the entries it reads, and always asynchronously. The real engine's side is
in ``tests/test_engine_hybrid_cost.py``."""

from types import SimpleNamespace

import pytest

from cache.cost import ChunkCost, PrefillRate, TierRate, attention_pairs, choose
from cache.vllm.hits import load_spans
from cache.vllm.planner import LoadPlanner
from tests.test_groups import LAYOUT, Blocks, hybrid_side, plan, req, run_cold, tokens

B, C = 128, 256
KIND_BYTES = (1 << 20, 3 << 20)  # per block: the full layer, the three sliding layers


def rates(load_bytes_per_s: float, s_per_token: float = 1e-4) -> tuple[dict, PrefillRate]:
    """Fitted rates: 'dram' at a memory copy's speed, 'disk' at ``load_bytes_per_s``."""
    tiers = {"dram": TierRate(), "disk": TierRate()}
    for n in (1e6, 1e7, 1e8):
        tiers["dram"].observe(int(n), 0.001 + n / 20e9)
        tiers["disk"].observe(int(n), 0.001 + n / load_bytes_per_s)
    prefill = PrefillRate()
    for n, c in ((64, 0), (512, 512), (2048, 0), (1024, 1024)):
        prefill.observe(n, attention_pairs(n, c), 0.002 + s_per_token * n)
    return tiers, prefill


def test_a_whole_hit_loads_every_entry_or_none():
    # a fast first chunk and a slow rest: loading only the first chunk is fastest,
    # which a hybrid hit cannot do (the window before its end comes with the rest)
    chunks = [ChunkCost(0, 256, "dram", 2 << 20)] + [
        ChunkCost(256 * i, 256 * (i + 1), "disk", 2 << 20) for i in range(1, 6)
    ]
    tiers, prefill = rates(load_bytes_per_s=2e6)
    assert choose(chunks, 1537, 0, tiers, prefill, {"dram"}).path == "partial"
    whole = choose(chunks, 1537, 0, tiers, prefill, {"dram"}, whole=True)
    assert (whole.path, whole.chunks) == ("recompute", 0)
    tiers, prefill = rates(load_bytes_per_s=5e12)
    whole = choose(chunks, 1537, 0, tiers, prefill, set(), whole=True)
    assert (whole.path, whole.mode) == ("load", "async")
    assert whole.ttft_s < whole.recompute_s and whole.deadline_s is not None


def test_a_hybrid_hit_is_priced_by_the_entries_it_reads():
    hit = plan(6, {4, 5})
    chunks = [SimpleNamespace(start=s, end=e) for s, e in ((i * C, min((i + 1) * C, 1500)) for i in range(6))]
    spans, sizes = load_spans(LAYOUT, hit, chunks, KIND_BYTES)
    assert len(spans) == 8 and spans[-1][1] == hit.hit_end == 1499  # 6 full entries, 2 windows
    assert [e for _, e, _ in spans] == sorted(e for _, e, _ in spans)
    # full entries: two blocks of the full layer; windows: the blocks under the window
    assert sorted(sizes) == [2 << 20] * 6 + [6 << 20] * 2
    assert load_spans(LAYOUT, hit, chunks, ())[1] == [0] * 8  # sizes unknown


@pytest.fixture
def side_and_writer(tmp_path):
    return hybrid_side(tmp_path, kind_bytes=KIND_BYTES)


def measure(side, dram_bytes_per_s: float) -> None:
    """Samples as the workers send them: DRAM loads at this speed, a prefill rate."""
    side.planner.observe([("load", "dram", int(n), 0.001 + n / dram_bytes_per_s) for n in (1e6, 1e7, 1e8)])
    side.planner.observe(
        [
            ("step", n, attention_pairs(n, c), 0.002 + 1e-4 * n)
            for n, c in ((64, 0), (512, 512), (2048, 0), (1024, 1024))
        ]
    )


def issued(side):
    """The loads sent to the workers with the next step."""
    return side.build_connector_meta(
        SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={},
        )
    ).loads


def test_a_hybrid_hit_loads_whole_until_measured(side_and_writer):
    side, writer, blocks = side_and_writer
    p1 = tokens(1, 1500)
    run_cold(side, writer, req("a", p1))
    r = req("b", p1)
    assert side.get_num_new_matched_tokens(r, 0) == (1499, True)
    side.update_state_after_alloc(r, Blocks(blocks), 1499)
    (load,) = issued(side)
    assert load.asynchronous and load.estimate_s is None and load.deadline_s is None


def test_a_slow_tier_makes_a_hybrid_hit_recompute(side_and_writer):
    side, writer, _ = side_and_writer
    p1 = tokens(1, 1500)
    run_cold(side, writer, req("a", p1))
    measure(side, dram_bytes_per_s=1e6)  # ~24 MiB to read at 1 MB/s: far slower than 1,500 tokens' prefill
    slow = req("slow", p1)
    assert side.get_num_new_matched_tokens(slow, 0) == (0, False)
    assert [(x["tokens"], x.get("computed")) for x in side.explain_finished(slow)] == [([0, 1499], "recompute")]
    side.request_finished(slow)
    assert plans(side) == {"plan:recompute.requests": 1}


def test_a_fast_tier_makes_a_hybrid_hit_load_asynchronously(side_and_writer):
    side, writer, blocks = side_and_writer
    p1 = tokens(1, 1500)
    run_cold(side, writer, req("a", p1))
    measure(side, dram_bytes_per_s=1e13)  # far faster than the prefill
    fast = req("fast", p1)
    assert side.get_num_new_matched_tokens(fast, 0) == (1499, True)  # nothing else runs: asynchronous all the same
    side.update_state_after_alloc(fast, Blocks(blocks), 1499)
    (load,) = issued(side)
    assert load.asynchronous and 0 < load.estimate_s < load.deadline_s  # still cut short if late
    assert sum(c.tokens for c in load.chunks) == 1499
    side.request_finished(fast)
    assert plans(side) == {"plan:load.requests": 1}


def plans(side) -> dict:
    return {k: v for k, v in side.get_stats().data.items() if k.startswith("plan:")}


def test_what_an_asynchronous_wait_adds_is_measured_and_priced(side_and_writer):
    """A hybrid hit cannot load synchronously: the wait for its load (engine steps, the
    load thread's share of the cores) is part of its cost. One that took far longer than
    its estimate makes the next hit of that size recompute."""
    side, writer, blocks = side_and_writer
    now = [100.0]
    side.planner = LoadPlanner(side.tier_names, {"dram"}, B, kind_bytes=KIND_BYTES, clock=lambda: now[0])
    p1 = tokens(1, 1500)
    run_cold(side, writer, req("a", p1))
    measure(side, dram_bytes_per_s=1e13)
    first = req("first", p1)
    assert side.get_num_new_matched_tokens(first, 0) == (1499, True)
    side.update_state_after_alloc(first, Blocks(blocks), 1499)
    issued(side)  # the load goes out; the request waits for it
    now[0] += 5.0  # ... five seconds, far past the load's estimate and a 1,500-token prefill
    side.build_connector_meta(
        SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id="first", num_computed_tokens=1499)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={"first": 1},
        )
    )
    side.request_finished(first)
    assert side.planner.round_trip.predict((1.0,)) == pytest.approx(5.0, abs=0.01)
    assert side.get_num_new_matched_tokens(req("second", p1), 0) == (0, False)
