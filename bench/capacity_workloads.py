"""The capacity benchmark's simulated users: what each one sends, turn after turn.

Pure Python, no I/O, no vLLM: runs in the benchmark's client process (and in unit tests).
A user runs sessions one after another; a session is a list of ``Turn``s, each the whole
prompt the client sends (token ids of the byte-level check model, 0-255), the answer
length it asks for and the think time before its next turn. Every random choice comes
from one ``random.Random`` seeded per user, so a run is reproducible and two
configurations see exactly the same traffic.

Workloads (sizes in tokens):

- ``chat``: a system prompt shared by every user (1,000), then 5-8 turns of 300-600 new
  tokens each; answers of 16-32; think time 6 s. Turn k's prompt is turn k-1's prompt,
  its answer and the new message.
- ``rag``: one question per session: a shared system prompt (300), one document drawn
  Zipf (s = 1.1) from a pool of 64 of 800-1,600, and a new question of 40-120; answers
  16-32; think time 3 s.
- ``agent``: a long prefix shared by every user (tools and instructions, 3,000), then 8-14
  short turns (tool results of 40-160); answers 16-32; think time 1 s.

The answer the client sends back in the next turn's prompt is a stand-in of the answer's
length drawn by the client: the random-weight model's bytes do not survive a round trip
through text, so the real answer's token ids are not known to the client. vLLM's own
prefix cache therefore hits up to the previous prompt, not through the answer, in every
configuration alike.
"""

from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import dataclass, field
from typing import Iterator

VOCAB = 256  # byte tokens of the check model (BOS/EOS lie above and are never sent)


@dataclass(frozen=True)
class Turn:
    """One request: the whole prompt, the answer length asked for, the pause after it."""

    prompt: tuple[int, ...]
    answer_tokens: int
    think_s: float
    session: str  # "<workload>-<user>-<session>": one id per conversation


@dataclass(frozen=True)
class Workload:
    """A workload's knobs; ``sessions`` builds a user's endless stream of sessions."""

    name: str
    shared_tokens: int  # system prompt / agent prefix, shared by all users
    turns: tuple[int, int]  # turns per session (inclusive)
    new_tokens: tuple[int, int]  # new tokens per turn (inclusive)
    answer_tokens: tuple[int, int] = (16, 32)
    think_s: float = 6.0
    docs: int = 0  # rag: pool size (0: not a RAG workload)
    doc_tokens: tuple[int, int] = (800, 1600)
    zipf_s: float = 1.1
    seed: int = 0
    _pool: list = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("turns", "new_tokens", "answer_tokens", "doc_tokens"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"workload {self.name}: {name} must be 0 < low <= high, got {(lo, hi)}")
        if self.think_s < 0 or self.shared_tokens < 0 or self.docs < 0:
            raise ValueError(f"workload {self.name}: think time, shared tokens and docs must be >= 0")
        rng = random.Random(f"{self.name}/{self.seed}/shared")
        self._pool.append(_tokens(rng, self.shared_tokens))
        for _ in range(self.docs):
            self._pool.append(_tokens(rng, rng.randint(*self.doc_tokens)))

    @property
    def shared(self) -> tuple[int, ...]:
        return self._pool[0]

    @property
    def documents(self) -> list[tuple[int, ...]]:
        return self._pool[1:]

    def max_prompt_tokens(self) -> int:
        """The longest prompt any session can send (for ``--max-model-len``)."""
        if self.docs:
            return self.shared_tokens + self.doc_tokens[1] + self.new_tokens[1]
        return self.shared_tokens + self.turns[1] * (self.new_tokens[1] + self.answer_tokens[1])

    def sessions(self, user: int, salt: str = "") -> Iterator[list[Turn]]:
        """User ``user``'s sessions, one after another, forever; ``salt`` makes a sweep
        point's conversations distinct from another point's (shared parts stay shared)."""
        rng = random.Random(f"{self.name}/{self.seed}/{salt}/user{user}")
        weights = _zipf_cdf(self.docs, self.zipf_s) if self.docs else None
        for n in itertools.count():
            sid = f"{self.name}-{salt}{user}-{n}"
            if weights:
                doc = self.documents[bisect.bisect_left(weights, rng.random() * weights[-1])]
                prompt = self.shared + doc + _tokens(rng, rng.randint(*self.new_tokens))
                yield [Turn(prompt, rng.randint(*self.answer_tokens), self.think_s, sid)]
                continue
            context, session = self.shared, []
            for _ in range(rng.randint(*self.turns)):
                context = context + _tokens(rng, rng.randint(*self.new_tokens))
                answer = rng.randint(*self.answer_tokens)
                session.append(Turn(context, answer, self.think_s, sid))
                context = context + _tokens(rng, answer)  # the answer's stand-in
            yield session


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB) for _ in range(n))


def _zipf_cdf(n: int, s: float) -> list[float]:
    """Cumulative Zipf weights of ranks 1..n (rank 1 the most popular)."""
    return list(itertools.accumulate(1.0 / (k**s) for k in range(1, n + 1)))


WORKLOADS = {
    "chat": dict(shared_tokens=1000, turns=(5, 8), new_tokens=(300, 600), think_s=6.0),
    "rag": dict(shared_tokens=300, turns=(1, 1), new_tokens=(40, 120), think_s=3.0, docs=64),
    "agent": dict(shared_tokens=3000, turns=(8, 14), new_tokens=(40, 160), think_s=1.0),
}


def workload(name: str, think_s: float | None = None, seed: int = 0) -> Workload:
    """The named workload, its think time replaced when ``think_s`` is given."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    knobs = dict(WORKLOADS[name])
    if think_s is not None:
        knobs["think_s"] = think_s
    return Workload(name=name, seed=seed, **knobs)
