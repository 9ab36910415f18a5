"""serving.cpu_binding on real processes: a tree shaped like the server's (the server, an
unbound engine core, a worker bound to its compute core with a helper of its own), moved
as the server moves it once vLLM has bound its workers."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from serving.cpu_binding import bind_off_compute_cores, descendants

CPUS = sorted(os.sched_getaffinity(0))

# The server: starts an engine core (unbound, two threads) and, under it, workers bound to
# the CPUs given (each starts an unbound helper of its own); prints the pids, then sleeps.
TREE = textwrap.dedent(
    """
    import os, subprocess, sys, threading, time
    role, arg = sys.argv[1], sys.argv[2]
    def child(*a):
        return subprocess.Popen([sys.executable, __file__, *a])
    kids = []
    if role == "server":
        kids = [child("core", arg)]
    elif role == "core":
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        kids = [child("worker", cpus) for cpus in arg.split("/") if cpus]
    elif role == "worker":
        every = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {int(c) for c in arg.split(",")})
        kids = [child("helper", "-")]
        os.sched_setaffinity(kids[0].pid, every)  # unbound, as a worker may start one
    time.sleep(600)
    """
)


def _tree(tmp_path, workers: str) -> tuple[subprocess.Popen, dict[str, list[int]]]:
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    server = subprocess.Popen([sys.executable, str(script), "server", workers], start_new_session=True)
    want = 1 + 2 * len([w for w in workers.split("/") if w])
    deadline = time.monotonic() + 60
    while len(pids := descendants(server.pid)) < want or _threads(pids[0]) < 2:
        assert time.monotonic() < deadline, pids
        time.sleep(0.05)
    time.sleep(0.3)  # each worker binds itself and its helper as it starts
    roles: dict[str, list[int]] = {"server": [server.pid]}
    for pid in pids:
        role = open(f"/proc/{pid}/cmdline").read().split("\0")[2]
        roles.setdefault(role, []).append(pid)
    return server, roles


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _masks(pid: int) -> set[frozenset[int]]:
    """The CPU masks of every thread of ``pid``."""
    return {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}


def _stop(server: subprocess.Popen) -> None:
    os.killpg(server.pid, 9)
    server.wait(10)


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs: one to compute on, one for the rest")
def test_the_server_and_its_engine_core_move_off_the_cores_workers_compute_on(tmp_path):
    compute, rest = frozenset(CPUS[:1]), frozenset(CPUS[1:])
    server, roles = _tree(tmp_path, ",".join(map(str, compute)))
    try:
        assert _masks(roles["core"][0]) == {frozenset(CPUS)}  # as vLLM leaves it
        assert bind_off_compute_cores(server.pid) == set(rest)
        assert _masks(server.pid) == _masks(roles["core"][0]) == {rest}  # every thread
        assert _masks(roles["worker"][0]) == {compute}
        assert _masks(roles["helper"][0]) == {frozenset(CPUS)}  # a worker's own: not ours to move
    finally:
        _stop(server)


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")
@pytest.mark.parametrize("workers", ["", "/".join(map(str, CPUS))], ids=["no-worker-bound", "workers-on-every-cpu"])
def test_nothing_moves_without_a_bound_worker_or_a_cpu_left_over(tmp_path, workers):
    """GPU machines and ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (no worker bound), or workers
    bound to every CPU between them (nowhere to move to)."""
    server, roles = _tree(tmp_path, workers)
    try:
        assert bind_off_compute_cores(server.pid) is None
        assert _masks(server.pid) == _masks(roles["core"][0]) == {frozenset(CPUS)}
    finally:
        _stop(server)


def test_on_a_gpu_build_nothing_moves(monkeypatch):
    """GPU workers are bound only with ``--numa-bind`` (each to its GPU's NUMA node), and the
    engine core belongs beside them then: the server never moves on a GPU build."""
    from vllm.platforms import current_platform

    from serving import cpu_binding

    called = []
    monkeypatch.setattr(cpu_binding, "bind_off_compute_cores", lambda *a: called.append(a) or {0})
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    assert cpu_binding.after_engine_start() is None and not called
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: True)
    assert cpu_binding.after_engine_start() == {0} and called == [()]
