"""Chunk keys: a cryptographic hash chained over token chunks, inside a namespace.

Pure functions, no I/O; called in the vLLM scheduler for every lookup, so they must be
cheap (one BLAKE2b over each chunk's token bytes). Keys are the same in every process
and on every machine (unlike Python's ``hash()``), so an entry written by one engine is
found by any other engine of the same model, layout and parallel rank.

The namespace folds in everything that makes KV bytes incompatible: model identity and
a digest of its config/revision, KV dtype, KV layout (block shape), parallel rank and
world size (tensor x pipeline), chunk size and the entry format version. Two models never
share a key.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import asdict, dataclass, replace
from typing import Optional, Sequence

FORMAT_VERSION = 1
DIGEST_BYTES = 16  # 128-bit keys: collisions are out of reach for any cache size


_HASHED_AS = {"rank": "tp_rank", "world_size": "tp_size"}


@dataclass(frozen=True)
class Namespace:
    """What makes two caches' KV bytes interchangeable."""

    model: str  # model id or path as served
    model_digest: str  # digest of the model's config (+ revision)
    kv_dtype: str  # e.g. "bfloat16"
    kv_layout: str  # per-block tensor shape as vLLM lays it out, e.g. "2x128x2x64"
    rank: int = 0  # this worker's parallel rank (tensor x pipeline)
    world_size: int = 1  # tensor-parallel size x pipeline-parallel size
    chunk_tokens: int = 256
    format_version: int = FORMAT_VERSION

    @property
    def digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"kvcache-ns")
        fields = asdict(self)
        # Hashed under the names these fields first had, so entries already stored (on
        # disk, in the shared tier) keep their namespace.
        for new, old in _HASHED_AS.items():
            fields[old] = fields.pop(new)
        for k, v in sorted(fields.items()):
            h.update(f"{k}={v}\n".encode())
        return h.digest()

    @property
    def chain_digest(self) -> bytes:
        """Seed of the chunk-key chain: the namespace without the rank, so every rank of
        an engine computes the same keys (each stores its own shard under its own
        namespace folder)."""
        return replace(self, rank=0).digest

    @property
    def id(self) -> str:
        """Short printable namespace id; also the folder name on shared tiers."""
        return self.digest.hex()


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return array("q", tokens).tobytes()


def chunk_keys(
    namespace_digest: bytes,
    tokens: Sequence[int],
    chunk_tokens: int,
    *,
    tail_tokens: int = 0,
    salt: str = "",
) -> list[str]:
    """Keys of ``tokens`` cut into chunks of ``chunk_tokens``.

    Key *i* hashes key *i-1* and chunk *i*'s tokens, so equal keys mean equal prefixes.
    Only whole chunks are keyed, plus (when ``tail_tokens`` > 0) one final partial chunk
    of exactly ``tail_tokens`` tokens that follows the last whole chunk. ``salt``
    separates otherwise equal prompts whose KV differs (e.g. a LoRA adapter).
    """
    n_full = len(tokens) // chunk_tokens
    if tail_tokens and n_full * chunk_tokens + tail_tokens > len(tokens):
        raise ValueError("tail_tokens reaches past the end of tokens")
    prev = _root(namespace_digest, salt)
    keys = []
    bounds = [(i * chunk_tokens, (i + 1) * chunk_tokens) for i in range(n_full)]
    if tail_tokens:
        bounds.append((n_full * chunk_tokens, n_full * chunk_tokens + tail_tokens))
    for start, end in bounds:
        prev = _link(namespace_digest, prev, tokens[start:end])
        keys.append(prev.hex())
    return keys


def _root(namespace_digest: bytes, salt: str) -> bytes:
    return hashlib.blake2b(
        salt.encode(), digest_size=DIGEST_BYTES, key=namespace_digest, person=b"kvcache-root"
    ).digest()


def _link(namespace_digest: bytes, prev: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(prev, digest_size=DIGEST_BYTES, key=namespace_digest)
    h.update(_token_bytes(tokens))
    return h.digest()


def next_key(namespace_digest: bytes, parent: Optional[str], tokens: Sequence[int], salt: str = "") -> str:
    """The key of a chunk holding ``tokens`` that follows chunk ``parent`` (None: the first
    chunk) in its chain, as ``chunk_keys`` keys it: how a lookup names a stored tail chunk
    that an earlier, shorter prompt ended with (``cache.vllm.tails``)."""
    prev = bytes.fromhex(parent) if parent else _root(namespace_digest, salt)
    return _link(namespace_digest, prev, tokens).hex()


def prompt_chunks(
    namespace_digest: bytes, tokens: Sequence[int], chunk_tokens: int, salt: str = ""
) -> list[tuple[str, int, int]]:
    """``(key, start, end)`` of each chunk of a prompt as the cache cuts it, for lookups and
    saves alike: its whole chunks, then one *tail* chunk holding the rest, unless the rest
    is a single token (it would load nothing: the last token is always computed)."""
    full, tail = divmod(len(tokens), chunk_tokens)
    if tail < 2:
        tail = 0
    keys = chunk_keys(namespace_digest, tokens[: full * chunk_tokens + tail], chunk_tokens, tail_tokens=tail, salt=salt)
    return [(k, i * chunk_tokens, min((i + 1) * chunk_tokens, full * chunk_tokens + tail)) for i, k in enumerate(keys)]


def parent_of(keys: Sequence[str], i: int) -> Optional[str]:
    """The key before ``keys[i]`` in its chain, ``None`` for the first chunk."""
    return keys[i - 1] if i > 0 else None
