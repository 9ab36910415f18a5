"""The benchmarks' result files: a run of some scenarios keeps the saved rows it did not
measure (bench.ttft_partial, bench.ttft_saved for bench.bench_ttft), and a sweep row's
load estimates come from the connector's metric deltas. No engine (pure functions over
dicts and a bare Bench-like holder; the engine's metric reader over a registry)."""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter

from bench import ttft_engine, ttft_partial, ttft_saved
from bench.bench_ttft import Row


def _partial(tier: str, prefix: int, suffix: int, ms: float) -> dict:
    return {"tier": tier, "prefix": prefix, "suffix": suffix, "median_ms": ms}


def _sweep(cap: float, ms: float) -> dict:
    return {"cap": cap, "median_ms": ms}


def test_sweep_only_run_keeps_partial_rows_and_other_caps():
    old = {
        "partial": [_partial("l3", 4096, 64, 1.0), _partial("dram", 1024, 512, 2.0)],
        "sweep": [_sweep(1e8, 10.0), _sweep(2.5e7, 20.0)],
    }
    new = {"partial": [], "sweep": [_sweep(1.8e9, 3.0), _sweep(1e8, 11.0)]}
    merged = ttft_partial.merge_saved(new, old, ["sweep"], [4096], [1.8e9, 1e8])
    assert [(r["tier"], r["prefix"]) for r in merged["partial"]] == [("dram", 1024), ("l3", 4096)]
    assert [(r["cap"], r["median_ms"]) for r in merged["sweep"]] == [(1.8e9, 3.0), (1e8, 11.0), (2.5e7, 20.0)]


def test_partial_run_replaces_only_its_tier_and_sizes():
    old = {
        "partial": [_partial("disk", 4096, 64, 1.0), _partial("disk", 8192, 64, 2.0), _partial("l3", 4096, 64, 3.0)],
        "sweep": [_sweep(1e8, 10.0)],
    }
    new = {"partial": [_partial("disk", 4096, 64, 9.0)], "sweep": []}
    merged = ttft_partial.merge_saved(new, old, ["partial-disk"], [4096], [1e8])
    assert [(r["tier"], r["prefix"], r["median_ms"]) for r in merged["partial"]] == [
        ("disk", 4096, 9.0),
        ("disk", 8192, 2.0),
        ("l3", 4096, 3.0),
    ]
    assert merged["sweep"] == [_sweep(1e8, 10.0)]


def test_load_estimates_per_load():
    metrics = {
        "kvcache:loads_total{mode=async}": 4.0,
        "kvcache:load_estimated_seconds_total{mode=async}": 0.2,
        "kvcache:load_estimated_actual_seconds_total{mode=async}": 0.3,
        "kvcache:loads_cut_short_total{mode=async}": 1.0,
        "kvcache:requests_by_path_total{path=load}": 4.0,
    }
    est = ttft_partial.load_estimates(metrics)
    assert est["loads"] == 4 and est["cut_short"] == 1
    assert abs(est["estimate_ms"] - 50.0) < 1e-9 and abs(est["actual_ms"] - 75.0) < 1e-9
    assert ttft_partial.load_estimates({"kvcache:requests_by_path_total{path=recompute}": 5.0}) == {"loads": 0}
    assert ttft_partial.load_estimates({}) == {}


def test_markdown_shows_rows_with_and_without_estimates():
    base = {
        "size": 4096,
        "samples_ms": [1.0],
        "loaded": [4095],
        "recompute_ms": 100.0,
        "full_load_ms": 50.0,
        "floor_ms": 50.0,
        "vs_floor": 1.0,
        "worst_vs_recompute": 0.5,
        "target": 1.1,
    }
    rows = [
        {
            **base,
            "cap": 1.8e9,
            "median_ms": 50.0,
            "load_estimates": {"loads": 5, "estimate_ms": 40.0, "actual_ms": 45.0, "cut_short": 0},
            "measured": {"utc": "2026-12-01 13:50", "loadavg_1m": [3.0, 3.5]},
        },
        {**base, "cap": 2.5e7, "median_ms": 50.0},
    ]
    text = "\n".join(ttft_partial.markdown({"sweep": rows}))
    assert "| 40.0 / 45.0 | 2026-12-01 13:50, load 3.0–3.5 |" in text
    assert "| – | – |" in text


def test_engine_reads_kvcache_samples_from_the_registry():
    counter = Counter("kvcache:bench_probe", "test only", ["mode", "engine"], registry=REGISTRY)
    try:
        counter.labels(mode="async", engine="0").inc(2)
        samples = ttft_engine.kvcache_samples()
        assert samples["kvcache:bench_probe_total{mode=async}"] == 2.0
        assert not any(k.endswith("_created") or "_created{" in k for k in samples)
    finally:
        REGISTRY.unregister(counter)


class _Bench:
    """What ``ttft_saved`` uses of ``bench_ttft.Bench``."""

    def __init__(self, sizes):
        self.sizes, self.rows, self.measured = sizes, {}, {}


def _saved_row(scenario: str, size: int, ms: list, **extra) -> dict:
    return {
        "scenario": scenario,
        "size": size,
        "samples_ms": ms,
        "hit_tokens": [size - 1] * len(ms),
        "detail": [{"loadavg_1m": 1.0}] * len(ms),
        "error": "",
        **extra,
    }


def test_restore_keeps_rows_not_measured_now_and_their_stamps():
    bench = _Bench([1024, 4096])
    bench.rows[("ours-dram", 1024)] = Row("ours-dram", 1024, samples_s=[0.02])
    saved = {
        "summary": {
            "table": [
                _saved_row("ours-dram", 1024, [30.0]),  # measured again now: not restored
                _saved_row("lmcache-dram", 1024, [90.0, 100.0]),
                _saved_row("example-warm", 4096, [120.0], measured="2026-11-30 15:59 UTC"),
                _saved_row("lmcache-dram", 8192, [200.0]),  # a size not in this run
            ],
            "throughput": {"rounds": {"with-0": [{"tokens_per_s": 1.0}]}},
        }
    }
    restored = ttft_saved.restore_rows(bench, saved, Row, throughput_run=False)
    assert restored == ["example-warm", "lmcache-dram"]
    assert bench.rows[("ours-dram", 1024)].samples_s == [0.02]
    assert bench.rows[("lmcache-dram", 1024)].samples_s == [0.09, 0.1]
    assert ("lmcache-dram", 8192) not in bench.rows
    assert bench.tput == {"with-0": [{"tokens_per_s": 1.0}]}
    table = [{"scenario": n, "size": z} for n, z in bench.rows]
    ttft_saved.stamp_rows(bench, table)
    stamps = {(r["scenario"], r["size"]): r["measured"] for r in table}
    assert stamps[("lmcache-dram", 1024)] == ttft_saved.EARLIER
    assert stamps[("example-warm", 4096)] == "2026-11-30 15:59 UTC"
    assert stamps[("ours-dram", 1024)].endswith("UTC") and stamps[("ours-dram", 1024)] != ttft_saved.EARLIER


def test_restore_leaves_a_new_throughput_run_alone():
    bench = _Bench([1024])
    bench.tput = {"with-0": [{"tokens_per_s": 2.0}]}
    saved = {"summary": {"table": [], "throughput": {"rounds": {"with-0": [{"tokens_per_s": 1.0}]}}}}
    ttft_saved.restore_rows(bench, saved, Row, throughput_run=True)
    assert bench.tput == {"with-0": [{"tokens_per_s": 2.0}]}
