"""Forward passes timed on the GPU with CUDA events, for the cost model's prefill rate.

Runs on the vLLM worker's forward thread (``cache.vllm.load_costs``); nothing here blocks,
and nothing synchronises with the GPU. On the CPU build the connector sees a step end
(``wait_for_save``) after its forward pass has run, and the host clock times it. On
CUDA its kernels are still queued then, and vLLM 0.32 schedules asynchronously: the host
prepares and launches step N+1 while the GPU still runs step N. So each timed step
records two timing events on the compute stream (the forward thread's current stream):
``begin`` when its metadata is bound (recorded again, ``restart``, once its synchronous
loads are in place, so the GPU time excludes them, as the CPU path subtracts them) and
``end`` when the connector sees the step end. Events queue on the one stream in the order
they are recorded, so each step's pair brackets that step's kernels whatever the host
did in between. ``ready`` asks the oldest pairs with ``query()`` and returns the steps the
GPU has passed, each with the GPU time between its two events: its kernels, plus any time
the GPU waited for the host to launch them (a request pays that too). A step is reported
one or more engine steps after it ran; the scheduler's fit does not mind.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional

# Timed steps the GPU may lag behind by before the oldest is dropped (vLLM runs at most a
# few steps ahead of the GPU; this only bounds memory if events never complete).
MAX_PENDING = 64


class EventClock:
    """Step timings from CUDA timing events: ``new_event()`` makes one
    (``torch.cuda.Event(enable_timing=True)``), ``stream()`` is the compute stream."""

    def __init__(self, new_event: Callable[[], Any], stream: Callable[[], Any]) -> None:
        self._new_event = new_event
        self._stream = stream
        self._begin: Any = None
        self._step: Optional[tuple[int, float]] = None
        self._pending: deque = deque()  # (begin, end, (tokens, pairs)), in record order

    def begin(self, compute: Optional[tuple[int, float]]) -> None:
        """A step's metadata is bound: time it when ``compute`` (tokens, attention pairs)
        is given; None: an untimed step (a stale begin is dropped)."""
        self._step = compute
        self._begin = self._record() if compute else None

    def restart(self) -> None:
        """The step's synchronous loads are in place (or queued ahead on the stream): its
        time starts here."""
        if self._begin is not None:
            self._begin = self._record()

    def end(self) -> None:
        """The connector saw the step end (its kernels may still be queued)."""
        if self._begin is None:
            return
        self._pending.append((self._begin, self._record(), self._step))
        self._begin = None
        if len(self._pending) > MAX_PENDING:
            self._pending.popleft()

    def ready(self) -> list[tuple[int, float, float]]:
        """(tokens, attention pairs, GPU seconds) of each timed step the GPU has passed,
        oldest first; asks without waiting."""
        out = []
        while self._pending:
            begin, end, (tokens, pairs) = self._pending[0]
            if not (end.query() and begin.query()):
                break  # later steps' events come after these on the stream
            self._pending.popleft()
            out.append((tokens, pairs, max(0.0, begin.elapsed_time(end) / 1000.0)))
        return out

    def _record(self) -> Any:
        event = self._new_event()
        event.record(self._stream())
        return event


def step_clock(device) -> Optional[EventClock]:
    """How forward passes on ``device`` are timed: CUDA events on a GPU; None on the CPU,
    where the connector sees each forward pass end and the host clock times it."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    return EventClock(lambda: torch.cuda.Event(enable_timing=True), lambda: torch.cuda.current_stream(device))
