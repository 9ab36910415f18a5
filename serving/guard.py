"""The request guard: what every model request passes before any route parses it.

An ASGI middleware in front of the model routes (``POST /invocations`` and the
``/v1/...`` routes). Runs on the server's event loop; the only work it does per
request is reading the body (bounded by the payload limit), parsing it and one walk of
what was parsed, tens of milliseconds for the largest body SageMaker accepts. In order:

1. draining after SIGTERM, or after the engine died: 503;
2. a ``Content-Type`` that is not JSON (``application/json`` or ``*/*+json``): 415;
3. a body over the payload limit (``SAGEMAKER_MAX_PAYLOAD_IN_MB``): 413, read no further;
4. the body must be UTF-8 JSON text of one object, bounded in nesting, numbers and
   strings (``serving.body``: parsed, then bounded; 400 otherwise); it is handed on,
   replayed to the route as it was received.

It also keeps the invocation metrics: every answer, whatever its status (500s
included), is counted in ``sagemaker_invocations_total{shape,status}`` (the route
names the shape in ``request.state.shape``), and the request counts as in flight
until its last byte is sent (a stream too). An exception no route handled becomes the
JSON 500 here, logged with its traceback, so no client ever sees a plain-text error.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable, Optional

from serving.body import BodyError, parse_body
from serving.errors import error_response
from serving.metrics import ServingMetrics

log = logging.getLogger(__name__)

OFF_LOOP_BYTES = 256 * 1024  # larger bodies are checked in a thread


SHUTTING_DOWN = "the server is shutting down"
ENGINE_DIED = "the engine died: this server process exits so that it is replaced; retry the request"


class Gate:
    """Requests in flight and the drain state, shared by the guard, the routes and the
    shutdown sequence (``serving.__main__``). Event loop only."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.draining = False
        self.engine_died = False  # draining because the engine died (not a SIGTERM)
        self.cut = asyncio.Event()  # set at the drain deadline: requests still running end with 503

    def cut_all(self) -> None:
        self.cut.set()

    @property
    def refusal(self) -> str:
        """What a request is told while the server drains."""
        return ENGINE_DIED if self.engine_died else SHUTTING_DOWN


def is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media in ("", "application/json") or media.endswith("+json")


class RequestGuard:
    """Pure ASGI middleware (see the module docstring). ``guarded(path)`` says which
    POST routes it applies to; everything else passes untouched."""

    def __init__(
        self, app, *, gate: Gate, metrics: ServingMetrics, max_body: int, guarded: Callable[[str], bool]
    ) -> None:
        self.app, self.gate, self.metrics = app, gate, metrics
        self.max_body, self.guarded = max_body, guarded

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not self.guarded(scope["path"]):
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        status: list[int] = []

        async def tracked_send(message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        self.gate.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            refusal, body = await self._admit(scope, receive)
            if refusal is not None:
                await refusal(scope, receive, tracked_send)
            else:
                await self.app(scope, _replay(body, receive), tracked_send)
        except Exception as e:  # a route let it through: still the one JSON shape
            log.exception("unhandled error serving %s", scope["path"])
            if not status:
                status.append(500)
                await error_response(500, f"internal error: {type(e).__name__}")(scope, receive, tracked_send)
        finally:
            self.gate.in_flight -= 1
            self.metrics.in_flight.dec()
            self.metrics.invocations.labels(
                state.get("shape", "unknown"), str(status[0] if status else CLIENT_LEFT)
            ).inc()

    async def _admit(self, scope, receive):
        """``(refusal, None)`` or ``(None, body)``."""
        if self.gate.draining:
            return error_response(503, self.gate.refusal), None
        headers = _headers(scope["headers"])
        ctype = headers.get("content-type", "")
        if not is_json(ctype):
            return error_response(415, f"Content-Type {ctype!r} is not JSON; send application/json"), None
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body:
            return _too_large(int(declared), self.max_body), None
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return _client_left, None  # before sending its whole body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return _too_large(None, self.max_body), None
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(parts)
        # A large body is scanned and parsed off the event loop (6 MiB: ~0.1 s of CPU).
        refusal, payload = await asyncio.to_thread(_check, body) if len(body) > OFF_LOOP_BYTES else _check(body)
        if payload is not None and "requestType" in payload:
            scope["state"]["shape"] = "session"  # answered by the standards library, not a route of ours
        return refusal, (body if refusal is None else None)


def _check(body: bytes):
    """``(None, payload)`` for a body the routes may parse, else ``(refusal, None)``."""
    try:
        return None, parse_body(body)
    except BodyError as e:
        return error_response(400, str(e)), None


CLIENT_LEFT = 499  # nginx's "client closed request": nothing was sent back


async def _client_left(scope, receive, send) -> None:
    """Nothing to answer: the client is gone."""


def _too_large(declared: Optional[int], limit: int):
    what = f"request body of {declared:,} bytes" if declared else "request body"
    return error_response(413, f"{what} is over the {limit:,}-byte payload limit (SAGEMAKER_MAX_PAYLOAD_IN_MB)")


def _headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw}


def _replay(body: bytes, receive):
    """A ``receive`` that hands the route the body already read, then the real one
    (which reports the client's disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
