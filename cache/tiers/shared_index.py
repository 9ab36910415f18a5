"""What this process knows the shared tier holds: an in-memory index, never I/O.

``SharedTier`` answers ``contains`` and ``probe`` from here so the scheduler never waits
on the network. The index learns keys from this process's reads and writes, from
existence checks (``to_check`` hands out what to ask; ``checked`` takes the answers) and
from background listings (``listing_started``/``listing_done``: what was learnt or
forgotten while a listing ran is kept over it). A key found absent is not asked about
again for ``ABSENT_TTL_SECONDS``; a rejected one (its entry failed verification here) is
ignored for ``REJECT_SECONDS``. Every map is bounded. Thread-safe: one lock, held for set
operations only; called from the scheduler, I/O threads and the listing thread.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable, Iterable, Optional, Sequence

ABSENT_TTL_SECONDS = 5.0  # a key found absent is not asked about again for this long
REJECT_SECONDS = 600.0  # a rejected (bad or foreign) entry is ignored this long
MAX_KNOWN = 2_000_000  # bound on the in-memory key set (~200 MB at most)
MAX_REMEMBERED = 100_000  # bound on the absent/rejected maps


class SharedIndex:
    """Keys known present, known absent (for a while), rejected (for a while), being checked."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._known: set[str] = set()
        self._absent: OrderedDict[str, float] = OrderedDict()  # key -> ask again after
        self._rejected: dict[str, float] = {}  # key -> ignore until
        self._checking: set[str] = set()
        self._delta: Optional[tuple[set, set]] = None  # (added, removed) during a listing

    def contains(self, key: str) -> bool:
        """Known present and not rejected."""
        return key in self._known and not (self._rejected and self._is_rejected(key))

    def learn(self, key: str) -> None:
        """``key`` is present (read, written, or found by a check)."""
        with self._lock:
            if len(self._known) < MAX_KNOWN:
                self._known.add(key)
            self._absent.pop(key, None)
            if self._delta is not None:
                self._delta[0].add(key)
                self._delta[1].discard(key)

    def forget(self, key: str) -> None:
        """``key`` is gone (deleted, or not found on read)."""
        with self._lock:
            self._known.discard(key)
            if self._delta is not None:
                self._delta[1].add(key)
                self._delta[0].discard(key)

    def reject(self, key: str) -> None:
        """Ignore ``key`` for ``REJECT_SECONDS``."""
        with self._lock:
            if len(self._rejected) >= MAX_REMEMBERED:
                now = self._clock()
                self._rejected = {k: t for k, t in self._rejected.items() if t > now}
            self._rejected[key] = self._clock() + REJECT_SECONDS
            self._known.discard(key)

    def recheck(self, keys: Iterable[str]) -> None:
        """Forget that ``keys`` were found absent: the next probe asks again."""
        with self._lock:
            for k in keys:
                self._absent.pop(k, None)

    def to_check(self, keys: Sequence[str]) -> tuple[list[str], bool]:
        """For the chain ``keys`` (in order): the keys to ask about now (marked as being
        checked), and whether answers for others are already pending. The chain stops at
        a key known absent or rejected."""
        batch, pending = [], False
        now = self._clock()
        with self._lock:
            for k in keys:
                if k in self._known:
                    continue
                if self._absent.get(k, 0.0) > now or (self._rejected and self._is_rejected(k)):
                    break
                if k in self._checking:
                    pending = True
                    continue
                batch.append(k)
            self._checking.update(batch)
        return batch, pending

    def absent(self, key: str) -> None:
        """A check found ``key`` absent."""
        with self._lock:
            self._absent[key] = self._clock() + ABSENT_TTL_SECONDS
            self._absent.move_to_end(key)
            while len(self._absent) > MAX_REMEMBERED:
                self._absent.popitem(last=False)

    def checked(self, keys: Iterable[str]) -> None:
        """The checks of ``keys`` are over (answered or not)."""
        with self._lock:
            self._checking.difference_update(keys)

    def listing_started(self) -> None:
        with self._lock:
            self._delta = (set(), set())

    def listing_done(self, names: Optional[set[str]]) -> None:
        """A listing returned ``names`` (None: it failed): they become the known set, with
        what was learnt or forgotten meanwhile applied over them."""
        with self._lock:
            assert self._delta is not None, "listing_done without listing_started"
            added, removed = self._delta
            self._delta = None
            if names is not None:
                fresh = (names - removed) | added
                self._known = fresh if len(fresh) <= MAX_KNOWN else set(list(fresh)[:MAX_KNOWN])

    def _is_rejected(self, key: str) -> bool:
        until = self._rejected.get(key)
        return until is not None and until > self._clock()
