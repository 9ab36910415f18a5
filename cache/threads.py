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
first. Loads stay at normal priority: a request is waiting for them; so do the saves'
copies on the CPU (``kvcache-copy``): the next step waits for them before vLLM writes
blocks again.

Each thread also gives the kernel its name (``kvcache-write_0``, ``kvcache-read_1``, ...),
so ``top -H``, ``ps -L`` and ``/proc/<pid>/task/*/comm`` tell the cache's threads from the
process's own: Python names threads for itself only, and the kernel would show them all
under the process's name (``VLLM::Worker``).

GPU workers: the current CUDA device is per thread, and a thread that never selected
one works on device 0 (with tensor parallelism, every rank's writer and loader threads
would open a CUDA context on GPU 0, or copy across devices). Once the worker knows its
device (``register_kv_caches``) it sets ``select_device``, which every thread started
from then on calls first. Threads started earlier are covered by the copier, which
selects its device at the start of every call that issues or waits on CUDA work
(``cache.vllm.kv_copy``).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Optional

log = logging.getLogger(__name__)

WRITER_NICE = 10


def spare_cpus() -> frozenset[int]:
    """CPUs the parent process may run on and this one may not (empty when unknown)."""
    try:
        return frozenset(os.sched_getaffinity(os.getppid()) - os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux, or the parent is gone
        return frozenset()


class ThreadSetup:
    """What each background thread calls first with its role ("read", "write", "publish",
    "load", "copy", or "shared": the shared tier's own threads): moves it onto ``cpus`` (if any),
    lowers writers' priority, and selects the worker's CUDA device (``select_device``,
    once set)."""

    def __init__(self, cpus: frozenset[int]) -> None:
        self.cpus = cpus
        self.select_device: Optional[Callable[[], None]] = None

    def __call__(self, role: str) -> None:
        name_os_thread(threading.current_thread().name)
        try:
            if self.cpus:
                os.sched_setaffinity(0, self.cpus)  # 0: the calling thread
            if role in ("write", "publish"):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (AttributeError, OSError) as e:  # best effort: placement is not correctness
            log.debug("kvcache: could not place %s thread: %s", role, e)
        select = self.select_device
        if select is not None:
            try:
                select()
            except Exception as e:  # (an initializer that raises breaks its thread pool)
                log.warning("kvcache: %s thread could not select the worker's CUDA device: %s", role, e)


def name_os_thread(name: str) -> None:
    """Give the calling thread's kernel name (15 bytes at most; Linux only, best effort)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name.encode()[:15].decode(errors="ignore"))
    except OSError:  # not Linux, or /proc read-only
        pass


def thread_setup(cpus: frozenset[int]) -> ThreadSetup:
    """The setup of the cache's threads in this worker (see ``ThreadSetup``)."""
    return ThreadSetup(cpus)
