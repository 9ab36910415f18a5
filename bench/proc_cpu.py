"""CPU time of a server's processes and threads over a run, from ``/proc`` (Linux).

Runs on the operator's machine next to a server started in its own session
(``bench.soak.start_server``): ``snapshot(sid)`` reads every thread's user+system time of
the processes in session ``sid``; the difference of two snapshots, per turn served, says
which process and thread took the cores (a stack sampler says where a thread is, not
whether it runs). Threads are named as the kernel knows them (15 characters: vLLM's
processes and the cache's ``kvcache-*`` threads name themselves).
"""

from __future__ import annotations

import os
from collections import Counter

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(path: str) -> tuple[str, int, float]:
    """(name, session id, user+system seconds) of one ``/proc/.../stat``."""
    with open(path) as f:
        raw = f.read()
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    return name, int(fields[3]), (int(fields[11]) + int(fields[12])) / TICK


def snapshot(sid: int) -> Counter:
    """CPU seconds so far per (process name, thread name) in session ``sid``."""
    out: Counter = Counter()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            proc, session, _ = _stat(f"/proc/{pid}/stat")
            if session != sid:
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                name, _, cpu = _stat(f"/proc/{pid}/task/{tid}/stat")
                out[(proc, name)] += cpu
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return out


def lines(config: str, before: Counter, after: Counter, turns: int, seconds: float, top: int = 12) -> list[str]:
    """The threads that took the most CPU between two snapshots: ms per turn and share of
    one core over the ``seconds`` between them."""
    used = Counter({k: after[k] - before.get(k, 0.0) for k in after})
    total = sum(used.values())
    rows = [
        f"{config}: CPU {total / seconds:.2f} cores over {seconds:.0f} s, {total * 1e3 / max(1, turns):.1f} ms per turn"
    ]
    for (proc, thread), cpu in used.most_common(top):
        rows.append(
            f"  {proc[:15]:15s} {thread[:15]:15s} {cpu * 1e3 / max(1, turns):7.1f} ms/turn  {cpu / seconds:5.2f} cores"
        )
    return rows
