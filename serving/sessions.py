"""SageMaker stateful sessions: the create/close protocol and the session registry.

SageMaker routes every request that carries ``X-Amzn-SageMaker-Session-Id`` to the
instance that created the session, so a conversation keeps landing where its KV is
cached. The container's part (the shapes SageMaker and AWS's model-hosting
container standards use):

- ``{"requestType": "NEW_SESSION"}`` -> 200 with
  ``X-Amzn-SageMaker-New-Session-Id: <id>; Expires=<UTC ISO-8601>``;
- ``{"requestType": "CLOSE"}`` with the session header -> 200 with
  ``X-Amzn-SageMaker-Closed-Session-Id: <id>``;
- any other request with the session header must name a live session (else 400); the
  header is echoed on the response.

Runs on the event loop; the registry is a dict, touched only there (no lock). Sessions
live in memory: after a restart a client gets 400 and opens a new session.
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timezone
from typing import Callable

SESSION_HEADER = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION_HEADER = "X-Amzn-SageMaker-New-Session-Id"
CLOSED_SESSION_HEADER = "X-Amzn-SageMaker-Closed-Session-Id"
REQUEST_TYPES = ("NEW_SESSION", "CLOSE")


class SessionError(Exception):
    """A session request that cannot be honoured (HTTP 400)."""


class Sessions:
    def __init__(self, ttl_s: float = 1200, clock: Callable[[], float] = time.time,
                 max_sessions: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self.max_sessions = max_sessions
        self._expiry: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._expiry)

    def _sweep(self) -> None:
        t = self.clock()
        for sid in [s for s, exp in self._expiry.items() if exp <= t]:
            del self._expiry[sid]

    def create(self) -> tuple[str, str]:
        """A new session: its id and the value of the New-Session-Id header."""
        self._sweep()
        if len(self._expiry) >= self.max_sessions:
            raise SessionError(f"too many open sessions ({self.max_sessions}); close some first")
        sid = str(uuid.uuid4())
        expires = self.clock() + self.ttl_s
        self._expiry[sid] = expires
        stamp = datetime.fromtimestamp(expires, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return sid, f"{sid}; Expires={stamp}"

    def is_live(self, sid: str) -> bool:
        exp = self._expiry.get(sid)
        if exp is None:
            return False
        if exp <= self.clock():
            del self._expiry[sid]
            return False
        return True

    def close(self, sid: str) -> None:
        if not self.is_live(sid):
            raise SessionError(f"session {sid!r} is not open on this instance (closed, expired, "
                               "or created before a restart)")
        del self._expiry[sid]


def parse_session_request(body: dict) -> str:
    """``NEW_SESSION`` or ``CLOSE``; SessionError for anything else."""
    if set(body) != {"requestType"} or body["requestType"] not in REQUEST_TYPES:
        raise SessionError('a session request is exactly {"requestType": "NEW_SESSION"} or '
                           '{"requestType": "CLOSE"}')
    return body["requestType"]
