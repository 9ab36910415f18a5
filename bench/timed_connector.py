"""``TieredKVConnector`` with timers: where a hit's time goes inside a running engine.

Load it instead of ours (``kv_connector="TimedTieredKVConnector"``,
``kv_connector_module_path="bench.timed_connector"``, same extra config plus
``timing_log``: a JSON-lines file). Runs in vLLM's processes like the real connector
and changes nothing but adds timers around it, through the worker's timing hook
(``WorkerSide.set_timer``) and around the connector's own calls:

- scheduler (engine core): ``get_num_new_matched_tokens`` (lookup), and the time from
  an asynchronous load's decision to the step that schedules the request (the
  async-load round trip);
- worker: ``start_load_kv`` and, inside each load, per chunk: tier read, entry check
  (decode + checksum), copy into the paged KV cache (scatter); ``wait_for_save``;
- worker, every step (``step`` records, written in batches): the step's span from
  ``bind_connector_metadata`` to the end of ``wait_for_save`` (the forward pass and the
  connector's hooks around it), the part of it spent in ``start_load_kv``, in
  ``wait_for_layer_load`` (layer-wise loads) and in ``wait_for_save``, and what the step
  carried: loads, saves, tokens computed.

Used by ``bench.profile_engine``; not part of the product.
"""

from __future__ import annotations

import json
import os
import threading
import time

from cache.vllm.connector import TieredKVConnector

_lock = threading.Lock()


def _emit(path: str, **record) -> None:
    record["t"] = time.time()
    record["pid"] = os.getpid()
    with _lock, open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class _Timers(threading.local):
    """What this thread spent since its last record: tier reads, entry checks, copies."""

    def __init__(self) -> None:
        self.read = self.decode = self.scatter = 0.0


class TimedTieredKVConnector(TieredKVConnector):
    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self._log = extra.pop("timing_log", "/tmp/kvbench-timing.jsonl")
        super().__init__(vllm_config, role, kv_cache_config)
        self._async_since: dict[str, float] = {}
        self._timers = _Timers()
        if self.worker_side is not None:
            self.worker_side.set_timer(self._timing)  # the worker's own hook: no patching
        self._step: dict | None = None
        self._steps: list[dict] = []

    def bind_connector_metadata(self, connector_metadata) -> None:
        t = time.perf_counter()
        super().bind_connector_metadata(connector_metadata)
        loads = getattr(connector_metadata, "loads", None) or []
        compute = getattr(connector_metadata, "compute", None)
        self._step = {
            "t0": t,
            "loads": len(loads),
            "sync_loads": sum(1 for x in loads if not x.asynchronous),
            "saves": len(getattr(connector_metadata, "saves", None) or []),
            "tokens": compute[0] if compute else 0,
            "pairs": compute[1] if compute else 0.0,
            "start_load_ms": 0.0,
            "layer_wait_ms": 0.0,
            "save_ms": 0.0,
        }

    def wait_for_layer_load(self, layer_name: str) -> None:
        t = time.perf_counter()
        super().wait_for_layer_load(layer_name)
        if self._step is not None:
            self._step["layer_wait_ms"] += (time.perf_counter() - t) * 1e3

    def _step_done(self, end: float) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        step["span_ms"] = (end - step.pop("t0")) * 1e3
        self._steps.append(step)
        if len(self._steps) >= 200:
            self._flush_steps()

    def _flush_steps(self) -> None:
        steps, self._steps = self._steps, []
        with _lock, open(self._log, "a") as f:
            for s in steps:
                f.write(json.dumps({"event": "step", "pid": os.getpid(), **s}) + "\n")

    def shutdown(self) -> None:
        self._flush_steps()
        super().shutdown()

    def _timing(self, step: str, seconds: float, **details) -> None:
        """The worker's timing hook. Reads of an async load run on the store's read
        threads: their read/decode land in those threads' timers (one ``io_get`` record
        per chunk); the loading thread sees the wait and the scatter (one ``load``)."""
        t = self._timers
        if step in ("read", "decode", "scatter"):
            setattr(t, step, getattr(t, step) + seconds)
            if step == "decode" and threading.current_thread().name.startswith("kvcache-read"):
                _emit(self._log, event="io_get", read_ms=t.read * 1e3, decode_ms=t.decode * 1e3)
                t.read = t.decode = 0.0
        elif step == "load":
            _emit(
                self._log,
                event="load",
                req=details["req"],
                asynchronous=details["asynchronous"],
                chunks=details["chunks"],
                total_ms=seconds * 1e3,
                read_ms=t.read * 1e3,
                decode_ms=t.decode * 1e3,
                scatter_ms=t.scatter * 1e3,
                failed=details["failed"],
            )
            t.read = t.decode = t.scatter = 0.0

    def start_load_kv(self, forward_context, **kwargs) -> None:
        t = time.perf_counter()
        super().start_load_kv(forward_context, **kwargs)
        ms = (time.perf_counter() - t) * 1e3
        if self._step is not None:
            self._step["start_load_ms"] += ms
        if ms > 0.5:
            _emit(self._log, event="start_load_kv", ms=ms)

    def wait_for_save(self) -> None:
        t = time.perf_counter()
        super().wait_for_save()
        end = time.perf_counter()
        ms = (end - t) * 1e3
        if self._step is not None:
            self._step["save_ms"] += ms
            self._step_done(end)
        if ms > 0.5:
            _emit(self._log, event="wait_for_save", ms=ms)

    def get_transfer_results(self, finished_req_ids):
        done = super().get_transfer_results(finished_req_ids)  # (vLLM 0.32 never calls get_finished)
        if done.finished_recving:
            _emit(self._log, event="finished_recving", reqs=sorted(done.finished_recving))
        return done

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        t = time.perf_counter()
        n, asynchronous = super().get_num_new_matched_tokens(request, num_computed_tokens)
        _emit(
            self._log,
            event="lookup",
            req=request.request_id,
            ms=(time.perf_counter() - t) * 1e3,
            tokens=n,
            asynchronous=asynchronous,
            prompt=len(request.prompt_token_ids or []),
        )
        if asynchronous:
            self._async_since[request.request_id] = time.perf_counter()
        return n, asynchronous

    def build_connector_meta(self, scheduler_output):
        for req in scheduler_output.scheduled_new_reqs:
            since = self._async_since.pop(req.req_id, None)
            if since is not None:
                _emit(
                    self._log,
                    event="scheduled_after_async_load",
                    req=req.req_id,
                    ms=(time.perf_counter() - since) * 1e3,
                )
        return super().build_connector_meta(scheduler_output)
