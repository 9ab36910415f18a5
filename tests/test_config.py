"""Cache settings: parsed in one place; a bad setting is one clear ConfigError."""

import json

import pytest

from cache.assembly import validate
from cache.config import (
    build_cache_config,
    check_block_size,
    config_from_connector,
    connector_extra,
    parse_size,
    read_prompt_file,
)
from cache.errors import ConfigError


def env(tmp_path, **kw):
    base = {
        "KVCACHE_DRAM_PATH": str(tmp_path / "shm"),
        "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
        "KVCACHE_DRAM_SIZE": "1MiB",
        "KVCACHE_DISK_SIZE": "1MiB",
    }
    base.update(kw)
    return base


@pytest.mark.parametrize(
    "text,whole,expected",
    [
        ("8GiB", None, 8 * 2**30),
        ("500MB", None, 500 * 10**6),
        ("1073741824", None, 2**30),
        ("20%", 1000, 200),
        ("1.5k", None, 1500),
        ("0", None, 0),
    ],
)
def test_parse_size(text, whole, expected):
    assert parse_size(text, whole, "X") == expected


@pytest.mark.parametrize("text", ["lots", "5 parsecs", "-1GB", "150%"])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(ConfigError, match="X="):
        parse_size(text, 100, "X")


def test_settings_and_defaults(tmp_path):
    cfg = build_cache_config(env(tmp_path, KVCACHE_DRAM_SIZE="2MiB", KVCACHE_CHUNK_TOKENS="512"))
    assert cfg.dram_bytes == 2 * 2**20 and cfg.disk_bytes == 2**20 and cfg.chunk_tokens == 512
    from cache.policy import DEFAULT_POLICY

    assert cfg.policy == DEFAULT_POLICY  # the store runs the recommended policy by default


def test_size_above_ram_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="KVCACHE_DRAM_SIZE=100TiB .* above the memory"):
        build_cache_config(env(tmp_path, KVCACHE_DRAM_SIZE="100TiB"))


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
    with pytest.raises(ConfigError, match="KVCACHE_POLICY"):  # names: checked where the registry is
        validate(build_cache_config(env(tmp_path, KVCACHE_POLICY="random-guess")))
    with pytest.raises(ConfigError, match="KVCACHE_SHARED_BANDWIDTH='fast'"):
        build_cache_config(env(tmp_path, KVCACHE_SHARED_BANDWIDTH="fast"))
    assert build_cache_config(env(tmp_path, KVCACHE_SHARED_BANDWIDTH="1.8GB")).shared_bandwidth == 1_800_000_000


def test_chunk_must_be_whole_blocks(tmp_path):
    cfg = build_cache_config(env(tmp_path, KVCACHE_CHUNK_TOKENS="200"))
    with pytest.raises(ConfigError, match="not a multiple of vLLM's block size \\(128\\); use e.g. 256"):
        check_block_size(cfg, 128)
    check_block_size(build_cache_config(env(tmp_path)), 128)


def test_disabled_tier_never_touches_its_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = build_cache_config(env(tmp_path, KVCACHE_DRAM_SIZE="0", KVCACHE_DRAM_PATH=str(blocker / "shm")))
    assert cfg.dram_bytes == 0


def test_memory_limit_reads_cgroup_files(tmp_path):
    from cache.config import memory_limit

    limit = tmp_path / "memory.max"
    limit.write_text("1048576\n")
    assert memory_limit((str(limit),)) == 1048576
    limit.write_text("max\n")
    assert memory_limit((str(limit),)) > 1048576


# -- one serialized value for the connector ------------------------------------------------
def test_the_connector_gets_the_resolved_config_without_the_signing_key(tmp_path):
    cfg = build_cache_config(
        env(
            tmp_path,
            KVCACHE_DRAM_SIZE="10%",
            KVCACHE_SIGNING_KEY="s3cret",
            KVCACHE_SHARED_URL=f"file://{tmp_path}/l3",
            KVCACHE_SHARED_BANDWIDTH="1GB",
        )
    )
    extra = connector_extra(cfg)
    assert list(extra) == ["kvcache_config"] and "s3cret" not in json.dumps(extra)
    data = json.loads(json.dumps(extra))["kvcache_config"]  # plain JSON, as vLLM passes it on
    assert data["dram_bytes"] == cfg.dram_bytes > 0 and data["shared_bandwidth"] == 10**9  # bytes, resolved
    # a worker reads it back as it is (nothing re-derived), the key from its environment
    assert config_from_connector(extra, {"KVCACHE_SIGNING_KEY": "s3cret"}) == cfg
    assert config_from_connector(extra, {}).signing_key == ""
    # plain `vllm serve`: no value, the process's own environment
    assert config_from_connector({}, env(tmp_path)) == build_cache_config(env(tmp_path))
    with pytest.raises(ConfigError, match="kvcache_dram_size.*KVCACHE_"):
        config_from_connector({"kvcache_dram_size": "1GiB"}, env(tmp_path))
    with pytest.raises(ConfigError, match="does not know"):
        config_from_connector({"kvcache_config": {**data, "surprise": 1}}, {})
    assert config_from_connector({"kvcache_config": json.dumps(data)}, {"KVCACHE_SIGNING_KEY": "s3cret"}) == cfg


def test_tier_roles_come_from_the_configuration(tmp_path):
    both = build_cache_config(env(tmp_path, KVCACHE_SHARED_URL=f"file://{tmp_path}/l3"))
    assert [(t.name, t.level, t.synchronous, t.last_local, t.shared) for t in both.tiers()] == [
        ("dram", "L1", True, False, False),
        ("disk", "L2", False, True, False),
        ("shared", "L3", False, False, True),
    ]
    disk_only = build_cache_config(env(tmp_path, KVCACHE_DRAM_SIZE="0"))
    assert [(t.name, t.synchronous, t.last_local) for t in disk_only.tiers()] == [("disk", False, True)]
    # Direct reads: the disk tier only (DRAM is tmpfs; the shared tier reads over its transport).
    assert [t.direct_reads for t in both.tiers()] == [False, True, False]
    buffered = build_cache_config(env(tmp_path, KVCACHE_DISK_DIRECT_READS="false"))
    assert [t.direct_reads for t in buffered.tiers()] == [False, False]


# -- names: one vocabulary, old names accepted --------------------------------------------
def test_old_names_are_deprecated_aliases(tmp_path):
    old = {
        "KVCACHE_CPU_PATH": str(tmp_path / "shm"),
        "KVCACHE_CPU_SIZE": "2MiB",
        "KVCACHE_DISK_SIZE": "1MiB",
        "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
        "KVCACHE_REMOTE_URL": f"file://{tmp_path}/l3",
        "KVCACHE_REMOTE_TIMEOUT_MS": "700",
        "KVCACHE_REMOTE_BANDWIDTH": "1MB",
    }
    cfg = build_cache_config(old)
    assert (cfg.dram_path, cfg.dram_bytes, cfg.shared_url, cfg.shared_timeout_ms, cfg.shared_bandwidth) == (
        str(tmp_path / "shm"),
        2 * 2**20,
        f"file://{tmp_path}/l3",
        700,
        10**6,
    )
    assert cfg.notes.count("KVCACHE_CPU_SIZE is deprecated: use KVCACHE_DRAM_SIZE") == 1
    assert len([n for n in cfg.notes if "deprecated" in n]) == 5
    same = build_cache_config({**old, "KVCACHE_DRAM_SIZE": "2MiB"})
    assert same.dram_bytes == 2 * 2**20
    with pytest.raises(ConfigError, match="KVCACHE_CPU_SIZE='2MiB' and KVCACHE_DRAM_SIZE='3MiB' disagree"):
        build_cache_config({**old, "KVCACHE_DRAM_SIZE": "3MiB"})
    typo = build_cache_config(env(tmp_path, KVCACHE_DRAM_SIZ="1GiB"))
    assert "KVCACHE_DRAM_SIZ is not a setting of this cache; ignored" in typo.notes


# -- the DRAM default: one rule -------------------------------------------------------------
def test_dram_default_is_a_share_of_ram_less_what_others_need(tmp_path):
    e = env(tmp_path)
    del e["KVCACHE_DRAM_SIZE"]
    gib = 2**30
    assert build_cache_config(e, ram_bytes=64 * gib).dram_bytes == int(64 * gib * 0.2)
    # RAM less weights (1 GiB), one worker's staging (the default: 1 GiB without the model) and 4 GiB
    capped = build_cache_config(e, ram_bytes=7 * gib, reserved_ram_bytes=1 * gib)
    assert capped.dram_bytes == 1 * gib and any("RAM left" in n for n in capped.notes)


def test_staging_memory_is_sized_up_front_and_left_out_of_the_dram_tier(tmp_path):
    e = env(tmp_path)
    del e["KVCACHE_DRAM_SIZE"]
    gib, mib = 2**30, 2**20
    assert build_cache_config(e).staging_bytes == gib  # the model unknown: the write-behind depth
    # 64 chunks of the model (256 tokens x 4 KiB + header), at most 1 GiB per worker
    small = build_cache_config(e, ram_bytes=64 * gib, kv_bytes_per_token=4096)
    assert small.staging_bytes == 64 * (256 * 4096 + 256)
    assert build_cache_config(e, ram_bytes=64 * gib, kv_bytes_per_token=128 * 1024).staging_bytes == gib
    # every worker's (GPU's) staging is RAM the DRAM default leaves to them
    four = build_cache_config({**e, "KVCACHE_STAGING_SIZE": "512MiB"}, ram_bytes=7 * gib, workers=4)
    assert four.staging_bytes == 512 * mib and four.dram_bytes == 7 * gib - 4 * 512 * mib - 4 * gib
    low = build_cache_config({**e, "KVCACHE_STAGING_SIZE": "1MiB"}, ram_bytes=64 * gib, kv_bytes_per_token=8192)
    assert any("KVCACHE_STAGING_SIZE=1MiB holds less than one chunk" in n for n in low.notes)
    for bad, why in (("10%", "percentage is not allowed"), ("0", "must be above 0"), ("lots", "not a size")):
        with pytest.raises(ConfigError, match=why):
            build_cache_config({**e, "KVCACHE_STAGING_SIZE": bad})


# -- Curvine client ---------------------------------------------------------------------------
def test_curvine_masters_and_a_conf_file_inside_the_model_folder(tmp_path):
    url = {"KVCACHE_SHARED_URL": "curvine:///kv"}
    cfg = build_cache_config(env(tmp_path, **url, KVCACHE_CURVINE_MASTERS="cv-0.cv:8995, cv-1.cv ,10.0.0.7:9000"))
    assert cfg.curvine_masters == ("cv-0.cv:8995", "cv-1.cv:8995", "10.0.0.7:9000") and cfg.curvine_conf == ""
    for bad in ("cv-0:port", "cv-0:70000", "a b:1"):
        with pytest.raises(ConfigError, match="KVCACHE_CURVINE_MASTERS=.* is not host:port"):
            build_cache_config(env(tmp_path, **url, KVCACHE_CURVINE_MASTERS=bad))
    model = tmp_path / "ml" / "model" / "curvine"
    model.mkdir(parents=True)
    (model / "curvine-cluster.toml").write_text("[client]\n")
    in_model = env(
        tmp_path, **url, SAGEMAKER_BASE_DIR=str(tmp_path / "ml"), KVCACHE_CURVINE_CONF="curvine/curvine-cluster.toml"
    )
    assert build_cache_config(in_model).curvine_conf == str(model / "curvine-cluster.toml")
    with pytest.raises(ConfigError, match="KVCACHE_CURVINE_CONF=.*missing.toml' is not a file"):
        build_cache_config({**in_model, "KVCACHE_CURVINE_CONF": "missing.toml"})
    with pytest.raises(ConfigError, match="KVCACHE_CURVINE_CONF=.* and KVCACHE_CURVINE_MASTERS=.* are both set"):
        build_cache_config({**in_model, "KVCACHE_CURVINE_MASTERS": "cv:8995"})


# -- the warm prompts file: one parser ---------------------------------------------------------
def test_prompt_file_is_parsed_in_one_place(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n\n{"prompt_token_ids": [1, 2]}\n{"messages": []}\n')
    assert read_prompt_file(str(path)) == [{"prompt": "hi"}, {"prompt_token_ids": [1, 2]}, {"messages": []}]
    path.write_text('{"prompt_token_ids": ["x"]}\n')
    with pytest.raises(ConfigError, match="line 1: prompt_token_ids must be a list of integers"):
        read_prompt_file(str(path))


# -- a DRAM folder too small is never taken silently (issue 12) ----------------------------------
def small_shm(monkeypatch, tmp_path, shm_room, others=()):
    """/dev/shm-like folder with ``shm_room`` bytes free; ``others``: (mount, room) of
    memory filesystems the user mounted. The rooms are stand-ins; the folders are real."""
    rooms = {str(tmp_path / "shm"): shm_room, **{str(tmp_path / m): r for m, r in others}}

    def room(path):
        return next((r for p, r in rooms.items() if str(path).startswith(p)), 10**15)

    import cache.dram

    monkeypatch.setattr(cache.dram, "room_for_tier", room)
    monkeypatch.setattr(cache.dram, "memory_folders", lambda: [str(tmp_path / m) for m, _ in others])
    for m, _ in others:
        (tmp_path / m).mkdir()


def test_a_dram_folder_smaller_than_a_chunk_turns_the_tier_off_loudly(tmp_path, monkeypatch):
    small_shm(monkeypatch, tmp_path, 64 * 2**20)
    e = env(tmp_path)
    del e["KVCACHE_DRAM_SIZE"]
    capped = build_cache_config(e, ram_bytes=64 * 2**30)
    assert capped.dram_bytes == 64 * 2**20
    assert any(n.startswith("WARNING: the DRAM tier wants 12.8 GiB") and "--shm-size" in n for n in capped.notes)
    # Llama 3 70B: 320 KiB per token, an 80 MiB chunk: the tier would cache nothing
    off = build_cache_config(e, ram_bytes=64 * 2**30, kv_bytes_per_token=327_680)
    assert off.dram_bytes == 0 and [t.name for t in off.tiers()] == ["disk"]
    assert any("WARNING: DRAM tier off: 64.0 MiB" in n and "cannot hold one chunk" in n for n in off.notes)
    # an explicit size: bytes the folder cannot hold stop start-up, a share is capped loudly
    with pytest.raises(ConfigError, match="KVCACHE_DRAM_SIZE=1GiB .* above the free space .*--shm-size"):
        build_cache_config(env(tmp_path, KVCACHE_DRAM_SIZE="1GiB"), ram_bytes=64 * 2**30)
    share = build_cache_config(env(tmp_path, KVCACHE_DRAM_SIZE="10%"), ram_bytes=64 * 2**30)
    assert share.dram_bytes == int(64 * 2**20 * 0.1)
    assert any(n.startswith("WARNING: KVCACHE_DRAM_SIZE=10% wants 6.4 GiB") for n in share.notes)


def test_a_roomier_memory_filesystem_is_used_when_the_path_was_not_chosen(tmp_path, monkeypatch):
    small_shm(monkeypatch, tmp_path, 64 * 2**20, others=[("tiny", 2**20), ("ramdisk", 32 * 2**30)])
    monkeypatch.setattr("cache.dram.DEFAULT_DRAM_PATH", str(tmp_path / "shm" / "kvcache"))
    e = {k: v for k, v in env(tmp_path, KVCACHE_DRAM_SIZE="8GiB").items() if k != "KVCACHE_DRAM_PATH"}
    cfg = build_cache_config(e, ram_bytes=64 * 2**30)
    assert (cfg.dram_path, cfg.dram_bytes) == (str(tmp_path / "ramdisk" / "kvcache"), 8 * 2**30)
    assert any("using " + str(tmp_path / "ramdisk" / "kvcache") in n and "KVCACHE_DRAM_PATH" in n for n in cfg.notes)
    # a folder the user chose is kept (and its size checked), never moved
    with pytest.raises(ConfigError, match="above the free space"):
        build_cache_config(env(tmp_path, KVCACHE_DRAM_SIZE="8GiB"), ram_bytes=64 * 2**30)


def test_memory_folders_are_the_users_tmpfs_mounts(tmp_path):
    from cache.sizes import memory_folders

    mounts = tmp_path / "mounts"
    mounts.write_text(
        "overlay / overlay rw 0 0\ntmpfs /dev/shm tmpfs rw,nosuid 0 0\n"
        "tmpfs /run tmpfs rw 0 0\ntmpfs /sys/fs/cgroup tmpfs ro 0 0\n"
        "tmpfs /mnt/ram tmpfs rw,size=32g 0 0\ntmpfs /mnt/ro tmpfs ro 0 0\n"
        "/dev/nvme1n1 /tmp ext4 rw 0 0\n"
    )
    assert memory_folders(str(mounts)) == ["/mnt/ram"]


def test_the_entry_overhead_is_the_codec_header():
    from cache.codec import HEADER_SIZE
    from cache.config import ENTRY_OVERHEAD

    assert ENTRY_OVERHEAD == HEADER_SIZE
