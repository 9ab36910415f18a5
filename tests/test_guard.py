"""The app's request guard, error shape, metrics and sessions, in process, without an engine.

The app is the real one (``serving.app.create_app``) on a real configuration; its
lifespan is not run, so the engine never starts and a request that passes every check
answers 503 ("not ready"). What the guard refuses never reaches the engine.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client import generate_latest

from serving.app import create_app
from serving.config import build_serving_config
from serving.guard import MAX_JSON_DEPTH, MAX_NUMBER_DIGITS, json_bounds_problem
from serving.machine import Machine
from tests.test_serving_config import LLAMA3_8B

SESSION = "X-Amzn-SageMaker-Session-Id"


@pytest.fixture
def app(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA3_8B))
    env = {"HF_MODEL_ID": str(model), "SAGEMAKER_BASE_DIR": str(tmp_path / "ml"),
           "KVCACHE_DRAM_PATH": str(tmp_path / "dram"), "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
           "SAGEMAKER_MAX_PAYLOAD_IN_MB": "1", "SAGEMAKER_SESSIONS_PATH": str(tmp_path / "sessions")}
    return create_app(build_serving_config(env, Machine(ram_bytes=16 << 30, cpus=2)))


def call(app, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def post(app, body, path="/invocations", ctype="application/json", headers=None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return call(app, "POST", path, content=content, headers={"Content-Type": ctype, **(headers or {})})


def counted(app, shape: str, status: int) -> float:
    text = generate_latest(app.state.metrics.registry).decode()
    line = f'sagemaker_invocations_total{{shape="{shape}",status="{status}"}} '
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)


def assert_error(r: httpx.Response, status: int, words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["code"] == status
    assert words in err["message"], err


@pytest.mark.parametrize("body,ctype,status,words", [
    (b"[" * 5000 + b"]" * 5000, "application/json", 400, f"more than {MAX_JSON_DEPTH} deep"),
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "application/json", 400,
     f"more than {MAX_NUMBER_DIGITS} digits"),
    (b'{"prompt": "x",', "application/json", 400, "malformed JSON"),
    (b"", "application/json", 400, "malformed JSON"),
    (b"\xff\xfe{}", "application/json", 400, "malformed JSON"),
    (b"[1, 2]", "application/json", 400, "must be a JSON object"),
    (b"3", "application/json", 400, "must be a JSON object"),
    (b'{"prompt": "x"}', "text/plain", 415, "is not JSON"),
    (b'{"prompt": "x"}', "application/x-www-form-urlencoded", 415, "is not JSON"),
    (b'{"inputs": "' + b"a" * (1 << 20) + b'"}', "application/json", 413, "payload limit"),
])
def test_guard_refuses_before_any_parser(app, body, ctype, status, words):
    r = post(app, body, ctype=ctype)
    assert_error(r, status, words)
    assert counted(app, "unknown", status) == 1
    r = post(app, body, path="/v1/completions", ctype=ctype)  # the OpenAI routes alike
    assert_error(r, status, words)


def test_bounds_ignore_brackets_and_digits_inside_strings():
    assert json_bounds_problem(json.dumps({"prompt": "[" * 500 + "9" * 500}).encode()) is None
    assert json_bounds_problem(b'{"a": "\\"[[[[", "b": [[1]]}') is None
    assert json_bounds_problem(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH) is None
    assert json_bounds_problem(b"[" * (MAX_JSON_DEPTH + 1)) is not None


def test_json_content_types_pass_and_an_unready_engine_is_503(app):
    for ctype in ("application/json", "application/json; charset=utf-8", "application/vnd.x+json"):
        r = post(app, {"prompt": "x"}, ctype=ctype)
        assert_error(r, 503, "not ready")
    assert counted(app, "completion", 503) == 3
    assert_error(call(app, "GET", "/v1/models"), 503, "not ready")
    r = call(app, "GET", "/ping")
    assert r.status_code == 503 and r.json()["status"] == "starting"


def test_draining_refuses_new_requests(app):
    app.state.gate.draining = True
    assert_error(post(app, {"inputs": "x"}), 503, "shutting down")
    assert call(app, "GET", "/ping").json() == {"status": "draining"}


def test_sessions_through_the_standards_library(app):
    r = post(app, {"requestType": "NEW_SESSION"})
    assert r.status_code == 200, r.text
    header = r.headers["X-Amzn-SageMaker-New-Session-Id"]
    sid = header.split(";")[0]
    assert "Expires=" in header
    # an open session, and NEW_SESSION on an ordinary request, reach the engine (503 here)
    assert_error(post(app, {"inputs": "x"}, headers={SESSION: sid}), 503, "not ready")
    assert_error(post(app, {"inputs": "x"}, headers={SESSION: "NEW_SESSION"}), 503, "not ready")
    r = post(app, {"requestType": "CLOSE"}, headers={SESSION: sid})
    assert r.status_code == 200 and r.headers["X-Amzn-SageMaker-Closed-Session-Id"] == sid
    assert counted(app, "session", 200) == 2
    assert_error(post(app, {"inputs": "x"}, headers={SESSION: sid}), 400, "session not found")
    assert_error(post(app, {"requestType": "CLOSE"}), 424, "invalid session_id")  # as the library answers
    assert_error(post(app, {"requestType": "BOGUS"}), 400, "requestType")


@pytest.fixture
def model_script(tmp_path, monkeypatch):
    """A model folder with a ``model.py`` defining a custom ping handler, as the
    standards library looks for it (``SAGEMAKER_MODEL_PATH``)."""
    from model_hosting_container_standards.sagemaker.sagemaker_loader import SageMakerFunctionLoader

    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "model.py").write_text(
        "from fastapi import Request\nfrom fastapi.responses import JSONResponse\n\n"
        "async def custom_sagemaker_ping_handler(raw_request: Request):\n"
        "    return JSONResponse({'status': 'custom'})\n")
    monkeypatch.setenv("SAGEMAKER_MODEL_PATH", str(folder) + "/")
    monkeypatch.setattr(SageMakerFunctionLoader, "_default_function_loader", None)  # the library caches it
    yield folder
    monkeypatch.delenv("SAGEMAKER_MODEL_PATH")
    SageMakerFunctionLoader._default_function_loader = None


def test_a_custom_handler_in_the_model_folder_replaces_ours(model_script, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA3_8B))
    env = {"HF_MODEL_ID": str(model), "SAGEMAKER_BASE_DIR": str(tmp_path / "ml"),
           "KVCACHE_DRAM_PATH": str(tmp_path / "dram"), "KVCACHE_DISK_PATH": str(tmp_path / "disk")}
    app = create_app(build_serving_config(env, Machine(ram_bytes=16 << 30, cpus=2)))
    r = call(app, "GET", "/ping")
    assert r.status_code == 200 and r.json() == {"status": "custom"}
