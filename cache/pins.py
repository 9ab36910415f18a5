"""Pinned prefixes: chunks a request asked to keep for a time (``cache_control``).

A request asks in its ``kv_transfer_params`` (``pin_ask``): ``kvcache_pin_ttl`` (seconds,
or ``"5m"`` / ``"1h"`` as hosted APIs' ``cache_control`` names them) and, optionally,
``kvcache_pin_tokens`` (the prompt tokens to pin; default the whole prompt). The server
turns a chat message's ``"cache_control": {"type": "ephemeral", "ttl": ...}`` into these
(``serving.cache_control``).

What a pin does (``cache.store`` asks ``PinBook.held`` when it picks eviction victims):
- the chunks of the pinned prefix are never dropped from the local tiers before the pin
  expires. The last local tier (disk; DRAM when it is the only one) never evicts them.
  DRAM evicts every unpinned entry before a pinned one, and a pinned entry that must
  still leave DRAM is written to the disk tier first and removed from DRAM only once it
  is there (never dropped);
- pins are bounded: the pinned chunks of every live pin in a tier folder hold at most
  ``KVCACHE_PIN_MAX`` (a share) of the last local tier's capacity, so unpinned entries
  always keep the rest, and one tenant's at most ``KVCACHE_PIN_TENANT_MAX`` of that
  allowance, so one tenant cannot take it all. A tenant is a ``cache_salt`` (requests
  without one are the tenant ``unsalted``); the pin file names it by a digest of the salt
  (``tenant_id``), never the salt. A pin past either bound is refused whole, with its
  reason, which names only the asking tenant's own bytes and budget;
- with a shared tier, a pinned prefix's chunks are published to it at once (not when
  they are used a second time, the default rule).

Records. One JSON file per tier folder, ``ROOT/.pins`` (``cache.tiers.layout``), of the
last local tier: it outlives the process (DRAM on tmpfs outlives an engine restart, disk
a reboot). Every engine of the node using the folder shares it. Written by the vLLM
scheduler (``PinBook.pin``, rare: only requests that ask) under the folder lock,
atomically (a temporary file renamed over it); read by each worker's store, again only
when the file changed (one ``stat`` per question). A damaged file is ignored with one
warning (no pins) and replaced by the next pin; expired pins are dropped when the file
is next written, and ignored until then.

Bytes: a pin's chunks count once each (a prefix pinned twice does not count twice), at
``entry_bytes`` each, the size of one chunk's entry for the model (an upper bound for
hybrid models, whose window entries are smaller).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional

from cache.errors import PinError
from cache.tiers.layout import LOCK_FILE, PINS_FILE

log = logging.getLogger(__name__)

TTL_NAMES = {"5m": 300, "1h": 3600}  # hosted APIs' cache_control lifetimes
MAX_TTL_S = 24 * 3600  # the longest pin a request may ask for
FORMAT = 1
UNSALTED = "unsalted"  # the tenant of requests without a cache_salt
# Why a pin was refused, for kvcache:pin_requests_total{outcome} (cache.vllm.metrics):
TENANT_BUDGET, TIER_BUDGET, PINS_OFF = "tenant_budget", "tier_budget", "pins_off"


@dataclass(frozen=True)
class PinAsk:
    ttl_s: float
    tokens: Optional[int] = None  # prompt tokens to pin; None: the whole prompt


def parse_ttl(value: Any, name: str = "kvcache_pin_ttl") -> float:
    """Seconds of a pin: a number in ``(0, MAX_TTL_S]`` or one of ``TTL_NAMES``."""
    if isinstance(value, str) and value in TTL_NAMES:
        return float(TTL_NAMES[value])
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PinError(
            f"{name}={value!r} is not a lifetime: give seconds (1 to {MAX_TTL_S}) "
            f"or one of {', '.join(map(repr, TTL_NAMES))}"
        )
    if not 0 < value <= MAX_TTL_S:
        raise PinError(f"{name}={value!r} is out of range: 1 to {MAX_TTL_S} seconds")
    return float(value)


def pin_ask(params: Optional[Mapping[str, Any]]) -> Optional[PinAsk]:
    """The pin a request's ``kv_transfer_params`` ask for, None when none; ``PinError``
    for a bad one."""
    params = params or {}
    ttl, tokens = params.get("kvcache_pin_ttl"), params.get("kvcache_pin_tokens")
    if ttl is None:
        if tokens is not None:
            raise PinError("kvcache_pin_tokens needs kvcache_pin_ttl (how long to pin)")
        return None
    ttl_s = parse_ttl(ttl)
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise PinError(f"kvcache_pin_tokens={tokens!r} must be a positive number of prompt tokens")
    return PinAsk(ttl_s, tokens)


def tenant_id(cache_salt: Optional[str], key: str = "") -> str:
    """The tenant a request pins for: ``unsalted``, or a BLAKE2b digest of its salt (keyed
    with ``key``, the signing key when one is set), so the pin file never holds a salt."""
    if not cache_salt:
        return UNSALTED
    h = hashlib.blake2b(cache_salt.encode(), digest_size=16, key=key.encode()[:64], person=b"kvcache-tenant")
    return "salt:" + h.hexdigest()


class PinResult(NamedTuple):
    pinned: bool
    reason: str = ""  # why it was refused (for the request's caller)
    expires: float = 0.0  # Unix time, when pinned
    refusal: str = ""  # TENANT_BUDGET, TIER_BUDGET, PINS_OFF


@dataclass(frozen=True)
class Pin:
    """One pin: chunk keys in some namespaces (one per parallel rank), until ``expires``."""

    namespaces: tuple[str, ...]
    keys: tuple[str, ...]
    entry_bytes: int
    expires: float  # Unix time
    created: float
    tokens: int = 0
    tenant: str = UNSALTED  # tenant_id of the request that pinned

    def pairs(self) -> Iterable[tuple[str, str]]:
        return ((ns, k) for ns in self.namespaces for k in self.keys)


def pinned_bytes(pins: Iterable[Pin]) -> int:
    """Bytes the pins hold, each (namespace, key) counted once."""
    sizes: dict[tuple[str, str], int] = {}
    for p in pins:
        for pair in p.pairs():
            sizes[pair] = max(sizes.get(pair, 0), p.entry_bytes)
    return sum(sizes.values())


class PinBook:
    """The pins of one tier folder (``ROOT/.pins``), bounded by ``share`` of ``capacity``,
    and each tenant's by ``tenant_share`` of that.

    ``namespace``: the one ``held`` answers for (a worker's store); the scheduler's book
    names namespaces per ``pin``. ``clock``: Unix time (tests pass their own)."""

    def __init__(
        self,
        root: str,
        capacity: int,
        share: float,
        namespace: str = "",
        clock: Callable[[], float] = time.time,
        *,
        tenant_share: float = 1.0,
    ) -> None:
        self.root, self.capacity, self.share, self.tenant_share = root, capacity, share, tenant_share
        self.namespace = namespace
        self.clock = clock
        self.path = os.path.join(root, PINS_FILE)
        self._seen: Optional[tuple] = None  # the file's (inode, mtime, size) last read
        self._held: dict[str, float] = {}  # key -> latest expiry, our namespace
        self._pins: list[Pin] = []

    @property
    def limit(self) -> int:
        return int(self.capacity * self.share)

    @property
    def tenant_limit(self) -> int:
        return int(self.limit * self.tenant_share)

    # -- reading (the store's eviction path: one stat, a dict lookup) -------------------
    def held(self, key: str) -> bool:
        """Whether ``key`` is pinned now, in this book's namespace."""
        self._refresh()
        return self._held.get(key, 0.0) > self.clock()

    def live(self) -> list[Pin]:
        """Pins not yet expired, as the file says now."""
        self._refresh()
        now = self.clock()
        return [p for p in self._pins if p.expires > now]

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
            seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            seen = None
        if seen == self._seen:
            return
        self._seen = seen
        self._pins = self._read() if seen is not None else []
        held: dict[str, float] = {}
        for p in self._pins:
            if self.namespace in p.namespaces:
                for k in p.keys:
                    held[k] = max(held.get(k, 0.0), p.expires)
        self._held = held

    def _read(self) -> list[Pin]:
        """The file's pins; none (and one warning) when it is damaged."""
        try:
            with open(self.path, "rb") as f:
                data = json.loads(f.read())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, not {FORMAT}")
            return [
                Pin(
                    tuple(p["namespaces"]),
                    tuple(p["keys"]),
                    int(p["entry_bytes"]),
                    float(p["expires"]),
                    float(p["created"]),
                    int(p.get("tokens", 0)),
                    str(p.get("tenant", UNSALTED)),
                )
                for p in data["pins"]
            ]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            log.warning(
                "kvcache: ignoring the damaged pin file %s (%s): no pins until the next pin replaces it", self.path, e
            )
            return []

    # -- writing (the scheduler, for a request that asks) -----------------------------
    def pin(
        self,
        namespaces: Iterable[str],
        keys: Iterable[str],
        entry_bytes: int,
        ttl_s: float,
        tokens: int = 0,
        tenant: str = UNSALTED,
    ) -> PinResult:
        """Pin ``keys`` in ``namespaces`` for ``ttl_s`` seconds for ``tenant`` (``tenant_id``);
        refused (the reason says why, naming only ``tenant``'s own bytes) when the tenant's
        budget or the tier's allowance would be passed."""
        ns, keys = tuple(namespaces), tuple(dict.fromkeys(keys))
        if self.limit <= 0:
            return PinResult(False, "pins are off (KVCACHE_PIN_MAX=0)", refusal=PINS_OFF)
        now = self.clock()
        new = Pin(ns, keys, entry_bytes, now + ttl_s, now, tokens, tenant)
        with self._locked():
            self._seen = None
            self._refresh()
            live = [p for p in self._pins if p.expires > now]
            # A pin of the very same chunks replaces an older one (the later expiry wins).
            same = [p for p in live if p.namespaces == ns and p.keys == keys and p.tenant == tenant]
            kept = [p for p in live if p not in same]
            ours = pinned_bytes(p for p in live if p.tenant == tenant)
            ours_after = pinned_bytes([p for p in kept if p.tenant == tenant] + [new])
            asked = f"pinning {len(keys)} chunks ({len(keys) * len(ns) * entry_bytes:,} bytes)"
            mine = f"this tenant holds {ours:,} pinned bytes now, of a budget of {self.tenant_limit:,}"
            if self.tenant_share < 1 and ours_after > self.tenant_limit:
                return PinResult(
                    False,
                    f"{asked} would bring this tenant's pinned bytes to {ours_after:,}, "
                    f"above its budget of {self.tenant_limit:,} (KVCACHE_PIN_TENANT_MAX="
                    f"{self.tenant_share:g} of the tier's pin allowance); {mine}",
                    refusal=TENANT_BUDGET,
                )
            if pinned_bytes(kept + [new]) > self.limit:
                return PinResult(
                    False,
                    f"{asked} does not fit: the tier's pin allowance (KVCACHE_PIN_MAX) is taken; {mine}",
                    refusal=TIER_BUDGET,
                )
            if same:
                expires = max(new.expires, *(p.expires for p in same))
                new = Pin(ns, keys, entry_bytes, expires, now, tokens, tenant)
            self._write(kept + [new])
        return PinResult(True, expires=new.expires)

    def usage(self) -> tuple[int, int]:
        """``(bytes, pins)`` of the live pins, every tenant together (the metrics)."""
        live = self.live()
        return pinned_bytes(live), len(live)

    def _write(self, pins: list[Pin]) -> None:
        tmp = f"{self.path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        body = {"format": FORMAT, "pins": [asdict(p) for p in pins]}
        try:
            with open(tmp, "w") as f:
                json.dump(body, f)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self._seen = None

    def _locked(self):
        return _FolderLock(os.path.join(self.root, LOCK_FILE))


class _FolderLock:
    """The tier folder's lock (the one ``FileTier`` takes for its byte account)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self):
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._f = open(self.path, "ab")
        fcntl.flock(self._f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        try:
            fcntl.flock(self._f, fcntl.LOCK_UN)
        finally:
            self._f.close()
