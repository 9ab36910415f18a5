"""A sampling profiler inside a process: every thread's Python stack, a few hundred times a second.

For benchmarks only (``bench.low_load --profile``), where py-spy cannot attach (this
machine's VM refuses it). ``start(folder)`` runs one daemon thread that reads
``sys._current_frames()`` every ``interval`` seconds and counts collapsed stacks
(``thread;file:function;...``) per thread; every few seconds it rewrites
``folder/<process title or pid>-<pid>.txt`` (one ``stack count`` per line, py-spy's raw
format). The sampler holds the GIL while it samples (tens of microseconds): it slows
what it measures a little, alike in every configuration.

Started in every process of a server by a ``sitecustomize`` module that
``bench.low_load`` puts first on ``PYTHONPATH`` (see ``shim``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter


def _title() -> str:
    try:
        with open(f"/proc/{os.getpid()}/comm") as f:
            return f.read().strip().replace("/", "_").replace(":", "_")
    except OSError:
        return "proc"


def _stack(frame, limit: int = 60) -> str:
    parts = []
    while frame is not None and len(parts) < limit:
        code = frame.f_code
        parts.append(f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})")
        frame = frame.f_back
    return ";".join(reversed(parts))


def start(folder: str, interval: float = 0.004, flush_s: float = 5.0) -> None:
    me = threading.get_ident()
    counts: Counter = Counter()

    def run() -> None:
        last = time.monotonic()
        while True:
            time.sleep(interval)
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():  # noqa: SLF001 (the one way to see every thread)
                if ident != me:
                    counts[f"{names.get(ident, ident)};{_stack(frame)}"] += 1
            if time.monotonic() - last > flush_s:
                last = time.monotonic()
                path = os.path.join(folder, f"{_title()}-{os.getpid()}.txt")
                with open(path + ".tmp", "w") as f:
                    f.writelines(f"{k} {v}\n" for k, v in counts.items())
                os.replace(path + ".tmp", path)

    t = threading.Thread(target=run, name="stack-sampler", daemon=True)
    me = None  # set once started
    t.start()
    me = t.ident


SITECUSTOMIZE = """import os
if os.environ.get("KVBENCH_STACKS"):
    try:
        from bench.stack_sampler import start
        start(os.environ["KVBENCH_STACKS"])
    except Exception as e:
        print("stack sampler not started:", e)
"""


def shim(folder: str) -> str:
    """A folder holding a ``sitecustomize`` that starts the sampler in every Python
    process started with it first on ``PYTHONPATH`` and ``KVBENCH_STACKS`` set."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    return folder
