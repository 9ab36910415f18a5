"""SageMaker stateful sessions: a bounded registry, and the session header on every model route.

Runs in the server process, on the event loop: dictionary lookups, and for a new session
one small folder (the standards library's, ``model_hosting_container_standards``).

- **Bounded.** The library keeps each session in a folder of ``SAGEMAKER_SESSIONS_PATH``
  (``/dev/shm`` by default: RAM) and bounds nothing: 400 ``NEW_SESSION`` requests made 400
  folders. ``BoundedSessionManager`` (the library's ``SessionManager``) holds at most
  ``SERVING_MAX_SESSIONS`` open sessions. A ``NEW_SESSION`` request first removes the
  expired ones (the library does so before each new session); when the live ones still
  fill the bound, ``limit_sessions`` answers it 429, naming the bound and when the oldest
  session expires. Nothing open is evicted: a client's live session is never taken from it.
- **Checked on every model route.** ``/invocations`` checks ``X-Amzn-SageMaker-Session-Id``
  through the library; ``check_session_header`` gives the ``/v1`` routes the same check,
  with the library's own function: an unknown or closed id is a 400, ``NEW_SESSION`` is
  served as a request without a session, the header with sessions off is a 400. With
  custom session handlers registered, the library checks nothing, nor does this.
"""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable, Optional

from fastapi import Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from serving.errors import error_response

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Amzn-SageMaker-Session-Id"


class SessionLimit(RuntimeError):
    """A new session past ``SERVING_MAX_SESSIONS`` (only when two arrive at once: the
    route answers 429 before the library gets there)."""


def bounded_manager(properties: dict, max_sessions: int):
    """The library's ``SessionManager`` holding at most ``max_sessions`` open sessions."""
    from model_hosting_container_standards.sagemaker.sessions.manager import SessionManager

    class BoundedSessionManager(SessionManager):
        limit = max_sessions
        refusing = False  # logged once per run of refusals

        def full(self) -> bool:
            """Whether a new session must be refused, once the expired ones are gone."""
            with self._lock:
                if len(self.sessions) < self.limit:
                    return False
                self._clean_expired_session()
                return len(self.sessions) >= self.limit

        def refusal(self) -> str:
            with self._lock:
                ends = [s.expiration_ts for s in self.sessions.values() if s.expiration_ts]
            wait = f"; the oldest expires in {max(0.0, min(ends) - time.time()):.0f} s" if ends else ""
            return (
                f"too many open sessions: {len(self.sessions)} of SERVING_MAX_SESSIONS={self.limit}; "
                f"close one (requestType CLOSE) or retry once one expires{wait}"
            )

        def create_session(self):
            with self._lock:
                if self.full():
                    raise SessionLimit(self.refusal())
                self.refusing = False
                return super().create_session()

    return BoundedSessionManager(properties)


def _manager():
    from model_hosting_container_standards.sagemaker.sessions import manager

    return manager.get_session_manager()


def _custom_handlers() -> bool:
    from model_hosting_container_standards.common.handler import handler_registry

    return handler_registry.has_handler("create_session") or handler_registry.has_handler("close_session")


def limit_sessions(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """``/invocations``: a ``NEW_SESSION`` request past ``SERVING_MAX_SESSIONS`` answers 429;
    everything else goes to ``handler`` (the library's session manager and our route)."""

    async def invocations(raw_request: Request) -> Response:
        manager = _manager()
        if getattr(manager, "full", None) is not None and not _custom_handlers():
            try:
                body = await raw_request.json()  # (parsed once: Starlette keeps it for the library)
            except (ValueError, RecursionError):  # (the guard let it through: the library answers it)
                body = None
            if isinstance(body, dict) and body.get("requestType") == "NEW_SESSION" and manager.full():
                if not manager.refusing:
                    manager.refusing = True
                    log.warning("refusing new sessions (429): %s", manager.refusal())
                return error_response(429, manager.refusal())
        return await handler(raw_request)

    invocations.__name__ = getattr(handler, "__name__", "invocations")
    return invocations


def check_session_header(raw_request: Request) -> Optional[Response]:
    """The error answer for a bad ``X-Amzn-SageMaker-Session-Id``, None when it is fine or
    absent (the check ``/invocations`` makes, for the ``/v1`` routes)."""
    from model_hosting_container_standards.sagemaker.sessions.utils import get_session

    if not raw_request.headers.get(SESSION_HEADER) or _custom_handlers():
        return None
    try:
        get_session(_manager(), raw_request)
    except ValueError as e:
        return error_response(400, f"Bad request: {e}")
    except HTTPException as e:
        return error_response(e.status_code, str(e.detail))
    return None
