"""Runs one real vLLM engine (CPU build) with TieredKVConnector through a list of steps.

Used by the engine tests as a subprocess (vLLM spawns workers, so each engine lives in
its own process). Reads a JSON spec from argv[1], writes one JSON line per generate
step to stdout prefixed with ``RESULT ``.

The connector reads its configuration as under a plain ``vllm serve``: each engine process
builds it from its own ``KVCACHE_*`` environment (``spec["cache"]``, set here before vLLM
starts its processes), with ``KVCACHE_LOAD_DECISION=always`` unless the spec sets it.

Spec: {"model": PATH, "cache": {KVCACHE_* settings}, "prefix_caching": bool, "log_stats": bool,
       "kv_events": optional {KVEventsConfig fields},
       "steps": [{"prompt_token_ids": [...], "cache_salt": optional, "kv_transfer_params": optional,
                  "prompt_logprobs": optional N} |
                 {"reset_prefix_cache": true} | {"corrupt": [FOLDER, ...]} | {"unsign": [FOLDER, ...]} |
                 {"break": FOLDER, "keep": FOLDER} | {"sleep": S} | {"touch": PATH} |
                 {"wait_for": PATH} | {"engine": true} |
                 {"metrics": PREFIX, "until": optional {LABELLED_NAME: MIN}, "timeout": S} |
                 {"random_batch": [SEED, N, LEN]} | {"damage": [FOLDER, ...]} | {"remove": PATH} |
                 {"fill": FOLDER} | {"unfill": FOLDER}]}

``sleep`` waits S seconds, then until the tiers' folders are quiet (no temporary file, no
change for 0.3 s). ``engine`` reports what vLLM decided about the engine (its hybrid KV cache manager on or
off); ``metrics`` the Prometheus metrics whose names start with PREFIX (needs ``log_stats``),
by name and, under ``labelled``, by ``name{cause=..,mode=..,path=..,tier=..}``; with
``until``, once those labelled samples reach their minimum (one-token requests in between
carry the workers' counters to the registry), or after ``timeout`` seconds. ``damage`` flips a payload
bit of every other entry file and truncates the rest; ``fill`` takes every free byte of
FOLDER's filesystem with one file, ``unfill`` removes it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time


def corrupt_entries(folder: str) -> int:
    """Flip one payload byte in every entry file under ``folder`` (temporary files of
    writes in flight are not entries: left alone, as is an entry removed meanwhile)."""
    from cache.codec import HEADER_SIZE

    n = 0
    for _ns, _key, path in list(entry_files(folder)):
        try:
            with open(path, "r+b") as f:
                f.seek(HEADER_SIZE + 7)
                b = f.read(1)
                if not b:  # too short to be an entry: the engine rejects it anyway
                    continue
                f.seek(HEADER_SIZE + 7)
                f.write(bytes([b[0] ^ 0xFF]))
        except FileNotFoundError:  # evicted or replaced while we walked
            continue
        n += 1
    return n


def entry_files(folder: str):
    """``(namespace folder name, key, path)`` of every entry file under a tier folder."""
    from cache.tiers.layout import is_key

    for root, _dirs, files in os.walk(folder):
        for name in files:
            if is_key(name):
                yield os.path.basename(os.path.dirname(root)), name, os.path.join(root, name)


def unsign_entries(folder: str) -> int:
    """Rewrite every entry under ``folder`` as a valid but unsigned entry."""
    from cache.codec import HEADER_SIZE, encode_header, read_header

    n = 0
    for ns, key, path in entry_files(folder):
        raw = open(path, "rb").read()
        info = read_header(raw, bytes.fromhex(ns), key)
        payload = raw[HEADER_SIZE:]
        with open(path, "wb") as f:
            f.write(encode_header(bytes.fromhex(ns), key, info.dtype, info.shape, payload, b"", info.parent))
            f.write(payload)
        n += 1
    return n


def break_entries(folder: str, keep: str) -> int:
    """Copy ``folder`` to ``keep``, then turn each entry into a folder of its name: the
    tier still says the entries exist, and every read of one fails."""
    import shutil

    shutil.copytree(folder, keep)
    n = 0
    for _ns, _key, path in list(entry_files(folder)):
        os.unlink(path)
        os.mkdir(path)
        n += 1
    return n


def flip(path: str, offset: int, mask: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def damage_entries(folder: str) -> dict:
    """Flip one payload bit of every other entry under ``folder``; cut the others short
    (alternately inside the payload and inside the header)."""
    from cache.codec import HEADER_SIZE

    done = {"flipped": 0, "truncated": 0}
    for i, (_ns, _key, path) in enumerate(sorted(entry_files(folder))):
        if i % 2 == 0:
            flip(path, HEADER_SIZE + 11, 0x04)
            done["flipped"] += 1
        else:
            os.truncate(path, HEADER_SIZE + 1000 if i % 4 == 1 else HEADER_SIZE // 2)
            done["truncated"] += 1
    return done


BALLAST = ".ballast"


def fill(folder: str) -> int:
    """Take every free byte of ``folder``'s filesystem (another process filled it)."""
    block = b"\0" * (1 << 16)
    n = 0
    with open(os.path.join(folder, BALLAST), "wb", buffering=0) as f:
        for size in (1 << 16, 4096, 512, 1):
            try:
                while True:
                    n += f.write(block[:size])
            except OSError:
                pass
    return n


def read_metrics(prefix: str) -> tuple[dict, dict]:
    """This process's Prometheus samples whose names start with ``prefix``: by name, and
    by ``name{cause=..,mode=..,path=..,source=..,tier=..}`` (the labels each has of these)."""
    from prometheus_client import REGISTRY  # vLLM's get_metrics() lists only vllm:*

    samples = [s for m in REGISTRY.collect() if m.name.startswith(prefix) for s in m.samples]
    keep = ("tier", "cause", "mode", "path", "source")
    labelled = {
        s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k in keep) + "}": s.value
        for s in samples
    }
    return {s.name: s.value for s in samples}, labelled


def tier_folders(cache: dict) -> list[str]:
    """The local folders of the spec's tiers (DRAM, disk, a ``file://`` shared tier)."""
    paths = [cache.get("KVCACHE_DRAM_PATH"), cache.get("KVCACHE_DISK_PATH")]
    url = cache.get("KVCACHE_SHARED_URL") or cache.get("KVCACHE_REMOTE_URL") or ""
    if url.startswith("file://"):
        paths.append(url[len("file://") :])
    return [p for p in paths if p and os.path.isdir(p)]


def settle(folders: list[str], quiet_s: float = 0.3, timeout_s: float = 30.0) -> None:
    """Wait until the write-behind is quiet: no temporary file in ``folders`` and their
    files unchanged for ``quiet_s`` (at most ``timeout_s``). A fixed sleep alone is not
    enough on a 2-core machine that can stall a writer for seconds."""

    def snapshot():
        seen = set()
        for folder in folders:
            for root, _dirs, files in os.walk(folder):
                for name in files:
                    try:
                        seen.add((root, name, os.stat(os.path.join(root, name)).st_size))
                    except FileNotFoundError:
                        pass
        return seen

    deadline = time.time() + timeout_s
    before = snapshot()
    while time.time() < deadline:
        time.sleep(quiet_s)
        now = snapshot()
        if now == before and not any(".tmp-" in name for _root, name, _size in now):
            return
        before = now


def main() -> None:
    spec = json.loads(sys.argv[1])
    # inherited by the engine's processes. Loads are pinned to "always" unless the spec
    # asks for the cost model: it decides from times measured on this (shared, noisy)
    # machine, and these tests are about what the tiers serve, not about wall-clock.
    os.environ.update({"KVCACHE_LOAD_DECISION": "always", **spec["cache"]})
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from cache.vllm import CONNECTOR_CLASS, CONNECTOR_MODULE

    transfer = KVTransferConfig(
        kv_connector=CONNECTOR_CLASS, kv_connector_module_path=CONNECTOR_MODULE, kv_role="kv_both"
    )
    events = None
    if spec.get("kv_events"):  # vLLM's KV events publisher (cache.vllm.events adds the tiers')
        from vllm.config import KVEventsConfig

        events = KVEventsConfig(**spec["kv_events"])
    llm = LLM(
        spec["model"],
        kv_transfer_config=transfer,
        max_model_len=spec.get("max_model_len", 4096),
        enforce_eager=True,
        enable_prefix_caching=spec.get("prefix_caching", True),
        seed=0,
        disable_log_stats=not spec.get("log_stats", False),
        kv_events_config=events,
    )
    params = SamplingParams(max_tokens=spec.get("max_tokens", 3), logprobs=5, temperature=0)
    for step in spec["steps"]:
        if step.get("reset_prefix_cache"):
            assert llm.reset_prefix_cache()
        elif "corrupt" in step:
            print("RESULT " + json.dumps({"corrupted": sum(corrupt_entries(f) for f in step["corrupt"])}), flush=True)
        elif step.get("engine"):
            sched = llm.llm_engine.vllm_config.scheduler_config
            print("RESULT " + json.dumps({"hybrid_kv_manager": not sched.disable_hybrid_kv_cache_manager}), flush=True)
        elif "metrics" in step:
            plain, labelled = read_metrics(step["metrics"])
            deadline = time.time() + step.get("timeout", 60)
            while any(labelled.get(k, 0) < v for k, v in step.get("until", {}).items()) and time.time() < deadline:
                # the workers' counters reach the registry with an engine step's output:
                # what the background threads did after the last step needs another one
                llm.generate([{"prompt_token_ids": [7, 7, 7]}], SamplingParams(max_tokens=1), use_tqdm=False)
                time.sleep(0.2)
                plain, labelled = read_metrics(step["metrics"])
            print("RESULT " + json.dumps({"metrics": plain, "labelled": labelled}), flush=True)
        elif "damage" in step:
            print("RESULT " + json.dumps({f: damage_entries(f) for f in step["damage"]}), flush=True)
        elif "remove" in step:
            shutil.rmtree(step["remove"])
        elif "fill" in step:
            print("RESULT " + json.dumps({"ballast": fill(step["fill"])}), flush=True)
        elif "unfill" in step:
            os.unlink(os.path.join(step["unfill"], BALLAST))
        elif "random_batch" in step:  # N prompts of LEN random tokens, seeds SEED, SEED+1, ...
            seed, n, length = step["random_batch"]
            rngs = [random.Random(seed + i) for i in range(n)]
            prompts = [[rng.randrange(0, 256) for _ in range(length)] for rng in rngs]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            print("RESULT " + json.dumps({"batch": len(outs)}), flush=True)
        elif "unsign" in step:
            print("RESULT " + json.dumps({"unsigned": sum(unsign_entries(f) for f in step["unsign"])}), flush=True)
        elif "break" in step:
            print("RESULT " + json.dumps({"broken": break_entries(step["break"], step["keep"])}), flush=True)
        elif "sleep" in step:  # let write-behind land before another process looks
            time.sleep(step["sleep"])
            settle(tier_folders(spec["cache"]))
        elif "touch" in step:
            open(step["touch"], "w").close()
        elif "wait_for" in step:
            deadline = time.time() + 300
            while not os.path.exists(step["wait_for"]):
                if time.time() > deadline:
                    raise TimeoutError(step["wait_for"])
                time.sleep(0.2)
        else:
            t0 = time.perf_counter()
            prompt = {"prompt_token_ids": step["prompt_token_ids"]}
            if step.get("cache_salt"):
                prompt["cache_salt"] = step["cache_salt"]
            sampling = params
            if step.get("prompt_logprobs"):  # (vLLM sets skip_reading_prefix_cache when built)
                sampling = SamplingParams(
                    max_tokens=params.max_tokens, logprobs=5, temperature=0, prompt_logprobs=step["prompt_logprobs"]
                )
            if step.get("kv_transfer_params"):
                sampling = params.clone()
                sampling.extra_args = {"kv_transfer_params": step["kv_transfer_params"]}
            out = llm.generate(prompt, sampling, use_tqdm=False)[0]
            comp = out.outputs[0]
            print(
                "RESULT "
                + json.dumps(
                    {
                        "seconds": time.perf_counter() - t0,
                        "token_ids": list(comp.token_ids),
                        "logprobs": [{str(k): v.logprob for k, v in d.items()} for d in comp.logprobs],
                        "num_cached_tokens": out.num_cached_tokens,
                        "loaded": (out.kv_transfer_params or {}).get("kvcache_loaded_tokens", {}),
                        "explain": (out.kv_transfer_params or {}).get("kvcache_explain", []),
                        "pin": (out.kv_transfer_params or {}).get("kvcache_pin"),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
