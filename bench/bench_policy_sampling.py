"""What miniature simulation costs ``prefix-adaptive`` in hit ratio, and what it saves in
time and memory.

Runs offline on the CPU (``python bench/bench_policy_sampling.py`` from the repository
root: about 15 minutes on one core); nothing here touches a GPU, vLLM or the serving path.
``prefix-adaptive`` simulates its experts exactly up to ``ExpertPanel.SAMPLED_SLOTS`` chunks
of capacity and on a spatial sample beyond (``cache.policy.panel``). This bench replays
seeded workloads (``cache.tools.workloads``) through the policy with the experts exact
and with them sampled down to a given number of sampled slots (the scaled capacity the
experts simulate), and writes ``bench/results/policy_sampling.{md,json}``:

- error: the token hit ratio with sampled experts minus the exact one, per workload and
  capacity, for a few numbers of sampled slots (rates 1/2 to 1/32): what
  ``SAMPLED_SLOTS`` is chosen from;
- scale: one workload scaled up until the capacity passes the default ``SAMPLED_SLOTS``,
  exact against default (sampled) and against sampling as deep as a 10-million-chunk
  tier's, with chunk lookups/s of each and of LRU;
- memory: bytes per tracked chunk, and the experts' fixed cost, with sampling active.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.policy_memory import adaptive_cost  # noqa: E402
from cache.policy.panel import ExpertPanel  # noqa: E402
from cache.policy.prefix_adaptive import PrefixAdaptivePolicy  # noqa: E402
from cache.tools.replay import replay, run  # noqa: E402
from cache.tools.trace import capacity_for_fraction  # noqa: E402
from cache.tools.workloads import generate  # noqa: E402

EXACT = 1 << 40
DEEP_SLOTS = 2048  # a rate near a 10-million-chunk tier's (1/128 at the default)


def sampled_run(requests, cap: int, slots: int):
    """``prefix-adaptive`` with its experts simulated exactly up to ``slots`` chunks."""
    p = PrefixAdaptivePolicy()
    p.panel.SAMPLED_SLOTS = slots
    res = replay(requests, p, cap, name=f"prefix-adaptive/{slots}")
    return res, p


def error_rows(workloads: List[str], scale: float, fractions: List[float], slots: List[int]) -> List[dict]:
    rows = []
    for name in workloads:
        requests = generate(name, 0, scale)
        for f in fractions:
            cap = capacity_for_fraction(requests, f)
            exact, pe = sampled_run(requests, cap, EXACT)
            row = {
                "workload": name,
                "fraction": f,
                "capacity_blocks": cap,
                "exact": exact.token_hit_ratio,
                "exact_leader": pe.leader,
                "sampled": {},
            }
            for s in slots:
                if s >= cap:
                    continue
                res, p = sampled_run(requests, cap, s)
                row["sampled"][s] = {
                    "ratio": res.token_hit_ratio,
                    "rate": p.panel.rate,
                    "leader": p.leader,
                    "switches": p.switches,
                }
            print(
                f"  {name:>14} {f:4.0%} cap {cap:>6}: exact {exact.token_hit_ratio:.4f} "
                + " ".join(f"{s}:{v['ratio'] - row['exact']:+.4f}" for s, v in row["sampled"].items()),
                flush=True,
            )
            rows.append(row)
    return rows


def scale_row(name: str, scale: float, fraction: float) -> dict:
    requests = generate(name, 0, scale)
    cap = capacity_for_fraction(requests, fraction)
    exact, _ = sampled_run(requests, cap, EXACT)
    sampled, p = sampled_run(requests, cap, ExpertPanel.SAMPLED_SLOTS)
    deep, pd = sampled_run(requests, cap, DEEP_SLOTS)
    lru = run(requests, "lru", cap)
    row = {
        "workload": name,
        "scale": scale,
        "fraction": fraction,
        "capacity_blocks": cap,
        "rate": p.panel.rate,
        "exact": exact.token_hit_ratio,
        "sampled": sampled.token_hit_ratio,
        "lru": lru.token_hit_ratio,
        "deep_rate": pd.panel.rate,
        "deep": deep.token_hit_ratio,
        "lookups_per_s": {
            "exact": exact.lookups_per_s,
            "sampled": sampled.lookups_per_s,
            "deep": deep.lookups_per_s,
            "lru": lru.lookups_per_s,
        },
    }
    print(
        f"  {name} x{scale} {fraction:.0%} cap {cap}: exact {exact.token_hit_ratio:.4f} "
        f"sampled {sampled.token_hit_ratio:.4f} (rate 1/{1 / p.panel.rate:.0f}); lookups/s "
        f"exact {exact.lookups_per_s:,.0f} sampled {sampled.lookups_per_s:,.0f} "
        f"lru {lru.lookups_per_s:,.0f}",
        flush=True,
    )
    return row


def markdown(rows: List[dict], big: dict, mem: float, experts: float, slots: List[int], scale: float) -> str:
    lines = [
        "# prefix-adaptive: exact against sampled experts",
        "",
        f"Workloads from `cache.tools.workloads` at scale {scale}, seed 0. Each cell: "
        "token hit ratio with the experts simulated exactly, and the difference with "
        "them simulated on a spatial sample whose scaled capacity is at most the "
        "column's number of sampled slots (rate 2^-k; blank where the capacity is "
        "below it, i.e. still exact). Regenerate with "
        "`python bench/bench_policy_sampling.py`.",
        "",
        "| workload | capacity | blocks | exact | " + " | ".join(f"{s:,} slots" for s in slots) + " |",
        "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in slots) + " |",
    ]
    worst: Dict[int, float] = {}
    for r in rows:
        cells = []
        for s in slots:
            v = r["sampled"].get(s)
            if v is None:
                cells.append("")
                continue
            d = v["ratio"] - r["exact"]
            worst[s] = min(worst.get(s, 0.0), d)
            cells.append(f"{d:+.4f} (1/{1 / v['rate']:.0f})")
        lines.append(
            f"| {r['workload']} | {r['fraction']:.0%} | {r['capacity_blocks']:,} | "
            f"{r['exact']:.4f} | " + " | ".join(cells) + " |"
        )
    lines += [
        "",
        "Worst difference per number of sampled slots: "
        + ", ".join(f"{s:,}: {w:+.4f}" for s, w in sorted(worst.items()))
        + ".",
        "",
        f"At scale: `{big['workload']}` x{big['scale']} at {big['fraction']:.0%} "
        f"({big['capacity_blocks']:,} blocks, default {ExpertPanel.SAMPLED_SLOTS:,} sampled "
        f"slots: rate 1/{1 / big['rate']:.0f}): token hit ratio exact {big['exact']:.4f}, "
        f"sampled {big['sampled']:.4f} ({big['sampled'] - big['exact']:+.4f}); LRU "
        f"{big['lru']:.4f}. Chunk lookups/s (one CPython thread, whole replay): exact "
        f"{big['lookups_per_s']['exact']:,.0f}, sampled {big['lookups_per_s']['sampled']:,.0f}, "
        f"LRU {big['lookups_per_s']['lru']:,.0f}. Sampled as deep as a 10-million-chunk "
        f"tier is ({DEEP_SLOTS:,} sampled slots: rate 1/{1 / big['deep_rate']:.0f}): "
        f"{big['deep']:.4f} ({big['deep'] - big['exact']:+.4f}), "
        f"{big['lookups_per_s']['deep']:,.0f} chunk lookups/s.",
        "",
        f"Memory with sampling active: {mem:.0f} bytes per tracked chunk plus "
        f"{experts / 2**20:.0f} MiB of experts, i.e. {(mem * 1e7 + experts) / 2**30:.2f} GiB "
        "for 10 million chunks (`bench.policy_memory.adaptive_cost`, "
        "`tests/test_policy.py`).",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=0.6)
    ap.add_argument("--workloads", default="chat,chat-agent,rag,scan,shift")
    ap.add_argument("--fractions", default="0.05,0.2")
    ap.add_argument("--slots", default="1024,4096")
    ap.add_argument("--big", default="chat:8:0.2", help="workload:scale:fraction")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    slots = [int(s) for s in args.slots.split(",")]
    print("error against exact:", flush=True)
    rows = error_rows(args.workloads.split(","), args.scale, [float(f) for f in args.fractions.split(",")], slots)
    name, scale, fraction = args.big.split(":")
    print("at scale:", flush=True)
    big = scale_row(name, float(scale), float(fraction))
    mem, experts = adaptive_cost()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "policy_sampling.md").write_text(markdown(rows, big, mem, experts, slots, args.scale))
    (args.out / "policy_sampling.json").write_text(
        json.dumps(
            {
                "sampled_slots": ExpertPanel.SAMPLED_SLOTS,
                "error": rows,
                "scale": big,
                "bytes_per_tracked_chunk": mem,
                "experts_bytes": experts,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out / 'policy_sampling.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
