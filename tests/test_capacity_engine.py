"""``bench.capacity --quick`` end to end: two real servers (vLLM alone, ours) one after the
other, two small user counts of the chat workload. Checks that every turn finished with
the asked answer length and that the token accounting adds up. Engine time: about 3 min."""

from __future__ import annotations

import json

import pytest

from bench import capacity

pytestmark = pytest.mark.engine


def test_quick_run_finishes_every_turn_and_accounts_for_its_tokens(tmp_path):
    rc = capacity.main(
        [
            "--quick",
            "--users",
            "2",
            "--duration",
            "15",
            "--out",
            str(tmp_path / "out"),
            "--workdir",
            str(tmp_path / "work"),
        ]
    )
    result = json.loads((tmp_path / "out" / "capacity.json").read_text())
    assert rc == 0, (tmp_path / "out" / "capacity.md").read_text()
    assert set(result["workloads"]["chat"]) == {"vllm-alone", "ours"}
    for name, c in result["workloads"]["chat"].items():
        p = c["points"]["2"]
        assert p["turns"] > 0 and p["failed"] == 0 and p["short_answers"] == 0, (name, p["errors"], p)
        assert p["ttft_p90"] > 0 and p["itl_p50"] > 0
        # the shared system prompt hits vLLM's own prefix cache; the sources add up
        assert p["l0_tokens"] > 0
        loaded = p["prompt_tokens"] - p["computed_tokens"] - p["l0_tokens"]
        assert loaded == pytest.approx(sum(p["loaded_tokens"].values()), abs=p["prompt_tokens"] * 0.01), (name, p)
    assert (tmp_path / "out" / "capacity.png").stat().st_size > 0
