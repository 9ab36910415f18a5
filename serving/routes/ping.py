"""``GET /ping`` (and POST, as vLLM's router answers it): SageMaker's health check.

Reads flags only (the gate's draining flag, the engine's state): it must answer
within 2 s while the engine loads or is busy. 200 when the engine can serve; 503 while
starting (``warming`` during pre-warming, ``warming dram`` while the DRAM warm-up of
``KVCACHE_WARM_DRAM`` runs, with its progress), while draining, and after the engine died
(``engine dead``, for the seconds until the server exits: ``serving.__main__``).
Registered as the SageMaker standards library's ping handler, so a custom ping handler
(``CUSTOM_FASTAPI_PING_HANDLER``, or ``custom_sagemaker_ping_handler`` in the model's
``model.py``) replaces it.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from serving.engine import State


async def ping(raw_request: Request) -> Response:
    app = raw_request.app.state
    engine, gate = app.engine, app.gate
    if gate.draining and not gate.engine_died:
        return JSONResponse({"status": "draining"}, status_code=503)
    if engine.healthy and engine.warming:
        p = engine.dram_warm.progress()
        return JSONResponse(
            {
                "status": "warming dram",
                "entries": p["prompts"]["warm"] + p["hot"]["warm"],
                "bytes": p["prompts"]["bytes"] + p["hot"]["bytes"],
            },
            status_code=503,
        )
    if engine.healthy:
        return JSONResponse({"status": "healthy"})
    body: dict[str, Any] = {"status": "warming" if engine.warmup is not None else engine.state.value}
    if engine.state is State.READY:
        body["status"] = "engine dead"
    if engine.error is not None:
        body["error"] = str(engine.error)
    return JSONResponse(body, status_code=503)


def router(standards) -> APIRouter:
    r = APIRouter()
    handler = standards.register_ping_handler(ping)
    r.add_api_route("/ping", handler, methods=["GET"])
    r.add_api_route("/ping", handler, methods=["POST"])
    return r
