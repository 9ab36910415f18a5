"""What a store counts and tells: per-tier statistics, failure accounting and chunk events.

``Accounting`` is shared by every part of a ``TieredStore`` (reads, the writer, the
publisher) and runs on whichever thread calls it: O(1), never I/O (log lines aside, at most
one a minute per tier; a failed write is logged once per episode by ``cache.faults``).
``on_event(key, event, tier)``: what happened to a chunk (stored, evicted, not_admitted,
damaged, ...; ``cache.explain``), on the thread it happened on.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from cache.faults import WriteFaults
from cache.tiers.base import Tier

log = logging.getLogger("cache.store")

WARN_INTERVAL_S = 60.0

EventSink = Callable[[str, str, str], None]


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    rejected: int = 0  # refused by admission
    corrupt: int = 0
    errors: int = 0
    timeouts: int = 0  # reads/writes past the tier's deadline (also in errors)
    unavailable: int = 0  # calls refused or failed while the tier is unreachable
    load_seconds: float = 0.0
    tokens_loaded: int = 0  # counted by the connector: prompt tokens served from here
    persisted: int = 0  # reused entries copied down into this tier (durability)


@dataclass
class StoreStats:
    tiers: dict[str, TierStats] = field(default_factory=dict)
    dropped_writes: int = 0  # write-behind queue full: dropped rather than block
    dropped_publishes: int = 0  # shared-tier queue full: dropped rather than block


class Accounting:
    """Statistics (``stats``), write failures (``faults``) and chunk events of one store."""

    def __init__(self, tier_names: Sequence[str], on_event: Optional[EventSink] = None) -> None:
        self.stats = StoreStats({name: TierStats() for name in tier_names})
        self.faults = WriteFaults()
        self.on_event = on_event
        self._warned: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def tier(self, name: str) -> TierStats:
        return self.stats.tiers[name]

    def note(self, key: str, event: str, tier: str) -> None:
        """Tell ``on_event`` what happened to ``key`` in ``tier`` (a name, or ``all``/``none``)."""
        if self.on_event is not None:
            self.on_event(key, event, tier)

    def succeeded(self, tier: str) -> None:
        """A write to ``tier`` worked (ends a failure episode)."""
        self.faults.succeeded(tier)

    def failed(self, tier: Tier, doing: str, key: str, e: Exception) -> None:
        """Count a tier failure while ``doing`` (``reading``/``writing``) ``key``; log it (at
        most once a minute per tier; a write: once per episode, with its cause). Connection
        trouble and deadlines are the shared tier's to report (once per outage)."""
        st = self.stats.tiers[tier.name]
        reading = doing == "reading"
        if doing == "writing":
            self.faults.failed(tier.name, e)
        if isinstance(e, ConnectionError):
            st.unavailable += 1
            self.note(key, "shared_unreachable", tier.name)
            return
        st.errors += 1
        if isinstance(e, TimeoutError):
            st.timeouts += 1
            self.note(key, "load_timeout" if reading else "shared_unreachable", tier.name)
            return
        self.note(key, "damaged" if reading else "not_admitted", tier.name)
        if doing == "writing":
            return  # logged by ``faults`` once per episode
        self.warn(tier.name, "kvcache: %s %s in %s failed: %s", doing, key, tier.name, e)

    def warn(self, tier_name: str, fmt: str, *args) -> None:
        """Log a warning about ``tier_name``, at most once a minute (then how many were held back)."""
        now = time.monotonic()
        with self._lock:
            last, suppressed = self._warned.get(tier_name, (-WARN_INTERVAL_S, 0))
            if now - last < WARN_INTERVAL_S:
                self._warned[tier_name] = (last, suppressed + 1)
                return
            self._warned[tier_name] = (now, 0)
        if suppressed:
            fmt += " (%d more since the last message)"
            args += (suppressed,)
        log.warning(fmt, *args)

    def counters(self, dropped_persists: int) -> dict[str, float]:
        """Running totals, flat: ``{"<tier>.<counter>": n, "all.dropped_writes": n, ...,
        "write_failure:<cause>:<tier>": n}``."""
        # (vars, not dataclasses.asdict: this runs every engine step, and asdict's deep copy is 9x slower)
        out: dict[str, float] = {f"{name}.{k}": v for name, st in self.stats.tiers.items() for k, v in vars(st).items()}
        out["all.dropped_writes"] = self.stats.dropped_writes
        out["all.dropped_publishes"] = self.stats.dropped_publishes
        out["all.dropped_persists"] = dropped_persists
        out.update(self.faults.counters())
        return out
