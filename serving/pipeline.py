"""One path for every model request, whichever route it came in by.

``serve(request, shape, payload)`` runs on the server's event loop for ``/invocations``
and the ``/v1/...`` routes alike:

1. the engine must be ready (503 otherwise);
2. the payload becomes vLLM's own request model (``ChatCompletionRequest``,
   ``CompletionRequest``; a TGI body is translated to a completion first; a pooling
   body to vLLM's pooling models). Anything raised here is the request's fault (400,
   ``serving.errors``); then our own rules: chat roles OpenAI knows, ``n`` at most
   ``SERVING_MAX_N``, ``kv_transfer_params`` a flat map of the cache's keys and a pin
   asked for by ``cache_control`` or by them (``serving.cache_control``; a message's
   ``cache_control`` is taken out first);
3. vLLM's serving layer runs it. A non-streamed request is awaited while watching for
   the client leaving (vLLM aborts it), ``SAGEMAKER_MODEL_SERVER_TIMEOUT`` (504) and the
   drain deadline (503). A non-streamed answer carries the opt-in ``X-Kvcache-Explain``
   header (``serving.explain``). A streamed request is validated before its 200: its first
   event is awaited first, and an error there is answered as a JSON error with its
   status instead of a 200 whose stream holds the error. A stream still running at the
   drain deadline ends with an error event (503) after the tokens already sent; an error
   event always ends a stream (``[DONE]`` follows, nothing else).
4. a 5xx from vLLM is answered otherwise where the cause is known (``instead_of_5xx``):
   503 when the engine died or the server drains, 400 when a request decoded under a
   grammar failed in generation (the grammar left no token to produce).

Nothing here blocks: JSON translation only, the engine is awaited.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Awaitable, Callable, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serving.cache_control import apply_chat_pin, check_transfer_params, take_cache_control
from serving.errors import ClientError, classify, error_body, error_response, response_for
from serving.explain import explain_headers
from serving.guard import ENGINE_DIED, SHUTTING_DOWN
from serving.tgi import TgiRequest, TgiStream, completion_to_tgi, parse_tgi, sse, tgi_to_completion

log = logging.getLogger(__name__)

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
GENERATE_SHAPES = ("chat", "completion", "tgi")
# vLLM's pooling endpoints (``vllm.entrypoints.pooling``), by the name of the function
# that serves them; /invocations tries them in vLLM's order for a body of no other shape.
DONE = "data: [DONE]\n\n"
GRAMMAR_FAILED = (
    "generation failed under the request's structured-output constraint "
    "(structured_outputs, response_format or tool_choice): its grammar left no "
    "token the model may produce next, or did not compile (a grammar such as "
    "'root ::= root' does this)"
)
POOLING_ENDPOINTS = {
    "embeddings": "create_embedding",
    "classify": "create_classify",
    "rerank": "do_rerank",
    "score": "create_score",
    "pooling": "create_pooling",
}


def shape_of(body: dict, tasks: tuple[str, ...] = ("generate",)) -> str:
    """The shape of an ``/invocations`` body: ``chat``, ``completion``, ``tgi``, or
    ``pooling`` (one of vLLM's pooling requests, found by trying them)."""
    if "generate" in tasks:
        for key, shape in (("messages", "chat"), ("prompt", "completion"), ("inputs", "tgi")):
            if key in body:
                return shape
    if any(t != "generate" for t in tasks):
        return "pooling"
    raise ClientError(
        'unknown request shape: send {"messages": [...]} (OpenAI chat), '
        '{"prompt": "..."} (OpenAI completion) or {"inputs": "...", '
        '"parameters": {...}} (TGI)'
    )


@dataclass(frozen=True)
class Prepared:
    """A validated request: ``call(raw)`` serves it."""

    call: Callable[[Request], Awaitable[Any]]
    tgi: Optional[TgiRequest] = None
    stream: bool = False
    constrained: bool = False  # decoded under a grammar (structured outputs, tools)


async def serve(request: Request, shape: str, payload: dict) -> Response:
    """Serve one model request (see the module docstring)."""
    request.state.shape = shape
    app = request.app.state
    engine, gate = app.engine, app.gate
    if not engine.healthy:
        return error_response(503, f"the engine is not ready ({engine.state.value})")
    try:
        prepared = _prepare(app, shape, payload)
    except Exception as e:
        return response_for(e, validating=True)
    outcome, result = await race(
        request, prepared.call(request), gate, None if prepared.stream else app.config.http.invocation_timeout_s
    )
    if outcome != "done":
        return _unfinished(outcome, app.config.http.invocation_timeout_s, gate)
    if isinstance(result, BaseException):
        swap = instead_of_5xx(classify(result)[0], app, prepared.constrained)
        return error_response(*swap) if swap else response_for(result)
    return await _respond(request, result, prepared)


def instead_of_5xx(status: int, app, constrained: bool) -> Optional[tuple[int, str]]:
    """``(status, message)`` to answer instead of a 5xx that vLLM gave a request, or None
    to keep it: the engine died or the server drains (503), or the request's grammar
    left no token to produce (400: vLLM ends such a request with a bare "Internal server
    error"; ``root ::= root`` does it at the first token)."""
    if status < 500:
        return None
    if app.engine.dead or app.gate.engine_died:
        return 503, ENGINE_DIED
    if app.gate.draining:
        return 503, SHUTTING_DOWN
    if constrained and status == 500:
        log.warning("a request decoded under a grammar failed in generation: answered 400")
        return 400, GRAMMAR_FAILED
    return None


def _prepare(app, shape: str, payload: dict) -> Prepared:
    """The validated request, ready to serve."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    engine, served = app.engine, app.config.engine.served_model_name
    tgi: Optional[TgiRequest] = None
    if shape in ("embeddings", "classify", "rerank", "score", "pooling"):
        return Prepared(_pooling_call(engine, shape, payload))
    if shape not in GENERATE_SHAPES or "generate" not in engine.tasks:
        raise ClientError(f"this model does not serve {shape} requests (its tasks: {', '.join(engine.tasks)})", 400)
    if shape == "tgi":
        tgi = parse_tgi(payload)
        payload = tgi_to_completion(tgi, served)
    body = dict(payload)
    if body.get("model") is None:
        body["model"] = served
    chat_pin = None
    if shape == "chat":
        chat_pin = take_cache_control(body)  # a message's cache_control (serving.cache_control)
        req = ChatCompletionRequest.model_validate(body)
        _check_roles(req.messages)
        handler = engine.chat.create_chat_completion
    else:
        req = CompletionRequest.model_validate(body)
        handler = engine.completion.create_completion
    check_transfer_params(req, chat_pin)
    max_n = app.config.http.max_n
    if (req.n or 1) > max_n:
        raise ClientError(f"n={req.n} is above this server's maximum of {max_n} (SERVING_MAX_N)")

    async def call(raw: Request):
        if chat_pin is not None:
            await apply_chat_pin(engine.chat, req, chat_pin)
        return await handler(req, raw)

    return Prepared(call, tgi, bool(req.stream), _constrained(req))


def _constrained(req) -> bool:
    """Whether vLLM decodes ``req`` under a grammar: structured outputs or a response
    format (``extract_structured_outputs``), or tools it must call."""
    if req.extract_structured_outputs() is not None:
        return True
    choice = getattr(req, "tool_choice", None)
    return choice == "required" or (choice is not None and not isinstance(choice, str))


def _pooling_call(engine, shape: str, payload: dict):
    """vLLM's own pooling endpoint for ``shape`` (``pooling``: the first of vLLM's
    pooling request models the body validates as, in vLLM's order)."""
    import pydantic

    candidates = [
        (t, ep)
        for t, (get_handler, ep) in engine.invocation_types()
        if shape == "pooling" or ep.__name__ == POOLING_ENDPOINTS[shape]
    ]
    if not candidates:
        raise ClientError(f"this model does not serve {shape} requests (its tasks: {', '.join(engine.tasks)})")
    errors = []
    for request_type, endpoint in candidates:
        try:
            req = pydantic.TypeAdapter(request_type).validate_python(payload)
        except pydantic.ValidationError as e:
            errors.append(e)
            continue

        async def call(raw: Request, req=req, endpoint=endpoint):
            return await endpoint(req, raw)

        return call
    if len(errors) == 1:
        raise errors[0]
    raise ClientError(
        "the body is none of the request shapes this model serves (chat, "
        "completion, TGI, or vLLM's pooling requests: "
        f"{', '.join(POOLING_ENDPOINTS)})"
    )


def _check_roles(messages: list) -> None:
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else getattr(m, "role", None)
        if role not in CHAT_ROLES:
            raise ClientError(
                f"messages.{i}.role: {role!r} is not a chat role (one of {', '.join(sorted(CHAT_ROLES))})"
            )


async def race(request: Request, work, gate, timeout_s: Optional[float]) -> tuple[str, Any]:
    """Await ``work`` against the client leaving (``gone``), the timeout (``timeout``)
    and the drain deadline (``cut``); the loser is cancelled (vLLM aborts the request).
    ``("done", result)``, where result is the exception ``work`` raised, if any."""
    task = asyncio.ensure_future(work)
    watchers = {
        asyncio.ensure_future(_until_disconnect(request)): "gone",
        asyncio.ensure_future(gate.cut.wait()): "cut",
    }
    try:
        done, _ = await asyncio.wait({task, *watchers}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            exc = task.exception()
            return "done", exc if exc is not None else task.result()
        for w, name in watchers.items():
            if w in done:
                return name, None
        return "timeout", None
    finally:
        for t in (task, *watchers):
            if not t.done():
                t.cancel()


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _unfinished(outcome: str, timeout_s: float, gate) -> Response:
    if outcome == "gone":
        return Response(status_code=499)  # nobody reads it; counted as the client's
    if outcome == "cut":
        return error_response(
            503,
            ENGINE_DIED
            if gate.engine_died
            else f"{SHUTTING_DOWN}: the request was still running at the drain deadline",
        )
    return error_response(504, f"no answer within {timeout_s:.0f} s (SAGEMAKER_MODEL_SERVER_TIMEOUT)", "TimeoutError")


async def _respond(request: Request, result: Any, prepared: Prepared) -> Response:
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    tgi = prepared.tgi
    if isinstance(result, ErrorResponse):
        swap = instead_of_5xx(result.error.code, request.app.state, prepared.constrained)
        return error_response(*swap) if swap else JSONResponse(result.model_dump(), status_code=result.error.code)
    if isinstance(result, Response):
        return result
    if hasattr(result, "model_dump"):
        data = result.model_dump()
        return JSONResponse(
            completion_to_tgi(data, tgi) if tgi else data, headers=explain_headers(request.headers, data)
        )
    return await _stream(request, result, prepared)


async def _stream(request: Request, chunks: AsyncGenerator[str, None], prepared: Prepared) -> Response:
    """Validate a stream by its first event, then stream the rest (module docstring)."""
    app = request.app.state
    outcome, first = await race(request, _first(chunks), app.gate, None)
    if outcome != "done":
        await chunks.aclose()
        return _unfinished(outcome, 0, app.gate)
    if isinstance(first, BaseException):
        await chunks.aclose()
        swap = instead_of_5xx(classify(first)[0], app, prepared.constrained)
        return error_response(*swap) if swap else response_for(first)
    error = _stream_error(first)
    if error is not None:
        await chunks.aclose()
        status = _status(error)
        swap = instead_of_5xx(status, app, prepared.constrained)
        return error_response(*swap) if swap else JSONResponse({"error": error}, status_code=status)
    events = _until_cut(_prepend(first, chunks), app, prepared.constrained)
    if prepared.tgi is not None:
        events = _tgi_events(events, prepared.tgi)
    return StreamingResponse(events, media_type="text/event-stream")


def _status(error: dict) -> int:
    code = str(error.get("code", ""))
    return int(code) if code.isdigit() and 400 <= int(code) < 600 else 400


async def _first(chunks: AsyncGenerator[str, None]) -> Optional[str]:
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


def _stream_error(chunk: Optional[str]) -> Optional[dict]:
    """The ``error`` object of a ``data: {"error": ...}`` event, else None."""
    if not chunk:
        return None
    for line in chunk.splitlines():
        if line.startswith("data:") and '"error"' in line:
            try:
                data = json.loads(line[5:])
            except ValueError:
                return None
            err = data.get("error") if isinstance(data, dict) else None
            return err if isinstance(err, dict) else None
    return None


async def _prepend(first: Optional[str], rest: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
    try:
        if first is not None:
            yield first
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()


async def _until_cut(chunks: AsyncGenerator[str, None], app, constrained: bool) -> AsyncGenerator[str, None]:
    """The stream, ended by an error event (503) once the drain deadline has passed. An
    error event ends it (``[DONE]`` follows, nothing else); a 5xx one is answered as
    ``instead_of_5xx`` says (the engine died: 503)."""
    gate = app.gate
    try:
        async for chunk in chunks:
            error = _stream_error(chunk)
            if error is not None:
                swap = instead_of_5xx(_status(error), app, constrained)
                yield sse(error_body(*swap)) if swap else chunk
                yield DONE
                return
            yield chunk
            if gate.cut.is_set():
                yield sse(
                    error_body(
                        503,
                        ENGINE_DIED
                        if gate.engine_died
                        else f"{SHUTTING_DOWN}: the stream was cut at the drain deadline",
                    )
                )
                yield DONE
                return
    finally:
        await chunks.aclose()


async def _tgi_events(chunks: AsyncGenerator[str, None], tgi: TgiRequest) -> AsyncGenerator[str, None]:
    conv = TgiStream(tgi)
    async for chunk in chunks:
        for event in conv.feed(chunk):
            yield event
    for event in conv.close():
        yield event
