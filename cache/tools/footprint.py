"""Command line: KV bytes per token and per request of a model, and what tiers of a given
size hold::

    python -m cache.tools.footprint MODEL_DIR_OR_CONFIG_JSON --context 131072 \\
        [--dram-size 64GiB] [--disk-size 2TB] [--shared-size 10TB] [--kv-dtype fp8] [--json]

Offline arithmetic over ``cache.footprint`` (no torch, no vLLM); prints text or JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from cache.config import parse_size
from cache.errors import ConfigError, FootprintError
from cache.footprint import footprint_from_config, load_hf_config, report
from cache.sizes import human_bytes


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cache.tools.footprint", description="KV cache bytes per token and per request of a model."
    )
    p.add_argument("model", help="model folder or config.json file")
    p.add_argument(
        "--context", type=int, default=None, help="tokens per request (default: the model's max_position_embeddings)"
    )
    p.add_argument("--kv-dtype", default=None, help="vLLM --kv-cache-dtype (auto, fp8, ...)")
    for tier, old in (("dram", "cpu"), ("disk", None), ("shared", "remote")):
        p.add_argument(
            f"--{tier}-size",
            *([f"--{old}-size"] if old else []),
            dest=tier,
            default=None,
            help=f"{tier} tier size, e.g. 64GiB, 2TB" + (f" (old name --{old}-size)" if old else ""),
        )
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    try:
        fp = footprint_from_config(load_hf_config(args.model), args.kv_dtype)
        tiers = {
            name: parse_size(getattr(args, name), None, f"--{name}-size")
            for name in ("dram", "disk", "shared")
            if getattr(args, name)
        }
    except (FootprintError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    context = args.context or fp.max_context or 0
    if context <= 0:
        print("error: give --context (the config has no max_position_embeddings)", file=sys.stderr)
        return 2
    out = report(fp, context, tiers)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(fp.describe())
    print(
        f"one {context:,}-token request: {out['bytes_per_request']:,} bytes ({human_bytes(out['bytes_per_request'])})"
    )
    if fp.hybrid:
        print(f"without the hybrid KV cache manager: {fp.full_layout_bytes_per_token:,} bytes per token")
    for name, t in out["tiers"].items():
        print(f"{name} tier {human_bytes(t['bytes'])}: {t['tokens']:,} tokens = {t['requests']:,} such requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
