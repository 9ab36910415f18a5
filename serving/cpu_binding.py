"""Keep the server's own processes off the cores vLLM's CPU workers compute on.

Runs in the server process, once, right after ``AsyncLLM`` is built (in a worker thread
of the event loop; it reads ``/proc`` and sets CPU masks, milliseconds).

vLLM's CPU build binds each worker process to its compute cores (``VLLM_CPU_OMP_THREADS_BIND``)
and reserves the others (``VLLM_CPU_NUM_OF_RESERVED_CPU``) for the API server and the
engine core, but it never binds those two: they keep every CPU. The engine core busy-waits
(``sched_yield``) for each step's output, and the cache's I/O threads run on the reserved
cores (``cache.threads``), so whenever those are busy Linux's load balancer moves the
engine core, or the API server, onto a compute core. The forward pass then shares its core
with them: on a 2-core host, decode steps took 0.2-2 ms longer with the cache's writes
running, and TTFT swung by 1.5x from run to run (``bench/results/low_load.md``, 2026-12-06).

So once the workers are bound, every process of the server's tree that vLLM left unbound
(the server itself, the engine core, helpers), every thread of each, moves to the CPUs no
worker computes on; threads started later inherit it. Nothing moves where vLLM bound no
worker (``VLLM_CPU_OMP_THREADS_BIND=nobind``) or where the workers take every CPU (nothing
is left to move to). A worker's own processes and threads are never touched.

GPU machines: nothing moves (``after_engine_start`` asks vLLM's platform first). vLLM binds
no GPU worker unless asked (``--numa-bind``: each worker on its GPU's NUMA node), and the
engine core then belongs next to the workers, not on the CPUs they left.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

PROC = Path("/proc")


def _parent(pid: int, proc: Path) -> Optional[int]:
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # (the name may hold spaces and parentheses)


def descendants(root: int, proc: Path = PROC) -> list[int]:
    """Every process under ``root``, parents before their children."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            parent = _parent(int(entry.name), proc)
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    out, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo += children.get(pid, ())
    return out


def _move(pid: int, cpus: set[int], proc: Path) -> int:
    """Every thread of ``pid`` onto ``cpus``; how many moved (threads may end meanwhile)."""
    moved = 0
    try:
        tids = [int(t.name) for t in (proc / str(pid) / "task").iterdir()]
    except OSError:
        return 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            moved += 1
        except OSError:  # ended, or not ours to move
            pass
    return moved


def bind_off_compute_cores(root: Optional[int] = None, proc: Path = PROC) -> Optional[set[int]]:
    """Move the unbound processes of ``root``'s tree (default: this server) off the cores
    its bound workers compute on. The CPUs they now run on, or None when nothing moved."""
    root = os.getpid() if root is None else root
    try:
        allowed = os.sched_getaffinity(root)
    except OSError:  # not Linux
        return None
    compute: set[int] = set()
    unbound: list[int] = []
    under_worker: set[int] = set()
    for pid in descendants(root, proc):
        if _parent(pid, proc) in under_worker:
            under_worker.add(pid)  # a worker's own child: the worker's business
            continue
        try:
            cpus = os.sched_getaffinity(pid)
        except OSError:  # ended meanwhile
            continue
        if cpus < allowed:
            compute |= cpus
            under_worker.add(pid)
        else:
            unbound.append(pid)
    reserved = allowed - compute
    if not compute:
        log.debug("cpu binding: no worker bound to cores; nothing moved")
        return None
    if not reserved:
        log.info("cpu binding: the model's workers compute on every CPU (%s); nothing moved", _cpus(compute))
        return None
    for pid in (root, *unbound):
        _move(pid, reserved, proc)
    log.info(
        "cpu binding: the model computes on CPUs %s; the API server and the engine core "
        "(processes %s) now run on CPUs %s, with the cache's I/O threads",
        _cpus(compute),
        ", ".join(map(str, (root, *unbound))),
        _cpus(reserved),
    )
    return reserved


def after_engine_start() -> Optional[set[int]]:
    """``bind_off_compute_cores`` for this server on vLLM's CPU build; None elsewhere."""
    from vllm.platforms import current_platform

    return bind_off_compute_cores() if current_platform.is_cpu() else None


def _cpus(cpus: set[int]) -> str:
    return ",".join(map(str, sorted(cpus)))
