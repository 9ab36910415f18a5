"""Why each prompt token's KV was loaded or computed: the explanation of one request.

Runs in the vLLM scheduler (engine-core process), inside its loop: every call here is
dict lookups and list building, O(chunks) per request, with no I/O and no locks. Imports
nothing from vLLM, so the server and the tools read the same vocabulary.

A finished request's explanation is a list of token ranges covering every prompt token
but the last (which vLLM always computes, for its logits). Each range either names where
its KV came from (``SOURCES``: ``vllm`` is the engine's own prefix cache) or why it was
computed (``CAUSES``), with the tier concerned where one is::

    [{"tokens": [0, 512], "from": "disk"},
     {"tokens": [512, 1024], "computed": "evicted", "tier": "dram"},
     {"tokens": [1024, 1499], "computed": "after_miss"}]

What the scheduler cannot see itself, the workers tell it: each worker's store reports
what happens to each chunk (stored, evicted, refused, found damaged, a read past its
deadline, loaded from another tier than planned ...) as small events, shipped with the
step's output (``TieredKVWorkerMetadata``). A hit is named after the tier that served it:
the one the lookup found, or the one a worker's read fell back to (``SERVED``: a DRAM copy
found damaged, the shared tier's served). (vLLM hands a step's output to the connector
after the requests that finished in it: a request done within the step of its load, one
generated token, is named after the tier it was planned from.)
``Fates`` keeps the last event per chunk key and tier, bounded (``MAX_RECORDS`` keys, oldest
forgotten first: a chunk beyond that horizon is explained as ``never_stored``). A
second bounded record remembers, per salt-free chunk key, which salt (or LoRA adapter)
last stored those tokens, so a miss that another tenant's entry would have served is
counted as ``other_namespace``. Both hold 16-byte-hex keys and short strings: a few MB.

Per tenant: a request sees only its own namespace (its model, ``cache_salt`` and
adapter). Its fates are keyed by its own chunk keys, and a prefix held under another
salt or adapter is ``never_stored`` to it (``HIDDEN``): telling it ``other_namespace``
would tell a tenant whether its guess of another tenant's prompt is right, the very
thing ``cache_salt`` hides. Operators see those tokens in the aggregate counts only
(``take_counts``: ``kvcache:misses_total{cause="other_namespace"}``), never per request.

A cause added later (a pin refused, say) is one entry in ``CAUSES`` and one event name a
worker sends; nothing else changes.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

from cache.keys import chunk_keys

SOURCES = ("vllm", "dram", "disk", "shared")  # where loaded KV came from
CAUSES = {  # why KV was computed instead
    "never_stored": "no record of these tokens here: never stored since this engine started "
    "(or forgotten, beyond the record's horizon)",
    "evicted": "removed by the tier's eviction policy (or by another process sharing the folder)",
    "not_admitted": "not stored: the tier's admission policy refused it, it did not fit the tier, its "
    "save was dropped (queue or staging memory full), or the request said kvcache_save: false",
    "other_namespace": "the same tokens are stored under another cache_salt or LoRA adapter (counted "
    "on /metrics only: the request itself is told never_stored)",
    "damaged": "the entry failed its checks (header, checksum, size, layout) and was dropped",
    "unsigned": "the entry was unsigned or signed with another KVCACHE_SIGNING_KEY",
    "writing": "its save was still being written (write-behind, or a publish to the shared tier)",
    "load_timeout": "its load from the shared tier ran past KVCACHE_SHARED_TIMEOUT_MS",
    "shared_unreachable": "the shared tier was down or failed the call (a publish past its "
    "deadline too: it is abandoned)",
    "recompute": "chosen to recompute: the request said kvcache_load: false, or asked for "
    "prompt_logprobs (vLLM then reads no cached KV), or loading was judged slower than computing",
    "after_miss": "stored, but an earlier chunk of the prompt was not: KV loads only as a prefix",
}
NO_TIER = "none"  # a cause that concerns no one tier
STORED = "stored"  # a worker event that is no cause: the chunk is on that tier
PUBLISHING = "publishing"  # queued for the shared tier (explained as "writing")
MISSING = "missing"  # a load found the chunk on no tier (explained as "evicted")
SERVED = "served"  # a load was served by this tier, not the one planned (a worker event)
MAX_RECORDS = 32768  # chunk keys remembered, per record (256-token chunks: 8M tokens)
REJECTED = ("damaged", "unsigned")  # a tier found the entry bad and dropped it
SHARED_FAILED = ("shared_unreachable", "load_timeout", MISSING)  # a fallback read came to nothing
HIDDEN = {"other_namespace": "never_stored"}  # counted as the key, shown to the request as the value


class Bounded(OrderedDict):
    """A dict that forgets its oldest-written keys beyond ``limit``."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > self.limit:
            self.popitem(last=False)


class Fates:
    """What a worker last reported about each chunk key on each tier: ``get`` the latest
    ``(event, tier)``, ``on`` the latest event of one tier (a load planned from DRAM
    that found its entry unsigned is explained by that, whatever the shared tier it fell
    back to answered next)."""

    def __init__(self, limit: int = MAX_RECORDS) -> None:
        self.last = Bounded(limit)  # key -> ((event, tier), ...): one per tier, latest last

    def apply(self, events: Iterable[tuple[str, str, str]]) -> None:
        """``(key, event, tier)`` in the order a worker saw them. ``missing`` (a load found
        nothing) overwrites only ``stored``/``publishing``: a known reason stays."""
        for key, event, tier in events:
            fate = self.get(key)
            if event == MISSING and fate is not None and fate[0] not in (STORED, PUBLISHING):
                continue
            self.note(key, event, tier)

    def get(self, key: str, default=None) -> Optional[tuple[str, str]]:
        fates = self.last.get(key)
        return fates[-1] if fates else default

    def on(self, key: str, tier: str) -> Optional[str]:
        """The latest event about ``key`` on ``tier``."""
        return next((e for e, t in reversed(self.last.get(key, ())) if t == tier), None)

    def rejected(self, key: str) -> Optional[tuple[str, str]]:
        """``(event, tier)`` of the tier that last dropped ``key``'s entry as damaged or
        unsigned, when nothing but the shared tier's failures came after (a read falls
        back to the shared tier once a local copy is rejected)."""
        for event, tier in reversed(self.last.get(key, ())):
            if event in REJECTED:
                return event, tier
            if event not in SHARED_FAILED:
                return None
        return None

    def note(self, key: str, event: str, tier: str = NO_TIER) -> None:
        self.last.put(key, tuple(f for f in self.last.get(key, ()) if f[1] != tier) + ((event, tier),))


def salt_tag(salt: str) -> str:
    """A short digest of a request's salt (never the salt itself: a tenant's secret)."""
    return hashlib.blake2b(salt.encode(), digest_size=8).hexdigest() if salt else ""


@dataclass
class Lookup:
    """What the scheduler learnt about one request at its last lookup."""

    tokens: int  # prompt length
    l0: int  # tokens vLLM's own prefix cache held
    chunks: list[tuple[str, int, int]]  # (key, start, end) of each chunk
    found: list[str]  # tier name of each leading chunk present
    misses: list[tuple[str, str]]  # (cause, tier) of each chunk after those
    tag: str = ""  # salt_tag of the request's salt
    plain: list[str] = field(default_factory=list)  # salt-free keys (salted requests)
    save: bool = True  # the request lets its chunks be stored
    failed: Optional[str] = None  # first chunk whose load failed
    failure: tuple[str, str] = ("evicted", NO_TIER)  # why it failed: (cause, tier)
    recompute_from: Optional[int] = None  # first chunk chosen to recompute
    seen: int = 0  # SERVED events received before this lookup
    moved: bool = False  # a chunk was served by another tier than found
    # (key, end, tier) of an earlier prompt's tail the hit goes on into, at the place of
    # the first chunk not found (cache.vllm.tails): it serves that chunk up to ``end``
    partial: Optional[tuple[str, int, str]] = None


class Explainer:
    """Keeps the records and explains each request; one per scheduler.

    ``top_tier``: the local tier new saves go to (named when a save is in flight);
    ``shared_up()``: whether the scheduler's view of the shared tier is up (memory only).
    """

    def __init__(
        self,
        chain: bytes,
        chunk_tokens: int,
        top_tier: str,
        shared_up: Callable[[], bool] = lambda: True,
        limit: int = MAX_RECORDS,
    ) -> None:
        self.chain, self.chunk = chain, chunk_tokens
        self.top_tier = top_tier
        self.shared_up = shared_up
        self.fates = Fates(limit)
        self.salts = Bounded(limit)  # salt-free key -> salt tag that stored it
        self.served = Bounded(limit)  # key -> (SERVED event number, tier) of its last one
        self.served_events = 0
        self.missed: Counter = Counter()  # (cause, tier) -> tokens, since take_counts

    # -- what happens to chunks -------------------------------------------------------
    def worker_events(self, events: Sequence[tuple[str, str, str]]) -> None:
        for key, _event, tier in (e for e in events if e[1] == SERVED):
            self.served_events += 1
            self.served.put(key, (self.served_events, tier))
        self.fates.apply(e for e in events if e[1] != SERVED)

    # -- one request ------------------------------------------------------------------
    def looked_up(
        self,
        tokens: Sequence[int],
        l0: int,
        chunks: list[tuple[str, int, int]],
        found: list[str],
        saving,
        salt: str = "",
        load: bool = True,
        save: bool = True,
    ) -> Lookup:
        """Record a lookup: ``found`` names the tier of each leading chunk present,
        ``saving`` holds the keys whose saves are in flight, ``load`` False when the
        request asked not to load (everything beyond ``l0`` is then recomputed)."""
        plain = [k for k, _s, _e in chunks]
        if salt and chunks:
            tail = chunks[-1][2] - chunks[-1][1] if chunks[-1][2] - chunks[-1][1] < self.chunk else 0
            plain = chunk_keys(self.chain, tokens[: chunks[-1][2]], self.chunk, tail_tokens=tail)
        look = Lookup(len(tokens), l0, chunks, list(found), [], salt_tag(salt), plain, save, seen=self.served_events)
        if not load:
            look.found, look.recompute_from = [], 0
            look.misses = [("recompute", NO_TIER)] * len(chunks)
            return look
        shared_down = not self.shared_up()
        for i in range(len(found), len(chunks)):
            look.misses.append(self._cause(look, i, i == len(found), saving, shared_down))
        return look

    def _cause(self, look: Lookup, i: int, first: bool, saving, shared_down: bool) -> tuple[str, str]:
        key = look.chunks[i][0]
        if key in saving:
            return "writing", self.top_tier
        fate = self.fates.get(key)
        if fate is not None and fate[0] == PUBLISHING:
            return "writing", "shared"
        rejected = self.fates.rejected(key)
        if rejected is not None:  # known, whether or not the shared tier could have served it
            return rejected
        if shared_down:
            return "shared_unreachable", "shared"
        if fate is not None:
            event, tier = fate
            if event == STORED:
                return ("evicted", tier) if first else ("after_miss", NO_TIER)
            return ("evicted", tier) if event == MISSING else (event, tier)
        other = self.salts.get(look.plain[i])
        if other is not None and other != look.tag:
            return "other_namespace", NO_TIER
        return "never_stored", NO_TIER

    def load_failed(self, look: Optional[Lookup], key: str) -> None:
        """The load of chunk ``key`` (and so of every later chunk) failed. Call it once the
        events of the step that reported the failure are applied: the cause is read now,
        before the recompute stores the chunk again."""
        if look is not None and look.failed is None:
            look.failed = key
            i = next((i for i, c in enumerate(look.chunks) if c[0] == key), len(look.found))
            planned = look.found[i] if i < len(look.found) else NO_TIER
            if look.partial is not None and key == look.partial[0]:
                planned = look.partial[2]
            look.failure = self._failure(key, planned)

    @staticmethod
    def chose_recompute(look: Optional[Lookup], chunk_index: int) -> None:
        """A cost model chose to compute chunks ``chunk_index:`` that the tiers hold."""
        if look is not None:
            look.recompute_from = chunk_index

    def finished(self, look: Optional[Lookup]) -> list[dict]:
        """The request's explanation; updates the miss counts and the salt record."""
        if look is None or not look.chunks:
            return []
        usable = look.tokens - 1
        ranges: list[list] = []

        hidden: Counter = Counter()  # tokens per cause the request is not told (HIDDEN)

        def add(start: int, end: int, what: str, tier: str, source: bool) -> None:
            start, end = max(start, 0), min(end, usable)
            if end <= start:
                return
            if what in HIDDEN:
                hidden[what] += end - start
                what = HIDDEN[what]
            if ranges and ranges[-1][2:] == [what, tier, source] and ranges[-1][1] == start:
                ranges[-1][1] = end
            else:
                ranges.append([start, end, what, tier, source])

        add(0, look.l0, "vllm", NO_TIER, True)
        failed_at = next((i for i, c in enumerate(look.chunks) if c[0] == look.failed), None)
        cut = min(x for x in (failed_at, look.recompute_from, len(look.found)) if x is not None)
        for i, (_key, start, end) in enumerate(look.chunks):
            start = max(start, look.l0)
            if i < cut:
                add(start, end, self._source(look, i), NO_TIER, True)
            elif i < len(look.found) and look.recompute_from is not None and i >= look.recompute_from:
                add(start, end, "recompute", NO_TIER, False)
            elif i < len(look.found):  # its load failed, or an earlier one did
                add(start, end, *(look.failure if i == failed_at else ("after_miss", NO_TIER)), False)
            else:
                if i == len(look.found) and look.partial is not None:  # an earlier prompt's tail
                    key, tail_end, tier = look.partial
                    if look.failed == key:
                        add(start, tail_end, *look.failure, False)
                    elif look.failed is not None:
                        add(start, tail_end, "after_miss", NO_TIER, False)
                    elif look.recompute_from is not None:
                        add(start, tail_end, "recompute", NO_TIER, False)
                    else:
                        add(start, tail_end, self._served_by(look, key, tier), NO_TIER, True)
                    start = max(start, tail_end)
                add(start, end, *look.misses[i - len(look.found)], False)
        self._remember(look)
        out = []
        for start, end, what, tier, source in ranges:
            if source:
                out.append({"tokens": [start, end], "from": what})
                continue
            self.missed[(what, tier)] += end - start
            out.append({"tokens": [start, end], "computed": what, **({"tier": tier} if tier != NO_TIER else {})})
        for cause, n in hidden.items():  # counted under their own cause, for operators
            self.missed[(HIDDEN[cause], NO_TIER)] -= n
            self.missed[(cause, NO_TIER)] += n
        return out

    def _source(self, look: Lookup, i: int) -> str:
        """The tier chunk ``i``'s load came from: the one its lookup found, unless a worker
        said since that another served it."""
        return self._served_by(look, look.chunks[i][0], look.found[i])

    def _served_by(self, look: Lookup, key: str, found: str) -> str:
        served = self.served.get(key)
        if served is None or served[0] <= look.seen or served[1] == found:
            return found
        look.moved = True
        return served[1]

    def _failure(self, key: str, planned: str) -> tuple[str, str]:
        """Why the load of ``key`` from tier ``planned`` failed: what that tier said of it
        (the tiers the read fell back to answer later, and less to the point), else the
        latest word on it; ``evicted`` when the entry was simply gone."""
        on_planned = self.fates.on(key, planned)
        if on_planned not in (None, STORED, PUBLISHING):
            return on_planned, planned
        fate = self.fates.get(key)
        if fate is None or fate[0] in (STORED, MISSING, PUBLISHING):
            return "evicted", planned  # gone between the lookup and the load
        return fate[0], fate[1] if fate[1] != NO_TIER else planned

    def _remember(self, look: Lookup) -> None:
        """Which salt now holds these tokens; and that an unsaved request stored nothing."""
        for i, (key, _s, _e) in enumerate(look.chunks):
            if look.save or i < len(look.found):
                self.salts.put(look.plain[i], look.tag)
            elif self.fates.get(key) is None:
                self.fates.note(key, "not_admitted")

    def take_counts(self) -> dict[str, int]:
        """Tokens computed per cause and tier since the last call, as connector stats
        (``miss:<cause>:<tier>``)."""
        out = {f"miss:{cause}:{tier}": n for (cause, tier), n in self.missed.items() if n}
        self.missed.clear()
        return out


def compact(explanation: Sequence[dict], limit: int = 1024) -> str:
    """One header value, ASCII: ``vllm:0-1408,dram:1408-1499`` and, for computed ranges,
    ``evicted/disk:0-512,after_miss:512-1499``; cut to ``limit`` characters with
    ``,+N`` saying how many ranges were left out. ``none`` when there is no explanation."""
    items = []
    for r in explanation:
        start, end = r["tokens"]
        what = r.get("from") or r.get("computed", "?")
        if r.get("tier"):
            what += "/" + r["tier"]
        items.append(f"{what}:{start}-{end}")
    out = ",".join(items)
    while len(out) > limit and items:
        items.pop()
        out = ",".join(items) + f",+{len(explanation) - len(items)}"
    return out or "none"
