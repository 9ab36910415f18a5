"""The request path's rules without an engine (``serving.pipeline``, ``serving.cache_control``,
``cache.request_params``, ``serving.tgi``): what a request may hand the engine beside its
prompt, how a 5xx from vLLM is answered when its cause is known, and how a stream ends.
vLLM's own request models are used; nothing here starts an engine."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import AsyncIterator

import pytest

from cache.errors import ParamsError
from cache.request_params import KEYS, check_params, wants
from serving.cache_control import check_transfer_params
from serving.errors import ClientError
from serving.guard import ENGINE_DIED, Gate
from serving.pipeline import GRAMMAR_FAILED, _constrained, _tgi_events, _until_cut, instead_of_5xx
from serving.tgi import TgiStream, parse_tgi, sse


# -- kv_transfer_params and the rest of what goes beside the prompt -------------------------
@pytest.mark.parametrize(
    "params",
    [
        None,
        {},
        {"kvcache_load": False},
        {"kvcache_save": True},
        {"kvcache_load": None},
        {"kvcache_pin_ttl": "5m"},
        {"kvcache_pin_ttl": 60, "kvcache_pin_tokens": 512},
    ],
)
def test_the_cache_keys_with_values_of_their_types_pass(params):
    check_params(params)


@pytest.mark.parametrize(
    "params, words",
    [
        ({"kvcache_load": "false"}, "kvcache_load='false' must be true or false"),
        ({"kvcache_load": 0}, "kvcache_load=0 must be true or false"),
        ({"kvcache_save": "no"}, "kvcache_save='no'"),
        ({"kvcache_save": [False]}, "kvcache_save=[False]"),
        ({"k": [[[0]]]}, "unknown key(s) 'k'"),
        ({"do_remote_prefill": True}, "'do_remote_prefill'"),
        ({"kvcache_loaded_tokens": {"dram": 16}}, "'kvcache_loaded_tokens'"),  # an answer's key
        ({"kvcache_pin_ttl": {"s": 1}}, "kvcache_pin_ttl"),
        ({"kvcache_pin_tokens": 5}, "needs kvcache_pin_ttl"),
        ([1], "must be an object"),
        ("x", "must be an object"),
    ],
)
def test_anything_else_is_refused_naming_the_key(params, words):
    with pytest.raises(ParamsError) as e:
        check_params(params)
    assert words in str(e.value)
    if "unknown" in str(e.value):  # and says what is read instead
        assert str(e.value).endswith(f"this server reads {', '.join(KEYS)}")


def test_only_an_explicit_false_turns_a_switch_off_in_the_scheduler():
    assert not wants({"kvcache_load": False}, "kvcache_load")
    for params in (
        None,
        {},
        {"kvcache_load": True},
        {"kvcache_load": "false"},
        {"kvcache_load": 0},
        ["kvcache_load"],
        "kvcache_load",
    ):
        assert wants(params, "kvcache_load"), params  # never raises in the engine core


def completion(**fields):
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})


def chat(**fields):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    )


@pytest.mark.parametrize(
    "req, words",
    [
        (lambda: completion(kv_transfer_params={"kvcache_load": "false"}), "kv_transfer_params: kvcache_load"),
        (lambda: chat(kv_transfer_params={"k": [[1]]}), "kv_transfer_params: unknown key(s) 'k'"),
        (lambda: completion(vllm_xargs={"kv_transfer_params": "x"}), "vllm_xargs: kv_transfer_params"),
        (lambda: chat(vllm_xargs={"ec_transfer_params": [1]}), "vllm_xargs: ec_transfer_params"),
        (lambda: completion(ec_transfer_params={"a": 1}), "encoder-cache connector"),
    ],
)
def test_requests_carrying_more_are_a_400(req, words):
    with pytest.raises(ClientError) as e:
        check_transfer_params(req(), None)
    assert e.value.status == 400 and words in e.value.message


def test_requests_within_the_rules_pass():
    check_transfer_params(completion(kv_transfer_params={"kvcache_load": False}, vllm_xargs={"my_processor": 3}), None)
    check_transfer_params(chat(), None)


# -- a 5xx whose cause is known --------------------------------------------------------------
def app_state(dead=False, draining=False, died=False):
    gate = Gate()
    gate.draining, gate.engine_died = draining, died
    return SimpleNamespace(engine=SimpleNamespace(dead=dead), gate=gate)


def test_a_5xx_is_answered_by_its_known_cause():
    assert instead_of_5xx(400, app_state(dead=True), True) is None  # a 4xx stays
    assert instead_of_5xx(500, app_state(dead=True), True) == (503, ENGINE_DIED)
    assert instead_of_5xx(500, app_state(died=True), False) == (503, ENGINE_DIED)
    assert instead_of_5xx(500, app_state(draining=True), False)[0] == 503
    assert instead_of_5xx(500, app_state(), True) == (400, GRAMMAR_FAILED)
    assert instead_of_5xx(500, app_state(), False) is None  # an unknown failure stays a 500
    assert instead_of_5xx(503, app_state(), True) is None


def test_which_requests_are_decoded_under_a_grammar():
    assert _constrained(completion(structured_outputs={"grammar": "root ::= root"}))
    assert _constrained(chat(response_format={"type": "json_object"}))
    assert not _constrained(chat(response_format={"type": "text"}))
    assert not _constrained(completion())


# -- how a stream ends ----------------------------------------------------------------------
def token(text: str, tid: int, finish=None) -> str:
    choice = {
        "text": text,
        "token_ids": [tid],
        "finish_reason": finish,
        "logprobs": {"tokens": [text], "token_logprobs": [-0.5]},
    }
    return "data: " + json.dumps({"choices": [choice]}) + "\n\n"


async def source(chunks: list[str], gate: Gate = None, cut_after: int = -1) -> AsyncIterator[str]:
    """vLLM's stream: ``chunks``; the drain deadline passes as chunk ``cut_after`` goes out."""
    for i, chunk in enumerate(chunks):
        if i == cut_after:
            gate.cut_all()
        yield chunk


def run(events: AsyncIterator[str]) -> list[str]:
    async def collect():
        return [e async for e in events]

    return asyncio.run(collect())


def data(events: list[str]) -> list:
    return [e[len("data: ") :].strip() for e in events]


def test_a_stream_cut_at_the_drain_deadline_ends_with_one_error_event():
    app = app_state()
    chunks = [token("a", 1), token("b", 2), token("c", 3), "data: [DONE]\n\n"]
    out = data(run(_until_cut(source(chunks, app.gate, cut_after=1), app, False)))
    assert [json.loads(x)["choices"][0]["text"] for x in out[:2]] == ["a", "b"]
    assert json.loads(out[2])["error"]["code"] == 503 and "drain deadline" in out[2]
    assert out[3:] == ["[DONE]"]


def test_a_tgi_stream_cut_at_the_drain_deadline_sends_nothing_after_its_error_event():
    app = app_state()
    tgi = parse_tgi({"inputs": "x", "stream": True, "parameters": {"details": True}})
    chunks = [token("a", 1), token("b", 2), token("c", 3), "data: [DONE]\n\n"]
    out = [
        json.loads(x)
        for x in data(run(_tgi_events(_until_cut(source(chunks, app.gate, cut_after=1), app, False), tgi)))
    ]
    assert [e["token"]["text"] for e in out[:-1]] == ["a", "b"]  # the held-back token goes first
    assert "drain deadline" in out[-1]["error"]  # and the error event is the last one
    assert all(e.get("generated_text") is None for e in out[:-1])


def test_an_error_event_ends_a_stream_and_a_5xx_one_is_answered_by_cause():
    error = sse({"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}})
    chunks = [token("a", 1), error, token("late", 9), "data: [DONE]\n\n"]
    out = data(run(_until_cut(source(chunks), app_state(dead=True), False)))
    assert json.loads(out[1])["error"] == {"message": ENGINE_DIED, "type": "ServiceUnavailableError", "code": 503}
    assert out[2:] == ["[DONE]"]
    out = data(run(_until_cut(source(chunks), app_state(), True)))  # under a grammar: the client's
    assert json.loads(out[1])["error"]["code"] == 400 and out[2:] == ["[DONE]"]
    out = data(run(_until_cut(source(chunks), app_state(), False)))  # else vLLM's own event
    assert json.loads(out[1])["error"]["code"] == 500 and out[2:] == ["[DONE]"]


def test_a_tgi_stream_error_is_its_last_event():
    conv = TgiStream(parse_tgi({"inputs": "x", "stream": True}))
    events = [
        e
        for c in (token("a", 1), token("b", 2), sse({"error": {"message": "boom", "type": "T"}}), token("c", 3))
        for e in conv.feed(c)
    ] + list(conv.close())
    parsed = [json.loads(e[len("data: ") :]) for e in events]
    assert [p.get("token", {}).get("text") for p in parsed[:-1]] == ["a", "b"]
    assert parsed[-1] == {"error": "boom", "error_type": "T"}
