"""The few CUDA calls the copier makes to order its copies, in one place.

Runs in the vLLM worker process, on whichever thread copies (the forward thread, a
loader thread, the writer thread waiting for a save's copy). ``CudaStreams`` is the real
thing; a test hands ``BlockCopier`` another object with the same methods to record
which stream waits on which, and the GPU conformance suite (``bench.gpu_conformance``)
hands it one that drops the waits, to show its ordering checks fail without them.

The rules it serves (torch's stream semantics):
- inside ``with torch.cuda.stream(s)`` the *current* stream is ``s``: the compute
  stream must be taken (or an event recorded on it) *before* entering the copier's
  stream, or a wait "on the current stream" waits on itself and orders nothing;
- the current stream and the current device are per thread: a thread that never
  selected the worker's device works on device 0 (and opens a CUDA context there).
"""

from __future__ import annotations

import torch


class CudaStreams:
    """Stream and event calls on one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def select(self) -> None:
        """Make the worker's device the calling thread's current device."""
        torch.cuda.set_device(self.device)

    def current(self):
        """The calling thread's current stream on the device (on the forward thread: the
        compute stream)."""
        return torch.cuda.current_stream(self.device)

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def using(self, stream):
        """Context: ``stream`` is the calling thread's current stream inside it."""
        return torch.cuda.stream(stream)

    def mark(self, stream):
        """An event after the work queued on ``stream`` so far."""
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        """``stream``'s later work waits for ``event`` (on the GPU; the host goes on)."""
        stream.wait_event(event)

    def synchronize(self, event) -> None:
        """Block the calling thread until ``event`` has happened."""
        event.synchronize()

    def happened(self, event) -> bool:
        return event.query()

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A small host tensor (block ids) on the device, without waiting: a copy from
        pageable memory would wait for the work queued on the current stream."""
        return host.pin_memory().to(self.device, non_blocking=True)
