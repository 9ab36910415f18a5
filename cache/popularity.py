"""Which chunks the fleet uses most, shared through the shared tier without a coordinator.

Counting. Every engine with a shared tier counts, in its vLLM scheduler, how often
requests use each chunk (``Popularity.observe``: once per request, every chunk of its
prompt, whether vLLM's own prefix cache, a tier or nobody then serves it), in counts that
halve every ``HALF_LIFE_S``, so that they follow the traffic of the last hours. A chunk is
used by every request that uses a later chunk of its chain, so a parent never counts less
than its children. At most ``MAX_TRACKED`` chunks are counted (beyond twice that, the
least used are forgotten first, a chunk before its parent).

Publishing. ``Publisher``, a daemon thread of the scheduler's process, writes the
``NOTE_KEYS`` most used chunks (keys, parents, counts, depths: hashes, never tokens) as
this node's *note* into the shared tier (``cache.tiers.notes``: one file per node, in
every rank's namespace folder), every ``PUBLISH_S`` while the counts change, and once
more at shutdown. A node starting again (same host name) first adds the counts of its own
earlier note, so a restart keeps what it knew. Notes older than ``NOTE_MAX_AGE_S`` are
ignored by readers and removed by the next node that publishes.

Reading (``hottest``: a new instance's DRAM warm-up, ``cache.dram_warm``). Every node's
note is aged to now and the counts are summed, so a chunk many nodes use comes first (a
parent counts at least as much as its most used child, whichever node forgot what);
chunks are ordered most used first, a parent always before its children, and a chunk
whose parent is in no note is left out (it cannot be loaded without its prefix).

Where it runs: ``observe`` on the scheduler loop (a dict update per chunk under a lock the
publisher holds only to copy the counts; forgetting the least used costs one partial sort
of ``2 x MAX_TRACKED`` counts once per ``MAX_TRACKED`` new chunks); the publisher on its
own thread, its calls within the shared tier's deadline; ``hottest`` and the note format
wherever notes are read. No vLLM, no torch.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence, TypeGuard

from cache.tiers.layout import is_key, this_host
from cache.tiers.notes import NOTE_SUFFIX, list_notes, read_note, remove_note, write_note

log = logging.getLogger(__name__)

HALF_LIFE_S = 3600.0  # a use counts half as much an hour later
MAX_TRACKED = 8192  # chunks counted per engine (beyond 2x: the least used forgotten)
NOTE_KEYS = 4096  # chunks in one node's note
NOTE_MAX_AGE_S = 7 * 86400  # an older note is ignored, and removed by the next publisher
PUBLISH_S = 60.0  # a changed note is published this often
FORMAT = 1
_REBASE = 2.0**40  # weights are rebased before they grow past this


@dataclass(frozen=True)
class Hot:
    """One chunk's popularity: uses, aged to a moment; ``depth``: its index in its chain."""

    key: str
    parent: Optional[str]
    score: float
    depth: int


@dataclass(frozen=True)
class Note:
    node: str
    written: float  # Unix time; scores are aged to it
    entries: tuple[Hot, ...]


class Popularity:
    """Aged use counts of chunks (``observe``), and the most used (``top``). Thread-safe."""

    def __init__(
        self, half_life_s: float = HALF_LIFE_S, max_tracked: int = MAX_TRACKED, clock: Callable[[], float] = time.time
    ) -> None:
        self.half_life_s, self.max_tracked, self.clock = half_life_s, max_tracked, clock
        self._lock = threading.Lock()
        self._base = clock()  # a use at this moment weighs 1
        self._counts: dict[str, list] = {}  # key -> [weight, parent, depth]
        self.version = 0  # changes with every observed request

    def _weight(self, now: float) -> float:
        return 2.0 ** ((now - self._base) / self.half_life_s)

    def observe(self, chunks: Sequence) -> None:
        """A request used ``chunks`` (objects with ``key`` and ``parent``), in prompt order."""
        if not chunks:
            return
        now = self.clock()
        with self._lock:
            w = self._weight(now)
            if w > _REBASE:
                self._rebase(now)
                w = 1.0
            counts = self._counts
            for depth, c in enumerate(chunks):
                entry = counts.get(c.key)
                if entry is None:
                    counts[c.key] = [w, c.parent, depth]
                else:
                    entry[0] += w
            if len(counts) > 2 * self.max_tracked:
                kept = heapq.nlargest(self.max_tracked, counts.items(), key=_rank)
                self._counts = dict(kept)
            self.version += 1

    def seed(self, entries: Iterable[Hot], age_s: float = 0.0) -> None:
        """Add counts read back from a note written ``age_s`` seconds ago."""
        now = self.clock()
        with self._lock:
            scale = self._weight(now) * 0.5 ** (max(0.0, age_s) / self.half_life_s)
            for h in entries:
                entry = self._counts.get(h.key)
                if entry is None:
                    self._counts[h.key] = [h.score * scale, h.parent, h.depth]
                else:
                    entry[0] += h.score * scale

    def _rebase(self, now: float) -> None:
        scale = 1.0 / self._weight(now)
        for entry in self._counts.values():
            entry[0] *= scale
        self._base = now

    def top(self, n: int = NOTE_KEYS) -> list[Hot]:
        """The ``n`` most used chunks, their counts aged to now, a parent before its children."""
        now = self.clock()
        with self._lock:
            items = [(k, list(v)) for k, v in self._counts.items()]
            scale = 1.0 / self._weight(now)
        return [Hot(k, p, w * scale, d) for k, (w, p, d) in heapq.nlargest(n, items, key=_rank)]

    def __len__(self) -> int:
        return len(self._counts)


def _rank(item) -> tuple:
    """Most used first; among equals the shallower (a parent before its child)."""
    _key, (weight, _parent, depth) = item
    return weight, -depth


# -- the note format ----------------------------------------------------------------
def encode_note(entries: Sequence[Hot], node: str, written: float) -> bytes:
    return json.dumps(
        {
            "format": FORMAT,
            "node": node,
            "written": written,
            "entries": [[h.key, h.parent or "", round(h.score, 9), h.depth] for h in entries],
        },
        separators=(",", ":"),
    ).encode()


def decode_note(data: bytes) -> Note:
    """A note read from the shared tier, checked field by field (``ValueError``)."""
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"not a popularity note of format {FORMAT}")
    node, written, raw = obj.get("node"), obj.get("written"), obj.get("entries")
    if not isinstance(node, str) or not _number(written) or not isinstance(raw, list):
        raise ValueError("node, written and entries are required")
    if len(raw) > 4 * NOTE_KEYS:
        raise ValueError(f"{len(raw)} entries: more than a note holds")
    entries = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 4):
            raise ValueError(f"entry {item!r:.80} is not [key, parent, score, depth]")
        key, parent, score, depth = item
        if not (
            isinstance(key, str)
            and is_key(key)
            and isinstance(parent, str)
            and (parent == "" or is_key(parent))
            and _number(score)
            and score >= 0
            and isinstance(depth, int)
            and not isinstance(depth, bool)
            and depth >= 0
        ):
            raise ValueError(f"entry {item!r:.80} is not [key, parent, score, depth]")
        entries.append(Hot(key, parent or None, float(score), depth))
    return Note(node, float(written), tuple(entries))


def _number(x: object) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def hottest(
    notes: Iterable[Note], now: float, half_life_s: float = HALF_LIFE_S, max_age_s: float = NOTE_MAX_AGE_S
) -> list[Hot]:
    """Every node's note merged: counts aged to ``now`` and summed, a parent's raised to its
    most used child's; most used first, a parent always before its children; a chunk whose
    parent is in no note left out."""
    merged: dict[str, list] = {}
    for note in notes:
        age = now - note.written
        if age > max_age_s:
            continue
        factor = 0.5 ** (max(0.0, age) / half_life_s)
        for h in note.entries:
            entry = merged.get(h.key)
            if entry is None:
                merged[h.key] = [h.score * factor, h.parent, h.depth]
            else:
                entry[0] += h.score * factor
    # A chunk is used whenever one of its children is: it counts at least as much as they do
    # (nodes that forgot different chunks can disagree).
    for entry in sorted(merged.values(), key=lambda e: -e[2]):
        parent = merged.get(entry[1]) if entry[1] is not None else None
        if parent is not None and parent[0] < entry[0]:
            parent[0] = entry[0]
    order = sorted(merged.items(), key=lambda kv: (-kv[1][0], kv[1][2], kv[0]))
    out: list[Hot] = []
    chosen: set[str] = set()
    waiting: dict[str, list] = {}  # parent -> its children met before it
    for key, entry in order:
        parent = entry[1]
        if parent is not None and parent not in chosen:
            if parent in merged:
                waiting.setdefault(parent, []).append((key, entry))
            continue
        stack = [(key, entry)]
        while stack:
            k, (score, p, depth) = stack.pop()
            out.append(Hot(k, p, score, depth))
            chosen.add(k)
            stack.extend(reversed(waiting.pop(k, [])))
    return out


# -- publishing ---------------------------------------------------------------------
_NODE_NAME = re.compile(r"[^A-Za-z0-9._-]")


class Publisher:
    """This node's note in the shared tier of each rank (``tiers``: one ``SharedTier``
    per rank, the scheduler's lookup views'): a daemon thread publishes it every
    ``interval`` seconds when the counts changed; ``close`` publishes it once more."""

    def __init__(
        self,
        popularity: Popularity,
        tiers: Sequence,
        node: Optional[str] = None,
        interval: float = PUBLISH_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.popularity, self.tiers, self.interval, self.clock = popularity, list(tiers), interval, clock
        self.node = node or this_host()
        self.name = _NODE_NAME.sub("_", self.node)[:100] + NOTE_SUFFIX
        self._published = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()  # one publish at a time (the thread, close)
        self._warned = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvcache-popularity")
        self._thread.start()

    def _run(self) -> None:
        self.seed()
        while not self._stop.wait(self.interval):
            self.publish()

    def seed(self) -> None:
        """Add the counts of this node's own earlier note (a restart on the same host)."""
        if not self.tiers:
            return
        try:
            note = decode_note(read_note(self.tiers[0], self.name))
        except FileNotFoundError:
            return
        except Exception as e:  # unreadable or damaged: start from nothing
            log.info("kvcache: this node's earlier popularity note is not used: %s", e)
            return
        self.popularity.seed(note.entries, self.clock() - note.written)
        log.info("kvcache: popularity of %d chunks taken over from this node's earlier note", len(note.entries))

    def publish(self) -> bool:
        """Write the note when the counts changed since the last one; remove expired notes.
        Blocks on the shared tier (its deadline per call). Returns whether it wrote."""
        with self._lock:
            version = self.popularity.version
            if version == self._published:
                return False
            now = self.clock()
            data = encode_note(self.popularity.top(), self.node, now)
            wrote = False
            for tier in self.tiers:
                try:
                    write_note(tier, self.name, data)
                    wrote = True
                    for name, _size, mtime in list_notes(tier):
                        if mtime and now - mtime > NOTE_MAX_AGE_S and name != self.name:
                            remove_note(tier, name)
                except Exception as e:  # the tier is down or refuses: the next round tries again
                    if not self._warned:
                        log.warning("kvcache: popularity note not published to %s: %s", tier.folder, e)
                    self._warned = True
            if wrote:
                self._published, self._warned = version, False
            return wrote

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and publish the counts one last time (scheduler shutdown)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.publish()
