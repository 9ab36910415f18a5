"""Worker side: copies KV between vLLM's paged buffers and the tiers, as the scheduler says.

Runs in each vLLM worker process (one per GPU rank; on the CPU build, one worker).
- ``start_load_kv`` (before the forward pass): DRAM hits are copied in synchronously
  (a memory copy, like vLLM's own prefix cache); loads the scheduler marked
  asynchronous (disk, shared) go to the store's read threads and are reported through
  ``take_transfer_results`` when their blocks are filled. On CPU blocks a synchronous
  load goes layer by layer (``cache.vllm.layered``; ``wait_for_layer_load``). Every
  load reads its chunks through one ``cache.vllm.load_path.ChunkLoader``.
- ``wait_for_save`` (after the forward pass): the new chunks' blocks are copied to host
  tensors and handed to the store's writer thread; encoding, checksums and file writes
  never delay the next step. The copy is only queued, on CUDA to a stream and on the
  CPU to the copy thread (``kvcache-copy``), so the step's sampling goes on: the writer
  waits for it, and ``fence`` orders vLLM's next writes to blocks after it. Settled
  saves go back to the scheduler with the next step's output (``take_settled``).
- A chunk that cannot be loaded (evicted meanwhile, damaged, foreign, a shared-tier
  read past ``KVCACHE_SHARED_TIMEOUT_MS``: the tier's own deadline, or not in place
  by the load's deadline: the scheduler's cost model expected recomputing to be
  faster by then) fails its blocks and every later block of the request; vLLM
  recomputes them. Each load's time and each forward pass's go back to the scheduler
  (``cache.vllm.load_costs``). Hybrid models
  (``cache.vllm.groups``: one copier per entry kind) load asynchronously only, and
  a failure fails the whole request (vLLM takes no block-level failures for several KV
  cache groups); vLLM recomputes it.

The store comes from ``cache.assembly.writer_store``. ``set_timer`` hands benchmarks the
time of each step of a load (``bench/timed_connector.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional

import torch

from cache.assembly import writer_store
from cache.config import CacheConfig
from cache.keys import Namespace
from cache.placed import BlockWriters
from cache.store.idle_gate import IdleGate
from cache.threads import spare_cpus, thread_setup
from cache.vllm.groups import GroupLayout
from cache.vllm.kv_copy import BlockCopier, copiers_for
from cache.vllm.layered import StepLoads
from cache.vllm.load_costs import LoadCosts
from cache.vllm.load_path import ChunkLoader, ChunkResult, Deadline, Failed, Fetched, Remote, failed_from
from cache.vllm.metadata import LoadRequest, TieredKVMetadata, TieredKVWorkerMetadata
from cache.vllm.metrics import StatsDelta
from cache.vllm.staging import StagingPool, half_taken
from cache.vllm.step_clock import step_clock

log = logging.getLogger(__name__)

# Chunk events sent to the scheduler per step at most (beyond: explained as never_stored).
MAX_EVENTS = 8192
# The tiers' usage in the step's stats is at most this old (read on a read thread).
LEVELS_MAX_AGE_S = 1.0


class WorkerSide:
    def __init__(
        self,
        config: CacheConfig,
        namespace: Namespace,
        num_blocks: int,
        block_size: int,
        layout: Optional[GroupLayout] = None,
    ) -> None:
        self.config = config
        self.layout = layout or GroupLayout.single(block_size)
        self.namespace = namespace
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._stats = StatsDelta(per_request=namespace.rank == 0)  # requests counted by rank 0 alone
        cpus = spare_cpus()  # off the compute cores vLLM bound this worker to (CPU backend)
        setup = self._thread_setup = thread_setup(cpus)
        self._lock = threading.Lock()
        self._events: list[tuple[str, str, str]] = []  # chunk events since the last step (cache.explain)
        gate = self.gate = IdleGate(pressed=lambda: half_taken(self.staging))  # (cache.store.idle_gate)
        self.store = writer_store(config, namespace, thread_setup=setup, on_event=self._on_event, gate=gate)
        if cpus:
            log.info("kvcache: I/O threads on CPUs %s (off this worker's compute cores)", sorted(cpus))
        self.copiers: list[BlockCopier] = []  # one per entry kind
        self.staging: Optional[StagingPool] = None  # host buffers of copies (once registered)
        self.costs: Optional[LoadCosts] = None  # measurements for the cost model (once registered)
        self._finished_loads: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._failed_requests: set[str] = set()  # hybrid models: loads that failed
        self._inflight: dict[str, threading.Thread] = {}
        self._copies: Optional[ThreadPoolExecutor] = None  # CPU caches: the saves' copy thread
        self.loader = ChunkLoader(self.store, block_size, self._on_event)  # every load reads through it
        # this step's layer-wise loads (forward thread)
        self.layered = StepLoads(self.loader, config.layered_loads and not self.layout.hybrid)
        self._settled: list[str] = []  # saves settled since the last step (writer thread appends)
        # The tiers' usage for the step's stats: read on a read thread (the writer holds the folder
        # lock as it writes; the forward thread never waits for it), again once a save settled or stale.
        self._levels: Optional[dict[str, int]] = None
        self._levels_at = float("-inf")
        self._levels_reading = False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Views checked (``ValueError``: ``kv_layout``), staging allocated, threads on this device."""
        chunk_blocks = self.config.chunk_tokens // self.block_size
        if next(iter(kv_caches.values())).device.type == "cpu":  # the saves' copies: off the forward thread
            self._copies = ThreadPoolExecutor(1, "kvcache-copy", initializer=self._thread_setup, initargs=("copy",))
        sizes = (self.num_blocks, chunk_blocks, self.config.staging_bytes)
        self.copiers, self.staging = copiers_for(kv_caches, self.layout, *sizes, self.store.describe(), self._copies)
        if self.copiers[0].cuda:  # threads started from now on select it first
            self._thread_setup.select_device = self.copiers[0].streams.select
        self.costs = LoadCosts(step_clock(self.copiers[0].device))
        self.loader.copiers, self.loader.costs = self.copiers, self.costs
        chunk = max(c.layout.bytes_per_block() for c in self.copiers) * chunk_blocks  # the largest entry
        for tier in self.config.tiers():
            if tier.capacity is not None and tier.capacity < chunk:
                where = f"{tier.name} tier ({tier.capacity:,} bytes at {tier.location})"
                log.warning(
                    "kvcache: the %s cannot hold one chunk of this model (%s bytes): chunks go to the next tier down",
                    where,
                    f"{chunk:,}",
                )

    def set_timer(self, timer: Optional[Callable[..., None]]) -> None:
        """Benchmarks: ``timer(step, seconds, **details)`` per tier read, entry check, copy and load."""
        self.loader.timer = timer
        self.store.set_timer(timer)

    # -- loads -----------------------------------------------------------------
    def fence(self) -> None:  # forward thread: vLLM's next writes to KV blocks wait for earlier saves' copies
        for copier in self.copiers:
            copier.fence()

    def step_begins(self, meta: Optional[TieredKVMetadata] = None) -> None:
        """A step's metadata is bound, before its forward pass is launched."""
        self.gate.step_began(hurry=meta is not None and meta.hurry)  # hurry: a request waits for a save
        self.fence()
        if self.costs is not None:
            self.costs.forward_began(meta.compute if meta is not None else None)

    def start_load_kv(self, meta: TieredKVMetadata) -> None:
        if meta.upcoming:
            self.store.hint_upcoming(meta.upcoming)
        if meta.reused:
            self.store.persist(meta.reused)  # queued: copied to disk behind the writes
        for key in meta.publish:  # pinned chunks (cache.pins), on the writer thread
            self.store.share(key)
        mark = None
        for load in meta.loads:
            if load.asynchronous:
                if mark is None and self.copiers:
                    mark = self.copiers[0].compute_mark()  # after the compute stream's work so far
                t = threading.Thread(
                    target=self._load_async, args=(load, mark), daemon=True, name=f"kvcache-load-{load.req_id}"
                )
                self._inflight[load.req_id] = t
                t.start()
            elif self.layered.wants(load):
                self.layered.start(load)
            else:
                self._fail(self._timed_load(load))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before attention layer ``layer_name`` (forward thread): its KV is in place."""
        self.layered.wait(layer_name)

    def _load_async(self, load: LoadRequest, mark: Any) -> None:
        """An asynchronous load, on its own thread; reported by ``take_transfer_results``."""
        self._thread_setup("load")
        failed: set[int] = set()
        try:
            failed = self._timed_load(load, mark)
        except Exception:
            log.exception("kvcache: loading request %s failed", load.req_id)
            failed = failed_from(load, 0)
        with self._lock:
            if failed and self.layout.hybrid:
                self._failed_requests.add(load.req_id)
            else:
                self._failed_blocks |= failed
            self._finished_loads.add(load.req_id)

    def _timed_load(self, load: LoadRequest, mark: Any = None) -> set[int]:
        """A whole load (before the forward pass, or on its own thread), timed; the blocks
        that failed."""
        t = time.perf_counter()
        read: dict[str, int] = {}  # bytes verified per tier
        failed, cut = self._load(load, mark, read)
        self.loader.report(load, time.perf_counter() - t, read, cut, failed)
        return failed

    def _load(self, load: LoadRequest, mark: Any, read: dict[str, int]) -> tuple[set[int], bool]:
        """Fill the request's blocks chunk by chunk; returns the blocks that failed, and
        whether the load passed its deadline (``load.deadline_s``: the chunks not in place
        by then fail, and vLLM recomputes them). ``mark``: the compute stream's point the
        copies must follow (a load on its own thread; see ``BlockCopier.compute_mark``).
        ``read`` gets the bytes verified per tier."""
        assert self.copiers
        if all(self.copiers[c.kind].placeable for c in load.chunks):
            return self._load_placed(load, read)
        deadline = Deadline(load.deadline_s)
        # Reads and checksums run on the store's read threads, ahead of the copies here. A
        # synchronous load's thread (the forward pass waits for it) reads a chunk itself
        # when no read thread has started it yet, rather than wait idle.
        futures = [self.store.get_async(c.key) for c in load.chunks]
        read_here = not load.asynchronous and deadline.end is None
        for i, chunk in enumerate(load.chunks):
            try:
                if read_here and futures[i].cancel():
                    entry = self.store.get(chunk.key)
                else:
                    entry = futures[i].result(timeout=deadline.timeout())
            except FutureTimeout:  # slower than recomputing: the rest is recomputed
                for f in futures[i:]:
                    f.cancel()  # (one already running ends on its own; its result is dropped)
                self.loader.passed_deadline(load, i)
                return failed_from(load, i), True
            if not self.loader.settle(chunk, Fetched(entry), read, mark):
                return failed_from(load, i), False
        return set(), False

    def _load_placed(self, load: LoadRequest, read: dict[str, int]) -> tuple[set[int], bool]:
        """``_load`` for CPU blocks (``BlockCopier.placeable``): each chunk in a local file
        is read straight into its blocks and verified there (``ChunkLoader.read``), on the
        store's read threads, in parallel; a synchronous load's own thread first takes
        every local chunk no read thread has started, then waits for the others.
        Shared-tier chunks are read on a read thread (through the tier's own threads,
        within its deadline), a piece at a time into the blocks. When the load fails or
        passes its deadline, the reads writing into blocks are waited for (a local
        file's chunk, a shared read's piece) and the others write nothing: no block vLLM
        is told to recompute is written afterwards."""
        deadline = Deadline(load.deadline_s)
        writers = BlockWriters()
        futures = [self.store.run_read(self.loader.read, c, writers) for c in load.chunks]
        done_here = {} if load.asynchronous else self._read_here(load, writers, futures, deadline)
        failed_at, cut = None, False
        for i, chunk in enumerate(load.chunks):
            try:
                result = done_here[i] if i in done_here else futures[i].result(timeout=deadline.timeout())
            except FutureTimeout:  # slower than recomputing: the rest is recomputed
                self.loader.passed_deadline(load, i)
                failed_at, cut = i, True
                break
            if not self.loader.settle(chunk, result, read):
                failed_at = i
                break
        if failed_at is None:
            return set(), False
        for f in futures[failed_at:]:
            f.cancel()
        writers.close()
        return failed_from(load, failed_at), cut

    def _read_here(
        self, load: LoadRequest, writers: BlockWriters, futures: list[Future[ChunkResult]], deadline: Deadline
    ) -> dict[int, ChunkResult]:
        """A synchronous placed load: the forward pass waits for this thread, so it reads
        every chunk no read thread has started (the read threads share the cores this
        one's compute leaves), until the deadline (past it by one chunk's read at most)
        or a chunk fails. A shared-tier chunk goes back to a read thread (``futures``)."""
        done_here: dict[int, ChunkResult] = {}
        for i, chunk in enumerate(load.chunks):
            if deadline.passed():
                break
            if not futures[i].cancel():
                continue
            result = self.loader.read(chunk, writers, local_only=True)
            if isinstance(result, Remote):  # the shared tier's read: on a read thread
                futures[i] = self.store.run_read(self.loader.read, chunk, writers)
                continue
            done_here[i] = result
            if isinstance(result, Failed):
                break
        return done_here

    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        """Async loads finished since the last call and those that failed whole (hybrid), taken together."""
        with self._lock:
            done, self._finished_loads = self._finished_loads, set()
            failed, self._failed_requests = self._failed_requests, set()
        for req_id in done:
            self._inflight.pop(req_id, None)
        return done, failed

    def get_stats(self):
        """This step's counter deltas and the tiers' usage, for vLLM's metrics pipeline
        (forward thread, every step: no file lock, no I/O; the usage comes from
        ``levels``)."""
        counters = {**self.store.counters(), **(self.staging.counters() if self.staging else {})}
        if self.costs is not None:
            counters.update(self.costs.totals())
        return self._stats.take(counters, {"all.enabled": 1, **self.levels()})

    def levels(self) -> dict[str, int]:
        """The tiers' usage (``TieredStore.levels``) as last read; a read thread reads it
        again when a save settled since or it is older than ``LEVELS_MAX_AGE_S`` (the
        first call reads it here, at start-up)."""
        with self._lock:
            levels = self._levels
            stale = (
                levels is None or time.monotonic() - self._levels_at > LEVELS_MAX_AGE_S
            ) and not self._levels_reading
            if stale and levels is not None:
                self._levels_reading = True
        if levels is None:
            self._read_levels()
            return self._levels or {}
        if stale:
            try:
                self.store.run_read(self._read_levels)
            except RuntimeError:  # the store is closing: the last usage read stands
                with self._lock:
                    self._levels_reading = False
        return levels

    def _read_levels(self) -> None:
        try:
            levels: Optional[dict[str, int]] = self.store.levels()
        except OSError as e:  # (a tier folder gone: its next write says so) the last usage stands
            log.debug("kvcache: could not read the tiers' usage: %s", e)
            levels = None
        with self._lock:
            self._levels = levels if levels is not None else (self._levels or {})
            self._levels_at, self._levels_reading = time.monotonic(), False

    def _fail(self, blocks: set[int]) -> None:
        """Blocks that could not be loaded: to vLLM with this step's output (any thread)."""
        if blocks:
            with self._lock:
                self._failed_blocks |= blocks

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._fail(self.layered.finish())  # (done in wait_for_save, unless vLLM deferred that)
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # -- saves -----------------------------------------------------------------
    def wait_for_save(self, meta: TieredKVMetadata) -> None:
        self._fail(self.layered.finish())  # this step's layer-wise loads end; failures go with its output
        self.gate.step_ended()
        if self.costs is not None:
            self.costs.forward_ended()
        if not meta.saves or not self.copiers:
            return
        for chunk in meta.saves:
            copier = self.copiers[chunk.kind]
            # On CUDA the copy may still run when put() queues it: the writer thread waits (ready),
            got = copier.gather_async(chunk.block_ids)  # vLLM's next writes to blocks too (fence)
            if got is None:  # no staging slot free: skipped (a future miss), never waited for
                self._on_event(chunk.key, "not_admitted", "all")
                self._on_settled(chunk.key)
                continue
            self.store.put(
                chunk.key,
                chunk.parent,
                copier.layout.dtype_name,
                tuple(got.host.shape),
                got.host.view(torch.uint8).reshape(-1).numpy(),
                shared=chunk.shared,
                on_done=got.then(self._on_settled),
                ready=got.wait,
                borrowed=True,
            )

    def _on_settled(self, key: str) -> None:
        with self._lock:
            self._settled.append(key)
            self._levels_at = float("-inf")  # the usage changed: read again at the next step

    def _on_event(self, key: str, event: str, tier: str) -> None:
        with self._lock:
            if len(self._events) < MAX_EVENTS:
                self._events.append((key, event, tier))

    def take_settled(self) -> Optional[TieredKVWorkerMetadata]:
        """Saves settled and chunk events since the last call, for the scheduler (None: none)."""
        with self._lock:
            settled, self._settled = self._settled, []
            events, self._events = self._events, []
        samples = self.costs.take() if self.costs is not None else []
        return TieredKVWorkerMetadata(settled, events, samples) if settled or events or samples else None

    def shutdown(self) -> None:
        """Flush write-behind (new entries, publishes, copies to disk) within vLLM's worker
        shutdown grace (``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``, 5 s), keeping 1 s of it;
        what is not written by then is a future miss, never a damaged entry."""
        from vllm import envs

        start = time.monotonic()
        deadline = start + max(1.0, envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS - 1.0)
        for t in list(self._inflight.values()):  # loads in flight: at most 1 s in all
            t.join(timeout=max(0.0, start + 1.0 - time.monotonic()))
        self.store.close(timeout=max(0.5, deadline - time.monotonic()))
        if self._copies is not None:  # (the writes waited for their copies)
            self._copies.shutdown(wait=False, cancel_futures=True)
