"""Token hit ratio of every eviction policy against tier capacity: a Mooncake trace, and a
robustness grid over seeded workloads.

Runs offline on the CPU (``python bench/bench_policy.py [TRACE]`` from the repository
root: about 10 minutes for the Mooncake part, 30 more for the grid at ``--scale 0.6`` on
one core); nothing here touches a GPU, vLLM or the serving path. It replays
the trace through the same policy classes a tier uses (``cache.tools.replay``) at 1, 2, 5, 10
and 20 % of the trace's distinct blocks, for lru, arc, s3fifo, ours (the registry's
default) and three offline references: the optimum (belady, which knows *when* every
block is used next) and two rate oracles (which know only *how often*: ``rate-oracle``
every block's whole-trace use count, ``span-oracle`` also its first and last use; see
``cache.policy.offline``). The oracles bound what any policy learning from access history
could reach; the trace's arrival statistics (how regular each block's reuse gaps are)
say why the rest of Belady's lead cannot be learned. It writes:

- ``bench/results/policy.md``: the table (also printed), with the share of the
  LRU-to-Belady gap ours and the oracles close, the arrival statistics, chunk lookups per
  second measured in the same run, our policy's memory per tracked chunk, and ours with queue hints;
- ``bench/results/policy_hit_ratio.png``: hit ratio against capacity (matplotlib, Agg);
- ``bench/results/policy.json``: every number above;
- ``bench/results/policy_robustness.{md,json,png}``: the robustness grid
  (``bench/policy_grid.py``): every workload of ``cache.tools.workloads`` (at ``--scale``,
  seed ``--seed``) and the Mooncake trace x 1, 2, 5, 10, 20 %: lru, arc, s3fifo, ours and
  belady, ours' margin over the best classic, lookups/s; the worst margin goes to
  bench/README.md. ``--grid-only`` runs just this part.

Main numbers use no hints. The hinted column passes, before each request, the keys of
the requests that arrive within ``--hint-window-ms`` (default 1000 ms: requests that
land while one long prompt is being prefilled sit in the engine's waiting queue).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import policy_grid, readme  # noqa: E402
from bench.policy_memory import adaptive_cost, memory_per_chunk  # noqa: E402
from cache.policy import DEFAULT_POLICY  # noqa: E402
from cache.policy.panel import ExpertPanel  # noqa: E402
from cache.tools.replay import (  # noqa: E402
    capacity_for_fraction,
    load_trace,
    run,
)
from cache.tools.trace import distinct_blocks  # noqa: E402

DEFAULT_TRACE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")
if not DEFAULT_TRACE.exists():
    DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.20)
BASELINES = ("lru", "arc", "s3fifo")
ORACLES = ("rate-oracle", "span-oracle")


def reuse_regularity(requests, min_uses: int = 6) -> dict:
    """How predictable the *timing* of reuse is, from every block used at least
    ``min_uses`` times: the median over blocks of the coefficient of variation of its
    reuse gaps (in requests), and the correlation of consecutive log-gaps within a block
    (each block's mean log-gap removed). Poisson arrivals read 1 and 0: the time to the
    next use is then unrelated to the past, and only the rate can be learned. Bursty
    reuse (chat turns) reads well above 1 and positive."""
    uses: Dict[object, List[int]] = {}
    for i, r in enumerate(requests):
        for key in r.hash_ids:
            uses.setdefault(key, []).append(i)
    cvs: List[float] = []
    sxy = sxx = syy = 0.0
    for seq in uses.values():
        if len(seq) < min_uses:
            continue
        gaps = [b - a for a, b in zip(seq, seq[1:])]
        mean = sum(gaps) / len(gaps)
        var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
        cvs.append(var**0.5 / mean)
        logs = [math.log(g) for g in gaps]
        m = sum(logs) / len(logs)
        d = [x - m for x in logs]
        sxy += sum(a * b for a, b in zip(d, d[1:]))
        sxx += sum(a * a for a in d[:-1])
        syy += sum(b * b for b in d[1:])
    cvs.sort()
    return {
        "min_uses": min_uses,
        "blocks": len(cvs),
        "median_gap_cv": cvs[len(cvs) // 2] if cvs else float("nan"),
        "lag1_log_gap_corr": sxy / math.sqrt(sxx * syy) if sxx and syy else float("nan"),
    }


def gap_closed(ratio: Dict[str, List[float]], name: str) -> List[float]:
    """Share of the LRU-to-Belady distance that ``name`` covers, per capacity."""
    return [(o - lru) / (b - lru) if b > lru else 0.0 for o, lru, b in zip(ratio[name], ratio["lru"], ratio["belady"])]


def readme_section(payload: dict) -> str:
    """bench/README.md's statement of the policy result: hit ratios, the best baseline and the
    share of the LRU-to-Belady gap closed, per capacity."""
    ratio, ours = payload["token_hit_ratio"], payload["ours"]
    lines = [
        f"Token hit ratio on `{payload['trace']}` ({payload['requests']:,} requests; "
        "[bench/results/policy.md](results/policy.md)):",
        "",
        "| capacity | LRU | best of LRU, ARC, S3-FIFO | "
        f"`{ours}` | Belady (offline) | LRU→Belady gap closed | "
        "closed by rate-oracle / span-oracle (offline) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    og = payload["oracle_gap_closed"]
    for i, (f, cap) in enumerate(zip(payload["fractions"], payload["capacity_blocks"])):
        best = max(ratio[p][i] for p in ("lru", "arc", "s3fifo"))
        lines.append(
            f"| {f:.0%} ({cap:,} blocks) | {ratio['lru'][i]:.4f} | {best:.4f} | "
            f"{ratio[ours][i]:.4f} | {ratio['belady'][i]:.4f} | "
            f"{payload['gap_closed'][i]:.1%} | "
            f"{og['rate-oracle'][i]:.0%} / {og['span-oracle'][i]:.0%} |"
        )
    reg = payload["reuse_regularity"]
    lines += [
        "",
        "The rate oracles know how often each block is used, never when "
        "(whole-trace reuses per request; `span-oracle` also knows each block's first "
        "and last use): they show what knowing each block's popularity is worth, the "
        "most that frequency learned from access history could win. The rest of "
        "Belady's lead is timing, and in this trace timing is nearly memoryless: "
        "a block's reuse "
        f"gaps have a median coefficient of variation of {reg['median_gap_cv']:.2f} "
        "and consecutive gaps correlate at "
        f"{reg['lag1_log_gap_corr']:+.2f} (Poisson arrivals: 1 and 0).",
    ]
    if payload.get("robustness"):
        # saved before the summary moved to bench/README.md, its links were from the top
        lines += ["", payload["robustness"].replace("](bench/results/", "](results/")]
    return "\n".join(lines)


def write_readme(payload: dict) -> bool:
    """bench/README.md's ``bench_policy`` section from ``payload``; False when it has none."""
    return readme.replace_section("bench_policy", readme_section(payload))


def robustness(trace, trace_name: str, out: Path, scale: float, seed: int) -> str:
    """The robustness grid over every seeded workload plus the trace; writes
    ``policy_robustness.{md,json,png}`` under ``out``; returns bench/README.md's sentence."""
    policies = BASELINES + (DEFAULT_POLICY, "belady")
    traces = policy_grid.workload_traces(scale, seed)
    traces["mooncake"] = trace
    cells = policy_grid.grid_rows(traces, FRACTIONS, policies, progress=True)
    sizes = ", ".join(f"{name} {len(reqs):,}" for name, reqs in traces.items())
    note = (
        f"Workloads from `cache.tools.workloads` at scale {scale:g}, seed {seed} "
        f"(requests: {sizes}; `mooncake` is `{trace_name}`). Capacity = share of the "
        "workload's distinct 512-token blocks; token hit ratio as in "
        "[policy.md](policy.md); belady is the offline optimum. Regenerate with "
        f"`python bench/bench_policy.py --grid-only --scale {scale:g}`."
    )
    table = policy_grid.markdown(cells, policies, "Policy robustness: workload x capacity", note)
    out.mkdir(parents=True, exist_ok=True)
    (out / "policy_robustness.md").write_text(table)
    worst = min(cells, key=lambda c: c.margin())
    (out / "policy_robustness.json").write_text(
        json.dumps(
            {
                "scale": scale,
                "seed": seed,
                "cells": [c.as_dict() for c in cells],
                "worst_margin": worst.margin(),
                "worst_cell": [worst.workload, worst.fraction],
                "generated_unix": int(time.time()),
            },
            indent=2,
        )
        + "\n"
    )
    policy_grid.plot(cells, out / "policy_robustness.png", policies)
    print(table)
    return (
        f"Robustness ([bench/results/policy_robustness.md](results/policy_robustness.md), "
        f"[plot](results/policy_robustness.png)): over {len(traces)} workloads "
        f"(chat, agent chat, RAG, shared system prompt, scans into a hot set, a popularity "
        f"shift, and the Mooncake trace) x {len(FRACTIONS)} capacities, `{DEFAULT_POLICY}`'s "
        f"worst margin over the best of LRU, ARC and S3-FIFO is **{worst.margin():+.4f}** "
        f"({worst.workload} at {worst.fraction:.0%})."
    )


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE))
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--hint-window-ms", type=float, default=1000.0)
    ap.add_argument("--memory-chunks", type=int, default=50_000)
    ap.add_argument(
        "--scale", type=float, default=0.6, help="workload size for the robustness grid (1 = about 10,000 requests)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grid-only", action="store_true", help="only the robustness grid")
    ap.add_argument(
        "--render", action="store_true", help="only rewrite bench/README.md's policy section from the saved policy.json"
    )
    args = ap.parse_args(argv)
    if args.render:
        payload = json.loads((Path(args.out_dir) / "policy.json").read_text())
        if not write_readme(payload):
            print("bench/README.md has no policy section markers", file=sys.stderr)
            return 1
        print(readme_section(payload))
        return 0

    requests = load_trace(args.trace)
    robust = robustness(requests, Path(args.trace).name, Path(args.out_dir), args.scale, args.seed)
    if args.grid_only:
        saved = Path(args.out_dir) / "policy.json"
        if saved.exists():
            payload = json.loads(saved.read_text())
            payload["robustness"] = robust
            saved.write_text(json.dumps(payload, indent=2) + "\n")
            if Path(args.out_dir).resolve() == (ROOT / "bench" / "results").resolve():
                write_readme(payload)
        return 0
    distinct = distinct_blocks(requests)
    ours = DEFAULT_POLICY
    policies = BASELINES + (ours, "belady") + ORACLES
    caps = [capacity_for_fraction(requests, f) for f in FRACTIONS]

    ratio: Dict[str, List[float]] = {p: [] for p in policies}
    ratio[ours + "+hints"] = []
    lookups: Dict[str, int] = {p: 0 for p in policies}
    seconds: Dict[str, float] = {p: 0.0 for p in policies}
    for cap in caps:
        for p in policies:
            res = run(requests, p, cap)
            ratio[p].append(res.token_hit_ratio)
            lookups[p] += res.lookups
            seconds[p] += res.seconds
            print(f"  {p:>16} {cap:>6} blocks: {res.token_hit_ratio:.4f}", flush=True)
        res = run(requests, ours, cap, hint_window_ms=args.hint_window_ms)
        ratio[ours + "+hints"].append(res.token_hit_ratio)
    rate = {p: lookups[p] / seconds[p] for p in policies}
    gap = gap_closed(ratio, ours)
    oracle_gap = {p: gap_closed(ratio, p) for p in ORACLES}
    regularity = reuse_regularity(requests)
    best_base = [max(ratio[p][i] for p in BASELINES) for i in range(len(caps))]
    mem = memory_per_chunk(ours, args.memory_chunks)
    sampled_mem, experts_mem = adaptive_cost()

    lines = [
        f"# Eviction policies on `{Path(args.trace).name}`",
        "",
        f"{len(requests):,} requests, {distinct:,} distinct 512-token blocks. Token hit "
        "ratio = prompt tokens served from the tier / prompt tokens; a request hits the "
        "longest run of leading blocks present; capacity in blocks. "
        f"`{ours}` is the registry default (`cache/policy/prefix_adaptive.py`); belady is the "
        "offline optimum (evict the block used farthest in the future, bypass blocks "
        "used later than every resident one). No queue hints unless stated.",
        "",
        "| capacity | blocks | lru | arc | s3fifo | "
        f"**{ours}** | belady | ours - best baseline | LRU->Belady gap closed | "
        f"ours + hints ({args.hint_window_ms:g} ms) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for i, (f, cap) in enumerate(zip(FRACTIONS, caps)):
        lines.append(
            f"| {f:.0%} | {cap:,} | {ratio['lru'][i]:.4f} | {ratio['arc'][i]:.4f} | "
            f"{ratio['s3fifo'][i]:.4f} | **{ratio[ours][i]:.4f}** | "
            f"{ratio['belady'][i]:.4f} | {ratio[ours][i] - best_base[i]:+.4f} | "
            f"{gap[i]:.1%} | {ratio[ours + '+hints'][i]:.4f} |"
        )
    lines += [
        "",
        "## What access history could teach",
        "",
        "The rate oracles (offline, `cache/policy/offline.py`) know how often every block is "
        "used, never when: `rate-oracle` ranks blocks by their whole-trace reuses per "
        "request from first use to the end of the trace, `span-oracle` by reuses per "
        "request between first and last use, and drops a block after its last use. An "
        "online policy learns at best an estimate of these rates from the uses it has "
        "seen, so they show what frequency learned from history could win at most; the "
        "rest of Belady's lead is knowing when the next use comes.",
        "",
        f"| capacity | **{ours}** gap closed | rate-oracle | gap closed | span-oracle | gap closed |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for i, f in enumerate(FRACTIONS):
        lines.append(
            f"| {f:.0%} | **{gap[i]:.1%}** | {ratio['rate-oracle'][i]:.4f} | "
            f"{oracle_gap['rate-oracle'][i]:.1%} | {ratio['span-oracle'][i]:.4f} | "
            f"{oracle_gap['span-oracle'][i]:.1%} |"
        )
    lines += [
        "",
        f"Timing of reuse, over the {regularity['blocks']:,} blocks used at least "
        f"{regularity['min_uses']} times: median coefficient of variation of a block's "
        f"reuse gaps {regularity['median_gap_cv']:.2f}, correlation of consecutive "
        f"log-gaps within a block {regularity['lag1_log_gap_corr']:+.2f} (Poisson "
        "arrivals: 1 and 0, i.e. when the next use comes does not depend on the past).",
    ]
    lines += [
        "",
        "Chunk lookups per second (every chunk a replay asks the policy about, timed "
        "over the five capacities of this run, one CPython thread"
        f" on {platform.machine()}):",
        "",
        "| policy | chunk lookups/s |",
        "| --- | ---: |",
    ]
    lines += [f"| {p} | {rate[p]:,.0f} |" for p in policies]
    lines += [
        "",
        f"Memory of `{ours}` (tracemalloc, full tier, churning): up to "
        f"{ExpertPanel.SAMPLED_SLOTS:,} chunks of capacity its experts are simulated "
        f"exactly, every one holding every chunk: {mem:.0f} bytes per tracked chunk "
        f"(measured at {args.memory_chunks:,} chunks), at most "
        f"{mem * ExpertPanel.SAMPLED_SLOTS / 2**20:.0f} MiB. Beyond, the experts are "
        f"sampled: {sampled_mem:.0f} bytes per tracked chunk plus "
        f"{experts_mem / 2**20:.0f} MiB of experts, i.e. "
        f"{(sampled_mem * 10e6 + experts_mem) / 2**30:.2f} GiB for 10 million chunks.",
        "",
    ]
    table = "\n".join(lines)
    print(table)

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "policy.md").write_text(table)
    payload = {
        "trace": Path(args.trace).name,
        "requests": len(requests),
        "distinct_blocks": distinct,
        "fractions": list(FRACTIONS),
        "capacity_blocks": caps,
        "token_hit_ratio": ratio,
        "gap_closed": gap,
        "oracle_gap_closed": oracle_gap,
        "reuse_regularity": regularity,
        "ours": ours,
        "ours_minus_best_baseline": [o - b for o, b in zip(ratio[ours], best_base)],
        "chunk_lookups_per_s": rate,
        "bytes_per_tracked_chunk": mem,
        "sampled_bytes_per_tracked_chunk": sampled_mem,
        "sampled_experts_bytes": experts_mem,
        "hint_window_ms": args.hint_window_ms,
        "robustness": robust,
        "generated_unix": int(time.time()),
    }
    (out / "policy.json").write_text(json.dumps(payload, indent=2) + "\n")
    if out.resolve() == (ROOT / "bench" / "results").resolve() and write_readme(payload):
        print("bench/README.md: policy section updated")

    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [100 * f for f in FRACTIONS]
    styles = {
        "lru": "o-",
        "arc": "s-",
        "s3fifo": "^-",
        ours: "D-",
        "belady": "k--",
        "rate-oracle": "k:",
        "span-oracle": "k-.",
    }
    for p in policies:
        ax.plot(xs, ratio[p], styles[p], label=p, linewidth=2.2 if p == ours else 1.2)
    ax.plot(xs, ratio[ours + "+hints"], "D:", label=f"{ours} + queue hints", alpha=0.7)
    ax.set_xscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{x:g}%" for x in xs])
    ax.set_xlabel("tier capacity (share of the trace's distinct blocks)")
    ax.set_ylabel("token hit ratio")
    ax.set_title(f"{Path(args.trace).name}: {len(requests):,} requests")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "policy_hit_ratio.png", dpi=120)
    print(f"wrote {out / 'policy.md'}, {out / 'policy.json'}, {out / 'policy_hit_ratio.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
