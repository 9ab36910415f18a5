"""``POST /invocations``: SageMaker's inference route, the body picks the shape.

- ``{"messages": [...]}`` OpenAI chat, ``{"prompt": ...}`` OpenAI completion,
  ``{"inputs": ..., "parameters": {...}}`` TGI / LMI (served as a completion);
- for a model that pools (embeddings, classification, scores), vLLM's pooling
  requests, tried in vLLM's order as its own SageMaker router does;
- ``{"requestType": "NEW_SESSION" | "CLOSE"}``: SageMaker stateful sessions.

Built on the SageMaker standards library (``model_hosting_container_standards``), as
vLLM's own SageMaker router is: its session manager intercepts session requests and
checks the ``X-Amzn-SageMaker-Session-Id`` of every other request (unknown or closed:
400; ``NEW_SESSION`` on an ordinary request is served as one; at most
``SERVING_MAX_SESSIONS`` open, a new one past that is a 429: ``serving.sessions``), its adapter injection
puts ``X-Amzn-SageMaker-Adapter-Identifier`` (inference components' LoRA adapters) in
the body's ``model``, and a custom invocation handler (``CUSTOM_FASTAPI_INVOCATION_HANDLER``
or ``custom_sagemaker_invocation_handler`` in the model's ``model.py``) replaces this one.
The body reaching here has passed ``serving.guard`` (bounded, a JSON object). Runs on
the event loop; the request itself is served by ``serving.pipeline``.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import Response

from serving.errors import response_for
from serving.pipeline import serve, shape_of
from serving.sessions import limit_sessions


async def invocations(raw_request: Request) -> Response:
    raw_request.state.shape = "unknown"
    try:
        payload = json.loads(await raw_request.body())
        shape = shape_of(payload, raw_request.app.state.engine.tasks or ("generate",))
    except Exception as e:
        return response_for(e, validating=True)
    return await serve(raw_request, shape, payload)


def router(standards) -> APIRouter:
    handler = standards.register_invocation_handler(
        limit_sessions(
            standards.stateful_session_manager()(standards.inject_adapter_id(adapter_path="model")(invocations))
        )
    )
    r = APIRouter()
    r.add_api_route("/invocations", handler, methods=["POST"])
    return r
