"""What the machine this container landed on offers: RAM (cgroup limit included), GPUs.

Runs once at start-up, in the server process, before vLLM starts. GPUs are read
through NVML (``pynvml``), which does not create a CUDA context; ``torch.cuda`` is the
fallback when NVML is missing. Nothing here is cached: call ``probe_machine`` again to
measure again. Free space of a folder is measured where a tier is sized
(``cache.config``), not here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

from cache.config import memory_limit

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Gpu:
    name: str
    total_bytes: int


@dataclass(frozen=True)
class Machine:
    ram_bytes: int  # the smaller of physical RAM and the cgroup limit
    cpus: int
    gpus: tuple[Gpu, ...] = ()

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def probe_gpus() -> tuple[Gpu, ...]:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            gpus = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(h)
                gpus.append(
                    Gpu(
                        name.decode() if isinstance(name, bytes) else str(name),
                        int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                    )
                )
            return tuple(gpus)
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # no NVML library, no driver, no GPU
        log.debug("NVML unavailable: %s", e)
    try:
        import torch

        if torch.cuda.is_available():
            return tuple(
                Gpu(torch.cuda.get_device_name(i), int(torch.cuda.get_device_properties(i).total_memory))
                for i in range(torch.cuda.device_count())
            )
    except Exception as e:  # pragma: no cover - broken CUDA install
        log.debug("torch.cuda unavailable: %s", e)
    return ()


def probe_machine(gpus: Optional[tuple[Gpu, ...]] = None) -> Machine:
    return Machine(ram_bytes=memory_limit(), cpus=_cpus(), gpus=probe_gpus() if gpus is None else gpus)
