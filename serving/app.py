"""Assembles the FastAPI app SageMaker talks to from the route modules in ``serving.routes``.

``create_app(config)`` runs once in the server process, before the port is bound. It
builds the metrics, the engine (started by the app's lifespan, in the background, so
``/ping`` answers 503 while vLLM loads) and the request gate, then mounts:

- ``GET /ping`` (``routes.ping``), ``POST /invocations`` (``routes.invocations``), both
  registered with the SageMaker standards library (``model_hosting_container_standards``),
  whose ``bootstrap`` mounts them, applies a custom handler if the deployment names one,
  and adds its middlewares;
- the OpenAI routes (``routes.openai``) and ``GET /metrics`` (``routes.metrics``);
- the request guard (``serving.guard``) in front of every model route, and exception
  handlers that give every error the one JSON shape (``serving.errors``).

Nothing here blocks a request: everything above happens before serving starts.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from cache.assembly import pin_book
from serving.config import HttpSettings, ServingConfig
from serving.engine import Engine
from serving.errors import error_response, response_for
from serving.guard import Gate, RequestGuard
from serving.metrics import NvmlEnergy, ServingMetrics
from serving.routes import invocations, metrics, openai, ping
from serving.sessions import bounded_manager

log = logging.getLogger(__name__)

MODEL_ROUTES = frozenset({"/invocations", *openai.SHAPES})


def build_metrics(config: ServingConfig) -> ServingMetrics:
    # The tiers the connector enables, fastest first (their names label the metrics).
    order = tuple(t.name for t in config.plan.cache.tiers()) if config.plan is not None else ()
    fp = config.footprint
    return ServingMetrics(
        fp.bytes_per_token if fp else None,
        order,
        NvmlEnergy.try_create(),
        fp.bytes_per_request if fp else None,
        _pins(config),
    )


def _pins(config: ServingConfig):
    """``(PinBook, tier name)`` of the tier that keeps pins (``cache.pins``), for the metrics."""
    cache = config.plan.cache if config.plan is not None else None
    book = pin_book(cache) if cache is not None else None
    if cache is None or book is None:
        return None
    return book, next(t.name for t in cache.tiers() if t.last_local)


def load_standards(http: HttpSettings):
    """The SageMaker standards library, its stateful-session manager set from our
    settings (bounded: ``serving.sessions``). Importing it re-levels the root logger's
    handlers (as vLLM notes): undone."""
    root = logging.getLogger()
    levels = [(h, h.level) for h in root.handlers]
    root_level = root.level
    try:
        import model_hosting_container_standards.sagemaker as standards
        from model_hosting_container_standards.sagemaker.sessions import manager
    finally:
        root.setLevel(root_level)
        for handler, level in levels:
            handler.setLevel(level)
    options = {"sessions_expiration": str(http.session_ttl_s)}
    if http.sessions_path:
        options["sessions_path"] = http.sessions_path
    manager.session_manager = bounded_manager(options, http.max_sessions) if http.sessions_enabled else None
    return standards


def create_app(
    config: ServingConfig, engine: Optional[Engine] = None, metrics_: Optional[ServingMetrics] = None
) -> FastAPI:
    registry = metrics_ or build_metrics(config)
    gate = Gate()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        start = asyncio.create_task(app.state.engine.start(), name="engine-start")
        yield
        gate.draining = True
        await app.state.engine.stop(start_task=start)

    app = FastAPI(
        title="SageMaker tiered-KV-cache LLM server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.engine = engine or Engine(
        config.engine, registry.observe, config.http.startup_timeout_s, vllm_state=app.state
    )
    app.state.gate, app.state.metrics, app.state.config = gate, registry, config
    if config.engine.warm_dram_bytes:
        registry.watch_dram_warm(lambda: app.state.engine.dram_warm)

    standards = load_standards(config.http)
    for r in (ping.router(standards), invocations.router(standards), openai.router(), metrics.router()):
        app.include_router(r)
    _error_handlers(app)
    app.add_middleware(
        RequestGuard,
        gate=gate,
        metrics=registry,
        max_body=config.http.max_payload_bytes,
        guarded=MODEL_ROUTES.__contains__,
    )
    return standards.bootstrap(app)


def _error_handlers(app: FastAPI) -> None:
    async def http_error(request: Request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    async def validation_error(request: Request, exc: RequestValidationError):
        return error_response(400, f"invalid request: {exc.errors()}")

    async def unexpected(request: Request, exc: Exception):
        return response_for(exc)

    # (Starlette types every handler for Exception; it calls each only with its own class.)
    app.add_exception_handler(HTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, unexpected)
