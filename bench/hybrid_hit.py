"""A sliding-window model's hit, side by side: vLLM's own prefix hit, our disk hit, recompute.

    flock /tmp/kvcache-engine.lock .venv/bin/python -m bench.hybrid_hit [--sizes 2048,4096] [--repeats 3]

Runs in the benchmark's process; one vLLM engine at a time in its own process
(``bench.ttft_engine``). The model is a generated random-weight Gemma 3 (sliding-window
and full-attention layers; vLLM's hybrid KV cache manager on), bigger than the tests'
one so a prefill takes a measurable time. One engine, our connector on a disk tier only
(DRAM off), ``KVCACHE_LOAD_DECISION`` as given (default ``cost``). Per prompt size, per
repeat, with a fresh prompt:

- ``cold``: the first request (computes, stores on disk);
- ``vllm_hit``: the same prompt again, from vLLM's own prefix cache;
- ``disk_hit``: vLLM's prefix cache reset and the disk folder dropped from the page
  cache, the same prompt again: what our connector decides (load or recompute);
- ``recompute``: the same, with ``kvcache_load: false`` (the prompt computed again).

TTFT is the wall time of one ``max_tokens=1`` request. Reports medians and the ratios
disk_hit / vllm_hit and disk_hit / recompute, and how each disk_hit was served (tokens
loaded per tier, or the explanation's cause). Writes ``hybrid_hit[_TAG].json`` and
``.md`` under ``bench/results/`` (``--tag``: before/after runs side by side).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# "small": the tests' model (tests.hybrid_models.GEMMA3: 3 sliding-window layers, window 256,
# 1 full; a prefill costs little next to a load's fixed costs); "medium": 10 sliding-window
# layers (window 512), 2 full, a prefill of seconds
SHAPES = {
    "small": None,
    "medium": {
        "hidden": 512,
        "heads": 4,
        "kv_heads": 2,
        "max_positions": 16384,
        "seed": 0,
        "layers": (["sliding_attention"] * 5 + ["full_attention"]) * 2,
        "sliding_window": 512,
        "head_dim": 128,
        "intermediate": 1024,
    },
}
SETTLE_S = 0.3


def median(xs):
    return statistics.median(xs) if xs else None


def served(r: dict) -> str:
    """How our connector served a request: tokens per tier, or the first cause computed."""
    params = r.get("kv_transfer_params") or {}
    loaded = params.get("kvcache_loaded_tokens")
    if loaded:
        return ",".join(f"{t}:{n}" for t, n in sorted(loaded.items()))
    causes = sorted({x.get("computed") for x in params.get("kvcache_explain") or [] if x.get("computed")})
    return "computed:" + "+".join(causes) if causes else "computed"


def run(args) -> dict:
    rows: dict[str, dict] = {}
    plans: dict[str, float] = {}
    shapes = {}
    t0 = time.perf_counter()
    for name in args.models.split(","):
        shapes[name] = run_model(args, name, rows, plans)
    return {
        "command": " ".join(["python -m bench.hybrid_hit", *sys.argv[1:]]),
        "shapes": shapes,
        "load_decision": args.load_decision,
        "sizes": args.sizes,
        "repeats": args.repeats,
        "rows": rows,
        "plans": plans,
        "seconds": round(time.perf_counter() - t0, 1),
        "cpus": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def run_model(args, name: str, rows: dict, plans: dict) -> dict:
    """One engine on the model ``name``: its rows (``model/size``) and metrics added."""
    from bench import pagecache, peers
    from bench.ttft_engine import EngineProcess
    from tests.hybrid_models import GEMMA3, ensure_gemma3

    shape = SHAPES[name] or GEMMA3
    model = str(ensure_gemma3(f"{args.model_path}-{name}", shape))
    shutil.rmtree(args.workdir, ignore_errors=True)
    disk = os.path.join(args.workdir, "disk")
    os.makedirs(disk)
    sizes = [int(x) for x in args.sizes.split(",")]
    kv = peers.ours(os.path.join(args.workdir, "shm"), "0", disk, "4GiB", load_decision=args.load_decision)
    spec = {"model": model, "dtype": "float32", "max_model_len": max(sizes) + 256, "kv_transfer": kv, "log_stats": True}
    env = {**peers.ENGINE_ENV, "VLLM_CPU_KVCACHE_SPACE": "2"}
    with EngineProcess(spec, os.path.join(args.workdir, "engine.log"), env=env) as e:

        def ttft(prompt, reset=False, load=True):
            time.sleep(SETTLE_S)
            extra = {} if load else {"kv_transfer_params": {"kvcache_load": False}}
            return e.call(op="ttft", prompt=prompt, reset=reset, **extra)

        warm = [random.Random(f"warm/{i}").randrange(256) for i in range(512)]
        ttft(warm), ttft(warm, reset=True)  # the engine's first requests (compile, allocate)
        for size in sizes:
            row = rows.setdefault(f"{name}/{size}", {k: [] for k in ("cold", "vllm_hit", "disk_hit", "recompute")})
            row["disk_served"] = []
            for i in range(args.repeats):
                prompt = [random.Random(f"{args.salt}/{size}/{i}").randrange(256) for _ in range(size)]
                row["cold"].append(ttft(prompt)["seconds"])
                row["vllm_hit"].append(ttft(prompt)["seconds"])
                time.sleep(args.settle_s)  # the write-behind lands
                pagecache.drop(disk)
                r = ttft(prompt, reset=True)
                row["disk_hit"].append(r["seconds"])
                row["disk_served"].append(served(r))
                pagecache.drop(disk)
                row["recompute"].append(ttft(prompt, reset=True, load=False)["seconds"])
                print(
                    f"  {name} {size:6d} #{i}: cold {row['cold'][-1] * 1e3:.0f} ms, vllm hit "
                    f"{row['vllm_hit'][-1] * 1e3:.0f} ms, disk hit {r['seconds'] * 1e3:.0f} ms "
                    f"({row['disk_served'][-1]}), recompute {row['recompute'][-1] * 1e3:.0f} ms",
                    flush=True,
                )
        metrics = e.call(op="metrics")["metrics"]
    for key, row in rows.items():
        if key.startswith(name + "/"):
            m = {k: median(row[k]) for k in ("cold", "vllm_hit", "disk_hit", "recompute")}
            row["median_s"] = m
            row["disk_over_vllm_hit"] = m["disk_hit"] / m["vllm_hit"]
            row["disk_over_recompute"] = m["disk_hit"] / m["recompute"]
    plans.update(
        {
            f"{name}: {k}": v
            for k, v in metrics.items()
            if k.startswith(("kvcache:requests_by_path", "kvcache:loads_total"))
        }
    )
    return shape


def markdown(result: dict) -> str:
    lines = [
        f"# A sliding-window model's hit{(' (' + result['tag'] + ')') if result.get('tag') else ''}",
        "",
        f"Command: `flock /tmp/kvcache-engine.lock .venv/bin/{result['command']}`",
        "",
        "Models: generated Gemma 3s, float32: "
        + "; ".join(f"{k}: {v}" for k, v in result["shapes"].items())
        + f". Our connector on a disk tier only, KVCACHE_LOAD_DECISION={result['load_decision']}; "
        f"{result['repeats']} fresh prompts a size, medians; {result['cpus']} CPUs, load avg "
        f"{result['loadavg_1m']} at end; {result['seconds']} s.",
        "",
        "| model/prompt | cold ms | vLLM prefix hit ms | our disk hit ms | recompute ms | disk / vLLM hit | "
        "disk / recompute | disk hits served |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for size, row in result["rows"].items():
        m = row["median_s"]
        lines.append(
            f"| {size} | {m['cold'] * 1e3:.0f} | {m['vllm_hit'] * 1e3:.0f} | {m['disk_hit'] * 1e3:.0f} | "
            f"{m['recompute'] * 1e3:.0f} | {row['disk_over_vllm_hit']:.2f} | "
            f"{row['disk_over_recompute']:.2f} | {'; '.join(row['disk_served'])} |"
        )
    lines += [
        "",
        "Requests by the cost model's path, loads: "
        + ", ".join(f"`{k}` {v:g}" for k, v in sorted(result["plans"].items())),
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="small,medium", help="comma list of: " + ",".join(SHAPES))
    p.add_argument("--sizes", default="2048,4096")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--load-decision", default="cost")
    p.add_argument("--settle-s", type=float, default=1.0, help="wait for the write-behind before a disk hit")
    p.add_argument("--salt", default="hybrid")
    p.add_argument("--tag", default="", help="suffix of the result files (hybrid_hit_TAG.json)")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    p.add_argument("--workdir", default="/tmp/kvbench-hybrid")
    p.add_argument("--model-path", default="/tmp/kvbench-hybrid-model")
    args = p.parse_args(argv)
    result = run(args)
    result["tag"] = args.tag
    name = "hybrid_hit" + (f"_{args.tag}" if args.tag else "")
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
