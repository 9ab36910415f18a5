"""Clean-up of what a killed vLLM left, decided by what holds each file (``serving.leftovers``),
and engine processes that die with the process that started them (``die_with_parent``)."""

from __future__ import annotations

import _multiprocessing
import mmap
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from serving.leftovers import MIN_AGE_S, candidates, engine_ready, held, remove_leftovers, stale
from tests.conftest import REPO
from tests.test_server import start_server, stop_server


def _age(paths, seconds: float = MIN_AGE_S + 60) -> None:
    old = time.time() - seconds
    for p in paths:
        os.utime(p, (old, old), follow_symlinks=False)


def _wait(condition, timeout: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent that does not reap is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _group(pgid: int) -> list[int]:
    """Live processes of process group ``pgid``."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(name))
    return out


def test_files_nobody_holds_go_whatever_their_age_and_held_ones_stay(tmp_path):
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    dead = [shm / "psm_dead0001", shm / "sem.mp-dead", tmp / "vllm_dist_dead"]
    for p in dead:
        p.write_bytes(b"\0" * 4096)
    _age(dead[2:])  # a file store: only once past MIN_AGE_S
    young = [shm / "psm_young001", shm / "sem.mp-young"]  # a restart right after the kill
    for p in young:
        p.write_bytes(b"\0" * 100)
    dead_socket = tmp / str(uuid.uuid4())
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(dead_socket))
    s.close()  # the file stays, nobody is bound to it
    mapped = shm / "psm_live0001"  # a live process maps it
    mapped.write_bytes(b"\0" * 4096)
    renamed = shm / "sem.mp-renamed"  # mapped under another name, as sem_open does
    renamed.write_bytes(b"\0" * 32)
    live_socket = tmp / str(uuid.uuid4())  # a live process listens on it
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(live_socket))
    listener.listen()
    opened = tmp / "vllm_dist_open"  # a live process holds it open
    opened.write_bytes(b"x")
    starting = tmp / "vllm_dist_young"  # a file store an engine may be meeting through
    starting.write_bytes(b"x")
    other = [tmp / "not-ours.txt", shm / "kvcache"]
    other[0].write_text("x")
    other[1].mkdir()
    _age([mapped, renamed, live_socket, opened, *other])
    temp_name = shm / "sem.XXtemp"
    os.link(renamed, temp_name)
    with (
        open(mapped, "r+b") as f,
        mmap.mmap(f.fileno(), 4096) as m,
        open(opened, "rb"),
        open(temp_name, "r+b") as g,
        mmap.mmap(g.fileno(), 32) as sem,
    ):
        temp_name.unlink()  # mapped only as "sem.XXtemp (deleted)"
        m[0] = sem[0] = 1
        holders = held()
        assert {str(mapped), str(live_socket), str(opened)} <= holders.paths
        assert str(renamed) not in holders.paths and (renamed, renamed.stat()) in holders
        done = remove_leftovers(shm=str(shm), tmp=str(tmp))
    listener.close()
    assert sorted(done.paths) == sorted(str(p) for p in [*dead, *young, dead_socket])
    assert done.bytes == 3 * 4096 + 2 * 100
    for p in [mapped, renamed, live_socket, opened, starting, *other]:
        assert p.exists(), p
    # released now (the maps, the open file, the listener are closed): they go next time
    again = remove_leftovers(shm=str(shm), tmp=str(tmp))
    assert sorted(again.paths) == sorted(str(p) for p in (mapped, renamed, live_socket, opened))
    assert starting.exists()  # still young
    _age([starting])
    assert remove_leftovers(shm=str(shm), tmp=str(tmp)).paths == (str(starting),)


def test_candidates_pick_vllm_names_only(tmp_path):
    (tmp_path / "psm_1").write_text("x")
    (tmp_path / "vllm_dist_1").write_text("x")
    (tmp_path / "notes").write_text("x")
    found = candidates(shm=str(tmp_path), tmp=str(tmp_path), rpc=str(tmp_path))
    assert [p.name for p in found] == ["psm_1", "vllm_dist_1"]
    assert [p.name for p, _ in stale(found, held())] == ["psm_1"]  # the file store is too young
    assert len(stale(found, held(), now=time.time() + MIN_AGE_S + 1)) == 2


def test_a_semaphore_of_a_live_process_is_held_and_goes_once_it_is_killed():
    name = f"/mp-kvcache-test-{uuid.uuid4().hex[:8]}"
    path = Path(f"/dev/shm/sem.{name[1:]}")
    # multiprocessing's own call, without its resource tracker (which would unlink it)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import _multiprocessing, sys, time\n"
                f"s = _multiprocessing.SemLock(1, 1, 1, {name!r}, False)\n"
                "print('ready', flush=True)\n"
                "time.sleep(600)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert path.exists()
        assert stale([path], held()) == []
        holder.kill()
        holder.wait(30)
        assert [p for p, _ in stale([path], held())] == [path]
    finally:
        holder.kill()
        try:
            _multiprocessing.sem_unlink(name)
        except OSError:
            pass


def test_engine_ready_holds_the_file_stores_written_since_start(tmp_path):
    mine = tmp_path / "vllm_dist_mine"
    mine.write_bytes(b"x")
    older = tmp_path / "vllm_dist_older"
    older.write_bytes(b"x")
    _age([older], seconds=10 * 365 * 86400)  # before this process started
    _age([mine], seconds=0)
    engine_ready(shm=str(tmp_path / "none"), tmp=str(tmp_path), rpc=str(tmp_path / "none"))
    assert (mine, mine.stat()) in held()
    assert not older.exists()  # nobody's, and old: cleaned up right away
    _age([mine])
    assert remove_leftovers(shm=str(tmp_path / "none"), tmp=str(tmp_path)).paths == ()


CHILD = """
import multiprocessing, pathlib, sys, time
from cache.vllm.plugin import die_with_parent

def child(ask, ready):
    if ask:
        die_with_parent()
    pathlib.Path(ready).write_text("ready")
    time.sleep(600)

if __name__ == "__main__":
    p = multiprocessing.get_context("spawn").Process(target=child, args=(sys.argv[1] == "ask", sys.argv[2]))
    p.start()
    print(p.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("ask", [True, False])
def test_a_spawned_child_dies_with_its_parent_when_it_asks(tmp_path, ask):
    script, ready = tmp_path / "parent.py", tmp_path / "ready"
    script.write_text(CHILD)
    parent = subprocess.Popen(
        [sys.executable, str(script), "ask" if ask else "no", str(ready)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    child = int(parent.stdout.readline())
    try:
        _wait(ready.exists, what="the child to start")
        parent.kill()
        parent.wait(30)
        if ask:
            _wait(lambda: not _alive(child), what=f"child {child} to die with its parent")
        else:  # the test's premise: without the request the child outlives its parent
            assert _alive(child)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_parent_already_gone_ends_the_child_at_once():
    code = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "from cache.vllm.plugin import die_with_parent\n"
                "die_with_parent(2 ** 22 + 12345)\n"  # no such process: the parent died already
                "print('still here')\n"
            ),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert code.returncode == 1 and "still here" not in code.stdout, code
    assert "is gone: exiting" in code.stderr


@pytest.mark.engine
def test_kill_9_leftovers_go_at_the_restart_and_the_engine_dies_with_its_server(tmp_path, model_path):
    """Restarted by the test process, alive and older than every file (the parent whose
    age made the old rule keep everything): a server killed with its whole process group
    mid-request (its resource tracker too: nothing unlinks its shared memory), then a
    server killed alone, as a supervisor or a container runtime kills its child."""
    before = set(candidates())
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    first = start_server(tmp_path / "a", model_path, {})
    try:
        assert any(p.name.startswith("psm_") for p in set(candidates()) - before)
        with first.client.stream(
            "POST", "/invocations", json={"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        ) as stream:
            next(stream.iter_lines())  # generating now
            os.killpg(first.proc.pid, signal.SIGKILL)  # start_server: it leads its own group
            first.proc.wait(30)
    except httpx.TransportError:
        pass
    finally:
        first.client.close()
    _wait(lambda: not _group(first.proc.pid), what="the killed group to end")
    left = [p for p in set(candidates()) - before if p.exists()]
    assert any(p.name.startswith("psm_") for p in left), f"nothing left to clean up: {left}"
    # The killed engine's file store: as if it had started a minute earlier (a file store
    # goes only once past MIN_AGE_S; that rule is tested above).
    _age([p for p in left if p.name.startswith("vllm_dist_")])
    second = start_server(tmp_path / "b", model_path, {})
    try:
        assert [p for p in left if p.exists()] == [], "leftovers survived the restart"
        lines = [line for line in second.log.read_text().splitlines() if "a killed vLLM left behind" in line]
        assert lines and " bytes " in lines[0], second.tail()
        mine = [p for p in set(candidates()) - before - set(left) if p.exists()]
        assert any(p.name.startswith("psm_") for p in mine)
        remove_leftovers()  # a live server's files: none goes
        assert [p for p in mine if not p.exists()] == []
        r = second.post({"prompt": "still serving", "max_tokens": 2})
        assert r.status_code == 200, r.text
        engines = [p for p in _group(second.proc.pid) if p != second.proc.pid]
        assert len(engines) >= 2, engines  # the engine core and its worker (and a resource tracker)
        os.kill(second.proc.pid, signal.SIGKILL)  # the main process alone
        second.proc.wait(30)
        _wait(
            lambda: not any(_alive(p) for p in engines),
            what=f"the engine processes to die with their server: {[p for p in engines if _alive(p)]}",
        )
    finally:
        stop_server(second)
    _age([p for p in candidates() if p.name.startswith("vllm_dist_") and p not in before])
    remove_leftovers()  # what the next start-up does
    holders = held()  # (other engines on this machine hold theirs)
    assert [p for p in set(candidates()) - before if p.exists() and (p, p.lstat()) not in holders] == []
