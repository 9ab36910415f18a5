"""What the engine's steps took with our connector, from ``bench.timed_connector``'s log.

Runs on the operator's machine, after a run (``bench.low_load --timings``). Reads the
``step`` records (one per worker step: its span from binding the connector's metadata to
the end of ``wait_for_save``, which covers the forward pass, and the parts of it spent in
the connector's load and save hooks) and groups the steps by what they carried: a
load, a save (and no load), or neither. Per group: steps, span p50/p90, and the mean of
each hook's part, so that a slower step is attributed to the hook or to the rest (the
forward pass, or whatever slowed it: other threads holding the GIL or the cores).
"""

from __future__ import annotations

import json
from pathlib import Path

PARTS = ("start_load_ms", "layer_wait_ms", "save_ms")


def read_steps(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path) as f:
        return [r for r in map(json.loads, filter(str.strip, f)) if r.get("event") == "step"]


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else 0.0


def group(step: dict) -> str:
    if step["loads"]:
        return "load"
    return "save" if step["saves"] else "neither"


def summarize(steps: list[dict], turns: int) -> dict:
    """Per group: steps, span p50/p90 ms, mean ms of each hook's part; and per turn, the
    hooks' total ms (what the forward thread spent in the connector per turn served)."""
    out: dict = {}
    for name in ("load", "save", "neither"):
        mine = [s for s in steps if group(s) == name]
        spans = [s["span_ms"] for s in mine]
        out[name] = {
            "steps": len(mine),
            "span_p50_ms": _pct(spans, 0.5),
            "span_p90_ms": _pct(spans, 0.9),
            **{p: sum(s[p] for s in mine) / max(1, len(mine)) for p in PARTS},
        }
    out["hooks_ms_per_turn"] = sum(s[p] for s in steps for p in PARTS) / max(1, turns)
    return out


def lines(config: str, summary: dict) -> list[str]:
    rows = [f"{config}: connector hooks on the forward thread {summary['hooks_ms_per_turn']:.2f} ms per turn"]
    for name in ("load", "save", "neither"):
        g = summary[name]
        rows.append(
            f"  steps with {name:7s} {g['steps']:6d}  span p50/p90 {g['span_p50_ms']:6.2f} / {g['span_p90_ms']:6.2f} ms"
            + "".join(f"  {p[:-3]} {g[p]:.2f}" for p in PARTS)
        )
    return rows
