"""The narrow protocol every tier implements.

A tier stores opaque, already-encoded entries (``cache.codec``) under hex chunk keys,
inside one namespace. It knows nothing of tensors, policies or other tiers: the
``TieredStore`` decides what goes where.

Where tier methods run and what may block:
- ``contains`` is called on the vLLM scheduler's lookup path: it must be cheap (a stat,
  a dict lookup) and may be stale; a tier that cannot answer quickly (the shared one)
  answers from what it last saw and learns in the background.
- ``read``, ``write``, ``delete``, ``reserve`` may block (disk, network): the store calls
  them from its I/O threads, never from the scheduler loop.
- Entries may be written or removed by other processes at any time: ``read`` of a key
  that ``contains`` reported may raise ``KeyError``.
- Capacity is a hard bound in bytes, kept by ``reserve``/``release`` *before* a write:
  a tier never holds more than ``capacity`` bytes. ``capacity`` None means the
  backend manages its own space (Curvine quotas and TTLs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence, TypeVar

from cache.tiers.identity import Locality, Medium, TierId

if TYPE_CHECKING:
    from typing_extensions import Buffer  # (collections.abc.Buffer from Python 3.12)

    from cache.placed import Reader
else:
    Buffer = object  # bytes, bytearray, memoryview, numpy array: anything with the buffer protocol

T = TypeVar("T")


class Tier(ABC):
    name: str = "tier"
    capacity: Optional[int] = None
    # True for a tier shared by many nodes (L3): write-once, never evicted by us, and
    # ``contains`` answers from memory (see ``probe``).
    shared: bool = False
    # What holds the bytes (``cache.tiers.identity``); a tier in host memory says CPU.
    medium: Medium = Medium.STORAGE

    @property
    def id(self) -> TierId:
        """The tier's identity: name, medium, locality (``cache.tiers.identity``)."""
        return TierId(self.name, self.medium, Locality.REMOTE if self.shared else Locality.LOCAL)

    @property
    def up(self) -> bool:
        """Whether the tier answers now: the shared tier says no while its circuit breaker is
        open (the scheduler's explanations read it); local tiers are always up."""
        return True

    @property
    def available(self) -> bool:
        """Whether a write handed to the tier now may succeed. A shared tier says no
        while it is down and its next retry is not due, so the store skips the write
        without queueing it; local tiers are always available."""
        return True

    def probe(self, keys: Sequence[str]) -> bool:
        """Start background existence checks for the chain ``keys``; True while some are
        still unanswered. Local tiers answer ``contains`` directly: nothing to wait for."""
        return False

    def knows_contents(self) -> bool:
        """Whether ``contains`` covers the whole tier yet. Local tiers always do; a shared
        tier only after its first background listing (a restart reads it: ``cache.vllm.events``)."""
        return True

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether ``key`` is (probably) present. Cheap; may be stale."""

    @abstractmethod
    def read(self, key: str) -> Buffer:
        """The whole encoded entry. Raises ``KeyError`` when absent."""

    # Whether ``read_with`` works: entries can be read piece by piece into the caller's
    # buffers (files, local or remote). Otherwise the store uses ``read``.
    reads_in_place: bool = False

    def read_with(self, key: str, use: Callable[["Reader"], T]) -> T:
        """``use(reader)``, a ``cache.placed.Reader`` over ``key``'s entry (opened for
        the call and closed after it). Raises ``KeyError`` when absent."""
        raise NotImplementedError(f"the {self.name} tier does not read entries in place")

    @abstractmethod
    def write(self, key: str, parts: Sequence[Buffer], nbytes: int) -> bool:
        """Publish ``parts`` (concatenated) as ``key``, atomically: readers see the whole
        entry or nothing. ``nbytes`` must already be reserved; the reservation is kept
        when the write publishes and released when it does not (key already present,
        or an error). Returns whether this call published the entry; a failure (no
        space, read-only, I/O error, tier down) raises, and the store counts its cause."""

    @abstractmethod
    def delete(self, key: str) -> int:
        """Remove ``key``; returns the bytes freed (0 if it was already gone)."""

    @abstractmethod
    def reserve(self, nbytes: int, key: Optional[str] = None) -> bool:
        """Claim ``nbytes`` of capacity for a coming write (of ``key``, when given: the
        tier may tie the claim to it); False when it does not fit."""

    @abstractmethod
    def release(self, nbytes: int) -> None:
        """Give back a reservation that was not used."""

    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes held, reservations included."""

    @abstractmethod
    def scan(self) -> Iterator[tuple[str, int]]:
        """Every entry present now, as ``(key, size)``; also fixes the usage count and
        removes leftovers (unfinished temporary files). Called at start-up and when the
        policy runs out of known victims (another process filled the tier)."""

    def recheck(self, keys: Sequence[str]) -> None:
        """``keys`` were just stored by this engine: a shared tier forgets that it found
        them absent, so the next ``probe`` asks again. Local tiers: nothing to do."""

    def reject(self, key: str) -> None:
        """``key`` failed to load from this tier; a shared tier stops offering it for a
        while. Local tiers delete bad entries instead: nothing to do."""

    def close(self) -> None:
        """Release resources; default nothing."""
