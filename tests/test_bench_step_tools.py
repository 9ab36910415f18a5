"""The tools ``bench.low_load`` attributes a TTFT gap with: ``bench.step_timings`` (the
timed connector's step records, grouped by what each step carried) and ``bench.proc_cpu``
(CPU time per process and kernel-named thread of a server's session)."""

import json
import os
import subprocess
import sys
import threading
import time

from bench import proc_cpu, step_timings
from cache.threads import name_os_thread


def _step(loads: int, saves: int, span: float, save_ms: float = 0.0, layer_wait_ms: float = 0.0) -> dict:
    return {
        "event": "step",
        "loads": loads,
        "sync_loads": loads,
        "saves": saves,
        "tokens": 0,
        "pairs": 0.0,
        "start_load_ms": 0.0,
        "layer_wait_ms": layer_wait_ms,
        "save_ms": save_ms,
        "span_ms": span,
    }


def test_steps_are_grouped_by_what_they_carried_and_hooks_summed_per_turn(tmp_path):
    log = tmp_path / "t.jsonl"
    records = [_step(1, 2, 30.0, save_ms=2.0, layer_wait_ms=1.0), _step(0, 1, 20.0, save_ms=1.0)]
    records += [_step(0, 0, 2.0 + i) for i in range(10)]
    records.append({"event": "lookup", "ms": 1.0})  # other records are not steps
    log.write_text("\n".join(map(json.dumps, records)) + "\n")
    steps = step_timings.read_steps(log)
    assert len(steps) == 12
    s = step_timings.summarize(steps, turns=2)
    assert (s["load"]["steps"], s["save"]["steps"], s["neither"]["steps"]) == (1, 1, 10)
    assert s["load"]["span_p50_ms"] == 30.0 and s["save"]["save_ms"] == 1.0
    assert s["neither"]["span_p50_ms"] == 7.0 and s["neither"]["span_p90_ms"] == 11.0
    assert s["hooks_ms_per_turn"] == (2.0 + 1.0 + 1.0) / 2
    assert "steps with load" in "\n".join(step_timings.lines("ours", s))


def test_cpu_is_counted_per_process_and_named_thread_of_a_session():
    # A child in its own session: one thread named as the cache names its threads, busy
    # for 0.6 s, while its main thread sleeps.
    code = (
        "import threading, time\n"
        "from cache.threads import name_os_thread\n"
        "def busy():\n"
        "    name_os_thread('kvcache-write_0')\n"
        "    end = time.process_time() + 0.6\n"
        "    while time.process_time() < end: pass\n"
        "t = threading.Thread(target=busy); t.start(); t.join(); time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, cwd=os.getcwd())
    try:
        before = proc_cpu.snapshot(child.pid)
        deadline = time.monotonic() + 20
        used = 0.0
        while time.monotonic() < deadline and used < 0.5:
            time.sleep(0.2)
            after = proc_cpu.snapshot(child.pid)
            used = sum(v - before.get(k, 0.0) for k, v in after.items() if k[1] == "kvcache-write_0")
        assert used >= 0.5, after
        others = sum(v - before.get(k, 0.0) for k, v in after.items() if k[1] != "kvcache-write_0")
        assert others < 0.3  # the sleeping main thread
        assert not any(k[1] == "kvcache-write_0" for k in proc_cpu.snapshot(os.getsid(0)))  # other sessions'
        text = "\n".join(proc_cpu.lines("x", before, after, turns=1, seconds=1.0))
        assert "kvcache-write_0" in text
    finally:
        child.kill()
        child.wait()


def test_a_thread_names_itself_for_the_kernel():
    seen = {}

    def run():
        name_os_thread("kvcache-read_12345678")  # longer than the kernel keeps
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            seen["comm"] = f.read().strip()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen["comm"] == "kvcache-read_12"


def test_vllm_step_calls_are_timed_once_their_module_is_imported(tmp_path, monkeypatch):
    import types

    from bench import vllm_steps

    class Worker:
        def execute_model(self, x):
            time.sleep(0.02)
            return x + 1

    fake = types.ModuleType("kvbench_fake_worker")
    monkeypatch.setattr(vllm_steps, "TARGETS", {"kvbench_fake_worker": ("Worker", ("execute_model",))})
    log = tmp_path / "steps.jsonl"
    vllm_steps.start(str(log), wait_s=10)
    time.sleep(0.2)  # imported after the timer started, as vLLM's modules are
    fake.Worker = Worker
    monkeypatch.setitem(sys.modules, "kvbench_fake_worker", fake)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not getattr(Worker.execute_model, "kvbench_timed", False):
        time.sleep(0.05)
    t0 = time.perf_counter()
    assert [Worker().execute_model(i) for i in range(3)] == [1, 2, 3]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 3):
        time.sleep(0.1)
    rows = vllm_steps.summarize(str(log), turns=3, since=t0)
    assert len(rows) == 1 and "execute_model" in rows[0] and "3 calls" in rows[0], rows
    ms = [json.loads(line)["ms"] for line in log.read_text().splitlines()]
    assert len(ms) == 3 and all(20 <= m < 1000 for m in ms)
    assert vllm_steps.summarize(str(log), turns=3, since=time.perf_counter() + 1) == []  # outside the window


def test_a_forward_step_is_logged_with_what_it_carried_and_compared_per_token(tmp_path, monkeypatch):
    """``execute_model`` lines carry the step's scheduled tokens and requests, and
    ``by_size`` groups the steps by tokens and fits ``ms = a + b x tokens``: two runs whose
    steps differ only in size give the same line."""
    import types

    from bench import vllm_steps

    class Worker:
        def execute_model(self, scheduler_output):
            return scheduler_output.total_num_scheduled_tokens

    fake = types.ModuleType("kvbench_fake_worker2")
    monkeypatch.setattr(vllm_steps, "TARGETS", {"kvbench_fake_worker2": ("Worker", ("execute_model",))})
    log = tmp_path / "steps.jsonl"
    vllm_steps.start(str(log), wait_s=10)
    fake.Worker = Worker
    monkeypatch.setitem(sys.modules, "kvbench_fake_worker2", fake)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not getattr(Worker.execute_model, "kvbench_timed", False):
        time.sleep(0.05)
    out = types.SimpleNamespace(total_num_scheduled_tokens=40, num_scheduled_tokens={"a": 1, "b": 39})
    assert Worker().execute_model(out) == 40
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not log.exists():
        time.sleep(0.1)
    (line,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert (line["f"], line["tok"], line["n"]) == ("execute_model", 40, 2)

    made = tmp_path / "made.jsonl"  # steps of 1 ms + 10 us per token
    with open(made, "w") as f:
        for i, tok in enumerate([1, 4, 20, 100, 300, 1000] * 3):
            f.write(
                json.dumps({"p": "w", "f": "execute_model", "t": i, "ms": 1 + 0.01 * tok, "tok": tok, "n": 2}) + "\n"
            )
        f.write(json.dumps({"p": "w", "f": "sample_tokens", "t": 0, "ms": 50.0}) + "\n")  # not a forward step
    rows = vllm_steps.by_size(vllm_steps.forward_steps(str(made)))
    assert len(rows) == 6 and "1-8 " in rows[0] and "513-" in rows[4], rows
    assert "ms = 1.000 + 10.00 us x tokens" in rows[-1], rows
    assert "all 18 steps" in rows[-1]
    assert vllm_steps.by_size(vllm_steps.forward_steps(str(made), since=100)) == [
        "(no execute_model steps with token counts)"
    ]


def test_the_collectors_pauses_are_timed_per_generation(tmp_path):
    """``bench.vllm_steps`` also logs garbage-collector pauses (``gc0``..``gc2``): a process
    that collects shows them, with their durations."""
    log = tmp_path / "steps.jsonl"
    code = (
        "import gc, time\n"
        "from bench import vllm_steps\n"
        f"vllm_steps.start({str(log)!r}, wait_s=1)\n"
        "junk = [[i] for i in range(200000)]\n"
        "gc.collect()\n"
        "time.sleep(1.5)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=os.getcwd())
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    full = [r for r in rows if r["f"] == "gc2"]
    assert full and all(r["ms"] > 0 for r in full), rows
