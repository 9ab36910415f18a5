"""Where the cache's background threads run, so they never slow the forward pass.

Runs in the vLLM worker process, once per thread, as the thread starts.

vLLM's CPU backend binds each worker process to its compute cores (OpenMP threads) and
leaves the rest (``VLLM_CPU_NUM_OF_RESERVED_CPU``) to the engine-core and API processes.
Threads the worker starts inherit the compute binding: a writer thread encoding and
writing chunks would take turns with the model on its own cores. So the cache's threads
move to the CPUs the worker's parent may use and the worker may not (``spare_cpus``).
On GPU workers, which vLLM does not bind, there are none and nothing moves.

Writes are background work: their threads also run at a lower priority (nice +10), so
that wherever they run, a thread on the request path (the engine loop, a load) comes
first. Loads stay at normal priority: a request is waiting for them.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

log = logging.getLogger(__name__)

WRITER_NICE = 10


def spare_cpus() -> frozenset[int]:
    """CPUs the parent process may run on and this one may not (empty when unknown)."""
    try:
        return frozenset(os.sched_getaffinity(os.getppid()) - os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux, or the parent is gone
        return frozenset()


def thread_setup(cpus: frozenset[int]) -> Callable[[str], None]:
    """A function each background thread calls first with its role ("read", "write",
    "publish", "load", or "shared": the shared tier's own threads): moves it onto
    ``cpus`` (if any) and lowers writers' priority."""

    def setup(role: str) -> None:
        try:
            if cpus:
                os.sched_setaffinity(0, cpus)  # 0: the calling thread
            if role in ("write", "publish"):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (AttributeError, OSError) as e:  # best effort: placement is not correctness
            log.debug("kvcache: could not place %s thread: %s", role, e)

    return setup
