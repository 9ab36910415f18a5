"""Reads: the verified entry from the highest tier holding it, whole or in place.

``Reads`` runs on the thread that calls it: a store's read threads, or a load's own thread
for a local tier; it blocks on tier I/O (a shared-tier read at most the tier's deadline).
Every entry read is verified (``cache.codec``); a damaged or foreign one is a miss,
deleted from a local tier, ignored (never deleted) on the shared one. A hit is counted,
touches the tier's policy, and, in a writer store, may promote the entry to the top tier
or publish it (``cache.store.placement.place_hit``; the writer thread does the copying).
``timer(step, seconds)``, if set, is called for each tier read (``"read"``) and entry
check (``"decode"``) of ``get``, on the thread that ran them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from cache.admission import SharedAdmission
from cache.codec import HEADER_SIZE, CorruptEntry, EntryInfo, UnsignedEntry, decode
from cache.placed import BlockWriters, LoadEnded, Misfit, PartRead, Place, Staged
from cache.store.accounting import Accounting
from cache.store.background import Background
from cache.store.placement import Layout, place_hit
from cache.store.writer import TierWriter
from cache.tiers.base import Buffer, Tier
from cache.tiers.identity import TierId

# ``get_into``'s answer when the entry may be in a tier it does not read in place.
ELSEWHERE = "elsewhere"

Timer = Callable[[str, float], None]


@dataclass
class Entry:
    """A verified entry: tensor metadata and a zero-copy view of its payload."""

    key: str
    info: EntryInfo
    payload: memoryview
    tier: TierId  # the tier it was read from
    raw: Optional[Buffer] = None  # the whole encoded entry (keeps mmaps alive; used to promote)


class Reads:
    """The read side of one store: every tier, in order, with what a hit sets going."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        layout: Layout,
        namespace: bytes,
        signing_key: bytes,
        account: Accounting,
        lock: threading.Lock,
        admission: SharedAdmission,
        writer: Optional[TierWriter] = None,
        background: Optional[Background] = None,
        timer: Optional[Timer] = None,
    ) -> None:
        self.tiers, self.layout = list(tiers), layout
        self.namespace, self.signing_key = namespace, signing_key
        self.account, self.lock, self.admission = account, lock, admission
        self.writer, self.background = writer, background
        self.timer = timer

    def remote(self, i: int) -> bool:
        """Whether tier ``i`` is the shared one (its identity says so: ``Tier.id``)."""
        return self.tiers[i].id.shared

    def get(self, key: str, promote: bool = True) -> Optional[Entry]:
        """The verified entry from the highest tier holding it, or None."""
        for i, tier in enumerate(self.tiers):
            t0 = time.perf_counter()
            try:
                raw = tier.read(key)
            except KeyError:
                continue
            except Exception as e:  # a tier failing must not fail the request
                self.account.failed(tier, "reading", key, e)
                continue
            t1 = time.perf_counter()
            try:
                info, payload = decode(raw, self.namespace, key, self.signing_key)
            except CorruptEntry as e:
                self.drop_bad(i, key, e)
                continue
            t2 = time.perf_counter()
            if self.timer is not None:
                self.timer("read", t1 - t0)
                self.timer("decode", t2 - t1)
            self.hit(i, key, info, t2 - t0, raw, promote)
            return Entry(key, info, payload, tier.id, raw)
        self._miss()
        return None

    def find_in_place(self, key: str, place: Place, writers: Optional[BlockWriters], local_only: bool, whole: bool):
        """``TieredStore.get_into`` (``whole``) and ``read_layers``: an ``EntryRead``, None or
        ``ELSEWHERE``."""
        writers = writers if writers is not None else BlockWriters()
        for i, tier in enumerate(self.tiers):
            remote = self.remote(i)
            if not tier.reads_in_place or (remote and local_only):
                return ELSEWHERE
            # A whole shared entry is kept to promote it (a layered read lets the writer read it again).
            keep = whole and remote and self.layout.n_local > 0 and self.writer is not None
            read = EntryRead(
                self, i, key, PartRead(self.namespace, key, place, self.signing_key, self.timer), writers, keep
            )
            t0 = time.perf_counter()
            try:
                raw = tier.read_with(key, lambda reader: read.use(reader, whole))  # noqa: B023 (called at once)
            except KeyError:
                continue
            except CorruptEntry as e:
                self.drop_bad(i, key, e)
                continue
            except LoadEnded:
                raise
            except ValueError as e:
                raise Misfit(tier.name, str(e)) from e
            except Exception as e:  # a tier failing must not fail the request
                self.account.failed(tier, "reading", key, e)
                continue
            read.seconds = time.perf_counter() - t0
            if read.read.done:
                self.hit(i, key, read.read.info, read.seconds, raw, True)
            return read
        self._miss()
        return None

    def _miss(self) -> None:
        if self.tiers:
            self.account.tier(self.tiers[0].name).misses += 1

    def hit(
        self, i: int, key: str, info: Optional[EntryInfo], seconds: float, raw: Optional[Buffer], promote: bool
    ) -> None:
        """Count a verified read from tier ``i``; touch its policy; publish the entry if it
        is now reused, promote it if an upper tier can hold it (on the writer thread).
        ``raw`` is the whole entry when the caller has it; otherwise it is read again."""
        assert info is not None, "a hit is a whole, verified entry"
        st = self.account.tier(self.tiers[i].name)
        st.hits += 1
        st.bytes_read += info.payload_len + HEADER_SIZE
        st.load_seconds += seconds
        writer, background = self.writer, self.background
        if writer is None or background is None:
            return  # a lookup-only store
        reused = False
        if not self.remote(i):
            with self.lock:
                writer.policies[i].touch(key)
                reused = self.admission.on_hit(key)
        plan = place_hit(self.layout, i, key, HEADER_SIZE + info.payload_len, reused, promote)
        if plan.publish:
            if raw is not None:
                writer.publish(key, [raw])
            else:
                background.write(writer.share_from, i, key)
        if plan.write is not None:
            background.write(writer.promote, plan.write, key, raw, info.parent, i)

    def drop_bad(self, i: int, key: str, e: CorruptEntry) -> None:
        """Count a bad entry of tier ``i``; a local tier deletes it, the shared tier's is only
        ignored here (the tier stops offering it for a while)."""
        tier = self.tiers[i]
        self.account.tier(tier.name).corrupt += 1
        self.account.warn(tier.name, "kvcache: ignoring bad entry %s in %s: %s", key, tier.name, e)
        self.account.note(key, "unsigned" if isinstance(e, UnsignedEntry) else "damaged", tier.name)
        if self.remote(i):
            tier.reject(key)
            return
        if self.writer is not None:
            self.writer.forget(i, key)
        tier.delete(key)

    def copy_up(self, key: str, fits: Callable[[int], bool]) -> tuple[str, int]:
        """``TieredStore.copy_up``: the sound entry of the highest tier below the top one,
        verified in full, stored into the top tier on the writer thread (waited for)."""
        writer, background = self.writer, self.background
        assert writer is not None and background is not None, "a writer store"
        if self.tiers[0].contains(key):
            raw = writer.read_local(0, key)
            if raw is not None:
                try:  # a damaged entry there is dropped, and copied again from below
                    decode(raw, self.namespace, key, self.signing_key)
                    return "held", memoryview(raw).nbytes
                except CorruptEntry as e:
                    self.drop_bad(0, key, e)
        for i in range(1, len(self.tiers)):
            tier = self.tiers[i]
            try:
                raw = tier.read(key)
            except KeyError:
                continue
            except Exception as e:  # a tier failing: try the next one
                self.account.failed(tier, "reading", key, e)
                continue
            nbytes = memoryview(raw).nbytes
            if not fits(nbytes):
                return "declined", nbytes
            try:
                info = decode(raw, self.namespace, key, self.signing_key)[0]
            except CorruptEntry as e:
                self.drop_bad(i, key, e)
                continue
            try:
                stored = background.write(writer.store, 0, key, info.parent, [raw], True).result()
            except RuntimeError:  # the store closed meanwhile (its writer shut down)
                return "refused", nbytes
            if stored:
                self.account.tier(self.tiers[0].name).promotions += 1
            return ("copied" if stored else "refused"), nbytes
        return "absent", 0


class EntryRead:
    """An entry being read in place from tier ``index`` of ``reads`` (``tier``: its identity), a part at a time
    (``TieredStore.read_layers``). Runs on the thread that calls ``step``: a read thread,
    or a load's own thread for a local tier; it blocks on that part's I/O (a shared
    tier's read: within the tier's deadline)."""

    def __init__(self, reads: Reads, index: int, key: str, read: PartRead, writers: BlockWriters, keep: bool) -> None:
        self.reads, self.index, self.key, self.read, self.writers = reads, index, key, read, writers
        self.tier: TierId = reads.tiers[index].id  # the tier it is read from
        self.keep = keep
        self.seconds = 0.0  # time spent reading, for the tier's statistics

    @property
    def remote(self) -> bool:
        return self.tier.shared

    def use(self, reader, whole: bool):
        """Inside the tier's ``read_with``: open the entry (the first call) or check it is
        still the same, then read the next part (``whole``: every part left). A local
        file is read straight into the buffers while ``writers`` admits it; a shared-tier
        entry through ``Staged`` (a piece at a time); one a transport read whole
        (Curvine's SDK) all at once. The whole entry when ``keep`` or read whole."""
        staged = Staged(reader, self.writers, self.keep) if self.remote else None
        if staged is None and not self.writers.enter():
            raise LoadEnded()
        try:
            reader = staged or reader
            if self.read.info is None:
                self.read.open(reader)
            else:
                self.read.same_entry(reader)
            whole = whole or (staged is not None and staged.in_memory)  # read whole already: use it all
            while not self.read.done:
                self.read.read_part(reader, rest=whole)
                if not whole:
                    break
        finally:
            if staged is None:
                self.writers.leave()
        if staged is None:
            return None
        return staged.reader.data if staged.in_memory else staged.entry()

    def step(self) -> bool:
        """Read the next part; False when the entry could not be read (gone, damaged,
        replaced, or the tier failed: counted, and the chunk's event sent). Once
        ``read.done`` the entry is whole and verified, and counted as a hit. Raises
        ``LoadEnded``."""
        reads, tier = self.reads, self.reads.tiers[self.index]
        t0 = time.perf_counter()
        try:
            raw = tier.read_with(self.key, lambda reader: self.use(reader, False))
        except LoadEnded:
            raise
        except KeyError:
            reads.account.note(self.key, "missing", "none")
            return False
        except CorruptEntry as e:
            reads.drop_bad(self.index, self.key, e)
            return False
        except Exception as e:  # a tier failing must not fail the request
            reads.account.failed(tier, "reading", self.key, e)
            return False
        self.seconds += time.perf_counter() - t0
        if self.read.done:
            reads.hit(self.index, self.key, self.read.info, self.seconds, raw, True)
        return True
