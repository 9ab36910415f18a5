"""Capacity: how many simulated users one server serves at a TTFT SLO, per cache configuration.

Runs on the operator's machine (here, under the engine lock). For each configuration it
starts the real server (``python -m serving`` on the generated check model, one at a
time, vLLM's own prefix cache (L0) deliberately small), and for each workload
(``bench.capacity_workloads``: multi-turn chat, RAG, agent sessions) and each user count
of the sweep, N asyncio users send their sessions' turns with think time for a fixed
window, streamed through vLLM's own benchmark request function
(``vllm.benchmarks.lib.endpoint_request_func``: TTFT and inter-token gaps as vLLM's
benchmarks measure them). Answers have the asked length (``ignore_eos``, ``min_tokens``:
the random-weight model may answer end-of-sequence first). Two scrapes of ``/metrics``
around each point give the prompt tokens computed, hit in L0 and loaded per tier.

    flock /tmp/kvcache-engine.lock .venv/bin/python -m bench.capacity            # default scale
    flock /tmp/kvcache-engine.lock .venv/bin/python -m bench.capacity --quick    # smoke run
    ... --workloads chat --configs vllm-alone,ours,limit --users 8,16,32 --duration 90

Writes ``capacity.json``, ``capacity.md`` and ``capacity.png`` (TTFT p90 against users)
under ``--out`` (``bench/results``); a run into ``bench/results`` also rewrites its
summary in ``bench/README.md`` and the capacity panel of the Grafana dashboard
(``deploy/grafana/kvcache.json``: TTFT p90 against users, users at each SLO). Exit
status 1 when a configuration failed to start or no turn finished.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import capacity_stats as stats  # noqa: E402
from bench import host  # noqa: E402
from bench.capacity_workloads import Workload, workload  # noqa: E402

RESULTS = REPO / "bench" / "results"
CPU_BLOCK = 128  # vLLM's block size on the CPU build
MAX_MODEL_LEN = 8192
DTYPE_HELP = (  # (bench.low_load's too)
    "the check model's dtype in place of bfloat16 (vLLM's --dtype), e.g. float32 on a host "
    "without bfloat16 instructions, where bfloat16 runs on a slow path (bench.host says which)"
)

# name -> (what it is, settings on top of the common ones). Sizes are the check model's.
CONFIGS = {
    "vllm-alone": ("vLLM alone, L0 small", {"KVCACHE_ENABLED": "false"}),
    "ours": ("ours, DRAM 2 GiB + disk 8 GiB, L0 small", {"KVCACHE_DRAM_SIZE": "2GiB", "KVCACHE_DISK_SIZE": "8GiB"}),
    "ours-disk": ("ours, disk 8 GiB only, L0 small", {"KVCACHE_DRAM_SIZE": "0", "KVCACHE_DISK_SIZE": "8GiB"}),
    "ours-shared": (
        "ours, shared tier only (a local folder as KVCACHE_SHARED_URL, read at 1.8 GB/s), L0 small",
        {"KVCACHE_DRAM_SIZE": "0", "KVCACHE_DISK_SIZE": "0", "KVCACHE_SHARED_BANDWIDTH": "1800MB"},
    ),
    "limit": ("the limit: vLLM alone, L0 holding everything", {"KVCACHE_ENABLED": "false"}),
}


def run_host(dtype: str | None) -> str:
    """The host (``bench.host``) and, when ``--dtype`` replaced it, the check model's dtype."""
    return host.describe() + (f"; the check model in {dtype}" if dtype else "")


def server_env(config: str, work: Path, l0_tokens: int, limit_tokens: int, dtype: str | None = None) -> dict[str, str]:
    """The settings of ``config``'s server, on top of ``bench.soak``'s (the same model);
    ``dtype``: the model's (vLLM's ``--dtype``) in place of its own bfloat16."""
    _, extra = CONFIGS[config]
    tokens = limit_tokens if config == "limit" else l0_tokens
    env = {
        "KVCACHE_DRAM_PATH": str(work / "dram"),
        "KVCACHE_DISK_PATH": str(work / "disk"),
        "SM_VLLM_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "SM_VLLM_ENABLE_PREFIX_CACHING": "true",
        "SM_VLLM_NUM_GPU_BLOCKS_OVERRIDE": str(max(1, tokens // CPU_BLOCK)),
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, -(-tokens * 4096 * 2 // 2**30))),
        # one CPU binding for every configuration (issue 31 item 6; bench/peers.py)
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
        **extra,
    }
    if dtype:
        env["SM_VLLM_DTYPE"] = dtype
    if config == "ours-shared":
        env["KVCACHE_SHARED_URL"] = f"file://{work / 'shared'}"
    return env


async def one_turn(session, url: str, turn, model: str) -> dict:
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput, async_request_openai_completions

    req = RequestFuncInput(
        prompt=list(turn.prompt),
        api_url=f"{url}/v1/completions",
        prompt_len=len(turn.prompt),
        output_len=turn.answer_tokens,
        model=model,
        ignore_eos=True,
        extra_body={"min_tokens": turn.answer_tokens, "temperature": 0},
    )
    out = await async_request_openai_completions(req, session)
    return {
        "ok": out.success,
        "ttft": out.ttft,
        "itl": out.itl,
        "asked": turn.answer_tokens,
        "got": out.output_tokens or 0,
        "prompt": len(turn.prompt),
        "start": out.start_time,
        "error": out.error[-300:] if not out.success else "",
    }


async def user(session, url: str, model: str, wl: Workload, uid: int, salt: str, until: float, records: list) -> None:
    """One simulated user: sessions one after another until ``until`` (a turn under way
    then is finished and kept); a first pause drawn up to one think time spreads the start."""
    rng = random.Random(f"{salt}/{uid}/start")
    await asyncio.sleep(rng.uniform(0, wl.think_s))
    for turns in wl.sessions(uid, salt):
        for turn in turns:
            if time.perf_counter() >= until:
                return
            rec = await one_turn(session, url, turn, model)
            rec["end"] = time.perf_counter()
            records.append(rec)
            await asyncio.sleep(turn.think_s)
            if not rec["ok"]:
                break  # the conversation is dropped, as a client would


async def sweep_point(url: str, model: str, wl: Workload, users: int, duration: float, salt: str) -> dict:
    import aiohttp

    # vLLM's request function: imported before the clock starts (importing vLLM takes seconds)
    from vllm.benchmarks.lib.endpoint_request_func import async_request_openai_completions  # noqa: F401

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async with session.get(f"{url}/metrics") as r:
            before = stats.token_counters(await r.text())
        records: list = []
        t0 = time.perf_counter()
        await asyncio.gather(*(user(session, url, model, wl, u, salt, t0 + duration, records) for u in range(users)))
        seconds = time.perf_counter() - t0
        async with session.get(f"{url}/metrics") as r:
            after = stats.token_counters(await r.text())
    point = stats.summarize(records, seconds, stats.delta(before, after))
    point["seconds"] = seconds
    point["errors"] = sorted({r["error"] for r in records if not r["ok"]})[:5]
    return point


def run_config(config: str, args, work: Path) -> dict:
    """Start ``config``'s server, run every workload's sweep, stop it."""
    from bench.soak import start_server

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = server_env(config, work, args.l0_tokens, args.limit_tokens, args.dtype)
    t0 = time.perf_counter()
    proc, url = start_server(work, overrides=env)
    out = {"what": CONFIGS[config][0], "settings": env, "start_s": time.perf_counter() - t0, "workloads": {}}
    try:
        import httpx

        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        for wname in args.workloads:
            wl = workload(wname, think_s=args.think_s)
            points = {}
            for users in args.users:
                salt = f"{args.salt}-{wname}-{users}-"
                p = asyncio.run(sweep_point(url, model, wl, users, args.duration, salt))
                points[users] = p
                print(
                    f"{config} {wname} {users} users: TTFT p50/p90/p99 {p['ttft_p50']:.2f}/{p['ttft_p90']:.2f}/"
                    f"{p['ttft_p99']:.2f} s, {p['turns_per_min']:.0f} turns/min, {p['turns']} turns "
                    f"({p['failed']} failed, {p['short_answers']} short), computed {p['computed_tokens']:,.0f} "
                    f"of {p['prompt_tokens']:,.0f}, L0 {p['l0_tokens']:,.0f}, loaded {p['loaded_tokens']}",
                    flush=True,
                )
            out["workloads"][wname] = {"points": points, "users_at_slo": stats.users_at_slo(points, args.slo)}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except Exception:
            proc.kill()
    return out


METHOD = (
    "Method: one server (`python -m serving`, the generated check model) per configuration, one at "
    "a time; per workload and user count, N asyncio users send their sessions' turns (streamed "
    "`/v1/completions`, token-id prompts, `ignore_eos` + `min_tokens` so every answer has the asked "
    "length) with think time for a fixed window; turns under way at its end are finished and "
    "counted. TTFT and inter-token latency as vLLM's benchmark request function measures them; "
    "turns/min over the window; prompt tokens computed / hit in L0 / loaded per tier from the "
    "server's `/metrics` (vLLM's `prompt_tokens_by_source`, our `tier_tokens_loaded`) before and "
    "after. Users at SLO: the largest user count up to which every point meets it, and a linear "
    "interpolation to the first that does not. Workloads: `bench/capacity_workloads.py`."
)


def summary(result: dict) -> str:
    """The short summary for bench/README.md."""
    run = result["run"]
    slos = run.get("slos", [run["slo_s"]])
    lines = [
        f"Users served at a TTFT p90 SLO ({run['scale']}; "
        "[bench/results/capacity.md](results/capacity.md), [plot](results/capacity.png)):",
        "",
        "| workload | SLO | " + " | ".join(run["configs"]) + " |",
        "| --- | --- |" + " ---: |" * len(run["configs"]),
    ]
    for wname, configs in result["workloads"].items():
        for x in slos:
            cells = [
                stats.slo_text(stats.users_at_slo(configs[c]["points"], x)) if c in configs else "–"
                for c in run["configs"]
            ]
            lines.append(f"| {wname} | p90 <= {x:g} s | " + " | ".join(cells) + " |")
    return "\n".join(lines)


DASHBOARD_PANEL = "Capacity measured by the benchmark: TTFT p90 against users (bench/results/capacity.md)"


def dashboard_text(result: dict) -> str:
    """The markdown of the dashboard's capacity panel: per workload and configuration, TTFT
    p90 at each user count of the sweep and the users served at each SLO; what was run and
    on what, so an operator does not read it as a measurement of their deployment."""
    run = result["run"]
    slos = run.get("slos", [run["slo_s"]])
    lines = [
        f"Measured by `python -m bench.capacity` ({run['scale']}; started {run['started']}): "
        "the project's generated check model on its reference machine, not this deployment. "
        "Run the benchmark against your model and hardware for your own curve. Live: the panel "
        "*Capacity curve: TTFT p90 by requests in flight*."
    ]
    for wname, configs in result["workloads"].items():
        users = sorted({int(u) for c in configs.values() for u in c["points"]})
        lines += [
            "",
            f"**{wname}**: TTFT p90 (s) at each user count; users served at each SLO",
            "",
            "| configuration | "
            + " | ".join(f"{u} users" for u in users)
            + " | "
            + " | ".join(f"p90 <= {x:g} s" for x in slos)
            + " |",
            "| --- |" + " ---: |" * (len(users) + len(slos)),
        ]
        for cname, c in configs.items():
            pts = {int(u): pt for u, pt in c["points"].items()}
            cells = [f"{pts[u]['ttft_p90']:.2f}" if u in pts else "–" for u in users]
            cells += [stats.slo_text(stats.users_at_slo(c["points"], x)) for x in slos]
            lines.append(f"| {cname} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="chat,rag,agent")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--users", default=None, help="the sweep's user counts (default 8,16,32)")
    p.add_argument("--duration", type=float, default=None, help="seconds per sweep point (default 20)")
    p.add_argument("--think-s", type=float, default=None, help="think time (default: the workload's)")
    p.add_argument("--slo", default="2", help="TTFT p90 SLO in seconds; more, comma-separated, add columns")
    p.add_argument("--render", type=Path, help="rewrite the report, plot and summary from a saved JSON")
    p.add_argument("--dtype", help=DTYPE_HELP)
    p.add_argument("--l0-tokens", type=int, default=32768, help="vLLM's own prefix cache, tokens")
    p.add_argument("--limit-tokens", type=int, default=524288, help="the limit's L0, tokens")
    p.add_argument(
        "--quick", action="store_true", help="smoke run: chat, vllm-alone and ours, 2 and 4 users, 20 s (unless given)"
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "kvbench-capacity")
    args = p.parse_args(argv)
    if args.quick:
        args.workloads, args.configs = "chat", "vllm-alone,ours"
    args.users = args.users or ("2,4" if args.quick else "8,16,32")
    args.duration = args.duration or 20.0
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.configs = [c for c in args.configs.split(",") if c]
    for c in args.configs:
        if c not in CONFIGS:
            p.error(f"unknown configuration {c!r}; known: {', '.join(CONFIGS)}")
    for w in args.workloads:
        workload(w)  # ValueError names the known ones
    args.users = sorted({int(u) for u in args.users.split(",")})
    if not args.users or args.users[0] < 1 or args.duration <= 0:
        p.error("--users must be positive integers and --duration > 0")
    args.slos = [float(x) for x in args.slo.split(",")]
    args.slo = args.slos[0]
    args.salt = f"{time.time_ns():x}"
    return args


def write(result: dict, out: Path, failed: list[str], workdir: Path) -> None:
    """capacity.json, .md, .png under ``out``; the summary in bench/README.md and the
    dashboard's capacity panel when ``out`` is bench/results."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity.json").write_text(json.dumps(result, indent=1))
    text = stats.report(result)
    if failed:
        text += f"\nFailed to run: {', '.join(failed)} (logs under {workdir}).\n"
    (out / "capacity.md").write_text(text)
    if result["workloads"]:
        stats.plot(result, out / "capacity.png")
    print(text)
    if out.resolve() == RESULTS.resolve() and result["workloads"]:
        from bench.dashboard import set_text_panel
        from bench.readme import replace_section

        replace_section("capacity", summary(result))
        set_text_panel(DASHBOARD_PANEL, dashboard_text(result))


def main(argv=None) -> int:
    args = parse(argv)
    if args.render:
        result = json.loads(args.render.read_text())
        result["run"].update(slo_s=args.slo, slos=args.slos)
        write(result, args.out, [], args.workdir)
        return 0
    scale = (
        f"workloads {','.join(args.workloads)}; configurations {','.join(args.configs)}; users "
        f"{','.join(map(str, args.users))}; {args.duration:g} s per point; think time "
        f"{'per workload' if args.think_s is None else f'{args.think_s:g} s'}; L0 {args.l0_tokens:,} tokens "
        f"(limit {args.limit_tokens:,}); {run_host(args.dtype)}"
    )
    result = {
        "run": {
            "scale": scale,
            "method": METHOD,
            "slo_s": args.slo,
            "slos": args.slos,
            "configs": args.configs,
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
        "configs": {},
        "workloads": {},
    }
    failed = []
    for config in args.configs:
        try:
            c = run_config(config, args, args.workdir / config)
        except (Exception, SystemExit) as e:  # start_server exits on a dead server
            print(f"{config}: failed: {e}", flush=True)
            failed.append(config)
            continue
        result["configs"][config] = {k: v for k, v in c.items() if k != "workloads"}
        for wname, w in c["workloads"].items():
            result["workloads"].setdefault(wname, {})[config] = w
    write(result, args.out, failed, args.workdir)
    finished = sum(p["turns"] for w in result["workloads"].values() for c in w.values() for p in c["points"].values())
    return 1 if failed or not finished else 0


if __name__ == "__main__":
    sys.exit(main())
