"""Low load: our TTFT against vLLM alone's at a few users, rounds interleaved, with a profile.

Runs on the operator's machine (here, under the engine lock). Issue 31 item 3: with few
users and no L0 pressure the cache has nothing to load, so any TTFT it adds is its own
per-request and per-step overhead. On a noisy shared machine one run per configuration
says little: this runs ``--rounds`` rounds, each starting one server per configuration
(``bench.capacity``'s settings, one at a time, the order alternating round by round)
and sending the same conversations (``bench.capacity``'s users, chat by default) for
``--duration`` seconds. It prints each round's TTFT p50/p90/p99 and inter-token gaps
per configuration and their ratio to the first configuration's in the same round, then
the same over every round's turns pooled.

Every configuration's line comes with the CPU its server's processes and threads took
(``bench.proc_cpu``: per turn and in cores; the cache's threads carry their names).
``--timings DIR`` runs ours with ``bench.timed_connector`` and prints its engine steps
grouped by what they carried (``bench.step_timings``). ``ours-l0-limit`` (ours with the
limit's L0: nothing to load) splits ours' gap to the limit into what saving costs and what
loading costs; ``ours-off``, ``ours-nosave``, ``ours-copyonly`` and ``ours-nocopydown``
(``bench.off_connector``: the cache off, no save, saves copied then dropped, saves written
but nothing copied down to disk; the limit's L0) split that further.

``--profile DIR`` also samples every thread's Python stack in every server process
(``bench.stack_sampler``: py-spy cannot attach on this machine) and prints, per
configuration, samples per turn by process and thread, and where the cache's own code
(``cache/``) took them; the collapsed stacks stay under ``DIR/<config>-<round>/``.

    mkdir -p /tmp/base && git archive main | tar -x -C /tmp/base      # optional: a before
    flock /tmp/kvcache-engine.lock .venv/bin/python -m bench.low_load --users 8 --duration 45 --rounds 2 \
        --base /tmp/base --profile bench/out/prof
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import capacity, proc_cpu, step_timings, vllm_steps  # noqa: E402
from bench import capacity_stats as stats  # noqa: E402
from bench.capacity_workloads import workload  # noqa: E402

# ``--base DIR``: "ours" as another source tree runs it (e.g. ``git archive main``), for a
# before/after in the same rounds.
BASE = "ours-base"
# Ours with the limit's L0: nothing is ever loaded, so its gap to the limit is what saving
# and the connector's presence cost under load, and ours' gap to it what the loads cost.
UNLIMITED = "ours-l0-limit"
# Ours with parts switched off (bench.off_connector; KVBENCH_CONNECTOR of bench.timed_server),
# the limit's L0: "ours-off" the connector configured with the cache off (its gap to the limit
# is what vLLM's connector plumbing costs), "ours-nosave" no save copied or written,
# "ours-copyonly" each save copied on the forward thread, then dropped, "ours-nocopydown"
# saves written but nothing copied down to disk.
ABLATED = {"ours-off": "off", "ours-nosave": "nosave", "ours-copyonly": "copyonly", "ours-nocopydown": "nocopydown"}


async def run_users(url: str, model: str, wl, users: int, duration: float, salt: str) -> list[dict]:
    """The users of ``bench.capacity`` for ``duration`` seconds; their raw turn records."""
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import async_request_openai_completions  # noqa: F401

    records: list = []
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(
            *(capacity.user(session, url, model, wl, u, salt, t0 + duration, records) for u in range(users))
        )
    return records


def _stacks(folder: Path) -> dict[str, Counter]:
    """The sampler's counts so far, per process file."""
    out = {}
    for f in folder.glob("*.txt"):
        c: Counter = Counter()
        for raw in f.read_text().splitlines():
            stack, _, n = raw.rpartition(" ")
            c[stack] += int(n)
        out[f.stem] = c
    return out


def config_env(config: str, args, work: Path) -> dict[str, str]:
    """``config``'s server settings (``bench.capacity``'s): ``ours-base`` as ``ours``, the
    limit's L0 ``--limit-tokens`` (and ``ours-l0-limit``'s: ``ours`` with it), every other
    ``--l0-tokens``."""
    if config == UNLIMITED or config in ABLATED:
        name, l0 = "ours", args.limit_tokens
    else:
        name, l0 = ("ours" if config == BASE else config), args.l0_tokens
    return capacity.server_env(name, work, l0, args.limit_tokens, args.dtype)


def one(
    config: str,
    args,
    work: Path,
    salt: str,
    profile_to: Path | None,
    timing_to: Path | None = None,
    steps_to: Path | None = None,
) -> dict:
    """Start ``config``'s server, run the users (its processes sampled when ``profile_to``:
    ``bench.stack_sampler``; with the timed connector logging to ``timing_to``, if given and
    the cache is on), stop it; the turn records and the samples taken meanwhile."""
    import shutil

    import httpx

    from bench.soak import start_server
    from bench.stack_sampler import shim

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    base = config == BASE
    repo = args.base if base else REPO
    env = config_env(config, args, work)
    if profile_to is not None:
        shutil.rmtree(profile_to, ignore_errors=True)
        profile_to.mkdir(parents=True)
        env.update(
            PYTHONPATH=f"{shim(str(work / 'shim'))}:{REPO}:{repo}",  # (the server runs in repo)
            KVBENCH_STACKS=str(profile_to.resolve()),
        )
    if steps_to is not None:
        steps_to.unlink(missing_ok=True)
        env.update(
            PYTHONPATH=f"{vllm_steps.shim(str(work / 'steps-shim'))}:{REPO}:{repo}",
            KVBENCH_VSTEPS=str(steps_to.resolve()),
        )
    module = "serving"
    if config in ABLATED:
        env["KVBENCH_CONNECTOR"] = ABLATED[config]
        module = "bench.timed_server"
    elif timing_to is not None and config not in ("vllm-alone", "limit"):  # (a connector to time)
        timing_to.unlink(missing_ok=True)
        env["KVBENCH_TIMING_LOG"] = str(timing_to.resolve())
        module = "bench.timed_server"
    proc, url = start_server(work, overrides=env, repo=repo, module=module)
    before: dict = {}
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        if profile_to is not None:
            time.sleep(6)  # the sampler's counts up to now (start-up) are written
            before = _stacks(profile_to)
        cpu0, t0, client0 = proc_cpu.snapshot(proc.pid), time.perf_counter(), time.process_time()
        records = asyncio.run(run_users(url, model, workload(args.workload), args.users, args.duration, salt))
        t1 = time.perf_counter()
        cpu = (cpu0, proc_cpu.snapshot(proc.pid), t1 - t0, time.process_time() - client0)
        if steps_to is not None:
            time.sleep(1.5)  # (the timer writes every second)
        if profile_to is not None:
            time.sleep(6)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    samples = {}
    if profile_to is not None:
        after = _stacks(profile_to)
        samples = {k: after[k] - before.get(k, Counter()) for k in after}
    return {"records": records, "samples": samples, "cpu": cpu, "window": (t0, t1)}


def summary(records: list[dict]) -> dict:
    ok = [r for r in records if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    itl = [g for r in ok for g in r["itl"]]
    return {
        "turns": len(ok),
        "failed": len(records) - len(ok),
        **{f"ttft_p{q}": stats.percentile(ttft, q / 100) for q in (50, 90, 99)},
        **{f"itl_p{q}": stats.percentile(itl, q / 100) for q in (50, 90)},
    }


def line(name: str, s: dict, base: dict | None) -> str:
    text = (
        f"{name:12s} {s['turns']:4d} turns  TTFT p50/p90/p99 {s['ttft_p50'] * 1e3:6.1f} / "
        f"{s['ttft_p90'] * 1e3:6.1f} / {s['ttft_p99'] * 1e3:6.1f} ms  "
        f"ITL p50/p90 {s['itl_p50'] * 1e3:.2f} / {s['itl_p90'] * 1e3:.2f} ms"
    )
    if base is not None:
        text += "  ratio " + " / ".join(f"{s[k] / base[k]:.2f}" for k in ("ttft_p50", "ttft_p90", "ttft_p99"))
    return text


def profile_summary(config: str, samples: dict[str, Counter], turns: int, top: int = 20) -> str:
    """Per process: samples per thread; in the engine core, the cache's frames (``/cache/``,
    inclusive) per thread. Counts per turn, so configurations compare."""
    lines = [
        f"{config}: samples per turn ({turns} turns; one sample = 4 ms of a thread's wall time; a "
        "thread's total counts its idle waits too, a cache frame only while it runs or waits in it)"
    ]
    for proc, counts in sorted(samples.items()):
        threads: Counter = Counter()
        ours: Counter = Counter()
        for stack, n in counts.items():
            frames = stack.split(";")
            threads[frames[0]] += n
            seen = set()
            for f in frames[1:]:
                if "/cache/" in f and f not in seen:
                    seen.add(f)
                    ours[(frames[0], f.replace(str(REPO) + "/", ""))] += n
        if not threads:
            continue
        lines.append(f"  {proc}:")
        lines += [f"    {n / max(1, turns):8.2f}  {t}" for t, n in threads.most_common(3)]
        lines += [f"    {n / max(1, turns):8.2f}  {t[:24]:24s} {f}" for (t, f), n in ours.most_common(top)]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--configs",
        default="vllm-alone,ours",
        help=f"first: the baseline of the ratios; bench.capacity's, {UNLIMITED!r} or {', '.join(ABLATED)}",
    )
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--workload", default="chat")
    p.add_argument("--duration", type=float, default=90.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", help=capacity.DTYPE_HELP)
    p.add_argument("--l0-tokens", type=int, default=32768)
    p.add_argument("--limit-tokens", type=int, default=524288, help="the limit's L0, tokens (bench.capacity's)")
    p.add_argument(
        "--profile", type=Path, help="sample every server process's stacks (bench.stack_sampler) into this folder"
    )
    p.add_argument(
        "--timings",
        type=Path,
        help="run ours with bench.timed_connector, its log per configuration and round in this folder, "
        "and print its step timings (bench.step_timings)",
    )
    p.add_argument(
        "--steps",
        type=Path,
        help="time vLLM's own step calls in every configuration (bench.vllm_steps), logs in this folder",
    )
    p.add_argument("--base", type=Path, help=f"another source tree: adds {BASE!r}, ours as that tree runs it")
    p.add_argument("--json", type=Path, help="write every round's summaries here")
    p.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "kvbench-low-load")
    args = p.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    if args.base is not None and BASE not in configs:
        configs.insert(1, BASE)
    for c in configs:
        if (c == BASE and args.base is not None) or c == UNLIMITED or c in ABLATED:
            continue
        if c not in capacity.CONFIGS:
            p.error(f"unknown configuration {c!r}; known: {', '.join(capacity.CONFIGS)}")
    if args.profile and args.steps:
        p.error("--profile and --steps each need their own sitecustomize: one at a time")
    for folder in (args.profile, args.timings, args.steps):
        if folder:
            folder.mkdir(parents=True, exist_ok=True)
    machine = capacity.run_host(args.dtype)
    print(f"host: {machine}", flush=True)
    salt = f"{time.time_ns():x}"
    pooled: dict[str, list] = {c: [] for c in configs}
    forward: dict[str, list] = {c: [] for c in configs}  # execute_model steps, with --steps
    rounds = []
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        got = {}
        for c in order:
            prof = args.profile / f"{c}-{r}" if args.profile else None
            log = args.timings / f"{c}-{r}.jsonl" if args.timings else None
            steps = args.steps / f"{c}-{r}.jsonl" if args.steps else None
            res = one(c, args, args.workdir / c, f"{salt}-{r}-", prof, log, steps)
            got[c] = res["records"]
            pooled[c] += got[c]
            turns = sum(1 for x in got[c] if x["ok"])
            before, after, seconds, client = res["cpu"]
            print("\n".join(proc_cpu.lines(c, before, after, turns, seconds)), flush=True)
            print(f"  (the client, this process: {client / seconds:.2f} cores)", flush=True)
            if res["samples"]:
                print(profile_summary(c, res["samples"], turns), flush=True)
            if steps is not None:
                print(f"{c}: vLLM's step calls", *vllm_steps.summarize(str(steps), turns, *res["window"]), sep="\n")
                mine = vllm_steps.forward_steps(str(steps), *res["window"])
                forward[c] += mine
                print(f"{c}: the forward pass by step size", *vllm_steps.by_size(mine), sep="\n")
            if log is not None and log.exists():
                print("\n".join(step_timings.lines(c, step_timings.summarize(step_timings.read_steps(log), turns))))
        sums = {c: summary(got[c]) for c in configs}
        rounds.append(sums)
        print(f"round {r + 1} ({args.users} users, {args.duration:g} s, order {','.join(order)}):", flush=True)
        for c in configs:
            print("  " + line(c, sums[c], sums[configs[0]] if c != configs[0] else None), flush=True)
    total = {c: summary(pooled[c]) for c in configs}
    print(f"pooled over {args.rounds} rounds:")
    for c in configs:
        print("  " + line(c, total[c], total[configs[0]] if c != configs[0] else None))
    if args.steps:
        for c in configs:
            print(f"{c}: the forward pass by step size, pooled", *vllm_steps.by_size(forward[c]), sep="\n")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "host": machine,
                    "rounds": rounds,
                    "pooled": total,
                },
                indent=1,
            )
        )
    return 0 if all(total[c]["turns"] for c in configs) else 1


if __name__ == "__main__":
    sys.exit(main())
