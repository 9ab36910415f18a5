"""Admission and eviction policies for the cache's tiers: pure logic, no I/O, clock-free.

- ``base``: the contract (``EvictionPolicy``) and the admit -> evict -> insert loop
  (``EvictionPolicy.offer``) that the store and the replay tool both run;
- ``registry``: policies by name (``make_policy``, ``policy_names``, ``DEFAULT_POLICY``);
- ``lru``, ``classic`` (ARC, S3-FIFO): the reference online policies;
- ``prefix_adaptive``: the recommended default (with its helpers ``sketch`` and ``slots``);
- ``offline``: Belady and the rate oracles, bounds for the replay tool only.

``python -m cache.tools.replay`` and ``bench/bench_policy.py`` compare them on traces.
"""

from .base import Decision, EvictionPolicy, Key, Offer
from .lru import LRUPolicy
from .registry import DEFAULT_POLICY, POLICIES, make_policy, policy_names

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "Decision",
    "EvictionPolicy",
    "Key",
    "LRUPolicy",
    "Offer",
    "make_policy",
    "policy_names",
]
