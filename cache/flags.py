"""The one parser of true/false setting values, for every reader of an environment
(``cache.config`` for ``KVCACHE_*``, ``serving.config`` and ``serving.model`` for the
server's settings): the same spellings mean the same thing everywhere.

Accepted, in any case and with surrounding blanks: ``1``, ``true``, ``yes``, ``on`` and
``0``, ``false``, ``no``, ``off``. Unset or blank is the default; anything else is a
``ConfigError`` naming the variable. A leaf: pure functions, imports only
``cache.errors``.
"""

from __future__ import annotations

from typing import Optional, Protocol, overload

from cache.errors import ConfigError

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


class Values(Protocol):
    """Where settings are read from: an environment mapping, or ``cache.config``'s reader
    (which resolves deprecated names)."""

    def get(self, name: str, /) -> Optional[str]: ...


@overload
def parse_bool(env: Values, name: str, default: bool) -> bool: ...
@overload
def parse_bool(env: Values, name: str, default: None) -> Optional[bool]: ...


def parse_bool(env: Values, name: str, default: Optional[bool]) -> Optional[bool]:
    """Setting ``name`` of ``env`` as a bool; ``default`` when it is unset or blank."""
    raw = env.get(name)
    text = "" if raw is None else str(raw).strip().lower()
    if not text:
        return default
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} must be true or false ({'/'.join(TRUE)} or {'/'.join(FALSE)})")
