"""Faults the tiers meet, without an engine: failed writes counted by cause and logged once
per episode, damaged entries (bit flips, truncation) in DRAM and on disk, a shared folder
removed while in use. The engine-level versions (a real full filesystem, kill -9) are in
``test_engine_faults.py``."""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cache.codec import HEADER_SIZE
from cache.faults import cause_of
from cache.keys import chunk_keys
from cache.tiers.layout import TMP_MARK
from cache.tiers.resilience import SharedUnavailable
from tests.test_shared_tier import keys_of, node, remote
from tests.test_tiers_store import NS, payload, put_chain, store


def test_causes():
    assert cause_of(OSError(errno.ENOSPC, "No space left on device")) == "no_space"
    assert cause_of(OSError(errno.EROFS, "Read-only file system")) == "read_only"
    wrapped = SharedUnavailable("shared: write failed")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert cause_of(wrapped) == "quota"  # the filesystem's reason, not the wrapper's
    assert cause_of(SharedUnavailable("shared tier is down")) == "unavailable"
    assert cause_of(TimeoutError("late")) == "timeout"
    assert cause_of(OSError(errno.EXDEV, "cross-device")) == "os_error"
    assert cause_of(ValueError("?")) == "other"


def failing_writes(monkeypatch, err):
    """Every file write fails with ``err`` (a unit test's stand-in for a full disk; the
    engine test fills a real filesystem)."""

    def writev(fd, buffers):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "writev", writev)


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cache.faults"]


def tmp_files(root) -> list[str]:
    return [f for _d, _s, files in os.walk(root) for f in files if TMP_MARK in f]


def test_a_full_disk_is_counted_by_cause_and_logged_once_per_episode(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="cache")
    s = store(tmp_path, dram=0)
    keys = chunk_keys(NS, list(range(8 * 16)), 16)
    with monkeypatch.context() as m:
        failing_writes(m, errno.ENOSPC)
        put_chain(s, keys[:5])
        failing_writes(m, errno.EROFS)  # a second cause in the same episode
        put_chain(s, keys[5:7])
    assert s.counters()["write_failure:no_space:disk"] == 5
    assert s.counters()["write_failure:read_only:disk"] == 2
    assert s.stats.tiers["disk"].writes == 0 and s.lookup(keys) == []
    # every claim went back, no temporary file is left
    assert s.tiers[0].used_bytes() == 0 and tmp_files(tmp_path / "disk") == [] and dict(s.tiers[0].scan()) == {}
    logged = messages(caplog)
    assert len(logged) == 2, logged
    assert "writes to the disk tier are failing (no space left" in logged[0]
    assert "also fail (read-only" in logged[1]
    put_chain(s, keys[7:])  # space again: the episode ends, logged once
    logged = messages(caplog)
    assert len(logged) == 3 and "succeed again, after 7 failed" in logged[2], logged
    assert "no_space: 5" in logged[2] and "read_only: 2" in logged[2]
    assert s.lookup(keys[7:]) == [s.tiers[0].id] and s.stats.tiers["disk"].writes == 1
    s.check()
    s.close()


def test_an_unusable_tier_folder_is_a_counted_write_failure_not_an_exception(tmp_path, caplog):
    """Not only the write itself: a folder whose lock cannot even be taken (here the
    folder was replaced by a file) fails each write, counted and logged once."""
    caplog.set_level(logging.WARNING, logger="cache")
    s = store(tmp_path, dram=0)
    keys = chunk_keys(NS, list(range(3 * 16)), 16)
    shutil.rmtree(tmp_path / "disk")
    (tmp_path / "disk").write_bytes(b"not a folder")
    put_chain(s, keys)
    assert s.counters()["write_failure:missing:disk"] == 3
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name != "cache.faults"] == []
    assert len(messages(caplog)) == 1 and "folder missing" in messages(caplog)[0]
    s.close()


def test_write_failures_reach_prometheus_with_tier_and_cause(tmp_path, monkeypatch):
    from cache.vllm.metrics import StatsDelta, TieredKVPromMetrics, TieredKVStats

    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = TieredKVPromMetrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    s = store(tmp_path, dram=0)
    delta = StatsDelta()
    with monkeypatch.context() as m:
        failing_writes(m, errno.ENOSPC)
        put_chain(s, chunk_keys(NS, list(range(3 * 16)), 16))
    for _ in range(2):  # two workers' reports, aggregated as vLLM does
        stats = TieredKVStats().aggregate(delta.take(s.counters(), s.levels()) or TieredKVStats())
        prom.observe(stats.reduce())
    labels = {"model_name": "m", "engine": "0", "tier": "disk", "cause": "no_space"}
    assert registry.get_sample_value("kvcache:tier_write_failures_total", labels) == 3
    s.close()


@pytest.mark.parametrize("tier", ["dram", "disk"])
@pytest.mark.parametrize("damage", ["flip", "truncate-payload", "truncate-header", "empty"])
def test_damaged_entries_are_detected_in_either_tier(tmp_path, tier, damage):
    """A damaged copy is never served: it is counted, deleted, and the next tier's intact
    copy (if any) is served instead."""
    s = store(tmp_path, dram=20 * 1300)
    keys = chunk_keys(NS, list(range(2 * 16)), 16)
    put_chain(s, keys)
    s.persist(keys)  # both chunks in DRAM and on disk
    assert s.flush(10)
    t = 0 if tier == "dram" else 1
    for key in keys:
        path = s.tiers[t].path(key)
        with open(path, "r+b") as f:
            if damage == "flip":
                f.seek(HEADER_SIZE + 500)
                byte = f.read(1)[0]
                f.seek(HEADER_SIZE + 500)
                f.write(bytes([byte ^ 0x10]))
            else:
                f.truncate({"truncate-payload": HEADER_SIZE + 999, "truncate-header": 100, "empty": 0}[damage])
    if t == 1:  # only the disk has the chunk now
        for key in keys:
            s.tiers[0].delete(key)
    e = s.get(keys[0])
    assert s.stats.tiers[tier].corrupt == 1
    if t == 0:  # served from the disk copy, intact, which is promoted back up in its place
        assert e.tier == s.tiers[1].id and np.array_equal(np.frombuffer(e.payload, np.uint8), payload(0))
        assert s.flush(10)
        again = s.get(keys[0])
        assert again.tier == s.tiers[0].id and np.array_equal(np.frombuffer(again.payload, np.uint8), payload(0))
    else:
        assert e is None and not s.tiers[t].contains(keys[0])
    s.close()


def test_a_shared_folder_removed_while_in_use_fails_nothing_and_is_made_again(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="cache")
    root = tmp_path / "l3"
    l3 = remote(root)
    s = node(l3, mode="all")
    first = keys_of(6)
    put_chain(s, first)
    assert all(l3.contains(k) for k in first)
    shutil.rmtree(root)  # gone while serving
    # reads of what it held are misses; the DRAM copies still serve
    assert [s.get(k).tier for k in first] == [s.tiers[0].id] * 6
    for k in first:
        with pytest.raises(KeyError):
            l3.read(k)
    # new entries, some in the very shard folders that vanished, are published again
    again = [k[:2] + keys_of(1, seed=1000 + i)[0][2:] for i, k in enumerate(first)]
    put_chain(s, again)
    st = s.stats.tiers["shared"]
    assert st.errors == 0 and not any(k.startswith("write_failure:") for k in s.counters())
    assert all((root / "ns" / k[:2] / k).exists() for k in again)
    assert messages(caplog) == []
    s.close()
