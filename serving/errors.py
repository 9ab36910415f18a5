"""The one error shape every route answers with, and which exception is whose mistake.

Runs on the server's event loop; pure functions and tiny responses, nothing blocks.

Every error body is vLLM's OpenAI one, ``{"error": {"message", "type", "code"}}`` (plus
vLLM's ``param`` where vLLM names one), whichever layer found the problem: our request
guard (payload, media type, JSON bounds), our translation of a request shape, vLLM's
request models and serving layer, the SageMaker standards library (sessions, adapters),
or an unexpected failure (500, logged with its traceback).

Which side made the mistake, in order:
- ``ClientError`` (ours) carries its status;
- an HTTP exception (Starlette's, FastAPI's, the standards library's) carries its status;
- vLLM's own exceptions are classified by vLLM (``create_error_response``: its
  ``VLLMValidationError`` and other client errors are 4xx, ``ValueError`` / ``TypeError``
  are 400, engine failures 5xx);
- anything raised while a request is validated or translated (``validating=True``) is
  the request's fault: 400. vLLM's request models raise plain ``TypeError`` and
  ``VLLMValidationError`` from their validators for input that fails their checks
  (``messages: 1.5``, an empty prompt, ``top_logprobs`` without ``logprobs``...), so
  the class of errors, not a list of examples, is what is mapped.
"""

from __future__ import annotations

import logging
import sys
from http import HTTPStatus
from typing import Any, Optional

from fastapi.responses import JSONResponse

log = logging.getLogger(__name__)

KINDS = {
    400: "BadRequestError",
    404: "NotFoundError",
    408: "RequestTimeout",
    413: "RequestEntityTooLarge",
    415: "UnsupportedMediaType",
    422: "UnprocessableEntityError",
    424: "FailedDependency",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


class ClientError(Exception):
    """A mistake in the request; ``status`` is the HTTP status (4xx)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def kind_of(status: int) -> str:
    if status in KINDS:
        return KINDS[status]
    try:
        return HTTPStatus(status).phrase.replace(" ", "")
    except ValueError:
        return "Error"


def error_body(status: int, message: str, kind: Optional[str] = None, param: Optional[str] = None) -> dict:
    err: dict[str, Any] = {"message": message, "type": kind or kind_of(status), "code": status}
    if param is not None:
        err["param"] = param
    return {"error": err}


def error_response(
    status: int, message: str, kind: Optional[str] = None, headers: Optional[dict] = None, param: Optional[str] = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind, param), status_code=status, headers=headers)


def validation_message(e) -> str:
    """A pydantic ``ValidationError`` as one line per problem: ``field.path: message``."""
    parts = []
    for err in e.errors(include_url=False)[:10]:
        where = ".".join(str(p) for p in err.get("loc", ())) or "body"
        parts.append(f"{where}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)


def classify(exc: BaseException, validating: bool = False) -> tuple[int, str, str, Optional[str]]:
    """``(status, message, type, param)`` for an exception raised while serving a request."""
    from pydantic import ValidationError
    from starlette.exceptions import HTTPException

    if isinstance(exc, ClientError):
        return exc.status, exc.message, kind_of(exc.status), None
    if isinstance(exc, HTTPException):
        return exc.status_code, str(exc.detail), kind_of(exc.status_code), None
    if isinstance(exc, ValidationError):
        return 400, validation_message(exc), kind_of(400), None
    if isinstance(exc, RecursionError):
        return 400, "the request is nested too deeply", kind_of(400), None
    status, message, kind, param = 500, f"{type(exc).__name__}: {exc}", kind_of(500), None
    if "vllm" in sys.modules:  # vLLM's own classification of its exceptions
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        err = create_error_response(exc).error
        status, message, kind, param = err.code, err.message, err.type, err.param
    if validating and status >= 500:
        return 400, f"invalid request: {message}", kind_of(400), param
    return status, message, kind, param


def response_for(exc: BaseException, validating: bool = False) -> JSONResponse:
    """The JSON error answer for ``exc``; a 5xx is logged with its traceback."""
    status, message, kind, param = classify(exc, validating)
    if status >= 500:
        log.error("request failed: %s", message, exc_info=exc)
    return error_response(status, message, kind, param=param)
