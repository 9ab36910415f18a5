"""The opt-in ``X-Kvcache-Explain`` response header: where a request's KV came from.

A client asks with the request header ``X-Kvcache-Explain: true``. Through SageMaker's
runtime, which forwards only ``X-Amzn-SageMaker-Custom-Attributes`` (``CustomAttributes``
of ``InvokeEndpoint``), it asks with ``kvcache-explain=true`` among those attributes. The
answer carries ``X-Kvcache-Explain: <ranges>`` and, when asked through the attributes,
``X-Amzn-SageMaker-Custom-Attributes: kvcache-explain=<ranges>`` too, which SageMaker
returns to the caller as ``CustomAttributes`` (1,024 characters at most). ``<ranges>`` is
``cache.explain.compact`` of the request's ``kv_transfer_params["kvcache_explain"]``:
``vllm:0-1408,dram:1408-1499`` or ``evicted/disk:0-512,after_miss:512-1499``; ``none``
when the cache did not look at the request (off, or a prompt it does not cache).

Only non-streamed answers carry it: a stream's headers leave before its request has
finished (the explanation is in ``kvcache:misses_total`` either way). Runs on the event
loop; string work only.
"""

from __future__ import annotations

from typing import Any, Mapping

from cache.explain import compact
from cache.flags import TRUE

HEADER = "X-Kvcache-Explain"
CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
ATTRIBUTE = "kvcache-explain"
CUSTOM_ATTRIBUTES_MAX = 1024


def _attributes(value: str) -> dict[str, str]:
    """``a=1; b=2, c`` -> ``{"a": "1", "b": "2", "c": ""}`` (SageMaker leaves the format
    to the container; ``;`` and ``,`` both separate)."""
    out = {}
    for item in value.replace(",", ";").split(";"):
        name, _, val = item.strip().partition("=")
        if name:
            out[name.strip().lower()] = val.strip()
    return out


def wanted(headers: Mapping[str, str]) -> tuple[bool, bool]:
    """``(explain, through_custom_attributes)`` for a request's headers."""
    direct = headers.get(HEADER, "").strip().lower() in TRUE
    attrs = _attributes(headers.get(CUSTOM_ATTRIBUTES, ""))
    custom = ATTRIBUTE in attrs and (attrs[ATTRIBUTE] or "true").lower() in TRUE
    return direct or custom, custom


def explain_headers(headers: Mapping[str, str], body: Any) -> dict[str, str]:
    """Response headers for an answer whose OpenAI body is ``body`` (``{}`` when not asked)."""
    explain, custom = wanted(headers)
    if not explain:
        return {}
    params = body.get("kv_transfer_params") if isinstance(body, dict) else None
    ranges = (params or {}).get("kvcache_explain") or []
    out = {HEADER: compact(ranges)}
    if custom:
        value = compact(ranges, CUSTOM_ATTRIBUTES_MAX - len(ATTRIBUTE) - 1)
        out[CUSTOM_ATTRIBUTES] = f"{ATTRIBUTE}={value}"
    return out
