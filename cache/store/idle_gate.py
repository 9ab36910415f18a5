"""Holding the store's background writes while the engine computes.

A writer store's threads (``cache.store.background``) run in the engine's worker process.
Whatever core they run on, they share the process's interpreter lock with the forward
thread: each chunk they encode and write is many short turns of Python between system
calls, and each turn can keep the forward thread waiting when one of its operations
returns (``bench/results/low_load.md``: decode steps about 10 % slower while saves are
written, on a host whose writer thread has a core of its own). Writes are behind the
forward pass anyway (nothing waits for them but a later request for the same chunk), so
the gate lets them wait for a quiet moment: no step running and none for ``quiet_s``.

Never for long: a write waits at most ``max_wait_s`` from being queued, so under
sustained load the writes go on at full rate, ``max_wait_s`` late; and not at all while
``pressed()`` (host staging or the queue's byte bound filling up: holding writes would
drop saves) or once ``hurry()`` was called (a request waits for a save, ``flush``,
shutdown): every write queued before that call goes at once.

The forward thread calls ``step_began``/``step_ended`` (attribute stores, no lock, never
blocks); ``wait`` runs on the writer or publisher thread, sleeping in short steps.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Callable, Optional

# Default longest a write waits for the engine to go quiet.
MAX_WAIT_S = 0.5
# The engine counts as quiet once no step ran for this long (a step's sampling and the
# next one's scheduling fall between a step's end and the next one's start).
QUIET_S = 0.005
# How often a waiting write looks again while a step runs.
POLL_S = 0.002


class IdleGate:
    """When the writer thread may go on (see the module docstring)."""

    def __init__(
        self,
        max_wait_s: float = MAX_WAIT_S,
        quiet_s: float = QUIET_S,
        pressed: Optional[Callable[[], bool]] = None,
    ) -> None:
        self.max_wait_s, self.quiet_s = max_wait_s, quiet_s
        self.pressures: list[Callable[[], bool]] = [pressed] if pressed is not None else []
        self._in_step = False
        self._last_end = float("-inf")
        self._seq = itertools.count(1)
        self._hurried_through = 0  # writes numbered up to this go at once
        self._lock = threading.Lock()

    # -- forward thread ------------------------------------------------------------------
    def step_began(self, hurry: bool = False) -> None:
        self._in_step = True
        if hurry:
            self.hurry()

    def step_ended(self) -> None:
        self._last_end = time.monotonic()
        self._in_step = False

    # -- any thread ----------------------------------------------------------------------
    def ticket(self) -> int:
        """A number for a write being queued (in queue order)."""
        return next(self._seq)

    def hurry(self) -> None:
        """Every write queued so far goes without waiting."""
        with self._lock:
            self._hurried_through = next(self._seq)

    # -- writer/publisher thread ---------------------------------------------------------
    def wait(self, ticket: int, queued_at: float) -> None:
        """Return once write ``ticket`` (queued at ``queued_at``, ``time.monotonic()``) may run."""
        deadline = queued_at + self.max_wait_s
        while True:
            now = time.monotonic()
            if ticket <= self._hurried_through or now >= deadline:
                break
            if any(p() for p in self.pressures):
                break
            if self._in_step:
                pause = POLL_S
            else:
                quiet_for = now - self._last_end
                if quiet_for >= self.quiet_s:
                    break
                pause = self.quiet_s - quiet_for
            time.sleep(min(pause, deadline - now))
