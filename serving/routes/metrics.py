"""``GET /metrics``: Prometheus text, vLLM's registry then ours.

vLLM's registry holds its ``vllm:*`` series and the connector's ``kvcache:tier_*``
(registered there by ``TieredKVConnector.build_prom_metrics``); ours is
``serving.metrics``. Renders what the registries hold: no engine call, nothing blocks.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


async def prometheus(request: Request) -> Response:
    app = request.app.state
    vllm_part = b""
    if app.engine.client is not None:
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        vllm_part = generate_latest(get_prometheus_registry())
    return Response(vllm_part + generate_latest(app.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def router() -> APIRouter:
    r = APIRouter()
    r.add_api_route("/metrics", prometheus, methods=["GET"])
    return r
