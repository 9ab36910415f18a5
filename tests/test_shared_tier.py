"""The shared tier (L3): the Tier contract on real fsspec filesystems, the store's
publishing rule, shared-namespace safety (signing, foreign, damaged and partial entries)
and faults injected into a real local filesystem: latency, errors, truncated writes."""

from __future__ import annotations

import logging
import os
import threading
import time
import types
import uuid

import fsspec
import numpy as np
import pytest
from fsspec.implementations.local import LocalFileSystem

from cache.assembly import build_tiers, shared_tier, validate
from cache.codec import UnsignedEntry, decode, encode_header
from cache.config import CacheConfig
from cache.errors import ConfigError
from cache.keys import Namespace, chunk_keys
from cache.policy import LRUPolicy
from cache.store import TieredStore
from cache.tiers.identity import SHARED, TierId
from cache.tiers.memory import MemoryTier
from cache.tiers.resilience import Pacer
from cache.tiers.shared import SharedTier
from tests.test_tiers_store import KEY, NS, TierContract, payload

ENTRY = 1000 + 256  # payload + header


class FaultyFS(LocalFileSystem):
    """The real local filesystem, with knobs: latency on every call, failing calls,
    writes that silently keep only half of what they are given."""

    protocol = ("faulty",)
    cachable = False
    delay = 0.0
    error: Exception | None = None
    truncate = False

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = 0

    def _fault(self):
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        if self.error is not None:
            raise self.error

    def cat_file(self, path, *a, **kw):
        self._fault()
        return super().cat_file(path, *a, **kw)

    def exists(self, path, **kw):  # (LocalFileSystem's own swallows every error)
        self._fault()
        return os.path.exists(self._strip_protocol(path))

    def info(self, path, **kw):
        self._fault()
        return super().info(path, **kw)

    def ls(self, path, detail=True, **kw):
        self._fault()
        return super().ls(path, detail=detail, **kw)

    def makedirs(self, path, exist_ok=False):
        self._fault()
        return super().makedirs(path, exist_ok=exist_ok)

    def mv(self, path1, path2, **kw):
        self._fault()
        return super().mv(path1, path2, **kw)

    def rm_file(self, path):
        self._fault()
        return super().rm_file(path)

    def _open(self, path, mode="rb", **kw):
        self._fault()
        f = super()._open(path, mode, **kw)
        return _HalfWriter(f) if "w" in mode and self.truncate else f


class _HalfWriter:
    def __init__(self, f):
        self.f = f

    def write(self, data):
        view = memoryview(data).cast("B")
        self.f.write(view[: len(view) // 2])
        return len(view)

    def close(self):
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def faulty_fs(**knobs) -> FaultyFS:
    cls = type("Faulty", (FaultyFS,), dict(knobs))
    return cls()


def remote(root, fs=None, namespace="ns", **kw) -> SharedTier:
    fs = fs if fs is not None else LocalFileSystem()
    kw.setdefault("refresh_s", 0)
    return SharedTier(lambda: fs, str(root), namespace, **kw)


def node(l3: SharedTier, key: bytes = b"", mode: str = "reused", dram: int = 8 * ENTRY) -> TieredStore:
    """One engine's writer store: its own DRAM tier, and the shared tier."""
    tiers = [MemoryTier(dram, "dram"), l3]
    return TieredStore(tiers, NS, [LRUPolicy() for _ in tiers], signing_key=key, shared_admission=mode)


def keys_of(n: int, seed: int = 0) -> list[str]:
    return chunk_keys(NS, list(range(seed, seed + n * 16)), 16)


def put_chain(s: TieredStore, keys, **kw) -> None:
    for i, k in enumerate(keys):
        assert s.put(k, keys[i - 1] if i else None, "uint8", (1000,), payload(i), **kw)
    assert s.flush(10)


def shared_keys(root) -> set[str]:
    return {k for k, _ in remote(root).scan()}


def wait_known(s: TieredStore, keys, timeout=5.0) -> list[TierId]:
    """What a scheduler does: probe, and look again until the answers are in."""
    deadline = time.monotonic() + timeout
    while s.probe(keys) and time.monotonic() < deadline:
        time.sleep(0.01)
    return s.lookup(keys)


# -- the Tier contract ----------------------------------------------------------
class TestSharedTierOnFiles(TierContract):
    def make(self, tmp_path, capacity):
        return shared_tier(CacheConfig(shared_url=f"file://{tmp_path}/l3"), "ns")

    def test_capacity_is_a_hard_bound(self, tmp_path):
        t = self.make(tmp_path, 25)  # the backend's quota bounds it, not this process
        assert t.capacity is None and t.reserve(10**15)

    def test_entries_land_where_a_mount_would_show_them(self, tmp_path):
        t = self.make(tmp_path, None)
        assert t.reserve(5) and t.write(KEY, [b"abcde"], 5)
        path = tmp_path / "l3" / "ns" / KEY[:2] / KEY
        assert path.read_bytes() == b"abcde"
        assert os.listdir(path.parent) == [KEY]  # no temporary file left behind


class TestSharedTierOnMemory(TestSharedTierOnFiles):
    def make(self, tmp_path, capacity):
        return shared_tier(CacheConfig(shared_url=f"memory://kv-{uuid.uuid4().hex}"), "ns")

    def test_entries_land_where_a_mount_would_show_them(self, tmp_path):
        pytest.skip("memory:// has no mount")


class FakeCurvineFileSystem:
    """The surface of curvinefs.CurvineFileSystem that the tier uses (create, rename,
    mkdir, rm, get_file_status, ls, cat_file), on a local folder. Like the SDK, it has no
    fsspec open(..., "wb") or makedirs."""

    def __init__(self, config_path, write_chunk_size, write_chunk_num):
        self.base = open(config_path).read().strip()

    def _p(self, path):
        return self.base + path

    def get_file_status(self, path):
        try:
            st = os.stat(self._p(path))
        except FileNotFoundError:
            return None
        return {"len": st.st_size, "is_dir": os.path.isdir(self._p(path)), "mtime": int(st.st_mtime * 1000)}

    def mkdir(self, path, create_parents):
        os.makedirs(self._p(path), exist_ok=True)

    def create(self, path, overwrite):
        f = open(self._p(path), "wb")
        return types.SimpleNamespace(write=lambda b: f.write(bytes(b)), close=f.close)

    def rename(self, src, dst):
        os.rename(self._p(src), self._p(dst))

    def rm(self, path, recursive=False):
        os.remove(self._p(path))

    def cat_file(self, path, start=0, end=None):
        if self.get_file_status(path) is None:
            raise FileNotFoundError(path)
        return open(self._p(path), "rb").read()

    def ls(self, path, detail=True):
        out = []
        for e in os.scandir(self._p(path)):
            out.append(
                {
                    "name": f"{path}/{e.name}",
                    "size": e.stat().st_size,
                    "type": "directory" if e.is_dir() else "file",
                    "mtime": 0,
                }
            )
        return out


FakeCurvineFileSystem.__name__ = "CurvineFileSystem"


class TestSharedTierOnCurvineSDK(TestSharedTierOnFiles):
    """curvine://PATH through the SDK's fsspec class (replaced by a local stand-in)."""

    def make(self, tmp_path, capacity):
        conf = tmp_path / "curvine-cluster.toml"
        conf.write_text(str(tmp_path / "cluster"))
        os.makedirs(tmp_path / "cluster" / "kv", exist_ok=True)
        sdk = types.ModuleType("curvinefs")
        sdk.CurvineFileSystem = FakeCurvineFileSystem
        self._mp.setitem(__import__("sys").modules, "curvinefs", sdk)
        return shared_tier(CacheConfig(shared_url="curvine:///kv", curvine_conf=str(conf)), "ns")

    @pytest.fixture(autouse=True)
    def _patch(self, monkeypatch):
        self._mp = monkeypatch

    def test_entries_land_where_a_mount_would_show_them(self, tmp_path):
        t = self.make(tmp_path, None)
        assert t.reserve(5) and t.write(KEY, [b"abcde"], 5)
        assert (tmp_path / "cluster" / "kv" / "ns" / KEY[:2] / KEY).read_bytes() == b"abcde"


def test_bad_urls_stop_start_up_with_one_message(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "curvinefs", None)  # SDK not installed
    conf = tmp_path / "c.toml"
    conf.write_text("")
    cases = {
        "curvine:///kv": ("", "KVCACHE_CURVINE_CONF"),
        "curvine:///kv ": (str(conf), "curvinefs"),
        "nope://x": ("", "fsspec"),
        f"file://{tmp_path}/missing/l3": ("", "mounted"),
    }
    for url, (curvine_conf, words) in cases.items():
        config = CacheConfig(shared_url=url.strip(), curvine_conf=curvine_conf)
        with pytest.raises(ConfigError, match=words):
            build_tiers(config, "ns")
        with pytest.raises(ConfigError, match=words):  # what the server checks at start-up
            validate(config)
    tiers = build_tiers(CacheConfig(shared_url=f"file://{tmp_path}/l3"), "ns")
    assert [t.name for t in tiers] == ["shared"] and tiers[0].shared


def test_a_broken_curvine_sdk_is_the_same_clear_message(tmp_path, monkeypatch):
    """Stubs generated by an old protoc fail to import under a newer protobuf with a
    TypeError, not an ImportError: any failure importing the SDK reads the same."""
    sdk = tmp_path / "sdk" / "curvinefs"
    sdk.mkdir(parents=True)
    (sdk / "__init__.py").write_text("raise TypeError('Descriptors cannot be created directly.')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "sdk"))
    monkeypatch.delitem(__import__("sys").modules, "curvinefs", raising=False)
    with pytest.raises(ConfigError, match="KVCACHE_SHARED_URL=.*curvinefs.*missing or broken.*TypeError"):
        validate(CacheConfig(shared_url="curvine:///kv", curvine_masters=("cv-0:8995",)))


def test_curvine_client_from_master_addresses_alone(tmp_path, monkeypatch):
    """KVCACHE_CURVINE_MASTERS: the SDK gets a minimal client file with those masters,
    private to this process and gone once the client is made."""
    seen = {}

    class CurvineFileSystem(FakeCurvineFileSystem):
        def __init__(self, config_path, write_chunk_size, write_chunk_num):
            seen["path"], seen["mode"] = config_path, os.stat(config_path).st_mode & 0o777
            seen["text"] = open(config_path).read()
            self.base = str(tmp_path / "cluster")

    os.makedirs(tmp_path / "cluster" / "kv", exist_ok=True)
    sdk = types.ModuleType("curvinefs")
    sdk.CurvineFileSystem = CurvineFileSystem
    monkeypatch.setitem(__import__("sys").modules, "curvinefs", sdk)
    t = shared_tier(CacheConfig(shared_url="curvine:///kv", curvine_masters=("cv-0.cv:8995", "10.0.0.7:9000")), "ns")
    assert t.reserve(5) and t.write(KEY, [b"abcde"], 5) and bytes(t.read(KEY)) == b"abcde"
    import tomllib

    assert tomllib.loads(seen["text"]) == {
        "client": {"master_addrs": [{"hostname": "cv-0.cv", "port": 8995}, {"hostname": "10.0.0.7", "port": 9000}]}
    }
    assert seen["mode"] == 0o600 and not os.path.exists(seen["path"])


# -- publishing rule --------------------------------------------------------------
def test_chunks_used_twice_are_published_and_one_offs_are_not(tmp_path):
    s = node(remote(tmp_path / "l3"))
    keys = keys_of(3)
    put_chain(s, keys)
    assert shared_keys(tmp_path / "l3") == set()  # computed once: local only
    assert s.get(keys[0]).tier == s.tiers[0].id  # used again
    assert s.flush(10)
    assert shared_keys(tmp_path / "l3") == {keys[0]}
    assert s.stats.tiers["shared"].writes == 1
    s.get(keys[0])
    assert s.flush(10) and s.stats.tiers["shared"].writes == 1  # known there: not again
    s.check()


def test_all_mode_and_explicit_marks_publish_at_once(tmp_path):
    a = node(remote(tmp_path / "a"), mode="all")
    put_chain(a, keys_of(2))
    assert shared_keys(tmp_path / "a") == set(keys_of(2))
    b = node(remote(tmp_path / "b"))
    put_chain(b, keys_of(2, seed=50), shared=True)
    assert shared_keys(tmp_path / "b") == set(keys_of(2, seed=50))
    c = node(remote(tmp_path / "c"), mode="none")
    put_chain(c, keys_of(1))
    c.get(keys_of(1)[0])
    assert c.flush(10) and shared_keys(tmp_path / "c") == set()


def test_second_node_finds_loads_and_promotes_shared_chunks(tmp_path):
    a = node(remote(tmp_path / "l3"), mode="all")
    keys = keys_of(4)
    put_chain(a, keys)
    b = node(remote(tmp_path / "l3"))  # another machine: empty DRAM, same shared folder
    assert b.lookup(keys) == []  # nothing known yet, and no I/O to find out
    assert b.probe(keys)  # checks start in the background
    assert wait_known(b, keys) == [SHARED] * 4
    e = b.get(keys[2])
    assert e.tier == b.tiers[1].id and e.tier.shared and np.array_equal(np.frombuffer(e.payload, np.uint8), payload(2))
    assert b.flush(10) and b.lookup(keys[2:3]) == [b.tiers[0].id]  # promoted into DRAM
    assert b.stats.tiers["shared"].hits == 1


def test_probe_stops_at_the_first_missing_chunk(tmp_path):
    a = node(remote(tmp_path / "l3"), mode="all")
    keys = keys_of(40)
    put_chain(a, keys[:20])
    fs = faulty_fs()
    b = node(remote(tmp_path / "l3", fs))
    assert wait_known(b, keys) == [SHARED] * 20
    asked = fs.calls
    assert asked <= 20 + 16  # whole waves of checks, none past the first wave with a miss
    assert not b.probe(keys) and fs.calls == asked  # the miss is remembered for a while
    # ... unless this engine just stored the missing chunks (they may be published now)
    put_chain(a, keys[20:])
    b.tiers[1].recheck(keys[20:])
    assert wait_known(b, keys) == [SHARED] * 40


def test_background_listing_learns_entries_and_clears_debris(tmp_path):
    a = node(remote(tmp_path / "l3"), mode="all")
    keys = keys_of(3)
    put_chain(a, keys)
    debris = tmp_path / "l3" / "ns" / keys[0][:2] / f"{keys[0]}.tmp-otherhost-1-dead"
    debris.write_bytes(b"partial")
    os.utime(debris, (1e9, 1e9))  # a writer that died long ago
    b = remote(tmp_path / "l3", refresh_s=0.05)
    assert not b.contains(keys[2])
    b.probe([])  # the scheduler's first ask starts the listing
    deadline = time.monotonic() + 5
    while not all(b.contains(k) for k in keys) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(b.contains(k) for k in keys)
    while debris.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not debris.exists()
    b.close()


def test_entry_evicted_after_reuse_is_published_when_the_tier_is_back(tmp_path, caplog):
    clock = Clock()
    fs = faulty_fs(error=ConnectionRefusedError("connection refused"))
    s = node(remote(tmp_path / "l3", fs, clock=clock, failure_threshold=1), dram=2 * ENTRY)
    keys = keys_of(3)
    put_chain(s, keys[:1])
    s.get(keys[0])  # reused, but the shared tier is down: skipped
    assert s.flush(10)
    assert s.stats.tiers["shared"].unavailable >= 1
    type(fs).error = None
    clock.t += 2  # past the backoff
    put_chain(s, keys[1:])  # DRAM holds two: keys[0] is evicted, and published
    assert shared_keys(tmp_path / "l3") == {keys[0]}
    assert s.stats.tiers["dram"].demotions == 1


# -- a shared namespace: signatures, foreign, damaged and partial entries ------------
def test_signed_entries_foreign_and_unsigned_ones_are_ignored_not_deleted(tmp_path):
    l3 = tmp_path / "l3"
    a = node(remote(l3), key=b"k1", mode="all")
    keys = keys_of(2)
    put_chain(a, keys)
    raw = open(l3 / "ns" / keys[0][:2] / keys[0], "rb").read()
    decode(raw, NS, keys[0], b"k1")  # published signed
    with pytest.raises(UnsignedEntry, match="signature mismatch"):
        decode(raw, NS, keys[0], b"k2")

    b = node(remote(l3), key=b"k2")  # a node with another key
    assert wait_known(b, keys) == [SHARED] * 2
    assert b.get(keys[0]) is None and b.stats.tiers["shared"].corrupt == 1
    assert b.lookup(keys) == []  # ignored from now on...
    assert (l3 / "ns" / keys[0][:2] / keys[0]).exists()  # ...but not deleted

    # an unsigned entry and one of another namespace dropped into the shared folder
    unsigned, foreign = keys_of(1, seed=500)[0], keys_of(1, seed=600)[0]
    data = payload(7)
    other_ns = Namespace("other", "d", "uint8", "x").digest
    t = remote(l3)
    for key, ns in ((unsigned, NS), (foreign, other_ns)):
        entry = encode_header(ns, key, "uint8", (1000,), data) + data.tobytes()
        t.reserve(len(entry))
        assert t.write(key, [entry], len(entry))
    c = node(remote(l3), key=b"k1")
    assert c.get(unsigned) is None and c.get(foreign) is None
    assert c.stats.tiers["shared"].corrupt == 2
    assert c.get(keys[1]).tier == c.tiers[1].id  # the signed one is served


def test_truncated_writes_are_never_served(tmp_path):
    fs = faulty_fs(truncate=True)  # the backend loses half of each write
    a = node(remote(tmp_path / "l3", fs), mode="all")
    keys = keys_of(3)
    put_chain(a, keys)
    b = node(remote(tmp_path / "l3"))
    assert wait_known(b, keys) == [SHARED] * 3
    assert all(b.get(k) is None for k in keys)
    assert b.stats.tiers["shared"].corrupt == 3 and b.lookup(keys) == []


def test_readers_never_see_a_partial_entry(tmp_path):
    """Big entries published while another node reads them as fast as it can."""
    keys = keys_of(30)
    big = np.arange(1 << 20, dtype=np.uint8)
    a = TieredStore([remote(tmp_path / "l3")], NS, [LRUPolicy()])
    b = TieredStore([remote(tmp_path / "l3")], NS, [LRUPolicy()])
    seen, done = set(), threading.Event()

    def reader():
        while not done.is_set():
            for k in keys:
                e = b.get(k, promote=False)
                if e is not None:
                    assert len(e.payload) == big.nbytes
                    seen.add(k)

    t = threading.Thread(target=reader)
    t.start()
    for k in keys:
        a.put(k, None, "uint8", big.shape, big)
    assert a.flush(30)
    done.set()
    t.join()
    assert b.stats.tiers["shared"].corrupt == 0 and len(seen) > 0


# -- faults: nothing fails, nothing blocks the scheduler, outages are quiet -------------
def test_reads_past_the_deadline_are_misses(tmp_path):
    a = node(remote(tmp_path / "l3"), mode="all")
    keys = keys_of(2)
    put_chain(a, keys)
    fs = faulty_fs(delay=1.0)
    b = node(remote(tmp_path / "l3", fs, timeout_s=0.2))
    t0 = time.perf_counter()
    assert b.get(keys[0]) is None
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.5, elapsed
    assert b.stats.tiers["shared"].timeouts == 1 and b.stats.tiers["shared"].errors == 1


def test_lookups_answer_from_memory_however_slow_the_backend(tmp_path):
    a = node(remote(tmp_path / "l3"), mode="all")
    keys = keys_of(8)
    put_chain(a, keys)
    fs = faulty_fs(delay=2.0)
    b = node(remote(tmp_path / "l3", fs))
    t0 = time.perf_counter()
    for _ in range(1000):
        b.lookup(keys)
        b.probe(keys)
    assert time.perf_counter() - t0 < 0.5


def test_unreachable_tier_is_logged_once_skipped_and_retried_with_backoff(tmp_path, caplog):
    clock = Clock()
    fs = faulty_fs(error=ConnectionRefusedError("connection refused"))
    l3 = remote(tmp_path / "l3", fs, clock=clock, backoff_s=1.0, max_backoff_s=8.0)
    s = node(l3, mode="all")
    keys = keys_of(30)
    caplog.set_level(logging.WARNING, logger="cache")
    for i, k in enumerate(keys):  # requests keep coming while L3 is down
        assert s.put(k, None, "uint8", (1000,), payload(i))
        s.probe([k])
        assert s.get(keys_of(1, seed=900)[0]) is None
    assert s.flush(10)
    time.sleep(0.1)  # let checks already in flight finish
    outage = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(outage) == 1 and len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
    assert not l3.up and l3.health.outages == 1
    calls = fs.calls
    assert calls <= 8  # three failures opened the breaker; then nothing
    assert s.lookup(keys[-1:]) == [s.tiers[0].id]  # served from DRAM meanwhile
    assert s.stats.tiers["shared"].unavailable > 0

    clock.t += 1.5  # first retry: still down, backoff doubles
    assert s.get(keys_of(1, seed=901)[0]) is None
    assert fs.calls == calls + 1
    clock.t += 1.5  # inside the doubled backoff: no call
    s.get(keys_of(1, seed=902)[0])
    assert fs.calls == calls + 1

    type(fs).error = None
    clock.t += 1.0  # the next trial succeeds: back up, logged once
    assert s.put(keys_of(1, seed=903)[0], None, "uint8", (1000,), payload(1), shared=True)
    assert s.flush(10)
    assert l3.up
    assert [r.getMessage() for r in caplog.records][1].startswith("kvcache: shared tier")
    assert "reachable again" in caplog.records[1].getMessage() and len(caplog.records) == 2


# -- the scheduler's wait for the shared tier ---------------------------------------------
@pytest.fixture
def faulty_url(tmp_path):
    name = f"faulty{uuid.uuid4().hex[:8]}"
    cls = type("Faulty", (FaultyFS,), {"protocol": (name,)})
    fsspec.register_implementation(name, cls, clobber=True)
    return cls, f"{name}://{tmp_path}/l3"


def scheduler(url, timeout_ms):
    from cache.vllm.scheduler import SchedulerSide

    config = CacheConfig(chunk_tokens=32, shared_url=url, shared_timeout_ms=timeout_ms)
    ns = Namespace("m", "d", "uint8", "x", chunk_tokens=32)
    return SchedulerSide(config, [ns], 16, lambda: None), ns


def ask_until_answered(side, request, limit=5.0):
    t0 = time.monotonic()
    while True:
        n, asynchronous = side.get_num_new_matched_tokens(request, 0)
        if n is not None or time.monotonic() - t0 > limit:
            return n, asynchronous, time.monotonic() - t0
        time.sleep(0.005)


def request(rid):
    return types.SimpleNamespace(
        request_id=rid, prompt_token_ids=list(range(200)), lora_request=None, mm_features=None, prompt_embeds=None
    )


@pytest.mark.parametrize("case", ["present", "hanging", "down"])
def test_scheduler_defers_a_request_only_until_the_shared_tier_answers(tmp_path, faulty_url, case):
    cls, url = faulty_url
    side, ns = scheduler(url, timeout_ms=300)
    # 200 tokens, 16-token blocks: 192 looked up, as six 32-token chunks
    keys = chunk_keys(ns.chain_digest, list(range(192)), 32)
    writer = TieredStore([remote(tmp_path / "l3", namespace=ns.id)], ns.digest, [LRUPolicy()])
    put_chain(writer, keys)
    cls.delay = {"present": 0.02, "hanging": 5.0, "down": 0.0}[case]
    cls.error = ConnectionResetError("reset") if case == "down" else None

    n, asynchronous, waited = ask_until_answered(side, request(case))
    if case == "present":  # (nothing else running: loaded before the forward pass)
        assert (n, asynchronous) == (192, False) and waited < 0.3
        assert side.requests[case].planned == {"shared": 192}
    else:
        assert (n, asynchronous) == (0, False)
        assert waited <= 0.45, waited  # bounded by the lookup wait (300 ms here)


def test_a_failed_shared_load_is_not_offered_again(tmp_path):
    """Workers report the blocks they could not load; the scheduler stops offering that
    chunk from the shared tier instead of paying for the same bad read on every request."""
    url = f"file://{tmp_path}/l3"
    side, ns = scheduler(url, timeout_ms=300)
    keys = chunk_keys(ns.chain_digest, list(range(192)), 32)
    writer = TieredStore([remote(tmp_path / "l3", namespace=ns.id)], ns.digest, [LRUPolicy()])
    put_chain(writer, keys)
    req = request("a")
    assert ask_until_answered(side, req)[:2] == (192, False)  # nothing else running: synchronous
    side.update_state_after_alloc(req, types.SimpleNamespace(get_block_ids=lambda: (list(range(12)),)), 192)
    (load,) = side.build_connector_meta(
        types.SimpleNamespace(
            scheduled_new_reqs=[],
            num_scheduled_tokens={},
            scheduled_cached_reqs=types.SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        )
    ).loads
    assert load.chunks[2].block_ids == [4, 5]
    side.loads_failed({4, 5, 6, 7, 8, 9, 10, 11})  # chunk 2 failed, and everything after it
    assert ask_until_answered(side, request("b"))[:2] == (64, False)


# -- bandwidth cap ------------------------------------------------------------------
def test_pacer_holds_transfers_to_the_link_rate():
    now, slept = [100.0], []

    def sleep(s):
        slept.append(round(s, 6))
        now[0] += s

    p = Pacer(1000.0, clock=lambda: now[0], sleep=sleep)
    p.take(500)  # idle link: 0.5 s
    p.take(1000)  # queued behind it: 1 s more
    now[0] += 5.0  # idle again
    p.take(100, started=now[0] - 0.05)  # the transfer itself took 0.05 s of its 0.1 s
    assert slept == [0.5, 1.0, 0.05]


def test_capped_shared_tier_paces_reads_and_writes(tmp_path):
    """Every entry byte written or read is charged to the link (the pacer's arithmetic
    is the test above): two entries written, then one read on another node."""

    class Charged(Pacer):
        def __init__(self, rate):
            super().__init__(rate)
            self.seen = []

        def take(self, nbytes, started=None):
            self.seen.append(nbytes)
            super().take(nbytes, started)

    writes = Charged(10**9)
    l3 = remote(tmp_path / "l3", pacer=writes)
    put_chain(node(l3, mode="all"), keys_of(2))
    assert writes.seen == [ENTRY, ENTRY]
    reads = Charged(10**9)
    other = remote(tmp_path / "l3", pacer=reads)
    assert node(other).get(keys_of(2)[0]) is not None
    assert reads.seen == [ENTRY]
    assert CacheConfig(shared_url="file:///x").shared_bandwidth == 0  # no cap by default
