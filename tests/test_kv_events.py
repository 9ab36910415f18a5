"""The tiers' KV events (``cache.vllm.events``) without an engine: vLLM's hashes and fields
for the blocks of a chunk, stored/removed per tier and rank, bounded, and kept across a
restart. The same against a real engine and a ZMQ subscriber: ``test_kv_events_engine.py``."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash

from cache.tiers.identity import DISK, DRAM, SHARED, Locality, Medium, tier_id
from cache.vllm import events as ev
from cache.vllm.events import TierEvents, chunk_blocks

B = 128


def request(req_id: str, tokens: list[int], salt=None, lora=None):
    """A stand-in of vLLM's ``Request`` with block hashes from vLLM's own hasher."""
    r = SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=tokens,
        all_token_ids=tokens,
        num_tokens=len(tokens),
        cache_salt=salt,
        lora_request=lora,
        mm_features=[],
        prompt_embeds=None,
        session_id=None,
        block_hashes=[],
    )
    init_none_hash(sha256_cbor)
    r.block_hashes = get_request_block_hasher(B, sha256_cbor)(r)
    return r


def external(r, first: int, last: int) -> list:
    """vLLM's published form of ``r``'s block hashes ``first .. last``."""
    return [maybe_convert_block_hash(h) for h in r.block_hashes[first:last]]


def chunks(n: int, size: int = 256):
    return [
        SimpleNamespace(key=f"k{i}", start=i * size, end=min(n, (i + 1) * size)) for i in range((n + size - 1) // size)
    ]


TOKENS = list(range(1, 700))  # two whole 256-token chunks and a 187-token tail (one full block)


def test_a_chunk_is_described_by_vllms_own_hashes_of_its_full_blocks():
    r = request("a", TOKENS)
    first, second, tail = (chunk_blocks(r, c.start, c.end, B) for c in chunks(len(TOKENS)))
    assert first.hashes == external(r, 0, 2) and first.parent is None
    assert second.hashes == external(r, 2, 4) and second.parent == external(r, 1, 2)[0]
    assert tail.hashes == external(r, 4, 5) and tail.tokens == TOKENS[512:640]  # its partial block: none
    assert first.extra_keys == [None, None] and first.lora_id is None  # as vLLM publishes them
    assert chunk_blocks(r, 640, 699, B) is None  # no full block


def test_salt_changes_every_hash_and_rides_in_the_first_blocks_extra_keys_as_in_vllm():
    plain, salted = request("a", TOKENS), request("b", TOKENS, salt="tenant-a")
    a, b = chunk_blocks(plain, 0, 256, B), chunk_blocks(salted, 0, 256, B)
    assert not set(a.hashes) & set(b.hashes)
    assert b.extra_keys == [("tenant-a",), None]  # vLLM's untagged form, first block only


def stored_event(events: TierEvents, tier: str, keys, rank_events=1):
    events.apply([(k, "stored", tier) for k in keys] * rank_events)


def test_stored_and_removed_per_tier_with_vllm_media():
    events = TierEvents([DRAM, DISK, SHARED], 1, B)
    r = request("a", TOKENS)
    events.seen(r, chunks(len(TOKENS)))
    events.apply(
        [
            ("k0", "stored", "dram"),
            ("k1", "stored", "dram"),
            ("k0", "evicted", "dram"),
            ("k0", "stored", "disk"),
            ("k1", "not_admitted", "disk"),
            ("k1", "stored", "shared"),
            ("nobody", "stored", "dram"),
        ]
    )
    out = events.take()
    assert [(type(e).__name__, e.medium, e.ownership, e.locality) for e in out] == [
        ("BlockStored", MEDIUM_CPU, "dram", "LOCAL"),
        ("BlockStored", MEDIUM_CPU, "dram", "LOCAL"),
        ("BlockRemoved", MEDIUM_CPU, "dram", "LOCAL"),
        ("BlockStored", MEDIUM_STORAGE, "disk", "LOCAL"),
        ("BlockStored", MEDIUM_STORAGE, "shared", "REMOTE"),
    ]
    assert out[0].block_hashes == external(r, 0, 2) and out[2].block_hashes == out[0].block_hashes
    assert out[0].token_ids == TOKENS[:256] and out[0].block_size == B
    assert events.take() == []
    events.apply([("k1", "stored", "dram"), ("k1", "damaged", "dram"), ("k1", "evicted", "shared")])
    assert [type(e) for e in events.take()] == [BlockRemoved]  # a duplicate store is not news; shared stays


def test_with_two_ranks_a_chunk_is_held_once_both_hold_it_and_gone_once_one_dropped_it():
    events = TierEvents([DRAM], 2, B)
    events.seen(request("a", TOKENS), chunks(len(TOKENS)))
    events.apply([("k0", "stored", "dram")])
    assert events.take() == []
    events.apply([("k0", "stored", "dram")])
    assert [type(e) for e in events.take()] == [BlockStored]
    events.apply([("k0", "evicted", "dram")])
    assert [type(e) for e in events.take()] == [BlockRemoved]
    events.apply([("k0", "evicted", "dram")])
    assert events.take() == []


def test_bounded_records_held_chunks_and_pending_events(monkeypatch):
    monkeypatch.setattr(ev, "MAX_RECORDS", 2)
    monkeypatch.setattr(ev, "MAX_HELD", 2)
    monkeypatch.setattr(ev, "MAX_PENDING", 4)
    events = TierEvents([DRAM], 1, B)
    events.seen(request("a", TOKENS), chunks(len(TOKENS)))
    assert list(events.recent) == ["k1", "k2"]
    for i, n in enumerate((700, 900, 1100)):
        events.seen(
            request(f"r{i}", list(range(i * 10_000, i * 10_000 + n))), [SimpleNamespace(key=f"x{i}", start=0, end=256)]
        )
        events.apply([(f"x{i}", "stored", "dram")])
    out = events.take()
    # the third held chunk pushed the first out, announced removed: a router under-credits
    assert [type(e).__name__ for e in out] == ["BlockStored", "BlockStored", "BlockStored", "BlockRemoved"]
    assert list(events.held["dram"]) == ["x1", "x2"]
    for _ in range(5):
        events.emit(BlockRemoved(block_hashes=[], medium=None))
    assert len(events.take()) == 4 and events.dropped == 1


def test_a_restart_keeps_what_is_still_there_and_announces_what_is_not(tmp_path):
    snap = str(tmp_path / ".kvevents-ns.json")
    first = TierEvents([DRAM, DISK], 1, B, snapshot=snap)
    r = request("a", TOKENS)
    first.seen(r, chunks(len(TOKENS)))
    first.apply([("k0", "stored", "dram"), ("k1", "stored", "disk"), ("k2", "stored", "disk")])
    first.take()
    first.close()
    saved = json.loads(open(snap).read())
    assert saved["block_size"] == B and "token" not in open(snap).read()  # hashes only, never tokens
    still = {("disk", "k1"), ("disk", "k2")}
    second = TierEvents([DRAM, DISK], 1, B, snapshot=snap, present=lambda t, k: (t, k) in still)
    (gone,) = second.take()
    assert isinstance(gone, BlockRemoved) and gone.medium == MEDIUM_CPU and gone.block_hashes == external(r, 0, 2)
    second.apply([("k1", "evicted", "disk")])  # a chunk announced before the restart, evicted after
    (removed,) = second.take()
    assert removed.block_hashes == external(r, 2, 4) and removed.medium == MEDIUM_STORAGE
    second.apply([("k2", "stored", "dram")])  # moved up before any request of this engine used it
    (moved,) = second.take()
    assert moved.block_hashes == external(r, 4, 5) and moved.parent_block_hash == external(r, 3, 4)[0]
    assert moved.medium == MEDIUM_CPU and moved.token_ids == []  # its tokens are not known here
    second.apply([("unknown", "stored", "dram")])
    assert second.take() == []  # another engine's chunk: nothing known, nothing said
    second.close()
    third = TierEvents([DRAM, DISK], 1, 64, snapshot=snap, present=lambda t, k: False)
    assert third.take() == []  # another block size: the old hashes mean nothing here


def test_the_server_hands_SM_VLLM_KV_EVENTS_CONFIG_to_vllms_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from serving.conventions import engine_args

    value = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"})
    args, sources, _notes = engine_args({"SM_VLLM_KV_EVENTS_CONFIG": value}, 0)
    assert args == {"--kv-events-config": value} and sources == {"--kv-events-config": "SM_VLLM_KV_EVENTS_CONFIG"}
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(["--kv-events-config", value])
    assert parsed.kv_events_config.enable_kv_cache_events and parsed.kv_events_config.endpoint == "tcp://*:5557"


def test_writes_finished_after_the_last_step_are_announced_by_the_next_engine(tmp_path):
    """Saves, copies down and publishes a worker finishes after the scheduler's last step
    (flushed at shutdown) never reach that engine's events: the next engine announces
    every known chunk a tier holds that was not announced there (by hashes alone)."""
    snap = str(tmp_path / ".kvevents-ns.json")
    first = TierEvents([DRAM, DISK], 1, B, snapshot=snap)
    r = request("a", TOKENS)
    first.seen(r, chunks(len(TOKENS)))
    first.apply([("k0", "stored", "dram")])  # k0's copy down to disk, k1's save: never reported
    first.take()
    first.close()
    on_disk = {("disk", "k0"), ("disk", "k1"), ("dram", "k0")}
    second = TierEvents([DRAM, DISK], 1, B, snapshot=snap, present=lambda t, k: (t, k) in on_disk)
    stored = {tuple(e.block_hashes): e for e in second.take()}
    assert set(stored) == {tuple(external(r, 0, 2)), tuple(external(r, 2, 4))}
    assert all(e.medium == MEDIUM_STORAGE and e.token_ids == [] for e in stored.values())
    assert stored[tuple(external(r, 2, 4))].parent_block_hash == external(r, 1, 2)[0]
    assert set(second.held["disk"]) == {"k0", "k1"} and set(second.held["dram"]) == {"k0"}


def test_a_tier_that_cannot_say_yet_keeps_its_record_until_it_can(tmp_path):
    """A shared tier knows what it holds only after its first listing: a restart before it
    announces none of the shared chunks removed; the first ``take`` after it settles the
    record (what is gone removed, what was written after the last step stored)."""
    snap = str(tmp_path / ".kvevents-ns.json")
    first = TierEvents([DRAM, SHARED], 1, B, snapshot=snap)
    r = request("a", TOKENS)
    first.seen(r, chunks(len(TOKENS)))
    first.apply([("k0", "stored", "shared"), ("k1", "stored", "shared")])  # k2's publish: never reported
    first.take()
    first.close()
    listed, on_shared = [False], {"k0", "k2"}

    def present(tier, key):
        if tier == "shared" and not listed[0]:
            return None
        return tier == "shared" and key in on_shared

    second = TierEvents([DRAM, SHARED], 1, B, snapshot=snap, present=present)
    assert second.take() == [] and set(second.held["shared"]) == {"k0", "k1"}
    second.close()  # a restart before the listing keeps the record, and the unreported chunk's hashes
    third = TierEvents([DRAM, SHARED], 1, B, snapshot=snap, present=present)
    assert third.take() == [] and set(third.held["shared"]) == {"k0", "k1"}
    listed[0] = True
    out = third.take()
    removed = [e for e in out if isinstance(e, BlockRemoved)]
    stored = [e for e in out if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in removed] == [external(r, 2, 4)] and removed[0].ownership == "shared"
    assert [e.block_hashes for e in stored] == [external(r, 4, 5)] and stored[0].token_ids == []
    assert set(third.held["shared"]) == {"k0", "k2"} and third.take() == []


def test_the_store_says_a_shared_tier_cannot_answer_before_its_first_listing(tmp_path):
    from fsspec.implementations.local import LocalFileSystem

    from cache.policy import LRUPolicy
    from cache.store import TieredStore
    from cache.tiers.memory import MemoryTier
    from cache.tiers.shared import SharedTier

    (tmp_path / "ns").mkdir()
    opened = threading.Event()  # the filesystem opens (and so the first listing ends) only once set

    def opener():
        opened.wait(60)
        return LocalFileSystem()

    shared = SharedTier(opener, str(tmp_path), "ns", refresh_s=3600)
    store = TieredStore([MemoryTier(1 << 20, "dram"), shared], "ns", [LRUPolicy(), LRUPolicy()])
    try:
        assert store.holds("dram", "k") is False
        assert store.holds("shared", "k") is None  # unknown until listed
        opened.set()
        deadline = time.monotonic() + 60
        while store.holds("shared", "k") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.holds("shared", "k") is False  # listed: an answer
    finally:
        opened.set()
        store.close()


def test_a_tier_identity_is_named_as_vllm_names_media_and_localities():
    from vllm.v1.kv_offload.base import Locality as VllmLocality
    from vllm.v1.kv_offload.base import Medium as VllmMedium

    assert {m.value for m in Medium} == {m.value for m in VllmMedium}
    assert {x.value for x in Locality} == {x.value for x in VllmLocality}
    assert (DRAM.medium, DISK.medium, SHARED.medium) == (MEDIUM_CPU, MEDIUM_STORAGE, MEDIUM_STORAGE)
    assert not DRAM.shared and not DISK.shared and SHARED.shared
    assert tier_id("shared") is SHARED and tier_id("l3", shared=True).locality is Locality.REMOTE
