"""Times vLLM's own step calls in every server process, whatever the configuration.

For benchmarks only (``bench.low_load --steps``): a configuration without our connector
(vLLM alone, the limit) has no hook of ours to time, so this wraps vLLM's methods
instead, the same way in every configuration: the worker's ``execute_model`` and
``sample_tokens`` (vLLM V1 splits a step in the two), the engine core's ``step``
and ``step_with_batch_queue`` and its scheduler's ``schedule`` and ``update_from_output``;
and, where the configuration has our connector, its hooks (each call timed, about a
microsecond added); and the garbage collector's pauses per generation (``gc0``..``gc2``).
Started by the ``sitecustomize`` that ``shim`` writes (first on ``PYTHONPATH``,
``KVBENCH_VSTEPS`` set): a daemon thread waits for each
module to be imported, wraps the methods (looked up on the class at every call, so
wrapping after the objects exist works), and appends ``{"p": process, "f": method,
"t": start, "ms": duration}`` lines to ``$KVBENCH_VSTEPS`` every second.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
import threading
import time

TARGETS = {
    "vllm.v1.worker.gpu_worker": ("Worker", ("execute_model", "sample_tokens")),
    "vllm.v1.engine.core": ("EngineCore", ("step", "step_with_batch_queue")),
    "vllm.v1.core.sched.scheduler": ("Scheduler", ("schedule", "update_from_output")),
    # our connector's hooks, where a configuration has it (bench.off_connector's inherit them)
    "cache.vllm.connector": (
        "TieredKVConnector",
        (
            "get_num_new_matched_tokens",
            "update_state_after_alloc",
            "build_connector_meta",
            "update_connector_output",
            "request_finished",
            "bind_connector_metadata",
            "handle_preemptions",
            "start_load_kv",
            "wait_for_save",
            "get_transfer_results",
            "build_connector_worker_meta",
            "get_kv_connector_stats",
        ),
    ),
}


def _title() -> str:
    try:
        with open(f"/proc/{os.getpid()}/comm") as f:
            return f.read().strip()
    except OSError:
        return str(os.getpid())


def start(path: str, wait_s: float = 600.0) -> None:
    records: list[dict] = []
    lock = threading.Lock()

    def wrap(cls, name: str) -> None:
        fn = getattr(cls, name, None)
        if fn is None or getattr(fn, "kvbench_timed", False):
            return

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:
                    records.append({"f": name, "t": t, "ms": (time.perf_counter() - t) * 1e3})

        timed.kvbench_timed = True  # type: ignore[attr-defined]
        setattr(cls, name, timed)

    gc_started: dict[int, float] = {}

    def gc_timed(phase: str, info: dict) -> None:  # the collector's pauses, as "gc<generation>"
        if phase == "start":
            gc_started[info["generation"]] = time.perf_counter()
        else:
            t = gc_started.pop(info["generation"], None)
            if t is not None:
                with lock:
                    records.append({"f": f"gc{info['generation']}", "t": t, "ms": (time.perf_counter() - t) * 1e3})

    gc.callbacks.append(gc_timed)

    def run() -> None:
        pending = dict(TARGETS)
        deadline = time.monotonic() + wait_s
        while True:
            time.sleep(0.05 if pending else 1.0)
            for mod in list(pending):
                if mod in sys.modules and hasattr(sys.modules[mod], pending[mod][0]):
                    cls_name, names = pending.pop(mod)
                    for name in names:
                        wrap(getattr(sys.modules[mod], cls_name), name)
            if pending and time.monotonic() > deadline:
                pending = {}
            with lock:
                batch, records[:] = list(records), []
            if batch:
                title = _title()
                with open(path, "a") as f:
                    f.writelines(json.dumps({"p": title, **r}) + "\n" for r in batch)

    threading.Thread(target=run, name="kvbench-steps", daemon=True).start()


SITECUSTOMIZE = """import os
if os.environ.get("KVBENCH_VSTEPS"):
    try:
        from bench.vllm_steps import start
        start(os.environ["KVBENCH_VSTEPS"])
    except Exception as e:
        print("step timer not started:", e)
"""


def shim(folder: str) -> str:
    """A folder holding a ``sitecustomize`` that starts the timer in every Python process
    started with it first on ``PYTHONPATH`` and ``KVBENCH_VSTEPS`` set."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    return folder


def summarize(path: str, turns: int, since: float = 0.0, until: float = float("inf")) -> list[str]:
    """Per process and method, calls begun between ``since`` and ``until`` (``perf_counter``,
    the machine's monotonic clock): calls, p50/p90 ms, and ms per turn (the time on the
    step path that each turn served costs)."""
    by: dict[tuple[str, str], list[float]] = {}
    try:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if since <= r["t"] <= until:
                    by.setdefault((r["p"], r["f"]), []).append(r["ms"])
    except FileNotFoundError:
        return ["(no step timings)"]
    rows = []
    for (proc, fn), ms in sorted(by.items()):
        ms.sort()
        rows.append(
            f"  {proc[:15]:15s} {fn:22s} {len(ms):6d} calls  p50/p90 {ms[len(ms) // 2]:6.2f} / "
            f"{ms[int(len(ms) * 0.9)]:6.2f} ms  {sum(ms) / max(1, turns):7.1f} ms/turn"
        )
    return rows
