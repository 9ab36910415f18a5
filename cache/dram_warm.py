"""Warm scale-out: a new instance copies the warm-prompt set and the fleet's hottest shared
entries into its DRAM tier (``KVCACHE_WARM_DRAM``) before it reports healthy.

Runs in each vLLM worker (one per rank: each warms its own rank's entries) on a daemon
thread of its own, started by the server through ``collective_rpc``
(``cache.vllm.warm_rpc``; the server's side, which polls ``status``, gates ``/ping`` and
calls ``stop`` at its start-up deadline, is ``serving.dram_warm``); it also stops once the
worker closes its store (shutdown), after the entry being copied. Blocks on I/O on that
thread only.

What it copies, in this order:

1. the warm-prompt set (``KVCACHE_WARM_PROMPTS``, token ids from the server): each
   prompt's chunks cut as the scheduler cuts them (``cache.keys.prompt_chunks``, no salt,
   no adapter: the warm tool's requests), in order, none after a chunk no tier holds;
   bounded by the DRAM tier's capacity;
2. the hottest shared entries, as the popularity notes of every node rank them
   (``cache.popularity.hottest``), most used first, until the next one would pass
   ``budget`` bytes or, with the prompts, the DRAM tier's capacity; a chunk whose parent
   is not warm is passed over (it could not be loaded).

Each entry goes through ``TieredStore.copy_up``: read from the disk tier or the shared
tier, verified in full (checksum, namespace, key, signature) and stored through the DRAM
tier's policy on the store's writer thread, as a promotion is, so the tier's byte
account, its policy and its pins hold. An entry DRAM holds already counts without a copy.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence, cast

from cache.keys import prompt_chunks
from cache.popularity import Note, decode_note, hottest
from cache.store import TieredStore
from cache.tiers.notes import read_notes

if TYPE_CHECKING:
    from cache.tiers.shared import SharedTier

log = logging.getLogger(__name__)

WARM = ("held", "copied")  # copy_up outcomes that leave the entry in DRAM


@dataclass
class SetProgress:
    """One set's entries: planned, warm in DRAM now (copied or there already), and why not."""

    planned: int = 0
    warm: int = 0
    copied: int = 0  # of the warm ones, copied by this warm-up
    bytes: int = 0  # bytes of the warm ones
    absent: int = 0  # no tier holds a sound entry
    skipped: int = 0  # passed over: its prefix is not warm, or over the budget or capacity


class DramWarm:
    """One warm-up of a worker's DRAM tier (``start`` once; ``status``, ``stop`` any time)."""

    def __init__(
        self,
        store: TieredStore,
        chain: bytes,
        chunk_tokens: int,
        setup: Optional[Callable[[], None]] = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``chain``: the namespace's chain digest (``Namespace.chain_digest``); ``setup``
        runs first on the warm-up's thread (``cache.threads``)."""
        self.store, self.chain, self.chunk_tokens, self.setup, self.clock = store, chain, chunk_tokens, setup, clock
        self.state = "idle"  # warming, done, stopped, failed
        self.prompts, self.hot = SetProgress(), SetProgress()
        self.budget = self.notes = 0
        self.error = ""
        self._started = self._ended = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- control (the worker's RPC thread) ---------------------------------------------
    def start(self, prompts: Sequence[Sequence[int]], budget: int) -> None:
        """Warm on a thread of its own; a second call while one runs or ran does nothing."""
        if self._thread is not None:
            return
        self.state, self._started = "warming", time.monotonic()
        self._thread = threading.Thread(target=self.run, args=(prompts, budget), daemon=True, name="kvcache-dram-warm")
        self._thread.start()

    def stop(self) -> None:
        """Stop after the entry being copied (the server's deadline passed)."""
        self._stop.set()

    def _stopping(self) -> bool:
        """Told to stop, or the store is closing (the worker shuts down)."""
        return self._stop.is_set() or self.store.closing

    def status(self) -> dict:
        end = self._ended or time.monotonic()
        return {
            "state": self.state,
            "budget": self.budget,
            "notes": self.notes,
            "error": self.error,
            "seconds": round(end - self._started, 3) if self._started else 0.0,
            "prompts": asdict(self.prompts),
            "hot": asdict(self.hot),
        }

    # -- the warm-up (its own thread) ------------------------------------------------
    def run(self, prompts: Sequence[Sequence[int]], budget: int) -> None:
        """The whole warm-up, on the calling thread: ``state`` says how it ended."""
        self.state, self.budget = "warming", int(budget)
        self._started = self._started or time.monotonic()
        try:
            if self.setup is not None:
                self.setup()
            warm = self._prompts(prompts)
            if not self._stopping():
                self._hot(warm)
            self.state = "stopped" if self._stopping() else "done"
        except Exception as e:  # a warm-up never takes the worker down: the server goes on
            log.exception("kvcache: DRAM warm-up failed")
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
        finally:
            self._ended = time.monotonic()

    @property
    def _capacity(self) -> int:
        return self.store.tiers[0].capacity or 0

    def _used(self) -> int:
        return self.prompts.bytes + self.hot.bytes

    def _prompts(self, prompts: Sequence[Sequence[int]]) -> set[str]:
        """Copy every prompt's chunks, in order; the keys warm now."""
        chains = [[k for k, _s, _e in prompt_chunks(self.chain, list(p), self.chunk_tokens)] for p in prompts]
        planned = {k for chain in chains for k in chain}
        p, warm, seen = self.prompts, set[str](), set[str]()
        p.planned = len(planned)
        for chain in chains:
            for i, key in enumerate(chain):
                if self._stopping():
                    return warm
                if key in seen:
                    if key in warm:
                        continue
                    break  # tried already, not warm: the rest of this prompt cannot load
                seen.add(key)
                outcome, nbytes = self.store.copy_up(key, lambda n: self._used() + n <= self._capacity)
                if self._count(p, outcome, nbytes):
                    warm.add(key)
                    continue
                p.skipped += len(set(chain[i + 1 :]) - seen)
                seen.update(chain[i + 1 :])
                break
        return warm

    def _hot(self, warm: set[str]) -> None:
        """Copy the hottest shared entries within the budget."""
        notes = self._read_notes()
        ranked = [h for h in hottest(notes, self.clock()) if h.key not in warm]
        hot = self.hot
        hot.planned = len(ranked)

        def fits(n: int) -> bool:
            return hot.bytes + n <= self.budget and self._used() + n <= self._capacity

        for i, h in enumerate(ranked):
            if self._stopping():
                return
            if h.parent is not None and h.parent not in warm:
                hot.skipped += 1
                continue
            outcome, nbytes = self.store.copy_up(h.key, fits)
            if outcome == "declined":  # the budget or DRAM is full: the rest would not fit either
                hot.skipped += len(ranked) - i
                return
            if self._count(hot, outcome, nbytes):
                warm.add(h.key)

    @staticmethod
    def _count(progress: SetProgress, outcome: str, nbytes: int) -> bool:
        if outcome in WARM:
            progress.warm += 1
            progress.bytes += nbytes
            progress.copied += outcome == "copied"
            return True
        if outcome == "absent":
            progress.absent += 1
        else:
            progress.skipped += 1
        return False

    def _read_notes(self) -> list[Note]:
        shared = self.store.shared
        if shared is None:
            return []
        notes = []
        for name, data in read_notes(cast("SharedTier", shared)):  # the store's last tier when it has one
            try:
                notes.append(decode_note(data))
            except ValueError as e:
                log.warning("kvcache: popularity note %s in the shared tier ignored: %s", name, e)
        self.notes = len(notes)
        return notes
