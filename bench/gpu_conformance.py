"""GPU conformance suite: the connector's copy path against vLLM 0.32's own KV cache views,
on a CUDA device, with only torch installed.

    python -m bench.gpu_conformance --report bench/results/gpu_conformance.md [--json OUT]
                                    [--device 0] [--repeats 10]

The views are vLLM's, recorded here with vLLM's functions on the meta device
(``bench.kv_fixtures`` -> ``bench/fixtures/kv_views.json``: every layout x attention
kind x dtype, Llama 3 8B's shape for bandwidth; a test regenerates them and fails when
vLLM changes them). On the device the suite rebuilds them over a real buffer and checks:

1. exactness (``bench.conformance_views``): gather and scatter bit for bit, bytes outside
   the target blocks untouched, entries carried across layouts and kernel splits;
2. ordering with teeth (``bench.conformance_order``): each check passes with the
   copier's ordering and fails with it removed;
3. the worker's device in a loader thread and a writer thread;
4. staging memory: the pinned high-water mark after many gathers in flight (the pool
   never grows; gathers beyond it are skipped), and torch's own pinned allocator;
5. bandwidth per layout: gather (device -> pinned staging) and scatter (an entry in
   pageable memory -> pinned staging -> device, as a load runs) of 256- and 1,024-token
   Llama 3 8B entries of random blocks, against the link measured the same way (one
   contiguous pinned copy each way).

Without CUDA it runs part 1 on the CPU copy path (the small cases) and part 4 on plain
memory, and the report says the GPU part was not run; ``tests/test_gpu_conformance.py``
runs that in the test suite. Exit status 1 when a check fails (or an ordering check
has no teeth).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from bench import conformance_views, kv_fixtures  # noqa: E402
from cache.vllm.kv_copy import BlockCopier, KVLayout  # noqa: E402
from cache.vllm.staging import StagingPool  # noqa: E402

ORDER_CASE = "llama3_8b/LBNHC"  # FlashAttention's layout (and FlashInfer's before Blackwell)
TARGET_LAYOUTS = ("LBNHC", "LBHNC")  # what vLLM 0.32 picks for FlashAttention / FlashInfer (Blackwell: LBHNC)
SMALL_CASE = "gqa_bf16/LBNHC"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn, device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def _pool(layout: KVLayout, blocks: int, slots: int, device: torch.device) -> StagingPool:
    cuda = device.type == "cuda"
    return StagingPool(
        layout.bytes_per_block() * blocks, slots, pin=cuda, happened=(lambda e: e.query()) if cuda else None
    )


def _pinned_bytes() -> int:
    stats = torch.cuda.host_memory_stats() if torch.cuda.is_available() else {}
    return int(stats.get("allocated_bytes.current", 0))


def staging_high_water(case: dict, device: torch.device, gathers: int = 64, slots: int = 8) -> dict:
    """``gathers`` saves of 4 blocks issued while the compute stream is busy (their copies
    in flight) against a pool of ``slots``: how much memory it took."""
    before = _pinned_bytes()
    _, views = conformance_views.build(case, device, seed=8)
    layout = KVLayout.of(views, case["num_blocks"])
    pool = _pool(layout, 4, slots, device)
    copier = BlockCopier(views, layout, staging=pool)
    allocated = _pinned_bytes() - before
    if device.type == "cuda":
        torch.cuda._sleep(100_000_000)  # noqa: SLF001 (the forward pass still running: every copy stays queued)
    got = [copier.gather_async([(4 * i + k) % case["num_blocks"] for k in range(4)]) for i in range(gathers)]
    taken = [g for g in got if g is not None]
    for g in taken:
        g.wait()
        g.release()
    _sync(device)
    grown = _pinned_bytes() - before - allocated
    out = {
        "pool_bytes": pool.nbytes,
        "slots": slots,
        "gathers": gathers,
        "skipped": pool.dropped_saves,
        "high_water_slots": pool.high_water,
        "high_water_bytes": pool.high_water * pool.slot_bytes,
        "pinned_allocated_by_pool": allocated,
        "pinned_grown_by_gathers": grown,
    }
    out["ok"] = (
        pool.high_water <= slots and pool.dropped_saves == gathers - slots and grown <= (1 << 20)
    )  # (block-id index tensors only)
    return out


def bandwidth(case: dict, device: torch.device, tokens=(256, 1024), repeats: int = 10) -> dict:
    """Gather and scatter of entries of random blocks; GB/s."""
    _, views = conformance_views.build(case, device, seed=9)
    layout = KVLayout.of(views, case["num_blocks"])
    per = case["block_size"]
    pool = _pool(layout, max(tokens) // per, 2, device)
    copier = BlockCopier(views, layout, staging=pool)
    rng = random.Random(0)
    out = {}
    for n_tokens in tokens:
        ids = rng.sample(range(case["num_blocks"]), n_tokens // per)
        nbytes = len(ids) * layout.bytes_per_block()

        def gather(ids=ids):
            got = copier.gather_async(ids)
            got.wait()
            got.release()

        def enqueue(ids=ids) -> float:  # what a save costs the forward thread
            _sync(device)
            t = time.perf_counter()
            got = copier.gather_async(ids)
            seconds = time.perf_counter() - t
            got.wait()
            got.release()
            return seconds

        entry = copier.gather(ids)  # pageable, as an entry read from a tier is

        def scatter(ids=ids, entry=entry):
            copier.scatter(ids, entry)

        g, s = _best(gather, device, repeats), _best(scatter, device, repeats)
        out[n_tokens] = {
            "entry_bytes": nbytes,
            "gather_s": g,
            "gather_GBps": nbytes / g / 1e9,
            "scatter_s": s,
            "scatter_GBps": nbytes / s / 1e9,
            "enqueue_ms": 1e3 * min(enqueue() for _ in range(repeats)),
        }
    return out


def link(device: torch.device, nbytes: int, repeats: int) -> dict:
    """One contiguous pinned copy each way: the host link's own rate."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    d2h = _best(lambda: host.copy_(dev, non_blocking=True), device, repeats)
    h2d = _best(lambda: dev.copy_(host, non_blocking=True), device, repeats)
    return {"bytes": nbytes, "d2h_GBps": nbytes / d2h / 1e9, "h2d_GBps": nbytes / h2d / 1e9}


def run(device: torch.device, repeats: int) -> dict:
    from bench import conformance_order

    fixtures = kv_fixtures.load()
    cuda = device.type == "cuda"
    names = None if cuda else {n for n in fixtures["cases"] if not n.startswith("llama")}
    result = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "fixtures_vllm": fixtures["vllm"],
        "gpu_part": cuda,
    }
    result["views"] = conformance_views.run(fixtures, device, names)
    result["staging"] = staging_high_water(fixtures["cases"][SMALL_CASE], device)
    if cuda:
        result["ordering"] = conformance_order.run(fixtures["cases"][ORDER_CASE], device)
        other = torch.device("cuda", 1) if torch.cuda.device_count() > 1 else device
        result["threads"] = conformance_order.threads_select_the_device(fixtures["cases"][SMALL_CASE], other)
        llama = {n.split("/")[1]: c for n, c in fixtures["cases"].items() if n.startswith("llama") and "views" in c}
        result["bandwidth"] = {lay: bandwidth(c, device, repeats=repeats) for lay, c in llama.items()}
        entry = result["bandwidth"][TARGET_LAYOUTS[0]][256]["entry_bytes"]
        result["link"] = link(device, 16 * entry, repeats)
    result["ok"] = ok(result)
    return result


def ok(result: dict) -> bool:
    good = conformance_views.passed(result["views"]) and result["staging"]["ok"]
    if result["gpu_part"]:
        good = (
            good
            and result["threads"]["ok"]
            and all(c["ordered"] and not c["unordered"] for c in result["ordering"].values())
        )
    return good


def main(argv=None) -> int:
    from bench.conformance_report import render

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", default="", help="write the markdown report here")
    p.add_argument("--json", default="", help="write the figures here")
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--repeats", type=int, default=10)
    a = p.parse_args(argv)
    device = torch.device("cuda", a.device) if torch.cuda.is_available() else torch.device("cpu")
    result = run(device, a.repeats)
    text = render(result)
    print(text)
    for path, body in ((a.report, text), (a.json, json.dumps(result, indent=1, default=str))):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                f.write(body + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
