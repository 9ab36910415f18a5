"""Policies by name: what ``KVCACHE_POLICY`` and ``--policy`` accept.

A leaf of the policy package's import graph above the policies themselves: it imports
each policy module (which import only ``cache.policy.base``), never the store or the
configuration, so ``cache.config`` can validate a name and the store's assembly can build
one without import cycles. Offline policies (``cache.policy.offline``) are not here: a
tier cannot know the future; the replay tool builds them itself.
"""

from __future__ import annotations

from typing import List

from .base import EvictionPolicy
from .classic import ARCPolicy, S3FIFOPolicy
from .lru import LRUPolicy
from .prefix_adaptive import PrefixAdaptivePolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, ARCPolicy, S3FIFOPolicy, PrefixAdaptivePolicy)
}
# Recommended default: see ``cache.policy.prefix_adaptive`` and ``bench/results/policy.md``.
DEFAULT_POLICY = PrefixAdaptivePolicy.name


def policy_names() -> List[str]:
    """Every name ``make_policy`` accepts, sorted."""
    return sorted(POLICIES)


def make_policy(name: str, *, last_tier: bool = True) -> EvictionPolicy:
    """Build a policy by its configured name (``KVCACHE_POLICY``).

    ``last_tier`` is the policy's role in a store (see ``EvictionPolicy.__init__``):
    ``False`` for tiers whose victims are demoted to a tier below; the default suits a
    single tier, the last local tier of a store, and the replay tool.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {policy_names()}") from None
    return cls(last_tier=last_tier)
