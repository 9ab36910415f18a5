"""Memory of an eviction policy per tracked chunk, measured with tracemalloc.

Runs offline on the CPU, in the calling process (``bench/bench_policy.py``,
``bench/bench_policy_sampling.py`` and ``tests/test_policy.py`` call it); a few seconds
per measurement. A policy is driven to a full tier of ``n`` one-block chunks in chains
of ``chain`` and churned through three times that many keys; keys are created before
tracing starts (a store owns its keys), so what is counted is what the policy allocates:
arrays, index, sketch, ghosts, experts.
"""

from __future__ import annotations

import tracemalloc
from typing import Callable, Tuple

from cache.policy import EvictionPolicy, make_policy
from cache.policy.panel import ExpertPanel
from cache.policy.prefix_adaptive import PrefixAdaptivePolicy


def traced_bytes(make: Callable[[], EvictionPolicy], n: int, chain: int = 8) -> Tuple[int, int]:
    """Bytes traced, and chunks resident, with the policy ``make()`` builds full at ``n``
    chunks and churning."""
    keys = list(range(10**9, 10**9 + 3 * n))
    tracemalloc.start()
    try:
        p = make()
        for i in range(0, len(keys), chain):
            parent = None
            for k in keys[i : i + chain]:
                if not p.admit(k, parent, 1):
                    break
                while len(p) >= n:
                    p.remove(p.victim())
                p.insert(k, parent, 1)
                parent = k
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return used, len(p)


def memory_per_chunk(policy_name: str, n: int = 50_000, chain: int = 8) -> float:
    """Bytes traced per resident chunk of ``policy_name`` full at ``n`` chunks."""
    used, resident = traced_bytes(lambda: make_policy(policy_name), n, chain)
    return used / resident


def sampled_adaptive(sampled_slots: int, leader: str = "s3fifo") -> Callable[[], PrefixAdaptivePolicy]:
    """A ``prefix-adaptive`` builder whose experts are sampled beyond ``sampled_slots``,
    starting with ``leader`` (S3-FIFO: the largest full-scale policy measured, its ghosts
    included)."""

    def make() -> PrefixAdaptivePolicy:
        p = PrefixAdaptivePolicy()
        p.panel.SAMPLED_SLOTS = sampled_slots
        p.panel.lead = p.panel.names.index(leader)
        return p

    return make


def adaptive_cost(n: int = 4000, sampled_slots: int = 256, leader: str = "s3fifo") -> Tuple[float, float]:
    """``prefix-adaptive``'s memory as bytes per tracked chunk and a fixed cost, with
    sampling active and ``leader`` mirrored: the per-chunk cost is the difference between
    tiers of ``n`` and ``2 n`` chunks (the experts, sampled to the same size in both,
    cancel out); the fixed cost is what is left at ``n`` chunks, scaled from
    ``sampled_slots`` to the default ``ExpertPanel.SAMPLED_SLOTS`` (the experts' size
    grows with it)."""
    make = sampled_adaptive(sampled_slots, leader)
    b1, n1 = traced_bytes(make, n)
    b2, n2 = traced_bytes(make, 2 * n)
    per_chunk = (b2 - b1) / (n2 - n1)
    fixed = max(0.0, b1 - per_chunk * n1) * ExpertPanel.SAMPLED_SLOTS / sampled_slots
    return per_chunk, fixed
