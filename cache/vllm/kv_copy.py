"""Copies between vLLM's paged KV cache and host entries, for CPU and CUDA caches.

Runs in the vLLM worker process. ``gather_async`` on the forward thread after the
forward pass was launched (saves: ``wait_for_save``); ``scatter`` on the forward thread
before it (synchronous loads) or on a loader thread (asynchronous loads, into blocks no
running request uses); ``place`` (CPU only) hands a reader the cache's own memory.

Layout (``cache.vllm.kv_layout``): vLLM 0.32 hands one ``[B, H, N, C]`` view per layer
of one int8 buffer, in one of six physical layouts, maybe split into kernel blocks;
``KVLayout`` turns each into a view of words with manager blocks along dimension 0
and each block's values in the canonical order entries hold: ``[layers, blocks, H, N,
C]``, contiguous, the cache's dtype named in the entry's header.

Hybrid models (``cache.vllm.groups``): a copier may span several KV cache groups,
each with its own block table. It is then built with ``layer_groups`` (each layer's
group) and given the blocks of every group back to back, ``n`` per group; layer *i*
uses the run of its group. Layers of different groups may share one buffer (vLLM's
hybrid allocator): their blocks never overlap.

Host memory: entries are staged in the worker's bounded pool (``cache.vllm.staging``):
pinned on CUDA, one slot per entry in flight, nothing pinned per call.

Order on CUDA (the stream calls are ``cache.vllm.streams``). Copies run on the copier's
own stream. The compute stream is taken, with an event recorded on it, *before* the
copier's stream becomes current (inside it, "the current stream" is the copier's own),
and every method first selects the copier's device on the calling thread:
- ``gather_async`` copies after the work queued on the compute stream so far (the
  forward pass that wrote the blocks) and returns at once with the host entry, a
  ``wait`` the writer thread calls before reading it, and a ``release`` of its staging
  slot; ``fence`` makes the compute stream wait for the gathers issued so far before
  the next forward pass may overwrite their blocks;
- ``scatter`` from the forward thread copies after the compute stream's queued work
  (a block's last reader may still be queued: vLLM schedules ahead) and makes the
  compute stream wait for the copy: the host does not block;
- ``scatter`` from another thread copies after ``after``, a ``compute_mark`` taken on the
  forward thread (e.g. after vLLM zeroed freshly allocated blocks), and returns once the
  blocks hold the data (the load is then reported finished);
- nothing is reused before the copy that reads or writes it has ended: a staging slot
  only after the copy's event (a missing sync garbled restored KV in vLLM's simple CPU
  offload, vllm#45704).
On the CPU a load's copy is done when the method returns; a save's copy runs on the
worker's copy thread (``copies``) while the step samples: ``gather_async`` queues it, the
writer's ``wait`` waits for it, ``release`` frees the slot once it ended, and ``fence``
(before vLLM's next writes to blocks) waits for the copies queued so far. They use numpy
(one thread, the GIL released): a torch copy may start an OpenMP team on the spare core.
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_for
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from cache.vllm.kv_layout import KVLayout, check_entry
from cache.vllm.staging import StagingPool, staging_pool
from cache.vllm.streams import CudaStreams

__all__ = ["BlockCopier", "Gathered", "KVLayout", "MAX_SLICE_RUNS", "copiers_for"]

log = logging.getLogger(__name__)


def _done() -> None:
    """``wait`` of a copy that is already complete."""


def _after(copied: Future, release: Callable[[], None]) -> Callable[[], None]:
    """``release`` once ``copied`` has ended (at once if it has; else on the copy thread)."""
    return lambda: copied.add_done_callback(lambda _f: release())


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``block_ids`` as runs of consecutive ids: (position in block_ids, first id, length)."""
    runs: list[tuple[int, int, int]] = []
    for pos, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((pos, b, 1))
    return runs


# A CPU copy of a layer's blocks takes slice copies when the blocks come in at most this
# many runs (vLLM hands a new request mostly consecutive blocks): a slice copy is a plain
# memcpy, about 1.4x as fast here as index_copy_/index_select on the same bytes.
MAX_SLICE_RUNS = 4


class Gathered:
    """A save's copy, maybe still in flight: ``host`` (the entry) holds the blocks once
    ``wait()`` returned; ``release()`` gives its staging slot back (any thread, once)."""

    __slots__ = ("host", "wait", "_release")

    def __init__(self, host: torch.Tensor, wait: Callable[[], None], release: Callable[[], None]) -> None:
        self.host, self.wait, self._release = host, wait, release

    def release(self) -> None:
        release, self._release = self._release, _done
        release()

    def then(self, settled: Callable[[str], None]) -> Callable[[str], None]:
        """``settled(key)``, after releasing the slot: the store's ``on_done``."""

        def done(key: str) -> None:
            self.release()
            settled(key)

        return done


class BlockCopier:
    """Moves whole blocks between the KV cache and host entries."""

    def __init__(
        self,
        kv_caches: dict[str, torch.Tensor],
        layout: KVLayout,
        layer_groups: Optional[Sequence[int]] = None,
        staging: Optional[StagingPool] = None,
        streams=None,
        copies: Optional[Executor] = None,
    ) -> None:
        """``staging``: the worker's pool (None: a new host tensor per gather, pageable).
        ``streams``: the stream calls (default: ``CudaStreams`` for a CUDA cache, none on
        the CPU); a test passes a recorder, which runs the stream path on CPU tensors.
        ``copies``: a CPU cache's save-copy thread (one worker; None: saves are copied on
        the calling thread)."""
        self.layout = layout
        self.caches = layout.views(kv_caches)  # canonical word views, blocks along dim 0
        self._layers = [kv_caches[n] for n in layout.layer_names]
        # each layer's run in a call's block ids (one run for all layers by default)
        self.layer_groups = tuple(layer_groups) if layer_groups is not None else (0,) * len(self.caches)
        self.n_groups = max(self.layer_groups, default=0) + 1
        self.device = self._layers[0].device
        if streams is None and self.device.type == "cuda":
            streams = CudaStreams(self.device)
        self.streams = streams
        self.cuda = streams is not None  # copies ordered on streams
        self.staging = staging
        self._stream = streams.new_stream() if streams is not None else None
        self._copies = copies if not self.cuda else None
        self._lock = threading.Lock()  # one copy's launches at a time on the stream
        self._last: Any = None  # CUDA event, or CPU Future: end of the last gather not yet fenced
        self._words: Optional[list[np.ndarray]] = None  # the word views as numpy arrays (copy thread)
        self._bytes: Optional[list] = None  # ``place``: each layer's memory as a numpy byte array

    @property
    def placeable(self) -> bool:
        """Whether entries can be read straight into this cache's blocks (``place``): CPU
        tensors, one KV cache group, contiguous layers whose blocks are not split
        (so a layer's memory is its blocks in canonical order, one after the other)."""
        return (
            not self.cuda
            and self.n_groups == 1
            and self.layout.split == 1
            and all(t.is_contiguous() for t in self._layers)
        )

    def place(self, block_ids: Sequence[int], skip_blocks: int, dtype: str, shape: Sequence[int]) -> list[memoryview]:
        """Where each byte of an entry (``dtype``, ``shape``: ``[layers, held blocks, ...]``)
        goes when read straight into ``block_ids``: writable views in payload order, the
        entry's blocks ``skip_blocks .. skip_blocks + len(block_ids)`` into the cache and
        the others into a scratch buffer (read only to be verified). Only for a
        ``placeable`` copier; ``ValueError`` when the entry does not fit this cache."""
        n = len(block_ids)
        held = check_entry(self.layout, dtype, shape, skip_blocks + n)
        block_bytes = self.layout.block_bytes()
        spare = held - n
        scratch = memoryview(bytearray(block_bytes * max(skip_blocks, spare - skip_blocks)))  # (empty: none spare)
        runs = _runs(block_ids)
        if self._bytes is None:  # each layer's tensor as bytes, made once
            self._bytes = [t.view(-1).view(torch.uint8).numpy() for t in self._layers]
        views: list[memoryview] = []
        for raw in self._bytes:
            if skip_blocks:
                views.append(scratch[: skip_blocks * block_bytes])
            for _pos, first, length in runs:
                views.append(memoryview(raw[first * block_bytes : (first + length) * block_bytes]))
            if held > skip_blocks + n:
                views.append(scratch[: (held - skip_blocks - n) * block_bytes])
        return views

    def _per_group(self, block_ids: Sequence[int]) -> int:
        n, odd = divmod(len(block_ids), self.n_groups)
        if odd:
            raise ValueError(f"{len(block_ids)} block ids do not split into {self.n_groups} groups")
        return n

    def _index(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """Each layer's index tensor: the run of ``block_ids`` of its group."""
        n = self._per_group(block_ids)
        ids = torch.tensor(block_ids, dtype=torch.long).view(self.n_groups, n)
        if self.cuda:
            ids = self.streams.to_device(ids)
        return [ids[g] for g in self.layer_groups]

    def _group_runs(self, block_ids: Sequence[int]) -> list[list[tuple[int, int, int]]]:
        """Each KV cache group's run of ``block_ids`` as runs of consecutive blocks."""
        n = self._per_group(block_ids)
        return [_runs(block_ids[g * n : (g + 1) * n]) for g in range(self.n_groups)]

    def _cpu_copy(self, block_ids: Sequence[int], entry: torch.Tensor, into_cache: bool) -> None:
        """Copy between the CPU KV cache's ``block_ids`` and ``entry`` (words, ``[layers,
        n blocks, ...]``, any strides): slice copies per run of consecutive blocks, or
        ``index_copy_``/``index_select`` when the blocks are scattered."""
        runs = self._group_runs(block_ids)
        if max(len(r) for r in runs) > MAX_SLICE_RUNS:
            idx = self._index(block_ids)
            for i, cache in enumerate(self.caches):
                if into_cache:
                    cache.index_copy_(0, idx[i], entry[i])
                else:
                    torch.index_select(cache, 0, idx[i], out=entry[i])
            return
        for i, cache in enumerate(self.caches):
            for pos, first, length in runs[self.layer_groups[i]]:
                blocks, held = cache.narrow(0, first, length), entry[i].narrow(0, pos, length)
                (blocks if into_cache else held).copy_(held if into_cache else blocks)

    # -- saves -------------------------------------------------------------------
    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A new host tensor (the entry) holding ``block_ids`` of every layer; returns once
        copied. Uses no staging slot."""
        host = torch.empty(self.layout.entry_shape(self._per_group(block_ids)), dtype=self.layout.dtype)
        if self.cuda:
            self.streams.select()
        self._gather(block_ids, host).wait()
        return host

    def gather_async(self, block_ids: Sequence[int]) -> Optional[Gathered]:
        """Start copying ``block_ids`` of every layer into a staging slot (a new host
        tensor without a pool). None when the pool has no slot free: the save is
        skipped (counted), never waited for. On CUDA, call ``fence`` before the compute
        stream may write these blocks again (the next forward pass)."""
        n = self._per_group(block_ids)
        if self.cuda:
            self.streams.select()  # first: the pool's take may query the events of copies in flight
        if self.staging is None:
            return self._gather(block_ids, torch.empty(self.layout.entry_shape(n), dtype=self.layout.dtype))
        slot = self.staging.take(n * self.layout.bytes_per_block(), "save")
        if slot is None:
            return None
        return self._gather(block_ids, slot.view(self.layout.dtype, self.layout.entry_shape(n)), slot)

    def _gather(self, block_ids: Sequence[int], host: torch.Tensor, slot=None) -> Gathered:
        """Copy into ``host`` (``slot``'s, if any); the caller selected the device."""
        words = self.layout.entry_words(host, writable=True)
        if not self.cuda:
            pool, release = self.staging, _done
            if slot is not None and pool is not None:
                release = functools.partial(pool.release, slot)
            if self._copies is None:
                self._cpu_copy(block_ids, words, into_cache=False)
                return Gathered(host, _done, release)
            copied = self._copies.submit(self._copy_out, list(block_ids), words)
            with self._lock:
                self._last = copied
            return Gathered(host, copied.result, _after(copied, release))
        s = self.streams
        order = s.mark(s.current())  # the compute stream: taken before ours becomes current
        with self._lock, s.using(self._stream):
            s.wait(self._stream, order)  # after the forward pass that wrote the blocks
            idx = self._index(block_ids)
            staging = torch.empty(words.shape, dtype=words.dtype, device=self.device)
            for i, cache in enumerate(self.caches):
                torch.index_select(cache, 0, idx[i], out=staging[i])
            words.copy_(staging, non_blocking=True)
            done = s.mark(self._stream)
            self._last = done

        def wait() -> None:  # on the writer thread
            s.select()
            s.synchronize(done)

        pool = self.staging
        return Gathered(
            host, wait, (lambda: pool.release(slot, after=done)) if slot is not None and pool is not None else _done
        )

    def _copy_out(self, block_ids: list[int], entry: torch.Tensor) -> None:
        """``_cpu_copy`` out of the cache, on the copy thread: numpy slice copies, one run
        of consecutive blocks at a time."""
        if self._words is None:
            self._words = [c.numpy() for c in self.caches]
        runs = self._group_runs(block_ids)
        for i, cache in enumerate(self._words):
            held = entry[i].numpy()
            for pos, first, length in runs[self.layer_groups[i]]:
                np.copyto(held[pos : pos + length], cache[first : first + length])

    def fence(self) -> None:
        """Order vLLM's next writes to blocks after the gathers issued since the last
        fence: call it before a forward pass, or anything else, may write blocks a gather
        is still reading. CUDA: the calling thread's (compute) stream waits, the thread
        does not block. CPU: the thread waits for the copy thread's gathers. Called from
        the thread that issues the gathers."""
        with self._lock:
            last, self._last = self._last, None
        if isinstance(last, Future):
            wait_for([last])  # (a failed copy fails its save on the writer thread, not here)
        elif last is not None:
            self.streams.select()
            self.streams.wait(self.streams.current(), last)

    # -- loads -------------------------------------------------------------------
    def compute_mark(self):
        """An event after the work queued so far on the calling thread's (compute)
        stream, for a ``scatter`` issued later from another thread (None on the CPU)."""
        if not self.cuda:
            return None
        self.streams.select()
        return self.streams.mark(self.streams.current())

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor, skip_blocks: int = 0, after=None) -> None:
        """Write ``src`` (an entry, ``[layers, held blocks, ...]`` in the cache's dtype)
        into ``block_ids``, skipping the entry's first ``skip_blocks`` blocks (and leaving
        out its blocks past those). On CUDA: without ``after``, the caller is the forward
        thread: the copy follows its stream's queued work and that stream waits for the
        copy (returns at once); with ``after`` (a ``compute_mark``), the copy follows it
        and this returns once the blocks hold the data."""
        n = self._per_group(block_ids)
        if n == 0:
            return
        held = src.shape[1] if src.ndim > 1 else 0
        if held < skip_blocks + n or tuple(src.shape) != self.layout.entry_shape(held):
            raise ValueError(
                f"entry shape {tuple(src.shape)} does not fit {skip_blocks + n} blocks "
                f"of {self.layout.entry_shape(skip_blocks + n)}"
            )
        part = self.layout.entry_words(src).narrow(1, skip_blocks, n)
        if not self.cuda:
            self._cpu_copy(block_ids, part, into_cache=True)
            return
        s = self.streams
        s.select()
        slot = None
        if self.staging is not None:  # into pinned memory first, without holding the lock
            slot = self.staging.take(n * self.layout.bytes_per_block(), "load")
        if slot is not None:
            host = slot.view(part.dtype, part.shape)
            host.copy_(part)
        else:  # no slot free: straight from the entry's (pageable) memory, slower
            host = part
        order = after if after is not None else s.mark(s.current())  # before ours is current
        with self._lock, s.using(self._stream):
            s.wait(self._stream, order)
            dev = host.to(self.device, non_blocking=True)
            idx = self._index(block_ids)
            for i, cache in enumerate(self.caches):
                cache.index_copy_(0, idx[i], dev[i])
            done = s.mark(self._stream)
        if slot is not None and self.staging is not None:  # (a slot is the pool's)
            self.staging.release(slot, after=done)
        if after is None:
            s.wait(s.current(), done)  # the forward pass reads the blocks after the copy
        else:
            s.synchronize(done)  # the blocks hold the data before the load is reported


def copiers_for(
    kv_caches: dict[str, torch.Tensor],
    groups,
    num_blocks: int,
    chunk_blocks: int,
    staging_bytes: int,
    tiers: str = "",
    copies: Optional[Executor] = None,
) -> tuple[list[BlockCopier], StagingPool]:
    """One copier per entry kind of ``groups`` (``cache.vllm.groups.GroupLayout``) over
    vLLM's views, and the staging pool they share: ``staging_bytes`` in slots of the
    largest chunk entry (``chunk_blocks`` blocks); ``copies``: a CPU cache's save-copy
    thread. ``ValueError``: views it cannot read."""
    layouts = []
    for kind in groups.kinds:
        if groups.hybrid:  # the kind's layers, each reading its group's blocks
            names, layer_groups = kind.layer_names, kind.layer_groups
        else:  # one group: every layer in vLLM's order, as entries always held them
            names, layer_groups = tuple(kv_caches), None
        layout = KVLayout.of({n: kv_caches[n] for n in names}, num_blocks)
        layouts.append((layout, layer_groups))
        log.info(
            "kvcache: %d KV layers%s, %s, %d bytes per block; tiers: %s",
            len(names),
            f" ({kind.tag})" if kind.tag else "",
            layout.describe(),
            layout.bytes_per_block(),
            tiers,
        )
    device = next(iter(kv_caches.values())).device
    pool = staging_pool(staging_bytes, max(lay.bytes_per_block() for lay, _ in layouts) * chunk_blocks, device)
    log.info("kvcache: %s on %s (KVCACHE_STAGING_SIZE)", pool.describe(), device)
    return [BlockCopier(kv_caches, lay, lg, pool, copies=copies) for lay, lg in layouts], pool
