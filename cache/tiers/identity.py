"""A tier's identity: its name, its storage medium and its locality, named once.

The names follow vLLM's KV offloading code (``vllm.v1.kv_offload.base``: ``Medium``,
``Locality``) and its KV cache events (``BlockStored.medium``: ``"CPU"``, ``"STORAGE"``), so
what a router reads of our tiers is what vLLM's own tiers say. A leaf module: no I/O, no
vLLM import; every tier carries its ``TierId`` (``Tier.id``) and the configuration names
each enabled tier's (``cache.config.TierSpec.id``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Medium(str, enum.Enum):
    """What holds a tier's bytes (vLLM's ``Medium`` values)."""

    CPU = "CPU"  # host memory (our DRAM tier: a tmpfs folder)
    STORAGE = "STORAGE"  # a filesystem: local NVMe, or a cluster's (Curvine)


class Locality(str, enum.Enum):
    """Where a tier is, seen from this engine (vLLM's ``Locality`` values)."""

    LOCAL = "LOCAL"  # this node's
    REMOTE = "REMOTE"  # shared by every node


@dataclass(frozen=True, order=True)
class TierId:
    """One tier's identity: ``name`` is its label in settings, logs, metrics and
    ``kv_transfer_params``.

    Ids order by speed, fastest first, whatever order a store lists its tiers in: by
    ``level`` (1: local memory, 2: local storage, 3: remote; ``L1``..``L3`` in the
    settings), then by name. So ``max`` of the tiers a chunk is found in is the slowest."""

    level: int = field(init=False, repr=False)  # from medium and locality: the first field, so it orders
    name: str
    medium: Medium
    locality: Locality

    def __post_init__(self) -> None:
        remote, memory = self.locality is Locality.REMOTE, self.medium is Medium.CPU
        object.__setattr__(self, "level", 3 if remote else 1 if memory else 2)

    @property
    def shared(self) -> bool:
        """A tier every node sees (L3): published to by rule, never evicted from by us."""
        return self.locality is Locality.REMOTE


DRAM = TierId("dram", Medium.CPU, Locality.LOCAL)  # L1
DISK = TierId("disk", Medium.STORAGE, Locality.LOCAL)  # L2
SHARED = TierId("shared", Medium.STORAGE, Locality.REMOTE)  # L3
KNOWN = {t.name: t for t in (DRAM, DISK, SHARED)}


def tier_id(name: str, shared: bool = False) -> TierId:
    """The identity of the tier called ``name``: one of ``KNOWN``, or (a test's tier) local
    storage, remote when ``shared``."""
    known = KNOWN.get(name)
    if known is not None:
        return known
    return TierId(name, Medium.STORAGE, Locality.REMOTE if shared else Locality.LOCAL)
