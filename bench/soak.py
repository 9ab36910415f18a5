"""Soak test: N clients x M minutes of mixed requests against a real server.

Runs on the operator's machine (here, under the engine lock): starts ``python -m serving``
on the generated model (or attaches to ``--url``), then N client threads send, until the
time is up, a mix of the request shapes the server takes (OpenAI chat and completion,
TGI, streamed and not, on ``/invocations`` and ``/v1/...``) whose prompts share a few
long prefixes (system prompts, documents) so that the cache tiers are used. Meanwhile
it samples, every few seconds, the server's whole process tree (RSS, open file
descriptors, threads). It reports status counts, p50/p99 latency per shape, the
resource curves (a PNG) and the tier hits from ``/metrics``:

    .venv/bin/python -m bench.soak --clients 8 --minutes 3     # writes bench/results/soak.*

Exit status 1 when any request failed (a status >= 500 or a transport error).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
WARMUP_S = 30.0  # RSS is judged flat over what follows


def _text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return "".join(chr(97 + rng.randrange(26)) for _ in range(n))


PREFIXES = [_text(i, n) for i, n in enumerate((1400, 1100, 700, 300))]  # byte tokens each


def request(rng: random.Random) -> tuple[str, str, dict]:
    """``(shape, path, body)``: a shared prefix plus a short unique question."""
    prefix = rng.choice(PREFIXES)
    question = f" question {rng.randrange(10**9)}?"
    stream = rng.random() < 0.3
    kind = rng.choice(("chat", "completion", "tgi"))
    if kind == "chat":
        body = {
            "messages": [{"role": "system", "content": prefix}, {"role": "user", "content": question}],
            "max_tokens": rng.randint(1, 16),
            "stream": stream,
        }
        path = rng.choice(("/invocations", "/v1/chat/completions"))
    elif kind == "completion":
        body = {"prompt": prefix + question, "max_tokens": rng.randint(1, 16), "stream": stream}
        path = rng.choice(("/invocations", "/v1/completions"))
    else:
        body = {"inputs": prefix + question, "stream": stream, "parameters": {"max_new_tokens": rng.randint(1, 16)}}
        path = "/invocations"
    return kind + ("-stream" if stream else ""), path, body


class Client(threading.Thread):
    def __init__(self, url: str, seed: int, until: float, out: list) -> None:
        super().__init__(daemon=True)
        self.url, self.rng, self.until, self.out = url, random.Random(seed), until, out

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as c:
            while time.monotonic() < self.until:
                shape, path, body = request(self.rng)
                t0 = time.monotonic()
                try:
                    with c.stream("POST", path, json=body) as r:
                        r.read()
                    status = r.status_code
                except httpx.HTTPError as e:
                    status = f"error:{type(e).__name__}"
                self.out.append((t0, shape, status, time.monotonic() - t0))


def tree_sample(pid: int) -> dict:
    """RSS, fds and threads summed over a process and its descendants."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    rss = fds = threads = 0
    for p in procs:
        try:
            with p.oneshot():
                rss += p.memory_info().rss
                fds += p.num_fds()
                threads += p.num_threads()
        except psutil.Error:
            continue
    return {"rss_mib": rss / 2**20, "fds": fds, "threads": threads, "processes": len(procs)}


def tier_hits(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict = defaultdict(float)
    for m in re.finditer(r'^kvcache:tier_(hits|tokens_loaded)_total\{[^}]*tier="(\w+)"[^}]*\} (\S+)$', text, re.M):
        out[f"{m.group(1)} {m.group(2)}"] += float(m.group(3))
    for m in re.finditer(r'^sagemaker_invocations_total\{shape="(\w+)",status="(\d+)"\} (\S+)$', text, re.M):
        out[f"server counted {m.group(1)} {m.group(2)}"] += float(m.group(3))
    return dict(out)


def start_server(
    tmp: Path, overrides: dict | None = None, repo: Path = REPO, module: str = "serving"
) -> tuple[subprocess.Popen, str]:
    """``python -m serving`` on the generated model, logs in ``tmp/server.log``; ``overrides``:
    settings replacing the soak's (``bench.capacity`` uses its own); ``repo``: the source
    tree it runs (``bench.low_load`` compares another checkout's); ``module``: what runs in
    place of ``serving`` (``bench.timed_server``)."""
    from serving.default_model import ensure_model

    model = ensure_model(REPO / ".models" / "test-llama")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SAGEMAKER_", "SM_", "KVCACHE_", "HF_", "OPTION_"))}
    env.update(
        {
            "PYTHONPATH": str(repo),
            "SAGEMAKER_BIND_TO_PORT": str(port),
            "SAGEMAKER_BASE_DIR": str(tmp / "ml"),
            "SERVING_DEFAULT_MODEL_DIR": str(model),
            "SAGEMAKER_SESSIONS_PATH": str(tmp / "sessions"),
            "KVCACHE_DRAM_PATH": str(tmp / "dram"),
            "KVCACHE_DISK_PATH": str(tmp / "disk"),
            "KVCACHE_DRAM_SIZE": "64MiB",
            "KVCACHE_DISK_SIZE": "1GiB",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "SM_VLLM_MAX_MODEL_LEN": "4096",
            "SM_VLLM_ENFORCE_EAGER": "true",
            # vLLM's own prefix cache off: a shared prefix must come from our tiers
            "SM_VLLM_ENABLE_PREFIX_CACHING": "false",
        }
    )
    env.update(overrides or {})
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", module],
        cwd=repo,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}; see {tmp / 'server.log'}")
        try:
            if httpx.get(url + "/ping", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit("server not ready within 600 s")


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def summarize(samples: list, resources: list, hits: dict, args) -> dict:
    statuses = Counter(str(s) for _, _, s, _ in samples)
    by_shape: dict = defaultdict(list)
    for _, shape, status, dt in samples:
        if status == 200:
            by_shape[shape].append(dt)
    latency = {
        shape: {"n": len(v), "p50_ms": 1000 * statistics.median(v), "p99_ms": 1000 * percentile(v, 0.99)}
        for shape, v in sorted(by_shape.items())
    }
    after = [r for r in resources if r["t"] >= WARMUP_S]
    rss = [r["rss_mib"] for r in after]
    return {
        "clients": args.clients,
        "minutes": args.minutes,
        "requests": len(samples),
        "statuses": dict(statuses),
        "errors": sum(n for s, n in statuses.items() if not s.startswith(("2", "4"))),
        "latency": latency,
        "tier_hits": hits,
        "rss_mib_after_warmup": {"first": rss[0], "last": rss[-1], "min": min(rss), "max": max(rss)} if rss else {},
        "fds": [resources[0]["fds"], resources[-1]["fds"]] if resources else [],
        "threads": [resources[0]["threads"], resources[-1]["threads"]] if resources else [],
        "resources": resources,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = result["resources"]
    t = [x["t"] / 60 for x in r]
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    for ax, key, label in zip(axes, ("rss_mib", "fds", "threads"), ("RSS (MiB)", "open fds", "threads")):
        ax.plot(t, [x[key] for x in r])
        ax.set_ylabel(label)
        ax.axvline(WARMUP_S / 60, color="grey", lw=0.5, ls="--")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes (server process tree; dashed: end of warm-up)")
    fig.suptitle(f"soak: {result['clients']} clients x {result['minutes']} min, {result['requests']:,} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(result: dict) -> str:
    lines = [
        f"# Soak: {result['clients']} clients x {result['minutes']} min",
        "",
        f"{result['requests']:,} requests; statuses {result['statuses']}; errors (5xx, transport): {result['errors']}",
        "",
        "| shape | n | p50 ms | p99 ms |",
        "| --- | ---: | ---: | ---: |",
    ]
    for shape, v in result["latency"].items():
        lines.append(f"| {shape} | {v['n']:,} | {v['p50_ms']:.0f} | {v['p99_ms']:.0f} |")
    rss = result["rss_mib_after_warmup"]
    if rss:
        lines += [
            "",
            f"Server process tree after {WARMUP_S:.0f} s of warm-up: RSS {rss['first']:.0f} -> "
            f"{rss['last']:.0f} MiB (min {rss['min']:.0f}, max {rss['max']:.0f}); open fds "
            f"{result['fds'][0]} -> {result['fds'][1]}; threads {result['threads'][0]} -> "
            f"{result['threads'][1]} (whole run). Plot: soak.png.",
        ]
    lines += ["", "Tier counters at the end (`/metrics`):", ""]
    lines += [f"- {k}: {v:,.0f}" for k, v in sorted(result["tier_hits"].items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--url", help="an already running server (default: start one)")
    p.add_argument("--pid", type=int, help="with --url: the server's process id, to sample")
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "kvbench-soak"
    tmp.mkdir(parents=True, exist_ok=True)
    proc, url = (None, args.url) if args.url else start_server(tmp)
    if proc is None and args.pid is None:
        p.error("--url needs --pid (the server process to sample)")
    pid = proc.pid if proc else args.pid
    try:
        samples: list = []
        t0 = time.monotonic()
        until = t0 + args.minutes * 60
        clients = [Client(url, seed, until, samples) for seed in range(args.clients)]
        for c in clients:
            c.start()
        resources = []
        while time.monotonic() < until:
            resources.append({"t": time.monotonic() - t0, **tree_sample(pid)})
            time.sleep(args.sample_s)
        for c in clients:
            c.join(180)
        resources.append({"t": time.monotonic() - t0, **tree_sample(pid)})
        result = summarize(samples, resources, tier_hits(url), args)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "soak.png")
    text = report(result)
    (args.out / "soak.md").write_text(text)
    print(text)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
