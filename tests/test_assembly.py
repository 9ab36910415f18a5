"""cache.assembly: the one place that builds tiers, policies and stores for each role."""

from cache.policy.prefix_adaptive import PrefixAdaptivePolicy


def test_worker_store_gives_only_its_last_local_tier_the_admission_role(tmp_path):
    """DRAM above disk takes everything (what it evicts is demoted); disk, the last local
    tier, judges admission; a shared tier below them changes neither. (Moved here from
    tests/test_policy.py, whose copy imports the connector's old module path.)"""
    from cache.config import build_cache_config
    from cache.keys import Namespace
    from cache.vllm.worker import WorkerSide

    cfg = build_cache_config(
        {
            "KVCACHE_DRAM_PATH": str(tmp_path / "shm"),
            "KVCACHE_DRAM_SIZE": "1MiB",
            "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
            "KVCACHE_DISK_SIZE": "1MiB",
            "KVCACHE_SHARED_URL": f"file://{tmp_path}/l3",
        }
    )
    side = WorkerSide(cfg, Namespace("m", "d", "bfloat16", "x"), num_blocks=4, block_size=16)
    dram, disk = side.store.policies[:2]
    assert isinstance(dram, PrefixAdaptivePolicy) and not dram.last_tier and disk.last_tier
    side.shutdown()


def test_each_tier_carries_the_identity_the_configuration_names(tmp_path):
    """A tier is named once (issue 29 item 3): the configuration's ``TierSpec.id`` and the
    built tier's ``id`` are the same name, medium and locality; the protocol's ``up`` is
    declared on every tier (the scheduler reads it)."""
    from cache.assembly import build_tiers
    from cache.config import build_cache_config
    from cache.tiers.identity import DISK, DRAM, SHARED

    cfg = build_cache_config(
        {
            "KVCACHE_DRAM_PATH": str(tmp_path / "shm"),
            "KVCACHE_DRAM_SIZE": "1MiB",
            "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
            "KVCACHE_DISK_SIZE": "1MiB",
            "KVCACHE_SHARED_URL": f"file://{tmp_path}/l3",
        }
    )
    specs, tiers = cfg.tiers(), build_tiers(cfg, "ns")
    try:
        assert [s.id for s in specs] == [t.id for t in tiers] == [DRAM, DISK, SHARED]
        assert [s.shared for s in specs] == [t.shared for t in tiers] == [False, False, True]
        assert all(t.up for t in tiers)
    finally:
        for t in tiers:
            t.close()


def test_tier_identities_order_by_speed_not_by_position():
    """``max`` of the tiers a chunk is found in is the slowest (``cache.vllm.hits``): local
    memory, then local storage, then remote (the settings' L1..L3), whatever order a store
    lists its tiers in; a test's tier named by ``tier_id`` takes its medium's place."""
    from cache.tiers.identity import DISK, DRAM, SHARED, tier_id

    assert sorted([SHARED, DISK, DRAM]) == [DRAM, DISK, SHARED] and max(DISK, DRAM) is DISK
    assert max(SHARED, DRAM, DISK) is SHARED and min(SHARED, DISK) is DISK
    assert DRAM < tier_id("t0") < tier_id("t1", shared=True) and tier_id("t0").level == DISK.level
    assert [t.level for t in (DRAM, DISK, SHARED)] == [1, 2, 3]  # TierSpec.level: "L1".."L3"
