"""The connector's GPU copy path (``cache.vllm.kv_copy.BlockCopier``) on a real CUDA device.

    python -m bench.gpu_copy [--layers 32 --kv-heads 8 --head-dim 128 --blocks 4096] [--json OUT]

Needs only torch (vLLM need not be installed): it builds KV caches in vLLM's
flash-attention layout (per layer ``[2, blocks, block_size, kv_heads, head_dim]``,
bf16, block size 16; Llama 3 8B's shape by default) and drives the copier exactly as
the worker does:

- correctness: a gather issued right after the compute stream wrote the blocks returns
  the new values (the copier's stream waits for the compute stream); a gather still in
  flight when the compute stream overwrites its blocks after ``fence`` (the next
  forward pass) returns the old values; blocks scattered
  from an entry read back bit for bit on the compute stream; a partial scatter
  (``first``) leaves the blocks around it untouched;
- bandwidth: gather (device -> pinned host) and scatter (host -> device) of one chunk
  (256 tokens, random non-adjacent blocks) from pinned and from pageable host memory
  (an entry read from a file is pageable), against the link's own limit: one large
  contiguous pinned copy each way.

Prints a table; ``--json`` writes the figures. On a machine without CUDA it runs the
same checks on the CPU copy path (a smoke run; no bandwidth claims).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from cache.vllm.kv_copy import BlockCopier, KVLayout  # noqa: E402

BLOCK = 16  # vLLM's default block size on CUDA


def make_caches(layers: int, blocks: int, kv_heads: int, head_dim: int, device) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(
        (2, blocks, BLOCK, kv_heads, head_dim), generator=gen, device=device).to(torch.bfloat16)
        for i in range(layers)}


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int) -> float:
    """Best wall time of ``fn`` over ``repeats`` runs (after one warm-up)."""
    fn()
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _busy(device) -> None:
    """Queue some milliseconds of kernels on the current stream (the caller's)."""
    big = torch.randn(8192, 8192, device=device)
    for _ in range(4):
        big = big @ big
        big = big / big.norm()


def check_correctness(copier: BlockCopier, caches: dict, blocks: int, device, fence: bool = True) -> dict:
    names = list(caches)
    rng = torch.Generator().manual_seed(1)
    ids = torch.randperm(blocks, generator=rng)[:16].tolist()
    idx = torch.tensor(ids, device=device)
    results = {}

    # 1. gather right after the compute stream wrote the blocks (a long kernel first,
    #    so the writes are still queued when the gather is issued)
    if device.type == "cuda":
        _busy(device)
    for n, c in enumerate(caches.values()):
        c.index_fill_(1, idx, float(n + 1))
    host = copier.gather(ids)
    want = torch.stack([torch.full_like(host[0], n + 1) for n in range(len(names))])
    results["gather_sees_compute_stream_writes"] = bool(torch.equal(host, want))

    # 2. a save's copy still in flight when the next forward pass overwrites its blocks:
    #    fence() makes the compute stream wait, so the host copy holds the old values
    if device.type == "cuda":  # keep the copier's stream busy (as a long queue of saves
        # would), so the gather is still waiting when the fill is issued: without the
        # fence the fill runs first and the host copy holds -1
        with torch.cuda.stream(copier._stream):
            _busy(device)
    host, wait = copier.gather_async(ids)
    if fence:
        copier.fence()
    for c in caches.values():
        c.index_fill_(1, idx, -1.0)
    wait()
    results["fence_keeps_inflight_save_intact"] = bool(torch.equal(host, want))

    # 3. scatter an entry (pageable, like an mmap'd file) and read it on the compute stream
    src = torch.randn(host.shape, generator=rng).to(torch.bfloat16)
    copier.scatter(ids, src)
    back = torch.stack([c.index_select(1, idx) for c in caches.values()]).cpu()
    results["scatter_reads_back_exact"] = bool(torch.equal(back, src))

    # 4. a partial scatter: entry blocks [4, 12) into 8 other blocks; the rest unchanged
    others = [b for b in torch.randperm(blocks, generator=rng).tolist() if b not in ids][:16]
    oidx = torch.tensor(others, device=device)
    before = torch.stack([c.index_select(1, oidx) for c in caches.values()]).cpu()
    copier.scatter(others[4:12], src, skip_blocks=4)
    after = torch.stack([c.index_select(1, oidx) for c in caches.values()]).cpu()
    results["partial_scatter_exact"] = bool(
        torch.equal(after[:, :, 4:12], src[:, :, 4:12]) and torch.equal(after[:, :, :4], before[:, :, :4])
        and torch.equal(after[:, :, 12:], before[:, :, 12:]))
    return results


def measure(copier: BlockCopier, blocks: int, chunk_blocks: int, device, repeats: int) -> dict:
    rng = torch.Generator().manual_seed(2)
    ids = torch.randperm(blocks, generator=rng)[:chunk_blocks].tolist()
    entry_bytes = copier.layout.bytes_per_block() * chunk_blocks
    out = {"entry_bytes": entry_bytes}
    out["gather_s"] = timed(lambda: copier.gather(ids), device, repeats)
    # what a save costs the forward pass's thread: queueing the copy, not waiting for it
    out["gather_enqueue_ms"] = 1e3 * min(_enqueue_s(copier, ids, device) for _ in range(repeats))
    pageable = copier.gather(ids).clone()  # plain host memory
    out["scatter_pageable_s"] = timed(lambda: copier.scatter(ids, pageable), device, repeats)
    if device.type == "cuda":
        pinned = pageable.pin_memory()
        out["scatter_pinned_s"] = timed(lambda: copier.scatter(ids, pinned), device, repeats)
        # the link itself: one contiguous pinned copy of 16 entries each way
        n = 16 * entry_bytes
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device=device)
        out["link_bytes"] = n
        out["link_h2d_s"] = timed(lambda: dev.copy_(host, non_blocking=True), device, repeats)
        out["link_d2h_s"] = timed(lambda: host.copy_(dev, non_blocking=True), device, repeats)
    for k in [k for k in out if k.endswith("_s")]:
        nbytes = out["link_bytes"] if k.startswith("link") else entry_bytes
        out[k.removesuffix("_s") + "_GBps"] = nbytes / out[k] / 1e9
    return out


def _enqueue_s(copier: BlockCopier, ids, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    _host, wait = copier.gather_async(ids)
    seconds = time.perf_counter() - t0
    wait()
    return seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--blocks", type=int, default=4096, help="KV blocks per layer")
    p.add_argument("--chunk-tokens", default="256,1024", help="entry sizes to time, comma list")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", default="")
    p.add_argument("--skip-fence", action="store_true",
                   help="leave out the fence (to see that its check then fails on a GPU)")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    if not cuda:  # smoke run: small shapes
        a.layers, a.blocks, a.repeats = min(a.layers, 4), min(a.blocks, 256), min(a.repeats, 2)
    caches = make_caches(a.layers, a.blocks, a.kv_heads, a.head_dim, device)
    copier = BlockCopier(caches, KVLayout.of(caches, a.blocks))
    result = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
              "shape": {"layers": a.layers, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
                        "block": BLOCK, "dtype": "bfloat16", "blocks": a.blocks},
              "correctness": check_correctness(copier, caches, a.blocks, device, fence=not a.skip_fence),
              "chunks": {n: measure(copier, a.blocks, n // BLOCK, device, a.repeats)
                         for n in map(int, a.chunk_tokens.split(","))}}
    print(f"device {result['device']}, torch {result['torch']}; {a.layers} layers")
    for k, v in result["correctness"].items():
        print(f"  {k}: {'ok' if v else 'FAILED'}")
    print("| entry | gather (device -> pinned host) | the saving thread's wait | scatter from pinned "
          "| scatter from pageable | link d2h / h2d |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for n, c in result["chunks"].items():
        def rate(k: str) -> str:
            return f"{c[k + '_GBps']:.1f} GB/s ({c[k + '_s'] * 1e3:.2f} ms)" if k + "_s" in c else "–"
        link = f"{c['link_d2h_GBps']:.1f} / {c['link_h2d_GBps']:.1f} GB/s" if "link_d2h_s" in c else "–"
        print(f"| {n:,} tokens, {c['entry_bytes'] / 2**20:.0f} MiB | {rate('gather')} | "
              f"{c['gather_enqueue_ms']:.2f} ms | {rate('scatter_pinned')} | {rate('scatter_pageable')} | {link} |")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(result["correctness"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
