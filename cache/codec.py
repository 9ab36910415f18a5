"""Entry format: a fixed 256-byte header, then the raw tensor bytes. No pickle, ever.

Header (little-endian): magic, format version, flags, namespace digest, key, dtype
name, shape, payload length, payload checksum (XXH3-128), optional HMAC-SHA256 over
header and payload (when a signing key is configured), and a checksum of the header
itself. ``decode`` rejects anything truncated, damaged, foreign (other namespace or
key) or, with a signing key, unsigned or wrongly signed: ``CorruptEntry`` is raised and
the caller recomputes.

Pure CPU work on buffers; runs in the store's I/O threads (and, for DRAM hits, in the
vLLM worker before the forward pass), so it avoids copies: ``encode`` returns the header
to be written before the caller's payload buffer, ``decode`` returns a view.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Optional, Sequence

import xxhash

from cache.keys import DIGEST_BYTES, FORMAT_VERSION

MAGIC = b"TKVCACHE"
HEADER_SIZE = 256
MAX_DIMS = 8
FLAG_SIGNED = 1
NO_PARENT = b"\0" * DIGEST_BYTES
# magic, version, flags, namespace, key, parent key, dtype, ndim, shape[8],
# payload length, payload xxh3-128, hmac-sha256
_FIELDS = struct.Struct(f"<8sHH{DIGEST_BYTES}s{DIGEST_BYTES}s{DIGEST_BYTES}s16sB{MAX_DIMS}QQ16s32s")
_HEADER_SUM = struct.Struct("<Q")
assert _FIELDS.size + _HEADER_SUM.size <= HEADER_SIZE


class CorruptEntry(Exception):
    """An entry that must not be served: truncated, damaged, foreign or unsigned."""


class UnsignedEntry(CorruptEntry):
    """Unsigned, or signed with another key, while a signing key is configured."""


@dataclass(frozen=True)
class EntryInfo:
    parent: Optional[str]  # key of the chunk before this one, None for a first chunk
    dtype: str
    shape: tuple[int, ...]
    payload_len: int


@dataclass(frozen=True)
class Seal:
    """What a verified header says the payload must hash (and be signed) to."""

    flags: int
    checksum: bytes
    mac: bytes
    fields: bytes


def _mac(signing_key: bytes, fields_without_mac: bytes, payload) -> bytes:
    m = hmac.new(signing_key, fields_without_mac, hashlib.sha256)
    m.update(payload)
    return m.digest()


def encode_header(
    namespace: bytes,
    key: str,
    dtype: str,
    shape: Sequence[int],
    payload,
    signing_key: bytes = b"",
    parent: Optional[str] = None,
) -> bytes:
    """Header for ``payload`` (any buffer); write it, then the payload, as one entry."""
    view = memoryview(payload).cast("B")
    if len(shape) > MAX_DIMS:
        raise ValueError(f"at most {MAX_DIMS} dimensions")
    dims = list(shape) + [0] * (MAX_DIMS - len(shape))
    checksum = xxhash.xxh3_128_digest(view)
    flags = FLAG_SIGNED if signing_key else 0
    args = [
        MAGIC,
        FORMAT_VERSION,
        flags,
        namespace,
        bytes.fromhex(key),
        bytes.fromhex(parent) if parent else NO_PARENT,
        dtype.encode().ljust(16, b"\0"),
        len(shape),
        *dims,
        len(view),
        checksum,
    ]
    unsigned = _FIELDS.pack(*args, b"\0" * 32)
    mac = _mac(signing_key, unsigned, view) if signing_key else b"\0" * 32
    fields = _FIELDS.pack(*args, mac)
    head = fields + _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(fields))
    return head.ljust(HEADER_SIZE, b"\0")


def read_header(buf, namespace: bytes, key: str) -> EntryInfo:
    """Check the header alone (cheap): used to rebuild an index without reading payloads."""
    info, _ = _parse_header(memoryview(buf).cast("B"), namespace, key)
    return info


def _parse_header(view: memoryview, namespace: bytes, key: str):
    if len(view) < HEADER_SIZE:
        raise CorruptEntry("truncated header")
    fields = bytes(view[: _FIELDS.size])
    (stored_sum,) = _HEADER_SUM.unpack_from(view, _FIELDS.size)
    if xxhash.xxh3_64_intdigest(fields) != stored_sum:
        raise CorruptEntry("header checksum mismatch")
    magic, version, flags, ns, k, parent, dtype, ndim, *rest = _FIELDS.unpack(fields)
    dims, (payload_len, checksum, mac) = rest[:MAX_DIMS], rest[MAX_DIMS:]
    if magic != MAGIC:
        raise CorruptEntry("not a cache entry")
    if version != FORMAT_VERSION:
        raise CorruptEntry(f"format version {version}, expected {FORMAT_VERSION}")
    if ns != namespace:
        raise CorruptEntry("entry of another namespace (model, layout or rank)")
    if k != bytes.fromhex(key):
        raise CorruptEntry("entry stored under the wrong key")
    parent_key = None if parent == NO_PARENT else parent.hex()
    info = EntryInfo(parent_key, dtype.rstrip(b"\0").decode(), tuple(dims[:ndim]), payload_len)
    return info, Seal(flags, checksum, mac, fields)


def open_header(buf, namespace: bytes, key: str) -> tuple[EntryInfo, Seal]:
    """Check an entry's header (its first ``HEADER_SIZE`` bytes, or more); its info and
    what its payload must match (``PayloadCheck``), for a payload checked piece by piece."""
    return _parse_header(memoryview(buf).cast("B"), namespace, key)


class PayloadCheck:
    """Checks a payload fed in pieces, in order (``update``), against its header's
    seal: the checksum and, with a signing key, the signature (``verify`` raises
    ``CorruptEntry``). For a payload copied elsewhere piece by piece: each piece is
    hashed right after its copy, while it is still in the CPU's cache."""

    def __init__(self, seal: Seal, signing_key: bytes = b"") -> None:
        self.seal = seal
        self.signed = bool(signing_key)
        self._hash = xxhash.xxh3_128()
        self._mac = None
        if signing_key and seal.flags & FLAG_SIGNED:
            self._mac = hmac.new(signing_key, seal.fields[: _FIELDS.size - 32] + b"\0" * 32, hashlib.sha256)

    def update(self, piece) -> None:
        self._hash.update(piece)
        if self._mac is not None:
            self._mac.update(piece)

    def verify(self) -> None:
        if self._hash.digest() != self.seal.checksum:
            raise CorruptEntry("payload checksum mismatch")
        if self.signed:
            if self._mac is None:
                raise UnsignedEntry("unsigned entry while a signing key is configured")
            if not hmac.compare_digest(self._mac.digest(), self.seal.mac):
                raise UnsignedEntry("signature mismatch")


def decode(buf, namespace: bytes, key: str, signing_key: bytes = b"") -> tuple[EntryInfo, memoryview]:
    """Verify a whole entry and return its info and a zero-copy view of the payload."""
    view = memoryview(buf).cast("B")
    info, seal = _parse_header(view, namespace, key)
    payload = view[HEADER_SIZE:]
    if len(payload) != info.payload_len:
        raise CorruptEntry(f"payload is {len(payload)} bytes, header says {info.payload_len}")
    check = PayloadCheck(seal, signing_key)
    check.update(payload)
    check.verify()
    return info, payload
