"""Cache settings: parsed in one place; a bad setting is one clear ConfigError."""

import pytest

from cache.config import ConfigError, build_cache_config, check_block_size, parse_size


def env(tmp_path, **kw):
    base = {"KVCACHE_CPU_PATH": str(tmp_path / "shm"), "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
            "KVCACHE_CPU_SIZE": "1MiB", "KVCACHE_DISK_SIZE": "1MiB"}
    base.update(kw)
    return base


@pytest.mark.parametrize("text,whole,expected", [
    ("8GiB", None, 8 * 2**30), ("500MB", None, 500 * 10**6), ("1073741824", None, 2**30),
    ("20%", 1000, 200), ("1.5k", None, 1500), ("0", None, 0),
])
def test_parse_size(text, whole, expected):
    assert parse_size(text, whole, "X") == expected


@pytest.mark.parametrize("text", ["lots", "5 parsecs", "-1GB", "150%"])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(ConfigError, match="X="):
        parse_size(text, 100, "X")


def test_defaults_and_extra_config_wins(tmp_path):
    cfg = build_cache_config(env(tmp_path), {"kvcache_cpu_size": "2MiB", "kvcache_chunk_tokens": 512})
    assert cfg.cpu_bytes == 2 * 2**20 and cfg.disk_bytes == 2**20 and cfg.chunk_tokens == 512
    from cache.policy import DEFAULT_POLICY
    assert cfg.policy == DEFAULT_POLICY  # the store runs the recommended policy by default


def test_size_above_ram_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="KVCACHE_CPU_SIZE=100TiB .* above the memory"):
        build_cache_config(env(tmp_path, KVCACHE_CPU_SIZE="100TiB"))


def test_size_above_disk_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="KVCACHE_DISK_SIZE=900TB .* above the free space"):
        build_cache_config(env(tmp_path, KVCACHE_DISK_SIZE="900TB"))


def test_unwritable_path_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="KVCACHE_DISK_PATH=.* is not a writable folder"):
        build_cache_config(env(tmp_path, KVCACHE_DISK_PATH=str(blocker / "sub")))


def test_bad_numbers_and_policy(tmp_path):
    with pytest.raises(ConfigError, match="KVCACHE_CHUNK_TOKENS"):
        build_cache_config(env(tmp_path, KVCACHE_CHUNK_TOKENS="many"))
    with pytest.raises(ConfigError, match="KVCACHE_POLICY"):
        build_cache_config(env(tmp_path, KVCACHE_POLICY="random-guess"))
    with pytest.raises(ConfigError, match="KVCACHE_REMOTE_BANDWIDTH='fast'"):
        build_cache_config(env(tmp_path, KVCACHE_REMOTE_BANDWIDTH="fast"))
    assert build_cache_config(env(tmp_path, KVCACHE_REMOTE_BANDWIDTH="1.8GB")).remote_bandwidth == 1_800_000_000


def test_chunk_must_be_whole_blocks(tmp_path):
    cfg = build_cache_config(env(tmp_path, KVCACHE_CHUNK_TOKENS="200"))
    with pytest.raises(ConfigError, match="not a multiple of vLLM's block size \\(128\\); use e.g. 256"):
        check_block_size(cfg, 128)
    check_block_size(build_cache_config(env(tmp_path)), 128)


def test_disabled_tier_never_touches_its_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = build_cache_config(env(tmp_path, KVCACHE_CPU_SIZE="0", KVCACHE_CPU_PATH=str(blocker / "shm")))
    assert cfg.cpu_bytes == 0


def test_memory_limit_reads_cgroup_files(tmp_path):
    from cache.config import memory_limit

    limit = tmp_path / "memory.max"
    limit.write_text("1048576\n")
    assert memory_limit((str(limit),)) == 1048576
    limit.write_text("max\n")
    assert memory_limit((str(limit),)) > 1048576
