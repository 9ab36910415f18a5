"""Copies between vLLM's paged KV tensors and host buffers, for CPU and CUDA tensors.

Runs in the vLLM worker process. ``gather`` is called after the forward pass (saves),
``scatter`` before it (synchronous loads) or from a loader thread (asynchronous loads,
into blocks no running request uses).

Layout: vLLM hands each attention layer's KV cache as one tensor whose block dimension
is 0 (CPU backend ``[blocks, 2, ...]``, MLA ``[blocks, block_size, dim]``) or 1 (flash
attention ``[2, blocks, ...]``). An entry holds every layer for a run of blocks:
``[layers, *layer_shape with blocks=n]``, contiguous, in the model's KV dtype.

Hybrid models (``cache.vllm.groups``): a copier may span several KV cache groups,
each with its own block table. It is then built with ``layer_groups`` (each layer's
group) and given the blocks of every group back to back, ``n`` per group; layer *i*
uses the run of its group. Layers of different groups may share one tensor (vLLM's
hybrid allocator): their blocks never overlap.

On CUDA the host side is pinned memory and copies run on the copier's own stream,
ordered after the compute stream's work on the same blocks. Nothing is reused before
the copy that reads or writes it has completed (a missing sync here garbled restored KV
in vLLM's simple CPU offload, vllm#45704):
- ``scatter`` returns once its blocks hold the data (the caller then schedules them);
- ``gather_async`` returns at once with the host tensor and a ``wait`` the reader calls
  before touching it (the writer thread, not the forward pass, waits); the blocks
  themselves are protected by ``fence``, which makes the compute stream wait for the
  copies issued so far before the next forward pass may overwrite a block;
- ``compute_mark`` lets a load started on another thread wait for the compute stream's
  work queued before it (e.g. vLLM zeroing freshly allocated blocks).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch


@dataclass(frozen=True)
class KVLayout:
    layer_names: tuple[str, ...]
    block_dim: int
    layer_shape: tuple[int, ...]   # one layer's tensor shape, all blocks
    dtype: torch.dtype

    @classmethod
    def of(cls, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> "KVLayout":
        names = tuple(kv_caches)
        first = kv_caches[names[0]]
        for name, t in kv_caches.items():
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ValueError(f"KV layer {name} differs in shape or dtype from {names[0]}; "
                                 "hybrid KV layouts are not supported")
        if first.shape[0] == num_blocks:
            block_dim = 0
        elif first.ndim > 1 and first.shape[1] == num_blocks:
            block_dim = 1
        else:
            raise ValueError(f"cannot find the block dimension ({num_blocks} blocks) in KV "
                             f"shape {tuple(first.shape)}")
        return cls(names, block_dim, tuple(first.shape), first.dtype)

    def entry_shape(self, n_blocks: int) -> tuple[int, ...]:
        shape = list(self.layer_shape)
        shape[self.block_dim] = n_blocks
        return (len(self.layer_names), *shape)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def bytes_per_block(self) -> int:
        per_layer = self.dtype.itemsize
        for i, d in enumerate(self.layer_shape):
            if i != self.block_dim:
                per_layer *= d
        return per_layer * len(self.layer_names)


def _done() -> None:
    """``wait`` of a copy that is already complete."""


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


class BlockCopier:
    """Moves whole blocks between the KV cache and host tensors."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], layout: KVLayout,
                 layer_groups: Optional[Sequence[int]] = None) -> None:
        self.layout = layout
        self.caches = [kv_caches[n] for n in layout.layer_names]
        # each layer's run in a call's block ids (one run for all layers by default)
        self.layer_groups = tuple(layer_groups) if layer_groups is not None else (0,) * len(self.caches)
        self.n_groups = max(self.layer_groups, default=0) + 1
        self.device = self.caches[0].device
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._lock = threading.Lock()  # one copy at a time on the stream
        self._last: Optional["torch.cuda.Event"] = None  # end of the last gather not yet fenced
        self._bytes = None  # ``place``: each layer's memory as a numpy byte array

    @property
    def placeable(self) -> bool:
        """Whether entries can be read straight into this cache's blocks (``place``): CPU
        tensors, one KV cache group, blocks along dimension 0 of contiguous layers, so a
        run of consecutive blocks is one contiguous span of memory."""
        return (not self.cuda and self.n_groups == 1 and self.layout.block_dim == 0
                and all(c.is_contiguous() for c in self.caches))

    def place(self, block_ids: Sequence[int], skip_blocks: int, dtype: str,
              shape: Sequence[int]) -> list[memoryview]:
        """Where each byte of an entry (``dtype``, ``shape``: ``[layers, held blocks, ...]``)
        goes when read straight into ``block_ids``: writable views in payload order, the
        entry's blocks ``skip_blocks .. skip_blocks + len(block_ids)`` into the cache and
        the others into a scratch buffer (read only to be verified). Only for a
        ``placeable`` copier; ``ValueError`` when the entry does not fit this cache."""
        n = len(block_ids)
        held = shape[1] if len(shape) > 1 else 0
        if dtype != self.layout.dtype_name or held < skip_blocks + n \
                or tuple(shape) != self.layout.entry_shape(held):
            raise ValueError(f"entry {dtype} {tuple(shape)} does not fit {skip_blocks + n} blocks "
                             f"of {self.layout.dtype_name} {self.layout.entry_shape(skip_blocks + n)}")
        block_bytes = self.layout.bytes_per_block() // len(self.caches)
        spare = held - n
        scratch = memoryview(bytearray(block_bytes * max(skip_blocks, spare - skip_blocks))) if spare else None
        runs = _runs(block_ids)
        if self._bytes is None:  # each layer's tensor as bytes, made once
            self._bytes = [c.view(-1).view(torch.uint8).numpy() for c in self.caches]
        views: list[memoryview] = []
        for raw in self._bytes:
            if skip_blocks:
                views.append(scratch[:skip_blocks * block_bytes])
            for _pos, first, length in runs:
                views.append(memoryview(raw[first * block_bytes:(first + length) * block_bytes]))
            if held > skip_blocks + n:
                views.append(scratch[:(held - skip_blocks - n) * block_bytes])
        return views

    def _index(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """Each layer's index tensor: the run of ``block_ids`` of its group."""
        n, odd = divmod(len(block_ids), self.n_groups)
        if odd:
            raise ValueError(f"{len(block_ids)} block ids do not split into {self.n_groups} groups")
        ids = torch.tensor(block_ids, dtype=torch.long).view(self.n_groups, n)
        if self.cuda:
            # From pinned memory, asynchronously: a copy from pageable memory would make this
            # thread wait for everything already queued on the current stream.
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        return [ids[g] for g in self.layer_groups]

    def _cpu_copy(self, block_ids: Sequence[int], entry: torch.Tensor, into_cache: bool) -> None:
        """Copy between the CPU KV cache's ``block_ids`` and ``entry`` (``[layers, ..n
        blocks..]``, any strides): slice copies per run of consecutive blocks, or
        ``index_copy_``/``index_select`` when the blocks are scattered."""
        bd = self.layout.block_dim
        n, odd = divmod(len(block_ids), self.n_groups)
        if odd:
            raise ValueError(f"{len(block_ids)} block ids do not split into {self.n_groups} groups")
        runs = [_runs(block_ids[g * n:(g + 1) * n]) for g in range(self.n_groups)]
        if max(len(r) for r in runs) > MAX_SLICE_RUNS:
            idx = self._index(block_ids)
            for i, cache in enumerate(self.caches):
                if into_cache:
                    cache.index_copy_(bd, idx[i], entry[i])
                else:
                    torch.index_select(cache, bd, idx[i], out=entry[i])
            return
        for i, cache in enumerate(self.caches):
            for pos, first, length in runs[self.layer_groups[i]]:
                blocks, held = cache.narrow(bd, first, length), entry[i].narrow(bd, pos, length)
                (blocks if into_cache else held).copy_(held if into_cache else blocks)

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A new host tensor holding ``block_ids`` of every layer. Returns once copied."""
        host, wait = self.gather_async(block_ids)
        wait()
        return host

    def gather_async(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, Callable[[], None]]:
        """Start copying ``block_ids`` of every layer into a new host tensor; returns it
        and ``wait()``, which returns once the tensor holds them. On the CPU the copy is
        done when this returns. On CUDA, call ``fence`` before the compute stream may
        write these blocks again (the next forward pass)."""
        shape = self.layout.entry_shape(len(block_ids) // self.n_groups)
        bd = self.layout.block_dim
        if not self.cuda:
            out = torch.empty(shape, dtype=self.layout.dtype)
            self._cpu_copy(block_ids, out, into_cache=False)
            return out, _done
        host = torch.empty(shape, dtype=self.layout.dtype, pin_memory=True)
        with self._lock, torch.cuda.stream(self._stream):
            # The forward pass that wrote these blocks ran on the compute stream.
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            idx = self._index(block_ids)
            staging = torch.empty(shape, dtype=self.layout.dtype, device=self.device)
            for i, cache in enumerate(self.caches):
                torch.index_select(cache, bd, idx[i], out=staging[i])
            host.copy_(staging, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
            self._last = done
        return host, done.synchronize

    def fence(self) -> None:
        """Make the calling thread's (compute) stream wait for the gathers issued since
        the last fence: call it before a forward pass that may write blocks a gather is
        still reading. A GPU-side wait: the calling thread does not block. Called from
        the thread that issues the gathers."""
        last, self._last = self._last, None
        if last is not None:
            torch.cuda.current_stream(self.device).wait_event(last)

    def compute_mark(self) -> Optional["torch.cuda.Event"]:
        """An event after the work queued so far on the calling thread's stream, for a
        ``scatter`` issued later from another thread (None on the CPU)."""
        if not self.cuda:
            return None
        mark = torch.cuda.Event()
        mark.record(torch.cuda.current_stream(self.device))
        return mark

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor, skip_blocks: int = 0,
                after: Optional["torch.cuda.Event"] = None) -> None:
        """Write ``src`` (an entry, ``[layers, ..blocks..]``) into ``block_ids``, skipping
        the entry's first ``skip_blocks`` blocks (and leaving out its blocks past those).
        Returns once the blocks hold the data. On CUDA the writes come after the work
        queued on the calling thread's stream, or after ``after`` (a ``compute_mark``
        taken on the compute thread) when given."""
        bd = self.layout.block_dim
        n = len(block_ids) // self.n_groups
        if n == 0:
            return
        held = src.shape[bd + 1] if src.ndim > bd + 1 else 0
        if held < skip_blocks + n or tuple(src.shape) != self.layout.entry_shape(held):
            raise ValueError(f"entry shape {tuple(src.shape)} does not fit {skip_blocks + n} blocks")
        part = src.narrow(bd + 1, skip_blocks, n)
        if not self.cuda:
            self._cpu_copy(block_ids, part, into_cache=True)
            return
        with self._lock, torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            else:
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
            pinned = part if part.is_pinned() else part.contiguous().pin_memory()
            staging = pinned.to(self.device, non_blocking=True)
            idx = self._index(block_ids)
            for i, cache in enumerate(self.caches):
                cache.index_copy_(bd, idx[i], staging[i])
            done = torch.cuda.Event()
            done.record(self._stream)
        # Blocks written and the host buffer free again before we return.
        done.synchronize()
