"""Pins (``cache.pins``) without an engine: what a request may ask, the bound, expiry, the
pin file across new instances (a restart) and damage, eviction passing pinned entries
over, the scheduler's ``Pinner``, the server's ``cache_control`` parsing, and
``cache.tools.inspect`` listing pins. The engine test is ``tests/test_pins_engine.py``."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest

from cache.assembly import writer_store
from cache.config import CacheConfig, build_cache_config
from cache.errors import ConfigError, PinError
from cache.keys import Namespace, chunk_keys
from cache.pins import MAX_TTL_S, PinAsk, PinBook, parse_ttl, pin_ask
from cache.policy import LRUPolicy
from cache.store import TieredStore
from cache.tiers.files import FileTier
from cache.tiers.layout import PINS_FILE
from cache.vllm.pinning import Pinner
from serving.cache_control import ChatPin, check_kv_params, take_cache_control
from serving.errors import ClientError
from serving.tgi import parse_tgi, tgi_to_completion
from tests.test_inspect import env_for, inspect

NS = Namespace("m", "d", "uint8", "x", chunk_tokens=16)
ENTRY = 1024 + 256  # bytes of one test entry (payload + header)


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# -- what a request may ask ------------------------------------------------------------
def test_ttl_names_and_seconds():
    assert parse_ttl("5m") == 300 and parse_ttl("1h") == 3600 and parse_ttl(90) == 90.0
    for bad in (0, -5, MAX_TTL_S + 1, True, "2h", "300", None, float("nan"), [300]):
        with pytest.raises(PinError):
            parse_ttl(bad)


def test_pin_ask_from_kv_transfer_params():
    assert pin_ask(None) is None and pin_ask({"kvcache_load": False}) is None
    assert pin_ask({"kvcache_pin_ttl": "1h"}) == PinAsk(3600.0, None)
    assert pin_ask({"kvcache_pin_ttl": 60, "kvcache_pin_tokens": 512}) == PinAsk(60.0, 512)
    for bad in (
        {"kvcache_pin_tokens": 10},
        {"kvcache_pin_ttl": 60, "kvcache_pin_tokens": 0},
        {"kvcache_pin_ttl": 60, "kvcache_pin_tokens": "all"},
        {"kvcache_pin_ttl": "forever"},
    ):
        with pytest.raises(PinError):
            pin_ask(bad)


def test_pin_max_setting():
    env = {"KVCACHE_DRAM_SIZE": "0", "KVCACHE_DISK_SIZE": "0"}
    assert build_cache_config(env).pin_max == 0.5 == CacheConfig().pin_max
    assert build_cache_config({**env, "KVCACHE_PIN_MAX": "25%"}).pin_max == 0.25
    cfg = build_cache_config({**env, "KVCACHE_PIN_MAX": "0.1"})
    assert cfg.pin_max == 0.1 and CacheConfig.from_dict(cfg.to_dict()).pin_max == 0.1
    for bad in ("2", "-0.1", "half", "150%"):
        with pytest.raises(ConfigError, match="KVCACHE_PIN_MAX"):
            build_cache_config({**env, "KVCACHE_PIN_MAX": bad})


# -- the pin book: bound, expiry, persistence, damage -------------------------------------
def test_bound_refuses_past_the_share_and_counts_each_chunk_once(tmp_path):
    book = PinBook(str(tmp_path), capacity=10 * ENTRY, share=0.5, namespace="ns1")
    ok, reason, expires, _ = book.pin(["ns1"], ["a", "b", "c"], ENTRY, 60)
    assert ok and not reason and expires > 0
    assert book.pin(["ns1"], ["a", "b", "c"], ENTRY, 120)[0]  # the same chunks again: no new bytes
    assert book.pin(["ns1"], ["a", "b", "d", "e"], ENTRY, 60)[0]  # 5 chunks in all: at the bound
    ok, reason, _, refusal = book.pin(["ns1"], ["f"], ENTRY, 60)
    assert not ok and "KVCACHE_PIN_MAX" in reason and refusal == "tier_budget"
    assert book.held("a") and book.held("e") and not book.held("f")
    assert not PinBook(str(tmp_path), 10 * ENTRY, 0.5, namespace="other").held("a")
    assert "pins are off" in PinBook(str(tmp_path / "off"), 10 * ENTRY, 0.0).pin(["ns1"], ["a"], ENTRY, 60)[1]


def test_pins_expire_and_are_dropped_when_the_file_is_next_written(tmp_path):
    clock = Clock()
    book = PinBook(str(tmp_path), 4 * ENTRY, 0.5, namespace="ns1", clock=clock)
    assert book.pin(["ns1"], ["a", "b"], ENTRY, 300)[0]
    assert not book.pin(["ns1"], ["c"], ENTRY, 300)[0]  # full
    clock.t += 299
    assert book.held("a")
    clock.t += 2
    assert not book.held("a") and book.live() == []
    assert len(json.loads((tmp_path / PINS_FILE).read_text())["pins"]) == 1  # lazily: still on file
    assert book.pin(["ns1"], ["c"], ENTRY, 300)[0]  # room again; the expired pin is dropped
    pins = json.loads((tmp_path / PINS_FILE).read_text())["pins"]
    assert [p["keys"] for p in pins] == [["c"]]


def test_pins_survive_a_new_instance_and_damage_is_ignored(tmp_path, caplog):
    PinBook(str(tmp_path), 8 * ENTRY, 0.5).pin(["ns1"], ["a", "b"], ENTRY, 600, tokens=32)
    again = PinBook(str(tmp_path), 8 * ENTRY, 0.5, namespace="ns1")  # a restarted process
    assert again.held("a") and again.held("b") and not again.held("c")
    assert again.live()[0].tokens == 32
    (tmp_path / PINS_FILE).write_bytes(b'{"format": 1, "pins": [{"keys": ')  # torn / damaged
    with caplog.at_level(logging.WARNING, logger="cache.pins"):
        assert not again.held("a") and again.live() == []
    assert "damaged pin file" in caplog.text
    assert again.pin(["ns1"], ["c"], ENTRY, 60)[0] and again.held("c")  # the next pin replaces it
    (tmp_path / PINS_FILE).write_text('{"format": 1, "pins": [{"keys": 3}]}')
    assert not again.held("c")


# -- the store's eviction hook ---------------------------------------------------------------
def _store(tmp_path, *capacities):
    tiers = [FileTier(str(tmp_path / name), NS.id, cap, name) for name, cap in zip(("dram", "disk"), capacities)]
    return TieredStore(
        tiers,
        NS.digest,
        [LRUPolicy() for _ in tiers],
        io_threads=1,
        pins=PinBook(str(tmp_path / tiers[-1].name), capacities[-1], 0.5, namespace=NS.id),
    )


def _put(store, keys):
    for i, k in enumerate(keys):
        store.put(k, None, "uint8", (1024,), np.full(1024, i % 251, np.uint8))
        store.flush(30)


def test_eviction_passes_pinned_entries_over(tmp_path):
    store = _store(tmp_path, 4 * ENTRY)
    keys = chunk_keys(NS.chain_digest, list(range(16 * 12)), 16)
    assert store.pins.pin([NS.id], keys[:2], ENTRY, 600)[0]
    _put(store, keys)
    present = [k for k in keys if store.tiers[0].contains(k)]
    assert present == keys[:2] + keys[-2:]  # the pinned two and the newest unpinned two
    assert store.stats.tiers["dram"].evictions == 8
    store.check()
    store.close()


def test_dram_demotes_a_pinned_entry_to_disk_never_drops_it(tmp_path):
    store = _store(tmp_path, 2 * ENTRY, 8 * ENTRY)
    keys = chunk_keys(NS.chain_digest, list(range(16 * 16)), 16)
    assert store.pins.pin([NS.id], keys[:3], ENTRY, 600)[0]
    _put(store, keys)
    dram, disk = store.tiers
    where = ["D" * dram.contains(k) + "d" * disk.contains(k) for k in keys]
    # DRAM kept pinned 2 while it had an unpinned entry to evict; pinned 0 and 1 went down
    # when DRAM held only pins; the disk evicted unpinned entries only, oldest first.
    assert where == ["d", "d", "D"] + [""] * 6 + ["d"] * 6 + ["D"]
    assert store.get(keys[0]) is not None  # (and promoted back to DRAM)
    store.flush(30)
    store.check()
    store.close()


def test_expired_pins_are_evicted_again(tmp_path):
    store = _store(tmp_path, 3 * ENTRY)
    clock = Clock()
    store.pins.clock = clock
    keys = chunk_keys(NS.chain_digest, list(range(16 * 6)), 16)
    assert store.pins.pin([NS.id], keys[:1], ENTRY, 60)[0]
    _put(store, keys[:4])
    assert store.tiers[0].contains(keys[0]) and not store.tiers[0].contains(keys[1])
    clock.t += 61
    _put(store, keys[4:])
    assert not store.tiers[0].contains(keys[0])
    store.close()


def test_writer_store_reads_the_pins_of_the_last_local_tier(tmp_path):
    env = env_for(tmp_path, KVCACHE_PIN_MAX="0.25")
    cfg = build_cache_config(env)
    store = writer_store(cfg, NS)
    assert store.pins.root == cfg.disk_path and store.pins.limit == cfg.disk_bytes // 4
    store.close()


# -- the scheduler's Pinner --------------------------------------------------------------------
def _chunks(n_whole, tail=0, c=16):
    out = [SimpleNamespace(keys=(f"k{i}",), start=i * c, end=(i + 1) * c) for i in range(n_whole)]
    if tail:
        out.append(SimpleNamespace(keys=("tail",), start=n_whole * c, end=n_whole * c + tail))
    return out


def test_pinner_pins_whole_chunks_inside_the_prefix(tmp_path):
    cfg = CacheConfig(disk_path=str(tmp_path), disk_bytes=20 * ENTRY, pin_tenant_max=1.0)
    pinner = Pinner(cfg, ["ns0", "ns1"], ENTRY)
    req = SimpleNamespace(request_id="r1", kv_transfer_params={"kvcache_pin_ttl": "1h", "kvcache_pin_tokens": 40})
    pinner.offer(req, _chunks(3, tail=5), 53)
    pinner.offer(req, _chunks(3, tail=5), 53)  # asked again (deferred): pinned once
    result = pinner.finished(req)
    assert result["pinned"] and result["tokens"] == 32 and result["chunks"] == 2 and result["tier"] == "disk"
    book = PinBook(str(tmp_path), 20 * ENTRY, 0.5, namespace="ns1")
    assert book.held("k0") and book.held("k1") and not book.held("k2")

    whole = SimpleNamespace(request_id="r2", kv_transfer_params={"kvcache_pin_ttl": 60})
    pinner.offer(whole, _chunks(3, tail=5), 53)
    assert pinner.finished(whole)["chunks"] == 4 and book.held("tail")
    big = SimpleNamespace(request_id="r3", kv_transfer_params={"kvcache_pin_ttl": 60})
    pinner.offer(big, _chunks(12), 192)
    refused = pinner.finished(big)
    assert not refused["pinned"] and "KVCACHE_PIN_MAX" in refused["reason"]
    short = SimpleNamespace(request_id="r4", kv_transfer_params={"kvcache_pin_ttl": 60, "kvcache_pin_tokens": 10})
    pinner.offer(short, _chunks(3), 48)
    assert "no whole chunk" in pinner.finished(short)["reason"]
    bad = SimpleNamespace(request_id="r5", kv_transfer_params={"kvcache_pin_ttl": -1})
    pinner.offer(bad, _chunks(3), 48)
    assert "out of range" in pinner.finished(bad)["reason"]
    plain = SimpleNamespace(request_id="r6", kv_transfer_params=None)
    pinner.offer(plain, _chunks(3), 48)
    assert pinner.finished(plain) is None


def test_pinner_marks_pinned_chunks_for_the_shared_tier(tmp_path):
    cfg = CacheConfig(dram_path=str(tmp_path), dram_bytes=20 * ENTRY, shared_url=f"file://{tmp_path}/l3")
    pinner = Pinner(cfg, ["ns0"], ENTRY)
    req = SimpleNamespace(request_id="r1", kv_transfer_params={"kvcache_pin_ttl": 60})
    pinner.offer(req, _chunks(2), 32)
    assert pinner.shares("k0") and pinner.take_publish() == ["k0", "k1"] and pinner.take_publish() == []
    pinner.finished(req)
    assert not pinner.shares("k0")


# -- the server: cache_control and kv_transfer_params ----------------------------------------
def test_cache_control_on_a_message_or_a_content_part_is_taken_out():
    body = {
        "messages": [
            {"role": "system", "content": "rules", "cache_control": {"type": "ephemeral"}},
            {
                "role": "user",
                "content": [{"type": "text", "text": "doc", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            },
            {"role": "user", "content": "question"},
        ]
    }
    original = json.dumps(body)
    pin = take_cache_control(body)
    assert pin == ChatPin(message=1, ttl_s=3600.0, last=False)
    assert "cache_control" not in json.dumps(body["messages"]) and json.dumps(body) != original
    last = {"messages": [{"role": "user", "content": "q", "cache_control": {"type": "ephemeral", "ttl": "5m"}}]}
    assert take_cache_control(last) == ChatPin(0, 300.0, True)
    assert take_cache_control({"messages": [{"role": "user", "content": "q"}]}) is None


@pytest.mark.parametrize(
    "mark, message",
    [
        ({"type": "persistent"}, "type"),
        ({"type": "ephemeral", "ttl": "2h"}, "ttl"),
        ("yes", "must be an object"),
        ({"type": "ephemeral", "size": 3}, "unknown fields"),
    ],
)
def test_bad_cache_control_is_a_400(mark, message):
    with pytest.raises(ClientError, match=message) as e:
        take_cache_control({"messages": [{"role": "user", "content": "q", "cache_control": mark}]})
    assert e.value.status == 400


def test_pin_params_are_checked_and_tgi_carries_them():
    check_kv_params({"kvcache_pin_ttl": 300}, None)
    with pytest.raises(ClientError, match="kvcache_pin_ttl"):
        check_kv_params({"kvcache_pin_ttl": "1d"}, None)
    with pytest.raises(ClientError, match="not both"):
        check_kv_params({"kvcache_pin_ttl": 300}, ChatPin(0, 300.0, True))
    tgi = parse_tgi({"inputs": "x", "parameters": {"kv_transfer_params": {"kvcache_pin_ttl": 300}}})
    assert tgi_to_completion(tgi, "m")["kv_transfer_params"] == {"kvcache_pin_ttl": 300}


# -- inspect ---------------------------------------------------------------------------------
def test_inspect_lists_pins(tmp_path):
    env = env_for(tmp_path)
    (tmp_path / "l3").mkdir()
    cfg = build_cache_config(env)
    store = writer_store(cfg, NS)
    keys = chunk_keys(NS.chain_digest, list(range(16 * 4)), 16)
    assert store.pins.pin([NS.id], keys[:2], ENTRY, 3600, tokens=32)[0]
    _put(store, keys)
    store.close()
    code, out = inspect(env)
    assert code == 0
    dram = next(line for line in out.splitlines() if line.startswith("dram ") and NS.id in line)
    assert dram.split()[-1] == "2"
    assert "pins: 1 live" in out and "2 chunks (32 tokens, 2,560 bytes), expires in 60.0m" in out
