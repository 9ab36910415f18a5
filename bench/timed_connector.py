"""``TieredKVConnector`` with timers: where a hit's time goes inside a running engine.

Load it instead of ours (``kv_connector="TimedTieredKVConnector"``,
``kv_connector_module_path="bench.timed_connector"``, same extra config plus
``timing_log``: a JSON-lines file). Runs in vLLM's processes like the real connector
and changes nothing but adds timers around it:

- scheduler (engine core): ``get_num_new_matched_tokens`` (lookup), and the time from
  an asynchronous load's decision to the step that schedules the request (the
  async-load round trip);
- worker: ``start_load_kv`` and, inside each load, per chunk: tier read, entry check
  (decode + checksum), copy into the paged KV cache (scatter); ``wait_for_save``.

Used by ``bench.profile_engine``; not part of the product.
"""

from __future__ import annotations

import json
import os
import threading
import time

from cache import store as store_module
from cache.vllm import worker as worker_module
from cache.vllm.connector import TieredKVConnector

_lock = threading.Lock()


def _emit(path: str, **record) -> None:
    record["t"] = time.time()
    record["pid"] = os.getpid()
    with _lock, open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class _Timers(threading.local):
    def __init__(self) -> None:
        self.read = self.decode = self.scatter = 0.0
        self.chunks = 0


_timers = _Timers()


def _patch_worker_classes() -> None:
    """Wrap the tier read, decode and scatter the worker's loads call (once per process)."""
    if getattr(_patch_worker_classes, "done", False):
        return
    _patch_worker_classes.done = True
    orig_decode = store_module.decode

    def decode(*a, **k):
        t = time.perf_counter()
        try:
            return orig_decode(*a, **k)
        finally:
            _timers.decode += time.perf_counter() - t

    store_module.decode = decode
    from cache.vllm.kv_copy import BlockCopier
    from cache.tiers.files import FileTier

    orig_read = FileTier.read

    def read(self, key):
        t = time.perf_counter()
        try:
            return orig_read(self, key)
        finally:
            _timers.read += time.perf_counter() - t

    FileTier.read = read
    orig_scatter = BlockCopier.scatter

    def scatter(self, *a, **k):
        t = time.perf_counter()
        try:
            return orig_scatter(self, *a, **k)
        finally:
            _timers.scatter += time.perf_counter() - t
            _timers.chunks += 1

    BlockCopier.scatter = scatter


class TimedTieredKVConnector(TieredKVConnector):
    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self._log = extra.pop("timing_log", "/tmp/kvbench-timing.jsonl")
        super().__init__(vllm_config, role, kv_cache_config)
        self._async_since: dict[str, float] = {}
        if self.worker_side is not None:
            _patch_worker_classes()
            ws, log = self.worker_side, self._log
            orig_load = ws._load

            def timed_load(load, mark=None):
                # Reads of an async load run on the I/O pool: their read/decode land in
                # those threads' timers; this thread sees the wait and the scatter.
                _timers.read = _timers.decode = _timers.scatter = 0.0
                _timers.chunks = 0
                t = time.perf_counter()
                failed = orig_load(load, mark)
                _emit(log, event="load", req=load.req_id, asynchronous=load.asynchronous,
                      chunks=len(load.chunks), total_ms=(time.perf_counter() - t) * 1e3,
                      read_ms=_timers.read * 1e3, decode_ms=_timers.decode * 1e3,
                      scatter_ms=_timers.scatter * 1e3, failed=len(failed))
                return failed

            ws._load = timed_load
            orig_get = ws.store.get

            def timed_get(key, promote=True):
                if not threading.current_thread().name.startswith("kvcache-read"):
                    return orig_get(key, promote)  # sync (DRAM) load: counted by timed_load
                _timers.read = _timers.decode = 0.0
                t = time.perf_counter()
                entry = orig_get(key, promote)
                _emit(log, event="io_get", ms=(time.perf_counter() - t) * 1e3,
                      read_ms=_timers.read * 1e3, decode_ms=_timers.decode * 1e3)
                return entry

            ws.store.get = timed_get
            worker_module.log.debug("kvcache: timed connector in worker %d", os.getpid())

    def start_load_kv(self, forward_context, **kwargs) -> None:
        t = time.perf_counter()
        super().start_load_kv(forward_context, **kwargs)
        ms = (time.perf_counter() - t) * 1e3
        if ms > 0.5:
            _emit(self._log, event="start_load_kv", ms=ms)

    def wait_for_save(self) -> None:
        t = time.perf_counter()
        super().wait_for_save()
        ms = (time.perf_counter() - t) * 1e3
        if ms > 0.5:
            _emit(self._log, event="wait_for_save", ms=ms)

    def get_finished(self, finished_req_ids):
        done = super().get_finished(finished_req_ids)
        if done[1]:
            _emit(self._log, event="finished_recving", reqs=sorted(done[1]))
        return done

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        t = time.perf_counter()
        n, asynchronous = super().get_num_new_matched_tokens(request, num_computed_tokens)
        _emit(self._log, event="lookup", req=request.request_id, ms=(time.perf_counter() - t) * 1e3,
              tokens=n, asynchronous=asynchronous, prompt=len(request.prompt_token_ids or []))
        if asynchronous:
            self._async_since[request.request_id] = time.perf_counter()
        return n, asynchronous

    def build_connector_meta(self, scheduler_output):
        for req in scheduler_output.scheduled_new_reqs:
            since = self._async_since.pop(req.req_id, None)
            if since is not None:
                _emit(self._log, event="scheduled_after_async_load", req=req.req_id,
                      ms=(time.perf_counter() - since) * 1e3)
        return super().build_connector_meta(scheduler_output)
