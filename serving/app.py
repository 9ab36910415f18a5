"""The FastAPI app SageMaker talks to: ``GET /ping``, ``POST /invocations``, ``GET /metrics``.

Runs on the server's event loop, in front of vLLM's ``AsyncLLM`` (``serving.engine``).
What must not block: ``/ping`` reads flags only (it must answer within 2 s while the
engine is busy or still loading); ``/invocations`` awaits the engine and never
computes anything heavier than JSON translation itself; ``/metrics`` renders what
the registries hold (no engine call).

Errors: every client mistake is a 4xx with a message (malformed JSON 400, wrong
types 400, body over the payload limit 413, prompt longer than the context 400,
nonsense sampling parameters 400); the engine not being ready, or the server
draining after SIGTERM, is 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from serving.config import ServingConfig
from serving.engine import Engine, State
from serving.invocations import (
    BadRequest,
    TgiStream,
    completion_to_tgi,
    parse_tgi,
    shape_of,
    tgi_to_completion,
    validation_message,
)
from serving.metrics import NvmlEnergy, ServingMetrics
from serving.sessions import (
    CLOSED_SESSION_HEADER,
    NEW_SESSION_HEADER,
    SESSION_HEADER,
    SessionError,
    Sessions,
    parse_session_request,
)

log = logging.getLogger(__name__)


class Gate:
    """Invocations in flight, and whether the server is draining (after SIGTERM)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.draining = False


def build_metrics(config: ServingConfig) -> ServingMetrics:
    # The tiers the connector enables, fastest first (their names label the metrics).
    order = tuple(t.name for t in config.plan.cache.tiers()) if config.plan is not None else ()
    fp = config.footprint
    return ServingMetrics(fp.bytes_per_token if fp else None, order, NvmlEnergy.try_create())


def error(status: int, message: str, kind: str = "BadRequestError",
          headers: Optional[dict] = None) -> JSONResponse:
    """The error body vLLM's OpenAI layer uses, so clients see one format."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status, headers=headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything over ``limit`` bytes without reading it all."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"request body of {int(declared):,} bytes is over the {limit:,}-byte "
                         "payload limit", 413)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"request body is over the {limit:,}-byte payload limit", 413)
        parts.append(chunk)
    return b"".join(parts)


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_or_abort(request: Request, work, timeout_s: float):
    """Await ``work``; cancel it (vLLM then aborts the request) if the client goes
    away or ``timeout_s`` passes. Returns None on disconnect."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        if not done:
            raise asyncio.TimeoutError
        return None
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()


def create_app(config: ServingConfig, engine: Optional[Engine] = None,
               metrics: Optional[ServingMetrics] = None) -> FastAPI:
    metrics = metrics or build_metrics(config)
    engine = engine or Engine(config.engine, metrics.observe, config.http.startup_timeout_s)
    gate = Gate()
    sessions = Sessions(config.http.session_ttl_s)
    served = config.engine.served_model_name
    limit = config.http.max_payload_bytes

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        start = asyncio.create_task(engine.start(), name="engine-start")
        yield
        gate.draining = True
        await engine.stop(start_task=start)

    app = FastAPI(title="SageMaker tiered-KV-cache LLM server", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.gate, app.state.metrics = engine, gate, metrics
    app.state.sessions, app.state.config = sessions, config

    # -- /ping -------------------------------------------------------------------------
    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        if gate.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if engine.healthy:
            return JSONResponse({"status": "healthy"})
        body: dict[str, Any] = {"status": "warming" if engine.warmup is not None else engine.state.value}
        if engine.state is State.READY:
            body["status"] = "engine dead"
        if engine.error is not None:
            body["error"] = str(engine.error)
        return JSONResponse(body, status_code=503)

    # -- /metrics ------------------------------------------------------------------------
    @app.get("/metrics")
    async def prometheus() -> Response:
        """vLLM's registry (its ``vllm:*`` series and the connector's ``kvcache:tier_*``,
        registered there by ``TieredKVConnector.build_prom_metrics``), then ours."""
        vllm_part = b""
        if engine.client is not None:
            from vllm.v1.metrics.prometheus import get_prometheus_registry

            vllm_part = generate_latest(get_prometheus_registry())
        return Response(vllm_part + generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- /invocations ----------------------------------------------------------------
    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        session = request.headers.get(SESSION_HEADER)
        echo = {SESSION_HEADER: session} if session else {}
        if gate.draining:
            return error(503, "the server is shutting down", "ServiceUnavailableError", echo)
        shape = "unknown"
        gate.in_flight += 1
        metrics.in_flight.inc()
        streaming = False
        try:
            body = await read_body(request, limit)
            try:
                payload = json.loads(body)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise BadRequest(f"malformed JSON: {e}") from None
            shape = shape_of(payload)
            if shape == "session":
                response = _session(payload, session)
            else:
                if session and config.http.sessions_enabled and not sessions.is_live(session):
                    raise BadRequest(f"session {session!r} is not open on this instance (closed, "
                                     "expired, or lost in a restart); start a new one with "
                                     '{"requestType": "NEW_SESSION"}')
                if not engine.healthy:
                    response = error(503, f"the engine is not ready ({engine.state.value})",
                                     "ServiceUnavailableError")
                else:
                    response = await _generate(request, shape, payload, session)
            streaming = isinstance(response, StreamingResponse)
            if streaming:
                response.body_iterator = _tracked(response.body_iterator)
        except BadRequest as e:
            response = error(e.status, e.message, "BadRequestError" if e.status == 400 else
                             "RequestEntityTooLarge")
        except asyncio.TimeoutError:
            response = error(504, f"no answer within {config.http.invocation_timeout_s:.0f} s "
                             "(SAGEMAKER_MODEL_SERVER_TIMEOUT)", "TimeoutError")
        finally:
            if not streaming:
                gate.in_flight -= 1
                metrics.in_flight.dec()
        metrics.invocations.labels(shape, str(response.status_code)).inc()
        response.headers.update(echo)
        return response

    async def _tracked(body: AsyncIterator) -> AsyncIterator:
        """A streamed body counts as in flight until its last byte."""
        try:
            async for chunk in body:
                yield chunk
        finally:
            gate.in_flight -= 1
            metrics.in_flight.dec()

    def _session(payload: dict, session: Optional[str]) -> Response:
        if not config.http.sessions_enabled:
            raise BadRequest("stateful sessions are off (SAGEMAKER_ENABLE_STATEFUL_SESSIONS=false)")
        try:
            kind = parse_session_request(payload)
            if kind == "NEW_SESSION":
                sid, header = sessions.create()
                return JSONResponse({"session_id": sid}, headers={NEW_SESSION_HEADER: header})
            if not session:
                raise SessionError(f'{{"requestType": "CLOSE"}} needs the {SESSION_HEADER} header')
            sessions.close(session)
            return JSONResponse({"closed": session}, headers={CLOSED_SESSION_HEADER: session})
        except SessionError as e:
            raise BadRequest(str(e)) from None

    async def _generate(request: Request, shape: str, payload: dict,
                        session: Optional[str]) -> Response:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        tgi = parse_tgi(payload) if shape == "tgi" else None
        body = tgi_to_completion(tgi, served) if tgi else dict(payload)
        body.setdefault("model", served)
        if session:
            body.setdefault("session_id", session)
        model_cls = ChatCompletionRequest if shape == "chat" else CompletionRequest
        try:
            req = model_cls.model_validate(body)
        except ValidationError as e:
            raise BadRequest(validation_message(e)) from None
        handler = (engine.chat.create_chat_completion if shape == "chat"
                   else engine.completion.create_completion)
        if req.stream:
            result = await _call(handler, req, request)
        else:
            result = await run_or_abort(request, _call(handler, req, request),
                                        config.http.invocation_timeout_s)
            if result is None:  # the client went away
                return Response(status_code=499)
        return _respond(result, tgi)

    def _respond(result: Any, tgi) -> Response:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        if isinstance(result, ErrorResponse):
            return JSONResponse(result.model_dump(), status_code=result.error.code)
        if isinstance(result, JSONResponse):
            return result
        if hasattr(result, "model_dump"):
            data = result.model_dump()
            return JSONResponse(completion_to_tgi(data, tgi) if tgi else data)
        stream = _tgi_events(result, tgi) if tgi else result
        return StreamingResponse(stream, media_type="text/event-stream")

    async def _tgi_events(chunks: AsyncIterator[str], tgi) -> AsyncIterator[str]:
        conv = TgiStream(tgi)
        async for chunk in chunks:
            for event in conv.feed(chunk):
                yield event
        for event in conv.close():
            yield event

    return app


async def _call(handler, req, raw_request):
    """Call vLLM's serving layer; its exceptions become its own error responses (4xx for
    bad input), exactly as its API server's exception handlers would answer."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    try:
        return await handler(req, raw_request)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        err = create_error_response(e)
        if err.error.code >= 500:
            log.exception("request failed")
        return JSONResponse(err.model_dump(), status_code=err.error.code)
