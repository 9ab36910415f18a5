"""Keys and the entry codec: stable, chained, namespaced; damage and foreign entries detected."""

import numpy as np
import pytest

from cache.codec import HEADER_SIZE, CorruptEntry, decode, encode_header, read_header
from cache.keys import Namespace, chunk_keys


def ns(**kw):
    base = dict(model="m", model_digest="d", kv_dtype="bfloat16", kv_layout="2x16x8")
    base.update(kw)
    return Namespace(**base)


def test_keys_are_stable_chained_and_namespaced():
    toks = list(range(1000))
    a = chunk_keys(ns().digest, toks, 256)
    assert len(a) == 3
    assert a == chunk_keys(ns().digest, toks, 256)  # deterministic
    assert a[:2] == chunk_keys(ns().digest, toks[:600], 256)[:2]  # prefix property
    changed = toks.copy()
    changed[10] = 7
    b = chunk_keys(ns().digest, changed, 256)
    assert all(x != y for x, y in zip(a, b))  # a change poisons every later key
    assert chunk_keys(ns(rank=1).digest, toks, 256)[0] != a[0]
    assert chunk_keys(ns(model_digest="e").digest, toks, 256)[0] != a[0]
    assert chunk_keys(ns().digest, toks, 256, salt="lora:x")[0] != a[0]


def test_tail_chunk_keyed_after_whole_chunks():
    toks = list(range(700))
    keys = chunk_keys(ns().digest, toks, 256, tail_tokens=128)
    assert len(keys) == 3 and keys[:2] == chunk_keys(ns().digest, toks, 256)
    with pytest.raises(ValueError):
        chunk_keys(ns().digest, toks, 256, tail_tokens=256)


def entry(key="ab" * 16, signing_key=b""):
    payload = np.arange(4096, dtype=np.uint16)
    head = encode_header(ns().digest, key, "uint16", payload.shape, payload, signing_key, parent="cd" * 16)
    return bytearray(head + payload.tobytes()), payload


def test_roundtrip_is_zero_copy_and_exact():
    raw, payload = entry()
    info, view = decode(raw, ns().digest, "ab" * 16)
    assert info.dtype == "uint16" and info.shape == (4096,) and info.parent == "cd" * 16
    assert np.array_equal(np.frombuffer(view, dtype=np.uint16), payload)
    assert read_header(raw[:HEADER_SIZE], ns().digest, "ab" * 16) == info


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "foreign_ns", "wrong_key"])
def test_damaged_or_foreign_entries_are_rejected(damage):
    raw, _ = entry()
    key, space = "ab" * 16, ns().digest
    if damage == "truncate":
        raw = raw[:-1]
    elif damage == "flip_payload":
        raw[HEADER_SIZE + 100] ^= 1
    elif damage == "flip_header":
        raw[20] ^= 1
    elif damage == "foreign_ns":
        space = ns(model="other").digest
    elif damage == "wrong_key":
        key = "ef" * 16
    with pytest.raises(CorruptEntry):
        decode(raw, space, key)


def test_signing():
    raw, _ = entry(signing_key=b"secret")
    decode(raw, ns().digest, "ab" * 16, b"secret")
    with pytest.raises(CorruptEntry):
        decode(raw, ns().digest, "ab" * 16, b"other")
    unsigned, _ = entry()
    with pytest.raises(CorruptEntry):
        decode(unsigned, ns().digest, "ab" * 16, b"secret")


def test_namespace_ids_stay_what_they_were():
    """Entries already stored (disk, the shared tier) stay reachable: the namespace digest
    of a given configuration never changes, field renames included."""
    assert Namespace("m", "d", "bf16", "x", rank=1, world_size=2).id == "6d06028380c8f86b4121a187d72cf3b9"
