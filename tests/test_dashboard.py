"""The Grafana dashboard (``deploy/grafana/kvcache.json``) without a server: it loads, every
query names series, and those series are ones this code exports. The check against a real
server's ``/metrics`` and a real Prometheus answering each query is in
``tests/test_server.py``."""

import json
import re

import pytest

from bench.capacity import DASHBOARD_PANEL, RESULTS, dashboard_text
from bench.dashboard import DASHBOARD, exported_names, metric_names, queries, set_text_panel
from tests.conftest import REPO


def test_promql_names():
    expr = (
        "histogram_quantile(0.95, sum by (le, prefix_source) (rate(kvcache_time_to_first_token_seconds_bucket"
        '{tier!="x:y", a=~"b|c"}[$__rate_interval]))) / on (tier) group_left max without (engine) '
        "(kvcache:tier_used_bytes offset 5m) > bool 1e3"
    )
    assert metric_names(expr) == {"kvcache_time_to_first_token_seconds_bucket", "kvcache:tier_used_bytes"}
    text = (
        "# HELP kvcache:tier_hits_total x\n# TYPE kvcache:tier_hits_total counter\n"
        '# TYPE kvcache_request_kv_bytes histogram\nvllm:num_requests_running{a="b"} 1.0\n'
    )
    expected = {"kvcache:tier_hits_total", "kvcache_request_kv_bytes_bucket", "vllm:num_requests_running"}
    assert expected <= exported_names(text)


def test_every_panel_has_queries_over_our_series():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["panels"] and all(p["targets"] for p in dash["panels"] if p["type"] != "text")
    sources = "\n".join(p.read_text() for p in (REPO / "cache").rglob("*.py")) + "\n".join(
        p.read_text() for p in (REPO / "serving").rglob("*.py")
    )
    for title, _legend, expr in queries():
        names = metric_names(expr)
        assert names, (title, expr)
        for name in names:
            if name.startswith("vllm:"):
                continue  # vLLM's own; checked against a server's /metrics in test_server.py
            base = re.sub(r"_(total|bucket|sum|count)$", "", name)
            assert (
                f'"{base}' in sources
                or f'"{name}' in sources
                or "kvcache:tier_{field}" in sources
                and base.startswith("kvcache:tier_")
            ), (title, name)
    # each subject the issue names has a panel
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for subject in (
        "hit ratio",
        "tokens served per tier",
        "time to first token",
        "misses by cause",
        "tier usage",
        "evictions",
        "shared tier health",
        "kv bytes per request",
        "energy per generated token",
        "miss-ratio curves",
        "capacity curve",
        "requests measured per band",
        "capacity measured by the benchmark",
    ):
        assert subject in titles, subject


def test_capacity_panel_shows_the_committed_capacity_results():
    """The text panel is what ``bench.capacity`` writes from bench/results/capacity.json: a
    run that changed the results and not the dashboard (or a hand edit) fails here."""
    panels = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["title"] == DASHBOARD_PANEL]
    assert len(panels) == 1 and panels[0]["type"] == "text"
    committed = json.loads((RESULTS / "capacity.json").read_text())
    assert panels[0]["options"]["content"] == dashboard_text(committed)
    for wname in committed["workloads"]:
        assert f"**{wname}**" in panels[0]["options"]["content"]


def test_set_text_panel_rewrites_one_panel_only(tmp_path):
    path = tmp_path / "dash.json"
    path.write_text(DASHBOARD.read_text())
    set_text_panel(DASHBOARD_PANEL, "| new | table |", path)
    before, after = json.loads(DASHBOARD.read_text()), json.loads(path.read_text())
    changed = [(a["title"], b["title"]) for a, b in zip(before["panels"], after["panels"]) if a != b]
    assert changed == [(DASHBOARD_PANEL, DASHBOARD_PANEL)]
    assert next(p for p in after["panels"] if p["title"] == DASHBOARD_PANEL)["options"]["content"] == "| new | table |"
    with pytest.raises(ValueError, match="one text panel titled 'nope'"):
        set_text_panel("nope", "x", path)


def test_live_capacity_curve_queries_the_load_histogram_by_band():
    """The live curve: TTFT p90 per band of requests in flight over the time range, and the
    requests each band rests on (series of serving/metrics.py)."""
    got = {title: expr for title, _legend, expr in queries() if title.startswith("Capacity curve")}
    assert len(got) == 2
    for expr in got.values():
        assert metric_names(expr) <= {
            "kvcache_time_to_first_token_by_load_seconds_bucket",
            "kvcache_time_to_first_token_by_load_seconds_count",
        }
        assert "by (le, in_flight)" in expr or "by (in_flight)" in expr
        assert "$__range" in expr
