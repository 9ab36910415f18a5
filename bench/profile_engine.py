"""Where our connector's DRAM and disk hits spend their time inside a running engine.

    .venv/bin/python -m bench.profile_engine [--sizes 4096,8192] [--repeats 5]

Runs like ``bench.bench_ttft`` (one engine subprocess at a time) but with
``bench.timed_connector`` in place of ours, and pairs every hit with an l0 hit of the
same prompt. Prints, per tier and size, medians of: TTFT, paired l0, their difference
(what the hit costs over vLLM's own prefix cache), the scheduler's lookup, the load
(total, tier read, entry check, scatter; for disk also the I/O threads' read and check
per chunk, summed), and for disk the async round trip (load decided -> request scheduled).
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

from bench import pagecache, peers  # noqa: E402
from bench.bench_ttft import DTYPE, MODEL_SHAPE, Bench  # noqa: E402
from bench.ttft_engine import EngineProcess  # noqa: E402


def _events(path: str, start: int) -> list[dict]:
    with open(path) as f:
        f.seek(start)
        return [json.loads(line) for line in f if line.strip()]


def profile(tier: str, sizes: list[int], repeats: int, work: str, model: str) -> dict:
    log_path = os.path.join(work, f"timing-{tier}.jsonl")
    kv = (
        peers.ours(os.path.join(work, "shm" if tier == "disk" else "unused"), "0", work + "/disk", "4GiB")
        if tier == "disk"
        else peers.ours("/dev/shm/kvbench-profile-engine", "2GiB", work + "/unused", "0")
    )
    kv["kv_connector"] = "TimedTieredKVConnector"
    kv["kv_connector_module_path"] = "bench.timed_connector"
    kv["kv_connector_extra_config"]["timing_log"] = log_path
    spec = {"model": model, "dtype": DTYPE, "max_model_len": max(sizes) + 256, "kv_transfer": kv}
    out = {}
    rng = random.Random(time.time_ns())
    with EngineProcess(
        spec, os.path.join(work, f"engine-{tier}.log"), env={**peers.ENGINE_ENV, "VLLM_CPU_KVCACHE_SPACE": "2"}
    ) as e:
        for size in sizes:
            prompt = [rng.randrange(256) for _ in range(size)]
            e.call(op="ttft", prompt=prompt, reset=False)
            if tier == "disk":
                Bench.wait_stable(work + "/disk")
            rows = []
            for i in range(1 + repeats):
                if tier == "disk":
                    pagecache.drop(work + "/disk")
                time.sleep(0.3)
                mark = os.path.getsize(log_path) if os.path.exists(log_path) else 0
                r = e.call(op="ttft", prompt=prompt, reset=True)
                time.sleep(0.3)
                r0 = e.call(op="ttft", prompt=prompt, reset=False)
                loaded = (r.get("kv_transfer_params") or {}).get("kvcache_loaded_tokens")
                if loaded != {tier: size - 1}:
                    raise AssertionError(f"{tier} {size}: loaded {loaded}")
                if i == 0:
                    continue  # warm-up
                ev = _events(log_path, mark)
                load = [x for x in ev if x["event"] == "load"]
                io = [x for x in ev if x["event"] == "io_get"]
                rt = [x for x in ev if x["event"] == "scheduled_after_async_load"]
                look = [x for x in ev if x["event"] == "lookup" and x["tokens"]]
                rows.append(
                    {
                        "ttft": r["seconds"] * 1e3,
                        "l0": r0["seconds"] * 1e3,
                        "extra": (r["seconds"] - r0["seconds"]) * 1e3,
                        "lookup": sum(x["ms"] for x in look),
                        "load": sum(x["total_ms"] for x in load),
                        "read": sum(x["read_ms"] for x in load) + sum(x["read_ms"] for x in io),
                        "decode": sum(x["decode_ms"] for x in load) + sum(x["decode_ms"] for x in io),
                        "scatter": sum(x["scatter_ms"] for x in load),
                        "async_round_trip": rt[0]["ms"] if rt else 0.0,
                    }
                )
            out[size] = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
            kv_mib = (size - 1) * Bench.bytes_per_token_of(MODEL_SHAPE) / 2**20
            print(
                f"{tier} {size} tokens ({kv_mib:.0f} MiB), median of {repeats} (ms): "
                + ", ".join(f"{k} {v:.1f}" for k, v in out[size].items()),
                flush=True,
            )
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4096,8192")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tiers", default="dram,disk")
    p.add_argument("--workdir", default="/tmp/kvbench-profile-engine")
    p.add_argument("--model-path", default="/tmp/kvbench-ttft-model")
    args = p.parse_args(argv)
    from serving.default_model import ModelShape, ensure_model

    ensure_model(args.model_path, ModelShape(**MODEL_SHAPE))
    sizes = [int(x) for x in args.sizes.split(",")]
    result = {}
    try:
        for tier in args.tiers.split(","):
            shutil.rmtree(args.workdir, ignore_errors=True)
            os.makedirs(args.workdir)
            result[tier] = profile(tier, sizes, args.repeats, args.workdir, args.model_path)
    finally:
        shutil.rmtree("/dev/shm/kvbench-profile-engine", ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
