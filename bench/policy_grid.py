"""The policy robustness grid: every seeded workload x every capacity, each policy's token
hit ratio, Belady's, and the recommended policy's margin over the best classic.

Runs offline on the CPU, in the calling process (``bench/bench_policy.py`` writes the full
grid to ``bench/results/policy_robustness.{md,json,png}``; ``tests/test_policy_grid.py``
runs a reduced one). Workloads come from ``cache.tools.workloads`` (seeded, so every run of
a given seed and scale replays the same requests); the Mooncake trace can be added as one
more row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence

from cache.policy import DEFAULT_POLICY
from cache.tools.replay import run
from cache.tools.trace import Request, capacity_for_fraction
from cache.tools.workloads import WORKLOADS, generate

FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.20)
CLASSICS = ("lru", "arc", "s3fifo")


@dataclass
class Cell:
    """One workload at one capacity."""

    workload: str
    fraction: float
    capacity_blocks: int
    ratio: Dict[str, float] = field(default_factory=dict)  # policy -> token hit ratio
    lookups_per_s: Dict[str, float] = field(default_factory=dict)

    @property
    def best_classic(self) -> float:
        return max(self.ratio[p] for p in CLASSICS)

    def margin(self, policy: str = DEFAULT_POLICY) -> float:
        """``policy``'s token hit ratio minus the best of LRU, ARC and S3-FIFO."""
        return self.ratio[policy] - self.best_classic

    def as_dict(self) -> dict:
        return {
            "workload": self.workload,
            "fraction": self.fraction,
            "capacity_blocks": self.capacity_blocks,
            "token_hit_ratio": self.ratio,
            "chunk_lookups_per_s": self.lookups_per_s,
            "margin": self.margin(),
        }


def grid_rows(
    traces: Dict[str, Sequence[Request]],
    fractions: Sequence[float] = FRACTIONS,
    policies: Sequence[str] = CLASSICS + (DEFAULT_POLICY, "belady"),
    progress: bool = False,
) -> List[Cell]:
    """Replay every trace at every capacity (a share of its distinct blocks) through every
    policy, each built fresh."""
    cells = []
    for name, requests in traces.items():
        for f in fractions:
            cell = Cell(name, f, capacity_for_fraction(requests, f))
            for p in policies:
                res = run(requests, p, cell.capacity_blocks)
                cell.ratio[p] = res.token_hit_ratio
                cell.lookups_per_s[p] = res.lookups_per_s
            if progress:
                print(
                    f"  {name:>14} {f:4.0%} {cell.capacity_blocks:>6} blocks: "
                    + " ".join(f"{p}={cell.ratio[p]:.4f}" for p in policies)
                    + f" margin={cell.margin():+.4f}",
                    flush=True,
                )
            cells.append(cell)
    return cells


def workload_traces(scale: float, seed: int = 0, names: Sequence[str] = tuple(WORKLOADS)) -> Dict[str, List[Request]]:
    """Every named workload generated at ``scale`` from ``seed``."""
    return {name: generate(name, seed, scale) for name in names}


def markdown(cells: Sequence[Cell], policies: Sequence[str], title: str, note: str) -> str:
    """The robustness table: one row per workload and capacity."""
    ours = DEFAULT_POLICY
    lines = [
        f"# {title}",
        "",
        note,
        "",
        "| workload | capacity | blocks | "
        + " | ".join(f"**{p}**" if p == ours else p for p in policies)
        + " | ours - best classic |",
        "| --- | ---: | ---: | " + " | ".join("---:" for _ in policies) + " | ---: |",
    ]
    for c in cells:
        lines.append(
            f"| {c.workload} | {c.fraction:.0%} | {c.capacity_blocks:,} | "
            + " | ".join(f"**{c.ratio[p]:.4f}**" if p == ours else f"{c.ratio[p]:.4f}" for p in policies)
            + f" | {c.margin():+.4f} |"
        )
    worst = min(cells, key=lambda c: c.margin())
    lines += [
        "",
        f"Worst margin of `{ours}` over the best of LRU, ARC and S3-FIFO: "
        f"**{worst.margin():+.4f}** ({worst.workload} at {worst.fraction:.0%}); "
        f"best {max(c.margin() for c in cells):+.4f}.",
    ]
    rates: Dict[str, List[float]] = {}
    for c in cells:
        for p, r in c.lookups_per_s.items():
            rates.setdefault(p, []).append(r)
    lines += [
        "",
        "Chunk lookups per second (median over the cells, one CPython thread, wall time of the whole replay):",
        "",
        "| policy | chunk lookups/s |",
        "| --- | ---: |",
    ]
    lines += [f"| {p} | {sorted(v)[len(v) // 2]:,.0f} |" for p, v in rates.items()]
    return "\n".join(lines) + "\n"


def plot(cells: Sequence[Cell], path, policies: Sequence[str]) -> None:
    """One panel per workload: token hit ratio against capacity, per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(c.workload for c in cells))
    cols = 4
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    styles = {"lru": "o-", "arc": "s-", "s3fifo": "^-", DEFAULT_POLICY: "D-", "belady": "k--"}
    for ax, name in zip(axes.flat, names):
        mine = [c for c in cells if c.workload == name]
        xs = [100 * c.fraction for c in mine]
        for p in policies:
            ax.plot(
                xs,
                [c.ratio[p] for c in mine],
                styles.get(p, ".-"),
                label=p,
                linewidth=2.2 if p == DEFAULT_POLICY else 1.0,
            )
        ax.set_xscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x:g}%" for x in xs])
        worst = min(c.margin() for c in mine)
        ax.set_title(f"{name} (worst margin {worst:+.3f})", fontsize=9)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.supxlabel("tier capacity (share of distinct blocks)")
    fig.supylabel("token hit ratio")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
