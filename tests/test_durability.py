"""Durability: chunks used again reach the disk tier in the background, so an engine that
starts with an empty DRAM folder finds them."""

import shutil
import threading

import numpy as np

from cache.keys import chunk_keys
from cache.policy import LRUPolicy
from cache.store import TieredStore
from cache.tiers.files import FileTier
from tests.test_scheduler_side import output, request, setup, store_saves  # noqa: F401 (fixture)
from tests.test_tiers_store import NS, payload, put_chain, store


class RefuseAll(LRUPolicy):
    def admit(self, key, parent, size):
        return False


def test_reused_chunks_land_on_disk_and_survive_an_empty_dram_folder(tmp_path):
    s = store(tmp_path, dram=20 * 1300)  # DRAM holds everything: nothing is evicted
    reused, once = chunk_keys(NS, list(range(3 * 16)), 16), chunk_keys(NS, list(range(100, 148)), 16)
    put_chain(s, reused)
    put_chain(s, once)
    assert s.lookup(reused + once, local_only=True) == [s.tiers[0].id] * 6
    s.persist(reused)  # a later request found them
    assert s.flush(10)
    assert [s.tiers[1].contains(k) for k in reused + once] == [True] * 3 + [False] * 3
    assert s.stats.tiers["disk"].persisted == 3 and s.stats.tiers["disk"].writes == 3
    s.persist(reused)  # already there: nothing more
    assert s.flush(10) and s.stats.tiers["disk"].persisted == 3
    s.check()
    s.close()
    shutil.rmtree(tmp_path / "shm")  # a new container: an empty DRAM folder, the same disk
    fresh = store(tmp_path, dram=20 * 1300)
    assert fresh.lookup(reused) == [fresh.tiers[1].id] * 3 and fresh.lookup(once) == []
    e = fresh.get(reused[0])
    assert e.tier.name == "disk" and np.array_equal(np.frombuffer(e.payload, np.uint8), payload(0))
    fresh.close()


def test_the_copy_queue_is_bounded_and_the_disk_policy_decides(tmp_path):
    keys = chunk_keys(NS, list(range(6 * 16)), 16)
    s = store(tmp_path, dram=20 * 1300, max_persist_keys=2)
    put_chain(s, keys)
    gate = threading.Event()  # the writer thread is busy with a put meanwhile
    assert s.put("ee" * 16, None, "uint8", (1000,), payload(9), ready=gate.wait)
    s.persist(keys)
    gate.set()
    assert s.counters()["all.dropped_persists"] == 4
    assert s.flush(10) and sum(s.tiers[1].contains(k) for k in keys) == 2
    s.close()

    tiers = [FileTier(str(tmp_path / "b" / d), "ns", 20 * 1300, d, use_mmap=d == "dram") for d in ("dram", "disk")]
    refusing = TieredStore(tiers, NS, [LRUPolicy(), RefuseAll()])
    put_chain(refusing, keys[:2])
    refusing.persist(keys[:2])
    assert refusing.flush(10)
    assert not any(tiers[1].contains(k) for k in keys[:2])
    assert refusing.stats.tiers["disk"].rejected == 2 and refusing.stats.tiers["disk"].persisted == 0
    refusing.close()


def test_closing_flushes_the_copies_to_disk(tmp_path):
    keys = chunk_keys(NS, list(range(8 * 16)), 16)
    s = store(tmp_path, dram=20 * 1300)
    put_chain(s, keys)
    s.persist(keys)
    assert s.close(timeout=10)  # SIGTERM: the workers close their stores
    disk = FileTier(str(tmp_path / "disk"), "ns", 10 * 1300, "disk")
    assert sorted(k for k, _ in disk.scan()) == sorted(keys)


def test_a_store_without_two_local_tiers_copies_nothing(tmp_path):
    s = store(tmp_path, dram=0)
    keys = chunk_keys(NS, list(range(16)), 16)
    put_chain(s, keys)
    s.persist(keys)
    assert s.flush(10) and s.stats.tiers["disk"].persisted == 0 and s.counters()["all.dropped_persists"] == 0
    s.close()


# -- the scheduler's side: what it reports as reused -------------------------
def test_stored_chunks_a_new_request_finds_are_reported_once(setup):  # noqa: F811
    side, writer = setup
    first = request("a", 700)
    side.get_num_new_matched_tokens(first, 0)
    meta = side.build_connector_meta(output(new=[("a", 0)], scheduled={"a": 700}))
    assert meta.reused == []  # nothing was stored before it
    store_saves(writer, meta)
    side.request_finished(first)
    again = request("b", 700)
    # vLLM's own prefix cache holds most of it: still a second use of every chunk
    side.get_num_new_matched_tokens(again, 640)
    side.get_num_new_matched_tokens(again, 640)  # asked again: reported once
    assert side.build_connector_meta(output()).reused == [c.key for c in side.requests["b"].chunks]
    assert side.build_connector_meta(output()).reused == []
