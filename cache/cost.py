"""What a load costs against what recomputing costs, from times measured online.

Pure arithmetic (no I/O, no vLLM, no torch); runs in vLLM's scheduler loop, once per
request that hits, in microseconds. Fed by measurements the workers send back each step:

- ``TierRate``: one tier's load time as ``latency + bytes / bandwidth``, fitted over its
  recent loads (wall time of a load, all its reads and checks included);
- ``PrefillRate``: the engine's forward time of one step as
  ``overhead + per_token * tokens + per_pair * attention pairs``, fitted over recent
  steps; ``attention pairs`` of a request computing ``n`` new tokens after ``c`` cached
  ones is ``n * (c + n / 2)`` (each new token attends to everything before it). The
  cost of recomputing a range of a prompt is the fit without the overhead, which a
  step pays anyway.

``choose`` then compares, for every prefix of the chunks found in the tiers, loading
that prefix and computing the rest, and picks the fastest; recomputing everything is
the empty prefix. Until both rates have been measured it loads everything (what a cache
without a cost model does). Estimates are seconds; ``Fit``s take an injected clock.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

WINDOW = 64  # samples a fit keeps
HALF_LIFE_S = 300.0  # a sample's weight halves every this many seconds (the machine changes)
SLACK = 1.5  # a load may run this much over its estimate before it is cut short
DEADLINE_MARGIN_S = 0.1  # ... plus this much (a busy host delays threads by tens of ms)
ASYNC_ROUND_TRIP_S = 0.005  # an asynchronous load costs the request an engine step more
# Loading everything found is the default (it also spares the engine compute that other
# requests could use); a plan that loads less must be expected faster by both margins.
MIN_GAIN = 0.05  # ... by this share of the full load's time to the first token
MIN_GAIN_S = 0.005  # ... and by this many seconds


class Fit:
    """Weighted least squares ``y ~ w . x`` with ``w >= 0`` over the last ``WINDOW``
    samples, newer ones weighing more. Thread-safe (the scheduler reads, the connector
    output feeds)."""

    def __init__(self, n_features: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.n = n_features
        self._clock = clock
        self._x: list[tuple[float, ...]] = []
        self._y: list[float] = []
        self._t: list[float] = []
        self._w: Optional[np.ndarray] = None
        self._lock = threading.Lock()

    def add(self, x: Sequence[float], y: float) -> None:
        if not (math.isfinite(y) and y >= 0) or len(x) != self.n:
            return
        with self._lock:
            self._x.append(tuple(float(v) for v in x))
            self._y.append(float(y))
            self._t.append(self._clock())
            if len(self._y) > WINDOW:
                del self._x[0], self._y[0], self._t[0]
            self._w = None

    @property
    def samples(self) -> int:
        return len(self._y)

    def weights(self) -> Optional[np.ndarray]:
        """The fitted ``w`` (None before any sample)."""
        with self._lock:
            if self._w is None and self._y:
                self._w = self._solve()
            return self._w

    def _solve(self) -> np.ndarray:
        x, y = np.array(self._x), np.array(self._y)
        age = self._clock() - np.array(self._t)
        sw = np.sqrt(0.5 ** (age / HALF_LIFE_S))
        active = [j for j in range(self.n) if np.any(x[:, j])]
        w = np.zeros(self.n)
        while active:  # non-negative least squares by dropping negative weights
            sol, *_ = np.linalg.lstsq(x[:, active] * sw[:, None], y * sw, rcond=None)
            if np.all(sol >= 0):
                w[active] = sol
                break
            active = [j for j, v in zip(active, sol) if v > 0] or active[-1:]
            if len(active) == 1:
                j = active[0]
                w[j] = max(0.0, float(np.dot(x[:, j] * sw, y * sw) / np.dot(x[:, j] * sw, x[:, j] * sw)))
                break
        return w

    def predict(self, x: Sequence[float]) -> Optional[float]:
        w = self.weights()
        return None if w is None else float(np.dot(w, x))


class TierRate:
    """Load time of one tier: ``latency + bytes / bandwidth``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.fit = Fit(2, clock)

    def observe(self, nbytes: int, seconds: float) -> None:
        self.fit.add((1.0, nbytes), seconds)

    def seconds(self, nbytes: int) -> Optional[float]:
        return self.fit.predict((1.0, nbytes)) if nbytes else 0.0

    @property
    def bandwidth(self) -> Optional[float]:
        w = self.fit.weights()
        return None if w is None or w[1] <= 0 else 1.0 / w[1]


def attention_pairs(new: float, cached: float) -> float:
    """Query-key pairs of computing ``new`` tokens after ``cached`` ones (causal)."""
    return new * (cached + new / 2)


class PrefillRate:
    """Forward time of a step: ``overhead + per_token * tokens + per_pair * pairs``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.fit = Fit(3, clock)

    def observe(self, tokens: int, pairs: float, seconds: float) -> None:
        if tokens > 0:
            self.fit.add((1.0, tokens, pairs), seconds)

    def seconds(self, new: int, cached: int) -> Optional[float]:
        """Time to compute ``new`` tokens after ``cached`` ones, over a step's overhead."""
        if new <= 0:
            return 0.0
        return self.fit.predict((0.0, new, attention_pairs(new, cached)))


@dataclass(frozen=True)
class ChunkCost:
    """One chunk a request found in the tiers: its tokens and where its bytes are."""

    start: int
    end: int
    tier: str
    nbytes: int


@dataclass(frozen=True)
class Plan:
    """What to do with a request's hit: load the first ``chunks`` of the ``found`` chunks
    (0: recompute everything) in ``mode``: ``sync`` (before the forward pass: memory
    tiers), ``async`` (the request waits, other requests run) or ``none``.
    ``estimate_s``: expected load time; ``deadline_s``: when the load is cut short and
    the rest recomputed (None: no estimate yet, or a memory copy: the tiers' own
    deadlines apply); ``ttft_s`` and ``recompute_s``: the expected time to the first
    token this way and by recomputing everything (None when unknown)."""

    chunks: int
    found: int
    mode: str
    estimate_s: Optional[float] = None
    deadline_s: Optional[float] = None
    ttft_s: Optional[float] = None
    recompute_s: Optional[float] = None

    @property
    def path(self) -> str:
        """``load`` (every chunk found), ``partial`` (a prefix of them), ``recompute``."""
        return "recompute" if self.chunks == 0 else ("load" if self.chunks == self.found else "partial")


def deadline(estimate: float, recompute: Optional[float]) -> float:
    """How long a load estimated at ``estimate`` may run: its estimate with some slack,
    but not longer than recomputing instead would have taken (either plus a margin for
    scheduling noise)."""
    limit = estimate * SLACK
    if recompute is not None:
        limit = max(estimate, min(limit, recompute))
    return limit + DEADLINE_MARGIN_S


def choose(
    chunks: Sequence[ChunkCost],
    n_tokens: int,
    computed: int,
    tiers: dict[str, TierRate],
    prefill: PrefillRate,
    synchronous: set[str],
    inline: bool = False,
    whole: bool = False,
    round_trip: float = ASYNC_ROUND_TRIP_S,
) -> Plan:
    """The fastest plan for a request of ``n_tokens`` whose first ``computed`` tokens are
    already in vLLM's blocks and whose next ``chunks`` were found in the tiers (their
    ``end`` at most ``n_tokens - 1``: the last token is always computed).

    ``synchronous``: tiers loaded before the forward pass (memory copies); a load that
    touches any other tier is asynchronous (it costs the request one engine step more),
    unless ``inline``: nothing else is running, so every load runs before the forward
    pass (it would stall no other request). Loads from the other tiers keep their
    deadline either way. ``whole``: the chunks are one hit's entries that only serve it
    together (a hybrid model's full-attention chain and the windows before its end):
    load them all or recompute, no prefix in between; the last chunk's ``end`` is the
    hit's. ``round_trip``: what an asynchronous load adds to the request's first token
    past the load itself."""
    found = len(chunks)
    if not chunks:
        return Plan(0, 0, "none")
    starts = [max(computed, c.start) for c in chunks] + [max(computed, chunks[-1].end)]
    predicted = [prefill.seconds(n_tokens - s, s) for s in starts]
    compute = [v for v in predicted if v is not None]
    known = all(c.tier in tiers and tiers[c.tier].seconds(c.nbytes) is not None for c in chunks)
    if len(compute) < len(predicted) or not known:
        sync = inline or all(c.tier in synchronous for c in chunks)
        return Plan(found, found, "sync" if sync else "async")
    plans: list[tuple[float, int, str, float]] = [(compute[0], 0, "none", 0.0)]  # recompute everything
    nbytes: dict[str, int] = {}
    for j in range(1, found + 1):
        c = chunks[j - 1]
        nbytes[c.tier] = nbytes.get(c.tier, 0) + c.nbytes
        # one load: latency once per tier (each tier's fit is known: checked above)
        load = sum(tiers[t].seconds(n) or 0.0 for t, n in nbytes.items())
        sync = inline or all(c.tier in synchronous for c in chunks[:j])
        ttft = load + compute[j] + (0.0 if sync else round_trip)
        if not whole or j == found:
            plans.append((ttft, j, "sync" if sync else "async", load))
    full = plans[-1]
    fastest = min(plans, key=lambda p: (p[0], -p[1]))
    gain = full[0] - fastest[0]
    ttft, j, mode, load = fastest if gain > max(MIN_GAIN * full[0], MIN_GAIN_S) else full
    recompute = compute[0]
    if j == 0:
        return Plan(0, found, "none", 0.0, None, ttft, recompute)
    slow = any(c.tier not in synchronous for c in chunks[:j])  # memory copies get no deadline
    return Plan(j, found, mode, load, deadline(load, recompute) if slow else None, ttft, recompute)
