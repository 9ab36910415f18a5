"""Start-up clean-up of what a killed vLLM left: only files no live process holds."""

from __future__ import annotations

import mmap
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from serving.leftovers import (MIN_AGE_S, candidates, engine_family_starts, held_paths, remove_leftovers,
                               stale)
from tests.test_server import start_server, stop_server


def _age(paths, seconds: float = MIN_AGE_S + 60) -> None:
    old = time.time() - seconds
    for p in paths:
        os.utime(p, (old, old), follow_symlinks=False)


def _before_boot(paths) -> None:
    """As if written before any live process started (the killed server's files)."""
    with open("/proc/stat") as f:
        boot = next(float(line.split()[1]) for line in f if line.startswith("btime"))
    old = boot - 60
    for p in paths:
        os.utime(p, (old, old), follow_symlinks=False)


def test_only_unheld_old_files_of_ours_are_removed(tmp_path):
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    dead = [shm / "psm_dead0001", shm / "sem.mp-dead", tmp / "vllm_dist_dead"]
    for p in dead:
        p.write_bytes(b"\0" * 4096)
    dead_socket = tmp / str(uuid.uuid4())
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(dead_socket))
    s.close()                                   # the file stays, nobody is bound to it
    mapped = shm / "psm_live0001"               # a live process maps it
    mapped.write_bytes(b"\0" * 4096)
    live_socket = tmp / str(uuid.uuid4())       # a live process listens on it
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(live_socket))
    listener.listen()
    opened = tmp / "vllm_dist_open"             # a live process holds it open
    opened.write_bytes(b"x")
    young = shm / "psm_young001"                # just created: maybe about to be opened
    young.write_bytes(b"x")
    other = [tmp / "not-ours.txt", shm / "kvcache"]
    other[0].write_text("x")
    other[1].mkdir()
    _age([*dead, dead_socket, mapped, live_socket, opened, *other])
    with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 4096) as m, open(opened, "rb"):
        m[0] = 1
        assert {str(mapped), str(live_socket), str(opened)} <= held_paths()
        done = remove_leftovers(shm=str(shm), tmp=str(tmp), family_starts=[])
    listener.close()
    assert sorted(done.paths) == sorted(str(p) for p in [*dead, dead_socket])
    assert done.bytes == 3 * 4096
    for p in [mapped, live_socket, opened, young, *other]:
        assert p.exists(), p
    # released now (the map, the open file, the listener are closed): they go next time
    _age([mapped])  # writing through the map touched it
    # a live engine started before they were written may still need them by name
    assert remove_leftovers(shm=str(shm), tmp=str(tmp), family_starts=[time.time() - 3600]).paths == ()
    again = remove_leftovers(shm=str(shm), tmp=str(tmp), family_starts=[time.time()])
    assert sorted(again.paths) == sorted(str(p) for p in (mapped, live_socket, opened))
    assert young.exists()


def test_candidates_and_stale_pick_vllm_names_only(tmp_path):
    (tmp_path / "psm_1").write_text("x")
    (tmp_path / "vllm_dist_1").write_text("x")
    (tmp_path / "notes").write_text("x")
    found = candidates(shm=str(tmp_path), tmp=str(tmp_path), rpc=str(tmp_path))
    assert [p.name for p in found] == ["psm_1", "vllm_dist_1"]
    assert stale(found, set(), now=time.time()) == []             # too young
    assert len(stale(found, set(), now=time.time() + MIN_AGE_S + 1)) == 2


@pytest.mark.engine
def test_kill_9_leftovers_are_removed_by_the_next_server_and_a_live_ones_kept(tmp_path, model_path):
    before = set(candidates())
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    first = start_server(tmp_path / "a", model_path, {})
    try:
        pgid = os.getpgid(first.proc.pid)
        live = set(candidates()) - before
        assert any(p.name.startswith("psm_") for p in live), live
        # mid-request: a long generation is running when the whole process group dies
        busy = subprocess.Popen([sys.executable, "-c", (
            "import httpx,sys; httpx.post(sys.argv[1] + '/invocations', json={'prompt': 'x', "
            "'max_tokens': 2000, 'ignore_eos': True}, timeout=60)"), first.url])
        time.sleep(2)
        assert pgid != os.getpgid(0)  # the server leads its own group (start_server)
        os.killpg(pgid, signal.SIGKILL)
        first.proc.wait(30)
        busy.kill()
    finally:
        first.client.close()
    time.sleep(2)  # the engine processes notice their parent is gone
    held = held_paths()  # other engines on this machine (other tests) hold theirs
    left = [p for p in set(candidates()) - before if p.exists() and str(p) not in held]
    assert left, "kill -9 left nothing behind (nothing to test)"
    _before_boot(left)  # as if the restart came later, on a machine running nothing else
    second = start_server(tmp_path / "b", model_path, {})
    try:
        assert not [p for p in left if p.exists()], "leftovers survived the restart"
        assert "a killed vLLM left behind" in second.log.read_text()
        mine = [p for p in set(candidates()) - before if p.exists()]
        assert any(p.name.startswith("psm_") for p in mine)
        # Old enough to go (judged a minute from now, instead of waiting for it), but the
        # live server holds or may need every one: none would be removed.
        later = max(p.lstat().st_mtime for p in mine) + MIN_AGE_S + 1
        assert stale(mine, held_paths(), now=later, family_starts=engine_family_starts()) == []
        remove_leftovers()  # and today nothing of the live server's goes either
        assert [p for p in mine if not p.exists()] == []
        r = second.post({"prompt": "still serving", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        stop_server(second)
