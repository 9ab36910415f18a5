"""The trace replay tool: CLI contract, hit accounting, and policy orderings.

CPU only and fast; synthetic traces are written to ``tmp_path``. The real Mooncake trace
is used by one test that is skipped when ``../shared/traces`` is not there.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from cache.policy import DEFAULT_POLICY
from cache.tools.replay import OFFLINE, Request, load_trace, run

ROOT = Path(__file__).resolve().parents[1]
REAL_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
ONLINE = ("lru", "arc", "s3fifo", DEFAULT_POLICY)


def write_trace(path: Path, requests: List[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return path


def random_tree_trace(seed: int, n: int = 300) -> List[Request]:
    """Random prefix tree: a request cuts an earlier request at a random depth and
    appends 0-4 new blocks; partial last blocks (input_length not a multiple of 512)."""
    rng = random.Random(seed)
    paths: List[tuple] = []
    nxt = 0
    out = []
    for i in range(n):
        ids: List[int] = []
        if paths and rng.random() < 0.6:
            base = rng.choice(paths)
            ids = list(base[: rng.randint(1, len(base))])
        k = rng.randint(0 if ids else 1, 4)
        ids += range(nxt, nxt + k)
        nxt += k
        paths.append(tuple(ids))
        out.append(Request(float(i), 512 * len(ids) - rng.randint(0, 300), tuple(ids)))
    return out


def structured_trace(seed: int, n: int = 1500, docs: int = 30) -> List[Request]:
    """System prompt + Zipf-popular documents + a unique question; 35 % one-off chains."""
    rng = random.Random(seed)
    nxt = 10_000

    def fresh(k: int) -> List[int]:
        nonlocal nxt
        nxt += k
        return list(range(nxt - k, nxt))

    system = fresh(2)
    doc_blocks = [fresh(rng.randint(2, 8)) for _ in range(docs)]
    weights = [1.0 / (i + 1) for i in range(docs)]
    out = []
    for i in range(n):
        if rng.random() < 0.35:
            ids = fresh(rng.randint(1, 8))
        else:
            ids = system + doc_blocks[rng.choices(range(docs), weights)[0]] + fresh(1)
        out.append(Request(float(i), 512 * len(ids), tuple(ids)))
    return out


TINY = [
    {"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [1, 2, 3]},
    {"timestamp": 5, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 4]},
    {"timestamp": 5, "input_length": 1000, "output_length": 1, "hash_ids": [1, 2]},
    {"timestamp": 9, "input_length": 700, "output_length": 1, "hash_ids": [7, 2]},
]


def test_lru_hit_accounting_by_hand(tmp_path):
    reqs = load_trace(str(write_trace(tmp_path / "t.jsonl", TINY)))
    res = run(reqs, "lru", capacity_blocks=10)
    # req2 hits [1,2] = 1024 tokens; req3 hits [1,2] capped at input 1000; req4 hits none
    # (its leading block 7 is new, so block 2 does not count)
    assert res.hit_tokens == 1024 + 1000
    assert res.prompt_tokens == 1500 + 1100 + 1000 + 700
    assert res.token_hit_ratio == pytest.approx(2024 / 4300)


def test_cli_json(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", TINY)
    for policy in ("lru", "belady", "rate-oracle", "span-oracle", "ours", DEFAULT_POLICY):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "cache.tools.replay",
                str(trace),
                "--capacity-blocks",
                "10",
                "--policy",
                policy,
                "--json",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        obj = json.loads(out)
        for key in ("token_hit_ratio", "policy", "capacity_blocks", "requests", "hit_tokens", "prompt_tokens"):
            assert key in obj
        assert obj["requests"] == 4 and obj["capacity_blocks"] == 10
        assert obj["token_hit_ratio"] == pytest.approx(2024 / 4300)


def test_cli_default_policy_fraction_and_hints(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", TINY)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cache.tools.replay",
            str(trace),
            "--capacity-fraction",
            "0.5",
            "--hint-window-ms",
            "10",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    obj = json.loads(out)
    assert obj["policy"] == DEFAULT_POLICY
    assert obj["capacity_blocks"] == 2  # half of 5 distinct blocks, rounded down
    assert obj["hint_window_ms"] == 10
    text = subprocess.run(
        [sys.executable, "-m", "cache.tools.replay", str(trace), "--capacity-blocks", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "token_hit_ratio=" in text


@pytest.mark.parametrize("seed", range(6))
def test_belady_is_an_upper_bound(seed):
    trace = random_tree_trace(seed) if seed % 2 else structured_trace(seed, n=400)
    for cap in (4, 16, 48):
        best = run(trace, "belady", cap).token_hit_ratio
        for policy in ONLINE:
            assert run(trace, policy, cap).token_hit_ratio <= best + 1e-12, (policy, cap)


@pytest.mark.parametrize("seed", range(3))
def test_ours_beats_lru_on_a_structured_trace(seed):
    trace = structured_trace(seed)
    for cap in (20, 40, 80):
        lru = run(trace, "lru", cap).token_hit_ratio
        ours = run(trace, DEFAULT_POLICY, cap).token_hit_ratio
        assert ours >= lru, (cap, ours, lru)


def test_unbounded_capacity_is_policy_independent():
    trace = random_tree_trace(11)
    want = run(trace, "lru", 10**9).token_hit_ratio
    for policy in ONLINE + OFFLINE:
        assert run(trace, policy, 10**9).token_hit_ratio == pytest.approx(want)


@pytest.mark.skipif(not REAL_TRACE.exists(), reason="shared Mooncake trace not present")
def test_real_trace_reference_numbers():
    """bench/README.md's LRU figure at 2 % (878 blocks) and ours beating every baseline."""
    reqs = load_trace(str(REAL_TRACE))
    lru = run(reqs, "lru", 878).token_hit_ratio
    assert lru == pytest.approx(0.0773, abs=5e-4)
    ours = run(reqs, DEFAULT_POLICY, 878).token_hit_ratio
    assert ours >= max(lru, run(reqs, "arc", 878).token_hit_ratio, run(reqs, "s3fifo", 878).token_hit_ratio)


def _reuse_trace(gaps: List[int]) -> List[Request]:
    """Block 0 used after each gap (in requests); every other request uses a new block."""
    at = [0]
    for g in gaps:
        at.append(at[-1] + g)
    uses = set(at)
    return [Request(float(i), 512, (0,) if i in uses else (i + 1,)) for i in range(at[-1] + 1)]


def test_reuse_regularity_tells_memoryless_from_regular_and_bursty_reuse():
    """The bench's timing statistic (printed under the policy table): Poisson reuse
    reads a coefficient of variation near 1 and no correlation between gaps; evenly
    spaced reuse reads 0; runs of short gaps and of long gaps read above 1, correlated."""
    from bench.bench_policy import reuse_regularity

    rng = random.Random(0)
    poisson = reuse_regularity(_reuse_trace([1 + int(rng.expovariate(1 / 40)) for _ in range(3000)]))
    assert poisson["blocks"] == 1
    assert poisson["median_gap_cv"] == pytest.approx(1.0, abs=0.1)
    assert abs(poisson["lag1_log_gap_corr"]) < 0.1
    assert reuse_regularity(_reuse_trace([10] * 50))["median_gap_cv"] == 0.0
    bursty = reuse_regularity(_reuse_trace(([1] * 20 + [200] * 5) * 20))
    assert bursty["median_gap_cv"] > 1.5 and bursty["lag1_log_gap_corr"] > 0.5
    assert reuse_regularity(_reuse_trace([5] * 3))["blocks"] == 0  # fewer uses than min_uses
