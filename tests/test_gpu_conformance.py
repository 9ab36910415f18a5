"""The GPU conformance suite's CPU part (``bench.gpu_conformance``, run on a GPU machine as
bench/README.md says): vLLM's recorded views, every layout x attention kind x dtype, copied
exactly by the CPU path and, with a stand-in for CUDA's stream calls, by the stream path
the GPU runs; the report says the GPU part was not run."""

import json

import torch

from bench import conformance_views, kv_fixtures
from bench.gpu_conformance import main
from tests.test_cuda_order import Recorder


def test_the_suite_runs_its_cpu_part_and_says_the_gpu_part_was_not_run(tmp_path):
    report, figures = tmp_path / "r.md", tmp_path / "r.json"
    assert main(["--report", str(report), "--json", str(figures)]) == 0
    text = report.read_text()
    assert "GPU part not run: no CUDA device" in text and "all pass" in text
    result = json.loads(figures.read_text())
    assert len(result["views"]["cases"]) == 44 and result["staging"]["skipped"] == 56


def test_the_stream_path_copies_every_view_exactly():
    fixtures = kv_fixtures.load()
    names = {n for n in fixtures["cases"] if not n.startswith("llama")}
    result = conformance_views.run(fixtures, torch.device("cpu"), names, streams=Recorder)
    assert conformance_views.passed(result), result
    assert len(result["cases"]) == 44 and len(result["carry"]) == 7
