"""The tiers' KV events on a real engine, read by a real consumer: a ZMQ subscriber on
vLLM's publisher decoding batches with msgspec, as vLLM's documentation shows
(``examples/online_serving/kv_events_subscriber.py``).

Three engines on the same tier folders (restarts), DRAM small enough to evict, a
``file://`` shared tier taking every chunk. After each engine the subscriber's view of
each tier (the block hashes of ``BlockStored`` minus ``BlockRemoved``, by ``medium`` and
``ownership``) equals what the connector announced (its snapshot file); after the third,
which writes nothing, that is what each tier's folder holds (writes a worker finished
after its scheduler's last step are announced by the next engine); and every block we announce carries the very
hash, tokens and extra keys of vLLM's own GPU event for that block, so a salted prompt's
blocks differ from the same prompt's unsalted ones exactly as vLLM's do.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import defaultdict

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, KVEventBatch

from bench.peers import free_port
from tests.conftest import run_engine
from tests.engine_driver import entry_files

pytestmark = pytest.mark.engine

B = 128  # vLLM's block size on the CPU build


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


P1 = tokens(11, 1500)  # 5 chunks and a 220-token tail (one full block)
PS = tokens(12, 700)  # sent salted and unsalted
P2 = tokens(13, 1200)  # after the restart: pushes older chunks out of DRAM
FLUSH = {"prompt_token_ids": tokens(14, 40), "kv_transfer_params": {"kvcache_save": False}}


class Subscriber:
    """A consumer of vLLM's KV events: per (medium, ownership), the block hashes held."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, "")
        self.sock.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.view: dict[tuple, set] = defaultdict(set)
        self.gpu: dict = {}  # hash -> (tokens, extra key) of vLLM's own GPU events
        self.ours: dict = {}  # hash -> (tokens, extra key) of the tiers' events
        self.batches = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(100):
                continue
            _topic, _seq, payload = self.sock.recv_multipart()
            batch = self.decoder.decode(payload)
            with self._lock:
                self.batches += 1
                for event in batch.events:
                    self._apply(event)

    def _apply(self, event) -> None:
        if isinstance(event, BlockStored):
            blocks = {
                h: (tuple(event.token_ids[i * B : (i + 1) * B]), event.extra_keys[i] if event.extra_keys else None)
                for i, h in enumerate(event.block_hashes)
            }
            if event.medium in (None, MEDIUM_GPU):
                self.gpu.update(blocks)
            else:
                if event.token_ids:  # (a chunk carried over a restart is announced by hashes alone)
                    self.ours.update(blocks)
                self.view[(event.medium, event.ownership)].update(event.block_hashes)
        elif isinstance(event, BlockRemoved) and event.medium not in (None, MEDIUM_GPU):
            self.view[(event.medium, event.ownership)].difference_update(event.block_hashes)

    def snapshot(self) -> dict:
        with self._lock:
            return {k: set(v) for k, v in self.view.items() if v}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(linger=0)
        self.ctx.term()


def tier_contents(cache: dict, snapshot_file: str) -> tuple[dict, dict]:
    """What each tier's folder holds, as (medium, tier) -> block hashes through the
    connector's chunk record; and the chunk keys of each folder and of the record."""
    record = {
        t: [(k, hs) for k, hs, _parent in entries]
        for t, entries in json.loads(open(snapshot_file).read())["tiers"].items()
    }
    folders = {
        "dram": cache["KVCACHE_DRAM_PATH"],
        "disk": cache["KVCACHE_DISK_PATH"],
        "shared": cache["KVCACHE_SHARED_URL"][len("file://") :],
    }
    medium = {"dram": MEDIUM_CPU, "disk": MEDIUM_STORAGE, "shared": MEDIUM_STORAGE}
    keys = {
        t: ({key for _ns, key, _p in entry_files(f)}, {k for k, _ in record.get(t, [])}) for t, f in folders.items()
    }
    view = {(medium[t], t): {h for _k, hs in record.get(t, []) for h in hs} for t in folders}
    return {k: v for k, v in view.items() if v}, keys


def wait_for(sub: Subscriber, expected: dict, timeout: float = 60) -> dict:
    """The subscriber's view once it equals ``expected``, or at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        got = sub.snapshot()
        if got == expected or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


@pytest.fixture(scope="module")
def runs(model_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("events")
    port = free_port()
    cache = {
        "KVCACHE_DRAM_PATH": str(tmp / "shm"),
        "KVCACHE_DRAM_SIZE": "2MiB",
        "KVCACHE_DISK_PATH": str(tmp / "disk"),
        "KVCACHE_DISK_SIZE": "256MiB",
        "KVCACHE_SHARED_URL": f"file://{tmp / 'shared'}",
        "KVCACHE_SHARED_ADMISSION": "all",
    }
    os.makedirs(tmp / "shared")
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    settle = {"sleep": 1}
    try:
        out = {}
        run_engine(
            {
                "model": model_path,
                "cache": cache,
                "kv_events": events,
                "steps": [
                    {"prompt_token_ids": P1},
                    {"prompt_token_ids": PS, "cache_salt": "tenantA"},
                    {"prompt_token_ids": PS},
                    settle,
                    FLUSH,
                    settle,
                    FLUSH,
                ],
            }
        )
        snap = next((tmp / "disk").glob(".kvevents-*.json"))
        out["first"] = tier_contents(cache, str(snap))
        out["first_view"] = wait_for(sub, out["first"][0])
        run_engine(
            {
                "model": model_path,
                "cache": cache,
                "kv_events": events,
                "steps": [{"prompt_token_ids": P2}, {"prompt_token_ids": P1}, settle, FLUSH, settle, FLUSH],
            }
        )
        out["second"] = tier_contents(cache, str(snap))
        out["second_view"] = wait_for(sub, out["second"][0])
        # A third engine that writes nothing: it announces what the workers of the two
        # before it wrote after their schedulers' last step (flushed at shutdown, or just
        # slower than the settle on a loaded machine), so only now must each folder and
        # the record agree exactly.
        run_engine({"model": model_path, "cache": cache, "kv_events": events, "steps": [FLUSH, settle, FLUSH]})
        out["third"] = tier_contents(cache, str(snap))
        out["third_view"] = wait_for(sub, out["third"][0])
        out["sub"] = sub
        yield out
    finally:
        sub.close()


def test_the_subscribers_view_of_each_tier_is_what_the_tier_holds(runs):
    """After each engine the subscriber holds what the connector announced; once an engine
    that writes nothing has started after them, that is exactly what each folder holds."""
    for run in ("first", "second", "third"):
        expected, keys = runs[run]
        assert set(expected) == {(MEDIUM_CPU, "dram"), (MEDIUM_STORAGE, "disk"), (MEDIUM_STORAGE, "shared")}, run
        assert runs[run + "_view"] == expected, run
    for tier, (in_folder, recorded) in runs["third"][1].items():
        assert in_folder == recorded, (tier, len(in_folder), len(recorded))


def test_the_restart_evicted_chunks_announced_by_the_engine_before_it(runs):
    first, second = runs["first"][0], runs["second"][0]
    gone = first[(MEDIUM_CPU, "dram")] - second[(MEDIUM_CPU, "dram")]
    assert gone, "P2 after the restart pushes chunks stored before it out of DRAM"
    assert not gone & runs["second_view"][(MEDIUM_CPU, "dram")]


def test_every_announced_block_is_vllms_own_and_salt_splits_them_as_vllm_does(runs):
    sub = runs["sub"]
    assert sub.ours and set(sub.ours) <= set(sub.gpu)
    for h, block in sub.ours.items():
        assert block == sub.gpu[h], h  # same tokens, same extra keys (salt) for that hash
    first_ps = [(h, extra) for h, (toks, extra) in sub.ours.items() if toks == tuple(PS[:B])]
    assert len(first_ps) == 2 and len({h for h, _ in first_ps}) == 2
    assert sorted(str(extra) for _, extra in first_ps) == sorted([str(("tenantA",)), "None"])
