"""Shared fixtures: the small generated model and a runner for real vLLM engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / ".models" / "test-llama"


@pytest.fixture(scope="session")
def model_path() -> str:
    from serving.default_model import ensure_model

    return str(ensure_model(MODEL_DIR))


def engine_env() -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def start_engine(spec: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "tests" / "engine_driver.py"), json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=engine_env(),
                            cwd=REPO)


def finish_engine(proc: subprocess.Popen, timeout: float = 600) -> list[dict]:
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"engine failed ({proc.returncode}):\n{err[-4000:]}")
    return [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]


def run_engine(spec: dict, timeout: float = 600) -> list[dict]:
    return finish_engine(start_engine(spec), timeout)
