"""Cache control per request: pin a prompt's prefix in the cache for a time (``cache.pins``).

Two ways to ask, checked here before vLLM sees the body (a bad one is a 400 in the
server's one error shape):

- a chat message carries ``"cache_control": {"type": "ephemeral", "ttl": "5m" | "1h"}``
  (``ttl`` defaults to ``5m``), on the message or on one of its content parts, as hosted
  APIs accept it: the prompt up to and including that message is pinned. With several
  marked messages, the prefix through the last one is pinned, for the longest ``ttl``
  given. The field is taken out of the message before vLLM validates it;
- any request (chat, completion, TGI's ``parameters``) sets ``kv_transfer_params``
  ``{"kvcache_pin_ttl": SECONDS | "5m" | "1h"}``, optionally with ``"kvcache_pin_tokens": N``
  (the first N prompt tokens; default the whole prompt).

``check_transfer_params`` checks everything else a request hands the engine beside its
prompt: ``kv_transfer_params`` holds only the cache's keys, with values of their types
(``cache.request_params``: ``kvcache_load``/``kvcache_save`` are JSON booleans).

A chat message before the last is turned into a token count by rendering the messages up
to it with vLLM's own chat template (``render_chat_request``, no generation prompt). The
answer's ``kv_transfer_params["kvcache_pin"]`` says whether the pin was taken and, if
not, why (``cache.vllm.pinning``). Runs on the server's event loop: dictionary work, and
one extra render awaited on vLLM's renderer for a pin on an earlier message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from cache.errors import ParamsError
from cache.pins import TTL_NAMES, pin_ask
from cache.request_params import check_params
from serving.errors import ClientError

CACHE_CONTROL = "cache_control"
RESERVED_XARGS = frozenset({"kv_transfer_params", "ec_transfer_params"})


@dataclass(frozen=True)
class ChatPin:
    message: int  # index of the last marked message
    ttl_s: float
    last: bool  # the marked message is the last one: the whole prompt is pinned


def _ttl(mark: Any, where: str) -> float:
    if not isinstance(mark, dict):
        raise ClientError(f'{where}: must be an object like {{"type": "ephemeral", "ttl": "5m"}}')
    if mark.get("type") != "ephemeral":
        raise ClientError(
            f"{where}.type: {mark.get('type')!r} is not a cache control type; the one type is 'ephemeral'"
        )
    unknown = sorted(set(mark) - {"type", "ttl"})
    if unknown:
        raise ClientError(f"{where}: unknown fields {unknown} (type, ttl)")
    ttl = mark.get("ttl", "5m")
    if ttl not in TTL_NAMES:
        raise ClientError(f"{where}.ttl: {ttl!r} is not a cache lifetime; use one of {', '.join(map(repr, TTL_NAMES))}")
    return float(TTL_NAMES[ttl])


def take_cache_control(body: dict) -> Optional[ChatPin]:
    """Remove every ``cache_control`` from a chat body's messages (copied, so the caller's
    dictionaries are left alone); the pin they ask for, or None. ``ClientError`` (400)
    for a bad one."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None  # vLLM's validation says what is wrong
    marked, ttls, out = None, [], []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and CACHE_CONTROL in m:
            m = dict(m)
            ttls.append(_ttl(m.pop(CACHE_CONTROL), f"messages.{i}.{CACHE_CONTROL}"))
            marked = i
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and CACHE_CONTROL in p for p in content):
            parts = []
            for j, part in enumerate(content):
                if isinstance(part, dict) and CACHE_CONTROL in part:
                    part = dict(part)
                    ttls.append(_ttl(part.pop(CACHE_CONTROL), f"messages.{i}.content.{j}.{CACHE_CONTROL}"))
                    marked = i
                parts.append(part)
            m = {**m, "content": parts}
        out.append(m)
    if marked is None:
        return None
    body["messages"] = out
    return ChatPin(marked, max(ttls), marked == len(messages) - 1)


def check_transfer_params(req, chat_pin: Optional[ChatPin]) -> None:
    """What a request hands the engine beside its prompt, checked before vLLM sees it
    (``ClientError``, 400, naming the field): its ``kv_transfer_params`` (``check_kv_params``);
    no ``ec_transfer_params`` (this server has no encoder-cache connector); and
    ``vllm_xargs`` may carry neither (vLLM copies it into the same place)."""
    check_kv_params(req.kv_transfer_params, chat_pin)
    if getattr(req, "ec_transfer_params", None) is not None:
        raise ClientError("ec_transfer_params: this server has no encoder-cache connector")
    reserved = sorted(set(getattr(req, "vllm_xargs", None) or {}) & RESERVED_XARGS)
    if reserved:
        raise ClientError(f"vllm_xargs: {', '.join(reserved)} may not be set here (send kv_transfer_params itself)")


def check_kv_params(params: Optional[dict], chat_pin: Optional[ChatPin]) -> None:
    """``kv_transfer_params``: a flat map of the keys the cache reads, each of its type
    (``cache.request_params``), and a chat request pins one way, not both."""
    try:
        check_params(params)
    except ParamsError as e:
        raise ClientError(f"kv_transfer_params: {e}") from None
    if chat_pin is not None and pin_ask(params) is not None:
        raise ClientError(
            "pin either with a message's cache_control or with kv_transfer_params' kvcache_pin_ttl, not both"
        )


async def apply_chat_pin(chat, req, pin: ChatPin) -> None:
    """Set ``req.kv_transfer_params``' pin fields for a chat pin; a pin on an earlier
    message is measured by rendering the messages up to it (vLLM's chat template)."""
    params = dict(req.kv_transfer_params or {})
    params["kvcache_pin_ttl"] = pin.ttl_s
    if not pin.last:
        params["kvcache_pin_tokens"] = await prefix_tokens(chat, req, pin.message)
    req.kv_transfer_params = params


async def prefix_tokens(chat, req, message: int) -> int:
    """Prompt tokens of ``req``'s messages up to and including ``message``, as vLLM's chat
    template renders them without a generation prompt."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    prefix = req.model_copy(
        update={
            "messages": req.messages[: message + 1],
            "add_generation_prompt": False,
            "continue_final_message": False,
            "kv_transfer_params": None,
        }
    )
    rendered = await chat.render_chat_request(prefix)
    if isinstance(rendered, ErrorResponse):
        raise ClientError(
            f"messages.{message}.{CACHE_CONTROL}: the messages up to it do not render: {rendered.error.message}"
        )
    _conversation, inputs = rendered
    return max(1, len(inputs[0].get("prompt_token_ids") or []))
