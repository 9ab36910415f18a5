"""The KV cache views vLLM hands a connector, recorded with vLLM's own functions, for the
GPU conformance suite (``bench.gpu_conformance``), which needs only torch.

    .venv/bin/python -m bench.kv_fixtures [--write]     # needs vLLM; prints the differences

Runs here, on the meta device (no memory): for each attention kind below and each of the
six physical layouts (``vllm.v1.kv_cache_layout.KVCacheLayout``), vLLM sizes the cache
(``get_kv_cache_config_from_groups``) and cuts its per-layer views
(``allocate_kv_cache``: the GPU model runner's own function, which calls
``create_kv_cache_views``), with the kernel block size the case names. Each layer's
view is recorded exactly: shape, strides and storage offset in elements, dtype, and
the buffer's size; a combination vLLM refuses is recorded with its message. The
suite rebuilds the views over a real buffer with ``torch.as_strided``.

``tests/test_kv_fixtures.py`` regenerates them with the installed vLLM and fails when
they differ from the committed ``bench/fixtures/kv_views.json``: the day vLLM changes
its views, the suite's fixtures are known stale (``--write`` rewrites them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

FIXTURES = os.path.join(REPO, "bench", "fixtures", "kv_views.json")

# (name, spec class, spec keywords, kernel block size or None); dtype names are torch's.
# Small models for the exactness checks (every layout x kind), Llama 3 8B for bandwidth.
KINDS = (
    ("gqa_bf16", "FullAttentionSpec", dict(block_size=16, num_kv_heads=4, head_size=64, dtype="bfloat16"), None),
    ("gqa_fp8_uint8", "FullAttentionSpec", dict(block_size=16, num_kv_heads=4, head_size=64, dtype="uint8"), None),
    (
        "gqa_float8_e4m3fn",
        "FullAttentionSpec",
        dict(block_size=16, num_kv_heads=4, head_size=64, dtype="float8_e4m3fn"),
        None,
    ),
    (
        "gqa_bf16_block64",
        "FullAttentionSpec",
        dict(block_size=64, num_kv_heads=4, head_size=64, dtype="bfloat16"),
        None,
    ),
    # the same spec with the kernel taking 16-token blocks: 4 kernel blocks per block
    (
        "gqa_bf16_kernel_split",
        "FullAttentionSpec",
        dict(block_size=64, num_kv_heads=4, head_size=64, dtype="bfloat16"),
        16,
    ),
    ("mla_bf16", "MLAAttentionSpec", dict(block_size=64, num_kv_heads=1, head_size=576, dtype="bfloat16"), None),
    (
        "mla_fp8_ds_mla",
        "MLAAttentionSpec",
        dict(
            block_size=64,
            num_kv_heads=1,
            head_size=576,
            dtype="uint8",
            cache_dtype_str="fp8_ds_mla",
            state_content_bytes=656,
        ),
        None,
    ),
    (
        "mla_fp8_ds_mla_padded",
        "MLAAttentionSpec",
        dict(
            block_size=64,
            num_kv_heads=1,
            head_size=576,
            dtype="uint8",
            cache_dtype_str="fp8_ds_mla",
            state_content_bytes=656,
            alignment=576,
        ),
        None,
    ),
)
SMALL = dict(layers=2, blocks=24)
LLAMA3_8B = ("llama3_8b", "FullAttentionSpec", dict(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16"))
LLAMA_SHAPE = dict(layers=32, blocks=1024)  # 16,384 tokens: 4 GiB of views per layout


def _case(spec_cls: str, spec_kw: dict, kernel_block: int | None, layout_name: str, layers: int, blocks: int) -> dict:
    import torch
    from vllm.v1 import kv_cache_interface as kvi
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = KVCacheLayout[layout_name]
    kw = {**spec_kw, "dtype": getattr(torch, spec_kw["dtype"])}
    spec = getattr(kvi, spec_cls)(**kw)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    config = SimpleNamespace(
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout,
            num_gpu_blocks_override=blocks,
            prefix_cache_retention_interval=None,
        ),
        attention_config=SimpleNamespace(hisparse_config=None),
    )
    out = {
        "layout": layout_name,
        "spec": f"{spec_cls}({', '.join(f'{k}={v}' for k, v in spec_kw.items())})",
        "block_size": spec.block_size,
        "kernel_block_size": kernel_block,
        "num_blocks": blocks,
    }
    try:
        kv_config = get_kv_cache_config_from_groups(config, [kvi.KVCacheGroupSpec(names, spec)], 1 << 40)
        views = allocate_kv_cache(kv_config, torch.device("meta"), layout, [kernel_block] if kernel_block else None)
    except (ValueError, AssertionError) as e:
        out["refused_by_vllm"] = f"{type(e).__name__}: {e}"
        return out
    out["buffer_bytes"] = kv_config.kv_cache_tensors[0].size
    out["page_bytes"] = spec.page_size_bytes
    out["views"] = [
        {
            "name": n,
            "dtype": str(v.dtype).removeprefix("torch."),
            "shape": list(v.shape),
            "stride": list(v.stride()),
            "offset": v.storage_offset(),
        }
        for n, v in views.items()
    ]
    return out


def generate() -> dict:
    """Every case, in a fixed order (needs vLLM)."""
    import vllm
    from vllm.v1.kv_cache_layout import KVCacheLayout

    cases = {}
    for name, spec_cls, spec_kw, kernel_block in KINDS:
        for layout in KVCacheLayout:
            cases[f"{name}/{layout.name}"] = _case(spec_cls, spec_kw, kernel_block, layout.name, **SMALL)
    name, spec_cls, spec_kw = LLAMA3_8B
    for layout in KVCacheLayout:
        cases[f"{name}/{layout.name}"] = _case(spec_cls, spec_kw, None, layout.name, **LLAMA_SHAPE)
    return {"vllm": vllm.__version__, "cases": cases}


def load() -> dict:
    with open(FIXTURES) as f:
        return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"rewrite {os.path.relpath(FIXTURES, REPO)}")
    a = p.parse_args(argv)
    fresh = generate()
    if a.write:
        os.makedirs(os.path.dirname(FIXTURES), exist_ok=True)
        with open(FIXTURES, "w") as f:
            json.dump(fresh, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote {len(fresh['cases'])} cases (vLLM {fresh['vllm']}) to {FIXTURES}")
        return 0
    old = load() if os.path.exists(FIXTURES) else {"cases": {}}
    changed = sorted(k for k in set(fresh["cases"]) | set(old["cases"]) if fresh["cases"].get(k) != old["cases"].get(k))
    print(f"{len(changed)} of {len(fresh['cases'])} cases differ from {FIXTURES}: {changed}")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
