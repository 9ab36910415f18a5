"""SageMaker stateful sessions (``serving.sessions``), in process, without an engine: the
bound on open sessions, and the session header checked on the ``/v1`` routes as on
``/invocations``. The app is the real one; a request that passes every check answers 503
(the engine is not started)."""

from __future__ import annotations

import json
import time

import pytest

from serving.app import create_app
from serving.config import build_serving_config
from serving.machine import Machine
from tests.test_guard import assert_error, counted, post
from tests.test_serving_config import LLAMA3_8B

SESSION = "X-Amzn-SageMaker-Session-Id"


def make_app(tmp_path, **env):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(LLAMA3_8B))
    base = {
        "HF_MODEL_ID": str(model),
        "SAGEMAKER_BASE_DIR": str(tmp_path / "ml"),
        "KVCACHE_DRAM_PATH": str(tmp_path / "dram"),
        "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
        "SAGEMAKER_SESSIONS_PATH": str(tmp_path / "sessions"),
    }
    return create_app(build_serving_config({**base, **env}, Machine(ram_bytes=16 << 30, cpus=2)))


def new_session(app) -> str:
    r = post(app, {"requestType": "NEW_SESSION"})
    assert r.status_code == 200, r.text
    return r.headers["X-Amzn-SageMaker-New-Session-Id"].split(";")[0]


def test_open_sessions_are_bounded_and_expired_ones_make_room(tmp_path):
    app = make_app(tmp_path, SERVING_MAX_SESSIONS="3")
    # (imported once the app has: importing the library re-levels the root logger's handlers)
    from model_hosting_container_standards.sagemaker.sessions import manager

    ids = [new_session(app) for _ in range(3)]
    r = post(app, {"requestType": "NEW_SESSION"})
    assert_error(r, 429, "too many open sessions: 3 of SERVING_MAX_SESSIONS=3")
    assert "the oldest expires in" in r.json()["error"]["message"]
    assert counted(app, "session", 429) == 1
    assert sorted(p.name for p in (tmp_path / "sessions").iterdir()) == sorted(ids)  # no 4th folder
    # the open ones still serve (503: no engine here, but past the session check)
    assert_error(post(app, {"inputs": "x"}, headers={SESSION: ids[0]}), 503, "not ready")
    # closing one makes room
    assert post(app, {"requestType": "CLOSE"}, headers={SESSION: ids[1]}).status_code == 200
    ids[1] = new_session(app)
    # an expired session makes room too: it is removed, folder and all
    manager.get_session_manager().sessions[ids[0]].expiration_ts = time.time() - 1
    fresh = new_session(app)
    assert not (tmp_path / "sessions" / ids[0]).exists() and (tmp_path / "sessions" / fresh).is_dir()
    assert len(list((tmp_path / "sessions").iterdir())) == 3


def test_the_bound_holds_when_the_manager_is_asked_directly(tmp_path):
    make_app(tmp_path, SERVING_MAX_SESSIONS="2")
    from model_hosting_container_standards.sagemaker.sessions import manager

    from serving.sessions import SessionLimit

    sessions = manager.get_session_manager()
    sessions.create_session()
    sessions.create_session()
    with pytest.raises(SessionLimit, match="SERVING_MAX_SESSIONS=2"):
        sessions.create_session()


def test_max_sessions_setting(tmp_path):
    app = make_app(tmp_path)
    assert app.state.config.http.max_sessions == 1000
    with pytest.raises(Exception, match="SERVING_MAX_SESSIONS"):
        make_app(tmp_path, SERVING_MAX_SESSIONS="0")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/invocations"])
def test_the_session_header_is_checked_on_every_model_route(tmp_path, path):
    app = make_app(tmp_path)
    body = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    assert_error(
        post(app, body, path=path, headers={SESSION: "no-such-session"}), 400, "session not found: no-such-session"
    )
    sid = new_session(app)
    assert_error(post(app, body, path=path, headers={SESSION: sid}), 503, "not ready")  # honoured
    assert_error(post(app, body, path=path, headers={SESSION: "NEW_SESSION"}), 503, "not ready")
    assert post(app, {"requestType": "CLOSE"}, headers={SESSION: sid}).status_code == 200
    assert_error(post(app, body, path=path, headers={SESSION: sid}), 400, "session not found")  # closed


def test_the_session_header_with_sessions_off_is_refused_on_v1_too(tmp_path):
    app = make_app(tmp_path, SAGEMAKER_ENABLE_STATEFUL_SESSIONS="false")
    for path in ("/invocations", "/v1/completions"):
        assert_error(
            post(app, {"prompt": "x"}, path=path, headers={SESSION: "abc"}), 400, "stateful sessions not enabled"
        )
        assert_error(post(app, {"prompt": "x"}, path=path), 503, "not ready")
