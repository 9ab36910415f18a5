"""What one request may tell the cache: the keys of vLLM's per-request ``kv_transfer_params``
this connector reads, and the one check of their values.

``kv_transfer_params`` is a flat map; the connector reads four keys of it:

- ``kvcache_load``: ``false`` computes the prompt instead of loading it from the tiers;
- ``kvcache_save``: ``false`` stores nothing of the request;
- ``kvcache_pin_ttl`` and ``kvcache_pin_tokens``: a pin (``cache.pins.pin_ask``).

``check_params`` runs where a request comes in (the server, ``serving.pipeline``, before
vLLM sees it): any other key (a nested value of any kind, vLLM's disaggregated-prefill keys,
the ``kvcache_*`` keys of an answer sent back as a question) and any value of the wrong type
is a ``ParamsError`` naming the key. ``kvcache_load`` and ``kvcache_save`` take JSON
booleans only (``null`` means not given); ``"false"`` or ``0`` are refused, not read as
"load". ``wants`` is the scheduler's reading (vLLM's engine-core process): it never
raises, whatever reached it by another way (an offline ``vllm.LLM``). Pure functions.
"""

from __future__ import annotations

from typing import Any, Optional

from cache.errors import ParamsError, PinError
from cache.pins import pin_ask

LOAD, SAVE = "kvcache_load", "kvcache_save"
PIN_TTL, PIN_TOKENS = "kvcache_pin_ttl", "kvcache_pin_tokens"
KEYS = (LOAD, SAVE, PIN_TTL, PIN_TOKENS)
SWITCHES = (LOAD, SAVE)


def check_params(params: Any) -> None:
    """``ParamsError`` unless ``params`` is None or a flat map of ``KEYS`` with values of
    their types (module docstring)."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise ParamsError(f"must be an object of {', '.join(KEYS)}, not {type(params).__name__}")
    unknown = [k for k in params if k not in KEYS]
    if unknown:
        listed = ", ".join(repr(k) if len(k) <= 64 else repr(k[:64]) + "..." for k in unknown[:5])
        raise ParamsError(
            f"unknown key(s) {listed}{' ...' if len(unknown) > 5 else ''}: this server reads {', '.join(KEYS)}"
        )
    for key in SWITCHES:
        value = params.get(key)
        if value is not None and not isinstance(value, bool):
            raise ParamsError(f"{key}={_short(value)} must be true or false (a JSON boolean)")
    try:
        pin_ask(params)
    except PinError as e:
        raise ParamsError(str(e)) from None


def wants(params: Optional[Any], key: str) -> bool:
    """Whether a request's ``kv_transfer_params`` leave ``key`` (``LOAD`` or ``SAVE``) on:
    only an explicit JSON ``false`` turns it off."""
    return not (isinstance(params, dict) and params.get(key) is False)


def request_wants(request: Any, key: str) -> bool:
    """``wants`` for a vLLM ``Request`` (scheduler side; its params may be absent)."""
    return wants(getattr(request, "kv_transfer_params", None), key)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."
