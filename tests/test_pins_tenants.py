"""Pins per tenant (``cache.pins``): one tenant filling its budget cannot make another's pin
fail, a refusal names only the asking tenant's own bytes, the pin file never holds a
salt, and pins reach ``/metrics`` without telling tenants apart."""

from __future__ import annotations

import functools
import json
import re
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cache.config import CacheConfig, build_cache_config
from cache.errors import ConfigError
from cache.pins import UNSALTED, PinBook, tenant_id
from cache.tiers.layout import PINS_FILE
from cache.vllm.metrics import TieredKVPromMetrics, TieredKVStats
from cache.vllm.pinning import Pinner
from serving.metrics import ServingMetrics

ENTRY = 1000  # bytes of one entry: round numbers in the refusals
A, B, C = tenant_id("salt-a"), tenant_id("salt-b"), tenant_id("salt-c")


def numbers(text: str) -> set[int]:
    return {int(n.replace(",", "")) for n in re.findall(r"\d[\d,]*", text)}


def book(tmp_path, tenant_share: float = 0.25) -> PinBook:
    # 200 entries of capacity, half of it for pins (100), a quarter of that per tenant (25)
    return PinBook(str(tmp_path), 200 * ENTRY, 0.5, tenant_share=tenant_share)


def keys(tag: str, n: int) -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


def test_one_tenant_filling_its_budget_cannot_block_another(tmp_path):
    b = book(tmp_path)
    assert b.tenant_limit == 25 * ENTRY
    assert b.pin(["ns"], keys("a", 20), ENTRY, 3600, tenant=A).pinned
    assert b.pin(["ns"], keys("a2-", 5), ENTRY, 3600, tenant=A).pinned  # A's budget, full
    refused = b.pin(["ns"], keys("a3-", 1), ENTRY, 3600, tenant=A)
    assert not refused.pinned and refused.refusal == "tenant_budget"
    # A's 24-hour pins change nothing for the others: each has a budget of its own
    for tenant, tag in ((B, "b"), (C, "c"), (UNSALTED, "u")):
        result = b.pin(["ns"], keys(tag, 25), ENTRY, 60, tenant=tenant)
        assert result.pinned, result.reason
    # Four full budgets hold the whole allowance: only now is a fifth tenant refused,
    # and by the tier's bound, with nothing of the others' in the reason.
    last = b.pin(["ns"], keys("d", 1), ENTRY, 60, tenant=tenant_id("salt-d"))
    assert not last.pinned and last.refusal == "tier_budget"
    assert numbers(last.reason) <= {1, ENTRY, 0, 25 * ENTRY}, last.reason
    assert b.usage() == (100 * ENTRY, 5)


def test_a_refusal_names_only_the_asking_tenants_bytes(tmp_path):
    b = book(tmp_path)
    assert b.pin(["ns"], keys("a", 23), ENTRY, 3600, tenant=A).pinned  # 23,000: A's bytes
    assert b.pin(["ns"], keys("b", 7), ENTRY, 3600, tenant=B).pinned  # 7,000: B's bytes
    refused = b.pin(["ns"], keys("b2-", 19), ENTRY, 3600, tenant=B)
    assert not refused.pinned and refused.refusal == "tenant_budget"
    # B's own: asked 19 chunks (19,000 bytes), would reach 26,000, holds 7,000 of 25,000
    assert numbers(refused.reason) == {19, 19_000, 26_000, 7_000, 25_000, 0, 25}, refused.reason  # (0.25)
    assert "this tenant holds 7,000 pinned bytes now, of a budget of 25,000" in refused.reason
    for others in ("23,000", "30,000", "100,000", "200,000"):  # A's, the total, the allowance, the tier
        assert others not in refused.reason


def test_the_same_chunks_pinned_again_by_their_tenant_count_once(tmp_path):
    b = book(tmp_path)
    assert b.pin(["ns"], keys("a", 25), ENTRY, 60, tenant=A).pinned
    again = b.pin(["ns"], keys("a", 25), ENTRY, 600, tenant=A)  # renewed, no new bytes
    assert again.pinned and len(b.live()) == 1 and b.live()[0].expires == again.expires


def test_the_pin_file_names_tenants_by_digest_never_by_salt(tmp_path):
    b = book(tmp_path)
    assert b.pin(["ns"], ["k"], ENTRY, 60, tenant=tenant_id("my secret salt")).pinned
    text = (tmp_path / PINS_FILE).read_text()
    assert "my secret salt" not in text
    assert json.loads(text)["pins"][0]["tenant"] == tenant_id("my secret salt")
    assert tenant_id(None) == tenant_id("") == UNSALTED
    assert tenant_id("s") != tenant_id("t") and tenant_id("s", "key") != tenant_id("s")
    # a pin file written before tenants existed: its pins are the unsalted tenant's
    (tmp_path / PINS_FILE).write_text(
        json.dumps(
            {
                "format": 1,
                "pins": [{"namespaces": ["ns"], "keys": ["old"], "entry_bytes": ENTRY, "expires": 4e9, "created": 1.0}],
            }
        )
    )
    assert [p.tenant for p in b.live()] == [UNSALTED]


def test_tenant_share_setting():
    env = {"KVCACHE_DRAM_SIZE": "0", "KVCACHE_DISK_SIZE": "0"}
    assert build_cache_config(env).pin_tenant_max == 0.25 == CacheConfig().pin_tenant_max
    cfg = build_cache_config({**env, "KVCACHE_PIN_TENANT_MAX": "10%"})
    assert cfg.pin_tenant_max == 0.1 and CacheConfig.from_dict(cfg.to_dict()).pin_tenant_max == 0.1
    assert build_cache_config({**env, "KVCACHE_PIN_TENANT_MAX": "1"}).pin_tenant_max == 1.0
    for bad in ("0", "1.5", "-0.1", "all"):
        with pytest.raises(ConfigError, match="KVCACHE_PIN_TENANT_MAX"):
            build_cache_config({**env, "KVCACHE_PIN_TENANT_MAX": bad})


def _chunks(n: int, tag: str):
    return [SimpleNamespace(keys=(f"{tag}{i}",), start=i * 16, end=(i + 1) * 16) for i in range(n)]


def test_the_pinner_pins_for_the_requests_salt_and_counts_outcomes(tmp_path):
    cfg = CacheConfig(disk_path=str(tmp_path), disk_bytes=16 * ENTRY, pin_max=0.5, pin_tenant_max=0.5)
    pinner = Pinner(cfg, ["ns0"], ENTRY)  # 8 entries for pins, 4 per tenant

    def ask(req_id, n, salt=None, tag=None, **params):
        req = SimpleNamespace(request_id=req_id, cache_salt=salt, kv_transfer_params={"kvcache_pin_ttl": 60, **params})
        pinner.offer(req, _chunks(n, tag or req_id), n * 16)
        return pinner.finished(req)

    assert ask("r1", 4, salt="tenant-a")["pinned"]
    refused = ask("r2", 1, salt="tenant-a")
    assert not refused["pinned"] and "this tenant holds 4,000" in refused["reason"]
    assert ask("r3", 4, salt="tenant-b")["pinned"]  # tenant-a's full budget blocks nobody
    assert not ask("r4", 1)["pinned"]  # the allowance is full (8 entries)
    assert not ask("r5", 1, kvcache_pin_tokens=0)["pinned"]  # a bad request
    tenants = {p.tenant for p in PinBook(str(tmp_path), 16 * ENTRY, 0.5).live()}
    assert tenants == {tenant_id("tenant-a"), tenant_id("tenant-b")}
    assert pinner.stats() == {
        "pin:pinned.requests": 2,
        "pin:tenant_budget.requests": 1,
        "pin:tier_budget.requests": 1,
        "pin:bad_request.requests": 1,
    }
    assert pinner.stats() == {}  # counted once


def test_pin_outcomes_reach_prometheus_by_outcome():
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = TieredKVPromMetrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    report = {"pin:pinned.requests": 2, "pin:tenant_budget.requests": 1}
    prom.observe(TieredKVStats(data=dict(report)).aggregate(TieredKVStats(data=dict(report))).reduce())
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("kvcache:pin_requests_total", {**labels, "outcome": "pinned"}) == 4
    assert registry.get_sample_value("kvcache:pin_requests_total", {**labels, "outcome": "tenant_budget"}) == 2


def test_pinned_bytes_are_on_metrics_every_tenant_together(tmp_path):
    b = book(tmp_path)
    assert b.pin(["ns"], keys("a", 20), ENTRY, 3600, tenant=A).pinned
    assert b.pin(["ns"], keys("b", 3), ENTRY, 3600, tenant=B).pinned
    metrics = ServingMetrics(None, ("dram", "disk"), pins=(book(tmp_path), "disk"))
    text = generate_latest(metrics.registry).decode()
    assert 'kvcache_pinned_bytes{tier="disk"} 23000.0' in text
    assert 'kvcache_pins{tier="disk"} 2.0' in text
    assert 'kvcache_pin_limit_bytes{tier="disk"} 100000.0' in text
    assert 'kvcache_pin_tenant_limit_bytes{tier="disk"} 25000.0' in text
    assert "tenant" not in re.sub(r"(?m)^#.*$", "", text).replace("pin_tenant_limit", "")
    assert A not in text and B not in text
    # a pin that expires is gone from the next scrape without anything else happening
    b.clock = lambda: 4e9
    assert b.pin(["ns"], ["c"], ENTRY, 60, tenant=C).pinned
    text = generate_latest(metrics.registry).decode()
    assert 'kvcache_pinned_bytes{tier="disk"} 1000.0' in text
