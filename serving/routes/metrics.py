"""``GET /metrics``: Prometheus text, vLLM's registry then ours.

vLLM's registry holds its ``vllm:*`` series and the connector's ``kvcache:tier_*``
(registered there by ``TieredKVConnector.build_prom_metrics``); ours is
``serving.metrics``. Renders what the registries hold, in a thread (our pin series read
the pin file at scrape time): no engine call, nothing blocks the event loop.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


async def prometheus(request: Request) -> Response:
    app = request.app.state
    registries = []
    if app.engine.client is not None:
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        registries.append(get_prometheus_registry())
    registries.append(app.metrics.registry)
    body = await asyncio.to_thread(lambda: b"".join(generate_latest(r) for r in registries))
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def router() -> APIRouter:
    r = APIRouter()
    r.add_api_route("/metrics", prometheus, methods=["GET"])
    return r
