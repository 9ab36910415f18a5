"""Mooncake-format traces: one JSON object per line, one request each.

Fields: ``timestamp`` (arrival, ms), ``input_length`` (prompt tokens), ``output_length``,
``hash_ids`` (the prompt's 512-token block ids; equal ids mean an equal prefix up to and
including that block, so every request's ids are a path in one prefix tree). Used offline
by the replay tool, the workload generators and the policy bench; plain file I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Hashable, Iterable, List, Sequence

BLOCK_TOKENS = 512


@dataclass(frozen=True)
class Request:
    """One request of a trace: arrival (ms), prompt tokens, and its prompt's block ids."""

    timestamp: float
    input_length: int
    hash_ids: tuple


def load_trace(path: str) -> List[Request]:
    """Read a Mooncake-format JSONL trace (blank lines ignored)."""
    out: List[Request] = []
    with open(path, "r", encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            obj = json.loads(line)
            ids = tuple(obj["hash_ids"])
            length = int(obj.get("input_length", len(ids) * BLOCK_TOKENS))
            out.append(Request(float(obj.get("timestamp", 0)), length, ids))
    return out


def save_trace(path: str, requests: Iterable[Request]) -> None:
    """Write ``requests`` as a Mooncake-format JSONL trace (``output_length`` 0)."""
    with open(path, "w", encoding="utf-8") as fh:
        for r in requests:
            fh.write(
                json.dumps(
                    {
                        "timestamp": r.timestamp,
                        "input_length": r.input_length,
                        "output_length": 0,
                        "hash_ids": list(r.hash_ids),
                    }
                )
                + "\n"
            )


def block_tokens(request: Request) -> List[int]:
    """Prompt tokens in each block of ``request`` (512 each, the last one partial), so
    that the first ``h`` of them add up to ``min(h * 512, input_length)``."""
    n = request.input_length
    return [max(0, min(BLOCK_TOKENS, n - i * BLOCK_TOKENS)) for i in range(len(request.hash_ids))]


def distinct_blocks(requests: Iterable[Request]) -> int:
    seen: set[Hashable] = set()
    for r in requests:
        seen.update(r.hash_ids)
    return len(seen)


def capacity_for_fraction(requests: Sequence[Request], fraction: float) -> int:
    """Capacity in blocks for a fraction of the trace's distinct blocks (rounded down,
    as in the trace README: 2 % of 43,924 is 878)."""
    return max(1, int(fraction * distinct_blocks(requests)))
