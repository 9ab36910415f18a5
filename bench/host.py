"""The host a benchmark ran on, in one line for its report.

Runs in the benchmark's own process, once, before anything is measured. The same figures
differ by an order of magnitude between hosts: the check model is bfloat16, and on a CPU
without AVX-512 BF16 or AMX every bfloat16 matmul falls back to a slow path (on the
AVX2-only host of 2026-12-04, 37-43x float32; ``bench/results/low_load.md``). A result
that does not say which host it came from cannot be compared with another.
"""

from __future__ import annotations

import os
from pathlib import Path


def cpu_model(cpuinfo: str) -> str:
    """The first ``model name`` of ``/proc/cpuinfo``'s text; ``unknown CPU`` without one."""
    for row in cpuinfo.splitlines():
        key, _, value = row.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return "unknown CPU"


def bf16_kernels(cpuinfo: str) -> str:
    """What a bfloat16 model's matmuls run on, from the CPU's flags in ``/proc/cpuinfo``."""
    flags: set[str] = set()
    for row in cpuinfo.splitlines():
        key, _, value = row.partition(":")
        if key.strip() == "flags":
            flags = set(value.split())
            break
    if "amx_bf16" in flags:
        return "bfloat16 in AMX"
    if "avx512_bf16" in flags:
        return "bfloat16 in AVX-512 BF16"
    return "no bfloat16 instructions: a bfloat16 model runs on a slow path"


def describe() -> str:
    """``AMD EPYC, 2 CPUs, torch CPU kernels AVX2, no bfloat16 instructions: ...``."""
    import torch

    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    kernels = torch.backends.cpu.get_cpu_capability()
    return f"{cpu_model(text)}, {os.cpu_count()} CPUs, torch CPU kernels {kernels}, {bf16_kernels(text)}"


if __name__ == "__main__":
    print(describe())
