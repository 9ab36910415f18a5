"""The ordering half of the GPU conformance suite (``bench.gpu_conformance``): checks with
teeth that the copier's copies follow and precede the compute stream's work. CUDA only.

Each check queues a long kernel on the stream a race would need to lose (``busy``:
about 0.1 s), so that without the copier's ordering the other side runs first, every
time. Each runs twice on its own copier: *ordered* (the real ``CudaStreams``), where it
must pass, and *unordered* (the same copier with every stream wait dropped), where it
must fail: a check that passes there has no teeth on this device, and the suite says
so. Each copier is warmed up first with the same calls: a first allocation
(``cudaMalloc``, ``cudaHostAlloc``) may synchronise the device and hide a race.

- gather after a write: a long kernel, then a write of the blocks, on the compute
  stream; then a save's gather: it must see the write;
- load from a loader thread: a long kernel and a write queued on the compute stream,
  a ``compute_mark`` taken, then a scatter from another thread after that mark: the
  scatter must win (land after the write);
- synchronous load: the same with the scatter on the forward thread (no mark), and the
  compute stream reading the blocks after it: the read and the blocks hold the load;
- fence: the copier's stream kept busy, a gather queued behind it, ``fence``, then the
  compute stream overwrites the blocks: the gather must hold the old values.
"""

from __future__ import annotations

import threading

import torch

from bench.conformance_views import build, copier_for
from cache.vllm.streams import CudaStreams

BUSY_CYCLES = 200_000_000  # torch.cuda._sleep: about 0.1 s at 2 GHz


class SuiteStreams(CudaStreams):
    """``CudaStreams`` that keeps the streams it made; ``ordered=False`` drops every wait."""

    def __init__(self, device: torch.device, ordered: bool = True) -> None:
        super().__init__(device)
        self.ordered, self.made = ordered, []

    def new_stream(self):
        stream = super().new_stream()
        self.made.append(stream)
        return stream

    def wait(self, stream, event) -> None:
        if self.ordered:
            super().wait(stream, event)


def busy(cycles: int = BUSY_CYCLES) -> None:
    """A long kernel on the current stream."""
    torch.cuda._sleep(cycles)  # noqa: SLF001 (torch's only spin kernel; its own tests use it)


class Bench:
    """One case's views and a copier over them, with helpers to fill and read blocks."""

    def __init__(self, case: dict, device: torch.device, ordered: bool) -> None:
        self.device = device
        self.raw, self.views = build(case, device, seed=5)
        self.streams = SuiteStreams(device, ordered)
        self.copier = copier_for(self.views, case["num_blocks"], self.streams)
        self.ids = [5, 9, 2, 14, 11, 3, 7, 1]
        split = self.copier.layout.split
        self.rows = torch.tensor([b * split + k for b in self.ids for k in range(split)], device=device)

    def fill(self, value: int) -> None:
        """Every byte of the blocks set to ``value``, on the current stream."""
        for v in self.views.values():
            v.view(torch.uint8)[self.rows] = value

    def read(self) -> torch.Tensor:
        """The blocks' bytes, read on the current stream."""
        return torch.stack([v.view(torch.uint8)[self.rows] for v in self.views.values()])

    def entry(self, value: int) -> torch.Tensor:
        """A host entry of the blocks, every byte ``value``."""
        layout = self.copier.layout
        n = len(self.ids) * layout.bytes_per_block()
        return torch.full((n,), value, dtype=torch.uint8).view(layout.dtype).view(layout.entry_shape(len(self.ids)))

    def settle(self) -> None:
        torch.cuda.synchronize(self.device)


def gather_after_write(b: Bench, warm: bool) -> bool:
    b.fill(1)
    b.settle()
    if not warm:
        busy()
    b.fill(0xA5)
    got = b.copier.gather_async(b.ids)
    got.wait()
    ok = bool((got.host.view(torch.uint8) == 0xA5).all())
    got.release()
    b.settle()
    return ok


def load_from_thread(b: Bench, warm: bool) -> bool:
    b.fill(1)
    b.settle()
    if not warm:
        busy()
    b.fill(0x11)  # vLLM's queued work on the blocks (e.g. the last reader, or a zeroing)
    mark = b.copier.compute_mark()
    t = threading.Thread(target=b.copier.scatter, args=(b.ids, b.entry(0x77)), kwargs={"after": mark})
    t.start()
    t.join()
    b.settle()
    return bool((b.read() == 0x77).all())


def synchronous_load(b: Bench, warm: bool) -> bool:
    b.fill(1)
    b.settle()
    if not warm:
        busy()
    b.fill(0x11)
    b.copier.scatter(b.ids, b.entry(0x66))  # forward thread: the compute stream waits for it
    seen = b.read()  # the forward pass's read, queued on the compute stream after it
    b.settle()
    return bool((seen == 0x66).all()) and bool((b.read() == 0x66).all())


def fence(b: Bench, warm: bool) -> bool:
    b.fill(0x3C)
    b.settle()
    if not warm:
        with torch.cuda.stream(b.streams.made[0]):  # the copier's stream: a long queue of saves
            busy()
    got = b.copier.gather_async(b.ids)
    b.copier.fence()  # what the connector does before the next forward pass
    b.fill(0xFF)  # the next forward pass overwrites the blocks
    got.wait()
    ok = bool((got.host.view(torch.uint8) == 0x3C).all())
    got.release()
    b.settle()
    return ok


CHECKS = {
    "a gather sees the compute stream's queued write": gather_after_write,
    "a load from another thread lands after the compute stream's queued write": load_from_thread,
    "a synchronous load lands after queued writes, and the forward pass reads it": synchronous_load,
    "a gather in flight keeps the old values behind fence()": fence,
}


def run(case: dict, device: torch.device) -> dict[str, dict[str, bool]]:
    """``{check: {"ordered": passed, "unordered": passed}}``: the first must be True,
    the second False (the check's teeth)."""
    out = {}
    for name, check in CHECKS.items():
        out[name] = {}
        for ordered in (True, False):
            b = Bench(case, device, ordered)
            check(b, warm=True)  # the same calls once: allocations cached, events made
            check(b, warm=True)
            out[name]["ordered" if ordered else "unordered"] = check(b, warm=False)
            del b
            torch.cuda.empty_cache()
    return out


def threads_select_the_device(case: dict, device: torch.device) -> dict:
    """A loader thread (the cache's thread setup) and a writer thread (a save's ``wait``)
    work on the copier's device. With one GPU it is device 0 either way: said so."""
    from cache.threads import thread_setup

    b = Bench(case, device, ordered=True)
    setup = thread_setup(frozenset())
    setup.select_device = b.copier.streams.select
    seen = {}

    def loader():
        setup("load")
        seen["loader thread"] = torch.cuda.current_device()

    got = b.copier.gather_async(b.ids)

    def writer():  # a thread that never selected a device, as an early writer thread
        got.wait()
        seen["writer thread (save's wait)"] = torch.cuda.current_device()

    for fn in (loader, writer):
        t = threading.Thread(target=fn)
        t.start()
        t.join()
    got.release()
    return {
        "device": device.index,
        "devices": torch.cuda.device_count(),
        "seen": seen,
        "distinguishing": device.index != 0,
        "ok": all(v == device.index for v in seen.values()) and len(seen) == 2,
    }
