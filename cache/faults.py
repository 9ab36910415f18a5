"""Tier write failures: each one counted per tier with a cause, and logged once per episode.

A write that fails (a full filesystem, a read-only or vanished folder, an I/O error, the
shared tier down) never fails a request: the entry is simply not stored there. What an
operator needs is to see it: ``kvcache:tier_write_failures_total{tier, cause}`` counts
every failure (``counters``, through the connector's stats pipeline, ``cache.vllm.metrics``),
and the log says when a tier's writes start failing (one line, with the cause) and when
they succeed again (one line, with how many failed meanwhile), never one line per write.
The shared tier's connection trouble (``cause`` ``unavailable``/``timeout``) is counted
here too, but logged by its circuit breaker (``cache.tiers.resilience``), once per outage.

Runs on the store's writer and publisher threads; every call is O(1) under a short lock,
never I/O (the log lines aside, two per episode).
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

log = logging.getLogger(__name__)

# errno -> cause label (a bounded set: the label values of a Prometheus series).
_CAUSES = {
    errno.ENOSPC: "no_space",
    errno.EDQUOT: "quota",
    errno.EROFS: "read_only",
    errno.EIO: "io_error",
    errno.EACCES: "permission",
    errno.EPERM: "permission",
    errno.ENOENT: "missing",
    errno.ENOTDIR: "missing",
    errno.EMFILE: "too_many_files",
    errno.ENFILE: "too_many_files",
    errno.EFBIG: "too_large",
    errno.ENOMEM: "no_memory",
}
# Causes the shared tier's breaker reports (once per outage): counted, not logged here.
BREAKER_CAUSES = ("unavailable", "timeout")
_TEXT = {
    "no_space": "no space left on the filesystem",
    "quota": "disk quota exceeded",
    "read_only": "read-only filesystem",
    "io_error": "I/O error",
    "permission": "permission denied",
    "missing": "folder missing",
    "too_many_files": "too many open files",
    "too_large": "file too large",
    "no_memory": "out of memory",
}


def cause_of(exc: BaseException) -> str:
    """The cause label of a failed write: the errno's name (``no_space`` for ENOSPC ...),
    looking through wrappers (the shared tier raises its own errors ``from`` the
    filesystem's); ``timeout``, ``unavailable`` (shared tier down), ``os_error`` (another
    errno) or ``other``."""
    seen: Optional[BaseException] = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _CAUSES:
            return _CAUSES[seen.errno]
        seen = seen.__cause__
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ConnectionError):
        return "unavailable"
    return "os_error" if isinstance(exc, OSError) else "other"


@dataclass
class _Episode:
    since: float
    causes: Counter = field(default_factory=Counter)


class WriteFaults:
    """Write failures of one store's tiers: counts by ``(tier, cause)`` and the open
    episodes (a tier whose last write failed)."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: Counter = Counter()  # (tier, cause) -> failures
        self._episodes: dict[str, _Episode] = {}  # tier -> its current failure episode

    def failed(self, tier: str, exc: BaseException) -> str:
        """Count a failed write to ``tier``; the first of an episode (and the first of each
        new cause within it) is logged. Returns the cause."""
        cause = cause_of(exc)
        with self._lock:
            self._counts[(tier, cause)] += 1
            if cause in BREAKER_CAUSES:
                return cause
            episode = self._episodes.get(tier)
            first = episode is None
            if episode is None:
                episode = self._episodes[tier] = _Episode(self._clock())
            new_cause = cause not in episode.causes
            episode.causes[cause] += 1
        if new_cause:
            log.warning(
                "kvcache: writes to the %s tier %s (%s: %s); its new entries are dropped "
                "until a write succeeds again (kvcache:tier_write_failures_total{tier=%r,cause=%r})",
                tier,
                "are failing" if first else "also fail",
                _TEXT.get(cause, cause),
                exc,
                tier,
                cause,
            )
        return cause

    def succeeded(self, tier: str) -> None:
        """A write to ``tier`` succeeded: its failure episode, if any, ends (logged)."""
        if tier not in self._episodes:  # the common case: no lock, one dict lookup
            return
        with self._lock:
            episode = self._episodes.pop(tier, None)
        if episode is not None:
            causes = ", ".join(f"{c}: {n:,}" for c, n in episode.causes.most_common())
            log.warning(
                "kvcache: writes to the %s tier succeed again, after %s failed in %.0f s (%s)",
                tier,
                f"{sum(episode.causes.values()):,}",
                self._clock() - episode.since,
                causes,
            )

    def failing(self, tier: str) -> bool:
        """Whether ``tier`` is in a failure episode (its last write failed)."""
        return tier in self._episodes

    def counters(self) -> dict[str, int]:
        """Running totals, flat, as the store reports them: ``{"write_failure:<cause>:<tier>": n}``."""
        with self._lock:
            return {f"write_failure:{cause}:{tier}": n for (tier, cause), n in self._counts.items()}
