"""The exactness half of the GPU conformance suite (``bench.gpu_conformance``): vLLM's own
KV cache views, recorded in ``bench/fixtures/kv_views.json`` (``bench.kv_fixtures``),
rebuilt over a real buffer of random bytes, on a CUDA device or the CPU, and the
connector's copier (``cache.vllm.kv_copy.BlockCopier``) checked against them.

Needs only torch. For every case vLLM can build (layout x attention kind x dtype):
- the views are accepted (``KVLayout.of``);
- a gather returns, bit for bit, each block's bytes in the canonical order, read here
  independently of the copier: token *t* of manager block *b* is row ``b * r + t // n``,
  token ``t % n`` of the view (``r`` kernel blocks of ``n`` tokens per block);
- a scatter (skipping the entry's first block) writes exactly the target blocks: once
  their old bytes are put back through the views, the whole buffer equals its snapshot
  (so nothing else moved: not the neighbours, not other layers, not a page's padding);
- an entry gathered in one layout (or kernel split) and scattered into another case of
  the same KV cache spec holds the same tokens there: entries carry across layouts.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch

from cache.vllm.kv_copy import BlockCopier, KVLayout
from cache.vllm.staging import StagingPool

GATHER_IDS = ([3, 4, 5, 17, 9, 0, 22, 11], [6, 7, 8])  # scattered (index copies), one run (slices)
SCATTER_IDS, SKIP, HELD = [13, 2, 19], 1, 4  # an entry of 4 blocks, the first skipped


def build(case: dict, device: torch.device, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The case's buffer (random bytes) and its per-layer views, as vLLM cut them."""
    gen = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(-128, 128, (case["buffer_bytes"],), dtype=torch.int8, device=device, generator=gen)
    return raw, views_over(case, raw)


def views_over(case: dict, raw: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        v["name"]: torch.as_strided(raw.view(getattr(torch, v["dtype"])), v["shape"], v["stride"], v["offset"])
        for v in case["views"]
    }


def logical(view: torch.Tensor, block: int, split: int) -> torch.Tensor:
    """Manager block ``block`` of one layer's view as bytes ``[H, N, C]``, token by token."""
    v = view.view(torch.uint8)  # [B * r, H, n, C bytes]
    n = v.shape[2]
    t = torch.arange(split * n, device=v.device)
    return v[block * split + t // n, :, t % n].transpose(0, 1)  # [N, H, C] -> [H, N, C]


def reference(views: dict[str, torch.Tensor], blocks, split: int) -> torch.Tensor:
    """What an entry of ``blocks`` must hold: ``[layers, blocks, H, N, C]`` bytes."""
    return torch.stack([torch.stack([logical(v, b, split) for b in blocks]) for v in views.values()])


def copier_for(views: dict[str, torch.Tensor], num_blocks: int, streams=None) -> BlockCopier:
    layout = KVLayout.of(views, num_blocks)
    device = next(iter(views.values())).device
    pool = StagingPool(
        layout.bytes_per_block() * max(len(GATHER_IDS[0]), HELD),
        4,
        pin=device.type == "cuda",
        happened=(lambda e: e.query()) if device.type == "cuda" else None,
    )
    return BlockCopier(views, layout, staging=pool, streams=streams)


def _bytes(entry: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    n = entry.shape[1]
    return entry.contiguous().view(torch.uint8).reshape(len(layout.layer_names), n, *layout.block_shape[:-1], -1)


def check_case(case: dict, device: torch.device, streams=None) -> dict[str, bool]:
    """Gather and scatter exactness, and nothing else touched, for one case. ``streams``:
    a factory of the copier's stream calls (default: CUDA's on a CUDA device)."""
    raw, views = build(case, device, seed=1)
    copier = copier_for(views, case["num_blocks"], streams() if streams else None)
    layout, split = copier.layout, copier.layout.split
    out = {}
    for ids in GATHER_IDS:
        got = copier.gather_async(ids)
        got.wait()
        ok = torch.equal(_bytes(got.host, layout).to(device), reference(views, ids, split))
        got.release()
        out[f"gather {'scattered' if len(ids) > 3 else 'run'}"] = ok
    snapshot = raw.clone()
    gen = torch.Generator().manual_seed(2)
    src = (
        torch.randint(0, 256, (len(views), HELD, layout.block_bytes()), dtype=torch.uint8, generator=gen)
        .view(layout.dtype)
        .view(layout.entry_shape(HELD))
    )
    copier.scatter(SCATTER_IDS, src, skip_blocks=SKIP)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    want = _bytes(src, layout)[:, SKIP : SKIP + len(SCATTER_IDS)].to(device)
    out["scatter exact"] = torch.equal(reference(views, SCATTER_IDS, split), want)
    before = views_over(case, snapshot)
    for name, view in views.items():  # the target blocks' old bytes back, through the views
        rows = torch.tensor([b * split + k for b in SCATTER_IDS for k in range(split)], device=device)
        view.view(torch.uint8)[rows] = before[name].view(torch.uint8)[rows]
    out["scatter touches nothing else"] = torch.equal(raw, snapshot)
    return out


def check_carry(cases: list[dict], device: torch.device, streams=None) -> dict[str, bool]:
    """Entries of one spec carried from each case to the next (a ring over its layouts)."""
    out = {}
    for a, b in zip(cases, cases[1:] + cases[:1]):
        if a is b:
            continue
        _, src = build(a, device, seed=3)
        _, dst = build(b, device, seed=4)
        from_a = copier_for(src, a["num_blocks"], streams() if streams else None)
        into_b = copier_for(dst, b["num_blocks"], streams() if streams else None)
        entry = from_a.gather(GATHER_IDS[0][:HELD])
        into_b.scatter(SCATTER_IDS, entry, skip_blocks=SKIP)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        moved = GATHER_IDS[0][SKIP:HELD]
        out[f"{_name(a)} -> {_name(b)}"] = torch.equal(
            reference(dst, SCATTER_IDS, into_b.layout.split), reference(src, moved, from_a.layout.split)
        )
    return out


def _name(case: dict) -> str:
    split = case["block_size"] // case["kernel_block_size"] if case.get("kernel_block_size") else 1
    return case["layout"] + (f" (kernel blocks x{split})" if split > 1 else "")


def run(fixtures: dict, device: torch.device, names: Optional[set] = None, streams=None) -> dict:
    """Every case (``names``: only those) on ``device``: ``{"cases": {name: {check: ok}},
    "refused_by_vllm": {name: message}, "carry": {spec: {a -> b: ok}}}``. ``streams``: as
    for ``check_case`` (a test runs the stream path on CPU tensors with a stand-in)."""
    out = {"cases": {}, "refused_by_vllm": {}, "carry": {}}
    by_spec = defaultdict(list)
    for name, case in fixtures["cases"].items():
        if names is not None and name not in names:
            continue
        if "refused_by_vllm" in case:
            out["refused_by_vllm"][name] = case["refused_by_vllm"]
            continue
        try:
            KVLayout.of(
                views_over(case, torch.empty(case["buffer_bytes"], dtype=torch.int8, device="meta")), case["num_blocks"]
            )
        except ValueError as e:  # a view vLLM builds that the cache cannot read
            out["cases"][name] = {f"accepted ({e})": False}
            continue
        out["cases"][name] = check_case(case, device, streams)
        by_spec[case["spec"]].append(case)
    for spec, cases in by_spec.items():
        out["carry"][spec] = check_carry(cases, device, streams)
    return out


def passed(result: dict) -> bool:
    return all(all(c.values()) for c in result["cases"].values()) and all(
        all(c.values()) for c in result["carry"].values()
    )
