"""bench.host: the line a benchmark's report carries about the host it ran on."""

from __future__ import annotations

import os

import torch

from bench import host

CPUINFO = (
    "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14 96-Core Processor\n"
    "flags\t\t: fpu avx2 avx512f\n"
)


def test_the_cpu_model_is_the_first_model_name():
    assert host.cpu_model(CPUINFO + CPUINFO.replace("9R14", "7R13")) == "AMD EPYC 9R14 96-Core Processor"
    assert host.cpu_model("processor\t: 0\nmodel name\t:\n") == "unknown CPU"


def test_a_cpu_without_bfloat16_instructions_is_named_as_such():
    assert "slow path" in host.bf16_kernels(CPUINFO)
    assert "slow path" in host.bf16_kernels(CPUINFO.replace("flags", "bugs").replace("avx2", "avx512_bf16"))
    assert host.bf16_kernels(CPUINFO.replace("avx2", "avx512_bf16")) == "bfloat16 in AVX-512 BF16"
    assert host.bf16_kernels(CPUINFO.replace("avx2", "avx512_bf16 amx_bf16 amx_tile")) == "bfloat16 in AMX"


def test_this_host_is_described_as_torch_sees_it():
    line = host.describe()
    assert f"{os.cpu_count()} CPUs, torch CPU kernels {torch.backends.cpu.get_cpu_capability()}, " in line
    with open("/proc/cpuinfo") as f:
        assert line.endswith(host.bf16_kernels(f.read()))
