"""One load path: a chunk read as a typed result, a load's deadline, and how a load ends.

Runs in the vLLM worker process, on whichever thread loads: the forward thread (a
synchronous load, or one handed to the forward pass layer by layer), a load's own thread
(an asynchronous load) and the store's read threads. ``ChunkLoader.read`` and
``ChunkLoader.read_layer`` block on file or network I/O (a shared-tier read within the
tier's deadline); nothing here waits for a lock held across I/O.

Every way of delivering a load (``cache.vllm.worker``: whole before the forward pass or
asynchronously; ``cache.vllm.layered``: layer by layer during it) reads its chunks here
and gets one of four results: ``Placed`` (in its blocks), ``Fetched`` (a whole entry,
still to copy: ``ChunkLoader.settle``), ``Remote`` (only the shared tier may have it:
read it on a read thread) or ``Failed`` (it cannot be loaded; its event is sent). A
failed or late chunk fails its blocks and every later block of the request
(``failed_from``); ``ChunkLoader.passed_deadline`` logs and reports a load cut short,
``ChunkLoader.report`` sends a load's time to the cost model and the benchmark timer.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar, Union

import torch

from cache.codec import HEADER_SIZE
from cache.placed import BlockWriters, LoadEnded, Misfit
from cache.store import ELSEWHERE, Entry, EntryRead, TieredStore
from cache.tiers.identity import TierId
from cache.vllm.kv_copy import BlockCopier
from cache.vllm.load_costs import LoadCosts
from cache.vllm.metadata import ChunkIO, LoadRequest

log = logging.getLogger(__name__)

T = TypeVar("T")
OnEvent = Callable[[str, str, str], None]  # (chunk key, event, tier): cache.explain


@dataclass(frozen=True)
class Placed:
    """The chunk is in its blocks, verified: read from ``tier``, ``nbytes`` in all."""

    tier: TierId
    nbytes: int


@dataclass(frozen=True)
class Fetched:
    """A whole verified entry from a tier that does not read in place (None: a miss); the
    copy into the blocks is still to do (``ChunkLoader.settle``)."""

    entry: Optional[Entry]


@dataclass(frozen=True)
class Partial:
    """Layer-wise reads: the entry's first ``read.read.next_part`` layers are in the blocks
    (unverified until the last); ``read.step()`` reads the next."""

    read: EntryRead


@dataclass(frozen=True)
class Remote:
    """Only the shared tier may hold the chunk: read it on a read thread (a network read
    the forward thread could not stop at the deadline)."""


@dataclass(frozen=True)
class Failed:
    """The chunk cannot be loaded (gone, damaged, foreign, or its load has ended); its
    event is sent."""


REMOTE = Remote()
FAILED = Failed()

ChunkResult = Union[Placed, Fetched, Remote, Failed]
LayerResult = Union[Placed, Partial, Remote, Failed]


class Deadline:
    """When a load must be in place (``LoadRequest.deadline_s`` from now; None: never)."""

    def __init__(self, seconds: Optional[float]) -> None:
        self.end = None if seconds is None else time.monotonic() + seconds

    def timeout(self) -> Optional[float]:
        """Seconds left (None: no deadline), for ``Future.result``."""
        return None if self.end is None else max(0.0, self.end - time.monotonic())

    def passed(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end

    def poll(self, most: float) -> float:
        """How long to sleep between looks: ``most``, less when the deadline is nearer."""
        left = self.timeout()
        return most if left is None else min(most, left)


def failed_from(load: LoadRequest, first: int) -> set[int]:
    """The blocks of chunk ``first`` and every later chunk of ``load`` (vLLM recomputes them)."""
    return {b for chunk in load.chunks[first:] for b in chunk.block_ids}


class ChunkLoader:
    """Reads chunks into the KV blocks of one worker; shared by every load of the worker.

    ``on_event(key, event, tier)`` takes chunk events for the scheduler (``cache.explain``).
    ``copiers`` (one per entry kind) and ``costs`` are set once the KV caches are
    registered; ``timer`` by benchmarks (``WorkerSide.set_timer``)."""

    def __init__(self, store: TieredStore, block_size: int, on_event: OnEvent) -> None:
        self.store = store
        self.block_size = block_size
        self.on_event = on_event
        self.copiers: list[BlockCopier] = []
        self.costs: Optional[LoadCosts] = None
        self.timer: Optional[Callable[..., None]] = None

    # -- reading a chunk ------------------------------------------------------------
    def read(self, chunk: ChunkIO, writers: BlockWriters, local_only: bool = False) -> ChunkResult:
        """One chunk of a load of CPU blocks (``BlockCopier.placeable``), whole, on a read
        thread or the load's own thread: ``Placed``, ``Fetched`` (a tier that does not
        read in place), ``Remote`` (``local_only`` and only the shared tier may have it)
        or ``Failed``."""
        place = self._place(chunk)
        found = self._attempt(chunk, lambda: self.store.get_into(chunk.key, place, writers, local_only))
        if isinstance(found, Failed):
            return found
        if found is ELSEWHERE:
            return REMOTE if local_only else Fetched(self.store.get(chunk.key))
        if found is None:
            return self._missing(chunk)
        tier, info = found
        return Placed(tier, HEADER_SIZE + info.payload_len)

    def read_layer(
        self, chunk: ChunkIO, started: Optional[EntryRead], writers: BlockWriters, local_only: bool = False
    ) -> LayerResult:
        """The next layer of a chunk (``started``: its read so far; None: find the entry
        and read its first layer): ``Partial``, ``Placed`` once whole and verified (a tier
        that does not read in place: the whole entry, copied), ``Remote`` or ``Failed``."""
        if started is None:
            place = self._place(chunk)
            found = self._attempt(chunk, lambda: self.store.read_layers(chunk.key, place, writers, local_only))
            if isinstance(found, Failed):
                return found
            if found is ELSEWHERE and local_only:
                return REMOTE
            if found is ELSEWHERE:  # a tier that does not read in place: the whole entry
                return self._attempt(chunk, lambda: self.fill(chunk, self.store.get(chunk.key)))
            if found is None:
                return self._missing(chunk)
            read: EntryRead = found
        else:
            read = started
            if self._attempt(chunk, read.step) is not True:
                return FAILED
        info = read.read.info
        if not read.read.done or info is None:  # (info: set once the entry is open)
            return Partial(read)
        return Placed(read.tier, HEADER_SIZE + info.payload_len)

    def fill(self, chunk: ChunkIO, entry: Optional[Entry], mark: Any = None) -> Union[Placed, Failed]:
        """Copy a verified entry (``TieredStore.get``) into the chunk's blocks, after the
        compute stream's point ``mark`` (``BlockCopier.compute_mark``); ``Failed`` when
        there is nothing to copy or it does not fit (the event is sent)."""
        if entry is None:
            return self._missing(chunk)
        copier = self.copiers[chunk.kind]
        try:
            with warnings.catch_warnings():  # read-only mapping, only ever copied from
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                src = torch.frombuffer(entry.payload, dtype=copier.layout.dtype)
            if entry.info.dtype != copier.layout.dtype_name:
                raise ValueError(f"entry dtype {entry.info.dtype}, cache {copier.layout.dtype_name}")
            t = time.perf_counter()
            copier.scatter(chunk.block_ids, src.view(entry.info.shape), chunk.skip_blocks, after=mark)
            if self.timer is not None:
                self.timer("scatter", time.perf_counter() - t)
        except (ValueError, RuntimeError) as e:
            return self._misfit(chunk, entry.tier.name, e)
        return Placed(entry.tier, HEADER_SIZE + entry.payload.nbytes)

    def place(self, chunk: ChunkIO, result: ChunkResult, mark: Any = None) -> Union[Placed, Failed]:
        """A chunk's whole read brought into its blocks: a ``Fetched`` entry is copied
        (``fill``); ``Failed`` unless it is in place."""
        if isinstance(result, Fetched):
            return self.fill(chunk, result.entry, mark)
        return result if isinstance(result, Placed) else FAILED

    def settle(self, chunk: ChunkIO, result: ChunkResult, read: dict[str, int], mark: Any = None) -> bool:
        """``place`` and ``count`` a chunk; False when it is not in place (the chunk fails)."""
        placed = self.place(chunk, result, mark)
        if isinstance(placed, Failed):
            return False
        self.count(chunk, placed, read)
        return True

    def count(self, chunk: ChunkIO, placed: Placed, read: dict[str, int]) -> None:
        """Count a chunk in place: its tokens served, its bytes read from its tier (``read``)."""
        tokens = chunk.tokens if chunk.tokens is not None else len(chunk.block_ids) * self.block_size
        self.store.note_loaded(placed.tier, tokens, chunk.key, chunk.tier)
        name = placed.tier.name
        read[name] = read.get(name, 0) + placed.nbytes

    # -- how a load ends ---------------------------------------------------------------
    def passed_deadline(self, load: LoadRequest, first: int) -> None:
        """``load`` passed its deadline with chunk ``first`` not in place: it and the rest
        are recomputed (slower than recomputing by now)."""
        log.info(
            "kvcache: load of request %s passed its %.3f s deadline at chunk %d of %d; the rest is recomputed",
            load.req_id,
            load.deadline_s,
            first,
            len(load.chunks),
        )
        self.on_event(load.chunks[first].key, "recompute", "none")

    def report(
        self,
        load: LoadRequest,
        seconds: float,
        read: dict[str, int],
        cut: bool,
        failed: set[int],
        forward_seconds: Optional[float] = None,
    ) -> None:
        """A load ended after ``seconds``: to the cost model (``LoadCosts.loaded``) and the
        benchmark timer. ``forward_seconds``: a layer-wise load's time on the forward thread."""
        layered = {} if forward_seconds is None else {"layered": True}
        if self.costs is not None:
            self.costs.loaded(load, seconds, read, cut, bool(failed), forward_seconds, **layered)
        if self.timer is not None:
            self.timer(
                "load",
                seconds,
                req=load.req_id,
                asynchronous=load.asynchronous,
                chunks=len(load.chunks),
                failed=len(failed),
                cut_short=cut,
                estimate=load.estimate_s,
                **layered,
            )

    # -- failures ----------------------------------------------------------------------
    def _attempt(self, chunk: ChunkIO, read: Callable[[], T]) -> Union[T, Failed]:
        """``read()``, or ``Failed`` when it raised: the load ended, the entry does not fit,
        or anything else (logged: a read thread's failure never passes unseen)."""
        try:
            return read()
        except LoadEnded:
            return FAILED
        except Misfit as e:
            return self._misfit(chunk, e.tier, e)
        except Exception:
            log.exception("kvcache: loading chunk %s failed", chunk.key)
            self.on_event(chunk.key, "damaged", "none")
            return FAILED

    def _misfit(self, chunk: ChunkIO, tier: str, e: Exception) -> Failed:
        log.warning("kvcache: entry %s does not fit this engine: %s", chunk.key, e)
        self.on_event(chunk.key, "damaged", tier)
        return FAILED

    def _missing(self, chunk: ChunkIO) -> Failed:
        self.on_event(chunk.key, "missing", "none")
        return FAILED

    def _place(self, chunk: ChunkIO) -> Callable[[Any], Any]:
        """The buffers of the chunk's blocks an entry is read into (``cache.placed.Place``)."""
        copier = self.copiers[chunk.kind]
        return lambda info: copier.place(chunk.block_ids, chunk.skip_blocks, info.dtype, info.shape)
