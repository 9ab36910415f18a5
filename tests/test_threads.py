"""cache.threads: every thread the cache starts in a vLLM CPU worker runs off the compute
cores the worker is bound to, the shared tier's own threads included (they start in the
thread that builds the store, and inherit its binding unless moved)."""

import os
import re
import threading
import time

import numpy as np
import pytest

from cache.assembly import writer_store
from cache.config import build_cache_config
from cache.keys import Namespace, chunk_keys
from cache.threads import WRITER_NICE, thread_setup

CPUS = sorted(os.sched_getaffinity(0))


def _affinity(tid: int) -> set[int]:
    return os.sched_getaffinity(tid)


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to tell compute cores from spare ones")
def test_every_cache_thread_runs_on_the_spare_cpus(tmp_path):
    compute, spare = {CPUS[0]}, frozenset(CPUS[1:])
    cfg = build_cache_config(
        {
            "KVCACHE_DRAM_PATH": str(tmp_path / "shm"),
            "KVCACHE_DRAM_SIZE": "8MiB",
            "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
            "KVCACHE_DISK_SIZE": "8MiB",
            "KVCACHE_SHARED_URL": f"file://{tmp_path}/l3",
            "KVCACHE_SHARED_ADMISSION": "all",
        }
    )
    ns = Namespace("m", "d", "uint8", "x")
    built = {}
    # Other tests' tiers may leave threads. Thread objects, not idents: a thread that ends
    # gives its ident to the next one started, which would then be taken for an old one.
    before = set(threading.enumerate())

    def build():  # as a worker's main thread, bound to its compute cores, builds the store
        os.sched_setaffinity(0, compute)
        store = writer_store(cfg, ns, thread_setup=thread_setup(spare))
        key = chunk_keys(ns.digest, list(range(16)), 16)[0]
        assert store.put(key, None, "uint8", (1000,), np.zeros(1000, np.uint8)) and store.flush(10)
        store.probe([key])
        store.tiers[-1].read_with(key, lambda reader: reader.size())  # on the shared tier's threads
        built["store"] = store

    t = threading.Thread(target=build)
    t.start()
    t.join()
    store = built["store"]
    try:
        names = {}
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            names = {
                th.name: th.native_id
                for th in threading.enumerate()
                if th.name.startswith("kvcache-") and th not in before
            }
            if all(_affinity(tid) == set(spare) for tid in names.values()):
                break
            time.sleep(0.05)
        roles = {re.sub(r"[-_]\d+$", "", name) for name in names}  # a pool's threads are numbered
        assert {"kvcache-write", "kvcache-publish", "kvcache-shared", "kvcache-shared-probe"} <= roles, roles
        assert {n: _affinity(tid) for n, tid in names.items()} == {n: set(spare) for n in names}
        # Writers at a lower priority; the shared tier's threads serve reads too: normal.
        for name, tid in names.items():
            nice = os.getpriority(os.PRIO_PROCESS, tid) - os.getpriority(os.PRIO_PROCESS, 0)
            assert nice == (WRITER_NICE if name.startswith(("kvcache-write", "kvcache-publish")) else 0), name
        # The kernel knows them by name too (top -H, ps -L, bench.proc_cpu), cut to 15 bytes.
        for name, tid in names.items():
            with open(f"/proc/self/task/{tid}/comm") as f:
                assert f.read().strip() == name[:15], name
    finally:
        store.close()
