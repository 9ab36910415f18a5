"""Warm scale-out (``KVCACHE_WARM_DRAM``) without an engine: a worker's warm-up of its DRAM
tier on real tiers (``cache.dram_warm``: which entries, in which order, within which
bounds, verified), the server's side against a test double of vLLM's ``collective_rpc``
(``serving.dram_warm``: done, the start-up deadline), ``/ping`` and ``/metrics`` while it
runs, and the setting itself. The engine test is ``tests/test_scaleout_engine.py``."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import pytest
from prometheus_client import generate_latest

from cache.codec import decode, encode_header
from cache.dram_warm import DramWarm
from cache.errors import ConfigError
from cache.keys import prompt_chunks
from cache.policy import LRUPolicy
from cache.popularity import Popularity, Publisher
from cache.store import TieredStore
from cache.tiers.files import FileTier
from serving.config import EngineSettings, build_serving_config
from serving.dram_warm import DramWarm as ServerWarm
from tests.test_popularity import Clock, chain
from tests.test_serving_config import CPU_BOX, args_of, env, model_dir, warm_env  # noqa: F401 (fixtures)
from tests.test_shared_tier import remote
from tests.test_tiers_store import NS, payload

ENTRY = 1000 + 256  # one chunk's entry: payload + header
CHUNK = 16  # tokens per chunk


def entry(key: str, parent, i: int) -> list:
    data = payload(i)
    return [encode_header(NS, key, "uint8", (1000,), data, b"", parent), data]


def put(tier, key: str, parent, i: int = 0) -> None:
    assert tier.reserve(ENTRY, key) and tier.write(key, entry(key, parent, i), ENTRY)


def node(tmp_path, dram_entries: int):
    """A worker's store: DRAM (tmpfs-like folder), disk, and the shared tier."""
    l3 = remote(tmp_path / "l3")
    tiers = [
        FileTier(str(tmp_path / "dram"), "ns", dram_entries * ENTRY, "dram", use_mmap=True),
        FileTier(str(tmp_path / "disk"), "ns", 100 * ENTRY, "disk"),
        l3,
    ]
    return TieredStore(tiers, NS, [LRUPolicy(), LRUPolicy()]), l3


def dram_keys(store) -> set[str]:
    return {k for k, _size in store.tiers[0].scan()}


def publish_note(l3, node_name: str, uses: list[tuple[list, int]]) -> None:
    clock = Clock(time.time())
    pop = Popularity(clock=clock)
    for c, n in uses:
        for _ in range(n):
            pop.observe(c)
    assert Publisher(pop, [l3], node=node_name, clock=clock).publish()


# -- the worker's warm-up -----------------------------------------------------------------
@pytest.fixture
def fleet(tmp_path):
    """A shared tier two nodes have used: chains a (4 chunks, used 10 times), b (3, 5 times;
    its second entry damaged), c (2, once); two prompts of the warm-prompt set."""
    p_tokens, q_tokens = list(range(100, 140)), list(range(200, 248))  # 2 chunks + tail; 3 chunks
    p = [k for k, _s, _e in prompt_chunks(NS, p_tokens, CHUNK)]
    q = [k for k, _s, _e in prompt_chunks(NS, q_tokens, CHUNK)]
    put(FileTier(str(tmp_path / "disk"), "ns", 100 * ENTRY, "disk"), q[0], None)  # on this node's disk
    store, l3 = node(tmp_path, dram_entries=12)
    a, b, c = chain(4, 0), chain(3, 5000), chain(2, 9000)
    for i, x in enumerate(a + b + c):
        put(l3, x.key, x.parent, i)
    damaged = os.path.join(l3.folder, b[1].key[:2], b[1].key)
    raw = bytearray(open(damaged, "rb").read())
    raw[-1] ^= 0xFF
    open(damaged, "wb").write(raw)
    publish_note(l3, "node-1", [(a, 6), (b, 5)])
    publish_note(l3, "node-2", [(a, 4), (c, 1)])
    for i, k in enumerate(p):
        put(l3, k, p[i - 1] if i else None, i)
    put(l3, q[2], q[1])  # q[1] is nowhere
    return store, (a, b, c), (p_tokens, q_tokens), (p, q)


def test_prompts_then_the_hottest_entries_in_order_within_the_budget(fleet):
    store, (a, b, c), prompts, (p, q) = fleet
    warm = DramWarm(store, NS, CHUNK)
    warm.run(prompts, budget=6 * ENTRY + ENTRY // 2)
    s = warm.status()
    assert s["state"] == "done" and s["notes"] == 2
    # prompts: p whole; q's first chunk (from disk), then the one no tier holds, so not q[2]
    assert s["prompts"] == {"planned": 6, "warm": 4, "copied": 4, "bytes": 4 * ENTRY, "absent": 1, "skipped": 1}
    # hot, most used first: a (4) and b's first; b[1] fails verification (no sound entry),
    # b[2] cannot load without it; c[0]; c[1] would pass the budget
    assert s["hot"] == {"planned": 9, "warm": 6, "copied": 6, "bytes": 6 * ENTRY, "absent": 1, "skipped": 2}
    assert dram_keys(store) == set(p) | {q[0]} | {x.key for x in a} | {b[0].key, c[0].key}
    for key in dram_keys(store):  # what was installed is sound, and the policy tracks it
        decode(store.tiers[0].read(key), NS, key, b"")
    store.check()
    assert store.counters()["dram.promotions"] == 10 and store.counters()["shared.corrupt"] == 1
    store.close()


def test_dram_capacity_bounds_the_warm_up_and_entries_there_count_without_a_copy(tmp_path):
    store, l3 = node(tmp_path, dram_entries=3)
    a = chain(5, 0)
    for i, x in enumerate(a):
        put(l3, x.key, x.parent, i)
    store.close()
    put(FileTier(str(tmp_path / "dram"), "ns", 3 * ENTRY, "dram"), a[0].key, None)  # DRAM holds the first
    store, l3 = node(tmp_path, dram_entries=3)
    publish_note(l3, "node-1", [(a, 3)])
    warm = DramWarm(store, NS, CHUNK)
    warm.run([], budget=100 * ENTRY)
    hot = warm.status()["hot"]
    assert hot["warm"] == 3 and hot["copied"] == 2 and hot["skipped"] == 2  # DRAM holds 3 entries
    assert dram_keys(store) == {x.key for x in a[:3]}
    store.check()
    store.close()


def test_dram_capacity_bounds_the_warm_prompts(tmp_path):
    store, l3 = node(tmp_path, dram_entries=3)
    tokens = list(range(300, 380))  # 5 whole chunks
    keys = [k for k, _s, _e in prompt_chunks(NS, tokens, CHUNK)]
    for i, k in enumerate(keys):
        put(l3, k, keys[i - 1] if i else None, i)
    warm = DramWarm(store, NS, CHUNK)
    warm.run([tokens], budget=0)
    assert warm.status()["prompts"] == {
        "planned": 5,
        "warm": 3,
        "copied": 3,
        "bytes": 3 * ENTRY,
        "absent": 0,
        "skipped": 2,
    }
    assert dram_keys(store) == set(keys[:3])  # the first three, none evicted for a later one
    store.close()


def test_a_stopped_warm_up_copies_nothing_more(fleet):
    store = fleet[0]
    warm = DramWarm(store, NS, CHUNK)
    warm.stop()
    warm.run(fleet[2], budget=100 * ENTRY)
    assert warm.status()["state"] == "stopped" and dram_keys(store) == set()
    store.close()


def test_a_damaged_entry_in_dram_is_replaced_by_a_sound_copy_never_counted_warm(tmp_path):
    store, l3 = node(tmp_path, dram_entries=3)
    a = chain(1, 0)
    put(l3, a[0].key, None)
    store.close()
    dram = FileTier(str(tmp_path / "dram"), "ns", 3 * ENTRY, "dram")
    put(dram, a[0].key, None)
    path = os.path.join(dram.folder, a[0].key[:2], a[0].key)
    raw = bytearray(open(path, "rb").read())
    raw[-1] ^= 0xFF
    open(path, "wb").write(raw)
    store, _l3 = node(tmp_path, dram_entries=3)
    assert store.copy_up(a[0].key) == ("copied", ENTRY)
    decode(store.tiers[0].read(a[0].key), NS, a[0].key, b"")  # sound now
    assert store.counters()["dram.corrupt"] == 1
    assert store.copy_up(a[0].key) == ("held", ENTRY)
    store.close()


def test_a_warm_up_stops_when_its_store_closes(fleet):
    store = fleet[0]
    store.close()
    assert store.copy_up(fleet[1][0][0].key) == ("refused", 0)
    warm = DramWarm(store, NS, CHUNK)
    warm.run(fleet[2], budget=100 * ENTRY)
    s = warm.status()
    assert s["state"] == "stopped" and s["error"] == "" and dram_keys(store) == set()


def test_the_worker_methods_return_at_once_while_the_copying_runs_on_its_own_thread(fleet, monkeypatch):
    """vLLM runs them on the worker's main thread, between engine steps: none may wait for a copy."""
    from types import SimpleNamespace

    from cache.vllm import warm_rpc

    store, entered, release = fleet[0], threading.Event(), threading.Event()
    copy_up = store.copy_up

    def blocked_copy_up(key, fits=lambda n: True):  # the first copy waits to be released
        if not entered.is_set():
            entered.set()
            release.wait(60)
        return copy_up(key, fits)

    monkeypatch.setattr(store, "copy_up", blocked_copy_up)
    side = SimpleNamespace(
        store=store,
        namespace=SimpleNamespace(chain_digest=NS),
        config=SimpleNamespace(dram_bytes=12 * ENTRY, chunk_tokens=CHUNK),
    )
    monkeypatch.setattr(warm_rpc, "_worker_side", lambda: side)
    monkeypatch.setattr(warm_rpc, "_warm", None)
    ext = warm_rpc.KVCacheWorkerExtension()
    assert ext.kvcache_warm_status()["state"] == "off"
    try:
        assert ext.kvcache_warm_dram({"prompts": fleet[2], "budget": 100 * ENTRY})["state"] == "warming"
        assert entered.wait(60)  # the copy is under way, and blocked ...
        assert ext.kvcache_warm_status()["state"] == "warming"  # ... while every method answers
        assert ext.kvcache_warm_dram({"prompts": [], "budget": 0})["state"] == "warming"  # the same one
        assert ext.kvcache_warm_stop()["state"] == "warming"
    finally:
        release.set()
    deadline = time.monotonic() + 60
    while ext.kvcache_warm_status()["state"] == "warming" and time.monotonic() < deadline:
        time.sleep(0.01)
    s = ext.kvcache_warm_status()
    assert s["state"] == "stopped" and s["prompts"]["warm"] == 1  # the entry being copied, then no more
    store.close()


# -- the server's side ----------------------------------------------------------------------
class Workers:
    """vLLM's ``AsyncLLM`` as the warm-up uses it: ``collective_rpc`` answers from a script."""

    def __init__(self, statuses: list[str]) -> None:
        self.statuses, self.calls = list(statuses), []

    def get_tokenizer(self):
        return type("Bytes", (), {"encode": staticmethod(lambda text: list(text.encode()))})()

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append((method, args))
        state = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        if method == "kvcache_warm_stop":
            state = "stopped"
        hot = {"planned": 4, "warm": 4 if state == "done" else 1, "copied": 1, "bytes": 1000, "absent": 0, "skipped": 0}
        return [
            {"state": state, "seconds": 1.0, "notes": 2, "prompts": {"planned": 2, "warm": 2, "bytes": 10}, "hot": hot}
        ]


def settings(tmp_path, prompts: bool = True) -> EngineSettings:
    path = tmp_path / "warm.jsonl"
    path.write_text('{"prompt": "ab"}\n{"prompt_token_ids": [7, 8, 9]}\n')
    return EngineSettings(vllm_args=(), warm_prompts=str(path) if prompts else None, warm_dram_bytes=4096)


def test_the_server_waits_for_every_rank_then_reports_done(tmp_path, caplog):
    caplog.set_level(logging.INFO, "serving.dram_warm")
    workers = Workers(["warming", "warming", "done"])
    warm = ServerWarm(settings(tmp_path), deadline=time.monotonic() + 600)
    assert not warm.finished
    asyncio.run(warm.run(workers))
    assert warm.state == "done" and warm.finished
    method, (job,) = workers.calls[0]
    assert method == "kvcache_warm_dram" and job == {"prompts": [[97, 98], [7, 8, 9]], "budget": 4096}
    assert [m for m, _ in workers.calls[1:]] == ["kvcache_warm_status"] * 2
    assert warm.progress()["hot"]["warm"] == 4
    assert "DRAM warm-up done" in caplog.text and "hottest shared entries 4 of 4 in DRAM" in caplog.text


def test_at_the_start_up_deadline_ping_turns_healthy_and_the_log_says_what_was_not_warmed(tmp_path, caplog):
    caplog.set_level(logging.INFO, "serving.dram_warm")
    clock = Clock(0.0)
    workers = Workers(["warming"])

    async def go():
        warm = ServerWarm(settings(tmp_path, prompts=False), deadline=3.0, clock=clock)
        task = asyncio.create_task(warm.run(workers))
        while not task.done():
            await asyncio.sleep(0.01)
            clock.t += 0.5
        return warm

    warm = asyncio.run(go())
    assert warm.state == "deadline" and warm.finished
    assert workers.calls[-1][0] == "kvcache_warm_stop"
    assert "cut at the start-up deadline" in caplog.text
    assert "Not warmed: 0 of 2 warm prompts' chunks, 3 of 4 hottest shared entries" in caplog.text


def test_a_failing_warm_up_or_a_stopping_server_ends_it_and_ping_turns_healthy(tmp_path, caplog):
    class Dead(Workers):
        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            raise RuntimeError("EngineDeadError")

    warm = ServerWarm(settings(tmp_path), deadline=time.monotonic() + 600)
    asyncio.run(warm.run(Dead(["warming"])))
    assert warm.state == "failed" and warm.finished and "DRAM warm-up failed" in caplog.text

    clock = Clock(0.0)

    async def go():  # the server stops while the warm-up runs, well before its deadline
        warm = ServerWarm(settings(tmp_path), deadline=100.0, clock=clock)
        task = asyncio.create_task(warm.run(Workers(["warming"])))
        while not task.done():
            await asyncio.sleep(0.01)
            clock.t += 0.5
            if clock.t == 5.0:
                warm.cancel()
        return warm

    warm = asyncio.run(go())
    assert warm.state == "stopped" and warm.finished


# -- /ping, /metrics and the setting ----------------------------------------------------------
def test_ping_says_warming_dram_until_the_warm_up_ends_and_metrics_show_it(warm_env, tmp_path):  # noqa: F811
    from serving.app import create_app
    from serving.engine import State
    from tests.test_guard import call

    cfg = build_serving_config({**warm_env, "KVCACHE_WARM_DRAM": "50%"}, CPU_BOX)
    app = create_app(cfg)
    engine = app.state.engine
    text = generate_latest(app.state.metrics.registry).decode()
    assert 'kvcache_dram_warm_state{state="starting"} 1.0' in text
    engine.state, engine.client = State.READY, type("Client", (), {"errored": False})()
    engine.dram_warm = ServerWarm(cfg.engine, deadline=1e18)
    engine.dram_warm.ranks = [
        {"state": "warming", "prompts": {"warm": 2, "bytes": 100}, "hot": {"warm": 3, "bytes": 300, "planned": 9}}
    ]
    r = call(app, "GET", "/ping")
    assert r.status_code == 503 and r.json() == {"status": "warming dram", "entries": 5, "bytes": 400}, r.text
    text = generate_latest(app.state.metrics.registry).decode()
    assert 'kvcache_dram_warm_state{state="warming"} 1.0' in text
    assert 'kvcache_dram_warm_entries{set="hot"} 3.0' in text and 'kvcache_dram_warm_bytes{set="prompts"} 100.0' in text
    assert 'kvcache_dram_warm_planned_entries{set="hot"} 9.0' in text
    engine.dram_warm.state = "deadline"
    assert call(app, "GET", "/ping").json() == {"status": "healthy"}


def test_the_setting(warm_env, tmp_path):  # noqa: F811
    cfg = build_serving_config({**warm_env, "KVCACHE_WARM_DRAM": "50%"}, CPU_BOX)
    assert cfg.engine.warm_dram_bytes == cfg.plan.cache.dram_bytes // 2
    assert args_of(cfg)["--worker-extension-cls"] == "cache.vllm.warm_rpc.KVCacheWorkerExtension"
    assert "/ping healthy once DRAM holds" in cfg.describe()
    assert ("KVCACHE_WARM_DRAM=50%", "--worker-extension-cls cache.vllm.warm_rpc.KVCacheWorkerExtension") in cfg.effects
    big = build_serving_config({**warm_env, "KVCACHE_WARM_DRAM": "1000TiB"}, CPU_BOX)
    assert big.engine.warm_dram_bytes == big.plan.cache.dram_bytes  # at most the tier
    off = build_serving_config(warm_env, CPU_BOX)
    assert off.engine.warm_dram_bytes == 0 and "--worker-extension-cls" not in args_of(off)
    for change, words in [
        ({"KVCACHE_SHARED_URL": "", "KVCACHE_WARM_PROMPTS": ""}, "needs the tiered cache on, KVCACHE_SHARED_URL"),
        ({"KVCACHE_DRAM_SIZE": "0"}, "a DRAM tier"),
        ({"KVCACHE_WARM_DRAM": "lots"}, "is not a size"),
        ({"SM_VLLM_WORKER_EXTENSION_CLS": "my.Ext"}, "SM_VLLM_WORKER_EXTENSION_CLS sets another"),
    ]:
        with pytest.raises(ConfigError, match=words):
            build_serving_config({**warm_env, "KVCACHE_WARM_DRAM": "1GiB", **change}, CPU_BOX)
