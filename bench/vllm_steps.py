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
"t": start, "ms": duration}`` lines to ``$KVBENCH_VSTEPS`` every second; an
``execute_model`` line also has ``"tok"`` and ``"n"``, the tokens and requests the step
carried, so that configurations compare per token (``by_size``), not only per step.
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

        sized = name == "execute_model"

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                r = {"f": name, "t": t, "ms": (time.perf_counter() - t) * 1e3}
                if sized and len(args) > 1:  # what the step carried: tokens and requests scheduled
                    r["tok"] = getattr(args[1], "total_num_scheduled_tokens", None)
                    r["n"] = len(getattr(args[1], "num_scheduled_tokens", None) or ())
                with lock:
                    records.append(r)

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


# execute_model steps grouped by the tokens they carried: decode-only steps of a few
# requests, mixed ones, and steps carrying a long prefill
SIZES = ((1, 8), (9, 32), (33, 128), (129, 512), (513, 1 << 30))


def forward_steps(path: str, since: float = 0.0, until: float = float("inf")) -> list[tuple[int, float, int]]:
    """The worker's ``execute_model`` steps begun between ``since`` and ``until``, as
    (tokens, ms, requests); empty when the log is missing or has no token counts."""
    steps = []
    try:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if r["f"] == "execute_model" and r.get("tok") and since <= r["t"] <= until:
                    steps.append((r["tok"], r["ms"], r.get("n", 0)))
    except FileNotFoundError:
        pass
    return steps


def by_size(steps: list[tuple[int, float, int]]) -> list[str]:
    """Forward steps (``forward_steps``, of one run or pooled) grouped by the tokens they
    carried: per group steps, tokens, p50/p90 ms and ms per token; and a least-squares line
    ``ms = a + b * tokens`` over all steps. Two configurations whose steps take the same
    time at the same size differ in what they batch, not in how fast the forward pass
    runs; a larger ``a`` or ``b`` at the same sizes is a slower forward."""
    if not steps:
        return ["(no execute_model steps with token counts)"]
    rows = []
    for lo, hi in SIZES:
        mine = sorted((ms, tok, n) for tok, ms, n in steps if lo <= tok <= hi)
        if not mine:
            continue
        toks = sum(t for _, t, _ in mine)
        rows.append(
            f"  {lo:4d}-{min(hi, 99999):<5d} tokens {len(mine):6d} steps {toks:8d} tokens "
            f"({sum(n for *_, n in mine) / len(mine):4.1f} requests)  p50/p90 {mine[len(mine) // 2][0]:6.2f} / "
            f"{mine[int(len(mine) * 0.9)][0]:6.2f} ms  {sum(m for m, *_ in mine) / toks:6.3f} ms/token"
        )
    n = len(steps)
    mx = sum(t for t, *_ in steps) / n
    my = sum(m for _, m, _ in steps) / n
    var = sum((t - mx) ** 2 for t, *_ in steps)
    b = sum((t - mx) * (m - my) for t, m, _ in steps) / var if var else 0.0
    rows.append(
        f"  all {n} steps, {mx:.1f} tokens per step: ms = {my - b * mx:.3f} + {b * 1e3:.2f} us x tokens "
        f"({sum(m for _, m, _ in steps):.0f} ms in all)"
    )
    return rows
