"""Sizing advice from miss-ratio curves: per tier, the knee of its curve, the bytes there,
and the time to first token that size would save.

    python -m cache.tools.advise --url http://127.0.0.1:8080          # a running server
    python -m cache.tools.advise --metrics saved_metrics.txt           # a page saved from it
    python -m cache.tools.advise TRACE.jsonl --tier dram=4392 --tier disk=20000
    python -m cache.tools.advise --workload rag --tier dram=1000 --url http://127.0.0.1:8080

From a server: its ``/metrics`` (the curves ``kvcache:curve_hit_ratio{tier,size}``, each
tier's ``kvcache:tier_capacity_bytes``, the cost model's fitted rates ``kvcache:cost_*``
and vLLM's ``vllm:request_prompt_tokens`` for the mean prompt). From a Mooncake-format
trace or a seeded workload: the same curves computed here (``cache.curves``, sampled as
in the server), with each ``--tier`` sized in the trace's 512-token blocks; a ``--url``
then lends the server's rates for the saving.

The knee: the smallest size past which no doubling of the tier adds ``--gain`` of the
prompt tokens or more (default 0.02); "still rising" when 4x -> 8x still adds that much. The
saving per request, at the mean prompt of *n* tokens whose first *h1 = r(1) n* tokens hit
now and *h2 = r(knee) n* would: the prefill of tokens *h1..h2* after *h1* cached
(``cache.cost``: seconds per token and per attention pair) less loading them from the tier
(its seconds per token, plus one latency when nothing hit before). A mean-field estimate:
real prompts hit unevenly.

Runs offline, in its own process: one HTTP GET at most; never in the serving path.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from cache.cost import attention_pairs
from cache.curves import SIZES, TierCurve, chunk_fingerprint
from cache.policy import DEFAULT_POLICY, policy_names

GAIN = 0.02  # a doubling that adds less of the prompt tokens than this is past the knee


@dataclass
class Rates:
    """The cost model's fitted rates (``cache.vllm.planner.LoadPlanner.rates``)."""

    prefill_per_token: Optional[float] = None
    prefill_per_pair: float = 0.0
    load_per_token: dict = field(default_factory=dict)  # tier -> seconds per token loaded
    load_latency: dict = field(default_factory=dict)  # tier -> seconds per load

    def __post_init__(self) -> None:
        self.load_per_token = dict(self.load_per_token or {})
        self.load_latency = dict(self.load_latency or {})


@dataclass
class Advice:
    tier: str
    curve: dict  # size label -> token hit ratio
    knee: str  # size label
    rising: bool  # still gaining past 8x
    capacity: Optional[int] = None  # at 1x: bytes (or a trace's blocks)
    saving_s: Optional[float] = None  # per request, at the knee against 1x


def knee(curve: dict, gain: float = GAIN) -> tuple[str, bool]:
    """The smallest size past which no doubling adds ``gain`` or more; (``"8"``, True)
    when the last one (4x -> 8x) still does."""
    at = 0
    for i in range(1, len(SIZES)):
        if curve[SIZES[i]] - curve[SIZES[i - 1]] >= gain:
            at = i
    return SIZES[at], at == len(SIZES) - 1


def saving(tier: str, r1: float, r2: float, prompt: float, rates: Rates) -> Optional[float]:
    """Seconds of prefill saved per request of ``prompt`` tokens when its hit grows from
    ``r1`` to ``r2`` of them (module docstring); None without the rates."""
    per_token = rates.load_per_token.get(tier)
    if rates.prefill_per_token is None or per_token is None or not prompt:
        return None
    h1, h2 = r1 * prompt, r2 * prompt
    computed = rates.prefill_per_token * (h2 - h1) + rates.prefill_per_pair * (
        attention_pairs(prompt - h1, h1) - attention_pairs(prompt - h2, h2)
    )
    loaded = per_token * (h2 - h1) + (rates.load_latency.get(tier, 0.0) if h1 <= 0 < h2 else 0.0)
    return computed - loaded


def advise(curves: dict, capacity: dict, rates: Rates, prompt: float, gain: float = GAIN) -> list[Advice]:
    """Advice per tier from its ``curves[tier]`` (size label -> ratio), its bytes at 1x
    (``capacity``, may lack a tier) and the mean prompt in tokens."""
    out = []
    for tier, curve in curves.items():
        at, rising = knee(curve, gain)
        out.append(
            Advice(tier, curve, at, rising, capacity.get(tier), saving(tier, curve["1"], curve[at], prompt, rates))
        )
    return out


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def render(
    advice: list[Advice], prompt: float, amount: Callable[[float], str] = human_bytes, gain: float = GAIN
) -> str:
    """The report, one paragraph per tier; ``amount`` spells a capacity."""
    lines = []
    for a in advice:

        def size(m: float, a: Advice = a) -> str:
            return amount(a.capacity * m) if a.capacity else f"{m:g}x its size"

        points = "  ".join(f"{s}x {a.curve[s]:.1%}" for s in SIZES)
        lines.append(f"{a.tier}: now {size(1.0)}, serving {a.curve['1']:.1%} of prompt tokens; at 1/4..8x: {points}")
        change = a.curve[a.knee] - a.curve["1"]
        verdict = (
            "still rising at 8x: the traffic would use more"
            if a.rising
            else f"no doubling past it adds {gain:.0%} of the tokens"
        )
        lines.append(
            f"  knee at {a.knee}x = {size(float(a.knee))} ({verdict}): "
            f"{a.curve[a.knee]:.1%} ({100 * change:+.1f} points against now)"
        )
        if a.saving_s is not None:
            lines.append(
                f"  expected time to first token there: {-a.saving_s or 0.0:+.3f} s per request "
                f"(mean prompt {prompt:,.0f} tokens; the cost model's rates)"
            )
        else:
            lines.append("  expected time to first token: unknown (no fitted rates yet, or no mean prompt)")
    return "\n".join(lines)


# -- sources ---------------------------------------------------------------------------------
def from_metrics(text: str) -> tuple[dict, dict, Rates, float]:
    """Curves, capacities, rates and the mean prompt from a ``/metrics`` page (series of
    several engines averaged)."""
    from prometheus_client.parser import text_string_to_metric_families

    curves: dict = {}
    capacity: dict = {}
    rates = Rates()
    prompt_sum = prompt_count = 0.0
    sums: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            tier = s.labels.get("tier")
            key: Optional[tuple] = None
            if s.name == "kvcache:curve_hit_ratio" and s.labels.get("size") in SIZES:
                key = ("curve", tier, s.labels["size"])
            elif s.name == "kvcache:tier_capacity_bytes" and s.value > 0:
                key = ("capacity", tier)
            elif s.name.startswith("kvcache:cost_"):
                key = (s.name, tier)
            elif s.name == "vllm:request_prompt_tokens_sum":
                prompt_sum += s.value
            elif s.name == "vllm:request_prompt_tokens_count":
                prompt_count += s.value
            if key is not None:
                sums.setdefault(key, []).append(s.value)
    for key, values in sums.items():
        v = sum(values) / len(values)
        if key[0] == "curve":
            curves.setdefault(key[1], {})[key[2]] = v
        elif key[0] == "capacity":
            capacity[key[1]] = int(v)
        elif key[0] == "kvcache:cost_prefill_seconds_per_token":
            rates.prefill_per_token = v
        elif key[0] == "kvcache:cost_prefill_seconds_per_pair":
            rates.prefill_per_pair = v
        elif key[0] == "kvcache:cost_load_seconds_per_token":
            rates.load_per_token[key[1]] = v
        elif key[0] == "kvcache:cost_load_latency_seconds":
            rates.load_latency[key[1]] = v
    curves = {t: c for t, c in curves.items() if len(c) == len(SIZES)}
    return curves, capacity, rates, (prompt_sum / prompt_count if prompt_count else 0.0)


def from_trace(requests, tiers: dict, policy: str = DEFAULT_POLICY) -> dict:
    """Curves of ``tiers`` (name -> capacity in the trace's blocks) over ``requests``,
    each tier alone, the last one judging admission (as a store's last local tier)."""
    from cache.tools.trace import block_tokens

    last = list(tiers)[-1] if tiers else None
    sims = [TierCurve(name, cap, policy, last_tier=name == last) for name, cap in tiers.items()]
    for r in requests:
        fps = [chunk_fingerprint(k) for k in r.hash_ids]
        tokens = block_tokens(r)
        for sim in sims:
            sim.request(fps, tokens)
    return {sim.tier: sim.ratios() for sim in sims}


def _fetch(url: str) -> str:
    import httpx

    r = httpx.get(url.rstrip("/") + "/metrics", timeout=10)
    r.raise_for_status()
    return r.text


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cache.tools.advise", description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", help="Mooncake-format JSONL trace (else: the server's curves)")
    ap.add_argument("--workload", help="a seeded synthetic workload instead of a trace (cache.tools.workloads)")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tier",
        action="append",
        default=[],
        metavar="NAME=BLOCKS",
        help="a tier and its size in the trace's blocks (trace or workload; repeat, fastest first)",
    )
    ap.add_argument("--block-bytes", type=int, default=0, help="bytes of one trace block (prints sizes in bytes)")
    ap.add_argument("--policy", default=DEFAULT_POLICY, choices=policy_names())
    ap.add_argument("--url", help="a server: its curves, or (with a trace) its cost model's rates")
    ap.add_argument("--metrics", help="a /metrics page saved to a file, in place of --url")
    ap.add_argument("--gain", type=float, default=GAIN, help="a doubling adding less than this is past the knee")
    args = ap.parse_args(argv)
    if args.url and args.metrics:
        ap.error("give --url or --metrics, not both")
    page = (lambda: _fetch(args.url)) if args.url else (lambda: open(args.metrics).read()) if args.metrics else None
    if args.trace or args.workload:
        if args.trace and args.workload:
            ap.error("give a trace file or --workload NAME, not both")
        try:
            tiers = {name: int(blocks) for name, _, blocks in (t.partition("=") for t in args.tier)}
        except ValueError:
            ap.error("--tier takes NAME=BLOCKS (a whole number of the trace's blocks)")
        if not tiers or min(tiers.values()) < 1:
            ap.error("a trace needs at least one --tier NAME=BLOCKS (BLOCKS >= 1)")
        from cache.tools.trace import load_trace
        from cache.tools.workloads import WORKLOADS, generate

        if args.workload and args.workload not in WORKLOADS:
            ap.error(f"unknown workload {args.workload!r}; choose one of {sorted(WORKLOADS)}")
        requests = generate(args.workload, args.seed, args.scale) if args.workload else load_trace(args.trace)
        curves = from_trace(requests, tiers, args.policy)
        rates = from_metrics(page())[2] if page else Rates()
        capacity = {t: b * (args.block_bytes or 1) for t, b in tiers.items()}
        prompt = sum(r.input_length for r in requests) / max(1, len(requests))
        amount = human_bytes if args.block_bytes else (lambda n: f"{n:,.0f} blocks")
    elif page:
        curves, capacity, rates, prompt = from_metrics(page())
        amount = human_bytes
        if not curves:
            print("no curves on that server's /metrics yet (no traffic, or no sized tier)", file=sys.stderr)
            return 1
    else:
        ap.error("give --url (a running server), --metrics (its saved page) or a trace / --workload with --tier")
    print(render(advise(curves, capacity, rates, prompt, args.gain), prompt, amount, args.gain))
    return 0


if __name__ == "__main__":
    sys.exit(main())
