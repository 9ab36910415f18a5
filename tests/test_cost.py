"""The cost model (cache.cost) and the scheduler's planner on top of it, with injected clocks."""

import pytest

from cache.cost import DEADLINE_MARGIN_S, ChunkCost, Fit, PrefillRate, TierRate, attention_pairs, choose, deadline
from cache.vllm.planner import RATES_EVERY_S, LoadPlanner


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_fit_recovers_a_linear_law_and_forgets_old_samples():
    clock = Clock()
    fit = Fit(2, clock)
    assert fit.predict((1, 5)) is None
    for x in (1, 2, 4, 8):
        fit.add((1, x), 0.5 + 2 * x)
    assert fit.predict((1, 10)) == pytest.approx(20.5)
    # the machine got twice as slow: after a while the new samples dominate
    clock.t += 3600
    for x in (1, 2, 4, 8):
        fit.add((1, x), 1 + 4 * x)
    assert fit.predict((1, 10)) == pytest.approx(41, rel=0.01)


def test_fit_never_goes_negative():
    fit = Fit(2, Clock())
    for x, y in ((1, 1.0), (2, 1.9), (3, 3.1), (10, 10.0)):
        fit.add((1, x), y)  # a law through the origin: no negative intercept
    w = fit.weights()
    assert (w >= 0).all() and fit.predict((1, 5)) == pytest.approx(5, rel=0.05)


def test_tier_rate_is_latency_plus_bytes_over_bandwidth():
    rate = TierRate(Clock())
    assert rate.seconds(1000) is None and rate.seconds(0) == 0
    for n in (10e6, 50e6, 100e6):
        rate.observe(int(n), 0.002 + n / 1e9)
    assert rate.bandwidth == pytest.approx(1e9, rel=1e-6)
    assert rate.seconds(200_000_000) == pytest.approx(0.202)


def prefill(per_token=1e-4, per_pair=1e-8, overhead=0.01):
    p = PrefillRate(Clock())
    for new, cached in ((1, 8000), (512, 0), (1024, 1024), (4096, 0), (2048, 6000), (64, 100)):
        pairs = attention_pairs(new, cached)
        p.observe(new, pairs, overhead + per_token * new + per_pair * pairs)
    return p


def test_prefill_rate_prices_a_range_with_its_context():
    p = prefill()
    assert p.seconds(1000, 0) == pytest.approx(1000 * 1e-4 + 1e-8 * 1000 * 500)
    assert p.seconds(1000, 7000) > p.seconds(1000, 0)  # the same tokens after a long prefix cost more
    assert p.seconds(0, 5) == 0


def tiers(**bandwidths):
    out = {}
    for name, bw in bandwidths.items():
        out[name] = TierRate(Clock())
        for n in (1e6, 1e7, 1e8):
            out[name].observe(int(n), 0.001 + n / bw)
    return out


CHUNK, BYTES_PER_TOKEN = 256, 18432


def found(n_tokens, tier, prefix=None):
    """Chunks of an ``n_tokens`` prompt found in ``tier`` (all but the last token)."""
    end = prefix if prefix is not None else n_tokens - 1
    out = []
    for s in range(0, end, CHUNK):
        e = min(s + CHUNK, end)
        out.append(ChunkCost(s, e, tier, (e - s) * BYTES_PER_TOKEN))
    return out


def test_without_measurements_everything_is_loaded():
    plan = choose(found(4096, "disk"), 4096, 0, tiers(), PrefillRate(Clock()), {"dram"})
    assert (plan.chunks, plan.mode, plan.deadline_s, plan.path) == (16, "async", None, "load")
    plan = choose(found(4096, "dram"), 4096, 0, tiers(), PrefillRate(Clock()), {"dram"})
    assert plan.mode == "sync" and plan.path == "load"


def test_fast_tier_full_hit_loads_everything():
    plan = choose(found(8192, "dram"), 8192, 0, tiers(dram=10e9), prefill(), {"dram"})
    assert plan.path == "load" and plan.mode == "sync"
    assert plan.ttft_s < plan.recompute_s / 10
    plan = choose(found(8192, "disk"), 8192, 0, tiers(disk=1e9), prefill(), {"dram"})
    assert plan.path == "load" and plan.mode == "async" and plan.deadline_s < plan.recompute_s


def test_a_slow_tier_loses_to_recompute():
    chunks = found(4096, "shared")
    p = prefill()
    recompute = p.seconds(4096, 0)
    nbytes = sum(c.nbytes for c in chunks)
    for times in (1.2, 3, 100):  # loading takes this many times recomputing
        plan = choose(chunks, 4096, 0, tiers(shared=nbytes / (times * recompute)), p, {"dram"})
        assert plan.path == "recompute" and plan.chunks == 0 and plan.ttft_s == pytest.approx(recompute)
    plan = choose(chunks, 4096, 0, tiers(shared=nbytes / (0.5 * recompute)), p, {"dram"})
    assert plan.path == "load" and plan.ttft_s < 0.6 * recompute
    assert plan.estimate_s < plan.deadline_s <= recompute + DEADLINE_MARGIN_S  # never waits past recompute


def test_a_prefix_pays_when_its_tier_is_fast_and_the_rest_slow():
    """DRAM holds the first chunks, the slow shared tier the rest: load the DRAM part."""
    p = prefill()
    chunks = found(4096, "dram", prefix=2048) + [
        ChunkCost(c.start, c.end, "shared", c.nbytes) for c in found(4096, "shared")[8:]
    ]
    nbytes = sum(c.nbytes for c in chunks[8:])
    rates = {**tiers(dram=10e9), **tiers(shared=nbytes / (5 * p.seconds(4096, 0)))}
    plan = choose(chunks, 4096, 0, rates, p, {"dram"})
    assert (plan.path, plan.chunks, plan.mode, plan.deadline_s) == ("partial", 8, "sync", None)
    assert plan.ttft_s < plan.recompute_s


def test_a_loaded_prefix_of_vllm_counts_as_computed():
    """Tokens vLLM's own prefix cache holds are neither loaded nor recomputed."""
    p = prefill()
    chunks = found(4096, "disk")[8:]
    plan = choose(chunks, 4096, 2048, tiers(disk=1e9), p, {"dram"})
    assert plan.recompute_s == pytest.approx(p.seconds(2048, 2048))


def test_deadline_has_slack_but_never_exceeds_recompute():
    m = DEADLINE_MARGIN_S
    assert deadline(0.1, None) == pytest.approx(0.15 + m)
    assert deadline(0.1, 0.12) == pytest.approx(0.12 + m)
    assert deadline(0.1, 0.05) == pytest.approx(0.1 + m)  # (a plan never loads what recompute beats)


def test_small_gains_keep_the_full_load_and_memory_loads_have_no_deadline():
    # a short prompt: loading and recomputing both take a millisecond or two
    plan = choose(found(64, "dram"), 64, 0, tiers(dram=1e9), prefill(), {"dram"})
    assert plan.path == "load" and plan.deadline_s is None
    plan = choose(found(64, "disk"), 64, 0, tiers(disk=1e9), prefill(), {"dram"})
    assert plan.path == "load" and plan.deadline_s >= DEADLINE_MARGIN_S


def test_planner_learns_from_worker_samples_and_counts_once():
    clock = Clock()
    planner = LoadPlanner(
        ["dram", "disk"], {"dram"}, block_size=128, bytes_per_block=128 * BYTES_PER_TOKEN, clock=clock
    )
    spans = [(s, min(s + CHUNK, 4095), "disk") for s in range(0, 4095, CHUNK)]
    plan = planner.plan("a", spans, 4096, 0)
    assert plan.path == "load" and plan.estimate_s is None
    # measurements arrive with the workers' output: a slow disk, a fast engine
    planner.observe([("load", "disk", int(n), n / 50e6) for n in (1e6, 1e7, 1e8)])
    planner.observe(
        [("step", n, attention_pairs(n, 0), 1e-5 * n) for n in (64, 512, 4096)]
        + [("step", 1, attention_pairs(1, 4000), 1e-5)]
    )
    plan = planner.plan("a", spans, 4096, 0)  # asked again: counted once
    assert plan.path == "recompute"
    planner.issued("a")  # (a recompute plan issues no load; vLLM never calls back)
    planner.finished("a")
    stats = planner.stats()  # the counts and, the first time, the rates fitted
    assert {k: v for k, v in stats.items() if not k.startswith("cost:")} == {"plan:recompute.requests": 1}
    assert stats["cost:disk.load_seconds_per_token"] == pytest.approx(BYTES_PER_TOKEN / 50e6, rel=0.01)
    assert stats["cost:prefill.seconds_per_token"] == pytest.approx(1e-5, rel=0.01)
    assert planner.stats() == {}  # no new count, and the rates are not due yet
    planner.observe([("load", "dram", 1 << 20, 1e-3)])  # a tier fitted for the first time: sent now
    assert planner.stats()["cost:dram.load_latency_seconds"] >= 0
    clock.t += RATES_EVERY_S
    assert "cost:prefill.seconds_per_pair" in planner.stats()  # and again now and then
    plan = planner.plan("b", spans[:1], 4096, 3840)
    planner.issued("b")
    planner.finished("b")
    assert planner.stats()["plan:" + plan.path + ".requests"] == 1
