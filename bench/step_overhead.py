"""What the connector costs the engine thread when it has nothing to load: per step and per request.

    .venv/bin/python -m bench.step_overhead

No engine: a real ``WorkerSide`` (DRAM and disk tiers in temporary folders, a small CPU
KV cache) and a real ``SchedulerSide`` (the check model's chunk, DRAM 2 GiB, disk 8 GiB
as in ``bench.capacity``'s "ours"). Prints, as the minimum and median of 15 repeats:
the worker hooks vLLM calls on the forward thread in a step with no load and no save
(``bind``/``start_load_kv``/``wait_for_save``/transfer results/stats/settled saves),
the scheduler's lookup of a new 3,000-token request (hashing, every tier's ``contains``,
the explanation), and the scheduler's hooks in a decode step with 32 requests running
(``build_connector_meta``); the lookup's share in the miss-ratio curves is in the commit
that moved them to ``request_finished`` (issue 31 item 3). Run it before and after a change
(``git stash``) on the same machine: it is sensitive to load.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _timed(fn, n: int, repeats: int = 15) -> tuple[float, float]:
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t) / n * 1e6)
    return min(runs), statistics.median(runs)


def main() -> None:
    import numpy as np
    import torch

    from cache.config import build_cache_config
    from cache.curves import tier_curves
    from cache.keys import Namespace
    from cache.vllm.metadata import TieredKVMetadata
    from cache.vllm.scheduler import SchedulerSide
    from cache.vllm.worker import WorkerSide

    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm, tempfile.TemporaryDirectory() as disk:
        cfg = build_cache_config(
            {
                "KVCACHE_DRAM_PATH": shm,
                "KVCACHE_DRAM_SIZE": "2GiB",
                "KVCACHE_DISK_PATH": disk,
                "KVCACHE_DISK_SIZE": "8GiB",
            }
        )
        ns = Namespace("m", "d", "bfloat16", "x", chunk_tokens=cfg.chunk_tokens)
        side = WorkerSide(cfg, ns, num_blocks=64, block_size=128)
        side.register_kv_caches({f"layer.{i}": torch.zeros(64, 2, 128, 2, 64, dtype=torch.bfloat16) for i in range(4)})
        meta = TieredKVMetadata()

        def step() -> None:
            side.step_begins(meta)
            side.start_load_kv(meta)
            side.wait_for_save(meta)
            side.take_transfer_results()
            side.get_block_ids_with_load_errors()
            side.get_stats()
            side.take_settled()

        lo, med = _timed(step, 200)
        print(f"worker hooks of a step with no load or save: min {lo:.1f} us, median {med:.1f} us")
        side.shutdown()

        manager = SimpleNamespace(get_block_ids=lambda req_id: (list(range(64)),))
        sched = SchedulerSide(
            cfg,
            [ns],
            128,
            lambda: manager,
            bytes_per_block=128 * 2048,
            curves=tier_curves(cfg, cfg.chunk_tokens * 2048),
        )
        rng = np.random.default_rng(0)
        count = iter(range(10**9))

        def lookup() -> None:
            toks = [int(t) for t in rng.integers(0, 250, 3000)]
            req = SimpleNamespace(
                request_id=f"r{next(count)}",
                prompt_token_ids=toks,
                all_token_ids=toks,
                lora_request=None,
                mm_features=None,
                prompt_embeds=None,
                kv_transfer_params=None,
                cache_salt=None,
            )
            sched.get_num_new_matched_tokens(req, 2048)

        lo, med = _timed(lookup, 20)
        print(
            f"scheduler lookup of a new 3,000-token request (2,048 in L0): min {lo / 1e3:.2f} ms, "
            f"median {med / 1e3:.2f} ms (random token ids drawn included)"
        )

        # A decode step with 32 running requests (the 32-user chat point of bench.low_load):
        # what the scheduler side does in every step, in the engine core's loop.
        running = [f"r{next(count)}" for _ in range(32)]
        for req_id in running:
            toks = [int(t) for t in rng.integers(0, 250, 3000)]
            sched.get_num_new_matched_tokens(
                SimpleNamespace(
                    request_id=req_id,
                    prompt_token_ids=toks,
                    all_token_ids=toks,
                    lora_request=None,
                    mm_features=None,
                    prompt_embeds=None,
                    kv_transfer_params=None,
                    cache_salt=None,
                ),
                0,
            )
        decode = SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=running, num_computed_tokens=[3005] * 32),
            num_scheduled_tokens=dict.fromkeys(running, 1),
        )
        lo, med = _timed(lambda: sched.build_connector_meta(decode), 200)
        print(f"scheduler hooks of a decode step, 32 requests running: min {lo:.1f} us, median {med:.1f} us")


if __name__ == "__main__":
    main()
