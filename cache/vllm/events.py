"""KV cache events for what the tiers hold, in vLLM's own format, for KV-aware routers.

Enabled by vLLM's ``--kv-events-config`` (``enable_kv_cache_events``; the server takes it
from ``SM_VLLM_KV_EVENTS_CONFIG``). vLLM's scheduler publishes, each step, its own GPU
events and then what the connector's ``take_events`` returns; ours are ``BlockStored``
when a tier has stored a chunk (on every rank) and ``BlockRemoved`` when a tier dropped
it (evicted, moved down, or found damaged), with:

- ``block_hashes``: vLLM's own hashes of the chunk's full blocks (``request.block_hashes``,
  which vLLM computes with its configured algorithm whenever a connector is set, prefix
  caching on or off), so a router matching vLLM's GPU events matches ours;
- ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``lora_name``,
  ``extra_keys`` (LoRA name, and ``cache_salt`` on a prompt's first block) and
  ``session_id`` exactly as vLLM's ``BlockPool`` fills them for the same blocks: nothing
  more (a salted prompt's hashes differ from the unsalted one's as vLLM's own do);
- ``medium`` and ``locality``: the tier's identity (``cache.tiers.identity``, named as vLLM
  names them): ``CPU`` for ``dram``, ``STORAGE`` for ``disk`` and ``shared``; ``LOCAL`` for
  dram and disk, ``REMOTE`` for ``shared``; ``ownership``: the tier's name. An entry with
  ``ownership="shared"`` is in the shared tier (Curvine), which every instance serving the
  same model with the same shared URL reads: a router may credit it to all of them.

Runs in vLLM's engine-core process, in the scheduler loop: ``seen`` (once per request,
a few microseconds per chunk), ``apply`` (the workers' chunk events of a step) and
``take`` are in-memory only and never block. Bounded: at most ``MAX_RECORDS`` chunks of
recent requests remembered until a tier stores them, ``MAX_HELD`` announced chunks per
tier (the oldest is announced removed to make room: a router under-credits, never
over-credits), ``MAX_PENDING`` events between two steps (beyond, dropped and counted;
the workers send at most ``cache.vllm.worker.MAX_EVENTS`` chunk events a step).

Across a restart: the announced chunks' block and parent hashes (never their tokens) are
kept in the last local tier's folder (``.kvevents-<namespace>.json``, written by one
daemon thread every ``SNAPSHOT_S`` when changed, and at shutdown), with those of the
recent chunks no tier had stored yet. A new engine reads it back: what a tier no longer
holds is announced removed (a DRAM folder emptied by a container restart), the rest
stays announced (a consumer that followed the publisher before the restart keeps it; one
that starts later learns a chunk when a tier stores it again), and a known chunk a tier
holds without having been announced there is announced stored: writes the workers
finished after the scheduler's last step (saves, copies down to disk, publishes flushed
at shutdown) are never reported to the engine that made them. Such chunks, and one moved
to another tier before a request of the new engine used it, are announced by their
hashes alone (``token_ids`` empty: their tokens are not known here). The shared tier
knows what it holds only after its first background listing: until then its record
stays as it was, and the first ``take`` after the listing checks it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from cache.tiers.identity import TierId

log = logging.getLogger(__name__)

STORED, GONE = "stored", ("evicted", "damaged", "unsigned")  # worker chunk events (cache.explain)
MAX_RECORDS = 4096
MAX_HELD = 131072
MAX_PENDING = 65536
SNAPSHOT_S = 30.0


@dataclass
class ChunkBlocks:
    """What vLLM's events say about one chunk's full blocks."""

    hashes: list
    parent: Any
    tokens: list
    lora_id: Optional[int]
    lora_name: Optional[str]
    extra_keys: Optional[list]
    session_id: Optional[str]


def chunk_blocks(request, start: int, end: int, block_size: int) -> Optional[ChunkBlocks]:
    """The full blocks of tokens ``start .. end`` of ``request``, as vLLM's ``BlockPool``
    describes them in a ``BlockStored`` (None: no full block, or no hashes)."""
    hashes = request.block_hashes
    first, last = start // block_size, min(end // block_size, len(hashes))
    if last <= first:
        return None
    extra = [
        generate_block_hash_extra_keys(request, j * block_size, (j + 1) * block_size, 0)[0] for j in range(first, last)
    ]
    lora = request.lora_request
    return ChunkBlocks(
        [maybe_convert_block_hash(hashes[j]) for j in range(first, last)],
        maybe_convert_block_hash(hashes[first - 1]) if first else None,
        list(request.all_token_ids[first * block_size : last * block_size]),
        lora.adapter_id if lora else None,
        lora.name if lora else None,
        to_event_extra_keys(extra),
        getattr(request, "session_id", None),
    )


class TierEvents:
    """The scheduler's record of what each tier holds, as vLLM KV events."""

    def __init__(
        self,
        tiers: Sequence[TierId],
        world: int,
        block_size: int,
        snapshot: Optional[str] = None,
        present: Optional[Callable[[str, str], Optional[bool]]] = None,
    ) -> None:
        """``tiers``: the tiers' identities (an event names a tier's medium and locality);
        ``world``: ranks (a chunk is held once every rank's entry is); ``snapshot``: the file
        that keeps announced hashes across restarts; ``present(tier, key)``: whether a tier
        holds a chunk now, None while the tier cannot say (read after a restart, in memory)."""
        self.ids = {t.name: t for t in tiers}
        self.tiers = list(self.ids)
        self.world = world
        self.block_size = block_size
        self.recent: OrderedDict[str, ChunkBlocks] = OrderedDict()  # key -> blocks, until stored
        # tier -> key -> (hashes, parent hash): what was announced, until announced removed
        self.held: dict[str, OrderedDict] = {t: OrderedDict() for t in self.tiers}
        self._ranks: dict[tuple[str, str], int] = {}  # (tier, key) -> ranks holding it (world > 1)
        self._requests: set[str] = set()
        self.pending: deque = deque()
        self.dropped = 0
        self._snapshot = snapshot
        self._dirty = threading.Event()
        self._closed = threading.Event()
        self._writer: Optional[threading.Thread] = None
        # After a restart: the tiers whose contents were not known yet (a shared tier before
        # its first listing), and the restored chunks' hashes, until ``take`` settles them.
        self._present = present
        self._unsettled: list[str] = []
        self._restored: dict[str, tuple] = {}
        if snapshot is not None:
            self._restore(snapshot)

    # -- scheduler loop ------------------------------------------------------------------
    def seen(self, request, chunks: Sequence) -> None:
        """A request's chunks (``key``, ``start``, ``end``), remembered until a tier stores
        them; once per request."""
        if request.request_id in self._requests:
            return
        self._requests.add(request.request_id)
        for c in chunks:
            blocks = chunk_blocks(request, c.start, c.end, self.block_size)
            if blocks is None:
                continue
            self.recent[c.key] = blocks
            self.recent.move_to_end(c.key)
        while len(self.recent) > MAX_RECORDS:
            self.recent.popitem(last=False)

    def finished(self, req_id: str) -> None:
        self._requests.discard(req_id)

    def apply(self, events: Sequence[tuple[str, str, str]]) -> None:
        """The workers' chunk events of one step, ``(key, event, tier)`` in order: a chunk
        is announced stored once every rank's entry is, removed once one rank's is gone."""
        for key, event, tier in events:
            if tier not in self.held:
                continue
            if event == STORED:
                if self._ranks_after(tier, key, +1) == self.world:
                    self._stored(tier, key)
            elif event in GONE and tier != "shared":  # (nothing is dropped from the shared tier)
                if self._ranks_after(tier, key, -1) < self.world:
                    self._removed(tier, key)

    def take(self) -> list:
        """The events since the last call, for vLLM's publisher."""
        if self._unsettled:
            self._settle()
        out = list(self.pending)
        self.pending.clear()
        return out

    # -- bookkeeping -----------------------------------------------------------------------
    def _ranks_after(self, tier: str, key: str, step: int) -> int:
        """How many ranks hold ``key`` on ``tier`` after one of them stored (+1) or
        dropped (-1) it."""
        if self.world == 1:
            return max(0, step)
        k = (tier, key)
        n = min(self.world, max(0, self._ranks.pop(k, 0) + step))
        if n:
            self._ranks[k] = n
            if len(self._ranks) > MAX_HELD * len(self.tiers):
                self._ranks.pop(next(iter(self._ranks)))
        return n

    def _stored(self, tier: str, key: str, known: Optional[tuple] = None) -> None:
        """Announce ``key`` stored on ``tier``; ``known``: its (hashes, parent) when no
        request of this engine described it."""
        held = self.held[tier]
        if key in held:
            return  # announced already
        blocks = self.recent.get(key)
        medium, locality = self.ids[tier].medium.value, self.ids[tier].locality.value
        if blocks is not None:
            held[key] = (blocks.hashes, blocks.parent)
            event = BlockStored(
                block_hashes=blocks.hashes,
                parent_block_hash=blocks.parent,
                token_ids=blocks.tokens,
                block_size=self.block_size,
                lora_id=blocks.lora_id,
                medium=medium,
                lora_name=blocks.lora_name,
                extra_keys=blocks.extra_keys,
                group_idx=0,
                locality=locality,
                ownership=tier,
                session_id=blocks.session_id,
            )
        else:  # no request seen here: a chunk announced in another tier (before a restart) moved
            known = known or next((h[key] for h in self.held.values() if key in h), None)
            if known is None:
                return  # another engine's chunk: unknown blocks
            held[key] = known
            event = BlockStored(
                block_hashes=known[0],
                parent_block_hash=known[1],
                token_ids=[],
                block_size=self.block_size,
                lora_id=None,
                medium=medium,
                lora_name=None,
                group_idx=0,
                locality=locality,
                ownership=tier,
            )
        self.emit(event)
        if len(held) > MAX_HELD:
            self._removed(tier, next(iter(held)))

    def _removed(self, tier: str, key: str) -> None:
        known = self.held[tier].pop(key, None)
        if known is not None:
            self.emit(
                BlockRemoved(
                    block_hashes=known[0],
                    medium=self.ids[tier].medium.value,
                    group_idx=0,
                    locality=self.ids[tier].locality.value,
                    ownership=tier,
                )
            )

    def emit(self, event) -> None:
        """Queue ``event`` for vLLM's next ``take``; beyond ``MAX_PENDING`` it is dropped (counted)."""
        if len(self.pending) >= MAX_PENDING:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 10000 == 0:
                log.warning(
                    "kvcache: %d KV events dropped (more than %d between two engine steps)", self.dropped, MAX_PENDING
                )
            return
        self.pending.append(event)
        if self._snapshot is not None:
            self._dirty.set()
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="kvcache-events", daemon=True)
                self._writer.start()

    # -- across restarts -------------------------------------------------------------------
    def _restore(self, path: str) -> None:
        try:
            with open(path) as f:
                saved = json.load(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.warning("kvcache: KV events snapshot %s unreadable (%s); starting without it", path, e)
            return
        if saved.get("block_size") != self.block_size:
            return
        known: dict[str, tuple] = {
            key: ([_unhex(h) for h in hashes], _unhex(parent)) for key, hashes, parent in saved.get("recent", [])
        }
        for tier, entries in saved.get("tiers", {}).items():
            if tier not in self.held:
                continue
            for key, hashes, parent in entries:
                self.held[tier][key] = known[key] = ([_unhex(h) for h in hashes], _unhex(parent))
                if self.world > 1:
                    self._ranks[(tier, key)] = self.world
        if self._present is not None:
            self._restored, self._unsettled = known, list(self.tiers)
            self._settle()

    def _settle(self) -> None:
        """Check the restored record against each tier that can say what it holds now: what
        it no longer holds is announced removed, a known chunk it holds without having been
        announced there is announced stored (written after the last step the scheduler saw:
        module docstring). A tier that cannot say yet (``present`` None: a shared tier before
        its first listing) keeps its record as it was and is checked again at the next
        ``take``. In memory only."""
        assert self._present is not None
        for tier in list(self._unsettled):
            held, probe = self.held[tier], next(iter(self._restored), None)
            if probe is not None and self._present(tier, probe) is None:
                continue
            gone = [k for k in held if not self._present(tier, k)]
            for key in gone:
                self._removed(tier, key)
            found = [k for k in self._restored if k not in held and self._present(tier, k)]
            for key in found:
                self._stored(tier, key, self._restored[key])
            self._unsettled.remove(tier)
            log.info(
                "kvcache: KV events after the restart, tier %s: %d chunks announced before it still held, "
                "%d announced removed, %d written after its last step announced",
                tier,
                len(held) - len(found),
                len(gone),
                len(found),
            )
        if not self._unsettled:
            self._restored = {}

    def _write_loop(self) -> None:
        while not self._closed.is_set():
            self._closed.wait(SNAPSHOT_S)
            if self._dirty.is_set():
                self._write()

    def _write(self) -> None:
        self._dirty.clear()
        snapshot = self._snapshot
        if snapshot is None:
            return
        held = {tier: list(entries.items()) for tier, entries in self.held.items()}  # (each copy is atomic)
        recent = [(k, (b.hashes, b.parent)) for k, b in list(self.recent.items())]
        recent += list(self._restored.items())  # (kept until every tier is settled)
        data = {
            "block_size": self.block_size,
            "tiers": {
                t: [[k, [_hex(h) for h in hs], _hex(parent)] for k, (hs, parent) in items] for t, items in held.items()
            },
            "recent": [[k, [_hex(h) for h in hs], _hex(parent)] for k, (hs, parent) in recent],
        }
        tmp = f"{snapshot}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, snapshot)
        except OSError as e:
            log.warning("kvcache: KV events snapshot %s not written: %s", self._snapshot, e)

    def close(self) -> None:
        """Write the snapshot one last time (vLLM's scheduler shutdown)."""
        self._closed.set()
        if self._writer is not None:
            self._writer.join(timeout=5)
        if self._snapshot is not None and (self._dirty.is_set() or self._writer is not None):
            self._write()


def _hex(h):
    """A block hash as JSON: vLLM's int form as it is, its bytes form in hex."""
    return h.hex() if isinstance(h, bytes) else h


def _unhex(h):
    return bytes.fromhex(h) if isinstance(h, str) else h


def tier_events(vllm_config, config, namespace_id: str, world: int, hybrid: bool, view) -> Optional[TierEvents]:
    """The connector's events when vLLM publishes KV events (``--kv-events-config`` with
    ``enable_kv_cache_events``), else None. ``view``: rank 0's lookup view of the tiers
    (``TieredStore.holds``), asked at start-up what the snapshot's chunks still are."""
    events_config = getattr(vllm_config, "kv_events_config", None)
    if events_config is None or not events_config.enable_kv_cache_events:
        return None
    if hybrid:
        log.warning(
            "kvcache: KV events of the tiers are not published for hybrid models (several KV "
            "cache groups); vLLM's own events are"
        )
        return None
    specs = config.tiers()
    local = [s for s in specs if not s.shared]
    snapshot = os.path.join(local[-1].location, f".kvevents-{namespace_id}.json") if local else None
    return TierEvents([s.id for s in specs], world, vllm_config.cache_config.block_size, snapshot, present=view.holds)
