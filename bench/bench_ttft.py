"""TTFT of a repeated prompt, served by each cache tier, against its physical floor.

    .venv/bin/python -m bench.bench_ttft [--sizes 1024,4096,8192] [--repeats 3]
                                         [--quick] [--skip-lmcache]
    .venv/bin/python -m bench.bench_ttft --render [bench/results/ttft.json]   # markdown only

Runs in one parent process that starts one vLLM engine subprocess at a time
(``bench.ttft_engine``), plus LMCache's server when LMCache is measured, and writes
``bench/results/ttft.json`` and ``bench/results/ttft.md`` (also printed). For every
prompt size (random token ids, distinct per size, scenario and run) it measures the
median TTFT (``LLM.generate``, ``max_tokens=1``) of:

  cold            no cache anywhere (our connector on, nothing stored yet)
  l0              vLLM's own prefix cache (same prompt again; our connector told not to
                  load, ``kvcache_load: false``, so it does not top up the last block)
  ours-dram       vLLM prefix cache reset, our DRAM tier serves the prompt
  ours-disk       DRAM tier off, our disk tier serves it, page cache dropped first
  ours-l3         DRAM and disk tiers off, our shared tier (L3) serves it: a ``file://``
                  folder read through the tier's bandwidth cap at 1.8 GB/s (the
                  cross-node rate AWS reported for Curvine; ``--l3-bandwidth``)
  lmcache-dram    LMCache (multiprocess connector, own server) L1 hit
  lmcache-disk    fresh LMCache server and engine, L1 empty, fs L2 populated, page cache dropped
  example-warm    vLLM's ExampleConnector, its safetensors files in the page cache
  example-disk    the same, page cache dropped

Floors, two per tier: ``floor = l0 + KV bytes / bandwidth`` (the acceptance target's
floor: vLLM's own prefix-cache hit, which stops at the last whole block and computes the
rest, up to 127 tokens) and ``1-token floor = l0 1-token + KV bytes / bandwidth``, where
``l0 1-token`` is a prefix-cache hit that computes exactly one token (the prompt plus one
token, sent right after the prompt): the compute no hit can avoid. Bandwidth: memcpy for
DRAM, a cold read for disk, the cap for L3. The KV bytes are those of all but the
prompt's last token (what our hit loads). Both bases are measured alternately with the
tier's hits, in the same engine.
Then the throughput of no-reuse batches with and without our connector (two engines of
each kind alive at once, rounds alternated; see ``run_throughput``).

See bench/README.md for what each row means and the acceptance targets.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench import pagecache, peers, readme, ttft_saved  # noqa: E402
from bench.ttft_engine import EngineProcess  # noqa: E402

# A 12-layer x 768 bf16 model took minutes for one cold 4K prefill on this 2-core AVX2
# machine (no AVX-512/bf16), so the benchmark model is scaled down until a cold 8K
# prefill takes seconds (the results' cold row), in float32 (faster than bf16 here).
# Multi-head attention (kv_heads == heads) keeps the KV large for the compute: 18 KiB
# per token.
MODEL_SHAPE = dict(layers=6, hidden=384, heads=6, kv_heads=6, intermediate=1024, max_positions=16384)
DTYPE = "float32"
BLOCK = 128  # vLLM's block size on the CPU
LMCACHE_CHUNK = 256
SETTLE_S = 0.3  # idle time before each timed request (write-behind of the last one lands)

TARGETS = {
    "dram_vs_l0": 1.3,  # ours-dram <= 1.3 x l0
    "disk_vs_floor": 1.3,  # ours-disk <= 1.3 x disk floor
    "throughput": 0.97,  # no-reuse throughput with connector >= 0.97 x without
}


@dataclass
class Row:
    scenario: str
    size: int
    samples_s: list = field(default_factory=list)
    hit_tokens: list = field(default_factory=list)
    detail: list = field(default_factory=list)
    error: str = ""

    @property
    def median_ms(self) -> Optional[float]:
        return statistics.median(self.samples_s) * 1e3 if self.samples_s else None


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.sizes = args.sizes
        self.repeats = args.repeats  # samples that each need a cold prefill
        self.hit_repeats = args.hit_repeats  # samples of a hit (cheap)
        self.salt = args.salt
        self.work = args.workdir
        self.shm = args.shmdir
        self.logs = os.path.join(self.work, "logs")
        os.makedirs(self.logs, exist_ok=True)
        os.makedirs(self.shm, exist_ok=True)
        self.rows: dict[tuple[str, int], Row] = {}
        self.errors: list[str] = []
        self.timings: dict[str, float] = {}
        self.checks: list[dict] = []
        self.measured: dict[tuple[str, int], str] = {}  # rows kept from a saved run (bench.ttft_saved)
        self.bandwidth: dict = {}
        self.bytes_per_token = self.bytes_per_token_of(args.shape)
        self.max_model_len = max(self.sizes) + 256
        self.engine_env = {**peers.ENGINE_ENV, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space_gib)}

    # -- helpers ---------------------------------------------------------------
    @staticmethod
    def bytes_per_token_of(shape: dict) -> int:
        """KV bytes per token: layers x (K, V) x kv_heads x head_dim x 4 (float32)."""
        return shape["layers"] * 2 * shape["kv_heads"] * (shape["hidden"] // shape["heads"]) * 4

    def prompt(self, tag: str, size: int, i: int = 0) -> list[int]:
        rng = random.Random(f"{self.salt}/{tag}/{size}/{i}")
        return [rng.randrange(256) for _ in range(size)]

    @staticmethod
    def loadable(size: int, unit: int = BLOCK) -> int:
        """Tokens a hit can load in whole ``unit``s (vLLM's prefix cache: blocks): the
        prompt less its last token, rounded down."""
        return (size - 1) // unit * unit

    @staticmethod
    def ours(size: int) -> int:
        """Tokens our hit loads: all but the last, which vLLM computes for its logits."""
        return size - 1

    def row(self, scenario: str, size: int) -> Row:
        return self.rows.setdefault((scenario, size), Row(scenario, size))

    def engine(
        self,
        name: str,
        kv_transfer: Optional[dict],
        wait: bool = True,
        log_stats: bool = False,
        kv_events: Optional[dict] = None,
    ) -> EngineProcess:
        """``log_stats``: vLLM's stat loggers on, so the engine answers ``op="metrics"``;
        ``kv_events``: vLLM's ``KVEventsConfig`` fields (its KV events published)."""
        spec = {
            "model": self.args.model_path,
            "dtype": DTYPE,
            "max_model_len": self.max_model_len,
            "kv_transfer": kv_transfer,
            "log_stats": log_stats,
            "kv_events": kv_events,
        }
        log(f"[{name}] starting engine")
        e = EngineProcess(spec, os.path.join(self.logs, f"{name}.log"), env=self.engine_env, wait=wait)
        if not wait:
            return e
        self.timings[f"start:{name}"] = e.start_seconds
        log(f"[{name}] engine up in {e.start_seconds:.0f}s")
        return e

    def ttft(self, e: EngineProcess, prompt: list[int], reset: bool, ours: bool = True) -> dict:
        """One timed request; ``ours=False`` asks our connector not to load (vLLM's own
        prefix cache alone: the l0 rows of our engines)."""
        time.sleep(SETTLE_S)
        extra = {} if ours else {"kv_transfer_params": {"kvcache_load": False}}
        return e.call(op="ttft", prompt=prompt, reset=reset, **extra)

    def record(self, scenario: str, size: int, r: dict, hit: int, **detail) -> None:
        row = self.row(scenario, size)
        row.samples_s.append(r["seconds"])
        row.hit_tokens.append(hit)
        row.detail.append(
            {
                k: v
                for k, v in {
                    **detail,
                    "kv_transfer_params": r.get("kv_transfer_params"),
                    "loadavg_1m": round(os.getloadavg()[0], 2),
                }.items()
                if v is not None
            }
        )
        log(f"  {scenario:13s} {size:6d}  {r['seconds'] * 1e3:9.1f} ms  hit {hit}")

    @staticmethod
    def ours_loaded(r: dict, tier: str, want: int) -> int:
        """Tokens our connector loaded from ``tier``; fails loudly if it served anything else."""
        got = (r.get("kv_transfer_params") or {}).get("kvcache_loaded_tokens") or {}
        if got != {tier: want}:
            raise AssertionError(
                f"expected a {tier} hit of {want} tokens, got kv_transfer_params="
                f"{r.get('kv_transfer_params')} (num_cached_tokens={r['num_cached_tokens']})"
            )
        return want

    @staticmethod
    def peer_hit(r: dict, want: int, who: str) -> int:
        got = r["num_cached_tokens"]
        if got < want:
            raise AssertionError(f"{who}: expected at least {want} cached tokens, got {got}")
        return got

    def drop(self, folder: str, scenario: str, size: int) -> dict:
        """Drop ``folder`` from the page cache and check it; pages still being written
        back cannot be dropped, so retry for a few seconds before failing. Returns the
        bytes still resident (``resident_after_drop``), to record with the sample."""
        for attempt in range(20):  # noqa: B007 (read after the loop)
            check = pagecache.drop_checked(folder)
            if check["resident_after"] <= 0.01 * max(check["bytes"], 1):
                break
            time.sleep(0.5)
        self.checks.append({"scenario": scenario, "size": size, "attempts": attempt + 1, **check})
        if check["resident_after"] > 0.01 * max(check["bytes"], 1):
            raise AssertionError(
                f"{scenario}: {check['resident_after']:,} of {check['bytes']:,} bytes "
                f"still in the page cache after dropping {folder}"
            )
        return {"resident_after_drop": check["resident_after"]}

    @staticmethod
    def wait_stable(folder: str, min_bytes: int = 0, quiet_s: float = 1.0, timeout: float = 120) -> int:
        """Wait until ``folder`` holds at least ``min_bytes`` and stops changing (write-behind done)."""
        deadline = time.monotonic() + timeout
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            files = pagecache.files_under(folder)
            state = []
            for f in files:
                try:
                    state.append((f, os.stat(f).st_size))
                except FileNotFoundError:
                    pass
            total = sum(s for _, s in state)
            busy = any(".tmp" in f for f, _ in state)
            if state != last or busy or total < min_bytes:
                last, since = state, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return total
            time.sleep(0.2)
        raise TimeoutError(f"{folder} did not settle with >= {min_bytes:,} bytes")

    def scenario(self, name: str, fn: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # keep measuring the rest; the run still fails at the end
            msg = f"{name}: {type(e).__name__}: {e}"
            self.errors.append(msg)
            log("FAILED " + msg)
            traceback.print_exc()
            for row_name in self.ROWS_OF.get(name, []):
                for size in self.sizes:
                    row = self.row(row_name, size)
                    if len(row.samples_s) < self.repeats:
                        row.error = msg
        self.timings[name] = time.perf_counter() - t0

    # -- scenarios -------------------------------------------------------------
    def run_ours_dram(self) -> None:
        """cold, l0 and ours-dram in one engine: DRAM tier only, prefix caching on."""
        kv = peers.ours(
            os.path.join(self.shm, "ours-dram"), self.args.dram_size, os.path.join(self.work, "ours-dram-nodisk"), "0"
        )
        with self.engine("ours-dram", kv) as e:
            for size in self.sizes:  # warm-up: each path once per size
                w = self.prompt("ours-dram-warm", size)
                self.ttft(e, w, reset=False)
                self.ttft(e, w, reset=False)
                self.ours_loaded(self.ttft(e, w, reset=True), "dram", self.ours(size))
            for size in self.sizes:
                prompts = [self.prompt("ours-cold", size, i) for i in range(self.repeats)]
                for p in prompts:
                    self.row("cold", size)
                    r = self.ttft(e, p, reset=False)
                    self.record("cold", size, r, r["num_cached_tokens"])
                    if r["num_cached_tokens"]:
                        raise AssertionError(f"cold prompt hit {r['num_cached_tokens']} tokens")
                # Alternate the two rows compared by the DRAM target, so drift in the
                # machine's load hits both alike: DRAM hit (prefix cache reset), then the
                # same prompt again, now in vLLM's prefix cache (l0).
                for i in range(self.hit_repeats):
                    p = prompts[i % len(prompts)]
                    r = self.ttft(e, p, reset=True)
                    self.record("ours-dram", size, r, self.ours_loaded(r, "dram", self.ours(size)))
                    r = self.ttft(e, p, reset=False, ours=False)
                    self.record("l0", size, r, self.peer_hit(r, self.loadable(size), "l0"))
                    if (r.get("kv_transfer_params") or {}).get("kvcache_loaded_tokens"):
                        raise AssertionError(f"l0 hit also loaded from our tiers: {r['kv_transfer_params']}")
                    self.one_token_l0(e, p, "l0 1-token", size)

    def run_ours_disk(self) -> None:
        """ours-disk, each sample followed by the same prompt from vLLM's prefix cache
        ("l0 (disk engine)"): the disk floor is built on that paired l0."""
        disk = os.path.join(self.work, "ours-disk")
        kv = peers.ours(os.path.join(self.shm, "ours-disk-nodram"), "0", disk, self.args.disk_size)
        with self.engine("ours-disk", kv) as e:
            for size in self.sizes:
                p = self.prompt("ours-disk", size)
                self.ttft(e, p, reset=False)  # populate the disk tier (and warm up this size)
                self.wait_stable(disk)
                self.tier_hits(
                    e, "disk", "ours-disk", p, size, before=lambda size=size: self.drop(disk, "ours-disk", size)
                )

    def run_ours_l3(self) -> None:
        """ours-l3, each sample followed by the same prompt from vLLM's prefix cache
        ("l0 (l3 engine)"). No local tiers: every chunk is published to L3 when stored
        (admission "all") and every hit reads it back through the bandwidth cap."""
        root = os.path.join(self.work, "ours-l3")
        local = os.path.join(self.work, "ours-l3-unused")
        kv = peers.ours(
            os.path.join(self.shm, "ours-l3-unused"),
            "0",
            local,
            "0",
            shared_url=f"file://{root}",
            shared_bandwidth=str(int(self.args.l3_bandwidth)),
            shared_admission="all",
        )
        with self.engine("ours-l3", kv) as e:
            for size in self.sizes:
                p = self.prompt("ours-l3", size)
                self.ttft(e, p, reset=False)  # compute and publish (and warm up this size)
                self.wait_stable(root, quiet_s=2.0)
                self.tier_hits(e, "l3", "ours-l3", p, size)

    def tier_hits(
        self,
        e: EngineProcess,
        kind: str,
        row: str,
        p: list[int],
        size: int,
        before: Optional[Callable[[], dict]] = None,
    ) -> None:
        """Samples of ``row``, hits of ``p`` from our ``kind`` tier (prefix cache reset),
        each followed by ``p`` again from vLLM's prefix cache (the engine's l0) and by the
        one-token l0. ``before()`` runs before each hit and returns details to record with
        it. The first round is a warm-up."""
        tier = {"disk": "disk", "l3": "shared"}[kind]
        l0 = "l0" + self.ENGINE_OF[kind]
        for i in range(1 + self.hit_repeats):
            detail = before() if before else {}
            r = self.ttft(e, p, reset=True)
            hit = self.ours_loaded(r, tier, self.ours(size))
            r0 = self.ttft(e, p, reset=False, ours=False)
            hit0 = self.peer_hit(r0, self.loadable(size), l0)
            if i:
                self.record(row, size, r, hit, **detail)
                self.record(l0, size, r0, hit0)
            self.one_token_l0(e, p, "l0 1-token" + self.ENGINE_OF[kind], size, record=bool(i))

    def one_token_l0(self, e: EngineProcess, p: list[int], row: str, size: int, record: bool = True) -> None:
        """The base of the floors: ``p`` plus one token, right after ``p`` itself was
        served, so vLLM's prefix cache holds all of ``p`` (whole blocks) and exactly one
        token is computed, as in a hit that loads all but the last token."""
        r = self.ttft(e, p + p[:1], reset=False, ours=False)
        hit = self.peer_hit(r, size, row)
        if record:
            self.record(row, size, r, hit)

    def run_lmcache(self) -> None:
        """lmcache-dram against its first server; lmcache-disk against a fresh server
        (empty L1) over the same L2 folder, from a fresh engine, page cache dropped."""
        l2 = os.path.join(self.work, "lmcache-l2")
        want = lambda size: self.loadable(size, LMCACHE_CHUNK)  # noqa: E731
        warm = self.prompt("lmcache-warm", min(self.sizes))
        server = peers.LMCacheServer(os.path.join(self.logs, "lmcache-server-1.log"), self.args.lmcache_l1_gb, l2)
        try:
            with self.engine("lmcache-dram", peers.lmcache(server.port)) as e:
                self.ttft(e, warm, reset=False)
                time.sleep(1.0)  # its store is asynchronous
                self.peer_hit(self.ttft(e, warm, reset=True), want(min(self.sizes)), "lmcache warm-up")
                for size in self.sizes:
                    prompts = [self.prompt("lmcache", size, i) for i in range(self.repeats)]
                    for p in prompts:
                        r = self.ttft(e, p, reset=False)  # populate L1 (and L2 behind it)
                        self.row("lmcache-cold", size)
                        self.record("lmcache-cold", size, r, r["num_cached_tokens"])
                    time.sleep(1.0)
                    for i in range(1 + self.hit_repeats):  # the first hit is a warm-up
                        r = self.ttft(e, prompts[i % len(prompts)], reset=True)
                        hit = self.peer_hit(r, want(size), "lmcache-dram")
                        if i:
                            self.record("lmcache-dram", size, r, hit)
            l2_bytes = self.wait_stable(l2, quiet_s=3.0)
            log(f"[lmcache] L2 holds {l2_bytes:,} bytes in {len(pagecache.files_under(l2))} files")
        finally:
            server.stop()
        server = peers.LMCacheServer(os.path.join(self.logs, "lmcache-server-2.log"), self.args.lmcache_l1_gb, l2)
        try:
            with self.engine("lmcache-disk", peers.lmcache(server.port)) as e:
                # Warm-up: a cold request, then one disk hit. (Every LMCache hit here
                # recomputes one token whatever the size, so one warm-up covers all sizes.)
                self.ttft(e, self.prompt("lmcache-disk-warm-cold", min(self.sizes)), reset=False)
                self.wait_stable(l2, quiet_s=2.0)  # its write-behind to L2
                self.drop(l2, "lmcache-disk-warmup", min(self.sizes))
                self.peer_hit(self.ttft(e, warm, reset=True), want(min(self.sizes)), "lmcache-disk warm-up")
                for size in self.sizes:
                    for i in range(self.repeats):  # each prompt once: a hit promotes it to L1
                        self.drop(l2, "lmcache-disk", size)
                        r = self.ttft(e, self.prompt("lmcache", size, i), reset=True)
                        self.record(
                            "lmcache-disk",
                            size,
                            r,
                            self.peer_hit(r, want(size), "lmcache-disk"),
                            resident_after_drop=self.checks[-1]["resident_after"],
                        )
        finally:
            server.stop()

    def run_example(self) -> None:
        store = os.path.join(self.work, "example")
        os.makedirs(store, exist_ok=True)
        with self.engine("example", peers.example(store)) as e:
            for size in self.sizes:
                p = self.prompt("example", size)
                self.ttft(e, p, reset=False)  # populate (saved synchronously, layer by layer)
                self.peer_hit(self.ttft(e, p, reset=True), self.loadable(size), "example warm-up")
                # Each sample followed by the same prompt from vLLM's prefix cache
                # ("l0 (example engine)"), as ours are: the hit's cost over l0 in its engine.
                for row in ("example-warm", "example-disk"):
                    for _ in range(self.hit_repeats):
                        detail = self.drop(store, row, size) if row == "example-disk" else {}
                        r = self.ttft(e, p, reset=True)
                        self.record(row, size, r, self.peer_hit(r, self.loadable(size), row), **detail)
                        r0 = self.ttft(e, p, reset=False)
                        l0 = "l0 (example engine)"
                        self.record(l0, size, r0, self.peer_hit(r0, self.loadable(size), l0))

    def run_throughput(self) -> None:
        """No reuse: batches of distinct prompts, with and without our connector.

        ``--tput-instances`` engines of each kind are alive at once and take turns, every
        round in the opposite order of the last. Two engines of one configuration differ
        by several per cent on this machine for as long as they live, so one engine per
        kind would compare two instances more than two configurations: the spread
        between same-kind instances is reported beside the ratio
        (``summarize_throughput``)."""
        a = self.args
        names = [f"{kind}-{i}" for i in range(a.tput_instances) for kind in ("without", "with")]
        engines = {}
        try:
            for name in names:  # all start at once (nothing is timed yet)
                kv = events = None
                if name.startswith("with-"):
                    kv = peers.ours(
                        os.path.join(self.shm, f"tput-{name}"),
                        a.tput_dram_size,
                        os.path.join(self.work, "tput-disk", name),
                        a.disk_size,
                    )
                    if a.tput_kv_events:  # published to a local port nobody reads: the cost is ours
                        events = {
                            "enable_kv_cache_events": True,
                            "publisher": "zmq",
                            "endpoint": f"tcp://*:{peers.free_port()}",
                        }
                engines[name] = self.engine(f"tput-{name}", kv, wait=False, kv_events=events)
            for name, e in engines.items():
                e.wait_ready()
                self.timings[f"start:tput-{name}"] = e.start_seconds

            def batch(tag, r):
                return [self.prompt(f"tput-{tag}-{r}", a.tput_len, i) for i in range(a.tput_prompts)]

            for name, e in engines.items():  # warm-up: one whole batch each, untimed
                e.call(op="batch", prompts=batch(f"warm-{name}", 0), max_tokens=a.tput_max_tokens)
            self.tput = {name: [] for name in names}
            for rnd in range(a.tput_rounds):
                for name in names if rnd % 2 == 0 else names[::-1]:
                    time.sleep(2.0)  # the other engines' write-behind is done
                    r = engines[name].call(op="batch", prompts=batch(name, rnd + 1), max_tokens=a.tput_max_tokens)
                    tps = (r["prompt_tokens"] + r["output_tokens"]) / r["seconds"]
                    self.tput[name].append({**r, "tokens_per_s": tps})
                    log(f"  throughput {name:10s} round {rnd}: {r['seconds']:.2f}s  {tps:,.0f} tok/s")
        finally:
            for e in engines.values():
                e.close()

    # -- floors ------------------------------------------------------------------
    def measure_floors(self) -> None:
        self.bandwidth = {}
        for size in self.sizes:
            nbytes = self.ours(size) * self.bytes_per_token
            self.bandwidth[size] = {
                "kv_bytes": nbytes,
                "dram": pagecache.dram_bandwidth(nbytes),
                "disk": pagecache.disk_bandwidth(nbytes, os.path.join(self.work, "bandwidth")),
            }
            b = self.bandwidth[size]
            log(
                f"  {size:6d} tokens: KV {nbytes / 2**20:7.1f} MiB  memcpy {b['dram']['best'] / 1e9:5.2f} GB/s"
                f"  cold read {b['disk']['bytes_per_s'] / 1e9:5.2f} GB/s"
            )

    # -- report ------------------------------------------------------------------
    # Suffix of the rows measured in a tier's own engine ("l0 (disk engine)" ...).
    ENGINE_OF = {"dram": "", "disk": " (disk engine)", "l3": " (l3 engine)"}

    def l0_for(self, kind: Optional[str], size: int) -> Optional[Row]:
        own = "l0" + self.ENGINE_OF.get(kind or "", "")
        for name in dict.fromkeys((own, "l0")):
            row = self.rows.get((name, size))
            if row is not None and row.median_ms is not None:
                return row
        return None

    def floor_ms(self, kind: str, size: int, one_token: bool = False) -> Optional[float]:
        """One floor per tier and size: a prefix-cache hit measured alongside that tier's
        hits in our engine, plus the time to move the KV of all but the last token at the
        tier's bandwidth. The base is the issue's l0 (vLLM's own hit, which computes the
        last partial block) or, with ``one_token``, the one-token hit ("l0 1-token ...":
        the compute no hit can avoid)."""
        l0 = self.rows.get(("l0 1-token" + self.ENGINE_OF[kind], size)) if one_token else self.l0_for(kind, size)
        if l0 is None or l0.median_ms is None:
            return None
        b = self.bandwidth[size]
        bw = {"dram": b["dram"]["best"], "disk": b["disk"]["bytes_per_s"], "l3": self.args.l3_bandwidth}[kind]
        return l0.median_ms + b["kv_bytes"] / bw * 1e3

    ROWS_OF = {
        "ours-dram": ["cold", "l0", "ours-dram"],
        "ours-disk": ["ours-disk", "l0 (disk engine)"],
        "ours-l3": ["ours-l3", "l0 (l3 engine)"],
        "lmcache": ["lmcache-dram", "lmcache-disk"],
        "example": ["example-warm", "example-disk", "l0 (example engine)"],
    }
    # The l0 measured alternately with each hit row, in the same engine.
    PAIRED_L0 = {
        "ours-dram": "l0",
        "ours-disk": "l0 (disk engine)",
        "ours-l3": "l0 (l3 engine)",
        "example-warm": "l0 (example engine)",
        "example-disk": "l0 (example engine)",
    }
    FLOOR_KIND = {
        "ours-dram": "dram",
        "lmcache-dram": "dram",
        "example-warm": "dram",
        "ours-disk": "disk",
        "lmcache-disk": "disk",
        "example-disk": "disk",
        "ours-l3": "l3",
    }
    ORDER = [
        "cold",
        "l0",
        "l0 1-token",
        "ours-dram",
        "lmcache-dram",
        "l0 (example engine)",
        "example-warm",
        "l0 (disk engine)",
        "l0 1-token (disk engine)",
        "ours-disk",
        "lmcache-disk",
        "example-disk",
        "l0 (l3 engine)",
        "l0 1-token (l3 engine)",
        "ours-l3",
        "lmcache-cold",
    ]

    def ratio(self, a: str, b: str, size: int) -> Optional[float]:
        ra, rb = self.rows.get((a, size)), self.rows.get((b, size))
        if not ra or not rb or ra.median_ms is None or rb.median_ms is None:
            return None
        return ra.median_ms / rb.median_ms

    def summary(self) -> dict:
        table = []
        for size in self.sizes:
            for name in self.ORDER:
                row = self.rows.get((name, size))
                if row is None:
                    continue
                kind = self.FLOOR_KIND.get(name)
                floor = self.floor_ms(kind, size) if kind else None
                floor1 = self.floor_ms(kind, size, one_token=True) if kind else None
                med = row.median_ms
                l0 = self.l0_for(kind, size)
                table.append(
                    {
                        "scenario": name,
                        "size": size,
                        "median_ms": med,
                        "samples_ms": [s * 1e3 for s in row.samples_s],
                        "hit_tokens": row.hit_tokens,
                        "floor_kind": kind,
                        "floor_ms": floor,
                        "vs_floor": med / floor if med and floor else None,
                        "floor1_ms": floor1,
                        "vs_floor1": med / floor1 if med and floor1 else None,
                        "vs_l0": med / l0.median_ms if med and l0 and l0.median_ms else None,
                        "over_paired_l0_ms": self.over_paired(name, size),
                        "error": row.error,
                        "detail": row.detail,
                    }
                )
        targets = []
        for size in self.sizes:
            checks = [
                ("ours-dram / l0", self.ratio("ours-dram", "l0", size), TARGETS["dram_vs_l0"]),
                ("ours-disk / disk floor", self._vs_floor("ours-disk", size), TARGETS["disk_vs_floor"]),
                ("ours-dram / lmcache-dram", self.ratio("ours-dram", "lmcache-dram", size), 1.0),
                ("ours-disk / lmcache-disk", self.ratio("ours-disk", "lmcache-disk", size), 1.0),
                ("ours-dram / example-warm", self.ratio("ours-dram", "example-warm", size), 1.0),
                ("ours-disk / example-disk", self.ratio("ours-disk", "example-disk", size), 1.0),
                ("ours-dram / cold", self.ratio("ours-dram", "cold", size), None),
                ("ours-disk / cold", self.ratio("ours-disk", "cold", size), None),
                ("ours-disk / disk 1-token floor", self._vs_floor("ours-disk", size, True), None),
                ("ours-dram / dram 1-token floor", self._vs_floor("ours-dram", size, True), None),
                ("ours-l3 / l3 floor", self._vs_floor("ours-l3", size), None),
                ("ours-l3 / l3 1-token floor", self._vs_floor("ours-l3", size, True), None),
                ("ours-l3 / cold", self.ratio("ours-l3", "cold", size), None),
            ]
            for name, value, limit in checks:
                ok = None if value is None or limit is None else (value <= limit if limit != 1.0 else value < 1.0)
                targets.append({"size": size, "ratio": name, "value": value, "target": limit, "met": ok})
        tput_summary = summarize_throughput(getattr(self, "tput", None) or {})
        return {"table": table, "targets": targets, "throughput": tput_summary}

    def over_paired(self, name: str, size: int) -> Optional[float]:
        """Median TTFT minus the median of the l0 measured alternately with it."""
        row, l0 = self.rows.get((name, size)), self.rows.get((self.PAIRED_L0.get(name, ""), size))
        if not row or not l0 or row.median_ms is None or l0.median_ms is None:
            return None
        return row.median_ms - l0.median_ms

    def _vs_floor(self, name: str, size: int, one_token: bool = False) -> Optional[float]:
        row = self.rows.get((name, size))
        floor = self.floor_ms(self.FLOOR_KIND[name], size, one_token)
        return row.median_ms / floor if row and row.median_ms and floor else None


def fmt(x, spec=".1f", none="–") -> str:
    return none if x is None else format(x, spec)


def markdown(result: dict) -> str:
    cfg = result["config"]
    s = result["summary"]
    lines = [
        "# TTFT by cache tier",
        "",
        f"Model: random-weight Llama, {cfg['shape']}, {cfg['dtype']}, "
        f"{cfg['bytes_per_token']:,} KV bytes/token; vLLM CPU {cfg['vllm']}, block {BLOCK}, "
        f"chunk 256. Median of {cfg['repeats']} samples (cold, lmcache-disk) or {cfg['hit_repeats']} (other hits); "
        f"TTFT = `LLM.generate`, max_tokens=1. "
        f"Machine: {cfg['machine']}. Run took {result['wall_s'] / 60:.1f} min.",
        "",
        "TTFT / l0: against the l0 row of the same tier's engine (l0 for DRAM rows, "
        "l0 (disk engine) for disk rows, l0 (l3 engine) for L3 rows); "
        "hit tokens: tokens not recomputed (vLLM's num_cached_tokens); "
        "over paired l0: median TTFT minus the median of the l0 hits measured alternately with it "
        "in the same engine (what the connector adds over vLLM's own prefix cache).",
        "",
        "| scenario | prompt tokens | median TTFT ms | min–max ms | hit tokens | floor ms | TTFT / floor "
        "| 1-token floor ms | TTFT / 1-token floor | TTFT / l0 | over paired l0 ms | measured |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    if result.get("restored_rows"):
        lines[4:4] = [
            f"The last run measured some scenarios only; these rows are kept from the saved run "
            f"(floors recomputed with this run's bandwidths): {', '.join(result['restored_rows'])}. "
            "The measured column says when each row was measured; a ratio between rows of two runs "
            "also compares two states of this shared machine (compare the cold and l0 rows of each).",
            "",
        ]
    for r in s["table"]:
        if r["error"] and r["median_ms"] is None:
            lines.append(f"| {r['scenario']} | {r['size']} | FAILED: {r['error'][:80]} | | | | | | |")
            continue
        samples = r["samples_ms"]
        lines.append(
            f"| {r['scenario']} | {r['size']} | {fmt(r['median_ms'])} | "
            f"{fmt(min(samples) if samples else None)}–{fmt(max(samples) if samples else None)} | "
            f"{min(r['hit_tokens']) if r['hit_tokens'] else '–'} | "
            f"{fmt(r['floor_ms'])}{' (' + r['floor_kind'] + ')' if r['floor_kind'] else ''} | "
            f"{fmt(r['vs_floor'], '.2f')} | {fmt(r.get('floor1_ms'))} | {fmt(r.get('vs_floor1'), '.2f')} | "
            f"{fmt(r['vs_l0'], '.2f')} | {fmt(r.get('over_paired_l0_ms'))} | "
            f"{r.get('measured') or ttft_saved.EARLIER} |"
        )
    l3_bw = cfg.get("l3_bandwidth")
    lines += [
        "",
        "Floors: `l0 + KV bytes / bandwidth` (the issue's floor) and `l0 1-token + KV bytes / bandwidth` "
        "(the compute no hit avoids); KV bytes: all but the last token's; bandwidths measured on this machine"
        + (f" (L3: the tier's cap, {l3_bw / 1e9:.1f} GB/s, over a local folder)" if l3_bw else "")
        + ":",
        "",
        "| prompt tokens | KV MiB (our hit) | memcpy GB/s | cold disk read GB/s |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for size, b in result["bandwidth"].items():
        lines.append(
            f"| {size} | {b['kv_bytes'] / 2**20:.1f} | {b['dram']['best'] / 1e9:.2f} | "
            f"{b['disk']['bytes_per_s'] / 1e9:.2f} |"
        )
    lines += [
        "",
        "## Targets",
        "",
        "| prompt tokens | ratio | value | target | met |",
        "| ---: | --- | ---: | ---: | --- |",
    ]
    for t in s["targets"]:
        tgt = "–" if t["target"] is None else ("< 1" if t["target"] == 1.0 else f"≤ {t['target']}")
        met = "–" if t["met"] is None else ("yes" if t["met"] else "**NO**")
        lines.append(f"| {t['size']} | {t['ratio']} | {fmt(t['value'], '.2f')} | {tgt} | {met} |")
    over = {(r["scenario"], r["size"]): r.get("over_paired_l0_ms") for r in s["table"]}
    pairs = [("ours-dram", "example-warm"), ("ours-disk", "example-disk")]
    if any(
        over.get((a, size)) is not None and over.get((b, size)) is not None for a, b in pairs for size in cfg["sizes"]
    ):
        lines += [
            "",
            "Same comparison with each engine's speed cancelled out (ms a hit adds over "
            "the l0 measured alternately with it in its own engine):",
            "",
            "| prompt tokens | ours-dram | example-warm | ours-disk | example-disk |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for size in cfg["sizes"]:
            lines.append(
                f"| {size} | "
                + " | ".join(
                    fmt(over.get((name, size)), "+.1f")
                    for name in ("ours-dram", "example-warm", "ours-disk", "example-disk")
                )
                + " |"
            )
    tp = s["throughput"]
    if tp:
        a = result["config"]["throughput"]
        lines += [
            "",
            "## No-reuse throughput",
            "",
            f"{a['prompts']} distinct prompts of {a['len']} tokens, max_tokens {a['max_tokens']}, "
            f"submitted at once; {a['rounds']} rounds; in each, every engine runs one batch, "
            "in the opposite order of the round before.",
            "",
            "| engine | median tokens/s | rounds (s) |",
            "| --- | ---: | --- |",
        ]
        for name, rounds in sorted(tp["rounds"].items()):
            med = statistics.median(x["tokens_per_s"] for x in rounds)
            lines.append(f"| {name} | {med:,.0f} | " + ", ".join(f"{x['seconds']:.2f}" for x in rounds) + " |")
        lines.append(
            f"\nwith / without, median over rounds of the instances' paired ratio = "
            f"**{tp['ratio']:.3f}** (target ≥ {tp['target']}: {'met' if tp['met'] else 'NOT met'}); "
            f"ratio of the medians {tp.get('ratio_of_medians', tp['ratio']):.3f}"
        )
        if tp.get("instance_spread"):
            lines[-1] += (
                "; the same statistic between two instances of one configuration (what the "
                "ratio reads when nothing differs): "
                + ", ".join(f"{k} {v:.3f}" for k, v in tp["instance_spread"].items())
            )
        run = result.get("throughput_run")
        if run:
            lines[-1] += (
                f". Measured in a throughput-only run ({run.get('utc', 'date not recorded')}; "
                f"machine: {run['machine']}; {run['wall_s'] / 60:.1f} min)"
            )
    if result["errors"]:
        lines += ["", "## Errors", ""] + [f"- {e}" for e in result["errors"]]
    return "\n".join(lines) + "\n"


def summarize_throughput(rounds: dict) -> Optional[dict]:
    """The no-reuse throughput figures from each engine's rounds (``{"with-0": [...],
    "without-0": [...], ...}``, one entry per round, tokens per second).

    ``ratio`` (checked against the target): the median over rounds of the geometric
    mean of the "with" instances over that of the "without" instances, so the machine's
    drift between rounds cancels. ``instance_spread``: the same statistic between two
    instances of one configuration (first over second, each kind), i.e. what the ratio
    would read if the connector changed nothing."""
    kinds = {k: sorted(n for n in rounds if n.rsplit("-", 1)[0] == k) for k in ("with", "without")}
    if not all(kinds.values()) or not all(rounds[n] for n in rounds):
        return None
    n_rounds = min(len(v) for v in rounds.values())

    def tps(name: str, r: int) -> float:
        return rounds[name][r]["tokens_per_s"]

    def gmean(xs) -> float:
        return math.exp(sum(map(math.log, xs)) / len(xs))

    def per_round(a: list, b: list) -> float:
        return statistics.median(gmean([tps(n, r) for n in a]) / gmean([tps(n, r) for n in b]) for r in range(n_rounds))

    medians = {k: statistics.median(tps(n, r) for n in names for r in range(n_rounds)) for k, names in kinds.items()}
    ratio = per_round(kinds["with"], kinds["without"])
    spread = {k: per_round(names[:1], names[1:2]) for k, names in kinds.items() if len(names) > 1}
    return {
        "with_tokens_per_s": medians["with"],
        "without_tokens_per_s": medians["without"],
        "ratio_of_medians": medians["with"] / medians["without"],
        "ratio": ratio,
        "instance_spread": spread,
        "target": TARGETS["throughput"],
        "met": ratio >= TARGETS["throughput"],
        "rounds": rounds,
    }


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1024,4096,8192", help="prompt sizes in tokens")
    p.add_argument(
        "--repeats", type=int, default=3, help="samples of rows that need a cold prefill each (cold, lmcache-disk)"
    )
    p.add_argument("--hit-repeats", type=int, default=5, help="samples of every other hit row")
    p.add_argument("--quick", action="store_true", help="smoke run: sizes 512,1024, small throughput batch")
    p.add_argument("--skip-lmcache", action="store_true")
    p.add_argument("--only", default="", help="comma list of: ours-dram,ours-disk,ours-l3,lmcache,example,throughput")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    p.add_argument("--workdir", default="/tmp/kvbench-ttft")
    p.add_argument("--shmdir", default="/dev/shm/kvbench-ttft")
    p.add_argument("--keep-workdir", action="store_true", help="keep the stores (for profiling)")
    p.add_argument("--model-path", default="/tmp/kvbench-ttft-model")
    p.add_argument("--kv-space-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE per engine")
    p.add_argument("--dram-size", default="2GiB")
    p.add_argument("--disk-size", default="4GiB")
    p.add_argument("--lmcache-l1-gb", type=float, default=2.0)
    p.add_argument(
        "--l3-bandwidth",
        type=float,
        default=1.8e9,
        help="bytes/s cap of the shared tier in the ours-l3 row (Curvine cross-node: 1.8 GB/s)",
    )
    p.add_argument("--tput-prompts", type=int, default=8)
    p.add_argument("--tput-len", type=int, default=1024)
    p.add_argument("--tput-max-tokens", type=int, default=16)
    p.add_argument("--tput-rounds", type=int, default=10)
    p.add_argument("--tput-instances", type=int, default=2, help="engines of each kind (with, without)")
    p.add_argument("--tput-dram-size", default="1GiB")
    p.add_argument(
        "--tput-kv-events",
        action="store_true",
        help="the engines with our connector publish vLLM's KV events (the tiers' too)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.sizes = "512,1024" if args.sizes == "1024,4096,8192" else args.sizes
        args.tput_prompts, args.tput_len, args.tput_max_tokens, args.tput_rounds = 4, 512, 8, 2
    args.sizes = [int(x) for x in args.sizes.split(",")]
    if any(s % LMCACHE_CHUNK or s <= BLOCK for s in args.sizes):
        p.error(f"sizes must be multiples of {LMCACHE_CHUNK}")
    args.shape = dict(MODEL_SHAPE)
    args.salt = f"{time.time_ns()}"
    return args


README_ROWS = [
    "cold",
    "l0",
    "l0 1-token",
    "ours-dram",
    "lmcache-dram",
    "example-warm",
    "ours-disk",
    "lmcache-disk",
    "example-disk",
    "ours-l3",
]


def readme_section(result: dict) -> str:
    """bench/README.md's summary of a run: median TTFT per row and size, the floors, the
    acceptance targets and the throughput ratio."""
    cfg, s = result["config"], result["summary"]
    sizes = cfg["sizes"]
    by = {(r["scenario"], r["size"]): r for r in s["table"]}
    head = "| | " + " | ".join(f"{n} tokens" for n in sizes) + " |"
    rule = "| --- |" + " ---: |" * len(sizes)
    kept = result.get("restored_rows")
    lines = [
        f"Median TTFT in ms ({cfg['machine']}; model and method: "
        "[bench/results/ttft.md](results/ttft.md)"
        + (f"; kept from an earlier run: {', '.join(kept)}" if kept else "")
        + "):",
        "",
        head,
        rule,
    ]
    for name in README_ROWS:
        if any((name, n) in by for n in sizes):
            lines.append(f"| {name} | " + " | ".join(fmt(by.get((name, n), {}).get("median_ms")) for n in sizes) + " |")
    for kind, row in (("dram", "ours-dram"), ("disk", "ours-disk"), ("l3", "ours-l3")):
        for key, label in (("floor_ms", f"{kind} floor (l0 + KV / bandwidth)"), ("floor1_ms", f"{kind} 1-token floor")):
            vals = [by.get((row, n), {}).get(key) for n in sizes]
            if any(v is not None for v in vals):
                lines.append(f"| {label} | " + " | ".join(fmt(v) for v in vals) + " |")
    lines += [
        "",
        "| ratio | " + " | ".join(str(n) for n in sizes) + " | target |",
        "| --- |" + " ---: |" * len(sizes) + " --- |",
    ]
    targets: dict = {}
    for t in s["targets"]:
        targets.setdefault(t["ratio"], {})[t["size"]] = t
    for name, per in targets.items():
        if all(t["value"] is None for t in per.values()):
            continue
        limit = next(iter(per.values()))["target"]
        cells = []
        for n in sizes:
            t = per.get(n)
            v = fmt(t["value"], ".2f") if t else "–"
            cells.append(f"**{v}**" if t and t["met"] is False else v)
        tgt = "–" if limit is None else ("< 1" if limit == 1.0 else f"≤ {limit}")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {tgt} |")
    tp = s["throughput"]
    if tp:
        n = len(next(iter(tp["rounds"].values())))
        spread = tp.get("instance_spread") or {}
        lines += [
            "",
            f"No-reuse throughput, with / without the connector: **{tp['ratio']:.3f}** "
            f"(median of {n} alternated rounds' paired ratios; target ≥ {tp['target']}; medians "
            f"{tp['with_tokens_per_s']:,.0f} vs {tp['without_tokens_per_s']:,.0f} tokens/s"
            + (
                "; two instances of one configuration read " + " and ".join(f"{v:.3f}" for v in spread.values())
                if spread
                else ""
            )
            + ").",
        ]
    if result.get("errors"):
        lines += ["", "Errors in this run: " + "; ".join(result["errors"])]
    return "\n".join(lines)


def write_readme(result: dict) -> bool:
    """bench/README.md's ``bench_ttft`` section from ``result``; False when it has none."""
    return readme.replace_section("bench_ttft", readme_section(result))


def render(json_path: str) -> None:
    """Rewrite the markdown next to a saved ttft.json, and bench/README.md's section when it
    is the committed result (no measurement)."""
    with open(json_path) as f:
        result = json.load(f)
    md = markdown(result)
    out = os.path.dirname(os.path.abspath(json_path))
    with open(os.path.join(out, "ttft.md"), "w") as f:
        f.write(md)
    if out == os.path.join(REPO, "bench", "results"):
        write_readme(result)
    print(md)


def merge_throughput(saved_path: str, new: dict) -> dict:
    """A saved full run with its throughput part (figures, settings, engine start times)
    replaced by those of ``new``, a throughput-only run."""
    with open(saved_path) as f:
        result = json.load(f)
    result["summary"]["throughput"] = new["summary"]["throughput"]
    result["config"]["throughput"] = new["config"]["throughput"]
    timings = {k: v for k, v in result.get("timings_s", {}).items() if not k.startswith("start:tput-")}
    result["timings_s"] = {**timings, **{k: v for k, v in new["timings_s"].items() if k.startswith("start:tput-")}}
    result["throughput_run"] = {
        "machine": new["config"]["machine"],
        "wall_s": new["wall_s"],
        "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    return result


def fresh_bench(args) -> "Bench":
    """A ``Bench`` over the generated model (built if missing) and empty tier folders."""
    from serving.default_model import ModelShape, ensure_model

    ensure_model(args.model_path, ModelShape(**args.shape))
    for d in (args.workdir, args.shmdir):
        shutil.rmtree(d, ignore_errors=True)
    return Bench(args)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--render"]:
        render(argv[1] if len(argv) > 1 else os.path.join(REPO, "bench", "results", "ttft.json"))
        return 0
    args = parse_args(argv)
    t_start = time.perf_counter()
    bench = fresh_bench(args)
    only = set(filter(None, args.only.split(",")))
    want = lambda name: not only or name in only  # noqa: E731
    load_before = os.getloadavg()
    try:
        log("floors: bandwidth of a memory copy and of a cold disk read, per prompt size")
        bench.measure_floors()
        if want("ours-dram"):
            bench.scenario("ours-dram", bench.run_ours_dram)
        if want("ours-disk"):
            bench.scenario("ours-disk", bench.run_ours_disk)
        if want("ours-l3"):
            bench.scenario("ours-l3", bench.run_ours_l3)
        if want("lmcache") and not args.skip_lmcache:
            reason = peers.lmcache_available()
            if reason:
                bench.errors.append(f"lmcache: skipped, {reason}")
            else:
                bench.scenario("lmcache", bench.run_lmcache)
        if want("example"):
            bench.scenario("example", bench.run_example)
        if want("throughput"):
            bench.scenario("throughput", bench.run_throughput)
    finally:
        shutil.rmtree(args.shmdir, ignore_errors=True)
        if not args.keep_workdir:
            for sub in ("ours-dram-nodisk", "ours-disk", "ours-l3", "lmcache-l2", "example", "tput-disk", "bandwidth"):
                shutil.rmtree(os.path.join(args.workdir, sub), ignore_errors=True)
    import vllm

    saved = os.path.join(args.out, "ttft.json")
    restored, old = [], {}
    if only and only != {"throughput"} and os.path.exists(saved):  # keep the rows not run now
        with open(saved) as f:
            old = json.load(f)
        restored = ttft_saved.restore_rows(bench, old, Row, "throughput" in only)
        log(f"kept from {saved}: {', '.join(restored) or 'nothing'}")
    summary = bench.summary()
    ttft_saved.stamp_rows(bench, summary["table"])
    result = {
        "config": {
            "shape": args.shape,
            "dtype": DTYPE,
            "bytes_per_token": bench.bytes_per_token,
            "sizes": args.sizes,
            "repeats": args.repeats,
            "hit_repeats": args.hit_repeats,
            "vllm": vllm.__version__,
            "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, load avg "
            f"{load_before[0]:.1f} at start / {os.getloadavg()[0]:.1f} at end",
            "throughput": {
                "prompts": args.tput_prompts,
                "len": args.tput_len,
                "max_tokens": args.tput_max_tokens,
                "rounds": args.tput_rounds,
                "instances": args.tput_instances,
                "kv_events": args.tput_kv_events,
            },
            "settle_s": SETTLE_S,
            "kv_space_gib": args.kv_space_gib,
            "l3_bandwidth": args.l3_bandwidth,
        },
        "bandwidth": bench.bandwidth,
        "summary": summary,
        "restored_rows": restored,
        "page_cache_checks": bench.checks,
        "timings_s": bench.timings,
        "errors": bench.errors,
        "wall_s": time.perf_counter() - t_start,
    }
    if old.get("throughput_run") and "throughput" not in only:
        result["throughput_run"] = old["throughput_run"]
    os.makedirs(args.out, exist_ok=True)
    if only == {"throughput"} and os.path.exists(saved) and not bench.errors:
        result = merge_throughput(saved, result)
        log(f"merged this throughput run into {saved}; the TTFT rows are those saved there")
    with open(saved, "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    with open(os.path.join(args.out, "ttft.md"), "w") as f:
        f.write(md)
    print("\n" + md)
    log(f"wrote {args.out}/ttft.json and ttft.md; logs in {args.workdir}/logs")
    official = os.path.abspath(args.out) == os.path.join(REPO, "bench", "results")
    if official and (not only or only == {"throughput"} or restored):
        if write_readme(result):
            log("bench/README.md: benchmark section updated")
    return 1 if bench.errors else 0


if __name__ == "__main__":
    sys.exit(main())
