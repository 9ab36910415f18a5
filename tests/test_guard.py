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
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from serving.app import create_app
from serving.body import MAX_JSON_DEPTH, MAX_NUMBER_DIGITS, BodyError, parse_body
from serving.config import build_serving_config
from serving.machine import Machine
from tests.test_serving_config import LLAMA3_8B

SESSION = "X-Amzn-SageMaker-Session-Id"


@pytest.fixture
def app(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA3_8B))
    env = {
        "HF_MODEL_ID": str(model),
        "SAGEMAKER_BASE_DIR": str(tmp_path / "ml"),
        "KVCACHE_DRAM_PATH": str(tmp_path / "dram"),
        "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
        "SAGEMAKER_MAX_PAYLOAD_IN_MB": "1",
        "SAGEMAKER_SESSIONS_PATH": str(tmp_path / "sessions"),
    }
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


@pytest.mark.parametrize(
    "body,ctype,status,words",
    [
        (b"[" * 5000 + b"]" * 5000, "application/json", 400, f"more than {MAX_JSON_DEPTH} deep"),
        (
            b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
            "application/json",
            400,
            f"more than {MAX_NUMBER_DIGITS} digits",
        ),
        (b'{"prompt": "x",', "application/json", 400, "malformed JSON"),
        (b"", "application/json", 400, "malformed JSON"),
        (b"\xff\xfe{}", "application/json", 400, "the body is UTF-16 text"),
        (b'{"prompt": "x", "max_tokens": 1e999}', "application/json", 400, "out of range"),
        (b'{"prompt": "x", "top_k": ' + b"9" * 64 + b"}", "application/json", 400, "64 bits"),
        (b'{"prompt": "x", "temperature": NaN}', "application/json", 400, "NaN is not a JSON number"),
        (b'{"prompt": "x", "stop": ["\\udfff"]}', "application/json", 400, "lone UTF-16 surrogate"),
        (b'{"prompt": "\xed\xa0\x80"}', "application/json", 400, "not UTF-8"),
        (b"[1, 2]", "application/json", 400, "must be a JSON object"),
        (b"3", "application/json", 400, "must be a JSON object"),
        (b'{"prompt": "x"}', "text/plain", 415, "is not JSON"),
        (b'{"prompt": "x"}', "application/x-www-form-urlencoded", 415, "is not JSON"),
        (b'{"inputs": "' + b"a" * (1 << 20) + b'"}', "application/json", 413, "payload limit"),
    ],
)
def test_guard_refuses_before_any_parser(app, body, ctype, status, words):
    r = post(app, body, ctype=ctype)
    assert_error(r, status, words)
    assert counted(app, "unknown", status) == 1
    r = post(app, body, path="/v1/completions", ctype=ctype)  # the OpenAI routes alike
    assert_error(r, status, words)


def test_bounds_ignore_brackets_and_digits_inside_strings():
    assert parse_body(json.dumps({"prompt": "[" * 500 + "9" * 500}).encode())
    assert parse_body(b'{"a": "\\"[[[[", "b": [[1]]}') == {"a": '"[[[[', "b": [[1]]}
    inner = MAX_JSON_DEPTH - 1  # the object itself is one level
    assert parse_body(b'{"a": ' + b"[" * inner + b"]" * inner + b"}")
    with pytest.raises(BodyError, match="deep"):
        parse_body(b'{"a": ' + b"[" * (inner + 1) + b"]" * (inner + 1) + b"}")


def engine_killer(encoding: str, depth: int = 900) -> bytes:
    """The request that killed the engine (issue 28): a U+2200 in the first string is the
    bytes 00 22 in UTF-16-LE, which put the old byte scan's quote pairing off by one and
    hid a 900-deep list in ``kv_transfer_params`` from it (3,804 bytes)."""
    deep = "[" * depth + "0" + "]" * depth
    text = (
        '{"inputs": "x\u2200", "parameters": {"max_new_tokens": 1, '
        '"kv_transfer_params": {"k": ' + deep + '}}, "stream": false}'
    )
    return text.encode(encoding)


ENCODINGS = ("utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be")


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_the_engine_killer_in_every_encoding_is_refused_by_name(app, encoding):
    body = engine_killer(encoding)
    for path in ("/invocations", "/v1/completions", "/v1/chat/completions"):
        assert_error(post(app, body, path=path), 400, f"is {encoding.upper()} text")
    deep = ("{" + '"a": [' * 5000 + "]" * 5000 + "}").encode(encoding)  # RecursionError in json
    assert_error(post(app, deep), 400, "UTF-8")


def test_the_engine_killer_in_utf8_is_refused_for_its_depth(app):
    assert_error(post(app, engine_killer("utf-8")), 400, f"more than {MAX_JSON_DEPTH} deep")
    assert_error(post(app, engine_killer("utf-8-sig")), 400, f"more than {MAX_JSON_DEPTH} deep")


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
        "    return JSONResponse({'status': 'custom'})\n"
    )
    monkeypatch.setenv("SAGEMAKER_MODEL_PATH", str(folder) + "/")
    monkeypatch.setattr(SageMakerFunctionLoader, "_default_function_loader", None)  # the library caches it
    yield folder
    monkeypatch.delenv("SAGEMAKER_MODEL_PATH")
    SageMakerFunctionLoader._default_function_loader = None  # noqa: SLF001 (the library's cache; no public reset)
    from model_hosting_container_standards.common.handler import handler_registry

    handler_registry.remove_handler("ping")  # the library keeps the override for every later app


def test_a_custom_handler_in_the_model_folder_replaces_ours(model_script, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA3_8B))
    env = {
        "HF_MODEL_ID": str(model),
        "SAGEMAKER_BASE_DIR": str(tmp_path / "ml"),
        "KVCACHE_DRAM_PATH": str(tmp_path / "dram"),
        "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
    }
    app = create_app(build_serving_config(env, Machine(ram_bytes=16 << 30, cpus=2)))
    r = call(app, "GET", "/ping")
    assert r.status_code == 200 and r.json() == {"status": "custom"}


# -- the body parser's properties (hypothesis) ---------------------------------------------
PROPS = settings(max_examples=300, deadline=None, database=None, derandomize=True)
ALL_ENCODINGS = ("utf-8", "utf-8-sig") + ENCODINGS
# Every code point, and often a surrogate (``st.text`` would leave surrogates out).
any_text = st.lists(
    st.one_of(
        st.characters(exclude_categories=()),
        st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=()),
    ),
    max_size=12,
).map("".join)
json_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    json_text,
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(json_text, inner, max_size=4)),
    max_leaves=20,
)


def _depth(value) -> int:
    """Nesting depth by the parser's reading (the test's own reference; recursive, bounded)."""
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@PROPS
@given(value=st.dictionaries(json_text, values, max_size=4), ascii_only=st.booleans(), bom=st.booleans())
def test_any_bounded_object_in_utf8_reads_as_json_reads_it(value, ascii_only, bom):
    body = json.dumps(value, ensure_ascii=ascii_only).encode("utf-8-sig" if bom else "utf-8")
    assert parse_body(body) == json.loads(body)  # what every later reader of the body builds


@PROPS
@given(value=st.dictionaries(json_text, values, min_size=1, max_size=4), encoding=st.sampled_from(ENCODINGS))
def test_utf16_and_utf32_bodies_are_refused_by_name(value, encoding):
    body = json.dumps(value, ensure_ascii=False).encode(encoding)
    with pytest.raises(BodyError, match=f"is {encoding.upper()} text"):
        parse_body(body)


@PROPS
@given(
    depth=st.integers(0, 3000),
    kinds=st.lists(st.booleans(), min_size=1, max_size=8),
    bait=st.text(st.sampled_from('x"\\[]{}\u2200\u225b\u5b22'), max_size=6),
    encoding=st.sampled_from(ALL_ENCODINGS),
)
def test_nesting_is_bounded_in_any_encoding_without_recursion(depth, kinds, bait, encoding):
    """Lists and objects ``depth`` deep inside the body's object, after a string of quote
    and bracket look-alikes (U+2200 is 00 22 in UTF-16-LE: a quote to a byte scan)."""
    opens = ["[" if kinds[i % len(kinds)] else '{"k": ' for i in range(depth)]
    closes = ["]" if o == "[" else "}" for o in reversed(opens)]
    text = '{"bait": ' + json.dumps(bait, ensure_ascii=False) + ', "v": ' + "".join(opens) + "0" + "".join(closes) + "}"
    body = text.encode(encoding)
    if encoding not in ("utf-8", "utf-8-sig"):
        with pytest.raises(BodyError, match="send JSON as UTF-8"):
            parse_body(body)
    elif depth + 1 > MAX_JSON_DEPTH:
        with pytest.raises(BodyError, match=f"more than {MAX_JSON_DEPTH} deep"):
            parse_body(body)
    else:
        value = parse_body(body)
        assert value == json.loads(body) and _depth(value) == depth + 1


@PROPS
@given(text=any_text, raw=st.booleans())
def test_strings_with_any_code_points(text, raw):
    """Any code point, lone surrogates included, escaped (``\\ud800``) or encoded raw: a
    body is read exactly as ``json.loads`` reads it, or refused when what it reads is not
    text (a lone surrogate left after pairs are joined) or its bytes are not UTF-8."""
    if raw:
        body = json.dumps({"prompt": text}, ensure_ascii=False).encode("utf-8", "surrogatepass")
    else:
        body = json.dumps({"prompt": text}).encode()
    reference = json.loads(body)["prompt"]  # Python's parser joins escaped pairs
    lone = any(0xD800 <= ord(c) <= 0xDFFF for c in reference)
    if lone:
        with pytest.raises(BodyError, match="not UTF-8" if raw else "lone UTF-16 surrogate"):
            parse_body(body)
    else:
        assert parse_body(body) == {"prompt": reference}


@PROPS
@given(number=st.one_of(st.integers(), st.integers(-(2**64), 2**64)))
def test_integers_are_bounded_to_64_bits(number):
    body = b'{"top_k": ' + str(number).encode() + b"}"
    if -(2**63) <= number < 2**63:
        assert parse_body(body) == {"top_k": number}
    else:
        with pytest.raises(BodyError, match="64 bits|digits"):
            parse_body(body)


@PROPS
@given(
    raw=st.one_of(
        st.binary(max_size=80), st.builds(lambda v, cut: json.dumps(v).encode()[:cut], values, st.integers(0, 80))
    )
)
def test_any_bytes_are_read_or_refused_never_an_other_error(raw):
    try:
        value = parse_body(raw)
    except BodyError:
        return
    assert value == json.loads(raw) and isinstance(value, dict)
