"""Worker side of the cost model: what loads and forward passes took, for the scheduler.

Runs in the vLLM worker process. ``forward_began``/``forward_ended`` are called on the
forward thread around each step (``bind_connector_metadata`` .. ``wait_for_save``), and
``take`` once per step there too; ``loaded`` on whichever thread ran a load (the forward
thread for memory tiers, a load thread otherwise). Nothing here blocks or waits for the
GPU: a lock around list appends.

What it sends back (``take``, with the step's ``TieredKVWorkerMetadata``):
- ``("load", tier, bytes, seconds)``: a load whose entries all came from one tier, read
  whole and verified (a load cut short or failed says nothing about the tier's rate);
- ``("step", tokens, attention pairs, seconds)``: a forward pass, less the time the
  forward thread spent loading (``cache.cost.PrefillRate``). On the CPU the forward pass
  has ended when ``wait_for_save`` runs: the host clock times it. On CUDA its kernels are
  still queued then: CUDA events on the compute stream time it (``cache.vllm.step_clock``,
  read back without waiting, a step or more later), from after its synchronous loads.

``totals`` (cumulative, for ``cache.vllm.metrics``): per load mode (``sync``: whole,
before the forward pass; ``layered``: layer by layer during it, ``cache.vllm.layered``;
``async``: on its own thread while the request waits) the loads and their measured
seconds; of the loads the cost model estimated, its estimate and their measured
seconds; the loads cut short at their deadline (the rest of their prompt recomputed).
"""

from __future__ import annotations

import threading
import time
from typing import Optional

from cache.vllm.metadata import LoadRequest
from cache.vllm.step_clock import EventClock


class LoadCosts:
    def __init__(self, events: Optional[EventClock] = None) -> None:
        """``events``: the GPU's step clock (``step_clock``); None: the host clock."""
        self.events = events
        self._lock = threading.Lock()
        self._samples: list[tuple] = []
        self.counters: dict[str, float] = {}
        self._began: Optional[float] = None
        self._compute: Optional[tuple[int, float]] = None
        self._loading = 0.0  # the forward thread's time in loads this step

    # -- forward passes (forward thread) -----------------------------------------
    def forward_began(self, compute: Optional[tuple[int, float]]) -> None:
        timed = compute if compute and compute[0] else None
        if self.events is not None:
            self.events.begin(timed)
        self._began = time.perf_counter() if timed and self.events is None else None
        self._compute, self._loading = compute, 0.0

    def forward_ended(self) -> None:
        if self.events is not None:
            self.events.end()
            return
        began, self._began = self._began, None
        if began is None or self._compute is None:  # (began is set only with a compute)
            return
        seconds = time.perf_counter() - began - self._loading
        with self._lock:
            self._samples.append(("step", self._compute[0], self._compute[1], max(0.0, seconds)))

    # -- loads (any thread) ------------------------------------------------------
    def loaded(
        self,
        load: LoadRequest,
        seconds: float,
        bytes_by_tier: dict[str, int],
        cut: bool,
        failed: bool,
        forward_seconds: Optional[float] = None,
        layered: bool = False,
    ) -> None:
        """A load ended after ``seconds``: ``bytes_by_tier`` read and verified; ``cut``:
        stopped at its deadline; ``failed``: some chunk failed (missing, damaged).
        ``forward_seconds``: of those, the forward thread's (a layer-wise load overlaps
        the forward pass; default: all of a synchronous load's, none of another's).
        ``layered``: the load went layer by layer (counted as its own mode)."""
        mode = "async" if load.asynchronous else "layered" if layered else "sync"
        if self.events is not None and mode == "sync":  # forward thread, before the forward pass:
            self.events.restart()  # the step's GPU time starts after it
        with self._lock:
            if not load.asynchronous:
                self._loading += seconds if forward_seconds is None else forward_seconds
            if len(bytes_by_tier) == 1 and not cut and not failed:
                ((tier, nbytes),) = bytes_by_tier.items()
                self._samples.append(("load", tier, nbytes, seconds))
            self._add(f"load:{mode}.loads", 1)
            self._add(f"load:{mode}.seconds", seconds)
            if load.estimate_s is not None:
                self._add(f"load:{mode}.estimated_seconds", load.estimate_s)
                self._add(f"load:{mode}.estimated_actual_seconds", seconds)
            if cut:
                self._add(f"load:{mode}.cut_short", 1)

    def _add(self, key: str, value: float) -> None:
        self.counters[key] = self.counters.get(key, 0) + value

    def take(self) -> list[tuple]:
        """Measurements since the last call (forward thread: the GPU's steps are read here)."""
        steps = [("step", *s) for s in self.events.ready()] if self.events is not None else []
        with self._lock:
            out, self._samples = self._samples + steps, []
        return out

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self.counters)
