"""What identifies a model's weights (or a LoRA adapter's): a fingerprint cheap enough to
take at every start-up, folded into the cache namespace (``cache.vllm.namespace``).

A model's path and ``config.json`` do not identify its weights: every SageMaker model is
at ``/opt/ml/model``, and fine-tunes of one base share its config. Two engines that
share tier folders and differ only in their weights would load each other's KV.

Runs once per model at start-up (the server, before vLLM starts; under plain ``vllm
serve`` each engine process) and once per LoRA adapter in the scheduler (cached there).
Blocks on file reads: ``sampled`` reads a few MiB whatever the model's size.

What is hashed (``fingerprint``), in file-name order, names relative to the folder (a
folder moved or renamed keeps its fingerprint):

- every weight file's name and size (``.safetensors``, ``.bin``, ``.pt``, ``.pth``,
  ``.gguf``, ``.ckpt``, ``.h5``, ``.msgpack``) and whole: the weight index files
  (``*.index.json``) and ``adapter_config.json``;
- ``sampled`` (the default): a ``.safetensors`` file's whole header (every tensor's name,
  dtype, shape and offsets) and, of every tensor in it, one piece of its bytes at an
  offset derived from its name; the pieces share ``SAMPLE_BUDGET`` (64 KiB each at most,
  ``MIN_PIECE`` at least: a model with very many tensors reads ``MIN_PIECE`` per tensor).
  Other formats (pickles, GGUF) are read as plain bytes: their first ``HEAD_BYTES`` and
  pieces of ``PIECE`` bytes evenly spread over the file, ``GENERIC_PIECES`` across all of
  them;
- ``full``: every byte of every weight file (XXH3-128; reads the whole model);
- the Hugging Face commit when the folder is a hub snapshot (``.../snapshots/<commit>``),
  and an S3 object's ETag when ``serving.model.fetch_model`` downloaded the file
  (``S3_MANIFEST``, kept beside the files).

The guarantee, honestly: ``full`` tells any two different sets of weights apart.
``sampled`` tells apart any two checkpoints whose tensors differ densely, which is what
training does: a fine-tune changes every element of every trained tensor, and a LoRA
merged into its base changes every element of each adapted matrix (``B @ A`` is dense),
so each changed tensor's sample changes; different shapes, dtypes, tensor names or file
sizes change the header or the sizes. It can miss a change confined to bytes it does not
read: a few edited values, a few rows of an embedding trained alone, or (in a non-
safetensors file) a change to a run of bytes shorter than the spacing of its pieces
(the whole size of the files over ``GENERIC_PIECES``). Set ``KVCACHE_WEIGHTS_HASH=full``
where that matters (``cache.config``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Optional

import xxhash

MODES = ("sampled", "full")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")
WHOLE_FILES = ("adapter_config.json",)  # hashed whole, besides the weight index files
S3_MANIFEST = ".kvcache-s3-etags.json"  # {relative name: [size, ETag]}, by serving.model
SAMPLE_BUDGET = 8 << 20  # bytes of tensor samples per model (safetensors), before the floor
MAX_PIECE = 64 << 10  # one tensor's sample, at most
MIN_PIECE = 256  # one tensor's sample, at least (smaller tensors: all of it)
HEAD_BYTES = 64 << 10  # the first bytes of a file in another format
PIECE = 4 << 10  # one piece of a file in another format
GENERIC_PIECES = 2048  # pieces across all files in other formats (8 MiB)
HEADER_MAX = 100 << 20  # a larger safetensors header is not one (the format's own bound)
FULL_READ = 8 << 20  # read size of a full hash
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class Fingerprint:
    digest: str  # 32 hex digits
    mode: str  # "sampled" or "full"
    files: int  # weight files
    total_bytes: int  # their size
    bytes_read: int  # what taking the fingerprint read

    def describe(self) -> str:
        return (
            f"{self.digest} ({self.mode}: {self.files} weight file(s), {self.total_bytes:,} bytes, "
            f"{self.bytes_read:,} read)"
        )


def fingerprint(path: str, mode: str = "sampled") -> Fingerprint:
    """The fingerprint of the weights in folder ``path`` (or of one weight file). Raises
    ``ValueError`` for an unknown mode, ``OSError`` when a file cannot be read."""
    if mode not in MODES:
        raise ValueError(f"weights hash mode {mode!r} is not one of {', '.join(MODES)}")
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    files = _files(path)
    etags = _s3_etags(folder)
    h = hashlib.blake2b(digest_size=16, person=b"kvcache-weights")
    h.update(f"mode={mode}\n".encode())
    commit = os.path.basename(os.path.normpath(folder))
    if _COMMIT.fullmatch(commit) and os.path.basename(os.path.dirname(os.path.normpath(folder))) == "snapshots":
        h.update(f"commit={commit}\n".encode())
    reader = _Reader(h)
    weights = [(rel, p, size) for rel, p, size in files if rel.endswith(WEIGHT_SUFFIXES)]
    headers = {}
    for rel, p, size in files:
        h.update(f"file={rel}\nsize={size}\n".encode())
        if rel in etags and etags[rel][0] == size:
            h.update(f"etag={etags[rel][1]}\n".encode())
        if not rel.endswith(WEIGHT_SUFFIXES):  # an index or adapter_config.json: whole
            reader.whole(p)
        elif mode == "sampled" and rel.endswith(".safetensors"):
            headers[rel] = reader.safetensors_header(p, size)
    if mode == "full":
        for _rel, p, _size in weights:
            reader.full(p)
    else:
        tensors = sum(len(t) for t in headers.values() if t is not None)
        piece = max(MIN_PIECE, min(MAX_PIECE, SAMPLE_BUDGET // max(1, tensors)))
        generic = [(p, size) for rel, p, size in weights if headers.get(rel) is None]
        spacing = max(PIECE, sum(size for _p, size in generic) // GENERIC_PIECES)
        for rel, p, size in weights:
            tensors_of = headers.get(rel)
            if tensors_of is not None:
                reader.tensor_samples(p, tensors_of, piece)
            else:
                reader.spread(p, size, spacing)
    return Fingerprint(h.hexdigest(), mode, len(weights), sum(s for _r, _p, s in weights), reader.read)


def _files(path: str) -> list[tuple[str, str, int]]:
    """``(name relative to the folder, path, size)`` of the files the fingerprint covers,
    sorted by name; hidden folders (``.cache``, ``.git``) are left out. Links are followed
    (a hub snapshot's files are links to its blobs)."""
    if not os.path.isdir(path):
        return [(os.path.basename(path), path, os.stat(path).st_size)]
    out = []
    for root, dirs, names in os.walk(path, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            if name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json") or name in WHOLE_FILES:
                p = os.path.join(root, name)
                out.append((os.path.relpath(p, path).replace(os.sep, "/"), p, os.stat(p).st_size))
    return sorted(out)


def _s3_etags(folder: str) -> dict[str, tuple[int, str]]:
    try:
        with open(os.path.join(folder, S3_MANIFEST)) as f:
            data = json.load(f)
        return {str(k): (int(v[0]), str(v[1])) for k, v in data.items()}
    except (OSError, ValueError, TypeError, IndexError, AttributeError):
        return {}


class _Reader:
    """Reads into the digest ``h`` and counts what it read."""

    def __init__(self, h) -> None:
        self.h = h
        self.read = 0

    def _pread(self, fd: int, n: int, offset: int) -> bytes:
        data = os.pread(fd, n, offset)
        self.read += len(data)
        return data

    def whole(self, path: str) -> None:
        with open(path, "rb") as f:
            data = f.read()
        self.read += len(data)
        self.h.update(data)

    def full(self, path: str) -> None:
        x = xxhash.xxh3_128()
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(FULL_READ):
                self.read += len(chunk)
                x.update(chunk)
        self.h.update(x.digest())

    def safetensors_header(self, path: str, size: int) -> Optional[list[tuple[str, int, int]]]:
        """Hash the header; ``(name, start, end)`` of each tensor's bytes in the file, or
        None when the file is not a sound safetensors file (then read as plain bytes)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            raw = self._pread(fd, 8, 0)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < n <= min(HEADER_MAX, size - 8):
                return None
            header = self._pread(fd, n, 8)
        finally:
            os.close(fd)
        self.h.update(header)
        try:
            table = json.loads(header)
            return sorted(
                (name, 8 + n + int(t["data_offsets"][0]), 8 + n + int(t["data_offsets"][1]))
                for name, t in table.items()
                if name != "__metadata__"
            )
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return None  # (the header bytes are hashed either way)

    def tensor_samples(self, path: str, tensors: list[tuple[str, int, int]], piece: int) -> None:
        """One piece of each tensor, at an offset its name decides (all of a small one)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            for name, start, end in tensors:
                length = max(0, end - start)
                if length > piece:
                    where = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
                    start += where % (length - piece + 1)
                    length = piece
                self.h.update(self._pread(fd, length, start))
        finally:
            os.close(fd)

    def spread(self, path: str, size: int, spacing: int) -> None:
        """A file in another format: its first ``HEAD_BYTES``, then a ``PIECE`` every
        ``spacing`` bytes, and its last ``PIECE``."""
        fd = os.open(path, os.O_RDONLY)
        try:
            self.h.update(self._pread(fd, min(size, HEAD_BYTES), 0))
            for offset in range(HEAD_BYTES, size, spacing):
                self.h.update(self._pread(fd, PIECE, offset))
            if size > HEAD_BYTES:
                self.h.update(self._pread(fd, PIECE, max(HEAD_BYTES, size - PIECE)))
        finally:
            os.close(fd)
