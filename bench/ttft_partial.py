"""TTFT of partial hits and of the shared tier's bandwidth sweep (issue 14 item 4).

``python -m bench.ttft_partial [--only partial-dram,partial-disk,partial-l3,sweep]
[--sweep-caps 1.8e9,4e8,1e8,2.5e7] [--sweep-size 4096] [bench_ttft options]`` (or
``--render [JSON]``: the report again from a saved run) writes
``ttft_partial.json`` and ``.md`` under ``bench/results/`` and bench/README.md's ``ttft_partial``
section. Runs in the benchmark's parent process, one engine subprocess at a time, with
``bench.bench_ttft``'s ``Bench`` helpers (model, prompts, timed requests, page-cache
drops, bandwidth floors):

- ``run_partial(bench, kind)``: a cached prefix of each size (1K/4K/8K) and a new suffix
  of 64 or 512 tokens, the prefix served by our ``kind`` tier (dram, disk, l3) with
  vLLM's prefix cache reset. Each sample is followed by the same prefix with another new
  suffix, the prefix from vLLM's own prefix cache (``suffix compute``: what computing
  the suffix alone costs in that engine). Floor: ``max(load, suffix compute)``, load =
  the prefix's KV bytes at the tier's bandwidth (memcpy, cold disk read, the cap).
- ``run_sweep(bench)``: the shared tier capped at each of ``--sweep-caps`` bytes/s (one
  engine per cap over one folder), a prompt of ``--sweep-size`` tokens served by it,
  alternated with the same prompt recomputed (our connector told not to load, prefix
  cache reset) and with the one-token l0. Floor: ``min(recompute, full load)``, full
  load = one-token l0 + KV bytes / cap. The cost model decides what each hit loads;
  every request's TTFT is also checked against its own recompute.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import time
from typing import Optional

from bench import bench_ttft, peers, readme

SUFFIXES = (64, 512)
PARTIAL_TARGET = 1.2  # partial hit <= 1.2 x max(load, suffix compute) (disk, l3)
SWEEP_TARGET = 1.1  # sweep: TTFT <= 1.1 x min(recompute, full load)


def _engine_config(bench, kind: str, tag: str, cap: Optional[float] = None) -> tuple[dict, str]:
    """Our connector with only the ``kind`` tier on; the folder its entries land in."""
    work, shm = bench.work, bench.shm
    if kind == "dram":
        folder = os.path.join(shm, f"{tag}-dram")
        return peers.ours(folder, bench.args.dram_size, os.path.join(work, f"{tag}-nodisk"), "0"), folder
    if kind == "disk":
        folder = os.path.join(work, f"{tag}-disk")
        return peers.ours(os.path.join(shm, f"{tag}-nodram"), "0", folder, bench.args.disk_size), folder
    folder = os.path.join(work, f"{tag}-l3")
    return peers.ours(
        os.path.join(shm, f"{tag}-unused"),
        "0",
        os.path.join(work, f"{tag}-unused"),
        "0",
        shared_url=f"file://{folder}",
        shared_admission="all",
        shared_bandwidth=str(int(cap or bench.args.l3_bandwidth)),
    ), folder


def loaded_tokens(r: dict) -> dict:
    return (r.get("kv_transfer_params") or {}).get("kvcache_loaded_tokens") or {}


def run_partial(bench, kind: str) -> None:
    """Partial hits served by tier ``kind`` (see the module docstring)."""
    kv, folder = _engine_config(bench, kind, "partial")
    tier = {"dram": "dram", "disk": "disk", "l3": "shared"}[kind]
    with bench.engine(f"partial-{kind}", kv) as e:
        for size in bench.sizes:
            prefix = bench.prompt(f"partial-{kind}", size)
            bench.ttft(e, prefix, reset=False)  # computed and stored
            if kind != "dram":
                bench.wait_stable(folder, quiet_s=2.0)
            for n in SUFFIXES:
                for i in range(1 + bench.hit_repeats):  # the first round is a warm-up
                    detail = bench.drop(folder, f"partial-{kind}", size) if kind == "disk" else {}
                    r = bench.ttft(e, prefix + bench.prompt(f"partial-{kind}-s{n}", n, i), reset=True)
                    got = loaded_tokens(r)
                    if set(got) - {tier}:
                        raise AssertionError(f"partial-{kind}: loaded from {got}, expected {tier} only")
                    r0 = bench.ttft(e, prefix + bench.prompt(f"partial-{kind}-l0-s{n}", n, i), reset=False, ours=False)
                    hit0 = bench.peer_hit(r0, size, "suffix compute")
                    if i:
                        bench.record(partial_row(kind, n), size, r, got.get(tier, 0), **detail)
                        bench.record(suffix_row(kind, n), size, r0, hit0)


def partial_row(kind: str, n: int) -> str:
    return f"partial-{kind} +{n}"


def suffix_row(kind: str, n: int) -> str:
    return f"suffix compute ({kind} engine) +{n}"


def run_sweep(bench) -> None:
    """The shared tier at each cap (see the module docstring)."""
    size = bench.args.sweep_size
    prompt = bench.prompt("sweep", size)
    stored = False
    bench.sweep_metrics = {}
    for cap in bench.args.sweep_caps:
        kv, folder = _engine_config(bench, "l3", "sweep", cap)
        with bench.engine(f"sweep-{cap / 1e6:.0f}MBps", kv, log_stats=True) as e:
            # warm-up, which also gives the cost model its first measurements: a cold
            # prefill, then a hit of it through this cap
            warm = bench.prompt(f"sweep-warm-{cap:.0f}", size)
            bench.ttft(e, warm, reset=False)
            if not stored:
                bench.ttft(e, prompt, reset=False)
                stored = True
            bench.wait_stable(folder, quiet_s=2.0)
            bench.ttft(e, warm, reset=True)
            bench.ttft(e, warm, reset=True)
            before = e.call(op="metrics")["metrics"]
            for _ in range(bench.hit_repeats):
                r = bench.ttft(e, prompt, reset=True)
                bench.record(
                    f"sweep {cap / 1e6:.0f} MB/s",
                    size,
                    r,
                    loaded_tokens(r).get("shared", 0),
                    cap=cap,
                    loaded=loaded_tokens(r),
                )
                rc = bench.ttft(e, prompt, reset=True, ours=False)
                bench.record(f"sweep recompute {cap / 1e6:.0f} MB/s", size, rc, rc["num_cached_tokens"], cap=cap)
                bench.one_token_l0(e, prompt, f"sweep l0 1-token {cap / 1e6:.0f} MB/s", size)
            after = e.call(op="metrics")["metrics"]
            bench.sweep_metrics[cap] = {
                k: v - before.get(k, 0.0)
                for k, v in after.items()
                if k.startswith(COST_METRICS) and v != before.get(k, 0.0)
            }


# The connector's metrics a sweep row keeps (deltas over its measured requests): what
# the cost model chose and its load estimates against the measured load times.
COST_METRICS = (
    "kvcache:requests_by_path",
    "kvcache:loads",
    "kvcache:load_seconds",
    "kvcache:load_estimated",
    "kvcache:loads_cut_short",
)


def load_estimates(metrics: dict) -> dict:
    """Per load (ms): the cost model's estimate and the measured time of the loads it
    estimated, from a sweep row's metric deltas; loads cut short at their deadline."""

    def total(prefix: str) -> float:
        return sum(v for k, v in metrics.items() if k.startswith(prefix))

    if not metrics:  # no metric came back (stat loggers off): nothing known
        return {}
    n = total("kvcache:loads_total")
    if not n:
        return {"loads": 0}
    return {
        "loads": int(n),
        "estimate_ms": total("kvcache:load_estimated_seconds_total") / n * 1e3,
        "actual_ms": total("kvcache:load_estimated_actual_seconds_total") / n * 1e3,
        "cut_short": int(total("kvcache:loads_cut_short_total")),
    }


# -- report ----------------------------------------------------------------------------
def _median(bench, name: str, size: int) -> Optional[float]:
    row = bench.rows.get((name, size))
    return row.median_ms if row is not None else None


def summarize(bench) -> dict:
    """The partial-hit and sweep tables (for the JSON and the markdown)."""
    partial = []
    for kind in ("dram", "disk", "l3"):
        for size in bench.sizes:
            for n in SUFFIXES:
                med = _median(bench, partial_row(kind, n), size)
                if med is None:
                    continue
                suffix = _median(bench, suffix_row(kind, n), size)
                row = bench.rows[(partial_row(kind, n), size)]
                b = bench.bandwidth.get(size) or {}
                bw = {
                    "dram": (b.get("dram") or {}).get("best"),
                    "disk": (b.get("disk") or {}).get("bytes_per_s"),
                    "l3": bench.args.l3_bandwidth,
                }[kind]
                load = size * bench.bytes_per_token / bw * 1e3 if bw else None
                floor = max(load, suffix) if load is not None and suffix is not None else None
                partial.append(
                    {
                        "tier": kind,
                        "prefix": size,
                        "suffix": n,
                        "median_ms": med,
                        "samples_ms": [s * 1e3 for s in row.samples_s],
                        "loaded": row.hit_tokens,
                        "suffix_compute_ms": suffix,
                        "load_ms": load,
                        "floor_ms": floor,
                        "vs_floor": med / floor if floor else None,
                        "target": PARTIAL_TARGET if kind != "dram" else None,
                    }
                )
    sweep = []
    size = getattr(bench.args, "sweep_size", None)
    for cap in getattr(bench.args, "sweep_caps", ()):
        tag = f"{cap / 1e6:.0f} MB/s"
        med = _median(bench, f"sweep {tag}", size)
        if med is None:
            continue
        recompute = _median(bench, f"sweep recompute {tag}", size)
        one = _median(bench, f"sweep l0 1-token {tag}", size)
        load = one + size * bench.bytes_per_token / cap * 1e3 if one is not None else None
        floor = min(x for x in (recompute, load) if x is not None) if recompute or load else None
        row = bench.rows[(f"sweep {tag}", size)]
        worst = max(s * 1e3 / recompute for s in row.samples_s) if recompute else None
        metrics = getattr(bench, "sweep_metrics", {}).get(cap, {})
        sweep.append(
            {
                "cap": cap,
                "size": size,
                "median_ms": med,
                "samples_ms": [s * 1e3 for s in row.samples_s],
                "loaded": row.hit_tokens,
                "recompute_ms": recompute,
                "full_load_ms": load,
                "floor_ms": floor,
                "vs_floor": med / floor if floor else None,
                "worst_vs_recompute": worst,
                "target": SWEEP_TARGET,
                "metrics": metrics,
                "load_estimates": load_estimates(metrics),
                "measured": measured_at(row),
            }
        )
    return {"partial": partial, "sweep": sweep}


def measured_at(row) -> dict:
    """When a row was measured (this run's end, UTC) and the machine's 1-minute load
    average at each of its samples (``bench_ttft.Bench.record``)."""
    return {
        "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "loadavg_1m": [d.get("loadavg_1m") for d in row.detail],
    }


def _f(x, spec=".1f") -> str:
    return "–" if x is None else format(x, spec)


def markdown(extra: dict) -> list[str]:
    lines = []
    if extra.get("partial"):
        lines += [
            "",
            "## Partial hits",
            "",
            "A cached prefix (prompt tokens) plus a new suffix; the prefix served by our tier, vLLM's "
            "prefix cache reset. Suffix compute: the same prefix from vLLM's prefix cache and another "
            "new suffix, measured alternately in the same engine. Floor = max(load, suffix compute), "
            "load = the prefix's KV bytes at the tier's bandwidth (memcpy, cold disk read, the L3 cap).",
            "",
            "| tier | prefix | suffix | median TTFT ms | min–max ms | tokens loaded | suffix compute ms "
            "| load ms | floor ms | TTFT / floor | target |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for r in extra["partial"]:
            met = (
                "–"
                if r["target"] is None or r["vs_floor"] is None
                else ("met" if r["vs_floor"] <= r["target"] else "**NOT met**")
            )
            lines.append(
                f"| {r['tier']} | {r['prefix']} | {r['suffix']} | {_f(r['median_ms'])} | "
                f"{_f(min(r['samples_ms']))}–{_f(max(r['samples_ms']))} | {min(r['loaded'])} | "
                f"{_f(r['suffix_compute_ms'])} | {_f(r['load_ms'])} | {_f(r['floor_ms'])} | "
                f"{_f(r['vs_floor'], '.2f')} | "
                f"{'≤ ' + str(r['target']) + ' ' + met if r['target'] else '–'} |"
            )
    if extra.get("sweep"):
        lines += [
            "",
            "## Shared-tier bandwidth sweep",
            "",
            "A repeated prompt served through the shared tier at each bandwidth cap "
            "(`KVCACHE_SHARED_BANDWIDTH`, one engine per cap); the cost model chooses what to load. "
            "Recompute: the same prompt with loading off, prefix cache reset, alternated with the hits. "
            "Full load = one-token l0 + KV bytes / cap. Worst / recompute: the slowest hit over the "
            "median recompute (no request should wait on the tier longer than recomputing). "
            "Load estimate / actual: per load of the measured hits, the cost model's estimate and the "
            "measured load time (`kvcache:load_estimated_seconds` and `kvcache:load_estimated_actual_"
            "seconds` over `kvcache:loads`; rows measured before these were recorded show –). "
            "Measured: the run's end (UTC) and the 1-minute load average over the hits.",
            "",
            "| cap MB/s | prompt | median TTFT ms | tokens loaded | recompute ms | full load ms "
            "| floor = min ms | TTFT / floor | worst / recompute | target | load estimate / actual ms "
            "| measured |",
            "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |",
        ]
        for r in extra["sweep"]:
            met = "–" if r["vs_floor"] is None else ("met" if r["vs_floor"] <= r["target"] else "**NOT met**")
            loaded = sorted(set(r["loaded"]))
            est = r.get("load_estimates") or {}
            when = r.get("measured") or {}
            loads = [x for x in when.get("loadavg_1m") or [] if x is not None]
            lines.append(
                f"| {r['cap'] / 1e6:,.0f} | {r['size']} | {_f(r['median_ms'])} | "
                f"{', '.join(map(str, loaded))} | {_f(r['recompute_ms'])} | {_f(r['full_load_ms'])} | "
                f"{_f(r['floor_ms'])} | {_f(r['vs_floor'], '.2f')} | {_f(r['worst_vs_recompute'], '.2f')} "
                f"| ≤ {r['target']} {met} | "
                + (
                    f"{_f(est.get('estimate_ms'))} / {_f(est.get('actual_ms'))}"
                    if est.get("loads")
                    else ("no load" if est else "–")
                )
                + " | "
                + (f"{when.get('utc', '?')}, load {min(loads):.1f}–{max(loads):.1f}" if loads else "–")
                + " |"
            )
    return lines


def readme_lines(extra: dict) -> list[str]:
    """Short form for bench/README.md: partial-hit and sweep ratios."""
    lines = []
    if extra.get("partial"):
        lines += [
            "",
            "Partial hits (prefix + new suffix), TTFT / max(load, suffix compute):",
            "",
            "| tier | prefix | +64 | +512 |",
            "| --- | ---: | ---: | ---: |",
        ]
        by = {(r["tier"], r["prefix"], r["suffix"]): r for r in extra["partial"]}
        for kind, size in sorted(
            {(r["tier"], r["prefix"]) for r in extra["partial"]},
            key=lambda x: (("dram", "disk", "l3").index(x[0]), x[1]),
        ):
            lines.append(
                f"| {kind} | {size} | "
                + " | ".join(_f((by.get((kind, size, n)) or {}).get("vs_floor"), ".2f") for n in SUFFIXES)
                + " |"
            )
    if extra.get("sweep"):
        lines += [
            "",
            "Shared-tier bandwidth sweep, TTFT / min(recompute, full load): "
            + ", ".join(f"{r['cap'] / 1e6:,.0f} MB/s {_f(r['vs_floor'], '.2f')}" for r in extra["sweep"])
            + ".",
        ]
    return lines


def _short(error: str) -> str:
    """An error's first line and the first line after it that names an exception."""
    lines = error.splitlines()
    cause = next((x.strip() for x in lines[1:] if "Error:" in x or "Exception:" in x), "")
    return " ".join(filter(None, (lines[0], cause)))


SCENARIOS = ("partial-dram", "partial-disk", "partial-l3", "sweep")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    p.add_argument("--only", default=",".join(SCENARIOS), help="comma list of: " + ",".join(SCENARIOS))
    p.add_argument("--sweep-caps", default="1.8e9,4e8,1e8,2.5e7", help="shared-tier caps, bytes/s")
    p.add_argument("--sweep-size", type=int, default=4096, help="prompt tokens of the sweep")
    own, rest = p.parse_known_args(argv)
    args = bench_ttft.parse_args(
        rest + ["--workdir", "/tmp/kvbench-partial", "--shmdir", "/dev/shm/kvbench-partial"]
        if "--workdir" not in rest
        else rest
    )
    args.only = [s for s in own.only.split(",") if s]
    unknown = set(args.only) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenarios {sorted(unknown)}")
    args.sweep_caps = [float(c) for c in own.sweep_caps.split(",") if c]
    args.sweep_size = own.sweep_size
    return args


def merge_saved(extra: dict, old: dict, only: list[str], sizes: list[int], caps: list[float]) -> dict:
    """This run's tables (``summarize``) with the saved rows it did not measure: partial
    rows of the tiers or prefix sizes not run, sweep rows of the caps not run."""
    partial = extra["partial"] + [
        r for r in old.get("partial", []) if f"partial-{r['tier']}" not in only or r["prefix"] not in sizes
    ]
    partial.sort(key=lambda r: (("dram", "disk", "l3").index(r["tier"]), r["prefix"], r["suffix"]))
    sweep = extra["sweep"] + [r for r in old.get("sweep", []) if "sweep" not in only or r["cap"] not in caps]
    sweep.sort(key=lambda r: -r["cap"])
    return {**extra, "partial": partial, "sweep": sweep}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--render"]:  # the report again from the saved JSON (no measurement)
        saved = argv[1] if len(argv) > 1 else os.path.join(bench_ttft.REPO, "bench", "results", "ttft_partial.json")
        with open(saved) as f:
            write_report(json.load(f), os.path.dirname(os.path.abspath(saved)))
        return 0
    args = parse_args(argv)
    t_start = time.perf_counter()
    bench = bench_ttft.fresh_bench(args)
    bench.max_model_len = max(args.sizes + [args.sweep_size]) + max(SUFFIXES) + 256  # prefix + suffix + output
    try:
        bench_ttft.log("floors: bandwidth of a memory copy and of a cold disk read, per prompt size")
        bench.measure_floors()
        for name in args.only:
            if name == "sweep":
                bench.scenario(name, lambda: run_sweep(bench))
            else:
                bench.scenario(name, functools.partial(run_partial, bench, name.split("-")[1]))
    finally:
        shutil.rmtree(args.shmdir, ignore_errors=True)
        shutil.rmtree(args.workdir, ignore_errors=True)
    extra = summarize(bench)
    saved = os.path.join(args.out, "ttft_partial.json")
    if os.path.exists(saved):  # a run of some scenarios, sizes or caps keeps the others' figures
        with open(saved) as f:
            extra = merge_saved(extra, json.load(f), args.only, args.sizes, args.sweep_caps)
    result = {
        "config": {
            "shape": args.shape,
            "dtype": bench_ttft.DTYPE,
            "bytes_per_token": bench.bytes_per_token,
            "sizes": args.sizes,
            "hit_repeats": args.hit_repeats,
            "sweep_caps": args.sweep_caps,
            "sweep_size": args.sweep_size,
            "l3_bandwidth": args.l3_bandwidth,
            "scenarios": args.only,
            "machine": f"{os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.1f} at end",
        },
        "bandwidth": bench.bandwidth,
        **extra,
        "errors": bench.errors,
        "timings_s": bench.timings,
        "wall_s": time.perf_counter() - t_start,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(saved, "w") as f:
        json.dump(result, f, indent=1)
    write_report(result, args.out)
    return 1 if bench.errors else 0


def write_report(result: dict, out: str) -> None:
    """``ttft_partial.md`` next to the JSON, and bench/README.md's section when ``out`` is
    the committed results folder."""
    cfg = result["config"]
    head = [
        "# TTFT of partial hits and of the shared tier's bandwidth sweep",
        "",
        f"Model: random-weight Llama, {cfg['shape']}, {cfg['dtype']}, {cfg['bytes_per_token']:,} KV "
        f"bytes/token; median of the samples after a warm-up round. The last run ("
        + (f"{', '.join(cfg['scenarios'])}; " if cfg.get("scenarios") else "")
        + f"{cfg['hit_repeats']} samples a row; machine: "
        f"{cfg['machine']}) took {result['wall_s'] / 60:.1f} min; rows it did not measure are kept "
        "from earlier runs.",
    ]
    md = "\n".join(head + markdown(result) + _errors(result)) + "\n"
    with open(os.path.join(out, "ttft_partial.md"), "w") as f:
        f.write(md)
    print(md)
    if os.path.abspath(out) == os.path.join(bench_ttft.REPO, "bench", "results"):
        readme.replace_section("ttft_partial", readme_section(result))


def _errors(result: dict) -> list[str]:
    return ["", "Errors in the last run: " + "; ".join(map(_short, result["errors"]))] if result["errors"] else []


def readme_section(result: dict) -> str:
    """bench/README.md's ``ttft_partial`` section from ``result``."""
    return "\n".join(
        ["Method and all figures: [bench/results/ttft_partial.md](results/ttft_partial.md)."]
        + readme_lines(result)
        + _errors(result)
    ).strip()


if __name__ == "__main__":
    sys.exit(main())
