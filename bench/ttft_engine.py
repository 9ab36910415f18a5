"""One vLLM engine as a subprocess that answers the benchmark's commands.

Runs in its own process (vLLM spawns its workers, so every engine configuration gets a
fresh interpreter, started by ``bench.bench_ttft`` through ``EngineProcess``). Reads
one JSON command per line on stdin and answers one JSON line on the file descriptor
given in argv (stdout and stderr stay free for vLLM's logs).

Commands::

    {"op": "ttft", "prompt": [ids], "reset": bool, "kv_transfer_params": {...}?}
        one request, max_tokens=1 (our connector reads ``kvcache_load: false``):
        {"seconds", "num_cached_tokens", "kv_transfer_params", "token_ids"}
    {"op": "batch", "prompts": [[ids]...], "max_tokens": N}   all submitted at once:
        {"seconds", "prompt_tokens", "output_tokens"}
    {"op": "reset"}                                     reset vLLM's prefix cache
    {"op": "metrics"}   our connector's Prometheus samples in this process (``kvcache:*``;
        the spec's ``log_stats`` must be true, or vLLM feeds no metric):
        {"metrics": {"name{labels}": value}}
    {"op": "quit"}

TTFT is the wall time of ``LLM.generate`` for one prompt with ``max_tokens=1``: the
scheduler's lookup, any load from an external cache, the prefill of what is left and
the first sampled token. Every row of the benchmark is measured this way.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _engine(spec: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs = dict(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        max_model_len=spec["max_model_len"],
        # Whole prompt in one step: the same for every row, and ExampleConnector only
        # saves what a request's first step computed.
        max_num_batched_tokens=spec["max_model_len"],
        enforce_eager=True,
        enable_prefix_caching=spec.get("prefix_caching", True),
        seed=0,
        disable_log_stats=not spec.get("log_stats", False),
    )
    if spec.get("kv_transfer"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer"])
    if spec.get("kv_events"):  # vLLM's KV events publisher (ours add the tiers' events)
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**spec["kv_events"])
    return LLM(**kwargs)


def kvcache_samples() -> dict[str, float]:
    """Our connector's metrics as vLLM's stat logger left them in this process's
    Prometheus registry (counters and gauges; ``_created`` samples left out)."""
    from prometheus_client import REGISTRY

    out = {}
    for metric in REGISTRY.collect():
        if not metric.name.startswith("kvcache:"):
            continue
        for s in metric.samples:
            if s.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("engine", "model_name"))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    reply = os.fdopen(int(sys.argv[2]), "w", buffering=1)
    from vllm import SamplingParams

    llm = _engine(spec)
    first = SamplingParams(max_tokens=1, temperature=0)
    reply.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        if op == "reset" or (op == "ttft" and cmd.get("reset")):
            if not llm.reset_prefix_cache():
                raise RuntimeError("reset_prefix_cache refused (requests still running?)")
        if op == "ttft":
            params = first
            if cmd.get("kv_transfer_params"):
                params = SamplingParams(
                    max_tokens=1, temperature=0, extra_args={"kv_transfer_params": cmd["kv_transfer_params"]}
                )
            t0 = time.perf_counter()
            out = llm.generate({"prompt_token_ids": cmd["prompt"]}, params, use_tqdm=False)[0]
            seconds = time.perf_counter() - t0
            answer = {
                "seconds": seconds,
                "num_cached_tokens": out.num_cached_tokens,
                "kv_transfer_params": out.kv_transfer_params,
                "token_ids": list(out.outputs[0].token_ids),
            }
        elif op == "batch":
            params = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0, ignore_eos=True)
            prompts = [{"prompt_token_ids": p} for p in cmd["prompts"]]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            answer = {
                "seconds": seconds,
                "prompt_tokens": sum(len(p) for p in cmd["prompts"]),
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            }
        elif op == "metrics":
            answer = {"metrics": kvcache_samples()}
        else:
            answer = {"ok": True}
        reply.write(json.dumps(answer) + "\n")


def _shm_segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("psm_")}
    except OSError:
        return set()


def _remove_orphaned_shm(names: set[str]) -> None:
    """Unlink shared-memory segments that appeared while our engine ran and that no
    process maps any more: vLLM's shutdown sometimes force-kills its engine core before
    it unlinks its message queues, which leaks 160-250 MB of /dev/shm per engine."""
    if not names:
        return
    mapped = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                text = f.read()
        except OSError:
            continue
        mapped |= {n for n in names if n in text}
    for name in names - mapped:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass


class EngineProcess:
    """Parent side: starts ``python -m bench.ttft_engine`` in its own process group and
    sends it commands. ``close`` ends the group (engine core and workers included)."""

    def __init__(
        self, spec: dict, log_path: str, env: Optional[dict] = None, wait: bool = True, start_timeout: float = 600
    ) -> None:
        self.log_path = log_path
        read_fd, write_fd = os.pipe()
        self._shm_before = _shm_segments()
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.ttft_engine", json.dumps(spec), str(write_fd)],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            pass_fds=(write_fd,),
            cwd=REPO,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": REPO, **(env or {})},
        )
        os.close(write_fd)
        self._reply = os.fdopen(read_fd, "r")
        self.started = time.perf_counter()
        self.start_seconds: Optional[float] = None
        if wait:
            self.wait_ready(start_timeout)

    def wait_ready(self, timeout: float = 600) -> None:
        """Block until the engine is up (vLLM start-up: tens of seconds)."""
        if self.start_seconds is None:
            try:
                self._read(timeout)
            except BaseException:
                self.close()
                raise
            self.start_seconds = time.perf_counter() - self.started

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([self._reply], [], [], 1.0)
            if ready:
                line = self._reply.readline()
                if line:
                    return json.loads(line)
            if self.proc.poll() is not None or (ready and not line):
                raise RuntimeError(f"engine process exited ({self.proc.poll()}):\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine gave no answer in {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-n:]).decode(errors="replace")
        except OSError:
            return ""

    def call(self, timeout: float = 600, **cmd) -> dict:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        return self._read(timeout)

    def close(self) -> None:
        from bench.peers import kill_group

        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        kill_group(self.proc)  # whatever vLLM left behind in the group
        self._reply.close()
        self._log.close()
        _remove_orphaned_shm(_shm_segments() - self._shm_before)

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    main()
