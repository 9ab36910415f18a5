"""How close the live miss-ratio curves (``cache.curves``) are to exact replays::

    python -m bench.curves [--scale 1.0] [--fractions 0.02 0.1]

For the shared Mooncake trace (``/work/shared/traces``, skipped when absent) and three
seeded workloads (chat, rag, scan at ``--scale``), and a tier sized at each fraction of
the distinct blocks: the curve the server would export (the default policy, the default
sample: ``SLOTS``, ``MIN_SHIFT``), fed each request's blocks as the scheduler feeds its
chunks, against ``cache.tools.replay`` of the same policy at 0.5x, 1x and 2x that size.
Writes ``bench/results/curves.json`` and ``curves.md`` (the error, the sample rate, and
the curve's cost per chunk). CPU only; minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

from cache.curves import MIN_SHIFT, SLOTS, TierCurve, chunk_fingerprint
from cache.policy import DEFAULT_POLICY
from cache.tools.replay import run
from cache.tools.trace import block_tokens, distinct_blocks, load_trace
from cache.tools.workloads import generate

RESULTS = Path(__file__).resolve().parent / "results"
TRACE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")
WORKLOADS = ("chat", "rag", "scan")
CHECKED = (("0.5", 0.5), ("1", 1.0), ("2", 2.0))


def measure(name: str, requests, fraction: float, policy: str = DEFAULT_POLICY) -> dict:
    cap = max(1, int(fraction * distinct_blocks(requests)))
    curve = TierCurve("tier", cap, policy)
    chunks = 0
    t0 = time.perf_counter()
    for r in requests:
        curve.request([chunk_fingerprint(k) for k in r.hash_ids], block_tokens(r))
        chunks += len(r.hash_ids)
    cost_us = (time.perf_counter() - t0) / max(1, chunks) * 1e6
    got = curve.ratios()
    row = {
        "source": name,
        "fraction": fraction,
        "capacity_blocks": cap,
        "requests": len(requests),
        "chunks": chunks,
        "sample_rate": curve.rate,
        "cost_us_per_chunk": round(cost_us, 2),
        "curve": {k: round(v, 4) for k, v in got.items()},
        "exact": {},
        "error": {},
    }
    for label, m in CHECKED:
        exact = run(requests, policy, max(1, round(m * cap))).token_hit_ratio
        row["exact"][label] = round(exact, 4)
        row["error"][label] = round(got[label] - exact, 4)
    print(
        f"{name:>8} {fraction:4.0%} cap {cap:>6} rate 1/{1 / curve.rate:.0f}: "
        + "  ".join(f"{lab}x {got[lab]:.4f}/{row['exact'][lab]:.4f} ({row['error'][lab]:+.4f})" for lab, _ in CHECKED)
        + f"  {cost_us:.1f} us/chunk",
        flush=True,
    )
    return row


def markdown(result: dict) -> str:
    rows = result["rows"]
    worst = {lab: max(abs(r["error"][lab]) for r in rows) for lab in ("0.5", "2")}
    out = [
        "# Miss-ratio curves against exact replays",
        "",
        f"Policy `{result['policy']}`; sample: the largest miniature cache at most {result['slots']} "
        f"chunks, rate at most 1/{2 ** result['min_shift']}; workloads at scale {result['scale']} "
        f"(seed 0). Each cell: the curve's estimate / the exact replay at that size (error). "
        f"Made by `python -m bench.curves`.",
        "",
        f"**Worst absolute error: {worst['0.5']:.4f} at 0.5x, {worst['2']:.4f} at 2x** "
        f"(tests/test_curves.py allows 0.04 on smaller workloads).",
        "",
        "| source | tier | rate | 0.5x | 1x | 2x | us/chunk |",
        "| --- | ---: | ---: | --- | --- | --- | ---: |",
    ]
    for r in rows:
        cells = [f"{r['curve'][lab]:.3f} / {r['exact'][lab]:.3f} ({r['error'][lab]:+.3f})" for lab, _ in CHECKED]
        out.append(
            f"| {r['source']} | {r['fraction']:.0%} ({r['capacity_blocks']:,}) | "
            f"1/{1 / r['sample_rate']:.0f} | " + " | ".join(cells) + f" | {r['cost_us_per_chunk']} |"
        )
    return "\n".join(out) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.curves", description=__doc__.split("::")[0])
    p.add_argument("--scale", type=float, default=1.0, help="workload scale (1: ~10,000 requests)")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.02, 0.1])
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    sources = [("mooncake", load_trace(str(TRACE)))] if TRACE.exists() else []
    sources += [(w, generate(w, 0, args.scale)) for w in WORKLOADS]
    rows = [measure(name, reqs, f) for name, reqs in sources for f in args.fractions]
    result = {"policy": DEFAULT_POLICY, "slots": SLOTS, "min_shift": MIN_SHIFT, "scale": args.scale, "rows": rows}
    (args.out / "curves.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "curves.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
