"""cache.flags: the one parser of true/false settings, and every reader of one using it
(the server's readers are checked in test_serving_config)."""

from __future__ import annotations

import pytest

from cache.config import build_cache_config, cache_enabled
from cache.errors import ConfigError
from cache.flags import FALSE, TRUE, parse_bool

# Every accepted spelling, in other cases and with blanks around it.
SPELLINGS = (
    [(s, True) for s in TRUE]
    + [(s, False) for s in FALSE]
    + [("TRUE", True), (" Yes ", True), ("On", True), ("FALSE", False), (" No", False), ("OFF ", False)]
)


def test_the_spellings():
    assert TRUE == ("1", "true", "yes", "on") and FALSE == ("0", "false", "no", "off")


@pytest.mark.parametrize("text,value", SPELLINGS)
def test_accepted_spellings(text, value):
    assert parse_bool({"X": text}, "X", not value) is value
    assert parse_bool({"X": text}, "X", None) is value


@pytest.mark.parametrize("env", [{}, {"X": ""}, {"X": "  "}, {"X": None}])
def test_unset_or_blank_is_the_default(env):
    assert parse_bool(env, "X", True) is True and parse_bool(env, "X", False) is False
    assert parse_bool(env, "X", None) is None


@pytest.mark.parametrize("text", ["maybe", "2", "t", "y", "enabled", "truefalse"])
def test_anything_else_is_an_error_naming_the_variable(text):
    with pytest.raises(ConfigError, match=rf"^X='{text}' must be true or false \(1/true/yes/on or 0/false/no/off\)"):
        parse_bool({"X": text}, "X", True)


@pytest.mark.parametrize("text,value", SPELLINGS)
def test_cache_settings_take_every_spelling(tmp_path, text, value):
    assert cache_enabled({"KVCACHE_ENABLED": text}) is value
    env = {
        "KVCACHE_DRAM_PATH": str(tmp_path / "shm"),
        "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
        "KVCACHE_DRAM_SIZE": "1MiB",
        "KVCACHE_DISK_SIZE": "1MiB",
        "KVCACHE_LAYERED_LOADS": text,
        "KVCACHE_DISK_DIRECT_READS": text,
    }
    cfg = build_cache_config(env)
    assert cfg.layered_loads is value and cfg.disk_direct_reads is value


def test_a_bad_cache_flag_names_its_variable(tmp_path):
    with pytest.raises(ConfigError, match="KVCACHE_LAYERED_LOADS='sometimes' must be true or false"):
        build_cache_config(
            {
                "KVCACHE_DRAM_PATH": str(tmp_path / "shm"),
                "KVCACHE_DISK_PATH": str(tmp_path / "d"),
                "KVCACHE_LAYERED_LOADS": "sometimes",
            }
        )
