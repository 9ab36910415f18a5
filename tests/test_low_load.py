"""``bench.low_load``'s server settings: its limit is the limit of ``bench.capacity`` (an L0
that holds every conversation), not vLLM alone at the small L0 (as it was until
2026-12-03: its "limit" at 32 users had 4x ours' TTFT p90)."""

from argparse import Namespace
from pathlib import Path

from bench import low_load


def test_the_limit_gets_the_limit_l0_and_every_other_configuration_the_small_one(tmp_path: Path):
    args = Namespace(l0_tokens=32768, limit_tokens=524288, dtype=None)
    blocks = {
        c: int(low_load.config_env(c, args, tmp_path)["SM_VLLM_NUM_GPU_BLOCKS_OVERRIDE"])
        for c in ("limit", "ours", "vllm-alone", low_load.BASE, low_load.UNLIMITED)
    }
    assert blocks["limit"] == 16 * blocks["ours"] == blocks[low_load.UNLIMITED]
    assert blocks["ours"] == blocks["vllm-alone"] == blocks[low_load.BASE]
    assert "KVCACHE_DRAM_PATH" in low_load.config_env(low_load.BASE, args, tmp_path)
    unlimited = low_load.config_env(low_load.UNLIMITED, args, tmp_path)  # ours, cache on
    assert unlimited["KVCACHE_DRAM_SIZE"] == "2GiB" and unlimited.get("KVCACHE_ENABLED") != "false"


def test_ablated_configurations_run_ours_connector_with_parts_switched_off(tmp_path: Path):
    """``ours-off``, ``ours-nosave``, ``ours-copyonly``, ``ours-nocopydown``: the limit's L0 (so their gaps to the
    limit are not the loads'), ours' tier settings, and a connector class of
    ``bench.off_connector`` that exists and is ours with parts switched off."""
    import importlib

    from bench import timed_server
    from cache.vllm.connector import TieredKVConnector

    args = Namespace(l0_tokens=32768, limit_tokens=524288, dtype=None)
    limit = low_load.config_env("limit", args, tmp_path)["SM_VLLM_NUM_GPU_BLOCKS_OVERRIDE"]
    assert set(low_load.ABLATED) == {"ours-off", "ours-nosave", "ours-copyonly", "ours-nocopydown"}
    for config, which in low_load.ABLATED.items():
        env = low_load.config_env(config, args, tmp_path)
        assert env["SM_VLLM_NUM_GPU_BLOCKS_OVERRIDE"] == limit and env["KVCACHE_DRAM_SIZE"] == "2GiB"
        kv = timed_server.swapped_config(lambda config: {"kv_connector_extra_config": {}}, which)(None)
        cls = getattr(importlib.import_module(kv["kv_connector_module_path"]), kv["kv_connector"])
        assert issubclass(cls, TieredKVConnector) and cls is not TieredKVConnector


def test_every_configuration_runs_the_model_in_the_dtype_asked(tmp_path: Path):
    """``--dtype float32``: on a host without bfloat16 instructions the check model's bfloat16
    runs on a slow path (1.7x float32's cost a prompt token on an AVX-512 Xeon without them); every
    configuration gets the same dtype, and none is set unless asked."""
    configs = ("limit", "ours", "vllm-alone", low_load.BASE, low_load.UNLIMITED, *low_load.ABLATED)
    args = Namespace(l0_tokens=32768, limit_tokens=524288, dtype="float32")
    assert {low_load.config_env(c, args, tmp_path).get("SM_VLLM_DTYPE") for c in configs} == {"float32"}
    args.dtype = None
    assert not any("SM_VLLM_DTYPE" in low_load.config_env(c, args, tmp_path) for c in configs)
