"""Layer-wise loads: a synchronous load handed to the forward pass a layer at a time.

Runs in the vLLM worker process (CPU blocks, ``BlockCopier.placeable``). An entry holds
its layers one after the other (``[layers, blocks, ...]``), so a load can read layer
*i* of every chunk, then layer *i+1*, while the forward pass computes the new tokens of
layer *i*: vLLM calls ``wait_for_layer_load`` before each attention layer, and only that
layer's KV must be in place by then. For a cached prefix and a new suffix, the load
and the suffix's compute overlap instead of running one after the other.

Each chunk's next layer is one task on the store's read threads (``EntryRead.step``),
queued behind every chunk's current layer, so layers arrive in order across chunks.
The forward thread, while it waits, takes queued tasks of local chunks itself (the read
threads share the cores its compute leaves); a shared-tier chunk is only ever read on a
read thread (a network read it could not stop at the deadline).

Verification: each chunk's payload is hashed in order as its layers arrive and checked
after the last; until then its layers are unverified. A chunk found bad (or gone, or
past the load's deadline) fails its blocks and every later block of the request
(``finish``), which vLLM takes after the forward pass: it drops that step's output for
the request and recomputes those blocks, so nothing computed from an unverified layer
is ever returned. ``finish`` waits for every read still writing into the blocks; after
it, nothing more is written.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Optional

from cache.codec import HEADER_SIZE
from cache.placed import BlockWriters, LoadEnded, Misfit
from cache.store import ELSEWHERE
from cache.vllm.metadata import LoadRequest

log = logging.getLogger(__name__)

# A load goes layer by layer only when the forward pass beside it computes at least this
# many of the request's tokens: with less (a full hit computes one) there is nothing to
# overlap, and whole loads are faster (measured here on full hits at 4K/8K tokens,
# layer-wise against whole: disk 116/147 vs 76/125 ms, DRAM 47/77 vs 46/63 ms; DRAM again
# after the direct disk reads, two alternated rounds: 41,44/70,69 vs 37,41/62,71 ms: the
# load, which has both cores when whole, shares them with the forward pass's layers).
MIN_COMPUTE_TOKENS = 64

# How long the forward thread sleeps at most between looks at a load it waits for (it
# is woken as soon as a layer lands; this only bounds a missed wake-up and the deadline).
POLL_S = 0.05


class LayeredLoad:
    """One synchronous load of ``worker`` (a ``cache.vllm.worker.WorkerSide``), started at
    once on the store's read threads. ``wait(layer)`` on the forward thread; ``finish``
    once after the forward pass: the blocks that failed."""

    def __init__(self, worker, load: LoadRequest, layer_names: tuple[str, ...]) -> None:
        self.worker, self.load = worker, load
        self.store = worker.store
        self.n_layers = len(layer_names)
        self.layer_of = {name: i for i, name in enumerate(layer_names)}
        self.writers = BlockWriters()
        self.read: dict[str, int] = {}  # bytes verified per tier
        self.started = time.perf_counter()
        self.end = None if load.deadline_s is None else time.monotonic() + load.deadline_s
        n = len(load.chunks)
        self._cond = threading.Condition()
        self._reads: list = [None] * n       # each chunk's EntryRead, once found
        self._layers = [0] * n               # layers in place per chunk
        self._remote = [False] * n           # read threads only (the shared tier)
        self._queued: dict[int, Future] = {}  # chunk -> its next layer's task, in queue order
        self._failed_at = n                  # first chunk that failed (n: none)
        self._cut = False                    # past the deadline
        self._ended = False
        self._waited = 0.0                   # the forward thread's time in ``wait``
        self._done_at: Optional[float] = None  # when the last chunk was whole
        self._failed: Optional[set[int]] = None
        # The forward pass writes its new tokens' KV into a layer's blocks before it waits
        # for that layer: a last block the hit fills only in part must be whole before the
        # forward pass begins, or a layer landing late would overwrite the new tokens there.
        tail = n - 1 if n and load.hit_end % worker.block_size else None
        for c in range(n):
            if c != tail:
                self._queue(c)
        if tail is not None:
            self._read_whole(tail)

    def _read_whole(self, c: int) -> None:
        """Chunk ``c``, every layer, before this returns (forward thread; a shared-tier read
        on a read thread, waited for until the load's deadline)."""
        worker, chunk = self.worker, self.load.chunks[c]
        how, got = worker._read_chunk(chunk, self.writers, local_only=True)
        if how == "remote":
            future = self.store.run_read(worker._read_chunk, chunk, self.writers)
            try:
                how, got = future.result(timeout=None if self.end is None else max(0.0, self.end - time.monotonic()))
            except FutureTimeout:
                with self._cond:
                    self._cut_here()
                return
        done = got if how == "placed" else worker._fill(chunk, got) if how == "entry" else None
        if done is not None:
            self._count(chunk, done)
        with self._cond:
            if done is None:
                self._failed_at = min(self._failed_at, c)
            else:
                self._layers[c] = self.n_layers
            self._note_done()

    # -- read threads and the forward thread ---------------------------------------
    def _queue(self, c: int) -> None:
        """Queue chunk ``c``'s next layer on a read thread (under the lock or at start)."""
        try:
            self._queued[c] = self.store.run_read(self._advance, c, False)
        except RuntimeError:  # the store is closing: the chunk is recomputed
            self._failed_at = min(self._failed_at, c)

    def _advance(self, c: int, here: bool) -> None:
        """Read chunk ``c``'s next layer (``here``: on the forward thread, local tiers only)."""
        chunk = self.load.chunks[c]
        with self._cond:
            self._queued.pop(c, None)
            if self._ended or c >= self._failed_at:
                return
        ok, whole, remote = True, False, False
        try:
            read = self._reads[c]
            if read is None:
                copier = self.worker.copiers[chunk.kind]
                found = self.store.read_layers(
                    chunk.key, lambda info: copier.place(chunk.block_ids, chunk.skip_blocks, info.dtype, info.shape),
                    self.writers, local_only=here)
                if found is ELSEWHERE and here:
                    remote = True
                elif found is ELSEWHERE:  # a tier that does not read in place: the whole entry
                    done = self.worker._fill(chunk, self.store.get(chunk.key))
                    ok, whole = done is not None, True
                    if ok:
                        self._count(chunk, done)
                elif found is None:
                    self.worker._on_event(chunk.key, "missing", "none")
                    ok = False
                else:
                    self._reads[c] = read = found
            else:
                ok = read.step()
            if ok and read is not None and read.read.done:
                whole = True
                self._count(chunk, (read.tier, HEADER_SIZE + read.read.info.payload_len))
        except LoadEnded:
            ok = False
        except Misfit as e:
            self.worker._misfit(chunk, e.tier, e)
            ok = False
        except Exception:  # never let a read thread's failure pass unseen
            log.exception("kvcache: loading chunk %s failed", chunk.key)
            self.worker._on_event(chunk.key, "damaged", "none")
            ok = False
        read = self._reads[c]
        with self._cond:
            if remote:
                self._remote[c] = True
            elif not ok:
                self._failed_at = min(self._failed_at, c)
            elif whole:
                self._layers[c] = self.n_layers
            elif read is not None:
                self._layers[c] = read.read.next_part
            if ok and not whole and not self._ended and c < self._failed_at:
                self._queue(c)
            self._note_done()
            self._cond.notify_all()

    def _note_done(self) -> None:
        """Under the lock: note when the load is whole (its time, for the cost model, is
        until then, not until the forward pass beside it ends)."""
        if self._done_at is None and self._ready(self.n_layers - 1):
            self._done_at = time.perf_counter()

    def _count(self, chunk, done: tuple[int, int]) -> None:
        with self._cond:
            self.worker._loaded(chunk, done, self.read)

    def _ready(self, layer: int) -> bool:
        """Whether ``layer`` is in place in every chunk that can still load (under the lock)."""
        return all(n > layer for n in self._layers[:self._failed_at])

    def _steal(self) -> Optional[int]:
        """A queued layer of a local chunk no read thread has started, taken off the queue
        (under the lock); the forward thread reads it itself."""
        for c, fut in list(self._queued.items()):
            if not self._remote[c] and fut.cancel():
                del self._queued[c]
                return c
        return None

    # -- the forward thread ------------------------------------------------------------
    def wait(self, layer_name: str) -> None:
        """Return once ``layer_name``'s KV is in place in every chunk (or the load failed,
        or passed its deadline: what is missing is then recomputed). A layer this load
        does not know waits for the whole load."""
        layer = self.layer_of.get(layer_name, self.n_layers - 1)
        t0 = time.perf_counter()
        while True:
            with self._cond:
                if self._ended or self._ready(layer):
                    break
                if self.end is not None and time.monotonic() >= self.end:
                    self._cut_here()
                    break
                c = self._steal()
                if c is None:
                    timeout = POLL_S if self.end is None else max(0.0, min(POLL_S, self.end - time.monotonic()))
                    self._cond.wait(timeout)
                    continue
            self._advance(c, True)
        self._waited += time.perf_counter() - t0

    def _cut_here(self) -> None:
        """Past the deadline (under the lock): the chunks not whole by now are recomputed."""
        first = next((c for c, n in enumerate(self._layers[:self._failed_at]) if n < self.n_layers), None)
        if first is None:
            return
        log.info("kvcache: load of request %s passed its %.3f s deadline at chunk %d of %d; "
                 "the rest is recomputed", self.load.req_id, self.load.deadline_s, first, len(self.load.chunks))
        self.worker._on_event(self.load.chunks[first].key, "recompute", "none")
        self._failed_at, self._cut = first, True

    def finish(self) -> set[int]:
        """After the forward pass: wait for the rest of the load (to its deadline), stop
        every read still queued, wait for those writing into the blocks; the blocks that
        failed. Later calls return the same set."""
        if self._failed is not None:
            return self._failed
        self.wait("")  # every layer
        with self._cond:
            self._ended = True
            for fut in self._queued.values():
                fut.cancel()
            self._queued.clear()
        self.writers.close()
        chunks = self.load.chunks
        with self._cond:
            self._failed = {b for ch in chunks[self._failed_at:] for b in ch.block_ids}
        seconds = (self._done_at or time.perf_counter()) - self.started
        worker = self.worker
        if worker.costs is not None:
            worker.costs.loaded(self.load, seconds, self.read, self._cut, bool(self._failed),
                                forward_seconds=self._waited, layered=True)
        if worker._timer is not None:
            worker._timer("load", seconds, req=self.load.req_id, asynchronous=False, chunks=len(chunks),
                          failed=len(self._failed), cut_short=self._cut, estimate=self.load.estimate_s,
                          layered=True)
        return self._failed


class StepLoads:
    """A worker's layer-wise loads of the current step (forward thread only)."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.loads: list[LayeredLoad] = []

    def wants(self, load: LoadRequest) -> bool:
        """Whether a synchronous load goes layer by layer: the setting on
        (``KVCACHE_LAYERED_LOADS``), enough compute beside it (``MIN_COMPUTE_TOKENS``),
        CPU blocks read in place, one entry kind holding every layer."""
        w = self.worker
        return (w.config.layered_loads and load.compute_tokens >= MIN_COMPUTE_TOKENS and not w.layout.hybrid
                and len(w.copiers) == 1 and w.copiers[0].placeable)

    def start(self, load: LoadRequest) -> None:
        self.loads.append(LayeredLoad(self.worker, load, self.worker.copiers[0].layout.layer_names))

    def wait(self, layer_name: str) -> None:
        for load in self.loads:
            load.wait(layer_name)

    def finish(self) -> None:
        """After the forward pass: end every load of the step; the blocks that failed go
        to vLLM with the step's output (``WorkerSide.get_block_ids_with_load_errors``)."""
        loads, self.loads = self.loads, []
        for load in loads:
            failed = load.finish()
            if failed:
                with self.worker._lock:
                    self.worker._failed_blocks |= failed
