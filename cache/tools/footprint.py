"""Command line: KV bytes per token and per request of a model, and what tiers of a given
size hold::

    python -m cache.tools.footprint MODEL_DIR_OR_CONFIG_JSON --context 131072 \\
        [--cpu-size 64GiB] [--disk-size 2TB] [--kv-dtype fp8] [--json]

Offline arithmetic over ``cache.footprint`` (no torch, no vLLM); prints text or JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from cache.footprint import FootprintError, footprint_from_config, human_bytes, load_hf_config, report


def main(argv: Optional[list[str]] = None) -> int:
    from cache.config import ConfigError, parse_size

    p = argparse.ArgumentParser(prog="python -m cache.tools.footprint",
                                description="KV cache bytes per token and per request of a model.")
    p.add_argument("model", help="model folder or config.json file")
    p.add_argument("--context", type=int, default=None,
                   help="tokens per request (default: the model's max_position_embeddings)")
    p.add_argument("--kv-dtype", default=None, help="vLLM --kv-cache-dtype (auto, fp8, ...)")
    for tier in ("cpu", "disk", "remote"):
        p.add_argument(f"--{tier}-size", default=None, help=f"{tier} tier size, e.g. 64GiB, 2TB")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    try:
        fp = footprint_from_config(load_hf_config(args.model), args.kv_dtype)
        tiers = {name: parse_size(text, None, f"--{name}-size")
                 for name, text in (("cpu", args.cpu_size), ("disk", args.disk_size),
                                    ("remote", args.remote_size)) if text}
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
    print(f"one {context:,}-token request: {out['bytes_per_request']:,} bytes "
          f"({human_bytes(out['bytes_per_request'])})")
    for name, t in out["tiers"].items():
        print(f"{name} tier {human_bytes(t['bytes'])}: {t['tokens']:,} tokens = "
              f"{t['requests']:,} such requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
