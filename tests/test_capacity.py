"""The capacity benchmark's parts without an engine: the workloads' sessions, the
statistics, and the asyncio client driving users against an in-process stand-in of the
server's streamed ``/v1/completions`` and ``/metrics`` (aiohttp)."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
from collections import Counter

import aiohttp
import pytest

from bench import capacity
from bench import capacity_stats as stats
from bench.capacity_workloads import VOCAB, Workload, workload


def _sessions(name: str, user: int = 0, n: int = 3, salt: str = "s"):
    it = workload(name).sessions(user, salt)
    return [next(it) for _ in range(n)]


def test_chat_turns_extend_the_conversation_from_the_shared_system_prompt():
    w = workload("chat")
    for session in _sessions("chat"):
        assert 5 <= len(session) <= 8
        assert len({t.session for t in session}) == 1
        prev, prev_answer = None, 0
        for t in session:
            assert t.prompt[:1000] == w.shared and 16 <= t.answer_tokens <= 32 and t.think_s == 6.0
            assert all(0 <= x < VOCAB for x in t.prompt)
            if prev is not None:
                assert t.prompt[: len(prev)] == prev
                assert 300 <= len(t.prompt) - len(prev) - prev_answer <= 600
            else:
                assert 300 <= len(t.prompt) - 1000 <= 600
            prev, prev_answer = t.prompt, t.answer_tokens
        assert len(session[-1].prompt) <= w.max_prompt_tokens()


def test_sessions_are_reproducible_and_distinct_per_user_and_salt():
    assert _sessions("chat", 1) == _sessions("chat", 1)
    a, b, c = _sessions("chat", 1)[0], _sessions("chat", 2)[0], _sessions("chat", 1, salt="t")[0]
    assert a[0].prompt[:1000] == b[0].prompt[:1000] == c[0].prompt[:1000]  # the shared part
    assert a[0].prompt[1000:1100] != b[0].prompt[1000:1100]
    assert a[0].prompt[1000:1100] != c[0].prompt[1000:1100]


def test_rag_draws_pool_documents_zipf_plus_a_new_question():
    w = workload("rag")
    docs = {d: i for i, d in enumerate(w.documents)}
    drawn = Counter()
    for session in _sessions("rag", n=2000):
        (t,) = session
        assert t.prompt[:300] == w.shared
        rest = t.prompt[300:]
        hits = [i for d, i in docs.items() if rest[: len(d)] == d]
        assert len(hits) == 1
        assert 40 <= len(rest) - len(w.documents[hits[0]]) <= 120
        drawn[hits[0]] += 1
    assert len(w.documents) == 64
    # seeded draws: rank 1 about 2.1x rank 2 and 12.6x rank 10 under Zipf s=1.1
    assert drawn[0] > 1.5 * drawn[1] > 0 and drawn[0] > 6 * drawn[9]


def test_agent_sessions_share_a_long_prefix_with_short_turns():
    w = workload("agent")
    for session in _sessions("agent"):
        assert 8 <= len(session) <= 14 and session[0].think_s == 1.0
        assert all(t.prompt[:3000] == w.shared for t in session)
        assert 40 <= len(session[0].prompt) - 3000 <= 160


def test_bad_workloads_are_refused():
    with pytest.raises(ValueError, match="unknown workload 'x'"):
        workload("x")
    with pytest.raises(ValueError, match="turns"):
        Workload(name="w", shared_tokens=10, turns=(3, 2), new_tokens=(1, 2))
    assert workload("chat", think_s=0.5).think_s == 0.5


def test_percentile_interpolates_like_statistics():
    data = [0.3, 1.0, 0.1, 7.0, 2.5, 0.9, 4.0]
    deciles = statistics.quantiles(data, n=10, method="inclusive")
    assert stats.percentile(data, 0.9) == pytest.approx(deciles[8])
    assert stats.percentile(data, 0.5) == statistics.median(data)
    assert math.isnan(stats.percentile([], 0.5))


METRICS = """# HELP vllm:prompt_tokens_by_source_total x
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="model",source="local_compute"} %d
vllm:prompt_tokens_by_source_total{engine="0",model_name="model",source="local_cache_hit"} %d
# HELP vllm:prompt_tokens_total x
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="model"} %d
# HELP kvcache:tier_tokens_loaded_total x
# TYPE kvcache:tier_tokens_loaded_total counter
kvcache:tier_tokens_loaded_total{engine="0",model_name="model",tier="dram"} %d
"""


def test_token_counters_and_a_point_summary():
    before = stats.token_counters(METRICS % (100, 50, 200, 50))
    after = stats.token_counters(METRICS % (400, 450, 1200, 350))
    d = stats.delta(before, after)
    assert d == {"loaded:dram": 300, "prompt": 1000, "prompt:local_cache_hit": 400, "prompt:local_compute": 300}
    turns = [{"ok": True, "ttft": x, "itl": [0.01, 0.03], "asked": 16, "got": 16} for x in (1.0, 2.0, 3.0)]
    turns += [
        {"ok": True, "ttft": 4.0, "itl": [], "asked": 16, "got": 3},
        {"ok": False, "ttft": 0.0, "itl": [], "asked": 16, "got": 0},
    ]
    p = stats.summarize(turns, 30.0, d)
    assert (p["turns"], p["failed"], p["short_answers"]) == (4, 1, 1)
    assert p["turns_per_min"] == 8.0 and p["ttft_p50"] == 2.5 and p["itl_p50"] == pytest.approx(0.02)
    assert p["computed_tokens"] == 300 and p["l0_tokens"] == 400 and p["computed_share"] == 0.3
    assert p["loaded_tokens"] == {"dram": 300, "disk": 0.0, "shared": 0.0}


def _points(*p90):
    return {u: {"ttft_p90": y} for u, y in zip((4, 8, 16, 32), p90)}


def test_users_at_slo():
    assert stats.users_at_slo(_points(0.5, 1.0, 3.0, 9.0), 2.0) == {"served": 8, "bound": "=", "estimate": 12.0}
    assert stats.users_at_slo(_points(0.5, 1.0, 1.5, 1.9), 2.0)["bound"] == ">="
    assert stats.users_at_slo(_points(2.5, 1.0, 1.5, 1.9), 2.0) == {"served": 4, "bound": "<", "estimate": None}
    # a later point that meets it again does not count: the sweep stops at the first miss
    assert stats.users_at_slo(_points(0.5, 3.0, 1.0, 1.0), 2.0)["served"] == 4
    assert stats.users_at_slo(_points(0.5, math.nan, 1.0, 1.0), 2.0)["served"] == 4
    assert stats.slo_text(stats.users_at_slo(_points(0.5, 1.0, 3.0, 9.0), 2.0)) == "8 (≈12)"


# -- the client against an in-process stand-in of the server -----------------------------------
async def _drive(users: int, wl: Workload, duration: float, fail_above: int = 10**9):
    from aiohttp import web

    seen, totals = [], Counter()

    async def completions(request):
        body = await request.json()
        seen.append(body)
        if len(body["prompt"]) > fail_above:
            return web.Response(status=500, reason="refused")
        totals["prompt"] += len(body["prompt"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(body["max_tokens"]):
            await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n')
            await asyncio.sleep(0.001)
        usage = {
            "choices": [],
            "usage": {"completion_tokens": body["max_tokens"], "prompt_tokens": len(body["prompt"])},
        }
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def metrics(request):
        return web.Response(text=METRICS % (totals["prompt"], 0, totals["prompt"], 0))

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions), web.get("/metrics", metrics)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        point = await capacity.sweep_point(f"http://127.0.0.1:{port}", "model", wl, users, duration, "t-")
    finally:
        await runner.cleanup()
    return point, seen, totals


def test_users_send_their_turns_and_the_point_counts_them():
    wl = Workload(name="tiny", shared_tokens=50, turns=(2, 3), new_tokens=(5, 10), answer_tokens=(4, 6), think_s=0.01)
    point, seen, totals = asyncio.run(_drive(3, wl, duration=2.0))
    assert point["failed"] == 0 and point["short_answers"] == 0
    assert point["turns"] == len(seen) >= 3
    assert point["prompt_tokens"] == point["computed_tokens"] == totals["prompt"]
    assert all(b["ignore_eos"] and b["min_tokens"] == b["max_tokens"] and b["stream"] for b in seen)
    assert {b["max_tokens"] for b in seen} <= {4, 5, 6}
    # every user's conversation grows turn by turn from the shared prefix
    shared = list(wl.shared)
    assert all(b["prompt"][:50] == shared for b in seen)
    assert point["ttft_p50"] > 0 and point["itl_p50"] > 0 and point["turns_per_min"] > 0


def test_a_failed_turn_drops_the_conversation():
    # every second turn fails: the user drops that conversation and starts the next one
    wl = Workload(name="tiny", shared_tokens=50, turns=(3, 3), new_tokens=(5, 10), answer_tokens=(4, 4), think_s=0.01)
    point, seen, _ = asyncio.run(_drive(1, wl, duration=1.0, fail_above=60))
    assert point["failed"] >= 1 and point["turns"] >= 1
    assert max(len(b["prompt"]) for b in seen) <= 50 + 10 + 4 + 10  # no third turn was ever sent
    assert point["errors"] and "refused" in point["errors"][0]
    with pytest.raises((aiohttp.ClientError, OSError)):  # no server: the first scrape of /metrics fails loudly
        asyncio.run(capacity.sweep_point("http://127.0.0.1:9", "model", wl, 1, 0.5, "t-"))


def test_summary_table_names_each_configuration():
    pts = {4: {"ttft_p90": 0.5}, 8: {"ttft_p90": 3.0}}
    result = {
        "run": {"slo_s": 2.0, "slos": [2.0, 0.4], "scale": "tiny", "configs": ["vllm-alone", "ours"]},
        "workloads": {"chat": {"vllm-alone": {"points": pts}}},
    }
    text = capacity.summary(result)
    assert "| workload | SLO | vllm-alone | ours |" in text
    assert "| chat | p90 <= 2 s | 4 (≈6) | – |" in text and "| chat | p90 <= 0.4 s | < 4 | – |" in text
    # after a JSON round trip the user counts are strings: still ordered as numbers
    assert stats.users_at_slo(json.loads(json.dumps({8: pts[8], 16: {"ttft_p90": 1.0}, 4: pts[4]})), 2.0)["served"] == 4


def test_parse_refuses_unknown_names():
    with pytest.raises(SystemExit):
        capacity.parse(["--configs", "vllm-alone,nope"])
    with pytest.raises(ValueError):
        capacity.parse(["--workloads", "nope"])
    a = capacity.parse(["--quick"])
    assert (a.workloads, a.configs, a.users) == (["chat"], ["vllm-alone", "ours"], [2, 4])


def test_dashboard_text_is_the_curve_and_users_at_each_slo():
    pts = {"8": {"ttft_p90": 0.5}, "16": {"ttft_p90": 3.0}}
    result = {
        "run": {
            "slo_s": 2.0,
            "slos": [2.0, 0.4],
            "scale": "tiny scale",
            "started": "then",
            "configs": ["vllm-alone", "limit"],
        },
        "workloads": {"rag": {"vllm-alone": {"points": pts}, "limit": {"points": {"8": {"ttft_p90": 0.25}}}}},
    }
    text = capacity.dashboard_text(result)
    assert "tiny scale; started then" in text and "not this deployment" in text
    assert "| configuration | 8 users | 16 users | p90 <= 2 s | p90 <= 0.4 s |" in text
    assert "| vllm-alone | 0.50 | 3.00 | 8 (≈13) | < 8 |" in text
    assert "| limit | 0.25 | – | >= 8 | >= 8 |" in text  # a point it did not run: a dash
