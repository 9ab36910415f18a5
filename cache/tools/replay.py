"""Replay a Mooncake-format trace through an eviction policy and report the token hit ratio.

Runs offline, on the CPU, in its own process (``python -m cache.tools.replay``); it never
runs inside the serving path. It drives the *same* policy classes the tiers use, through
the same loop a store runs (``EvictionPolicy.offer``), so a number printed here is what the
policy would do in a tier of ``capacity_blocks`` chunks:

- lookup: walk the request's leading ``hash_ids`` while present and ``touch`` each hit (a
  request only hits its leading run);
- store: offer each block of the request that is not present
  (``offer(key, parent, 1, reserve=len < capacity)``: admit, evict until there is room,
  insert; ``parent`` = the previous block of the request, or None), and report each one
  that is present to ``seen`` (it was computed again: an earlier block missed).

Token hit ratio = sum(min(hit_blocks * 512, input_length)) / sum(input_length).

Optional queue hints (``--hint-window-ms W``): before request *i* is served, the keys of
requests *j > i* with ``timestamp_j <= timestamp_i + W`` are passed to ``hint_upcoming``
(one call per request, describing the queue as it is then). Those requests have arrived,
or arrive within ``W`` ms, while request *i* is scheduled and prefilled, so an engine
would hold them in its waiting queue; ``W = 0`` means exactly the requests that arrived at
the same instant. Off by default: the main numbers use no hints.

Traces are Mooncake-format JSONL files (``cache.tools.trace``) or seeded synthetic
workloads (``--workload NAME``, ``cache.tools.workloads``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

from cache.curves import serve
from cache.policy import DEFAULT_POLICY, EvictionPolicy, make_policy, policy_names
from cache.policy.offline import BeladyPolicy, OfflinePolicy, RateOraclePolicy
from cache.tools.trace import BLOCK_TOKENS, Request, capacity_for_fraction, load_trace
from cache.tools.workloads import WORKLOADS, generate

# Offline references, built with the whole trace: Belady knows when each block is used
# next; the rate oracles know only how often (see ``cache.policy.offline``).
OFFLINE = ("belady", "rate-oracle", "span-oracle")


def replay_policy_names() -> List[str]:
    """Every name ``--policy`` accepts: the online registry, the offline references, and
    ``ours`` (an alias of the recommended default)."""
    return policy_names() + list(OFFLINE) + ["ours"]


def build_policy(name: str, requests: Sequence[Request], capacity_blocks: Optional[int] = None) -> EvictionPolicy:
    """Online policies come from the registry; the offline ones are built with the whole
    trace (and the capacity, so they can bypass blocks that rank below every resident
    one, as MIN does)."""
    if name == "belady":
        return BeladyPolicy([r.hash_ids for r in requests], capacity=capacity_blocks)
    if name in ("rate-oracle", "span-oracle"):
        return RateOraclePolicy([r.hash_ids for r in requests], capacity=capacity_blocks, span=name == "span-oracle")
    return make_policy(DEFAULT_POLICY if name == "ours" else name)


@dataclass
class ReplayResult:
    policy: str
    capacity_blocks: int
    requests: int
    hit_tokens: int
    prompt_tokens: int
    hit_blocks: int
    lookups: int
    seconds: float
    hint_window_ms: Optional[float] = None

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def lookups_per_s(self) -> float:
        return self.lookups / self.seconds if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict:
        return {
            "policy": self.policy,
            "capacity_blocks": self.capacity_blocks,
            "requests": self.requests,
            "hit_tokens": self.hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "token_hit_ratio": self.token_hit_ratio,
            "hit_blocks": self.hit_blocks,
            "chunk_lookups": self.lookups,
            "seconds": self.seconds,
            "chunk_lookups_per_s": self.lookups_per_s,
            "hint_window_ms": self.hint_window_ms,
        }


def replay(
    requests: Sequence[Request],
    policy: EvictionPolicy,
    capacity_blocks: int,
    hint_window_ms: Optional[float] = None,
    name: Optional[str] = None,
) -> ReplayResult:
    """Drive ``policy`` exactly as a store of ``capacity_blocks`` one-block chunks would.

    ``lookups`` counts every chunk the replay asked the policy about (a lookup step, an
    admission, an insertion); the wall time covers the whole replay including the trace
    walk, so ``lookups_per_s`` is a lower bound on what the policy costs per chunk.
    """
    if capacity_blocks < 1:
        raise ValueError("capacity_blocks must be >= 1")
    hit_tokens = prompt_tokens = hit_blocks = lookups = 0
    begin = policy.begin_request if isinstance(policy, OfflinePolicy) else None

    def reserve() -> bool:
        return len(policy) < capacity_blocks

    n = len(requests)
    hint_end = 0  # requests [i+1, hint_end) are in the queue window of request i
    t0 = time.perf_counter()
    for i, req in enumerate(requests):
        ids = req.hash_ids
        if begin is not None:
            begin(ids)
        if hint_window_ms is not None:
            if hint_end <= i:
                hint_end = i + 1
            limit = req.timestamp + hint_window_ms
            while hint_end < n and requests[hint_end].timestamp <= limit:
                hint_end += 1
            if hint_end > i + 1:
                policy.hint_upcoming(k for r in requests[i + 1 : hint_end] for k in r.hash_ids)
        hits = serve(policy, ids, reserve)  # the leading run hits; the rest is stored
        lookups += len(ids) + (hits < len(ids))
        prompt_tokens += req.input_length
        hit_tokens += min(hits * BLOCK_TOKENS, req.input_length)
        hit_blocks += hits
    seconds = time.perf_counter() - t0
    return ReplayResult(
        policy=name or str(getattr(policy, "name", type(policy).__name__)),
        capacity_blocks=capacity_blocks,
        requests=n,
        hit_tokens=hit_tokens,
        prompt_tokens=prompt_tokens,
        hit_blocks=hit_blocks,
        lookups=lookups,
        seconds=seconds,
        hint_window_ms=hint_window_ms,
    )


def run(
    requests: Sequence[Request],
    policy_name: str,
    capacity_blocks: int,
    hint_window_ms: Optional[float] = None,
) -> ReplayResult:
    """Build ``policy_name`` fresh and replay ``requests`` through it."""
    pol = build_policy(policy_name, requests, capacity_blocks)
    name = DEFAULT_POLICY if policy_name == "ours" else policy_name
    return replay(requests, pol, capacity_blocks, hint_window_ms, name=name)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cache.tools.replay",
        description="Replay a Mooncake-format trace and print the token hit ratio.",
    )
    ap.add_argument("trace", nargs="?", help="JSONL trace (timestamp, input_length, hash_ids)")
    ap.add_argument(
        "--workload", choices=sorted(WORKLOADS), help="replay a seeded synthetic workload instead of a trace file"
    )
    ap.add_argument("--scale", type=float, default=1.0, help="workload size (1: ~10,000 requests)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    cap = ap.add_mutually_exclusive_group(required=True)
    cap.add_argument("--capacity-blocks", type=int, help="tier capacity in blocks")
    cap.add_argument(
        "--capacity-fraction",
        type=float,
        help="tier capacity as a fraction of the trace's distinct blocks (0.02 = 2%%)",
    )
    ap.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        choices=replay_policy_names(),
        help=f"eviction policy (default: {DEFAULT_POLICY}); belady = offline optimum; "
        "rate-oracle / span-oracle = offline, know how often each block is used",
    )
    ap.add_argument(
        "--hint-window-ms",
        type=float,
        default=None,
        help="pass keys of requests arriving within this many ms as upcoming hints",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if (args.trace is None) == (args.workload is None):
        ap.error("give a trace file or --workload NAME (one of them)")
    if args.workload:
        requests = generate(args.workload, args.seed, args.scale)
    else:
        requests = load_trace(args.trace)
    if args.capacity_blocks is not None:
        capacity = args.capacity_blocks
    else:
        capacity = capacity_for_fraction(requests, args.capacity_fraction)
    res = run(requests, args.policy, capacity, args.hint_window_ms)
    if args.json:
        print(json.dumps(res.as_dict()))
    else:
        print(
            f"policy={res.policy} capacity_blocks={res.capacity_blocks} "
            f"requests={res.requests} token_hit_ratio={res.token_hit_ratio:.4f} "
            f"({res.hit_tokens}/{res.prompt_tokens} tokens, "
            f"{res.lookups_per_s:,.0f} chunk lookups/s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
