"""Scheduler side: which stored tail chunks a longer prompt may continue from.

Runs in vLLM's engine-core process, in the scheduler loop: memory only, nothing blocks.

A prompt is cut into whole chunks and one partial *tail* chunk keyed by exactly its tokens
(``cache.keys.prompt_chunks``). The next turn of a conversation repeats the previous
prompt and adds to it, so at the old tail's place it has a whole chunk with another key:
by its own cut it finds only the old prompt's whole chunks and recomputes the old tail,
half a chunk on average, although that tail is stored. This index remembers each tail
sent to be saved: its length, under the key of the chunk before it and a hash of its
first ``ID_TOKENS`` tokens. A lookup whose next whole chunk is missing asks it which
lengths to try there, names each candidate as the chain names it (``keys.next_key``) and
asks the tiers, like any other key: a candidate whose entry is gone, or that another
prompt with the same first tokens left (its key hashes other tokens), simply misses. The
index gives lengths, never KV, and a request's key folds in its own salt, so one tenant's
candidates cannot load another's entries.

A candidate whose save is still in flight defers the request like any chunk in flight
(``cache.vllm.saves``: until it settles, ``SAVE_WAIT_MAX_S`` at most): a turn sent right
after the last one's answer finds the tail stored, not half a chunk to compute again.

Only what this engine saved since it started is indexed: another engine's tails, and
tails saved before a restart, serve only the same prompt again (as before).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional, Sequence

from cache.keys import next_key
from cache.tiers.identity import TierId

# Tokens of a tail that identify it beside its parent (shorter tails are not indexed:
# continuing one would save fewer tokens of compute than a lookup costs).
ID_TOKENS = 16
# Places remembered (least recently noted dropped first), and lengths kept per place.
MAX_PLACES = 32768
LENGTHS_PER_PLACE = 4


class TailIndex:
    """Tail lengths by place (parent key, first tokens), most recent first."""

    def __init__(self, chunk_tokens: int, max_places: int = MAX_PLACES) -> None:
        self.chunk_tokens, self.max_places = chunk_tokens, max_places
        self._places: OrderedDict[tuple[str, int], list[int]] = OrderedDict()

    @staticmethod
    def _place(parent: Optional[str], tokens: Sequence[int]) -> tuple[str, int]:
        return parent or "", hash(tuple(int(t) for t in tokens[:ID_TOKENS]))

    def note(self, parent: Optional[str], tokens: Sequence[int]) -> None:
        """A tail chunk holding ``tokens`` after chunk ``parent`` is (being) stored."""
        n = len(tokens)
        if not ID_TOKENS <= n < self.chunk_tokens:
            return
        place = self._place(parent, tokens)
        lengths = self._places.pop(place, [])
        self._places[place] = [n] + [x for x in lengths if x != n][: LENGTHS_PER_PLACE - 1]
        while len(self._places) > self.max_places:
            self._places.popitem(last=False)

    def lengths(self, parent: Optional[str], tokens: Sequence[int]) -> list[int]:
        """Lengths of the tails noted at the place of a chunk starting with ``tokens``
        after ``parent``, longest first; only those shorter than ``tokens``."""
        if len(tokens) < ID_TOKENS:
            return []
        found = self._places.get(self._place(parent, tokens), ())
        return sorted((n for n in found if n < len(tokens)), reverse=True)

    def find(
        self,
        views: Sequence,
        chain: bytes,
        parent: Optional[str],
        tokens: Sequence[int],
        start: int,
        computed: int,
        salt: str,
        saving: Callable[[str], bool] = lambda key: False,
    ) -> Optional[tuple[str, int, Optional[TierId]]]:
        """The longest tail noted at the place of the chunk holding ``tokens`` from token
        ``start`` (after ``parent``; keyed with the request's ``salt``) that every rank's
        lookup ``views`` hold: its key, where it ends, and the slowest tier holding it.
        None when there is none, or it would serve nothing past ``computed`` tokens. A
        longer one still being saved (``saving(key)``) comes first, with no tier: the
        caller may wait for it, as for any chunk in flight."""
        for n in self.lengths(parent, tokens):
            if start + n <= computed:
                break
            key = next_key(chain, parent, tokens[:n], salt)
            if saving(key):
                return key, start + n, None
            found = [v.lookup([key]) for v in views]
            if all(found):
                return key, start + n, max(f[0] for f in found)
        return None
