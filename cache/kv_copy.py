"""Copies between vLLM's paged KV tensors and host buffers, for CPU and CUDA tensors.

Runs in the vLLM worker process. ``gather`` is called after the forward pass (saves),
``scatter`` before it (synchronous loads) or from a loader thread (asynchronous loads,
into blocks no running request uses).

Layout: vLLM hands each attention layer's KV cache as one tensor whose block dimension
is 0 (CPU backend ``[blocks, 2, ...]``, MLA ``[blocks, block_size, dim]``) or 1 (flash
attention ``[2, blocks, ...]``). An entry holds every layer for a run of blocks:
``[layers, *layer_shape with blocks=n]``, contiguous, in the model's KV dtype.

On CUDA the host side is pinned memory, copies run on the copier's own stream, and a
buffer or block is only handed back after the event that ends its copy has completed
(a missing sync here garbled restored KV in vLLM's simple CPU offload, vllm#45704).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

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


class BlockCopier:
    """Moves whole blocks between the KV cache and host tensors."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], layout: KVLayout) -> None:
        self.layout = layout
        self.caches = [kv_caches[n] for n in layout.layer_names]
        self.device = self.caches[0].device
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._lock = threading.Lock()  # one copy at a time on the stream

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A new host tensor holding ``block_ids`` of every layer. Returns once copied."""
        shape = self.layout.entry_shape(len(block_ids))
        bd = self.layout.block_dim
        if not self.cuda:
            out = torch.empty(shape, dtype=self.layout.dtype)
            idx = self._index(block_ids)
            for i, cache in enumerate(self.caches):
                torch.index_select(cache, bd, idx, out=out[i])
            return out
        host = torch.empty(shape, dtype=self.layout.dtype, pin_memory=True)
        with self._lock, torch.cuda.stream(self._stream):
            # The forward pass that wrote these blocks ran on the compute stream.
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            idx = self._index(block_ids)
            staging = torch.empty(shape, dtype=self.layout.dtype, device=self.device)
            for i, cache in enumerate(self.caches):
                torch.index_select(cache, bd, idx, out=staging[i])
            host.copy_(staging, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()  # host buffer complete before anyone reads it
        return host

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor, first: int = 0) -> None:
        """Write ``src`` (an entry, ``[layers, ..blocks..]``) into ``block_ids``, skipping
        the entry's first ``first`` blocks (and leaving out its blocks past those).
        Returns once the blocks hold the data."""
        bd = self.layout.block_dim
        n = len(block_ids)
        if n == 0:
            return
        held = src.shape[bd + 1] if src.ndim > bd + 1 else 0
        if held < first + n or tuple(src.shape) != self.layout.entry_shape(held):
            raise ValueError(f"entry shape {tuple(src.shape)} does not fit {first + n} blocks")
        part = src.narrow(bd + 1, first, n)
        if not self.cuda:
            idx = self._index(block_ids)
            for i, cache in enumerate(self.caches):
                cache.index_copy_(bd, idx, part[i])
            return
        with self._lock, torch.cuda.stream(self._stream):
            pinned = part if part.is_pinned() else part.contiguous().pin_memory()
            staging = pinned.to(self.device, non_blocking=True)
            idx = self._index(block_ids)
            for i, cache in enumerate(self.caches):
                cache.index_copy_(bd, idx, staging[i])
            done = torch.cuda.Event()
            done.record(self._stream)
        # Blocks written and the host buffer free again before we return.
        done.synchronize()
