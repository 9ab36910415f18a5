"""``python -m cache.tools.advise``: the knee, the saving priced with the cost model's
rates, a server's /metrics read back, and a trace's curves. CPU only, seconds."""

from __future__ import annotations

import functools
import subprocess
import sys
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cache.cost import attention_pairs
from cache.curves import SIZES
from cache.tools.advise import Rates, advise, from_metrics, knee, render, saving
from tests.conftest import REPO


def curve(*values):
    return dict(zip(SIZES, values))


def test_the_knee_is_where_no_later_doubling_adds_the_gain():
    assert knee(curve(0.02, 0.04, 0.08, 0.14, 0.22, 0.37)) == ("8", True)  # still rising
    assert knee(curve(0.10, 0.20, 0.30, 0.31, 0.315, 0.32)) == ("1", False)  # flat past 1x
    assert knee(curve(0.01, 0.015, 0.02, 0.30, 0.305, 0.31)) == ("2", False)  # late rise counts
    assert knee(curve(*[0.5] * 6)) == ("0.25", False)  # nothing to win
    assert knee(curve(0.10, 0.20, 0.30, 0.31, 0.315, 0.32), gain=0.004) == ("8", True)


def test_saving_is_prefill_of_the_new_hit_less_loading_it():
    rates = Rates(
        prefill_per_token=1e-4, prefill_per_pair=1e-8, load_per_token={"dram": 1e-5}, load_latency={"dram": 0.002}
    )
    n = 10_000
    got = saving("dram", 0.2, 0.5, n, rates)
    pairs = attention_pairs(n - 2000, 2000) - attention_pairs(n - 5000, 5000)
    assert got == pytest.approx(1e-4 * 3000 + 1e-8 * pairs - 1e-5 * 3000)
    # from no hit at all, the first load pays its latency once
    assert saving("dram", 0.0, 0.5, n, rates) == pytest.approx(
        1e-4 * 5000 + 1e-8 * (attention_pairs(n, 0) - attention_pairs(5000, 5000)) - 1e-5 * 5000 - 0.002
    )
    assert saving("disk", 0.2, 0.5, n, rates) is None  # no rate for that tier yet
    assert saving("dram", 0.2, 0.5, n, Rates()) is None


def metrics_page() -> str:
    """A /metrics page made by the connector's own Prometheus metrics, with vLLM's prompt
    histogram beside it (as a server's page has both)."""
    from cache.vllm.metrics import TieredKVPromMetrics

    registry = CollectorRegistry()
    kinds = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = TieredKVPromMetrics(
        SimpleNamespace(kv_transfer_config=None), kinds, ["model_name", "engine"], {0: ["m", "0"]}
    )
    data = {f"curve:dram:{s}.hit_ratio": v for s, v in zip(SIZES, (0.05, 0.1, 0.2, 0.4, 0.41, 0.415))}
    data.update(
        {
            "curve:dram.tokens": 10_000,
            "curve:dram.sample_rate": 0.25,
            "dram.capacity_bytes": 1 << 30,
            "cost:dram.load_latency_seconds": 0.001,
            "cost:dram.load_seconds_per_token": 2e-6,
            "cost:prefill.seconds_per_token": 1e-4,
            "cost:prefill.seconds_per_pair": 0.0,
        }
    )
    prom.observe(data, 0)
    prompts = Histogram(
        "vllm:request_prompt_tokens", "prompt tokens", ["model_name"], registry=registry, buckets=(1000, 10000)
    )
    for n in (2000, 4000):
        prompts.labels("m").observe(n)
    return generate_latest(registry).decode()


def test_a_servers_metrics_give_curves_sizes_rates_and_the_mean_prompt():
    curves, capacity, rates, prompt = from_metrics(metrics_page())
    assert curves == {"dram": curve(0.05, 0.1, 0.2, 0.4, 0.41, 0.415)}
    assert capacity == {"dram": 1 << 30} and prompt == 3000
    assert rates.prefill_per_token == 1e-4 and rates.load_per_token == {"dram": 2e-6}
    (a,) = advise(curves, capacity, rates, prompt)
    assert (a.knee, a.rising) == ("2", False)
    assert a.saving_s == pytest.approx((1e-4 - 2e-6) * 0.2 * 3000)
    text = render([a], prompt)
    assert "dram: now 1.0 GiB, serving 20.0% of prompt tokens" in text
    assert "knee at 2x = 2.0 GiB" in text and "-0.059 s per request" in text


def test_the_command_advises_from_a_saved_page(tmp_path):
    page = tmp_path / "metrics.txt"
    page.write_text(metrics_page())
    out = subprocess.run(
        [sys.executable, "-m", "cache.tools.advise", "--metrics", str(page)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "knee at 2x = 2.0 GiB" in out.stdout and "-0.059 s per request" in out.stdout
    page.write_text("# nothing here\n")
    out = subprocess.run(
        [sys.executable, "-m", "cache.tools.advise", "--metrics", str(page)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and "no curves" in out.stderr


def test_the_command_advises_from_a_workload(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cache.tools.advise",
            "--workload",
            "rag",
            "--scale",
            "0.05",
            "--tier",
            "dram=40",
            "--tier",
            "disk=200",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("dram: now 40 blocks, serving") and lines[3].startswith("disk: now 200 blocks")
    assert "knee at" in lines[1] and "unknown (no fitted rates yet" in lines[2]
    bad = subprocess.run(
        [sys.executable, "-m", "cache.tools.advise", "--workload", "rag", "--tier", "dram"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "NAME=BLOCKS" in bad.stderr
