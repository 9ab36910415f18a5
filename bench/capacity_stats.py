"""The capacity benchmark's statistics: percentiles, one sweep point's summary, prompt
tokens computed vs loaded (from two scrapes of the server's ``/metrics``), the users a
configuration serves at a TTFT SLO, the report and the plot.

Pure functions over plain data; runs in the benchmark's client process after each sweep
point and in unit tests. No I/O except ``plot`` (writes one PNG).
"""

from __future__ import annotations

import math
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

# What the server counts, per sweep point (deltas of two scrapes): vLLM's split of prompt
# tokens by where their KV came from, and our tiers' loaded tokens.
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
TIERS = ("dram", "disk", "shared")


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def token_counters(metrics_text: str) -> dict[str, float]:
    """The counters the report needs out of a ``/metrics`` page, summed over other labels:
    ``prompt:<source>`` (vLLM's ``prompt_tokens_by_source``) and ``loaded:<tier>`` (our
    ``kvcache:tier_tokens_loaded_total``), plus ``prompt`` (vLLM's prompt tokens)."""
    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == "vllm:prompt_tokens_by_source_total":
                out[f"prompt:{s.labels.get('source')}"] += s.value
            elif s.name == "vllm:prompt_tokens_total":
                out["prompt"] += s.value
            elif s.name == "kvcache:tier_tokens_loaded_total":
                out[f"loaded:{s.labels.get('tier')}"] += s.value
    return dict(out)


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(before) | set(after))}


def summarize(turns: list[dict], seconds: float, counters: dict[str, float]) -> dict:
    """One sweep point: ``turns`` are the client's records (``ok``, ``ttft``, ``itl`` (a
    list of gaps), ``asked``, ``got``), ``seconds`` the measured window, ``counters`` the
    token deltas over it."""
    ok = [t for t in turns if t["ok"]]
    ttft = [t["ttft"] for t in ok]
    itl = [g for t in ok for g in t["itl"]]
    computed = counters.get("prompt:local_compute", 0.0)
    prompt = counters.get("prompt", 0.0) or sum(counters.get(f"prompt:{s}", 0.0) for s in SOURCES)
    return {
        "turns": len(ok),
        "failed": len(turns) - len(ok),
        "short_answers": sum(1 for t in ok if t["got"] < t["asked"]),
        "turns_per_min": 60.0 * len(ok) / seconds if seconds > 0 else math.nan,
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p90": percentile(ttft, 0.9),
        "ttft_p99": percentile(ttft, 0.99),
        "itl_p50": percentile(itl, 0.5),
        "itl_p90": percentile(itl, 0.9),
        "prompt_tokens": prompt,
        "computed_tokens": computed,
        "l0_tokens": counters.get("prompt:local_cache_hit", 0.0),
        "loaded_tokens": {tier: counters.get(f"loaded:{tier}", 0.0) for tier in TIERS},
        "computed_share": computed / prompt if prompt else math.nan,
    }


def users_at_slo(points: dict[int, dict], slo_s: float, key: str = "ttft_p90") -> dict:
    """The most users served with ``key`` <= ``slo_s``: the largest user count of the sweep
    below which every point meets it (``served``), ``bound`` ``">="`` when even the largest
    meets it and ``"<"`` when the smallest does not, and an estimate interpolated linearly
    between the last point that meets it and the first that does not."""
    points = {int(u): p for u, p in points.items()}  # keys are strings after a JSON round trip
    users = sorted(points)
    served = None
    for u in users:
        if not points[u][key] <= slo_s:  # NaN (no finished turn) fails too
            break
        served = u
    if served is None:
        return {"served": users[0] if users else None, "bound": "<", "estimate": None}
    nxt = [u for u in users if u > served]
    if not nxt:
        return {"served": served, "bound": ">=", "estimate": float(served)}
    u1, y0, y1 = nxt[0], points[served][key], points[nxt[0]][key]
    est = served + (u1 - served) * (slo_s - y0) / (y1 - y0) if y1 > y0 and math.isfinite(y1) else float(served)
    return {"served": served, "bound": "=", "estimate": est}


def _fmt(x: float, unit: str = "") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}{unit}"


def slo_text(s: dict) -> str:
    if s["served"] is None:
        return "–"
    if s["bound"] == "<":
        return f"< {s['served']}"
    if s["bound"] == ">=":
        return f">= {s['served']}"
    return f"{s['served']} (≈{s['estimate']:.0f})"


def report(result: dict) -> str:
    """The markdown report of a whole run (``result``: what ``bench.capacity`` saves)."""
    run = result["run"]
    out = ["# Capacity: users at a TTFT SLO", "", f"Scale run: {run['scale']}.", "", run["method"], ""]
    for wname, configs in result["workloads"].items():
        slos = run.get("slos", [run["slo_s"]])
        out += [
            f"## {wname}",
            "",
            "Users at a TTFT p90 SLO:",
            "",
            "| configuration | " + " | ".join(f"p90 <= {x:g} s" for x in slos) + " |",
            "| --- |" + " --- |" * len(slos),
        ]
        for cname, c in configs.items():
            out.append(f"| {cname} | " + " | ".join(slo_text(users_at_slo(c["points"], x)) for x in slos) + " |")
        out += [
            "",
            "| configuration | users | TTFT p50 s | p90 s | p99 s | ITL p50 ms | ITL p90 ms | turns/min "
            "| turns (failed, short) | prompt tokens | computed | L0 hit | loaded dram | disk | shared |",
            "| --- |" + " ---: |" * 14,
        ]
        for cname, c in configs.items():
            for u, p in sorted(c["points"].items(), key=lambda kv: int(kv[0])):
                ld = p["loaded_tokens"]
                out.append(
                    f"| {cname} | {u} | {_fmt(p['ttft_p50'])} | {_fmt(p['ttft_p90'])} | {_fmt(p['ttft_p99'])} "
                    f"| {_fmt(1e3 * p['itl_p50'])} | {_fmt(1e3 * p['itl_p90'])} | {p['turns_per_min']:.0f} "
                    f"| {p['turns']} ({p['failed']}, {p['short_answers']}) | {p['prompt_tokens']:,.0f} "
                    f"| {p['computed_tokens']:,.0f} | {p['l0_tokens']:,.0f} | {ld['dram']:,.0f} "
                    f"| {ld['disk']:,.0f} | {ld['shared']:,.0f} |"
                )
        out += ratios(configs) + [""]
    return "\n".join(out) + "\n"


def ratios(configs: dict) -> list[str]:
    """Each configuration's TTFT p90 over the limit's and over vLLM alone's, per user count."""
    if "limit" not in configs:
        return []
    lines = ["", "TTFT p90 over the limit's (and over vLLM alone's):", ""]
    for cname, c in configs.items():
        if cname == "limit":
            continue
        parts = []
        for u, p in sorted(c["points"].items(), key=lambda kv: int(kv[0])):
            lim = configs["limit"]["points"].get(u)
            alone = configs.get("vllm-alone", {}).get("points", {}).get(u)
            if lim and lim["ttft_p90"] > 0:
                part = f"{u} users {p['ttft_p90'] / lim['ttft_p90']:.2f}×"
                if alone and cname != "vllm-alone" and alone["ttft_p90"] > 0:
                    part += f" ({p['ttft_p90'] / alone['ttft_p90']:.2f}×)"
                parts.append(part)
        lines.append(f"- {cname}: " + ", ".join(parts))
    return lines


def plot(result: dict, path) -> None:
    """TTFT p90 against users, one panel per workload, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = result["workloads"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, (wname, configs) in zip(axes[0], workloads.items()):
        for cname, c in configs.items():
            pts = sorted((int(u), p["ttft_p90"]) for u, p in c["points"].items())
            ax.plot([u for u, _ in pts], [y for _, y in pts], marker="o", label=cname)
        ax.set_xticks(sorted({int(u) for c in configs.values() for u in c["points"]}))
        for slo in result["run"].get("slos", [result["run"]["slo_s"]]):
            ax.axhline(slo, color="grey", ls="--", lw=0.8)
        ax.set_title(wname)
        ax.set_xlabel("users")
        ax.set_ylabel("TTFT p90 (s)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("TTFT p90 against users (dashed: the SLOs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
