"""Where our connector's hit time goes: its load path, step by step, without vLLM.

    .venv/bin/python -m bench.profile_hit [--tokens 8192] [--repeats 5]

Runs in one process, single-threaded except where the connector itself uses threads
(the disk tier's ``get_async`` pool). Stores one prompt's chunks with the connector's
own store (``cache.assembly.writer_store``) and ``BlockCopier`` on KV tensors laid out as
vLLM's CPU backend lays them out (``[blocks, kv_heads, block_size, 2 * head_dim]`` per
layer), then times, per hit: the scheduler's lookup (``contains`` per chunk), the tier
read (DRAM: shared ``MAP_POPULATE`` mmap of a tmpfs file; disk: ``readv`` into a new
buffer, page cache dropped) and the entry check (``decode``: header + XXH3-128 of the
payload), both through the store's timing hook around ``get``, and the copy into the
paged KV cache (``scatter``: ``index_copy_`` per layer); and the disk path as the worker
runs it (``get_async`` on the I/O threads, scatter in order). Then the CPU worker's
path: each entry read from its file straight into its blocks and verified there
(``get_into``), on one thread (``placed``) and as the worker runs it, on the read
threads and the loading thread in parallel (``placed_worker``). Compared with a plain
memory copy of the same bytes, and with the work no verified load can skip
(``verified_copy_bounds``): the same bytes copied and hashed piece by piece, out of
anonymous memory and out of tmpfs files, on one and two threads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shm", default="/dev/shm/kvbench-profile")
    p.add_argument("--disk", default="/tmp/kvbench-profile")
    args = p.parse_args(argv)

    import numpy as np
    import torch

    from bench import pagecache
    from cache.assembly import writer_store
    from cache.config import build_cache_config
    from cache.keys import Namespace, chunk_keys
    from cache.vllm.kv_copy import BlockCopier, KVLayout

    torch.set_num_threads(1)  # as vLLM's CPU worker runs
    block, chunk = 128, 256
    n_chunks = args.tokens // chunk
    num_blocks = 2 * args.tokens // block + 8
    caches = {
        f"layer.{i}": torch.randn(num_blocks, args.kv_heads, block, 2 * args.head_dim) for i in range(args.layers)
    }
    layout = KVLayout.of(caches, num_blocks)
    copier = BlockCopier(caches, layout)
    ns = Namespace("profile", "0", layout.dtype_name, "profile", chunk_tokens=chunk)
    tokens = list(np.random.default_rng(0).integers(0, 256, args.tokens))
    keys = chunk_keys(ns.chain_digest, [int(t) for t in tokens], chunk)
    per = chunk // block
    src_blocks = [list(range(i * per, (i + 1) * per)) for i in range(n_chunks)]
    dst_base = args.tokens // block + 4
    dst_blocks = [list(range(dst_base + i * per, dst_base + (i + 1) * per)) for i in range(n_chunks)]
    nbytes = layout.bytes_per_block() * per * n_chunks
    report = {"tokens": args.tokens, "chunks": n_chunks, "kv_bytes": nbytes, "tiers": {}}
    print(
        f"{args.tokens} tokens, {n_chunks} chunks of {chunk}, KV {nbytes / 2**20:.1f} MiB "
        f"({layout.bytes_per_block() * per / 2**20:.2f} MiB per chunk)"
    )

    for tier_name in ("dram", "disk"):
        shutil.rmtree(args.shm, ignore_errors=True)
        shutil.rmtree(args.disk, ignore_errors=True)
        config = build_cache_config(
            {
                "KVCACHE_DRAM_PATH": args.shm,
                "KVCACHE_DISK_PATH": args.disk,
                "KVCACHE_DRAM_SIZE": "2GiB" if tier_name == "dram" else "0",
                "KVCACHE_DISK_SIZE": "2GiB" if tier_name == "disk" else "0",
            }
        )
        timed = {"read": 0.0, "decode": 0.0}

        def timer(step, seconds, timed=timed):
            timed[step] += seconds

        store = writer_store(config, ns, timer=timer)
        for i, key in enumerate(keys):
            host = copier.gather(src_blocks[i])
            store.put(
                key,
                keys[i - 1] if i else None,
                layout.dtype_name,
                tuple(host.shape),
                host.view(torch.uint8).reshape(-1).numpy(),
            )
        store.flush()
        folder = args.shm if tier_name == "dram" else args.disk
        steps = {
            "lookup": [],
            "read": [],
            "decode": [],
            "scatter": [],
            "sum": [],
            "worker_path": [],
            "placed": [],
            "placed_worker": [],
        }
        for _ in range(args.repeats):
            if tier_name == "disk":
                pagecache.drop(folder)
            t = time.perf_counter()
            assert len(store.lookup(keys)) == n_chunks
            steps["lookup"].append(time.perf_counter() - t)
            s = 0.0
            timed.update(read=0.0, decode=0.0)
            for i, key in enumerate(keys):
                entry = store.get(key, promote=False)  # read and decode, timed by the hook
                t2 = time.perf_counter()
                src = torch.frombuffer(entry.payload, dtype=layout.dtype).view(entry.info.shape)
                copier.scatter(dst_blocks[i], src, 0)
                s += time.perf_counter() - t2
                del src, entry
            r, d = timed["read"], timed["decode"]
            steps["read"].append(r)
            steps["decode"].append(d)
            steps["scatter"].append(s)
            steps["sum"].append(r + d + s)
            # As the worker runs it: sync get() for DRAM, get_async() on the I/O pool for disk.
            if tier_name == "disk":
                pagecache.drop(folder)
            t = time.perf_counter()
            futures = [store.get_async(k) for k in keys] if tier_name == "disk" else None
            for i, key in enumerate(keys):
                entry = futures[i].result() if futures else store.get(key)
                src = torch.frombuffer(entry.payload, dtype=layout.dtype).view(entry.info.shape)
                copier.scatter(dst_blocks[i], src, 0)
                del src, entry
            steps["worker_path"].append(time.perf_counter() - t)
            # Read straight into the blocks and verified there (get_into), one thread, then
            # as the CPU worker runs it: on the read threads and this one, in parallel.
            for name, parallel in (("placed", False), ("placed_worker", True)):
                if tier_name == "disk":
                    pagecache.drop(folder)

                def place(i):
                    return lambda info: copier.place(dst_blocks[i], 0, info.dtype, info.shape)

                t = time.perf_counter()
                jobs = [store.run_read(store.get_into, k, place(i)) for i, k in enumerate(keys)] if parallel else []
                got = [
                    store.get_into(key, place(i)) if not jobs or jobs[i].cancel() else None
                    for i, key in enumerate(keys)
                ]  # what no read thread has started
                got = [g if g is not None else jobs[i].result() for i, g in enumerate(got)]
                assert all(g is not None for g in got)
                steps[name].append(time.perf_counter() - t)
        store.close()
        med = {k: statistics.median(v) for k, v in steps.items()}
        report["tiers"][tier_name] = {k: v * 1e3 for k, v in med.items()}
        print(f"\n{tier_name}: median of {args.repeats} (ms, and GB/s of the KV bytes)")
        for k, v in med.items():
            print(f"  {k:12s} {v * 1e3:8.1f} ms  {nbytes / v / 1e9 if v else 0:6.2f} GB/s")

    # A plain copy of the same bytes: the floor for read + scatter from DRAM.
    bw = pagecache.dram_bandwidth(nbytes)
    report["memcpy_ms"] = nbytes / bw["best"] * 1e3
    print(f"\nmemcpy of the same bytes: {report['memcpy_ms']:.1f} ms ({bw['best'] / 1e9:.2f} GB/s)")
    report["verified_copy_ms"] = bounds = verified_copy_bounds(nbytes, n_chunks, args.shm, args.repeats)
    for name, ms in bounds.items():
        print(f"copy + hash {name + ':':25s} {ms:6.1f} ms ({nbytes / ms / 1e6:.2f} GB/s)")
    disk = pagecache.disk_bandwidth(nbytes, args.disk)
    report["disk_read_ms"] = nbytes / disk["bytes_per_s"] * 1e3
    print(
        f"cold read of one file of the same size: {report['disk_read_ms']:.1f} ms "
        f"({disk['bytes_per_s'] / 1e9:.2f} GB/s)"
    )
    shutil.rmtree(args.shm, ignore_errors=True)
    shutil.rmtree(args.disk, ignore_errors=True)
    print(json.dumps(report))


def verified_copy_bounds(nbytes: int, n_files: int, folder: str, repeats: int) -> dict[str, float]:
    """Median ms of the work every verified load of ``nbytes`` must do, without the store:
    each entry copied into a destination a piece at a time, each piece hashed right after
    (XXH3-128, as ``cache.placed`` does), on one and on two threads. Sources: anonymous
    memory (the bound for any copy out of host memory) and ``n_files`` tmpfs files under
    ``folder`` read with ``preadv`` from byte 0 (the DRAM tier's path, less its header's
    256 bytes, which put an entry's reads off the page grid). Next to the 1-token floor,
    which counts a plain copy only, at the best of numpy's and torch's bandwidth."""
    import threading

    import numpy as np
    import xxhash

    from cache.placed import PIECE_BYTES, copy_into

    size = nbytes // n_files
    rng = np.random.default_rng(1)
    sources = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n_files)]
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, f"bound-{i}") for i in range(n_files)]
    for path, src in zip(paths, sources):
        with open(path, "wb") as f:
            f.write(src.tobytes())

    view = memoryview(np.ones(size * n_files, np.uint8))  # where the entries go

    def copy_and_hash(i: int, fill) -> None:
        """Entry ``i`` into its place in ``view``: ``fill(piece, offset)``, then the hash."""
        h, base = xxhash.xxh3_128(), i * size
        for off in range(0, size, PIECE_BYTES):
            piece = view[base + off : base + off + PIECE_BYTES]
            fill(piece, off)
            h.update(piece)

    def from_memory(i: int) -> None:
        copy_and_hash(i, lambda piece, off: copy_into(piece, sources[i][off : off + len(piece)]))

    def from_tmpfs(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            copy_and_hash(i, lambda piece, off: os.preadv(fd, [piece], off))
        finally:
            os.close(fd)

    def timed(job, threads: int) -> float:
        def run(k):
            for i in range(k, n_files, threads):
                job(i)

        workers = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
        t = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return (time.perf_counter() - t) * 1e3

    cases = {
        f"from {src}, {n} thread{'s' if n > 1 else ''}": (job, n)
        for src, job in (("memory", from_memory), ("tmpfs", from_tmpfs))
        for n in (1, 2)
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(max(3, repeats)):  # alternated, so a noisy moment hits every case alike
        for name, (job, n) in cases.items():
            samples[name].append(timed(job, n))
    for path in paths:
        os.unlink(path)
    return {name: statistics.median(v) for name, v in samples.items()}


if __name__ == "__main__":
    main()
