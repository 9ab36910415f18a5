"""Scheduler side of pins: a request that asks for its prefix to be pinned (``cache.pins``).

Runs in vLLM's engine-core process, on the scheduler loop. The first time a request is
looked up, ``offer`` reads its pin request from ``kv_transfer_params``, takes the chunks
inside the pinned prefix (whole chunks that end within ``kvcache_pin_tokens``; every
chunk, the tail included, when the whole prompt is pinned) and records the pin in the
last local tier's pin file, for the request's tenant (its ``cache_salt``,
``cache.pins.tenant_id``): one small locked file write, only for requests that ask.
A refused pin (past the tenant's budget or ``KVCACHE_PIN_MAX``, a bad request, no local
tier) is logged; either way the outcome goes back in the request's
``kv_transfer_params`` as ``kvcache_pin``::

    {"pinned": true, "tokens": 512, "chunks": 2, "ttl_s": 3600, "expires_at": 1796000000, "tier": "disk"}
    {"pinned": false, "reason": "pinning 9 chunks (...) would bring this tenant's pinned bytes to ..."}

Outcomes are counted for the connector's metrics (``stats``:
``kvcache:pin_requests_total{outcome}``, ``cache.vllm.metrics``): ``pinned`` or why not.

With a shared tier, the pinned chunks are published at once: chunks this request saves
are marked ``shared`` (``ChunkIO``), and chunks already held locally are named to the
workers (``take_publish``), whose stores publish them (``TieredStore.share``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional, Sequence

from cache.assembly import pin_book
from cache.codec import HEADER_SIZE
from cache.config import CacheConfig
from cache.errors import PinError
from cache.pins import pin_ask, tenant_id

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def chunk_entry_bytes(kv_cache_config, chunk_tokens: int) -> int:
    """Bytes of one chunk's entry of this model: every layer's KV for ``chunk_tokens``
    tokens plus the header (for a hybrid model, all its groups: an upper bound)."""
    per_token = 0.0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        per_token += len(group.layer_names) * spec.page_size_bytes / spec.block_size
    return int(per_token * chunk_tokens) + HEADER_SIZE


class Pinner:
    """Pins for the scheduler: ``offer`` each looked-up request, ``finished`` at its end."""

    def __init__(self, config: CacheConfig, namespace_ids: Sequence[str], entry_bytes: int) -> None:
        self.book = pin_book(config)
        self.tier = next((s.name for s in config.tiers() if s.last_local), None)
        self.namespace_ids = tuple(namespace_ids)
        self.entry_bytes = entry_bytes
        self.has_shared = config.has_shared
        self.tenant_key = config.signing_key  # keys the tenant digests in the pin file
        self._counts: dict[str, int] = {}  # outcome -> requests, since the last stats()
        self._results: dict[str, dict[str, Any]] = {}
        self._shared: dict[str, set[str]] = {}  # per request: pinned keys published when saved
        self._publish: list[str] = []

    def offer(self, request: "Request", chunks: Sequence, n_tokens: int) -> None:
        """Pin the prefix ``request`` asks for, once per request. ``chunks`` have
        ``keys``, ``start`` and ``end`` (``cache.vllm.request_state.Chunk``)."""
        req_id = request.request_id
        if req_id in self._results:
            return
        try:
            ask = pin_ask(getattr(request, "kv_transfer_params", None))
        except PinError as e:
            self._refuse(req_id, str(e), "bad_request")
            return
        if ask is None:
            return
        end = n_tokens if ask.tokens is None else min(ask.tokens, n_tokens)
        inside = [c for c in chunks if c.end <= end]
        if self.book is None:
            self._refuse(
                req_id, "no local tier to pin in (KVCACHE_DRAM_SIZE and KVCACHE_DISK_SIZE are 0)", "no_local_tier"
            )
            return
        if not inside:
            self._refuse(
                req_id,
                f"the prefix to pin ({end} tokens) holds no whole chunk "
                f"(chunks of {chunks[0].end - chunks[0].start if chunks else 0} tokens)",
                "no_whole_chunk",
            )
            return
        keys = [k for c in inside for k in c.keys]
        tokens = inside[-1].end
        tenant = tenant_id(getattr(request, "cache_salt", None), self.tenant_key)
        try:
            result = self.book.pin(self.namespace_ids, keys, self.entry_bytes, ask.ttl_s, tokens, tenant)
        except OSError as e:
            self._refuse(req_id, f"the pin file could not be written: {e}", "write_error")
            return
        if not result.pinned:
            self._refuse(req_id, result.reason, result.refusal)
            return
        self._count("pinned")
        self._results[req_id] = {
            "pinned": True,
            "tokens": tokens,
            "chunks": len(inside),
            "ttl_s": ask.ttl_s,
            "expires_at": int(result.expires),
            "tier": self.tier,
        }
        log.info(
            "kvcache: pinned %d tokens (%d chunks) of request %s for %g s in the %s tier",
            tokens,
            len(inside),
            req_id,
            ask.ttl_s,
            self.tier,
        )
        if self.has_shared:
            self._shared[req_id] = set(keys)
            self._publish.extend(keys)

    def _refuse(self, req_id: str, reason: str, outcome: str) -> None:
        self._count(outcome)
        self._results[req_id] = {"pinned": False, "reason": reason}
        log.warning("kvcache: pin of request %s refused (%s): %s", req_id, outcome, reason)

    def _count(self, outcome: str) -> None:
        self._counts[outcome] = self._counts.get(outcome, 0) + 1

    def stats(self) -> dict[str, int]:
        """Pin requests since the last call by outcome (``pin:<outcome>.requests``)."""
        counts, self._counts = self._counts, {}
        return {f"pin:{k}.requests": v for k, v in counts.items()}

    def shares(self, key: str) -> bool:
        """Whether a save of ``key`` should be published at once (a pinned chunk)."""
        return any(key in keys for keys in self._shared.values())

    def take_publish(self) -> list[str]:
        """Pinned keys the workers should publish now (if they hold them), once each."""
        keys, self._publish = self._publish, []
        return keys

    def finished(self, request: "Request") -> Optional[dict[str, Any]]:
        """The request's pin outcome (``kvcache_pin``), None if it asked for none."""
        self._shared.pop(request.request_id, None)
        return self._results.pop(request.request_id, None)
