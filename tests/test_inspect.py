"""``python -m cache.tools.inspect`` on real tier folders filled by a real store, with
damage planted the ways it happens (a flipped bit, a short file, an unsigned entry, a
crashed writer's temporary file, a stray file, a skewed byte account). The server-level
check (repair while a server uses the folders) is in ``tests/test_server.py``."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cache.assembly import writer_store
from cache.codec import HEADER_SIZE, encode_header
from cache.config import build_cache_config
from cache.keys import Namespace, chunk_keys
from cache.tiers.layout import USAGE, folder_usage, temp_path
from tests.conftest import REPO

NS = Namespace("m", "d", "bfloat16", "x", chunk_tokens=16)


def env_for(tmp, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHE_")}
    env.update(
        {
            "PYTHONPATH": str(REPO),
            "KVCACHE_DRAM_PATH": str(tmp / "dram"),
            "KVCACHE_DRAM_SIZE": "32KiB",
            "KVCACHE_DISK_PATH": str(tmp / "disk"),
            "KVCACHE_DISK_SIZE": "1MiB",
            "KVCACHE_SHARED_URL": f"file://{tmp}/l3",
            "KVCACHE_SHARED_ADMISSION": "all",
            "KVCACHE_SIGNING_KEY": "key-1",
            **extra,
        }
    )
    return env


def inspect(env, *args):
    run = subprocess.run(
        [sys.executable, "-m", "cache.tools.inspect", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode in (0, 1), run.stderr
    return run.returncode, run.stdout


@pytest.fixture
def filled(tmp_path):
    (tmp_path / "l3").mkdir()
    env = env_for(tmp_path)
    cfg = build_cache_config(env)
    store = writer_store(cfg, NS)
    keys = chunk_keys(NS.chain_digest, list(range(16 * 40)), 16)
    for i, k in enumerate(keys):  # 40 entries of 1,280 bytes: DRAM holds 25, the rest go to disk
        store.put(k, keys[i - 1] if i else None, "uint8", (1024,), np.full(1024, i, np.uint8))
    store.flush(30)
    store.close()
    return tmp_path, env, cfg, keys


def entries(folder):
    return sorted(p for p in folder.rglob("*") if p.is_file() and len(p.name) == 32)


def test_lists_then_finds_planted_damage_and_repairs_it(filled):
    tmp, env, cfg, keys = filled
    code, out = inspect(env)
    assert code == 0
    dram_line = next(line for line in out.splitlines() if line.startswith("dram ") and NS.id in line)
    assert f"{len(entries(tmp / 'dram')):>9,}" in dram_line
    assert any(line.startswith("shared ") and NS.id in line for line in out.splitlines())
    code, out = inspect(env, "--verify")
    assert code == 0 and "0 problem(s)" in out and "MISMATCH" not in out

    dram, disk = entries(tmp / "dram"), entries(tmp / "disk")
    flipped, short, unsigned = dram[0], disk[0], disk[1]
    raw = bytearray(flipped.read_bytes())
    raw[HEADER_SIZE + 3] ^= 0xFF
    flipped.write_bytes(raw)
    short.write_bytes(short.read_bytes()[:-100])  # an entry of the wrong size
    payload = np.zeros(1024, np.uint8)
    unsigned.write_bytes(encode_header(NS.digest, unsigned.name, "uint8", (1024,), payload) + payload.tobytes())
    dead = subprocess.Popen(["true"])
    dead.wait()
    crashed = temp_path(str(dram[1]), 1280).replace(f"-{os.getpid()}-", f"-{dead.pid}-")
    open(crashed, "wb").write(b"half an entry")
    live = temp_path(str(dram[2]), 1280)  # this process: a write in progress
    open(live, "wb").write(b"being written")
    stray = dram[3].parent / "notes.txt"
    stray.write_text("not an entry")
    with open(tmp / "dram" / ".usage", "r+b") as f:  # a skewed account
        f.write(USAGE.pack(folder_usage(tmp / "dram") + 999_999))
    l3_entry = entries(tmp / "l3")[0]
    raw = bytearray(l3_entry.read_bytes())
    raw[HEADER_SIZE + 5] ^= 0xFF
    l3_entry.write_bytes(raw)

    code, out = inspect(env, "--verify")
    assert code == 1, out
    for what, path in (
        ("damaged", flipped),
        ("damaged", short),
        ("unsigned", unsigned),
        ("orphan", crashed),
        ("orphan", stray),
        ("damaged", l3_entry),
    ):
        assert any(line.split()[:2] == [what, f"{path}:"] for line in out.splitlines()), (what, path, out)
    assert "payload is 924 bytes, header says 1024" in out and "MISMATCH" in out
    assert str(live) not in out  # a live writer's file is nobody's problem
    assert flipped.exists() and stray.exists()  # --verify changes nothing

    code, out = inspect(env, "--repair")
    assert code == 0 and "repaired: removed damaged" in out and "repaired: account" in out
    assert not flipped.exists() and not short.exists() and not unsigned.exists()
    assert not os.path.exists(crashed) and not stray.exists() and not l3_entry.exists()
    assert os.path.exists(live)
    code, out = inspect(env, "--verify", "--json")  # the live claim is counted on both sides
    report = json.loads(out)
    assert code == 0, out
    assert all(not ns["problems"] for tier in report for ns in tier["namespaces"]), out
    assert all(t["usage_file"] == t["counted"] for t in report if t["usage_file"] is not None)
    os.unlink(live)
    # the repaired folders are a working cache: every entry left loads, the bounds hold
    store = writer_store(cfg, NS)
    gone = {flipped.name, short.name, unsigned.name} & {l3_entry.name}  # every copy removed
    assert [k for k in keys if store.get(k, promote=False) is None] == sorted(gone)
    assert store.check() is None
    store.close()


def test_bad_settings_exit_2(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "cache.tools.inspect"],
        env=env_for(tmp_path, KVCACHE_DISK_SIZE="lots"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "KVCACHE_DISK_SIZE" in run.stderr
