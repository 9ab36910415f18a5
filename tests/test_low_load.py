"""``bench.low_load``'s server settings: its limit is the limit of ``bench.capacity`` (an L0
that holds every conversation), not vLLM alone at the small L0 (as it was until
2026-12-03: its "limit" at 32 users had 4x ours' TTFT p90)."""

from argparse import Namespace
from pathlib import Path

from bench import low_load


def test_the_limit_gets_the_limit_l0_and_every_other_configuration_the_small_one(tmp_path: Path):
    args = Namespace(l0_tokens=32768, limit_tokens=524288)
    blocks = {
        c: int(low_load.config_env(c, args, tmp_path)["SM_VLLM_NUM_GPU_BLOCKS_OVERRIDE"])
        for c in ("limit", "ours", "vllm-alone", low_load.BASE, low_load.UNLIMITED)
    }
    assert blocks["limit"] == 16 * blocks["ours"] == blocks[low_load.UNLIMITED]
    assert blocks["ours"] == blocks["vllm-alone"] == blocks[low_load.BASE]
    assert "KVCACHE_DRAM_PATH" in low_load.config_env(low_load.BASE, args, tmp_path)
    unlimited = low_load.config_env(low_load.UNLIMITED, args, tmp_path)  # ours, cache on
    assert unlimited["KVCACHE_DRAM_SIZE"] == "2GiB" and unlimited.get("KVCACHE_ENABLED") != "false"
