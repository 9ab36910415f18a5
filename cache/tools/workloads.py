"""Seeded synthetic workloads in the Mooncake trace format, for the replay tool, the policy
bench and the tests (``python -m cache.tools.replay --workload NAME``).

Runs offline, on the CPU; pure Python, deterministic for a given seed and scale. Every
generator builds prompts as sequences of *content labels* (a system prompt's blocks, a
document's blocks, a turn's new text) and numbers their 512-token blocks through one
prefix tree, so two requests share a block id exactly when they share every block up to
it, as Mooncake ``hash_ids`` do. A prompt's last block is partial (``input_length`` is
not a multiple of 512). ``scale`` multiplies the number of requests and every pool
(sessions, documents, hot prefixes) together, so a fraction of the distinct blocks means
about the same cache at every scale; ``scale=1`` is the bench's size (10-12 thousand
requests), the tests use about a tenth.

The workloads (``WORKLOADS``):

- ``chat``: multi-turn conversations. Sessions arrive as a Poisson process; each turn's
  prompt is the previous prompt (all but its partial last block) plus the answer and the
  next question. Calibrated on the statistics of Mooncake's public conversation trace
  (FAST'25 release): 1 shared system block, 1.6 turns per session (69 % one turn, a
  heavy tail past 15), first prompts of median 11 / mean 21 blocks, 2 / 7 new blocks a
  turn, think times of median 2 minutes with a long tail (p90 8 minutes).
- ``chat-agent``: the same generator with long sessions and short think times (an agent
  or coding assistant: 6 turns a session on average, median think time 15 s) and
  fewer concurrent sessions.
- ``rag``: a shared system prompt, one to three documents drawn from a pool with Zipf
  popularity (in retrieval order), and a unique question.
- ``system-prompt``: a few shared system prompts (Zipf over them) followed by long
  one-off user suffixes: most blocks are never reused, the valuable ones always are.
- ``scan``: a hot set of prefixes reused with Zipf popularity, with long one-off documents
  (scans of 64-256 blocks) mixed in as one request in ten.
- ``shift``: RAG over a Zipf-popular pool whose popularity ranks are reshuffled half-way:
  the old favourites go cold at once.
"""

from __future__ import annotations

import math
import random
from typing import Callable, Dict, Hashable, List, Sequence, Tuple

from cache.tools.trace import BLOCK_TOKENS, Request


class PrefixTree:
    """Block ids for label sequences: equal label prefixes get equal ids."""

    def __init__(self) -> None:
        self._ids: Dict[Tuple[int, Hashable], int] = {}

    def ids(self, labels: Sequence[Hashable]) -> Tuple[int, ...]:
        out, parent, table = [], -1, self._ids
        for label in labels:
            node = table.get((parent, label))
            if node is None:
                node = table[(parent, label)] = len(table)
            out.append(node)
            parent = node
        return tuple(out)


def lognormal_blocks(rng: random.Random, median: float, mean: float, cap: int = 256) -> int:
    """A positive block count, log-normal with the given median and mean, at most ``cap``."""
    sigma = math.sqrt(2 * math.log(mean / median)) if mean > median else 0.0
    return max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))


def zipf_weights(n: int, s: float) -> List[float]:
    return [1.0 / (i + 1) ** s for i in range(n)]


Labelled = List[Tuple[float, List[Hashable]]]  # (arrival ms, content labels) per request


def _number(rng: random.Random, labelled: Labelled) -> List[Request]:
    """Requests from label sequences, numbered through one prefix tree; each prompt's last
    block is partial (1-512 tokens)."""
    tree = PrefixTree()
    out = []
    for ms, labels in labelled:
        ids = tree.ids(labels)
        out.append(Request(round(ms, 3), BLOCK_TOKENS * (len(ids) - 1) + rng.randint(1, BLOCK_TOKENS), ids))
    return out


class _Labels:
    """Fresh labels for content seen once (a question, a turn's new text)."""

    def __init__(self) -> None:
        self.n = 0

    def fresh(self, k: int) -> List[Hashable]:
        self.n += k
        return [("u", i) for i in range(self.n - k, self.n)]


def chat(
    seed: int = 0,
    scale: float = 1.0,
    *,
    sessions: int = 7400,
    sessions_per_s: float = 2.1,
    first_continue: float = 0.31,
    max_continue: float = 0.7,
    think_s: float = 98.0,
    min_think_s: float = 25.0,
    system_blocks: int = 1,
    first_blocks: Tuple[float, float] = (11, 21),
    turn_blocks: Tuple[float, float] = (2, 4),
    branch: float = 0.18,
    max_blocks: int = 256,
) -> List[Request]:
    """Multi-turn conversations (defaults: calibrated on Mooncake's conversation trace).

    ``sessions`` arrive at ``sessions_per_s`` (Poisson). After turn *t* a session goes on
    with probability ``max_continue - (max_continue - first_continue) * 0.6**(t-1)``
    (users who stayed once tend to stay), after a log-normal think time of median
    ``think_s`` (sigma 1.1). Block counts are log-normal ``(median, mean)``: the first
    prompt's after the system prompt, and each later turn's new blocks (answer and
    question); a prompt never grows past ``max_blocks``.
    """
    rng = random.Random(seed)
    text = _Labels()
    system = [("system", j) for j in range(system_blocks)]
    out: Labelled = []
    start = 0.0
    for _ in range(max(1, round(sessions * scale))):
        start += rng.expovariate(sessions_per_s * scale) * 1000
        labels = system + text.fresh(lognormal_blocks(rng, *first_blocks, cap=max_blocks))
        at, turn, history = start, 1, []
        pace = think_s * rng.lognormvariate(0.0, 0.72)  # a user's own pace
        while True:
            out.append((at, labels))
            history.append(labels)
            p = max_continue - (max_continue - first_continue) * 0.6 ** (turn - 1)
            if rng.random() >= p:
                break
            turn += 1
            at += (min_think_s + pace * rng.lognormvariate(0.0, 1.08)) * 1000
            if rng.random() < branch:
                labels = rng.choice(history)  # edit or regenerate an earlier turn
            room = max_blocks - (len(labels) - 1)
            if room < 1:
                break
            labels = labels[:-1] + text.fresh(min(room, lognormal_blocks(rng, *turn_blocks)))
    out.sort(key=lambda r: r[0])
    return _number(rng, out)


def chat_agent(seed: int = 0, scale: float = 1.0) -> List[Request]:
    """Long sessions, short think times, fewer sessions: 6 turns on average, 15 s."""
    return chat(
        seed,
        scale,
        sessions=1800,
        sessions_per_s=0.5,
        first_continue=0.8,
        max_continue=0.85,
        think_s=15.0,
        first_blocks=(8, 16),
        turn_blocks=(2, 4),
    )


def _zipf_pool(
    rng: random.Random,
    n: int,
    pool: int,
    s: float,
    prefix: Callable[[int], List[Hashable]],
    tail: Callable[[], List[Hashable]],
    shift_at: int = -1,
    per_s: float = 3.0,
) -> Labelled:
    """``n`` requests arriving at ``per_s`` (Poisson): ``prefix(item)`` for an item drawn
    Zipf(``s``) from ``pool``, then ``tail()``. At request ``shift_at`` the popularity
    ranks are reshuffled."""
    rank = list(range(pool))
    rng.shuffle(rank)
    weights = zipf_weights(pool, s)
    cum = [0.0]
    for w in weights:
        cum.append(cum[-1] + w)
    out, at = [], 0.0
    for i in range(n):
        if i == shift_at:
            rng.shuffle(rank)
        at += rng.expovariate(per_s) * 1000
        item = rank[_draw(rng, cum)]
        out.append((at, prefix(item) + tail()))
    return out


def _draw(rng: random.Random, cum: List[float]) -> int:
    """Index drawn in proportion to the weights whose running sums are ``cum``."""
    x = rng.random() * cum[-1]
    lo, hi = 0, len(cum) - 2
    while lo < hi:
        mid = (lo + hi) // 2
        if cum[mid + 1] <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def rag(
    seed: int = 0,
    scale: float = 1.0,
    *,
    requests: int = 10000,
    docs: int = 3000,
    s: float = 0.9,
    doc_blocks: Tuple[float, float] = (6, 9),
    system_blocks: int = 2,
    question_blocks: Tuple[float, float] = (1, 1.5),
) -> List[Request]:
    """System prompt + 1-3 documents drawn Zipf(``s``) from ``docs`` (the first document
    fixes the ones after it: a retriever returns the same neighbours for the same top
    hit) + a unique question."""
    rng = random.Random(seed)
    n_docs = max(3, round(docs * scale))
    length = [lognormal_blocks(rng, *doc_blocks) for _ in range(n_docs)]
    follow = [[rng.randrange(n_docs) for _ in range(rng.randint(0, 2))] for _ in range(n_docs)]
    text = _Labels()
    system = [("system", j) for j in range(system_blocks)]

    def prefix(d: int) -> List[Hashable]:
        out: List[Hashable] = list(system)
        for doc in [d] + follow[d]:
            out += [("doc", doc, j) for j in range(length[doc])]
        return out

    return _number(
        rng,
        _zipf_pool(
            rng, round(requests * scale), n_docs, s, prefix, lambda: text.fresh(lognormal_blocks(rng, *question_blocks))
        ),
    )


def system_prompt(
    seed: int = 0,
    scale: float = 1.0,
    *,
    requests: int = 10000,
    prompts: int = 6,
    s: float = 1.0,
    prompt_blocks: Tuple[float, float] = (8, 12),
    suffix_blocks: Tuple[float, float] = (6, 12),
) -> List[Request]:
    """A few shared system prompts (Zipf over ``prompts``) + a long one-off suffix."""
    rng = random.Random(seed)
    length = [lognormal_blocks(rng, *prompt_blocks) for _ in range(prompts)]
    text = _Labels()
    return _number(
        rng,
        _zipf_pool(
            rng,
            round(requests * scale),
            prompts,
            s,
            lambda p: [("prompt", p, j) for j in range(length[p])],
            lambda: text.fresh(lognormal_blocks(rng, *suffix_blocks)),
        ),
    )


def scan(
    seed: int = 0,
    scale: float = 1.0,
    *,
    requests: int = 10000,
    hot: int = 400,
    s: float = 0.7,
    hot_blocks: Tuple[float, float] = (8, 10),
    scan_share: float = 0.1,
    scan_blocks: Tuple[int, int] = (64, 256),
) -> List[Request]:
    """A hot set of ``hot`` prefixes (Zipf(``s``)) + a unique question; one request in
    ``1/scan_share`` is instead a one-off document of 64-256 blocks (a scan)."""
    rng = random.Random(seed)
    n_hot = max(2, round(hot * scale))
    length = [lognormal_blocks(rng, *hot_blocks) for _ in range(n_hot)]
    text = _Labels()
    labelled = _zipf_pool(
        rng,
        round(requests * scale),
        n_hot,
        s,
        lambda h: [("hot", h, j) for j in range(length[h])],
        lambda: text.fresh(1),
    )
    for i, (at, _) in enumerate(labelled):
        if rng.random() < scan_share:
            labelled[i] = (at, text.fresh(rng.randint(*scan_blocks)))
    return _number(rng, labelled)


def shift(
    seed: int = 0,
    scale: float = 1.0,
    *,
    requests: int = 10000,
    docs: int = 1500,
    s: float = 1.0,
    doc_blocks: Tuple[float, float] = (8, 12),
) -> List[Request]:
    """System prompt + one document, Zipf(``s``) popular; the ranks are reshuffled at the
    half-way request, so yesterday's hot documents are cold from then on."""
    rng = random.Random(seed)
    n_docs = max(2, round(docs * scale))
    length = [lognormal_blocks(rng, *doc_blocks) for _ in range(n_docs)]
    text = _Labels()
    n = round(requests * scale)
    return _number(
        rng,
        _zipf_pool(
            rng,
            n,
            n_docs,
            s,
            lambda d: [("system", 0)] + [("doc", d, j) for j in range(length[d])],
            lambda: text.fresh(1),
            shift_at=n // 2,
        ),
    )


WORKLOADS: Dict[str, Callable[..., List[Request]]] = {
    "chat": chat,
    "chat-agent": chat_agent,
    "rag": rag,
    "system-prompt": system_prompt,
    "scan": scan,
    "shift": shift,
}


def generate(name: str, seed: int = 0, scale: float = 1.0) -> List[Request]:
    """The workload ``name`` (see ``WORKLOADS``) for ``seed`` at ``scale``."""
    try:
        make = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}") from None
    return make(seed, scale)
