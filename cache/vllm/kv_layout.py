"""How the connector reads vLLM 0.32's KV cache views: each layer's blocks as bytes in one
canonical order, whatever the physical layout.

Runs in the vLLM worker process, once, in ``register_kv_caches``: ``KVLayout.of`` accepts
the views or refuses them there with the reason (``ValueError``), never later.

What vLLM 0.32 hands ``register_kv_caches`` (``allocate_kv_cache`` in
``vllm/v1/worker/utils.py``; ``create_kv_cache_views`` in ``vllm/v1/kv_cache_interface.py``),
on the GPU and the CPU build alike: one int8 buffer for the whole cache, cut into one
logical ``[B, H, N, C]`` view per attention layer (blocks, head slots, tokens of a block,
content), viewed as the spec's dtype.

- The physical order of ``[L, B, H, N, C]`` is one of six layouts
  (``vllm/v1/kv_cache_layout.py``: LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC), so a view
  is often not contiguous; only C always is (stride 1).
- K and V share C (``head_size + head_size_v`` values per token and head); MLA latents
  are ``[B, 1, N, 576]``; FP8 caches are uint8 or a float8 dtype; ``fp8_ds_mla`` packs
  656 bytes per token, and such pages may be padded (the view skips the padding).
- Where the attention kernel takes smaller blocks than the KV cache manager, each
  manager block is split into ``r`` kernel blocks: the view then has ``r * B`` rows of
  ``N / r`` tokens (``group_kernel_blocks``). The connector is given manager block ids.
- A spec without per-layer views (``has_layer_views`` false) hands the flat buffer.

Entries hold the canonical order: for each layer in order, for each of the entry's
blocks, the manager block's ``[H, N, C]`` values in logical order (head slots, then
the block's tokens in order, then content). That is the physical order of LBHNC, the
CPU backend's only layout, so the entries the CPU build wrote before are read as they
always were (no format change). It depends neither on the physical layout nor on kernel
splitting: the namespace (``cache.vllm.namespace``) holds the KV cache spec, not the
layout, so an engine on FlashAttention (LBNHC) and one on FlashInfer on Blackwell
(LBHNC) serving the same model share entries, and each reads the other's. (The other
choice, the layout in the namespace, would split one model's cache between nodes that
differ only in GPU generation.)

Copies move bytes, not values: each layer's canonical view is reinterpreted as the
widest integer type its content and alignment allow (``word``: int64 for every layout
above), so any dtype copies exactly (CUDA's ``index_copy_`` has no float8 kernel) and
a copy moves words, not bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)  # widest first


def _canonical(name: str, t: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, tuple[int, ...], int]:
    """Layer ``name``'s view with manager blocks as dim 0 and each block's values in
    canonical order (a view, no copy); the block's shape in the cache's dtype (as
    entries record it); the kernel blocks per manager block."""
    if t.ndim < 2:
        raise ValueError(
            f"KV layer {name} is a flat {tuple(t.shape)} buffer, not a view per block "
            "(a KV cache spec without per-layer views); the tiered cache cannot copy its blocks"
        )
    rows = t.shape[0]
    if num_blocks <= 0 or rows % num_blocks:
        raise ValueError(
            f"KV layer {name}: {rows} rows in dimension 0 of {tuple(t.shape)} are not a "
            f"whole number of kernel blocks per KV cache block ({num_blocks} blocks)"
        )
    if t.stride(-1) != 1:
        raise ValueError(
            f"KV layer {name}: its innermost dimension is not contiguous (strides "
            f"{t.stride()}); no vLLM layout does that"
        )
    split = rows // num_blocks
    if split == 1:
        return t, tuple(t.shape[1:]), 1
    if t.ndim != 4:
        raise ValueError(
            f"KV layer {name}: kernel blocks ({split} per KV cache block) in a "
            f"{t.ndim}-dimensional view {tuple(t.shape)}; only [blocks, heads, tokens, content] "
            "views can be regrouped"
        )
    _, heads, tokens, content = t.shape
    # [B*r, H, n, C] -> [B, r, H, n, C] -> [B, H, r, n, C]: token r_i * n + j of each head
    grouped = t.unflatten(0, (num_blocks, split)).permute(0, 2, 1, 3, 4)
    return grouped, (heads, split * tokens, content), split


def _as_words(t: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """``t`` (innermost dimension contiguous) as ``word``s; RuntimeError if it cannot be."""
    return t.view(torch.uint8).view(word)


@dataclass(frozen=True)
class KVLayout:
    """The KV layers one copier moves (one entry kind), as the copies see them."""

    layer_names: tuple[str, ...]
    dtype: torch.dtype  # the cache's, named in entries
    block_shape: tuple[int, ...]  # one layer's block in canonical order, in ``dtype`` values
    word: torch.dtype = torch.uint8  # what copies move
    split: int = 1  # kernel blocks per KV cache (manager) block
    num_blocks: int = 0

    @classmethod
    def of(cls, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> "KVLayout":
        """The layout of ``kv_caches`` (every layer of one entry kind), or ``ValueError``
        saying why these views cannot be copied."""
        names = tuple(kv_caches)
        if not names:
            raise ValueError("no KV layers to copy")
        first = kv_caches[names[0]]
        for name, t in kv_caches.items():
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ValueError(
                    f"KV layer {name} ({tuple(t.shape)}, {t.dtype}) differs in shape or dtype from "
                    f"{names[0]} ({tuple(first.shape)}, {first.dtype}) in one KV cache group"
                )
        views = {n: _canonical(n, kv_caches[n], num_blocks) for n in names}
        _, block_shape, split = views[names[0]]
        for word in WORDS:
            try:
                for view, _, _ in views.values():
                    _as_words(view, word)
            except RuntimeError:
                continue
            return cls(names, first.dtype, block_shape, word, split, num_blocks)
        raise AssertionError("every view is readable as bytes")  # uint8 always fits

    def views(self, kv_caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Each layer's canonical view as ``word``s: ``[blocks, *block]``, in layer order."""
        return [_as_words(_canonical(n, kv_caches[n], self.num_blocks)[0], self.word) for n in self.layer_names]

    def entry_shape(self, n_blocks: int) -> tuple[int, ...]:
        """An entry's shape in ``dtype`` values, as its header records it."""
        return (len(self.layer_names), n_blocks, *self.block_shape)

    def entry_words(self, entry: torch.Tensor, writable: bool = False) -> torch.Tensor:
        """An entry (a contiguous tensor whose bytes are ``entry_shape(held)``) as words in
        the copies' shape, ``[layers, held, *word block]``: a view, or (not ``writable``,
        a payload at an odd address) a copy in aligned memory."""
        raw = entry.view(torch.uint8) if entry.dtype != torch.uint8 else entry
        layers, held = entry.shape[0], entry.shape[1]
        shape = [layers, held, *self.block_shape[:-1], self.block_shape[-1] * self.dtype.itemsize]
        if self.split > 1:  # the tokens of a block as (kernel block, token in it)
            heads, tokens, content = shape[2:]
            shape[2:] = [heads, self.split, tokens // self.split, content]
        raw = raw.reshape(shape)
        try:
            return raw.view(self.word)
        except RuntimeError:
            if writable:
                raise
            return raw.clone().view(self.word)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def block_bytes(self) -> int:
        """Bytes of one block of one layer."""
        n = self.dtype.itemsize
        for d in self.block_shape:
            n *= d
        return n

    def bytes_per_block(self) -> int:
        """Bytes of one block of every layer (an entry's bytes per block)."""
        return self.block_bytes() * len(self.layer_names)

    def describe(self) -> str:
        """For the start-up log: ``[8, 16, 256] bfloat16 per block and layer (copied as int64)``."""
        split = f", {self.split} kernel blocks per block regrouped" if self.split > 1 else ""
        word = str(self.word).removeprefix("torch.")
        return f"{list(self.block_shape)} {self.dtype_name} per block and layer (copied as {word}{split})"


def check_entry(layout: KVLayout, dtype: str, shape: Sequence[int], blocks: int) -> int:
    """Blocks an entry (``dtype``, ``shape``) holds; ``ValueError`` unless it is an entry of
    ``layout`` holding at least ``blocks``."""
    held = shape[1] if len(shape) > 1 else 0
    if dtype != layout.dtype_name or held < blocks or tuple(shape) != layout.entry_shape(held):
        raise ValueError(
            f"entry {dtype} {tuple(shape)} does not fit {blocks} blocks "
            f"of {layout.dtype_name} {layout.entry_shape(blocks)}"
        )
    return held
