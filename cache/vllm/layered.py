"""Layer-wise loads: a synchronous load handed to the forward pass a layer at a time.

Runs in the vLLM worker process (CPU blocks, ``BlockCopier.placeable``). An entry holds
its layers one after the other (``[layers, blocks, ...]``), so a load can read layer
*i* of every chunk, then layer *i+1*, while the forward pass computes the new tokens of
layer *i*: vLLM calls ``wait_for_layer_load`` before each attention layer, and only that
layer's KV must be in place by then. For a cached prefix and a new suffix, the load
and the suffix's compute overlap instead of running one after the other.

Each chunk's next layer is one task on the store's read threads (``EntryRead.step``,
through ``cache.vllm.load_path.ChunkLoader.read_layer``: the reader whole loads use),
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

import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Optional

from cache.placed import BlockWriters
from cache.store import EntryRead
from cache.vllm.load_path import ChunkLoader, ChunkResult, Deadline, Partial, Placed, Remote, failed_from
from cache.vllm.metadata import LoadRequest

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
    """One synchronous load read through ``loader`` (a worker's ``ChunkLoader``), started
    at once on the store's read threads. ``wait(layer)`` on the forward thread; ``finish``
    once after the forward pass: the blocks that failed."""

    def __init__(self, loader: ChunkLoader, load: LoadRequest, layer_names: tuple[str, ...]) -> None:
        self.loader, self.load = loader, load
        self.store = loader.store
        self.n_layers = len(layer_names)
        self.layer_of = {name: i for i, name in enumerate(layer_names)}
        self.writers = BlockWriters()
        self.read: dict[str, int] = {}  # bytes verified per tier
        self.started = time.perf_counter()
        self.deadline = Deadline(load.deadline_s)
        n = len(load.chunks)
        self._cond = threading.Condition()
        self._reads: list[Optional[EntryRead]] = [None] * n  # each chunk's read, once found
        self._layers = [0] * n  # layers in place per chunk
        self._remote = [False] * n  # read threads only (the shared tier)
        self._queued: dict[int, Future[None]] = {}  # chunk -> its next layer's task, in queue order
        self._failed_at = n  # first chunk that failed (n: none)
        self._cut = False  # past the deadline
        self._ended = False
        self._waited = 0.0  # the forward thread's time in ``wait``
        self._done_at: Optional[float] = None  # when the last chunk was whole
        self._failed: Optional[set[int]] = None
        # The forward pass writes its new tokens' KV into a layer's blocks before it waits
        # for that layer: a last block the hit fills only in part must be whole before the
        # forward pass begins, or a layer landing late would overwrite the new tokens there.
        tail = n - 1 if n and load.hit_end % loader.block_size else None
        for c in range(n):
            if c != tail:
                self._queue(c)
        if tail is not None:
            self._read_whole(tail)

    def _read_whole(self, c: int) -> None:
        """Chunk ``c``, every layer, before this returns (forward thread; a shared-tier read
        on a read thread, waited for until the load's deadline)."""
        chunk = self.load.chunks[c]
        result: ChunkResult = self.loader.read(chunk, self.writers, local_only=True)
        if isinstance(result, Remote):
            future = self.store.run_read(self.loader.read, chunk, self.writers)
            try:
                result = future.result(timeout=self.deadline.timeout())
            except FutureTimeout:
                with self._cond:
                    self._cut_here()
                return
        placed = self.loader.place(chunk, result)  # (a whole entry is copied here)
        with self._cond:
            if isinstance(placed, Placed):
                self.loader.count(chunk, placed, self.read)
                self._layers[c] = self.n_layers
            else:
                self._failed_at = min(self._failed_at, c)
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
        result = self.loader.read_layer(chunk, self._reads[c], self.writers, local_only=here)
        with self._cond:
            if isinstance(result, Remote):  # read again, on a read thread
                self._remote[c] = True
            elif isinstance(result, Partial):
                self._reads[c] = result.read
                self._layers[c] = result.read.read.next_part
            elif isinstance(result, Placed):
                self.loader.count(chunk, result, self.read)
                self._layers[c] = self.n_layers
            else:
                self._failed_at = min(self._failed_at, c)
            more = isinstance(result, (Remote, Partial))
            if more and not self._ended and c < self._failed_at:
                self._queue(c)
            self._note_done()
            self._cond.notify_all()

    def _note_done(self) -> None:
        """Under the lock: note when the load is whole (its time, for the cost model, is
        until then, not until the forward pass beside it ends)."""
        if self._done_at is None and self._ready(self.n_layers - 1):
            self._done_at = time.perf_counter()

    def _ready(self, layer: int) -> bool:
        """Whether ``layer`` is in place in every chunk that can still load (under the lock)."""
        return all(n > layer for n in self._layers[: self._failed_at])

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
                if self.deadline.passed():
                    self._cut_here()
                    break
                c = self._steal()
                if c is None:
                    self._cond.wait(self.deadline.poll(POLL_S))
                    continue
            self._advance(c, True)
        self._waited += time.perf_counter() - t0

    def _cut_here(self) -> None:
        """Past the deadline (under the lock): the chunks not whole by now are recomputed."""
        first = next((c for c, n in enumerate(self._layers[: self._failed_at]) if n < self.n_layers), None)
        if first is None:
            return
        self.loader.passed_deadline(self.load, first)
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
        with self._cond:
            failed = self._failed = failed_from(self.load, self._failed_at)
        seconds = (self._done_at or time.perf_counter()) - self.started
        self.loader.report(self.load, seconds, self.read, self._cut, failed, forward_seconds=self._waited)
        return failed


class StepLoads:
    """A worker's layer-wise loads of the current step (forward thread only), read through
    ``loader``; ``enabled``: the setting on (``KVCACHE_LAYERED_LOADS``) for a model with
    one KV cache group."""

    def __init__(self, loader: ChunkLoader, enabled: bool) -> None:
        self.loader = loader
        self.enabled = enabled
        self.loads: list[LayeredLoad] = []

    def wants(self, load: LoadRequest) -> bool:
        """Whether a synchronous load goes layer by layer: enabled, enough compute beside
        it (``MIN_COMPUTE_TOKENS``), CPU blocks read in place, one entry kind holding
        every layer."""
        copiers = self.loader.copiers
        if not self.enabled or load.compute_tokens < MIN_COMPUTE_TOKENS:
            return False
        return len(copiers) == 1 and copiers[0].placeable

    def start(self, load: LoadRequest) -> None:
        self.loads.append(LayeredLoad(self.loader, load, self.loader.copiers[0].layout.layer_names))

    def wait(self, layer_name: str) -> None:
        for load in self.loads:
            load.wait(layer_name)

    def finish(self) -> set[int]:
        """After the forward pass: end every load of the step; the blocks that failed (to
        vLLM with the step's output: ``WorkerSide.get_block_ids_with_load_errors``)."""
        loads, self.loads = self.loads, []
        failed: set[int] = set()
        for load in loads:
            failed |= load.finish()
        return failed
