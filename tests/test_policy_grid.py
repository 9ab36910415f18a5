"""The policy robustness grid in reduced form (``bench/policy_grid.py``): every seeded
workload at a twentieth of the bench's size, at a small and a large capacity. Pure CPU,
no vLLM; about half a minute.

``prefix-adaptive`` must stay near the best of LRU, ARC and S3-FIFO on every cell. The
bench's full grid holds it to 0.005; these traces are 20 times shorter, so the cost of
learning which expert to mirror (a turnover after each switch) weighs 20 times more, and
the bound here is 0.02.
"""

from __future__ import annotations

import time

from bench.policy_grid import CLASSICS, grid_rows, workload_traces
from cache.policy import DEFAULT_POLICY
from cache.tools.workloads import WORKLOADS, generate

REDUCED_SCALE = 0.05
FRACTIONS = (0.02, 0.10)


def test_workloads_are_seeded_prefix_trees():
    for name in WORKLOADS:
        a, b = generate(name, 3, 0.02), generate(name, 3, 0.02)
        assert a == b and len(a) > 20, name  # same seed, same requests
        assert generate(name, 4, 0.02) != a, name
        parent = {}
        for r in a:
            assert r.input_length <= 512 * len(r.hash_ids)
            for i, k in enumerate(r.hash_ids):  # equal id, equal prefix
                assert parent.setdefault(k, r.hash_ids[i - 1] if i else None) == (r.hash_ids[i - 1] if i else None)
        assert [r.timestamp for r in a] == sorted(r.timestamp for r in a)


def test_reduced_grid_prefix_adaptive_never_far_below_the_best_classic():
    t0 = time.perf_counter()
    cells = grid_rows(workload_traces(REDUCED_SCALE), FRACTIONS, CLASSICS + (DEFAULT_POLICY,))
    worst = min(cells, key=lambda c: c.margin())
    print(
        f"reduced grid: {len(cells)} cells in {time.perf_counter() - t0:.1f}s, worst margin "
        f"{worst.margin():+.4f} ({worst.workload} at {worst.fraction:.0%})"
    )
    assert len(cells) == len(WORKLOADS) * len(FRACTIONS)
    for c in cells:
        assert c.margin() >= -0.02, (c.workload, c.fraction, c.ratio)
