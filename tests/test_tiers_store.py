"""Tier contract (one mixin, every tier) and TieredStore behaviour on real files."""

import multiprocessing as mp
import os
import shutil
import threading
import time

import numpy as np
import pytest

from cache.codec import HEADER_SIZE, encode_header
from cache.keys import Namespace, chunk_keys
from cache.policy import LRUPolicy
from cache.store import TieredStore
from cache.tiers.files import FileTier
from cache.tiers.memory import MemoryTier

NS = Namespace("m", "d", "uint8", "x").digest
KEY = "ab" * 16


class TierContract:
    """Every tier must pass these; subclasses provide ``make(capacity)``."""

    def make(self, tmp_path, capacity):
        raise NotImplementedError

    def test_write_read_delete(self, tmp_path):
        t = self.make(tmp_path, 1000)
        assert not t.contains(KEY)
        with pytest.raises(KeyError):
            t.read(KEY)
        assert t.reserve(10)
        assert t.write(KEY, [b"hello", b"world"], 10)
        assert t.contains(KEY) and bytes(t.read(KEY)) == b"helloworld"
        assert t.used_bytes() == 10
        assert t.delete(KEY) == 10 and t.used_bytes() == 0 and not t.contains(KEY)
        assert t.delete(KEY) == 0

    def test_capacity_is_a_hard_bound(self, tmp_path):
        t = self.make(tmp_path, 25)
        assert t.reserve(10) and t.reserve(10)
        assert not t.reserve(10)
        t.release(10)
        assert t.reserve(10)

    def test_second_writer_of_a_key_is_harmless(self, tmp_path):
        t = self.make(tmp_path, 100)
        assert t.reserve(5) and t.write(KEY, [b"aaaaa"], 5)
        assert t.reserve(5) and not t.write(KEY, [b"aaaaa"], 5)
        assert t.used_bytes() == 5
        assert dict(t.scan()) == {KEY: 5}


class TestMemoryTier(TierContract):
    def make(self, tmp_path, capacity):
        return MemoryTier(capacity)


class TestFileTier(TierContract):
    def make(self, tmp_path, capacity):
        return FileTier(str(tmp_path / "disk"), "ns", capacity)

    def test_scan_removes_debris_and_recounts(self, tmp_path):
        t = self.make(tmp_path, 100)
        assert t.reserve(5) and t.write(KEY, [b"aaaaa"], 5)
        t.reserve(50)  # a writer that crashed after reserving
        debris = t.path(KEY) + ".tmp-otherhost-1-50-dead"
        open(debris, "wb").write(b"x")
        os.utime(debris, (0, 0))
        assert dict(t.scan()) == {KEY: 5}
        assert t.used_bytes() == 5 and not os.path.exists(debris)

    def test_a_recount_by_another_process_keeps_claims_in_flight(self, tmp_path):
        """Another engine's ``scan`` between our reserve and write must not forget the
        claim (the folder would then go over its bound)."""
        ours, theirs = self.make(tmp_path, 100), self.make(tmp_path, 100)
        other = "cd" * 16
        assert ours.reserve(40, other)
        assert dict(theirs.scan()) == {} and theirs.used_bytes() == 40
        assert not theirs.reserve(70)
        assert ours.write(other, [b"x" * 40], 40)
        assert dict(theirs.scan()) == {other: 40} and theirs.used_bytes() == 40
        # the second writer of a key: its claim and temporary file go away
        assert theirs.reserve(40, other) and not theirs.write(other, [b"y" * 40], 40)
        assert dict(ours.scan()) == {other: 40} and ours.used_bytes() == 40

    def test_an_entry_cut_short_from_outside_leaves_no_bytes_counted(self, tmp_path):
        """The account loses what an entry was counted for, not what is left of it."""
        t, other = self.make(tmp_path, 100), "cd" * 16
        assert t.reserve(40, KEY) and t.write(KEY, [b"x" * 40], 40)
        assert t.reserve(30, other) and t.write(other, [b"y" * 30], 30)
        os.truncate(t.path(KEY), 10)
        assert t.delete(KEY) == 40 and t.used_bytes() == 30
        # counted by a recount (another process's tier, after a restart)
        again = self.make(tmp_path, 100)
        assert dict(again.scan()) == {other: 30}
        os.truncate(again.path(other), 0)
        assert again.delete(other) == 30 and again.used_bytes() == 0

    def test_threads_of_one_process_take_turns_on_the_folder_lock(self, tmp_path):
        """The lock file stays open and its ``flock`` is the open file's, shared by every
        thread: a second thread must still wait for the first."""
        t = self.make(tmp_path, 100)
        done = threading.Event()
        with t._locked_usage():  # noqa: SLF001 (holding the folder lock is what is tested)
            threading.Thread(target=lambda: (t.reserve(5), done.set()), daemon=True).start()
            assert not done.wait(0.3), "a reserve went ahead while another thread held the lock"
        assert done.wait(10) and t.used_bytes() == 5

    def test_a_forked_child_waits_for_the_lock_its_parent_holds(self, tmp_path):
        """A child inherits the open lock file; sharing it would share the lock."""
        t = self.make(tmp_path, 100)
        with t._locked_usage():  # noqa: SLF001 (holding the folder lock is what is tested)
            pid = os.fork()
            if pid == 0:  # the child: reserve, then exit at once (no pytest teardown)
                os._exit(0 if t.reserve(7) else 1)
            time.sleep(0.3)
            assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the child took the lock its parent held"
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0 and t.used_bytes() == 7

    def test_a_folder_removed_behind_its_back_is_started_again_for_everyone(self, tmp_path):
        """Not an unlinked usage file only this tier still writes: another opener agrees."""
        t = self.make(tmp_path, 100)
        assert t.reserve(40, KEY) and t.write(KEY, [b"x" * 40], 40)
        shutil.rmtree(t.root)
        other = "cd" * 16
        assert t.reserve(30, other) and t.write(other, [b"y" * 30], 30)
        assert t.used_bytes() == 30 and self.make(tmp_path, 100).used_bytes() == 30


class TestMmapFileTier(TestFileTier):
    def make(self, tmp_path, capacity):
        return FileTier(str(tmp_path / "shm"), "ns", capacity, name="dram", use_mmap=True)


def payload(i, n=1000):
    return np.full(n, i % 251, dtype=np.uint8)


def store(tmp_path, dram=4 * 1300, disk=10 * 1300, **kw):
    tiers = [FileTier(str(tmp_path / "shm"), "ns", dram, "dram", use_mmap=True)] if dram else []
    tiers.append(FileTier(str(tmp_path / "disk"), "ns", disk, "disk"))
    return TieredStore(tiers, NS, [LRUPolicy() for _ in tiers], **kw)


def put_chain(s, keys):
    for i, k in enumerate(keys):
        assert s.put(k, keys[i - 1] if i else None, "uint8", (1000,), payload(i))
    assert s.flush(10)


def test_longest_prefix_promotion_demotion_and_bounds(tmp_path):
    s = store(tmp_path)
    keys = chunk_keys(NS, list(range(12 * 16)), 16)
    put_chain(s, keys[:8])
    # DRAM holds 4 entries; the 4 oldest went down to disk, nothing was lost
    dram, disk = (t.id for t in s.tiers)
    assert s.lookup(keys) == [disk] * 4 + [dram] * 4
    s.check()
    e = s.get(keys[0])
    assert e.tier == s.tiers[1].id and np.array_equal(np.frombuffer(e.payload, np.uint8), payload(0))
    s.flush(10)
    assert s.lookup(keys[:1]) == [dram]  # promoted
    s.check()
    assert s.tiers[0].used_bytes() <= 4 * 1300
    s.close()


def test_a_dram_tier_smaller_than_one_entry_is_passed_over(tmp_path):
    """A DRAM folder too small for one entry (a pod's 64 MiB /dev/shm, a large model)
    must not stop caching: entries go to the first tier that can hold them, and a hit
    there is not promoted into a tier it cannot fit."""
    s = store(tmp_path, dram=1000)  # an entry is 1,256 bytes
    keys = chunk_keys(NS, list(range(3 * 16)), 16)
    put_chain(s, keys)
    assert s.lookup(keys) == [s.tiers[1].id] * 3
    assert s.stats.tiers["dram"].rejected == 0 and s.stats.tiers["disk"].writes == 3
    assert s.get(keys[0]).tier == s.tiers[1].id and s.flush(10)
    assert s.lookup(keys[:1]) == [s.tiers[1].id] and s.stats.tiers["dram"].promotions == 0
    s.check()
    s.close()


def test_every_put_reports_when_it_settles(tmp_path):
    """``on_done`` fires once per put: stored, refused (larger than every tier) or
    dropped (queue full), so the scheduler never waits for a write that will not come."""
    keys = chunk_keys(NS, list(range(3 * 16)), 16)
    settled = []
    s = store(tmp_path, disk=4 * 1300)
    assert s.put(keys[0], None, "uint8", (1000,), payload(0), on_done=settled.append)
    huge = np.zeros(6000, np.uint8)  # larger than either tier: refused
    assert s.put(keys[1], keys[0], "uint8", huge.shape, huge, on_done=settled.append)
    assert s.flush(10)
    assert settled == keys[:2] and s.lookup(keys) == [s.tiers[0].id]
    s.close()
    tight = store(tmp_path / "b", max_pending_bytes=500)  # no room in the write queue
    assert not tight.put(keys[2], None, "uint8", (1000,), payload(2), on_done=settled.append)
    assert settled == keys and tight.stats.dropped_writes == 1
    tight.close()


def test_a_put_is_read_only_once_its_copy_is_ready(tmp_path):
    """A GPU save hands over a host buffer whose device copy is still in flight, with
    ``ready``: the writer waits for it before reading (encoding, checksum, write)."""
    keys = chunk_keys(NS, list(range(16)), 16)
    buf = np.zeros(1000, np.uint8)  # the copy has not landed yet
    landed = []

    def ready():
        buf[:] = 7  # the device copy completes
        landed.append(True)

    s = store(tmp_path)
    assert s.put(keys[0], None, "uint8", buf.shape, buf, ready=ready)
    assert s.flush(10) and landed == [True]
    e = s.get(keys[0])
    assert np.array_equal(np.frombuffer(e.payload, np.uint8), np.full(1000, 7, np.uint8))
    s.close()


def test_restart_rebuilds_from_disk(tmp_path):
    s = store(tmp_path, dram=0)
    keys = chunk_keys(NS, list(range(3 * 16)), 16)
    put_chain(s, keys)
    s.close()
    s2 = store(tmp_path, dram=0)
    assert s2.lookup(keys) == [s2.tiers[0].id] * 3
    assert all(k in s2.policies[0] for k in keys)
    s2.check()


def test_damaged_entry_is_dropped_not_served(tmp_path):
    s = store(tmp_path)
    keys = chunk_keys(NS, list(range(16)), 16)
    put_chain(s, keys)
    path = s.tiers[0].path(keys[0])
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 10)
        f.write(b"\xff")
    assert s.get(keys[0]) is None
    assert s.stats.tiers["dram"].corrupt == 1 and not s.tiers[0].contains(keys[0])


def test_a_truncated_entry_dropped_as_damaged_leaves_the_account_right(tmp_path):
    s = store(tmp_path, dram=0)
    keys = chunk_keys(NS, list(range(32)), 16)
    put_chain(s, keys)
    disk = s.tiers[0]
    whole = disk.used_bytes()
    os.truncate(disk.path(keys[1]), HEADER_SIZE + 100)
    assert s.get(keys[1]) is None and s.stats.tiers["disk"].corrupt == 1
    assert disk.used_bytes() == whole // 2 == sum(size for _k, size in disk.scan())
    s.close()


def test_foreign_entry_is_not_served(tmp_path):
    s = store(tmp_path)
    other = Namespace("other", "d", "uint8", "x").digest
    data = payload(1)
    raw = encode_header(other, KEY, "uint8", (1000,), data) + data.tobytes()
    s.tiers[1].reserve(len(raw))
    s.tiers[1].write(KEY, [raw], len(raw))
    assert s.lookup([KEY]) == [s.tiers[1].id] and s.get(KEY) is None


def _writer(root, start, n):
    tiers = [FileTier(root, "ns", 20 * 1300, "disk")]
    s = TieredStore(tiers, NS, [LRUPolicy()])
    keys = chunk_keys(NS, list(range(start, start + n * 16)), 16)
    for i, k in enumerate(keys):
        s.put(k, None, "uint8", (1000,), payload(i))
    s.flush(60)
    s.close()


def test_two_processes_share_one_folder_within_bound(tmp_path):
    root = str(tmp_path / "disk")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(root, base, 30)) for base in (0, 100000)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    t = FileTier(root, "ns", 20 * 1300)
    entries = dict(t.scan())
    assert 0 < sum(entries.values()) <= 20 * 1300
    assert t.used_bytes() == sum(entries.values())
