"""Shared fixtures: the small generated model and a runner for real vLLM engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / ".models" / "test-llama"


@pytest.fixture(scope="session")
def model_path() -> str:
    from serving.default_model import ensure_model

    return str(ensure_model(MODEL_DIR))


def engine_env() -> dict:
    """This environment for an engine subprocess, without cache settings of the caller's
    shell (each test gives its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHE_")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def start_engine(spec: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "engine_driver.py"), json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=engine_env(),
        cwd=REPO,
    )


def finish_engine(proc: subprocess.Popen, timeout: float = 600, log: Optional[list] = None) -> list[dict]:
    """The engine's results; its stderr is appended to ``log`` when given."""
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"engine failed ({proc.returncode}):\n{err[-4000:]}")
    if log is not None:
        log.append(err)
    return [json.loads(line[len("RESULT ") :]) for line in out.splitlines() if line.startswith("RESULT ")]


def run_engine(spec: dict, timeout: float = 600, log: Optional[list] = None) -> list[dict]:
    return finish_engine(start_engine(spec), timeout, log)


# -- comparing logprobs across computations ------------------------------------------------
# CPU kernels (AMX, AVX-512, oneDNN) differ in accumulation order with batch shape, so two
# computations of the same tokens agree to a few 1e-3, not bit for bit. A wrongly placed or
# stale KV block moves them by 1e-2 and more. Equality is asserted only where the same KV
# bytes feed the same computation (a tier hit against a prefix-cache hit).
LOGPROB_TOL = 1e-2


def close_logprobs(a: dict, b: dict, tol: float = LOGPROB_TOL) -> bool:
    """``a`` and ``b`` (each ``{"token_ids": [...], "logprobs": [{token: logprob}]}``) are
    the same generation up to float tolerance: at each position the tokens both list
    agree within ``tol``, at most one top-k entry differs at the cut-off, and the same
    token is chosen. Comparison stops after a position where ``a``'s two best tokens are
    within ``2 * tol`` (a tie the other computation may break the other way; what
    follows it is a different continuation, not an error)."""
    for tok_a, tok_b, x, y in zip(a["token_ids"], b["token_ids"], a["logprobs"], b["logprobs"], strict=True):
        common = x.keys() & y.keys()
        if len(common) < min(len(x), len(y)) - 1:
            return False
        if any(abs(x[k] - y[k]) > tol for k in common):
            return False
        best = sorted(x.values(), reverse=True)
        if len(best) > 1 and best[0] - best[1] < 2 * tol:
            return True
        if tok_a != tok_b:
            return False
    return True


@pytest.fixture(autouse=True)
def _main_thread_left_as_found():
    """No test may leave pytest's main thread niced or bound to other CPUs: every later
    test, and every thread it starts, would inherit it (a writer thread's setup run on
    the main thread once niced the rest of the suite)."""
    before = os.getpriority(os.PRIO_PROCESS, 0), os.sched_getaffinity(0)
    yield
    after = os.getpriority(os.PRIO_PROCESS, 0), os.sched_getaffinity(0)
    assert after == before, f"the test left the main thread's (nice, CPUs) at {after}, was {before}"
