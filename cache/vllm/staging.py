"""Host staging buffers for copies between the KV cache and the tiers: allocated once,
bounded, reused.

Runs in the vLLM worker process. Built in ``register_kv_caches`` with the worker's
``KVCACHE_STAGING_SIZE`` (``cache.config``) cut into slots of one chunk's entry each;
pinned (page-locked) memory on CUDA, so device copies run asynchronously at the link's
speed, plain memory on the CPU build (the same bound and accounting). Nothing else pins
host memory per call: torch's pinned allocator rounds each request up to a power of two
and never gives memory back.

Who takes a slot, and when it comes back:
- a save (``BlockCopier.gather_async``, forward thread): the gather copies into a slot;
  the slot is released once the writer thread has written the entry (or the save was
  dropped), and reused only after the device copy into it has ended;
- a synchronous load on CUDA (``BlockCopier.scatter``): the entry is copied into a slot,
  and from there to the device; released when that copy ends.

``take`` hands out the slot freed last: a pool is far larger than the copies in flight
(``STAGING_CHUNKS`` entries), and cycling through every slot in turn would make each
save's copy write memory not touched for a long time: on the CPU build, pages never
touched yet (a fault per 4 KiB page; torch allocates them lazily) until every slot has
been used once, then lines long gone from the CPU's caches. Reusing the last slot keeps
a save's copy at memory speed (``bench/results/low_load.md``).

``take`` never blocks: with no slot free it returns None. A save then is skipped (a
future miss, counted as ``dropped_staging``, ``kvcache:tier_dropped_staging_total``);
a load copies from the entry's own (pageable) memory instead, slower, counted as
``unstaged_loads``. ``release`` may be called on any thread, with the event of a copy
still in flight: the slot is free once that event has happened (looked at by ``take``,
never waited for).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Callable, Optional

import torch

log = logging.getLogger(__name__)


class Slot:
    """One staging buffer: ``data``, ``slot_bytes`` bytes (uint8)."""

    __slots__ = ("index", "data")

    def __init__(self, index: int, data: torch.Tensor) -> None:
        self.index, self.data = index, data

    def view(self, dtype: torch.dtype, shape) -> torch.Tensor:
        """The slot's first bytes as a contiguous ``dtype`` tensor of ``shape``."""
        n = dtype.itemsize
        for d in shape:
            n *= d
        return self.data[:n].view(dtype).view(shape)


class StagingPool:
    """``slots`` buffers of ``slot_bytes`` each, in one allocation made here."""

    def __init__(
        self, slot_bytes: int, slots: int, pin: bool = False, happened: Optional[Callable[[Any], bool]] = None
    ) -> None:
        if slot_bytes <= 0 or slots <= 0:
            raise ValueError(f"a staging pool needs slots ({slots}) of some bytes ({slot_bytes})")
        self.slot_bytes, self.slots, self.pinned = slot_bytes, slots, pin
        self._happened = happened or (lambda event: True)
        self._buffer = torch.empty(slot_bytes * slots, dtype=torch.uint8, pin_memory=pin)
        self._slots = [Slot(i, self._buffer[i * slot_bytes : (i + 1) * slot_bytes]) for i in range(slots)]
        self._free = deque(range(slots))
        self._pending: list[tuple[int, object]] = []  # (slot, event of a copy still using it)
        self._lock = threading.Lock()
        self.taken = 0  # slots handed out, all time
        self.dropped_saves = 0  # saves skipped: no slot free
        self.unstaged_loads = 0  # loads copied from pageable memory: no slot free
        self.high_water = 0  # most slots in use at once

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.slots

    def take(self, nbytes: int, purpose: str = "save") -> Optional[Slot]:
        """A free slot for ``nbytes`` (at most ``slot_bytes``), or None (counted under
        ``purpose``: "save" or "load"). Never blocks."""
        if nbytes > self.slot_bytes:
            raise ValueError(f"{nbytes} bytes do not fit a {self.slot_bytes}-byte staging slot")
        with self._lock:
            if not self._free and self._pending:
                still = []
                for index, event in self._pending:
                    (self._free.append(index) if self._happened(event) else still.append((index, event)))
                self._pending = still
            if not self._free:
                if purpose == "save":
                    self.dropped_saves += 1
                else:
                    self.unstaged_loads += 1
                return None
            index = self._free.pop()  # the slot freed last: its pages are mapped and likely cached
            self.taken += 1
            self.high_water = max(self.high_water, self.slots - len(self._free))
            return self._slots[index]

    def release(self, slot: Slot, after=None) -> None:
        """Give ``slot`` back; with ``after`` (an event of a copy still using it), it is
        reused only once that event has happened."""
        with self._lock:
            if after is None:
                self._free.append(slot.index)
            else:
                self._pending.append((slot.index, after))

    def in_use(self) -> int:
        """Slots taken and not yet free (in-flight copies included)."""
        with self._lock:
            return self.slots - len(self._free)

    def counters(self) -> dict[str, int]:
        """For the worker's stats (``cache.vllm.metrics``)."""
        return {"all.dropped_staging": self.dropped_saves, "all.unstaged_loads": self.unstaged_loads}

    def describe(self) -> str:
        kind = "pinned" if self.pinned else "host"
        return f"{self.slots} x {self.slot_bytes:,} bytes of {kind} staging memory"


def staging_pool(staging_bytes: int, entry_bytes: int, device: torch.device) -> StagingPool:
    """The worker's pool: ``staging_bytes`` (``KVCACHE_STAGING_SIZE``) cut into slots of
    one ``entry_bytes`` entry (the largest a copy makes), at least one; pinned on CUDA."""
    slot = -(-entry_bytes // 64) * 64  # slots start 64-byte aligned: copies view them as words
    if staging_bytes < slot:
        log.warning(
            "kvcache: KVCACHE_STAGING_SIZE (%s bytes) holds less than one chunk of this model "
            "(%s bytes): one chunk is staged at a time; saves meanwhile are skipped",
            f"{staging_bytes:,}",
            f"{slot:,}",
        )
    cuda = device.type == "cuda"
    return StagingPool(
        slot, max(1, staging_bytes // slot), pin=cuda, happened=(lambda event: event.query()) if cuda else None
    )


def half_taken(pool: Optional[StagingPool]) -> bool:
    """Whether more than half of ``pool``'s slots are taken (holding writes would drop saves)."""
    return pool is not None and pool.in_use() * 2 > pool.slots
