"""The OpenAI routes on the same port: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``, and, for a model that pools, ``/v1/embeddings``, ``/classify``,
``/score``, ``/rerank`` and ``/pooling`` (vLLM's own endpoints for those).

HyperPod's samples point ``invocationEndpoint`` at ``v1/chat/completions``; a client
written for ``vllm serve`` works unchanged. Every POST goes through the same guard
and the same path as ``/invocations`` (``serving.pipeline``): the same validation,
errors, metrics and shutdown behaviour, and the same check of a
``X-Amzn-SageMaker-Session-Id`` header (``serving.sessions``). Event loop; nothing blocks.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from serving.errors import error_response, response_for
from serving.pipeline import serve
from serving.sessions import check_session_header

SHAPES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": "embeddings",
    "/classify": "classify",
    "/score": "score",
    "/v1/score": "score",
    "/rerank": "rerank",
    "/v1/rerank": "rerank",
    "/pooling": "pooling",
}


def _route(shape: str):
    async def endpoint(raw_request: Request) -> Response:
        raw_request.state.shape = shape
        refused = check_session_header(raw_request)  # as /invocations checks it
        if refused is not None:
            return refused
        try:
            payload = json.loads(await raw_request.body())
        except Exception as e:
            return response_for(e, validating=True)
        return await serve(raw_request, shape, payload)

    endpoint.__name__ = f"openai_{shape}"
    return endpoint


async def models(raw_request: Request) -> Response:
    engine = raw_request.app.state.engine
    if not engine.healthy or engine.models is None:
        return error_response(503, f"the engine is not ready ({engine.state.value})")
    listing = await engine.models.show_available_models()
    return JSONResponse(listing.model_dump())


def router() -> APIRouter:
    r = APIRouter()
    for path, shape in SHAPES.items():
        r.add_api_route(path, _route(shape), methods=["POST"])
    r.add_api_route("/v1/models", models, methods=["GET"])
    return r
