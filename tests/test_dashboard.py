"""The Grafana dashboard (``deploy/grafana/kvcache.json``) without a server: it loads, every
query names series, and those series are ones this code exports. The check against a real
server's ``/metrics`` and a real Prometheus answering each query is in
``tests/test_server.py``."""

import json
import re

from bench.dashboard import DASHBOARD, exported_names, metric_names, queries
from tests.conftest import REPO


def test_promql_names():
    expr = ('histogram_quantile(0.95, sum by (le, prefix_source) (rate(kvcache_time_to_first_token_seconds_bucket'
            '{tier!="x:y", a=~"b|c"}[$__rate_interval]))) / on (tier) group_left max without (engine) '
            '(kvcache:tier_used_bytes offset 5m) > bool 1e3')
    assert metric_names(expr) == {"kvcache_time_to_first_token_seconds_bucket", "kvcache:tier_used_bytes"}
    text = ("# HELP kvcache:tier_hits_total x\n# TYPE kvcache:tier_hits_total counter\n"
            "# TYPE kvcache_request_kv_bytes histogram\nvllm:num_requests_running{a=\"b\"} 1.0\n")
    expected = {"kvcache:tier_hits_total", "kvcache_request_kv_bytes_bucket", "vllm:num_requests_running"}
    assert expected <= exported_names(text)


def test_every_panel_has_queries_over_our_series():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["panels"] and all(p["targets"] for p in dash["panels"])
    sources = "\n".join(p.read_text() for p in (REPO / "cache").rglob("*.py")) + \
        "\n".join(p.read_text() for p in (REPO / "serving").rglob("*.py"))
    for title, _legend, expr in queries():
        names = metric_names(expr)
        assert names, (title, expr)
        for name in names:
            if name.startswith("vllm:"):
                continue  # vLLM's own; checked against a server's /metrics in test_server.py
            base = re.sub(r"_(total|bucket|sum|count)$", "", name)
            assert f'"{base}' in sources or f'"{name}' in sources or \
                'kvcache:tier_{field}' in sources and base.startswith("kvcache:tier_"), (title, name)
    # each subject the issue names has a panel
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for subject in ("hit ratio", "tokens served per tier", "time to first token", "misses by cause",
                    "tier usage", "evictions", "shared tier health", "kv bytes per request",
                    "energy per generated token", "miss-ratio curves"):
        assert subject in titles, subject
